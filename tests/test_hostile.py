"""One hostile node against the controller: whatever it sends on its own topics, the
controller keeps running, every tick ends with caps, and the honest GPUs stay within every
budget with the controller's belief above the truth.

The controller runs synchronously (`handle` and `step`, a manual clock); honest agents are
state machines that apply each command and report it, the hostile node publishes what
hypothesis draws: the attacks of the outside review (huge ticks, inverted limits, phantom
GPUs, other nodes' uuids, clocks an hour off, a last will) and arbitrary JSON.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.honest import GPUS, NODES, HonestNode, policy_dict
from support.hostile import HOSTILE, TOPICS, gpu_dict

from powerd.clock import ManualClock
from powerd.controller.build import build_controller
from powerd.controller.controller import Controller
from powerd.controller.overrides import BudgetOverride
from powerd.policy import parse_policy
from powerd.transport import MemoryBroker, Message
from powerd.wire import (
    NodeState,
    NodeStatus,
    encode,
)

TOL = 1e-6


huge = st.sampled_from([10**29, 2**63, 2**64 + 1, -1, 2**53, 2**53 - 1])
watts = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False, min_value=-1e6, max_value=1e6),
    st.sampled_from([0.0, 1e-9, 10_000.0, 10_000.1]),
)
others = st.sampled_from([u for n in NODES if n != HOSTILE for u in HonestNode(n).uuids])
wall_offset = st.sampled_from([0.0, 3600.0, -3600.0, 600.0, -300.0, 1e12])


@st.composite
def hostile_message(draw: st.DrawFn) -> tuple[str, bytes]:
    kind = draw(st.sampled_from(["telemetry", "ack", "status", "junk"]))
    topic = TOPICS.telemetry(HOSTILE) if kind != "junk" else TOPICS.ack(HOSTILE)
    attack = draw(st.integers(0, 7))
    if kind == "telemetry":
        topic = TOPICS.telemetry(HOSTILE)
        own = [f"GPU-{HOSTILE}-{i}" for i in range(GPUS)]
        if attack == 0:  # phantom GPUs
            gpus = [gpu_dict(f"phantom-{i}", i % 64) for i in range(draw(st.integers(5, 64)))]
        elif attack == 1:  # another node's GPU
            gpus = [gpu_dict(draw(others), 0, cap_w=200.0)]
        elif attack == 2:  # inverted or odd limits
            gpus = [gpu_dict(own[0], 0, min_cap_w=draw(watts), max_cap_w=draw(watts))]
        else:
            # `set_w` too: the controller counts a GPU at no less than it (a lower limit
            # another holds may lift to it), so a huge one may cost only the sender's room.
            gpus = [
                gpu_dict(
                    u, i, cap_w=draw(watts), power_w=draw(watts),
                    set_w=draw(st.one_of(st.none(), watts)),
                )
                for i, u in enumerate(own)
            ]  # fmt: skip
        payload: Any = {
            "v": 1,
            "node_id": HOSTILE,
            "ts": 1.7e9 + draw(wall_offset),
            "seq": draw(st.one_of(st.integers(0, 10), huge)),
            "period_s": 1.0,
            "gpus": gpus,
            "tick": draw(st.one_of(st.none(), st.integers(0, 5000), huge)),
        }
    elif kind == "ack":
        topic = TOPICS.ack(HOSTILE)
        payload = {
            "v": 1,
            "node_id": HOSTILE,
            "tick": draw(st.one_of(st.integers(0, 5000), huge)),
            "gpus": {
                draw(st.one_of(others, st.just(f"GPU-{HOSTILE}-0"))): {
                    "requested_w": draw(watts),
                    "enforced_w": draw(watts),
                }
            },
            "ts": 1.7e9 + draw(wall_offset),
        }
    elif kind == "status":
        topic = TOPICS.status(HOSTILE)
        payload = {
            "v": 1,
            "node_id": HOSTILE,
            "state": draw(st.sampled_from(["starting", "steered", "failsafe", "offline"])),
            "last_tick": draw(st.one_of(st.none(), st.integers(0, 5000), huge)),
            "caps_w": {draw(others): draw(watts), f"GPU-{HOSTILE}-1": draw(watts)},
            "set_w": {draw(others): draw(watts), f"GPU-{HOSTILE}-0": draw(watts)},
        }
    else:
        payload = draw(
            st.recursive(
                st.one_of(st.none(), st.booleans(), st.integers(), st.text(max_size=5)),
                lambda inner: st.one_of(
                    st.lists(inner, max_size=3),
                    st.dictionaries(st.text(max_size=5), inner, max_size=3),
                ),
                max_leaves=8,
            )
        )
        if attack == 0:
            return topic, b"[" * 100_000  # nested past any parser's depth
        if attack == 1:
            return topic, bytes(draw(st.binary(max_size=64)))
    return topic, json.dumps(payload).encode()


def belief_check(c: Controller, honest: dict[str, HonestNode]) -> None:
    """The controller's committed cap bounds every honest GPU's cap in force."""
    layout = c.planner.layout
    if layout is None:
        return
    committed = c.planner.committed_w()
    for i, (u, node) in enumerate(zip(layout.uuids, layout.nodes, strict=True)):
        if node in honest:
            assert committed[i] >= honest[node].caps[u] - TOL, (u, committed[i])


def budget_check(c: Controller, honest: dict[str, HonestNode]) -> None:
    """Honest GPUs' true caps, with the hostile node at what the controller counts for it,
    fit every group, or every honest GPU under it is already at its minimum (a node that
    reports more than its budget costs its neighbours what it reports: see docs/safety.md)."""
    layout = c.planner.layout
    assert layout is not None
    topo = layout.topology
    committed = c.planner.committed_w()
    is_honest = np.array([node in honest for node in layout.nodes])
    true = np.array(
        [
            honest[node].caps[u] if node in honest else committed[i]
            for i, (u, node) in enumerate(zip(layout.uuids, layout.nodes, strict=True))
        ]
    )
    load = topo.group_sums(true) + topo.overhead_w
    above_min = topo.group_sums(np.where(is_honest, true - 200.0, 0.0))
    bad = np.flatnonzero((load > topo.budget_w + TOL) & (above_min > TOL))
    assert not len(bad), [topo.names[g] for g in bad]


SETTINGS = settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@pytest.mark.slow  # seconds of CPU: many runs of 12 ticks
@SETTINGS
@given(
    attacks=st.lists(st.lists(hostile_message(), max_size=4), min_size=12, max_size=12),
    order=st.randoms(use_true_random=False),
)
def test_a_hostile_node_cannot_stop_the_controller_or_breach_a_budget(
    attacks: list[list[tuple[str, bytes]]], order: Any
) -> None:
    clock = ManualClock(start=100.0)
    c = build_controller(parse_policy(policy_dict()), MemoryBroker().client("c"), clock)
    honest = {n: HonestNode(n) for n in NODES if n != HOSTILE}
    hostile = HonestNode(HOSTILE)  # starts honest: it is steered before it turns

    def deliver(topic: str, payload: bytes) -> None:
        c.handle(Message(topic, payload), clock.monotonic())  # must never raise

    for node in [hostile, *honest.values()]:
        deliver(
            TOPICS.status(node.name),
            encode(NodeStatus(node_id=node.name, state=NodeState.STARTING)),
        )
        deliver(TOPICS.telemetry(node.name), node.telemetry(clock.wall()))
    steered = 0
    for tick_attacks in [*attacks, [], [], [], []]:  # then four quiet ticks
        report, plan = c.step()  # must never raise
        assert plan.commands or plan.waiting_nodes, "a tick ended without caps"
        for cmd in plan.commands:
            node = honest.get(cmd.node)
            if node is not None:
                steered += 1
                ack = node.apply(cmd.to_wire(clock.wall()))
                belief_check(c, honest)
                if ack is not None:
                    deliver(TOPICS.ack(node.name), ack)
        events: list[tuple[str, bytes]] = list(tick_attacks)
        events += [(TOPICS.telemetry(n.name), n.telemetry(clock.wall())) for n in honest.values()]
        order.shuffle(events)
        for topic, payload in events:
            deliver(topic, payload)
            belief_check(c, honest)
        clock.advance(1.0)
    assert steered > 0
    # Four ticks after the last attack, the honest GPUs fit every budget beside it.
    budget_check(c, honest)
    # The hostile node reached only its own GPUs: an honest GPU is its node's, or (named by
    # the hostile node too) nobody's.
    for node in honest.values():
        for u in node.uuids:
            rec = c.fleet.gpus.get(u)
            assert rec.node == node.name if rec is not None else u in c.fleet.disputes
    assert len([g for g in c.fleet.gpus.values() if g.node == HOSTILE]) <= GPUS
    assert math.isfinite(float(report.group_committed_w[0]))


def test_a_tick_that_fails_still_ends_with_safe_caps_and_an_alarm() -> None:
    clock = ManualClock(start=100.0)
    c = build_controller(parse_policy(policy_dict()), MemoryBroker().client("c"), clock)
    nodes = {n: HonestNode(n) for n in NODES}

    def exchange(plan_commands: list[Any]) -> None:
        for cmd in plan_commands:
            ack = nodes[cmd.node].apply(cmd.to_wire(clock.wall()))
            if ack is not None:
                c.handle(Message(TOPICS.ack(cmd.node), ack), clock.monotonic())
        for n in nodes.values():
            c.handle(
                Message(TOPICS.telemetry(n.name), n.telemetry(clock.wall())),
                0.0 + clock.monotonic(),
            )
        clock.advance(1.0)

    exchange([])
    for _ in range(3):
        _, plan = c.step()
        exchange(plan.commands)
    steered = {u: w for n in nodes.values() for u, w in n.caps.items()}
    c.overrides.set_budget(
        c.policy, BudgetOverride("dc", 4000.0, None, "grid event", "test", clock.wall())
    )

    def broken(*_: Any) -> Any:
        raise RuntimeError("a fault inside the tick")

    c.engine.targets.class_indices = broken  # type: ignore[method-assign]
    report, plan = c.step()
    assert report.status == "tick_failed" and "tick_failed" in c.alarms
    assert {cmd.node for cmd in plan.commands} == set(NODES)  # every lease renewed
    exchange(plan.commands)
    _, plan = c.step()  # still failing: the cut is obeyed all the same
    exchange(plan.commands)
    total = sum(w for n in nodes.values() for w in n.caps.values())
    assert total + 0.0 <= 4000.0 + TOL
    assert any(n.caps[u] < steered[u] for n in nodes.values() for u in n.uuids)
    del c.engine.targets.class_indices  # the fault goes away: so does the alarm
    report, _ = c.step()
    assert report.status != "tick_failed" and "tick_failed" not in c.alarms


def test_unknown_gpus_above_their_nodes_budget_floor_only_that_node() -> None:
    """r2-n2's GPUs, disputed by one spoofed message, count at their maximum: 2,800 W in a
    2,400 W node. Only that node is infeasible; the rest of the site keeps steering. (The
    allocator once got the reserves already summed up the tree and added them up again:
    every GPU of the site went to its minimum, 3,200 W of a 7,000 W facility.)"""
    clock = ManualClock(start=100.0)
    c = build_controller(parse_policy(policy_dict()), MemoryBroker().client("c"), clock)
    nodes = {n: HonestNode(n) for n in NODES}

    def cycle(spoof: bool = False) -> None:
        if spoof:
            gpus = [gpu_dict(u, i) for i, u in enumerate(nodes["r2-n2"].uuids)]
            msg = {"v": 1, "node_id": "r1-n1", "ts": 0, "seq": 1, "period_s": 1, "gpus": gpus}
            c.handle(
                Message(TOPICS.telemetry("r1-n1"), json.dumps(msg).encode()), clock.monotonic()
            )
        for n in nodes.values():
            c.handle(
                Message(TOPICS.telemetry(n.name), n.telemetry(clock.wall())), clock.monotonic()
            )
        clock.advance(1.0)
        _, plan = c.step()
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply(cmd.to_wire(clock.wall()))
            if ack is not None:
                c.handle(Message(TOPICS.ack(cmd.node), ack), clock.monotonic())

    for _ in range(6):
        cycle()
    cycle(spoof=True)
    cycle()
    assert "infeasible_min" in c.alarms and set(nodes["r2-n2"].uuids) <= set(c.fleet.disputes)
    total = {n: sum(node.caps.values()) for n, node in nodes.items()}
    assert total["r1-n1"] > 1000.0 and total["r1-n2"] > 1000.0, total
