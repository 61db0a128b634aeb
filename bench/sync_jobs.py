"""What a synchronous job's slowest GPU costs, and what reported jobs win back.

    PYTHONPATH=. .venv/bin/python bench/sync_jobs.py policies/scenarios/training-sync.yaml
    PYTHONPATH=. .venv/bin/python bench/sync_jobs.py policies/scenarios/mixed-50.yaml \
        --duration-h 0.5 --tick-s 5 --variants per-gpu sync node site

Runs `fast` on the scenario (and `static`, the unconstrained reference: every GPU at its
TDP, so every job's GPUs alike) under each variant and prints the work lost against the
reference, in all and per class, and the seconds over a budget:

- `per-gpu`: each GPU's work counted on its own, as the simulator did before 2026-12-06 (a
  GPU given more power than the rest of its job is credited with it);
- `sync`: a synchronous job at its slowest GPU's pace (the simulator now), its nodes
  reporting no job: the controller steers the job GPU by GPU;
- `node`, `site`: the same, the nodes reporting their jobs and the policy's
  `control.reported_jobs` set to `node` (the default: one node's GPUs share a cap) or
  `site` (every GPU of a job shares one).

Figures: docs/simulator.md, "Synchronous training: the slowest GPU sets the pace".
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from churn import load_run, with_control

from powerd.logs import configure_logging
from powerd.sim.run import STATIC, simulate
from powerd.sim.site import build_mix, site_for

VARIANTS = ("per-gpu", "sync", "node", "site")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("scenario")
    ap.add_argument("--duration-h", type=float, default=0.5)
    ap.add_argument("--tick-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int)
    ap.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    args = ap.parse_args()
    configure_logging(level="warning")
    scenario, base = load_run(args.scenario, args.duration_h, args.tick_s, args.seed)
    print(
        f"{scenario.spec.name}: {args.duration_h:g} h in {args.tick_s:g} s ticks, fast "
        "against static (every GPU at TDP)"
    )
    reference = None
    for variant in args.variants:
        scope = variant if variant in ("node", "site") else "off"
        policy = with_control(base, f"reported_jobs={scope}")
        site = site_for(scenario, policy)
        mix = build_mix(scenario, site)
        if variant == "per-gpu":
            mix = replace(mix, sync_jobs=(), gpu_jobs=())
        elif variant == "sync":
            mix = replace(mix, gpu_jobs=())
        if reference is None:
            # Every GPU of a job at its TDP cap draws alike: the same work either way.
            reference = simulate(scenario, site, mix, STATIC)
        t0 = time.process_time()
        run = simulate(scenario, site, mix, "fast")
        cpu = time.process_time() - t0
        loss = 1 - run.work_gpu_s / reference.work_gpu_s
        by_class = ", ".join(
            f"{c} {100 * (1 - w / reference.work_by_class[c]):.2f} %"
            for c, w in run.work_by_class.items()
        )
        print(
            f"{variant:8} lost {100 * loss:6.3f} % ({by_class}), "
            f"over a budget {run.over_budget_s:.0f} s, CPU {cpu:.1f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
