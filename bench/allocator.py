"""Allocator figures: steady-state time per allocation and peak memory, fast vs cvxpy.

    .venv/bin/python bench/allocator.py                 # 1k, 10k, 100k GPUs
    .venv/bin/python bench/allocator.py --sizes 1000 --runs 5
    .venv/bin/python bench/allocator.py --jobs 0.7      # 70 % of GPUs in jobs of 8-4,096
    .venv/bin/python bench/allocator.py --jobs 0.7 --scattered 0   # all on consecutive nodes
    .venv/bin/python bench/allocator.py --jobs 0.7 --fractions 1,0.9,0.8,0.7   # tight budgets

Fleets: 8 GPUs/node, 8 nodes/rack, 16 racks/row (powerd.testing.synthetic, budgets binding at every
level). Steady state: one untimed first call, then successive ticks whose draws drift and
whose caps in force are the previous tick's; `fast` (cold) also times a fleet never steered
(every GPU at its maximum, every budget over). Each (size, solver) runs in its own process so
its peak RSS is its own. `--jobs SHARE` puts that share of the GPUs in jobs
(synthetic.with_jobs: 8 to 4,096 GPUs, most on consecutive nodes, `--scattered` of them,
a fifth by default, on GPUs picked anywhere) and prints the largest duality gap `fast`
certified. `--fractions` sets the room of each level's budget (facility, row, rack, node) as a
share of its GPUs' maximum. Results go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import replace

GPUS_PER_ROW = 8 * 8 * 16


def worker(
    size: int,
    solver: str,
    runs: int,
    warm: bool,
    jobs: float,
    scattered: float,
    fractions: tuple[float, float, float, float] | None = None,
) -> dict[str, object]:
    from powerd.allocator import ClassTable, Tree, allocate_arrays
    from powerd.testing.synthetic import Drift, make_policy, random_fleet, with_jobs

    rows = max(1, round(size / GPUS_PER_ROW))
    options = {} if fractions is None else {"fractions": fractions}
    policy = make_policy(rows, 16, 8, 8, **options)
    fleet = random_fleet(policy, seed=size)
    if jobs > 0:
        fleet = with_jobs(fleet, seed=size, share=jobs, scattered=scattered)
    classes, tree = ClassTable.from_policy(policy), Tree(fleet.topology)
    drift = Drift.start(fleet, seed=1)
    rss_setup = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    last = allocate_arrays(fleet, policy, solver, classes=classes, tree=tree)
    first_ms = (time.perf_counter() - t0) * 1000
    times, walls, gaps = [], [], [last.gap]
    for _ in range(runs):
        fleet = drift.tick(last.caps_w)
        t0 = time.perf_counter()
        last = allocate_arrays(
            fleet, policy, solver, classes=classes, tree=tree, warm=last if warm else None
        )
        walls.append((time.perf_counter() - t0) * 1000)
        times.append(last.solve_ms)
        gaps.append(last.gap)
    first_start = []
    if solver == "fast" and not warm:
        # A fleet never steered: every GPU at its maximum, every budget over (no prices).
        uncapped = replace(fleet, cap_w=fleet.max_cap_w.copy())
        for _ in range(min(runs, 5)):
            first_start.append(
                allocate_arrays(uncapped, policy, solver, classes=classes, tree=tree).solve_ms
            )
    return {
        "gpus": fleet.n,
        "solver": solver + (" (warm)" if warm and solver == "fast" else ""),
        "runs": runs,
        "median_ms": statistics.median(times),
        "min_ms": min(times),
        "max_ms": max(times),
        "first_ms": first_ms,
        "rss_setup_mb": rss_setup / 1024,
        "rss_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "status": last.status,
        "jobs": len(fleet.job_names),
        "gap_max": max(gaps),
        "objective": last.objective,
        "uncapped_ms": statistics.median(first_start) if first_start else None,
    }


def machine() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy as np

    return (
        f"{model}, nproc={os.cpu_count()}, Python {platform.python_version()}, "
        f"numpy {np.__version__}"
    )


def _fractions(ap: argparse.ArgumentParser, text: str) -> tuple[float, float, float, float] | None:
    if text in ("", "-"):
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        ap.error(f"--fractions takes four numbers separated by commas, not {text!r}")
    if len(values) != 4 or not all(0.0 < v <= 1.0 for v in values):
        ap.error("--fractions takes four shares in (0, 1]: facility,row,rack,node")
    return values[0], values[1], values[2], values[3]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1000,10000,100000")
    ap.add_argument("--runs", type=int, default=9, help="timed ticks per (size, solver)")
    ap.add_argument("--cvxpy-runs-100k", type=int, default=1)
    ap.add_argument("--jobs", type=float, default=0.0, help="share of GPUs in jobs (0-1)")
    ap.add_argument(
        "--scattered", type=float, default=0.2, help="share of the jobs on scattered GPUs"
    )
    ap.add_argument(
        "--fractions",
        default="",
        help="budget room per level (facility,row,rack,node), e.g. 1,0.9,0.8,0.7; "
        "default: synthetic.policy_dict's",
    )
    ap.add_argument(
        "--worker",
        nargs=7,
        metavar=("SIZE", "SOLVER", "RUNS", "WARM", "JOBS", "SCATTERED", "FRACTIONS"),
    )
    args = ap.parse_args()
    if args.worker:
        size, solver, runs, warm, jobs, scattered, shares = args.worker
        fractions = _fractions(ap, shares)
        result = worker(
            int(size), solver, int(runs), warm == "1", float(jobs), float(scattered), fractions
        )
        print(json.dumps(result))
        return
    _fractions(ap, args.fractions)  # checked here, used by the workers
    if not 0.0 <= args.jobs <= 1.0:
        ap.error("--jobs is a share of the GPUs, from 0 to 1")
    if not 0.0 <= args.scattered <= 1.0:
        ap.error("--scattered is a share of the jobs, from 0 to 1")
    print(f"machine: {machine()}")
    # Other work on the machine shows up in the timings: say how busy it was.
    print(f"load average at start: {os.getloadavg()[0]:.2f}")
    results = []
    for size in (int(s) for s in args.sizes.split(",")):
        for solver, warm in (("fast", "1"), ("fast", "0"), ("cvxpy", "0")):
            runs = args.runs if solver == "fast" or size < 50_000 else args.cvxpy_runs_100k
            if runs < 1:
                continue  # e.g. --cvxpy-runs-100k 0: skip the 15 s reference solve
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--worker",
                    str(size),
                    solver,
                    str(runs),
                    warm,
                    str(args.jobs),
                    str(args.scattered),
                    args.fractions or "-",
                ],
                check=True,
                capture_output=True,
                text=True,
            )
            results.append(json.loads(out.stdout))
            r = results[-1]
            print(
                f"  {r['gpus']:>7} {r['solver']:<12} median {r['median_ms']:9.1f} ms"
                f"  jobs {r['jobs']}  gap {r['gap_max']:.1e}",
                flush=True,
            )
    print()
    print(
        "| GPUs | solver | runs | median ms | min–max ms | first call ms | peak RSS MB "
        "(setup) | speed-up vs cvxpy | jobs | largest gap |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    ref = {r["gpus"]: r["median_ms"] for r in results if r["solver"] == "cvxpy"}
    for r in results:
        speedup = ref[r["gpus"]] / r["median_ms"] if r["gpus"] in ref else float("nan")
        print(
            f"| {r['gpus']:,} | {r['solver']} | {r['runs']} | {r['median_ms']:.1f} | "
            f"{r['min_ms']:.1f}–{r['max_ms']:.1f} | {r['first_ms']:.1f} | "
            f"{r['rss_peak_mb']:.0f} ({r['rss_setup_mb']:.0f}) | {speedup:.0f}× | "
            f"{r['jobs']} | {r['gap_max']:.1e} |"
        )
    for r in results:
        if r.get("uncapped_ms") is not None:
            print(
                f"{r['gpus']:,} GPUs, every GPU at its maximum (a fleet never steered): "
                f"fast {r['uncapped_ms']:.1f} ms (median of up to 5)"
            )


if __name__ == "__main__":
    main()
