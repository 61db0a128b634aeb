"""The safety planner's whole-fleet entry points (`on_fleet_telemetry`, `on_fleet_acks`), as
the simulator's agents use them: on any sequence of messages they leave the planner exactly
as the same messages handed over node by node (`on_telemetry`, `on_ack`) do."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner import simple_fleet

from powerd.safety import AckedCaps, GpuLayout, SafetyPlanner

NODES = [3, 1, 2, 2]


def _state(planner: SafetyPlanner, tick: int, now: float) -> str:
    layout = planner.layout
    assert layout is not None
    plan = planner.plan(tick, now, np.full(layout.n_gpus, 300.0))
    # As text: NaN (no command) compares equal to NaN there.
    return repr(
        [
            planner.committed_w().tolist(),
            planner._low_w().tolist(),
            planner.defiant().tolist(),
            planner.settling().tolist(),
            planner.pending_since(np.arange(layout.n_gpus)).tolist(),
            planner._seen.tolist(),
            plan.sent_w.tolist(),
            [(c.node, c.caps_w) for c in plan.commands],
            [e.kind for e in plan.events],
        ]
    )


def _node_uuids(layout: GpuLayout) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for u, node in zip(layout.uuids, layout.nodes, strict=True):
        out.setdefault(node, []).append(u)
    return out


# One message batch: telemetry of every node (caps, tick per node, some NaN), or acks of
# some nodes (a tick each, obeyed or with a GPU left out), then a plan.
_caps = st.floats(100.0, 400.0)
_batch = st.tuples(
    st.sampled_from(["telemetry", "acks"]),
    st.lists(_caps, min_size=8, max_size=8),
    st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),  # node included / obeyed
    st.booleans(),  # a NaN reading somewhere (telemetry)
    st.one_of(st.none(), st.integers(0, 3)),  # a status of n0 first, of this tick
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_batch, min_size=1, max_size=8), st.booleans())
def test_fleet_messages_leave_the_planner_as_node_by_node_messages_do(
    batches: list[tuple[str, list[float], list[int | None], list[bool], bool, int | None]],
    settled: bool,
) -> None:
    policy, layout = simple_fleet(NODES, facility=2400.0)
    one, fleet = SafetyPlanner(policy, layout), SafetyPlanner(policy, layout)
    if settled:
        one.assume_settled()
        fleet.assume_settled()
    uuids = _node_uuids(layout)
    nodes = list(uuids)
    for step, (kind, caps, ticks, flags, nan, pre) in enumerate(batches):
        now = float(step)
        if pre is not None:
            # A message node by node just before the batch: the order of arrival holds.
            status = dict(zip(uuids["n0"], caps[::-1], strict=False))
            one.learn_status("n0", status, as_of_tick=pre)
            fleet.learn_status("n0", status, as_of_tick=pre)
        if kind == "telemetry":
            values = list(caps)
            if nan:
                values[step % len(values)] = float("nan")
            as_of = [None if t is None else t for t in ticks]
            a = 0
            for node, t in zip(nodes, as_of, strict=True):
                b = a + len(uuids[node])
                one.on_telemetry(node, (uuids[node], values[a:b]), received_at=now, as_of_tick=t)
                a = b
            cols = [uuids[node] for node in nodes]
            if not fleet.on_fleet_telemetry(nodes, cols, values, now, as_of):
                assert nan  # the batch is refused only where a reading is missing
                a = 0
                for node, t in zip(nodes, as_of, strict=True):
                    b = a + len(uuids[node])
                    fleet.on_telemetry(
                        node, (uuids[node], values[a:b]), received_at=now, as_of_tick=t
                    )
                    a = b
        else:
            acks = []
            a = 0
            for node, t, ok in zip(nodes, ticks, flags, strict=True):
                b = a + len(uuids[node])
                names = uuids[node] if ok else uuids[node][1:]  # a GPU left out
                got = caps[a : a + len(names)]
                acked = AckedCaps(names, got, list(got), [None] * len(names), True)
                acks.append((node, step % 4 if t is None else t, acked))
                a = b
            for node, t, acked in acks:
                one.on_ack(node, t, acked)
            fleet.on_fleet_acks(acks)
        tick = step + 1
        assert _state(one, 100 + tick, now) == _state(fleet, 100 + tick, now)


def test_fleet_telemetry_from_nodes_the_planner_does_not_know_is_refused() -> None:
    policy, layout = simple_fleet([1, 1])
    planner = SafetyPlanner(policy, layout)
    assert not planner.on_fleet_telemetry(["n0", "nx"], [["g0-0"], ["g1-0"]], [200, 200], 0, [1, 1])
    # Another GPU order than the planner's: refused, nothing queued.
    assert not planner.on_fleet_telemetry(["n0", "n1"], [["g0-0"], ["gx"]], [200, 200], 0, [1, 1])
    assert planner.committed_w().tolist() == [400.0, 400.0]
    assert planner.on_fleet_telemetry(["n0", "n1"], [["g0-0"], ["g1-0"]], [200, 300], 0, [1, 1])
    planner.assume_settled()
    assert planner.committed_w().tolist() == [200.0, 300.0]


# One round: targets for every GPU, the enforced limit's offset from each cap sent (a
# device clamps), and whether an older ack of one node arrives first.
_round = st.tuples(
    st.lists(st.floats(100.0, 400.0), min_size=8, max_size=8),
    st.lists(st.sampled_from([0.0, 0.0, -10.0, 5.0]), min_size=8, max_size=8),
    st.booleans(),
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_round, min_size=1, max_size=6), st.booleans())
def test_a_plan_acknowledged_as_one_block_leaves_the_planner_as_its_acks_do(
    rounds: list[tuple[list[float], list[float], bool]], settled: bool
) -> None:
    """`on_plan_acked(plan, enforced)` (the simulator's agents) = `on_fleet_acks` of the
    acks each command gets (`plan.acks`), even after a newer ack of a node came first."""
    policy, layout = simple_fleet(NODES, facility=2400.0)
    one, block = SafetyPlanner(policy, layout), SafetyPlanner(policy, layout)
    uuids = _node_uuids(layout)
    for p in (one, block):
        p.on_fleet_telemetry(list(uuids), list(uuids.values()), [250.0] * 8, 0.0, [None] * 4)
        if settled:
            p.assume_settled()
    for step, (targets, offsets, late) in enumerate(rounds):
        tick = 200 * (step + 1)
        now = float(step)
        plans = [p.plan(tick, now, np.array(targets)) for p in (one, block)]
        assert repr(plans[0].sent_w.tolist()) == repr(plans[1].sent_w.tolist())
        assert len(plans[0].commands) == len(NODES)  # every node heard: every node sent to
        if late and plans[0].commands:
            # A newer tick's ack of the first node commanded: this plan's ack of it is old.
            node = plans[0].commands[0].node
            for p, plan in zip((one, block), plans, strict=True):
                p.on_fleet_acks(plan.acks(plan.sent_w)[:1])
                p.on_fleet_acks([(node, tick + 1, plan.acks(plan.sent_w)[0][2])])
        for p, plan in zip((one, block), plans, strict=True):
            enforced = plan.sent_w + np.array(offsets)
            if p is one:
                p.on_fleet_acks(plan.acks(enforced))
            else:
                p.on_plan_acked(plan, enforced)
        assert _state(one, 100 + tick, now) == _state(block, 100 + tick, now)


def test_a_plan_of_another_layout_is_acknowledged_command_by_command() -> None:
    policy, layout = simple_fleet([1, 1])
    planner = SafetyPlanner(policy, layout)
    planner.on_fleet_telemetry(["n0", "n1"], [["g0-0"], ["g1-0"]], [250, 250], 0.0, [None] * 2)
    planner.assume_settled()
    plan = planner.plan(1, 0.0, np.array([200.0, 300.0]))
    assert [c.node for c in plan.commands] == ["n0", "n1"]
    _, other = simple_fleet([1, 1])
    planner.set_layout(other)  # the same GPUs, another layout object
    planner.on_plan_acked(plan, np.array([180.0, 300.0]))
    assert planner.committed_w().tolist() == [180.0, 300.0]
