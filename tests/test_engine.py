"""The tick engine alone: decoded messages in, plans out, no broker, store or clock; and an
import of the pure core that loads no I/O library."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import pytest
from support.honest import GPUS, NODES, HonestNode, policy_dict
from test_layers import IO_LIBRARIES

from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.wire import NodeState, NodeStatus

TOL = 1e-6

PURE_CORE = (
    "powerd.controller.tick",
    "powerd.safety",
    "powerd.allocator",
    "powerd.policy",
    "powerd.wire",
)


@pytest.mark.process
def test_the_pure_core_imports_no_io_library() -> None:
    for module in PURE_CORE:
        code = (
            "import sys\n"
            f"import {module}\n"
            f"print(','.join(m for m in {IO_LIBRARIES!r} if m in sys.modules))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == "", f"importing {module} loads {out.stdout.strip()}"


def test_the_engine_alone_steers_every_gpu_within_every_budget() -> None:
    policy = parse_policy(policy_dict())
    engine = TickEngine(policy)
    nodes = {n: HonestNode(n) for n in NODES}
    wall0 = 1_700_000_000.0
    for t in range(8):
        now, wall = float(t), wall0 + t
        for node in nodes.values():
            assert engine.on_telemetry(node.sample(wall), now)
        report, plan = engine.step(now, wall)
        assert report.tick == plan.tick == engine.tick_no
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                assert engine.on_ack(cmd.node, ack)
        # What the devices enforce, plus overhead, fits every budget at every tick.
        topo = engine.shape.topology if engine.shape is not None else None
        assert topo is not None
        caps = np.array([nodes[n].caps[u] for u, n in zip(report.uuids, report.nodes, strict=True)])
        assert (topo.group_sums(caps) + topo.overhead_w <= report.group_budget_w + TOL).all()
        # The planner's bound is over only while it counts GPUs at their maximum for what a
        # predecessor may have sent (until the first acks of ours).
        assert not (plan.group_over & ~plan.group_settling).any()
    assert report.status == "optimal" and not report.group_over.any()
    assert (plan.group_committed_w <= report.group_budget_w + TOL).all()
    assert len(report.uuids) == GPUS * len(NODES)
    # The budget is shared out, not left at the failsafe caps: 7000 W for 16 GPUs.
    total = sum(w for n in nodes.values() for w in n.caps.values())
    assert 6000.0 < total <= 7000.0 + TOL
    assert engine.alarms.active == {}


def last_report(policy_data: dict[str, Any], ticks: int = 6) -> TickReport:
    engine = TickEngine(parse_policy(policy_data))
    nodes = {n: HonestNode(n) for n in NODES}
    reports = []
    for t in range(ticks):
        now, wall = float(t), 1_700_000_000.0 + t
        for node in nodes.values():
            assert engine.on_telemetry(node.sample(wall), now)
        report, plan = engine.step(now, wall)
        reports.append(report)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                engine.on_ack(cmd.node, ack)
    return reports[-1]


@pytest.mark.parametrize("leftover", ["peak", "max"])
def test_power_past_the_peak_is_reported_unused_unless_leftover_max(leftover: str) -> None:
    # Throughput stops rising at 400 W: 16 GPUs at their peak take 6,400 W of the 7,000.
    data = policy_dict()
    data["profiles"] = {"p": {"points": [[200, 0.4], [400, 1.0], [700, 1.0]]}}
    data["control"] = dict(data["control"]) | {"leftover": leftover}
    report = last_report(data)
    assert report.status == "optimal"
    if leftover == "peak":
        assert np.allclose(report.targets_w, 400.0, atol=TOL)
        assert report.unused_w == pytest.approx(7000.0 - 16 * 400.0, abs=TOL)
    else:  # handed out up to the budgets: the facility is full
        assert report.targets_w.sum() == pytest.approx(7000.0, abs=TOL)
        assert report.unused_w == pytest.approx(0.0, abs=TOL)


def test_alarms_are_data_the_owner_takes() -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    nodes = {n: HonestNode(n) for n in NODES}
    for node in nodes.values():
        engine.on_telemetry(node.sample(1.0), 0.0)
    engine.step(0.0, 1.0)
    engine.alarms.take()
    assert engine.on_status("r1-n1", NodeStatus(node_id="r1-n1", state=NodeState.OFFLINE, ts=2.0))
    assert not engine.on_status("nowhere", NodeStatus(node_id="nowhere", state=NodeState.OFFLINE))
    engine.step(1.0, 2.0)
    assert "r1-n1" in engine.alarms.active["nodes_offline"]
    changes = engine.alarms.take()
    assert {c.ts for c in changes} == {2.0}
    raised = {c.kind: c.message for c in changes}
    assert raised["nodes_offline"] == engine.alarms.active["nodes_offline"]
    assert engine.alarms.take() == []


def test_a_standby_that_heard_the_leader_commands_every_node_on_its_first_tick() -> None:
    """Two engines hear the same messages; only the leader steps. The standby keeps its
    view with `observe`, and its first tick after taking over sends every node a command
    (the caps in force are known: nobody waits) that holds or lowers every cap (what the
    leader may still send counts until an ack of the standby's own), and every budget
    holds throughout."""
    policy = parse_policy(policy_dict())
    leader, standby = TickEngine(policy), TickEngine(policy)
    nodes = {n: HonestNode(n) for n in NODES}
    wall0 = 1_700_000_000.0
    for t in range(6):
        now, wall = float(t), wall0 + t
        for node in nodes.values():
            msg = node.sample(wall)
            assert leader.on_telemetry(msg, now) and standby.on_telemetry(msg, now)
        standby.observe(now)
        _, plan = leader.step(now, wall)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                assert leader.on_ack(cmd.node, ack) and standby.on_ack(cmd.node, ack)
    assert standby.tick_no == 0  # it decided nothing
    before = {u: w for n in nodes.values() for u, w in n.caps.items()}
    report, plan = standby.step(6.0, wall0 + 6)
    assert plan.waiting_nodes == ()
    assert {cmd.node for cmd in plan.commands} == set(NODES)
    assert report.tick > leader.tick_no  # above every tick the leader sent
    for cmd in plan.commands:
        for u, w in cmd.caps_w.items():
            assert w <= before[u] + TOL
    assert not (plan.group_over & ~plan.group_settling).any()


def test_the_agents_epoch_is_the_median_over_every_node() -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    assert engine.agents_epoch() == 0
    # One node claiming a huge epoch cannot lift it: the median of all nodes counts.
    engine.on_status(NODES[0], NodeStatus(node_id=NODES[0], state=NodeState.STEERED, epoch=10**9))
    assert engine.agents_epoch() == 0
    for n in NODES:
        engine.on_status(n, NodeStatus(node_id=n, state=NodeState.STEERED, epoch=7, fenced=2))
    # The first node keeps its higher claim (epochs only grow); the others carry the median.
    assert engine.agents_epoch() == 7
    assert engine.fenced_total() == 2 * len(NODES)
