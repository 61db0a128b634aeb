"""How fast the simulator is: one steered run, its stages, and an oversubscription search.

    PYTHONPATH=. .venv/bin/python bench/sim_speed.py                  # 24 h, 512 GPUs, 5 s
    PYTHONPATH=. .venv/bin/python bench/sim_speed.py --duration-h 1   # to try it
    PYTHONPATH=. .venv/bin/python bench/sim_speed.py --search --jobs 2
    PYTHONPATH=. .venv/bin/python bench/sim_speed.py --command --points 6 --jobs 2

Prints, for `powerd sim SCENARIO --policies POLICY --tick-s TICK --duration-h HOURS`:
the steered run's CPU and wall seconds (and per simulated tick), the unconstrained
(`static`) run the report compares it with, where the steered run's CPU time goes
(agents, the engine's stages, the GPU model and accounting), and with `--search` the
oversubscription search (`powerd sim ... --oversubscribe`): its seconds, its runs and the
fit sizes; with `--command`, the whole `powerd sim ... --oversubscribe` command: every
run's CPU, and the wall it takes on --jobs idle cores, as it runs now (the day beside the
search) and as it ran before (in turn). CPU seconds are the process's (and its workers'),
so they hold on a shared machine where wall seconds do not. Figures: docs/performance.md,
"Simulator" and "The whole command".
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
from dataclasses import replace
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
    parser.add_argument(
        "--command",
        action="store_true",
        help="model the whole `powerd sim --oversubscribe` command: every run's CPU, and the "
        "wall it takes on --jobs idle cores with the day's runs beside the search or in turn",
    )
    parser.add_argument(
        "--baselines", default="none", help="with --command: none, or e.g. uncapped,oracle"
    )
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.command:
        _command(args)
        return
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


def _command(args: argparse.Namespace) -> None:
    """`--command`: `powerd sim SCENARIO --policies POLICY --tick-s TICK --oversubscribe
    --points N --baselines B --jobs J` as the command runs it, every run in this process one
    after another (its CPU seconds measured), the workers' clock kept by `_model_runner`: the
    wall the command takes on J idle cores, as it runs now (the day's runs in the background
    beside the search) and as it ran before (in turn: the day's runs, static provisioning,
    then the search). Idle cores, so a figure a shared machine's wall seconds cannot give."""
    from powerd.allocator import kernel
    from powerd.cli.sim import _study
    from powerd.policy import load_policy
    from powerd.sim.baselines import Breaker
    from powerd.sim.report import Report
    from powerd.sim.scenario import load_scenario
    from powerd.sim.site import site_for

    kernel.warm_up()
    scenario = load_scenario(args.scenario, {"duration_h": args.duration_h, "tick_s": args.tick_s})
    assert scenario.policy_path is not None
    site = site_for(scenario, load_policy(scenario.policy_path))
    baselines = [] if args.baselines == "none" else args.baselines.split(",")
    flags = argparse.Namespace(
        policies=[args.policy],
        baselines=baselines,
        budget_sweep=None,
        oversubscribe=True,
        feed_w=None,
        threshold=0.03,
        points=args.points,
        metric="total",
        keep_inner_budgets=False,
    )
    model = _model_runner()
    spent: dict[tuple[Any, ...], tuple[Any, float]] = {}
    walls = {}
    orders = {  # the day's runs in turn; the search's rounds in two batches
        "beside": (False, False),
        "beside, each round in two batches": (False, True),
        "in turn": (True, True),
    }
    schedule = []
    for order, (in_turn, batches) in orders.items():
        runner = model(args.jobs, spent, in_turn=in_turn, batches=batches)
        _study(Report(scenario=scenario, site=site, breaker=Breaker()), flags, runner)
        walls[order] = (runner.now, runner.cpu, runner.runs)
        schedule = schedule or runner.schedule
    print(
        f"{scenario.spec.name}: {site.n_gpus} GPUs, {args.duration_h:g} h of {args.tick_s:g} s "
        f"ticks, {args.policy}, --points {args.points} --baselines {args.baselines} "
        f"--jobs {args.jobs}: the wall on {args.jobs} idle core(s), modelled from each run's CPU"
    )
    for order, (wall, cpu, runs) in walls.items():
        print(f"  {order:34s} {wall:7.1f} s wall  {cpu:7.1f} s CPU in {runs} runs")
    print("  beside, run by run (worker: start-end s, the run, its CPU s):")
    for worker, start, end, key, gpus in sorted(schedule, key=lambda r: (r[1], r[0])):
        print(f"    {worker}: {start:6.1f}-{end:6.1f}  {key} {gpus} GPUs  {end - start:5.1f}")


def _model_runner() -> type:
    from powerd.sim.study import Runner, _Job, run_one

    class ModelRunner(Runner):
        """Runs each task here when a modelled worker takes it (its result and CPU seconds
        kept by task key, `spent`, for the next order), and keeps the clock `jobs` idle
        workers would keep with the runner's own order. As the command ran before:
        `in_turn`, every background `start` waits for its runs at once, and no run is
        shared (static provisioning's run and the search's first size's were two);
        `batches`, the search's rounds in two batches (every size's unconstrained and bound
        runs, then every steered run), each the largest first."""

        def __init__(
            self,
            jobs: int,
            spent: dict[tuple[Any, ...], tuple[Any, float]],
            *,
            in_turn: bool,
            batches: bool,
        ) -> None:
            super().__init__(jobs)
            self.spent, self.in_turn, self.batches = spent, in_turn, batches
            self.now = self.cpu = 0.0
            self.runs = 0
            self.ends: dict[_Job, float] = {}
            self.worker: dict[_Job, int] = {}
            self.schedule: list[tuple[int, float, float, Any, int]] = []

        def _submit(self, tasks: Any, *, foreground: bool, make: Any) -> Any:
            if self.in_turn:
                tasks = [replace(t, run_id=None) for t in tasks]
            pending = super()._submit(tasks, foreground=foreground, make=make)
            if self.in_turn and not foreground:
                pending.result()
            return pending

        def first_done(self, pending: dict[Any, Any]) -> Any:
            if self.batches:
                self._drive(lambda: all(p.done for p in pending.values()))
            return super().first_done(pending)

        def _next(self) -> _Job:
            if not self.batches:
                return super()._next()
            job = min(self._queue, key=lambda j: (not j.foreground, -j.task.site.n_gpus, j.seq))
            self._queue.remove(job)
            return job

        def _drive(self, until: Callable[[], bool]) -> None:
            while not until():
                while self._queue and len(self.ends) < self.jobs:
                    job = self._next()
                    t = job.task
                    key = (t.key, t.site.n_gpus, t.policy, t.steered_steps, t.stop is not None)
                    if key not in self.spent:
                        t0 = time.process_time()
                        self.spent[key] = (run_one(t, None), time.process_time() - t0)
                    job.result, cpu = self.spent[key]
                    self.ends[job] = self.now + cpu
                    busy = set(self.worker.values())
                    self.worker[job] = min(w for w in range(self.jobs) if w not in busy)
                    self.schedule.append(
                        (self.worker[job], self.now, self.now + cpu, t.key, t.site.n_gpus)
                    )
                    self.cpu += cpu
                    self.runs += 1
                first = min(self.ends, key=self.ends.__getitem__)
                self.now = self.ends.pop(first)
                del self.worker[first]
                first.done = True

    return ModelRunner


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
