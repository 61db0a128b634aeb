"""`powerd sim`: a scenario on a policy's site, the policies side by side, sweeps and plots.

The command's flags, progress bar and output; the simulator itself is `powerd.sim` (the
handler calls its studies). The handler returns the exit status: 0 success, 1 a steered
policy exceeded a budget (a bug), 2 bad input.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import structlog

from powerd.argtypes import BREAKER_RATING, int_range, loss_share, positive_float
from powerd.cli.admin import parse_time
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from powerd.cli.extras import require
from powerd.input_errors import InputError
from powerd.outputs import check_out_dir, staged
from powerd.sim import (
    BASELINES,
    DEFAULT_FRACTIONS,
    DEFAULT_POINTS,
    DEFAULT_THRESHOLD,
    METRICS,
    POLICIES,
    STATIC,
)

if TYPE_CHECKING:  # the simulator itself loads with the command (numpy, the tick)
    from powerd.policy import Overload, Policy
    from powerd.sim.baselines import Breaker
    from powerd.sim.report import Report
    from powerd.sim.scenario import Scenario
    from powerd.sim.site import Site
    from powerd.sim.study import Runner

log = structlog.get_logger(__name__)

MAX_DEFAULT_JOBS = 4
CPUS = os.cpu_count() or 1
MAX_SWEEP = 100  # feeds in a budget sweep
MAX_POINTS = 1000  # grid sizes: the search bisects between them, more only cost runs


def _fractions(text_: str) -> list[float]:
    """`0.5,0.75,0.9` or `START:STOP:STEP` (inclusive), as shares of nameplate."""
    try:
        if ":" in text_:
            start, stop, step = (float(x) for x in text_.split(":"))
            if not step > 0 or not stop >= start:  # NaN too
                raise ValueError
            count = round((stop - start) / step) + 1
            if count > MAX_SWEEP:
                raise argparse.ArgumentTypeError(
                    f"'{text_}' is {count:,} feeds; at most {MAX_SWEEP} (a run per feed and "
                    "policy): give a larger STEP"
                )
            values = [round(start + k * step, 10) for k in range(count)]
        else:
            values = [float(x) for x in text_.split(",") if x.strip()]
    except (ValueError, OverflowError):  # OverflowError: an infinite STOP or START
        raise argparse.ArgumentTypeError(
            f"'{text_}': give shares of nameplate as 0.5,0.75,0.9 or START:STOP:STEP"
        ) from None
    if not values or any(not 0 < v <= 2 for v in values):
        raise argparse.ArgumentTypeError(f"'{text_}': every share must be in (0, 2]")
    if len(values) > MAX_SWEEP:
        raise argparse.ArgumentTypeError(
            f"'{text_}' is {len(values):,} feeds; at most {MAX_SWEEP} (a run per feed and policy)"
        )
    return values


def _policies(text_: str) -> list[str]:
    names = [x.strip() for x in text_.split(",") if x.strip()]
    bad = [n for n in names if n not in POLICIES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown policy {', '.join(bad) or '(none)'}; valid: {', '.join(POLICIES)}"
        )
    return list(dict.fromkeys(names))


def _baselines(text_: str) -> list[str]:
    names = [x.strip() for x in text_.split(",") if x.strip()]
    if names == ["none"]:
        return []
    bad = [n for n in names if n not in BASELINES]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown baseline {', '.join(bad) or '(none)'}; valid: {', '.join(BASELINES)}, or none"
        )
    return list(dict.fromkeys(names))


def add_parser(subparsers: Any) -> None:
    """Register `powerd sim` on the top-level subparsers."""
    sim = subparsers.add_parser(
        "sim",
        help="simulate a scenario: powerd against baselines, budget sweeps, how many GPUs fit",
        description="Run the real allocator and safety planner over simulated GPUs in virtual "
        "time and compare policies on the same scenario and seed (docs/simulator.md).",
    )
    sim.add_argument("scenario", help="scenario YAML file (e.g. policies/scenarios/*.yaml)")
    sim.add_argument("--policy", help="policy YAML file (default: the scenario's `policy`)")
    sim.add_argument(
        "--policies",
        type=_policies,
        default=list(POLICIES),
        help=f"comma-separated, default {','.join(POLICIES)}",
    )
    sim.add_argument(
        "--baselines",
        type=_baselines,
        default=list(BASELINES),
        help="what a site would do without powerd, beside the policies and in "
        "--oversubscribe: uncapped (no caps, judged by breakers), oracle (perfect foresight, "
        f"the upper bound); default {','.join(BASELINES)}; none to skip",
    )
    sim.add_argument(
        "--breaker-rating",
        type=BREAKER_RATING,
        default=1.0,
        metavar="SHARE",
        help="every budgeted group's breaker rating as a share of its budget, at least 1 "
        "(default %(default)s; 1.25 where the budget is NEC's 80 %% continuous load)",
    )
    sim.add_argument(
        "--restore-s",
        type=positive_float,
        help="seconds from a breaker trip until the group's GPUs work again (default 1800: "
        "reset, reboot, restart from the last checkpoint)",
    )
    sim.add_argument("--seed", type=int, help="override the scenario's seed")
    sim.add_argument("--duration-h", type=positive_float, help="override the simulated duration")
    sim.add_argument("--tick-s", type=positive_float, help="override the simulated tick")
    _add_study_arguments(sim)
    _add_recording_arguments(sim)
    _add_output_arguments(sim)
    sim.set_defaults(handler=cmd_sim, needs="sim")


def _add_study_arguments(sim: argparse.ArgumentParser) -> None:
    """What to study beyond the comparison: a budget sweep, the oversubscription search."""
    sim.add_argument(
        "--budget-sweep",
        nargs="?",
        const=list(DEFAULT_FRACTIONS),
        type=_fractions,
        metavar="SHARES",
        help="also sweep the feed over shares of nameplate (default "
        f"{','.join(f'{f:g}' for f in DEFAULT_FRACTIONS)}): throughput vs power",
    )
    sim.add_argument(
        "--oversubscribe",
        action="store_true",
        help="also find how many GPUs each policy runs under the feed within --threshold loss",
    )
    sim.add_argument(
        "--feed-w", type=positive_float, help="feed for --oversubscribe (default: site's)"
    )
    sim.add_argument(
        "--threshold",
        type=loss_share,
        default=DEFAULT_THRESHOLD,
        help="throughput loss allowed by --oversubscribe, a share between 0 and 1 (default "
        "%(default)s: 3 %%)",
    )
    sim.add_argument(
        "--metric",
        choices=METRICS,
        default="total",
        help="loss measured on total or on priority-weighted throughput (default %(default)s)",
    )
    sim.add_argument(
        "--keep-inner-budgets",
        action="store_true",
        help="--oversubscribe with the policy's row/rack/node budgets (default: at nameplate)",
    )
    sim.add_argument(
        "--points",
        type=int_range(2, MAX_POINTS),
        default=DEFAULT_POINTS,
        help=f"site sizes on the oversubscription grid, 2 to {MAX_POINTS} (default %(default)s)",
    )


def _add_recording_arguments(sim: argparse.ArgumentParser) -> None:
    """A controller's recorded draw as the demand, and overload ratings on the policy."""
    sim.add_argument(
        "--from-db",
        help="replay the per-minute draw a controller recorded in this database (SQLAlchemy "
        "URL) as the GPUs' demand; the scenario's workloads still give their classes",
    )
    sim.add_argument(
        "--since", type=parse_time, help="start of the recording (epoch s or ISO time with zone)"
    )
    sim.add_argument("--until", type=parse_time, help="end of the recording")
    sim.add_argument(
        "--overload",
        type=overload_arg,
        metavar="PCT:SECONDS[:TARGET[:RISE]]",
        help="rate every budgeted group for PCT %% above its budget for SECONDS (policy key "
        "`overload`): caps commit above the budgets, draw is steered TARGET %% (default 3) "
        "below them, only the reservation unused all the last RISE s (default 30) lent",
    )


