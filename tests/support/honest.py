"""A small site and honest agents as state machines, for tests that drive the controller
or its tick engine synchronously (no broker, no processes): 2 racks × 2 nodes × 4 GPUs
under a 7,000 W facility, every GPU 200–700 W."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from powerd.wire import CapAck, CapCommand, GpuAck, GpuTelemetry, NodeTelemetry, encode

GPUS = 4
NODES = ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]


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


class HonestNode:
    """An agent as a state machine: applies each newer command to its own GPUs, reports
    what they enforce."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.uuids = [f"GPU-{name}-{i}" for i in range(GPUS)]
        self.caps = dict.fromkeys(self.uuids, 200.0)  # failsafe, as an agent starts
        self.last_tick: int | None = None
        self.seq = 0

    def draw(self) -> dict[str, float]:
        """What each GPU draws under the cap in force."""
        return {u: min(cap, 650.0) for u, cap in self.caps.items()}

    def sample(self, wall: float) -> NodeTelemetry:
        self.seq += 1
        draw = self.draw()
        gpus = [
            GpuTelemetry(
                uuid=u,
                index=i,
                power_w=draw[u],
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

    def telemetry(self, wall: float) -> bytes:
        return encode(self.sample(wall))

    def apply_caps(self, tick: int, caps_w: Mapping[str, float]) -> CapAck | None:
        """The ack of command `tick`, or None for a tick not newer than the last applied."""
        if self.last_tick is not None and tick <= self.last_tick:
            return None
        self.last_tick = tick
        acks = {}
        for u, w in caps_w.items():
            if u in self.caps:
                self.caps[u] = min(max(w, 200.0), 700.0)
                acks[u] = GpuAck(requested_w=w, enforced_w=self.caps[u])
        return CapAck(node_id=self.name, tick=tick, gpus=acks)

    def apply(self, cmd: CapCommand) -> bytes | None:
        ack = self.apply_caps(cmd.tick, cmd.caps)
        return None if ack is None else encode(ack)


def tick(engine: Any, nodes: Mapping[str, HonestNode], t: int, wall0: float = 1e9) -> Any:
    """One synchronous tick at second `t` (wall clock `wall0 + t`): every node's sample
    in, the engine's step, each command applied by its node and acknowledged. Returns the
    step's (report, plan)."""
    for node in nodes.values():
        engine.on_telemetry(node.sample(wall0 + t), float(t))
    report, plan = engine.step(float(t), wall0 + t)
    for cmd in plan.commands:
        ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
        if ack is not None:
            engine.on_ack(cmd.node, ack)
    return report, plan
