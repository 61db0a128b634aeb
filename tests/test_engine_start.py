"""What a freshly built tick engine hears before its first tick: the broker's retained
statuses, telemetry and acks arrive before the engine knows any GPU (issue 27, finding 6).
None of them may raise, and the caps they carry must count from the first tick on."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.honest import GPUS, NODES, HonestNode, policy_dict

from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.wire import CapAck, GpuAck, NodeState, NodeStatus

TOL = 1e-6
MAX_W = 700.0  # every GPU of the honest site: 200-700 W
WALL0 = 1_700_000_000.0


def node_committed_w(report: TickReport, node: str) -> float:
    """A node's committed caps as the tick counted them, unknown GPUs' reserve included."""
    return float(report.group_committed_w[report.group_names.index(node)])


def stopped(node: HonestNode, caps_w: float) -> NodeStatus:
    """The status a cleanly stopping agent leaves retained: offline, with its caps."""
    node.caps = dict.fromkeys(node.uuids, caps_w)
    return NodeStatus(
        node_id=node.name,
        state=NodeState.OFFLINE,
        last_tick=node.last_tick,
        gpus=GPUS,
        caps_w=dict(node.caps),
    )


def test_a_fleet_stopped_at_failsafe_counts_at_its_caps_from_the_first_tick() -> None:
    """The lab's start: every agent stopped cleanly at its failsafe caps, the broker holds
    their `offline` statuses, no telemetry. The first tick counts the caps they left."""
    engine = TickEngine(parse_policy(policy_dict()))
    for name in NODES:
        assert engine.on_status(name, stopped(HonestNode(name), 200.0))
    report, plan = engine.step(0.0, WALL0)
    assert report.status != "tick_failed"
    assert not plan.commands  # nobody to command
    for name in NODES:
        assert node_committed_w(report, name) == GPUS * 200.0
    assert report.group_committed_w[0] == len(NODES) * GPUS * 200.0
    assert not report.group_over.any()
    assert set(engine.alarms.active) == {"nodes_offline"}
    assert "stopped, counted at the caps they left" in engine.alarms.active["nodes_offline"]


def test_a_last_will_counts_at_the_maximum_and_a_restart_ends_a_stop() -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    a, b = HonestNode(NODES[0]), HonestNode(NODES[1])
    engine.on_status(a.name, stopped(a, 250.0))
    engine.on_status(b.name, stopped(b, 250.0))
    # b's agent is killed after a restart: the will (no caps) replaces what it said.
    engine.on_status(b.name, NodeStatus(node_id=b.name, state=NodeState.OFFLINE))
    report, _ = engine.step(0.0, WALL0)
    assert node_committed_w(report, a.name) == GPUS * 250.0
    assert node_committed_w(report, b.name) == GPUS * MAX_W
    assert "maximum until they report: " + b.name in engine.alarms.active["nodes_offline"]
    # a starts again: its GPUs are steered, and counted, from its telemetry (at their
    # maximum until they acknowledge a command of ours).
    engine.on_status(a.name, NodeStatus(node_id=a.name, state=NodeState.STARTING, caps_w=a.caps))
    engine.on_telemetry(a.sample(WALL0 + 1), 1.0)
    report, plan = engine.step(1.0, WALL0 + 1)
    assert a.name in {cmd.node for cmd in plan.commands}
    assert node_committed_w(report, a.name) >= GPUS * 250.0 - TOL


# ---- every message kind, in any order, before the first tick --------------------------


@dataclass(frozen=True)
class Heard:
    kind: str  # telemetry | ack | status
    node: int
    state: NodeState = NodeState.STEERED
    with_caps: bool = True
    caps_w: float = 200.0
    tick: int = 1


HEARD = st.one_of(
    st.builds(Heard, kind=st.just("telemetry"), node=st.integers(0, len(NODES) - 1)),
    st.builds(
        Heard,
        kind=st.just("ack"),
        node=st.integers(0, len(NODES) - 1),
        caps_w=st.sampled_from([200.0, 350.0, 700.0]),
        tick=st.integers(1, 50),
    ),
    st.builds(
        Heard,
        kind=st.just("status"),
        node=st.integers(0, len(NODES) - 1),
        state=st.sampled_from(list(NodeState)),
        with_caps=st.booleans(),
        caps_w=st.sampled_from([200.0, 350.0, 700.0]),
        tick=st.integers(1, 50),
    ),
)


@dataclass
class Truth:
    """What the test knows of a node after the messages: the caps in force (None: unknown,
    a last will), whether its last word was a clean stop, and whether telemetry named it."""

    caps_w: float | None = 200.0
    stopped: bool = False
    seen: bool = False


def hear(engine: TickEngine, nodes: list[HonestNode], truth: list[Truth], m: Heard) -> None:
    node, t = nodes[m.node], truth[m.node]
    if m.kind == "telemetry":
        if t.caps_w is None:  # a will: the agent that reports again starts at failsafe
            node.caps = dict.fromkeys(node.uuids, 200.0)
        assert engine.on_telemetry(node.sample(WALL0), 0.0)
        t.caps_w, t.stopped, t.seen = next(iter(node.caps.values())), False, True
    elif m.kind == "ack":  # a predecessor's command, applied
        node.last_tick = max(node.last_tick or 0, m.tick)
        node.caps = dict.fromkeys(node.uuids, m.caps_w)
        gpus = {u: GpuAck(requested_w=m.caps_w, enforced_w=m.caps_w) for u in node.uuids}
        assert engine.on_ack(node.name, CapAck(node_id=node.name, tick=m.tick, gpus=gpus))
        t.caps_w, t.stopped = m.caps_w, False
    else:
        if m.with_caps:
            node.caps = dict.fromkeys(node.uuids, m.caps_w)
        status = NodeStatus(
            node_id=node.name,
            state=m.state,
            last_tick=m.tick,
            caps_w=dict(node.caps) if m.with_caps else {},
        )
        assert engine.on_status(node.name, status)
        t.stopped = m.state is NodeState.OFFLINE and m.with_caps
        if m.state is NodeState.OFFLINE:
            t.caps_w = m.caps_w if m.with_caps else None
        elif m.with_caps:
            t.caps_w = m.caps_w


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(HEARD, max_size=24))
def test_whatever_is_heard_before_the_first_tick_never_raises_and_counts(
    heard: list[Heard],
) -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    nodes = [HonestNode(n) for n in NODES]
    truth = [Truth() for _ in NODES]
    for m in heard:
        hear(engine, nodes, truth, m)  # raises nothing (the test fails if it does)
    report, _ = engine.step(0.0, WALL0)
    assert report.status != "tick_failed"
    assert "tick_failed" not in engine.alarms.active
    assert "message_failed" not in engine.alarms.active
    for node, t in zip(nodes, truth, strict=True):
        counted = node_committed_w(report, node.name)
        # Never below what may be in force (a will: anything up to the maximum).
        in_force = GPUS * (MAX_W if t.caps_w is None else t.caps_w)
        assert counted >= in_force - TOL, (node.name, t)
        if t.stopped and not t.seen:
            # The caps a stopped node left are learned from its status alone.
            assert counted == GPUS * t.caps_w, (node.name, t)
    # From there the engine steers the agents that run (those lost start again, at
    # failsafe) and keeps counting every node at no less than its caps in force.
    running = [n for n, t in zip(nodes, truth, strict=True) if not t.stopped]
    for node, t in zip(nodes, truth, strict=True):
        if t.caps_w is None:
            node.caps = dict.fromkeys(node.uuids, 200.0)
    for step in range(1, 8):
        now, wall = float(step), WALL0 + step
        for node in running:
            engine.on_telemetry(node.sample(wall), now)
        report, plan = engine.step(now, wall)
        assert report.status != "tick_failed"
        assert {cmd.node for cmd in plan.commands} <= {n.name for n in running}
        for cmd in plan.commands:
            node = nodes[NODES.index(cmd.node)]
            ack = node.apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                engine.on_ack(cmd.node, ack)
        for node in nodes:
            in_force = sum(node.caps.values())
            assert node_committed_w(report, node.name) >= in_force - TOL, node.name
    # Where the stopped nodes leave room for the others' minimums, the site fits its
    # budget once the cuts are acknowledged.
    facility_w = report.group_budget_w[0]
    floor_w = sum(sum(n.caps.values()) if n not in running else GPUS * 200.0 for n in nodes)
    if floor_w <= facility_w:
        assert sum(sum(n.caps.values()) for n in nodes) <= facility_w + TOL
