"""Scope figures: demand-curve time, the coordinator's split time, and the objective gap of
scopes solved apart against one global solve.

    .venv/bin/python bench/scopes.py
    .venv/bin/python bench/scopes.py --repeats 5

Fleets from powerd.testing.synthetic (8 GPUs/node, budgets binding at every level). Curves
have 256 points. Times are medians of the repeats. Results go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import numpy as np

from powerd.allocator import allocate_arrays, build_problem
from powerd.allocator.problem import objective
from powerd.allocator.scopes import DemandCurve, UpperTree, demand_curve, split_budgets
from powerd.policy import Policy
from powerd.testing.synthetic import make_policy, random_fleet, scope_fleet

POINTS = 256


def median_ms(run: object, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()  # type: ignore[operator]
        times.append((time.perf_counter() - t0) * 1000.0)
    return statistics.median(times)


def curve_time(gpus: int, repeats: int) -> float:
    """One scope of `gpus` GPUs (a row: racks of 8 nodes × 8 GPUs), curve at its root."""
    policy = make_policy(1, max(1, gpus // 64), 8, 8)
    fleet = random_fleet(policy, seed=gpus)
    problem = build_problem(fleet, policy)
    row = int(fleet.topology.groups_at(1)[0])
    return median_ms(lambda: demand_curve(problem, row, POINTS), repeats)


def split_time(scopes: int, repeats: int) -> float:
    """`scopes` racks (16 a row), curves with windows around a first split."""
    rows = max(1, scopes // 16)
    policy = make_policy(rows, min(scopes, 16), 2, 8)
    fleet = random_fleet(policy, seed=scopes)
    problem = build_problem(fleet, policy)
    upper = UpperTree.from_topology(fleet.topology, 2)
    coarse = [demand_curve(problem, int(g), POINTS) for g in upper.scopes]
    first = split_budgets(upper, coarse)
    curves = [
        demand_curve(problem, int(g), POINTS, around_w=float(b))
        for g, b in zip(upper.scopes, first.budget_w, strict=True)
    ]
    return median_ms(lambda: split_budgets(upper, curves), repeats)


def gap(rows: int, racks: int, ticks: int) -> list[tuple[int, float, bool]]:
    """Relative objective gap per tick of scopes (rows) solved apart, against one solve."""
    policy: Policy = make_policy(rows, racks, 8, 8)
    fleet = random_fleet(policy, seed=rows, stale_share=0.05, pinned_share=0.05)
    best = allocate_arrays(fleet, policy).objective
    whole = build_problem(fleet, policy)
    upper = UpperTree.from_topology(fleet.topology, 1)
    parts = []
    for g in upper.scopes:
        name = fleet.topology.names[int(g)]
        scope_policy, part, gpus = scope_fleet(fleet, policy, name)
        root = part.topology.names.index(name)
        parts.append((scope_policy, part, gpus, root, build_problem(part, scope_policy)))
    around: list[float | None] = [None] * len(parts)
    out = []
    for tick in range(ticks):
        curves: list[DemandCurve | None] = [
            demand_curve(problem, root, POINTS, around_w=a)
            for (_, _, _, root, problem), a in zip(parts, around, strict=True)
        ]
        split = split_budgets(upper, curves)
        caps = np.zeros(fleet.n)
        for (scope_policy, part, gpus, root, _), b in zip(parts, split.budget_w, strict=True):
            budget = part.topology.budget_w.copy()
            budget[root] = b + part.topology.overhead_w[root]
            caps[gpus] = allocate_arrays(part, scope_policy, budget_w=budget).caps_w
        value = objective(whole, caps / 1000.0)
        out.append((tick + 1, (best - value) / abs(best), split.exact))
        around = [float(b) for b in split.budget_w]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--ticks", type=int, default=4)
    args = parser.parse_args()
    print(f"# {platform.processor() or platform.machine()}, numpy {np.__version__}")
    for gpus in (10_240, 51_200):
        print(f"demand curve, {gpus} GPUs: {curve_time(gpus, args.repeats):.1f} ms")
    for scopes in (8, 64, 256):
        print(f"split, {scopes} scopes: {split_time(scopes, args.repeats):.2f} ms")
    for rows, racks in ((2, 160), (4, 80)):
        for tick, rel, exact in gap(rows, racks, args.ticks):
            print(
                f"gap, {rows * racks * 64} GPUs in {rows} scopes, tick {tick}: "
                f"{rel:.2e} (split exact: {exact})"
            )


if __name__ == "__main__":
    main()
