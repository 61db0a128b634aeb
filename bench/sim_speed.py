"""How fast the simulator is: one steered run, its stages, and an oversubscription search.

    PYTHONPATH=. .venv/bin/python bench/sim_speed.py                  # 24 h, 512 GPUs, 5 s
    PYTHONPATH=. .venv/bin/python bench/sim_speed.py --duration-h 1   # to try it
    PYTHONPATH=. .venv/bin/python bench/sim_speed.py --search --jobs 2

Prints, for `powerd sim SCENARIO --policies POLICY --tick-s TICK --duration-h HOURS`:
the steered run's CPU and wall seconds (and per simulated tick), the unconstrained
(`static`) run the report compares it with, where the steered run's CPU time goes
(agents, the engine's stages, the GPU model and accounting), and with `--search` the
oversubscription search (`powerd sim ... --oversubscribe`): its seconds, its runs and the
fit sizes. CPU seconds are the process's (and its workers'), so they hold on a shared
machine where wall seconds do not. Figures: docs/performance.md, "Simulator".
"""

from __future__ import annotations

import argparse
import json
import logging
import resource
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import structlog


def _cpu() -> float:
    """CPU seconds of this process and its finished children (the search's workers)."""
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# What the breakdown times: (label, module, class, method). Nested ones (the engine's
# stages within `TickEngine.step`) are indented and not added to the total.
STAGES = [
    ("agents: telemetry as columns", "powerd.sim.agents", "SimAgents", "fleet_readings"),
    ("engine: take telemetry", "powerd.controller.tick", "TickEngine", "on_fleet_readings"),
    ("engine: tick (step)", "powerd.controller.tick", "TickEngine", "step"),
    ("  1 fleet (_see)", "powerd.controller.tick", "TickEngine", "_see"),
    ("  2 budgets", "powerd.controller.tick", "TickEngine", "_budgets"),
    ("  3 allocation (targets)", "powerd.controller.targets", "TargetStage", "decide"),
    ("    allocator", "powerd.controller.targets", "TargetStage", "allocate"),
    ("  4 safe plan", "powerd.controller.tick", "TickEngine", "_plan"),
    ("  alarms on the plan", "powerd.controller.tick", "TickEngine", "_alarm_plan"),
    ("  5 report", "powerd.controller.tick", "TickEngine", "_report"),
    ("agents: apply commands", "powerd.sim.agents", "SimAgents", "apply_plan"),
    ("engine: take acks", "powerd.controller.tick", "TickEngine", "on_plan_acked"),
    ("GPU model and accounting (advance)", "powerd.sim.run", "_Run", "advance"),
]


def _instrument() -> dict[str, float]:
    """Wrap each stage's method to add its CPU time up (process_time: this process)."""
    import importlib

    spent: dict[str, float] = defaultdict(float)
    for label, module, cls_name, method in STAGES:
        cls = getattr(importlib.import_module(module), cls_name)
        original = getattr(cls, method)

        def timed(
            *args: Any, _f: Callable[..., Any] = original, _label: str = label, **kwargs: Any
        ) -> Any:
            t0 = time.process_time()
            try:
                return _f(*args, **kwargs)
            finally:
                spent[_label] += time.process_time() - t0

        setattr(cls, method, timed)
    return spent


