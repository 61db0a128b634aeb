"""The tick engine alone: decoded messages in, plans out, no broker, store or clock; and an
import of the pure core that loads no I/O library."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
from test_layers import IO_LIBRARIES

from powerd.controller.engine import TickEngine
from powerd.policy import parse_policy
from powerd.safety import NodeCommand
from powerd.wire import CapAck, GpuAck, GpuTelemetry, NodeState, NodeStatus, NodeTelemetry

GPUS = 4
NODES = ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
TOL = 1e-6

PURE_CORE = (
    "powerd.controller.engine",
    "powerd.safety",
    "powerd.allocator",
    "powerd.policy",
    "powerd.wire",
)


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


def policy_dict() -> dict[str, Any]:
    return {
        "facility": {
            "name": "dc",
            "budget_w": 7000,
            "rows": [
                {
                    "name": "row",
                    "racks": [
                        {
                            "name": "r{1..2}",
                            "budget_w": 3800,
                            "nodes": [{"name": "{rack}-n{1..2}", "budget_w": 2400, "gpus": GPUS}],
                        }
                    ],
                }
            ],
        },
        "profiles": {"p": {"points": [[200, 0.4], [700, 1.0]]}},
        "classes": {"c": {"weight": 1, "profile": "p"}},
        "defaults": {"class": "c", "failsafe_w": 200},
        "control": {"tick_s": 1.0, "lease_s": 4.0, "stale_after_s": 3.0, "forget_after_s": 20},
    }


class Node:
    """An agent as a state machine: applies each newer command, reports what it enforces."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.caps = {f"GPU-{name}-{i}": 200.0 for i in range(GPUS)}  # failsafe at start
        self.last_tick: int | None = None
        self.seq = 0

    def telemetry(self, wall: float) -> NodeTelemetry:
        self.seq += 1
        gpus = [
            GpuTelemetry(
                uuid=u,
                index=i,
                power_w=min(cap, 650.0),
                energy_j=1.0,
                cap_w=cap,
                min_cap_w=200.0,
                max_cap_w=700.0,
                default_cap_w=700.0,
                temp_c=50.0,
                util_pct=90.0,
                sm_clock_mhz=1500.0,
            )
            for i, (u, cap) in enumerate(self.caps.items())
        ]
        return NodeTelemetry(
            node_id=self.name, ts=wall, seq=self.seq, period_s=1.0, gpus=gpus, tick=self.last_tick
        )

    def apply(self, cmd: NodeCommand) -> CapAck | None:
        if self.last_tick is not None and cmd.tick <= self.last_tick:
            return None
        self.last_tick = cmd.tick
        acks = {}
        for u, w in cmd.caps_w.items():
            self.caps[u] = min(max(w, 200.0), 700.0)
            acks[u] = GpuAck(requested_w=w, enforced_w=self.caps[u])
        return CapAck(node_id=self.name, tick=cmd.tick, gpus=acks)


def test_the_engine_alone_steers_every_gpu_within_every_budget() -> None:
    policy = parse_policy(policy_dict())
    engine = TickEngine(policy)
    nodes = {n: Node(n) for n in NODES}
    wall0 = 1_700_000_000.0
    for t in range(8):
        now, wall = float(t), wall0 + t
        for node in nodes.values():
            assert engine.on_telemetry(node.telemetry(wall), now)
        report, plan = engine.step(now, wall)
        assert report.tick == plan.tick == engine.tick_no
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply(cmd)
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


def test_alarms_are_data_the_owner_takes() -> None:
    engine = TickEngine(parse_policy(policy_dict()))
    nodes = {n: Node(n) for n in NODES}
    for node in nodes.values():
        engine.on_telemetry(node.telemetry(1.0), 0.0)
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