def _add_output_arguments(sim: argparse.ArgumentParser) -> None:
    """The learning study instead, what is printed and written, and how the runs run."""
    sim.add_argument(
        "--learning",
        action="store_true",
        help="instead of comparing policies: how online learning recovers from the policy's "
        "profiles (learning off, on, and steering by the workloads' true curves); writes "
        "learning.json and learning.png under --out",
    )
    sim.add_argument("--json", action="store_true", help="print the results as JSON")
    sim.add_argument("--out", help="directory for PNG plots, report.html and results.json")
    sim.add_argument(
        "--jobs",
        type=int_range(1, CPUS, "this machine's CPUs: more processes only add memory"),
        default=min(CPUS, MAX_DEFAULT_JOBS),
        help=f"runs in parallel processes, 1 to the CPUs ({CPUS}) (default: CPUs, at most 4)",
    )
    sim.add_argument(
        "--progress",
        choices=("auto", "always", "never"),
        default="auto",
        help="progress bar on stderr (auto: when stderr is a terminal)",
    )


class FlagError(InputError):
    """A flag whose value cannot be used with this scenario: the flag, and what would do."""

    kind = "argument"


class ProgressBar:
    """One line on stderr, redrawn at most ten times a second."""

    def __init__(self, out: TextIO, width: int = 30) -> None:
        self.out = out
        self.width = width
        self.started = time.monotonic()
        self.last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < 0.1 and done < total:
            return
        self.last = now
        share = done / total if total else 1.0
        filled = int(share * self.width)
        elapsed = now - self.started
        eta = elapsed / share - elapsed if share > 0 else 0.0
        self.out.write(
            f"\r[{'#' * filled}{'.' * (self.width - filled)}] {share:4.0%} "
            f"{done:,}/{total:,} ticks, {elapsed:.0f} s, about {eta:.0f} s left "
        )
        self.out.flush()

    def close(self) -> None:
        self.out.write("\r" + " " * (self.width + 60) + "\r")
        self.out.flush()