def _count_steps() -> dict[str, int]:
    """Count the engine's ticks by wrapping `TickEngine.step` (not with `simulate`'s
    `trace`: a trace turns each report's per-cap explanation on, which `powerd sim` does
    not compute)."""
    from powerd.controller.tick import TickEngine

    rounds = {"n": 0}
    step = TickEngine.step

    def counted(*args: Any, **kwargs: Any) -> Any:
        rounds["n"] += 1
        return step(*args, **kwargs)

    TickEngine.step = counted  # type: ignore[method-assign]
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scenario", default="policies/scenarios/mixed-50.yaml")
    parser.add_argument("--duration-h", type=float, default=24.0)
    parser.add_argument("--tick-s", type=float, default=5.0)
    parser.add_argument("--policy", default="fast")
    parser.add_argument("--search", action="store_true", help="also time --oversubscribe")
    parser.add_argument("--points", type=int, default=8, help="the search's grid sizes")
    parser.add_argument("--jobs", type=int, default=1, help="the search's processes")
    parser.add_argument(
        "--old-search",
        action="store_true",
        help="the search as it was: bisection, every run to its end (no secant, no stop)",
    )
    parser.add_argument(
        "--search-only", action="store_true", help="time the search alone (not the day's runs)"
    )
    parser.add_argument(
        "--plain",
        action="store_true",
        help="the steered run without the stage timers and the tick counter (they add ~3 %%)",
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    from powerd.allocator import kernel
    from powerd.policy import load_policy
    from powerd.sim import STATIC
    from powerd.sim.run import simulate
    from powerd.sim.scenario import load_scenario
    from powerd.sim.site import build_mix, site_for
    from powerd.sim.study import Runner, oversubscribe

    kernel.warm_up()
    scenario = load_scenario(args.scenario, {"duration_h": args.duration_h, "tick_s": args.tick_s})
    assert scenario.policy_path is not None
    site = site_for(scenario, load_policy(scenario.policy_path))
    mix = build_mix(scenario, site)
    out: dict[str, Any] = {
        "scenario": scenario.spec.name,
        "gpus": site.n_gpus,
        "duration_h": args.duration_h,
        "tick_s": args.tick_s,
        "ticks": scenario.ticks,
        "policy": args.policy,
    }

    if not args.search_only:
        spent: dict[str, float] = {} if args.plain else _instrument()
        rounds = {"n": 0} if args.plain else _count_steps()
        cpu0, wall0 = _cpu(), time.perf_counter()
        run = simulate(scenario, site, mix, args.policy)
        cpu, wall = _cpu() - cpu0, time.perf_counter() - wall0
        out["run"] = {
            "cpu_s": cpu,
            "wall_s": wall,
            "ms_per_tick": 1000.0 * cpu / scenario.ticks,
            "engine_ticks": rounds["n"],
            "work_gpu_h": run.work_gpu_s / 3600.0,
            "over_budget_s": run.over_budget_s,
        }
        out["stages_cpu_s"] = dict(spent)  # the steered run's alone
        cpu0, wall0 = _cpu(), time.perf_counter()
        simulate(scenario, site, mix, STATIC)
        out["unconstrained"] = {"cpu_s": _cpu() - cpu0, "wall_s": time.perf_counter() - wall0}

    if args.search or args.search_only:
        runner = Runner(jobs=args.jobs)
        new = not args.old_search
        cpu0, wall0 = _cpu(), time.perf_counter()
        o = oversubscribe(
            scenario,
            site,
            [args.policy, STATIC],
            runner,
            points=args.points,
            secant=new,
            early_stop=new,
        )
        out["search"] = {
            "cpu_s": _cpu() - cpu0,
            "wall_s": time.perf_counter() - wall0,
            "jobs": args.jobs,
            "search": "old" if args.old_search else "new",
            "sizes": len(o.points),
            "steered_runs": sum(1 for pt in o.points if args.policy in pt.loss),
            "stopped_runs": {pt.gpus: pt.stopped_h[args.policy] for pt in o.points if pt.stopped_h},
            "losses": {pt.gpus: pt.loss.get(args.policy) for pt in o.points},
            "fit_gpus": o.fit_gpus(args.policy),
            "static_tdp_gpus": o.static_tdp_gpus,
        }

    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{out['scenario']}: {out['gpus']} GPUs, {args.duration_h:g} h of {args.tick_s:g} s "
        f"ticks ({out['ticks']:,}), {args.policy}"
    )
    if "run" in out:
        _print_run(out)
    if "search" in out:
        s = out["search"]
        stopped = ", ".join(f"{g} at {h:.1f} h" for g, h in s["stopped_runs"].items())
        print(
            f"  search ({s['search']})   {s['cpu_s']:7.1f} s CPU {s['wall_s']:7.1f} s wall  "
            f"(--jobs {s['jobs']}): {s['steered_runs']} {args.policy} runs over {s['sizes']} "
            f"sizes ({len(s['stopped_runs'])} stopped: {stopped or 'none'}); fits "
            f"{s['fit_gpus']} GPUs (static TDP {s['static_tdp_gpus']})"
        )
    sys.stdout.flush()


def _print_run(out: dict[str, Any]) -> None:
    r = out["run"]
    engine = (
        f", {r['engine_ticks'] / out['ticks']:.2f} engine ticks a tick"
        if r["engine_ticks"]
        else " (--plain: no stage timers)"
    )
    print(
        f"  steered run      {r['cpu_s']:7.1f} s CPU {r['wall_s']:7.1f} s wall  "
        f"{r['ms_per_tick']:.2f} ms CPU a tick{engine}"
    )
    u = out["unconstrained"]
    print(f"  unconstrained    {u['cpu_s']:7.1f} s CPU {u['wall_s']:7.1f} s wall")
    stages = out["stages_cpu_s"]
    if not stages:
        return
    print("  where the steered run's CPU goes:")
    for label, _, _, _ in STAGES:
        s = stages.get(label, 0.0)
        print(f"    {label:38s} {s:7.2f} s {100 * s / r['cpu_s']:5.1f} %")
    top = sum(stages.get(label, 0.0) for label, *_ in STAGES if not label.startswith(" "))
    print(f"    {'the rest (committed check, loop)':38s} {r['cpu_s'] - top:7.2f} s")


if __name__ == "__main__":
    main()
