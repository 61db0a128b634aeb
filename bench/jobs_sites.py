"""How often coupled_newton.py reaches the optimum on its own, measured against cvxpy.

    .venv/bin/python bench/jobs_sites.py                   # 1,000 random small sites
    .venv/bin/python bench/jobs_sites.py --sites 3000 --first 1000
    .venv/bin/python bench/jobs_sites.py --large 100000 --fractions 1,0.9,0.8,0.7

Random sites (1-2 rows, 1-3 racks, 1-3 nodes of 1-4 GPUs, budgets at 50-100 % of their
GPUs' maximum, damping 0.01-1, jobs of 2-8 GPUs on 30-100 % of the GPUs, a random share of
them scattered): for each, coupled_newton.py from the relaxed problem's prices (as `fast` calls it
with no warm start) and from the previous fleet's prices, without the reference `fast`
falls back to on sites this small. It prints how many did not converge and how many missed
cvxpy's objective by more than 1e-6 (relative).

`--large SIZE`: one drifted tick of the synthetic fleet of bench/allocator.py (70 % of the
GPUs in jobs, a fifth scattered), `fast` cold against cvxpy: the certified gap and the
true shortfall (cvxpy at 100k takes 10-20 s).
"""

from __future__ import annotations

import argparse
import time
import warnings
from dataclasses import replace

from powerd.allocator import (
    ClassTable,
    Tree,
    allocate_arrays,
    build_problem,
    coupled_newton,
    tree_solver,
)
from powerd.allocator.problem import FloatArray, Problem, objective, repair
from powerd.testing.synthetic import Drift, make_policy, random_fleet, random_job_site, with_jobs


def _right(problem: Problem, p: FloatArray, best: float) -> bool:
    return abs(objective(problem, repair(problem, p)) - best) <= 1e-6 * max(abs(best), 1.0)


def sites(first: int, count: int) -> None:
    counts = {"sites": 0, "cold_unconverged": 0, "cold_wrong": 0, "warm_wrong": 0}
    t0 = time.perf_counter()
    for seed in range(first, first + count):
        policy, fleet = random_job_site(seed)
        problem = build_problem(fleet, policy)
        if problem.jobs is None:
            continue
        counts["sites"] += 1
        ref = allocate_arrays(fleet, policy, "cvxpy")
        start = tree_solver._tree_solve(problem, None, rough=True)[1]  # as fast starts it cold
        p, _, done = coupled_newton.solve_checked(problem, None, start)
        counts["cold_unconverged"] += not done
        counts["cold_wrong"] += not _right(problem, p, ref.objective)
        # The next tick, from the prices fast found for this one.
        now = replace(fleet, cap_w=ref.caps_w)
        problem2 = build_problem(now, policy)
        warm = tree_solver._usable_warm(problem2, allocate_arrays(fleet, policy, "fast").prices)
        p2, _, _ = coupled_newton.solve_checked(problem2, warm, None)
        ref2 = allocate_arrays(now, policy, "cvxpy")
        counts["warm_wrong"] += not _right(problem2, p2, ref2.objective)
        if (seed - first + 1) % 250 == 0:
            print(f"  {seed - first + 1} seeds, {time.perf_counter() - t0:.0f} s", flush=True)
    print(
        f"seeds {first}-{first + count - 1}: {counts['sites']} sites with jobs; from the "
        f"relaxed start {counts['cold_unconverged']} not converged, {counts['cold_wrong']} "
        f"off cvxpy; from last tick's prices {counts['warm_wrong']} off cvxpy"
    )


def large(size: int, fractions: tuple[float, ...] | None) -> None:
    rows = max(1, round(size / 1024))
    options = {} if fractions is None else {"fractions": fractions}
    policy = make_policy(rows, 16, 8, 8, **options)
    fleet = with_jobs(random_fleet(policy, seed=size), seed=size, share=0.7)
    classes, tree = ClassTable.from_policy(policy), Tree(fleet.topology)
    last = allocate_arrays(fleet, policy, "fast", classes=classes, tree=tree)
    fleet = Drift.start(fleet, seed=1).tick(last.caps_w)
    got = allocate_arrays(fleet, policy, "fast", classes=classes, tree=tree)
    print(f"fast: {got.solve_ms:.0f} ms, objective {got.objective:.4f}, gap {got.gap:.2e}")
    t0 = time.perf_counter()
    ref = allocate_arrays(fleet, policy, "cvxpy", classes=classes, tree=tree)
    short = (ref.objective - got.objective) / abs(ref.objective)
    print(
        f"cvxpy: {time.perf_counter() - t0:.1f} s, objective {ref.objective:.4f}; "
        f"fast falls short by {short:.2e}"
    )


def main() -> None:
    warnings.filterwarnings("ignore")  # cvxpy's on tiny problems
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sites", type=int, default=1000)
    ap.add_argument("--first", type=int, default=0, help="first seed")
    ap.add_argument("--large", type=int, default=0, help="GPUs of one large fleet instead")
    ap.add_argument("--fractions", default="", help="budget room per level, as allocator.py")
    args = ap.parse_args()
    if args.large:
        fractions = tuple(float(v) for v in args.fractions.split(",")) if args.fractions else None
        if fractions is not None and len(fractions) != 4:
            ap.error("--fractions takes four shares: facility,row,rack,node")
        large(args.large, fractions)
    else:
        sites(args.first, args.sites)


if __name__ == "__main__":
    main()