def overload_arg(text: str) -> Overload:
    """PCT:SECONDS[:TARGET[:RISE]], as `overload: {pct, for_s, target_pct, rise_s}` in a
    policy (TARGET: the share below the budget the measured draw is steered to, default 3;
    RISE: lend only the reservation unused all that many seconds, default 30)."""
    require("powerd sim", "sim")  # Overload is the policy's model (numpy): refuse as `sim` does
    from pydantic import ValidationError

    from powerd.input_errors import validation_problems
    from powerd.policy import Overload

    parts = text.split(":")
    names = {"pct": "PCT", "for_s": "SECONDS", "target_pct": "TARGET", "rise_s": "RISE"}
    try:
        if len(parts) not in (2, 3, 4):
            raise ValueError("no ':'" if len(parts) == 1 else "more than three ':'")
        fields = dict(zip(names, (float(p) for p in parts), strict=False))
        return Overload.model_validate(fields)
    except ValidationError as exc:  # which part, and its range
        why = "; ".join(
            f"{names.get(path, path)} {msg[0].lower()}{msg[1:]}"
            for path, msg in validation_problems(exc)
        )
    except ValueError as exc:
        why = str(exc)
    raise argparse.ArgumentTypeError(
        f"{text!r}: want PCT:SECONDS[:TARGET[:RISE]], e.g. 5:30 (5 % above the budget for "
        f"30 s; draw steered TARGET %, default 3, below it; only what stayed unused the last "
        f"RISE s lent, default 30): {why}"
    )


def cmd_sim(args: argparse.Namespace) -> int:
    try:
        return _run(args)
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT


