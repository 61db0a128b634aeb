"""Bench: what the planner's room for GPUs that keep their limits costs per tick.

A synthetic site (`--rows` × `--racks` × `--nodes` × 8 GPUs, 200–700 W), a share of its
nodes declared `keeps_limits` (every k-th node) and the facility's `lowest_budget_w` at
70 % of its budget; the safety planner alone, every GPU's target drawn at random each tick
(the worst case: every group crowded), every command acknowledged at once. Prints the
median `SafetyPlanner.plan` time per share of such nodes.

    .venv/bin/python bench/keeps.py                 # 10,240 GPUs, shares 0, 0.5, 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace

import numpy as np

from powerd.policy import Policy, parse_policy
from powerd.safety import GpuLayout, SafetyPlanner
from powerd.testing.synthetic import policy_dict
from powerd.wire import GpuAck

GPUS = 8


def with_keeps(base: Policy, share: float) -> Policy:
    every = 0 if share <= 0 else max(1, round(1 / share))
    groups = []
    k = 0
    for g in base.groups:
        if g.level == 3:
            groups.append(replace(g, keeps_limits=bool(every) and k % every == 0))
            k += 1
        else:
            groups.append(g)
    root = groups[0]
    groups[0] = replace(root, lowest_budget_w=0.7 * root.budget_w)
    return replace(base, groups=tuple(groups))


def median_plan_ms(policy: Policy, ticks: int) -> tuple[int, float]:
    nodes = policy.node_names()
    uuids = [f"GPU-{n}-{i}" for n in nodes for i in range(GPUS)]
    gpu_nodes = [n for n in nodes for _ in range(GPUS)]
    layout = GpuLayout.build(policy, uuids, gpu_nodes, [200.0] * len(uuids), [700.0] * len(uuids))
    planner = SafetyPlanner(policy, layout)
    planner.claim_keeps_limits([g.name for g in policy.groups if g.keeps_limits])
    for n in nodes:
        planner.on_telemetry(n, {f"GPU-{n}-{i}": 300.0 for i in range(GPUS)}, received_at=0.0)
    planner.assume_settled()
    rng = np.random.default_rng(1)
    times = []
    for t in range(1, ticks + 1):
        targets = rng.uniform(200, 700, len(uuids))
        t0 = time.perf_counter()
        plan = planner.plan(t, float(t), targets)
        times.append(time.perf_counter() - t0)
        for cmd in plan.commands:
            acks = {u: GpuAck(requested_w=w, enforced_w=w) for u, w in cmd.caps_w.items()}
            planner.on_ack(cmd.node, cmd.tick, acks)
    return len(uuids), statistics.median(times) * 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--racks", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--shares", default="0,0.5,1")
    args = parser.parse_args()
    base = parse_policy(policy_dict(args.rows, args.racks, args.nodes, GPUS))
    for share in (float(s) for s in args.shares.split(",")):
        n, ms = median_plan_ms(with_keeps(base, share), args.ticks)
        print(f"{n} GPUs, share of nodes keeping their limits {share:g}: plan {ms:.1f} ms")


if __name__ == "__main__":
    main()
