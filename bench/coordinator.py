"""The coordinator's tick at many scopes: reports in, the split, the safety plan, out.

Builds a site of `--scopes` racks (16 racks a row, 2 nodes × 8 GPUs a rack) from
powerd.testing.synthetic, computes each rack's demand curve from a random fleet (256
points, as scope controllers send), and times `BudgetSplitter.step` (the split, the
planner, the report) over `--ticks` ticks after every scope has confirmed a budget, and
decoding one tick's reports from JSON. Prints medians and maxima.

    .venv/bin/python bench/coordinator.py --scopes 64
"""

from __future__ import annotations

import argparse
import statistics
import time

from powerd.allocator import build_problem
from powerd.allocator.scopes import demand_curve
from powerd.coordinator.split import BudgetSplitter
from powerd.testing.synthetic import make_policy, random_fleet
from powerd.wire import ScopeReport, decode, encode

EPOCH = 1
POINTS = 256


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scopes", type=int, default=64)
    parser.add_argument("--ticks", type=int, default=200)
    args = parser.parse_args()
    rows = max(1, args.scopes // 16)
    policy = make_policy(rows, min(args.scopes, 16), 2, 8)
    fleet = random_fleet(policy, seed=args.scopes)
    problem = build_problem(fleet, policy)
    topo = fleet.topology
    racks = [int(g) for g in topo.groups_at(2)]
    splitter = BudgetSplitter(policy, "rack")
    reports = {}
    for g in racks:
        curve = demand_curve(problem, g, POINTS)
        off = float(topo.overhead_w[g])
        budget = float(topo.budget_w[g])
        reports[topo.names[g]] = ScopeReport(
            scope=topo.names[g],
            tick=1,
            budget_w=min(budget, curve.hi_w + off),
            committed_w=min(budget, curve.hi_w + off),
            failsafe_w=off,
            lo_w=curve.lo_w + off,
            hi_w=curve.hi_w + off,
            offset_w=off,
            curve_budget_w=(curve.budget_w + off).tolist(),
            curve_price=curve.price.tolist(),
        )
    wire = [encode(r) for r in reports.values()]
    now = 0.0
    for r in reports.values():
        splitter.on_report(r, now, EPOCH)
    steps, decodes = [], []
    for k in range(args.ticks):
        t0 = time.perf_counter()
        plan = splitter.step(now, now, 1.0)
        steps.append((time.perf_counter() - t0) * 1000.0)
        t0 = time.perf_counter()
        for payload in wire:
            decode(payload, ScopeReport)
        decodes.append((time.perf_counter() - t0) * 1000.0)
        now += 1.0
        # Every scope confirms what it was sent (its caps fit), as in steady state.
        for p in plan.budgets:
            r = reports[p.scope]
            b = p.budget_w if p.budget_w is not None else r.budget_w
            splitter.on_report(
                r.model_copy(
                    update={
                        "budget_epoch": EPOCH,
                        "budget_tick": plan.tick,
                        "budget_w": b,
                        "committed_w": min(b, r.committed_w),
                        "tick": k + 2,
                    }
                ),
                now,
                EPOCH,
            )
    held = sum(p.held for p in plan.budgets)
    size = sum(len(w) for w in wire) / len(wire)
    print(
        f"{args.scopes} scopes ({len(fleet.uuids)} GPUs), {POINTS}-point curves, "
        f"{args.ticks} ticks\n"
        f"BudgetSplitter.step: median {statistics.median(steps):.2f} ms, "
        f"max {max(steps):.2f} ms\n"
        f"decoding one tick's reports: median {statistics.median(decodes):.2f} ms "
        f"({size / 1024:.1f} KiB a report)\n"
        f"raises still held at the end: {held}"
    )


if __name__ == "__main__":
    main()