def _scenario_and_policy(args: argparse.Namespace) -> tuple[Scenario, Policy]:
    """The scenario with the command line's overrides, and the policy it runs on."""
    from powerd.policy import load_policy, with_overload
    from powerd.sim.recorded import read_recording
    from powerd.sim.scenario import ScenarioError, check_against_policy, load_scenario

    overrides = {"seed": args.seed, "duration_h": args.duration_h, "tick_s": args.tick_s}
    scenario = load_scenario(args.scenario, overrides)
    path = args.policy if args.policy is not None else scenario.policy_path
    if path is None:
        raise ScenarioError(
            scenario.source, [("policy", "no policy: add `policy: FILE` or give --policy")]
        )
    policy = load_policy(path)
    if args.overload is not None:
        policy = with_overload(policy, args.overload)
    check_against_policy(scenario, policy)
    for i, window in enumerate(scenario.spec.schedule):
        if window.start_h >= scenario.spec.duration_h:  # e.g. a shorter --duration-h
            print(
                f"powerd sim: schedule[{i}] ({window.start_h:g} to {window.end_h:g} h) starts "
                f"after the simulation ends ({scenario.spec.duration_h:g} h): not simulated",
                file=sys.stderr,
            )
    if args.from_db is not None:
        recording = read_recording(args.from_db, args.since, args.until)
        if recording.skipped:
            print(
                f"powerd sim: {len(recording.skipped)} recorded GPU(s) with fewer than two "
                "minutes in the window are left out",
                file=sys.stderr,
            )
        scenario = replace(scenario, recording=recording)
    return scenario, policy


def _run(args: argparse.Namespace) -> int:
    from powerd.sim.report import Report
    from powerd.sim.scenario import ScenarioError
    from powerd.sim.site import check_minimums_fit, check_mix_fits, site_for
    from powerd.sim.study import Runner

    scenario, policy = _scenario_and_policy(args)
    if args.out:
        check_out_dir(Path(args.out))
    site = site_for(scenario, policy)
    check_minimums_fit(scenario, site)
    check_mix_fits(scenario, site)
    if args.oversubscribe:
        _check_feed(site, args.feed_w)
    if args.learning:
        return _learning(scenario, site, args)
    t0 = time.perf_counter()
    _warm_up(scenario, site)
    show = args.progress == "always" or (args.progress == "auto" and sys.stderr.isatty())
    bar = ProgressBar(sys.stderr) if show else None
    report = Report(scenario=scenario, site=site, breaker=_breaker(args))
    try:
        with Runner(jobs=args.jobs, progress=bar) as runner:
            _study(report, args, runner)
    except ValueError as exc:
        raise ScenarioError(scenario.source, [("", str(exc))]) from None
    finally:
        if bar is not None:
            bar.close()
    report.wall_s = time.perf_counter() - t0
    _show(report, args)
    log.info("sim_finished", scenario=scenario.spec.name, wall_s=round(report.wall_s, 2))
    steered = {p: r for p, r in report.compare.items() if p != STATIC}
    # Over a budget within its rating (`overload`) is what the rating is for; past it, or
    # committed caps above a limit, is a failure.
    steered_over = [
        p for p, r in steered.items() if r.beyond_rating_s > 0 or r.committed_over_ticks > 0
    ]
    if steered_over:
        log.error("sim_budget_exceeded", policies=steered_over)
        return EXIT_FAILED
    rated_over = {p: r.over_budget_s for p, r in steered.items() if r.over_budget_s > 0}
    if rated_over:
        log.info("sim_over_budget_within_rating", over_budget_s=rated_over)
    return EXIT_OK


COMPILING = (
    "powerd sim: compiling the allocator's and the simulator's kernels (once per install: "
    "numba caches them; `powerd warm` does the allocator's ahead) ..."
)


def _warm_up(scenario: Scenario, site: Site) -> None:
    """The kernels compiled (or loaded) here, before any worker starts: each worker would
    otherwise compile them at once on a fresh install, and say nothing of why its first
    run is slow. Says so on stderr when it compiles."""
    from powerd.sim.run import warm_up

    def compiling() -> None:
        print(COMPILING, file=sys.stderr, flush=True)

    seconds = warm_up(scenario, site, compiling)
    log.info("sim_kernels_ready", seconds=round(seconds, 2))


