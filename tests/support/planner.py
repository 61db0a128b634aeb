"""Small fleets for the safety planner (test_safety, test_jobs_allocator): a policy of nodes
given GPU by GPU, its layout, and the telemetry and acks of agents that obey."""

from __future__ import annotations

from typing import Any

import numpy as np

from powerd.policy import Policy, parse_policy
from powerd.safety import GpuLayout, SafePlan, SafetyPlanner
from powerd.wire import GpuAck

FAILSAFE_W = 150.0


def policy_dict(nodes: list[dict[str, Any]], *, budgets: dict[str, float] | None = None) -> dict:
    """One row, one rack unless the nodes say otherwise (keys row/rack in each node)."""
    budgets = budgets or {}
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {}
    for node in nodes:
        rows.setdefault(node.get("row", "r0"), {}).setdefault(node.get("rack", "k0"), []).append(
            {k: v for k, v in node.items() if k not in ("row", "rack")}
        )

    def budget(name: str) -> dict[str, float]:
        return {"budget_w": budgets[name]} if name in budgets else {}

    return {
        "facility": {
            "name": "f",
            **budget("f"),
            "rows": [
                {
                    "name": row,
                    **budget(row),
                    "racks": [
                        {"name": rack, **budget(rack), "nodes": specs}
                        for rack, specs in racks.items()
                    ],
                }
                for row, racks in rows.items()
            ],
        },
        "profiles": {"p": {"points": [[100, 0.4], [400, 1.0]]}},
        "classes": {"c": {"weight": 1, "profile": "p"}},
        "defaults": {
            "class": "c",
            "failsafe_w": FAILSAFE_W,
            "gpu": {"min_cap_w": 100, "max_cap_w": 400},
        },
        "control": {"tick_s": 1.0, "lease_s": 4.0, "stale_after_s": 2.5},
    }


def simple_fleet(
    gpus_per_node: list[int], node_budget: float | None = None, facility: float | None = None
) -> tuple[Policy, GpuLayout]:
    nodes = [
        {"name": f"n{k}", "gpus": g, **({"budget_w": node_budget} if node_budget else {})}
        for k, g in enumerate(gpus_per_node)
    ]
    policy = parse_policy(policy_dict(nodes, budgets={"f": facility} if facility else {}))
    uuids, names = [], []
    for k, g in enumerate(gpus_per_node):
        for j in range(g):
            uuids.append(f"g{k}-{j}")
            names.append(f"n{k}")
    n = len(uuids)
    return policy, GpuLayout.build(policy, uuids, names, np.full(n, 100.0), np.full(n, 400.0))


def node_caps(layout: GpuLayout, node: str, values: np.ndarray) -> dict[str, float]:
    return {u: float(values[i]) for i, u in enumerate(layout.uuids) if layout.nodes[i] == node}


def teach(planner: SafetyPlanner, layout: GpuLayout, caps: np.ndarray, at: float) -> None:
    """Telemetry from every node reporting `caps`, fresh at `at`."""
    for node in dict.fromkeys(layout.nodes):
        planner.on_telemetry(node, node_caps(layout, node, caps), received_at=at)
    planner.assume_settled()  # these tests start the fleet: no predecessor's commands


def ack_all(planner: SafetyPlanner, plan: SafePlan, at: float) -> None:
    for c in plan.commands:
        acks = {u: GpuAck(requested_w=v, enforced_w=v) for u, v in c.caps_w.items()}
        planner.on_ack(c.node, c.tick, acks)