def _study(report: Report, args: argparse.Namespace, runner: Runner) -> None:
    """The report's runs. The policies and baselines on the site, static provisioning and
    the budget sweep start in the runner's background; the oversubscription search's
    rounds, one after another, go first on the workers and the background fills the rest
    (with --jobs 1, everything in this order, one run after another)."""
    from powerd.sim.baselines import BaselineResult
    from powerd.sim.study import (
        oversubscribe,
        start_budget_sweep,
        start_compare,
        start_static_provisioning,
    )

    scenario, site, breaker = report.scenario, report.site, report.breaker
    policies: list[str] = args.policies
    baselines: list[str] = args.baselines
    runs = start_compare(scenario, site, policies, runner, baselines=baselines, breaker=breaker)
    provisioned = start_static_provisioning(scenario, site, runner)
    sweep = (
        start_budget_sweep(scenario, site, args.budget_sweep, policies, runner)
        if args.budget_sweep
        else None
    )
    if args.oversubscribe:
        report.oversub = oversubscribe(
            scenario,
            site,
            policies,
            runner,
            feed_w=args.feed_w,
            threshold=args.threshold,
            points=args.points,
            metric=args.metric,
            keep_inner=args.keep_inner_budgets,
            baselines=baselines,
            breaker=breaker,
        )
    done = runs.result()
    report.compare = {p: done[p] for p in policies}
    report.baselines = {b: r for b in baselines if isinstance(r := done[b], BaselineResult)}
    report.provisioned = provisioned.result()
    if sweep is not None:
        report.sweep = sweep.result()


def _check_feed(site: Site, feed_w: float | None) -> None:
    """The search's feed runs at least one node and at most a site the simulator builds:
    checked before any run, rather than after hours of them (or a search that never ends)."""
    from powerd.sim.scenario import MAX_NODES

    feed = site.feed_w if feed_w is None else feed_w
    flag = "--feed-w" if feed_w is not None else "--oversubscribe"
    if not math.isfinite(feed):
        raise FlagError(flag, [("", "the site has no facility budget: give --feed-w WATTS")])
    node_min = site.node_min_w()
    if feed < node_min:
        raise FlagError(
            flag,
            [
                (
                    "",
                    f"a {feed:,.0f} W feed runs no node, even at device minimums "
                    f"({node_min:,.0f} W a node): give at least {node_min:,.0f} W",
                )
            ],
        )
    if feed // node_min > MAX_NODES:
        raise FlagError(
            flag,
            [
                (
                    "",
                    f"a {feed:,.0f} W feed holds {feed // node_min:,.0f} nodes at device minimums; "
                    f"the search grows a site up to {MAX_NODES:,} nodes: give at most "
                    f"{MAX_NODES * node_min:,.0f} W",
                )
            ],
        )


def _breaker(args: argparse.Namespace) -> Breaker:
    from powerd.sim.baselines import RESTORE_S, Breaker

    restore = RESTORE_S if args.restore_s is None else args.restore_s
    return Breaker(rating=args.breaker_rating, restore_s=restore)


def _learning(scenario: Scenario, site: Site, args: argparse.Namespace) -> int:
    """`--learning`: three runs (learning off, on, true curves) and the recovery figure."""
    from powerd.sim.learning import learning_study, plot_learning
    from powerd.sim.scenario import ScenarioError
    from powerd.sim.site import build_mix

    try:
        study = learning_study(scenario, site, build_mix(scenario, site))
    except ValueError as exc:
        raise ScenarioError(scenario.source, [("", str(exc))]) from None
    doc = study.to_json()
    if args.out:
        with staged(Path(args.out)) as out:
            (out / "learning.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
            plot_learning(study, out / "learning.png")
    if args.json:
        print(json.dumps({k: v for k, v in doc.items() if k != "series"}, indent=2))
    else:
        print("\n".join(study.lines()))
    return EXIT_OK


def _show(report: Report, args: argparse.Namespace) -> None:
    """The report as text or JSON on stdout, and its files under --out."""
    from powerd.sim.report import text, to_json, write_outputs

    doc = to_json(report)
    if args.out:
        with staged(Path(args.out)) as out:
            written = write_outputs(report, out)
            (out / "results.json").write_text(json.dumps(doc, indent=2), encoding="utf-8")
        names = [p.name for p in written] + ["results.json"]
        log.info("sim_outputs_written", files=[str(Path(args.out) / n) for n in names])
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(text(report))
