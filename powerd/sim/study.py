"""Studies built from runs: policies side by side, a budget sweep, the oversubscription search.

Runs are independent, so a `Runner` spreads them over processes (`jobs`) and keeps one
progress count in ticks across all of them. Results do not depend on `jobs`.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.sharedctypes
import os
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import structlog

from powerd.policy import Policy
from powerd.sim import BASELINES, DEFAULT_POINTS, DEFAULT_THRESHOLD, ORACLE, STATIC, UNCAPPED
from powerd.sim.baselines import BaselineResult, Breaker, run_baseline
from powerd.sim.run import Progress, RunResult, simulate
from powerd.sim.scenario import Scenario
from powerd.sim.site import Mix, Site, build_mix, build_site

log = structlog.get_logger(__name__)

ProgressHook = Callable[[int, int], None]  # (ticks done, ticks in total)
# What fails a size in the oversubscription search, judged on the size's point.
Fails = Callable[["OversubPoint"], bool]
# `uncapped`'s searches by risk: no breaker trip; draw never over a budget.
NO_TRIP = "no_trip"
NEVER_OVER = "never_over"


@dataclass(frozen=True)
class Task:
    key: tuple[Any, ...]
    scenario: Scenario
    site: Site
    mix: Mix
    policy: str  # a policy, or a baseline (powerd/sim/baselines.py)
    breaker: Breaker | None = None  # baselines: the breakers' model (default Breaker())
    objective: str = "weighted"  # the oracle's: weighted or total work


def run_one(task: Task, progress: Progress | None) -> RunResult:
    """One task: a simulated policy, or a baseline."""
    if task.policy in BASELINES:
        return run_baseline(
            task.policy,
            task.scenario,
            task.site,
            task.mix,
            breaker=task.breaker,
            objective=task.objective,
            progress=progress,
        )
    return simulate(task.scenario, task.site, task.mix, task.policy, progress=progress)


_counter: Any = None
_stop: Any = None  # set by the parent when it stops early (Ctrl-C): workers leave
_parent = 0


def _init_worker(counter: Any, stop: Any) -> None:
    global _counter, _stop, _parent
    _counter, _stop, _parent = counter, stop, os.getppid()


def _tick(n: int) -> None:
    with _counter.get_lock():
        _counter.value += n
    # A worker outlives its parent (killed: SIGTERM) or finishes a run it was told to drop
    # (Ctrl-C) only until its next progress step: no stray processes burning CPU.
    if _stop.value or os.getppid() != _parent:
        os._exit(1)


def _run_task(task: Task) -> RunResult:
    return run_one(task, _tick if _counter is not None else None)


class Runner:
    """Runs tasks, in parallel when jobs > 1, reporting progress in ticks."""

    def __init__(self, jobs: int = 1, progress: ProgressHook | None = None) -> None:
        self.jobs = max(1, jobs)
        self.progress = progress
        self.done_ticks = 0
        self.total_ticks = 0

    def run(self, tasks: Sequence[Task]) -> dict[tuple[Any, ...], RunResult]:
        self.total_ticks += sum(t.scenario.ticks for t in tasks)
        if self.jobs == 1 or len(tasks) <= 1:
            out = {}
            for task in tasks:
                out[task.key] = run_one(task, self._step)
            return out
        return self._parallel(tasks)

    def _step(self, n: int) -> None:
        self.done_ticks += n
        if self.progress is not None:
            self.progress(self.done_ticks, self.total_ticks)

    def _parallel(self, tasks: Sequence[Task]) -> dict[tuple[Any, ...], RunResult]:
        ctx = multiprocessing.get_context()
        counter = ctx.Value("q", 0)
        stop = ctx.Value("b", 0, lock=False)  # one byte, written once
        base = self.done_ticks
        out: dict[tuple[Any, ...], RunResult] = {}
        with ProcessPoolExecutor(
            max_workers=min(self.jobs, len(tasks)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(counter, stop),
        ) as pool:
            # Longest first (most GPUs × ticks), so the last worker does not start last.
            order = sorted(tasks, key=lambda t: -t.site.n_gpus * t.scenario.ticks)
            pending: dict[Future[RunResult], Task] = {pool.submit(_run_task, t): t for t in order}
            try:
                while pending:
                    done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                    for fut in done:
                        out[pending.pop(fut).key] = fut.result()
                    self.done_ticks = base + int(counter.value)
                    if self.progress is not None:
                        self.progress(self.done_ticks, self.total_ticks)
            except BaseException:  # Ctrl-C, or a run that failed: the others stop too
                stop.value = 1
                pool.shutdown(wait=True, cancel_futures=True)
                raise
        return out


# -- policies side by side -----------------------------------------------------------------


def compare(
    scenario: Scenario,
    site: Site,
    policies: Sequence[str],
    runner: Runner,
    *,
    baselines: Sequence[str] = (),
    breaker: Breaker | None = None,
) -> dict[str, RunResult]:
    """Each policy, then each baseline (`uncapped`, `oracle`: BaselineResults), on the site."""
    mix = build_mix(scenario, site)
    names = [*policies, *(b for b in baselines if b not in policies)]
    tasks = [Task((p,), scenario, site, mix, p, breaker=breaker) for p in names]
    results = runner.run(tasks)
    return {p: results[(p,)] for p in names}


def static_provisioning(scenario: Scenario, site: Site, runner: Runner) -> RunResult | None:
    """`static` on as many nodes as the site's feed holds at nameplate (every GPU at its
    TDP): what the same feed buys provisioned as sites are today, the baseline an operator
    judges steering against. None without a finite feed, or room for one node."""
    feed = site.feed_w
    if not math.isfinite(feed):
        return None
    node = next(g for g in site.policy.groups if g.level == 3)
    nodes = int(feed // (node.gpus * site.tdp_w + node.overhead_w))
    if nodes < 1:
        return None
    s = build_site(site.policy, nodes=nodes, facility_budget_w=feed).inner_at_nameplate()
    key = ("provisioned",)
    return runner.run([Task(key, scenario, s, build_mix(scenario, s), STATIC)])[key]


# -- budget sweep --------------------------------------------------------------------------


@dataclass
class SweepPoint:
    fraction: float  # of the site's nameplate
    feed_w: float
    results: dict[str, RunResult]


def budget_sweep(
    scenario: Scenario,
    site: Site,
    fractions: Iterable[float],
    policies: Sequence[str],
    runner: Runner,
) -> list[SweepPoint]:
    """The same site and workloads under feeds of `fraction` × nameplate; every budget in the
    tree is scaled by the same factor (the same design at another feed)."""
    mix = build_mix(scenario, site)
    sites = {f: site.scaled(f * site.nameplate_w) for f in fractions}
    tasks = [Task((f, p), scenario, s, mix, p) for f, s in sites.items() for p in policies]
    results = runner.run(tasks)
    return [
        SweepPoint(f, s.feed_w, {p: results[(f, p)] for p in policies}) for f, s in sites.items()
    ]


# -- how many GPUs fit a feed --------------------------------------------------------------


@dataclass
class OversubPoint:
    nodes: int
    gpus: int
    work_unconstrained_gpu_h: float
    weighted_unconstrained_gpu_h: float
    loss: dict[str, float]  # per steered policy: 1 − its work / unconstrained work
    weighted_loss: dict[str, float]  # the same, weighted by class weight
    over_budget_s: dict[str, float]  # per policy, static included
    trips: dict[str, int] = field(default_factory=dict)  # per run a breaker model watched


@dataclass
class Oversubscription:
    feed_w: float
    threshold: float
    metric: str  # which loss decides: total or weighted
    gpus_per_node: int
    node_nameplate_w: float
    static_tdp_nodes: int  # nodes whose nameplate fits the feed
    max_nodes: int  # beyond this, device minimums plus overhead exceed the feed
    points: list[OversubPoint] = field(default_factory=list)
    fit_nodes: dict[str, int | None] = field(default_factory=dict)
    # `uncapped`'s sizes by risk: the most nodes with draw never over a budget (`never_over`,
    # powerd's own risk: decision 0006) and with no breaker trip (`no_trip`, more risk).
    uncapped_fit_nodes: dict[str, int | None] = field(default_factory=dict)

    def fit_gpus(self, policy: str) -> int | None:
        n = self.fit_nodes.get(policy)
        return None if n is None else n * self.gpus_per_node

    def uncapped_fit_gpus(self, which: str) -> int | None:
        n = self.uncapped_fit_nodes.get(which)
        return None if n is None else n * self.gpus_per_node

    @property
    def static_tdp_gpus(self) -> int:
        return self.static_tdp_nodes * self.gpus_per_node


class _Sizes:
    """The site at each size tried by `oversubscribe`: built, simulated (the unconstrained
    `static` run once a size, each policy once), and its loss against unconstrained."""

    def __init__(
        self,
        scenario: Scenario,
        policy: Policy,
        runner: Runner,
        feed_w: float,
        gpus_per_node: int,
        *,
        keep_inner: bool,
        metric: str,
        breaker: Breaker | None = None,
    ) -> None:
        self.breaker = breaker
        self.scenario = scenario
        self.policy = policy
        self.runner = runner
        self.feed_w = feed_w
        self.gpus_per_node = gpus_per_node
        self.keep_inner = keep_inner
        self.metric = metric
        self.evaluated: dict[int, OversubPoint] = {}

    def _record(
        self,
        n: int,
        which: Sequence[str],
        results: dict[tuple[Any, ...], RunResult | BaselineResult],
    ) -> None:
        pt = self._point(n, results.get((n, STATIC)))
        for p in which:
            r = results.get((n, p))
            if isinstance(r, BaselineResult):
                # Against the same GPUs unconstrained at the baseline's own sub-steps.
                pt.loss[p], pt.weighted_loss[p] = r.loss("total"), r.loss("weighted")
                pt.over_budget_s[p] = r.over_budget_s
                if r.trips is not None:
                    pt.trips[p] = r.trips.trips
            elif r is not None:
                pt.loss[p] = 1.0 - r.work_gpu_s / (pt.work_unconstrained_gpu_h * 3600.0)
                pt.weighted_loss[p] = 1.0 - r.weighted_work_gpu_s / (
                    pt.weighted_unconstrained_gpu_h * 3600.0
                )
                pt.over_budget_s[p] = r.over_budget_s

    def _point(self, n: int, ref: RunResult | None) -> OversubPoint:
        """Size `n`'s point, made from its unconstrained run `ref` the first time."""
        if n not in self.evaluated:
            assert ref is not None
            self.evaluated[n] = OversubPoint(
                nodes=n,
                gpus=n * self.gpus_per_node,
                work_unconstrained_gpu_h=ref.work_gpu_s / 3600.0,
                weighted_unconstrained_gpu_h=ref.weighted_work_gpu_s / 3600.0,
                loss={},
                weighted_loss={},
                over_budget_s={STATIC: ref.over_budget_s},
            )
        return self.evaluated[n]

    def loss(self, n: int, p: str) -> float:
        pt = self.evaluated[n]
        return pt.weighted_loss[p] if self.metric == "weighted" else pt.loss[p]

    def fits(
        self, searches: dict[str, tuple[str, Fails]], grid: Sequence[int]
    ) -> dict[str, int | None]:
        """Per search (its name → the policy it simulates and what fails a size), the most
        nodes its policy passes (`_Search`). Each round simulates every search's next sizes
        in one batch over the runner's jobs: its next grid sizes (as many as the jobs give
        it) or its bisection's midpoint."""
        walks = {k: _Search(grid) for k in searches}
        while True:
            active = [k for k, s in walks.items() if not s.done]
            if not active:
                return {k: s.fit for k, s in walks.items()}
            share = max(1, self.runner.jobs // len(active))
            want: dict[int, list[str]] = {}
            for k in active:
                for n in walks[k].next_sizes(share):
                    which = want.setdefault(n, [])
                    if searches[k][0] not in which:
                        which.append(searches[k][0])
            self.evaluate_each(want)
            for k in active:
                policy, fails = searches[k]
                have = {n: fails(self.evaluated[n]) for n in want if policy in want[n]}
                walks[k].learn(have)

    def evaluate_each(self, want: dict[int, list[str]]) -> None:
        """Simulate each size for its policies (and unconstrained), all in one batch."""
        tasks = []
        for n, which in sorted(want.items()):
            s = build_site(self.policy, nodes=n, facility_budget_w=self.feed_w)
            if not self.keep_inner:
                s = s.inner_at_nameplate()
            mix = build_mix(self.scenario, s)
            have = self.evaluated.get(n)
            tasks += [
                Task((n, p), self.scenario, s, mix, p, breaker=self.breaker, objective=self.metric)
                for p in (STATIC, *which)
                if have is None or (p != STATIC and p not in have.loss)
            ]
        results = self.runner.run(tasks)
        for n, which in want.items():
            self._record(n, which, results)


@dataclass
class _Search:
    """One policy's search for its fit on a grid of sizes: the grid walked upwards to its
    first failing size, then bisection between it and the grid size below it, down to one
    node (fit None: not even the smallest size passes). A size beyond the first failing one
    cannot change the fit, so the walk stops there: the answer is the one a walk of the whole
    grid gives, from fewer runs."""

    grid: Sequence[int]
    i: int = 0  # the next grid index to look at while walking
    good: int = 0
    bad: int | None = None  # bisecting once set
    done: bool = False
    fit: int | None = None
    failed: dict[int, bool] = field(default_factory=dict)  # size → lost over the threshold

    def next_sizes(self, share: int) -> list[int]:
        if self.bad is None:
            return list(self.grid[self.i : self.i + share])
        return [(self.good + self.bad) // 2]

    def learn(self, failed: dict[int, bool]) -> None:
        self.failed.update(failed)
        grid = self.grid
        if self.bad is None:
            while self.i < len(grid) and self.failed.get(grid[self.i]) is False:
                self.i += 1
            if self.i == len(grid):
                self.done, self.fit = True, grid[-1]
                return
            if not self.failed.get(grid[self.i]):
                return  # not simulated yet
            self.good, self.bad = (grid[self.i - 1] if self.i > 0 else 0), grid[self.i]
        else:
            mid = (self.good + self.bad) // 2
            if mid in self.failed:
                if self.failed[mid]:
                    self.bad = mid
                else:
                    self.good = mid
        if self.bad - self.good <= 1:
            self.done, self.fit = True, self.good or None


def oversubscribe(  # noqa: PLR0913 (the search's knobs, keyword-only, each a CLI flag)
    scenario: Scenario,
    site: Site,
    policies: Sequence[str],
    runner: Runner,
    *,
    feed_w: float | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    points: int = DEFAULT_POINTS,
    metric: str = "total",
    keep_inner: bool = False,
    baselines: Sequence[str] = (),
    breaker: Breaker | None = None,
) -> Oversubscription:
    """Grow the site node by node under a fixed feed; per policy, the most nodes whose
    throughput stays within `threshold` of the same GPUs unconstrained (every GPU free to
    draw up to its TDP: the `static` run, ignoring budgets).

    A grid of `points` sizes from static TDP provisioning up to where device minimums fill
    the feed is walked upwards to each policy's first size over the threshold (no further:
    larger sizes cannot change the fit), and the crossing is then bisected to one node.
    Rows, racks and nodes are budgeted at their nameplate, so the feed is the question;
    `keep_inner` keeps the policy's own inner budgets instead (which may bind at any size).
    Baselines: the `oracle` fits by the same threshold (its loss against the same GPUs
    unconstrained at its own sub-steps, its objective the metric's); `uncapped` by risk, the
    most nodes with no breaker trip and with draw never over a budget.
    """
    feed = site.feed_w if feed_w is None else feed_w
    if not math.isfinite(feed):
        raise ValueError("the site has no facility budget: give a feed (--feed-w)")
    node = next(g for g in site.policy.groups if g.level == 3)
    gpn = node.gpus
    node_nameplate = gpn * site.tdp_w + node.overhead_w
    static_nodes = int(feed // node_nameplate)
    max_nodes = int(feed // (gpn * site.min_cap_w + node.overhead_w))
    result = Oversubscription(
        feed_w=feed,
        threshold=threshold,
        metric=metric,
        gpus_per_node=gpn,
        node_nameplate_w=node_nameplate,
        static_tdp_nodes=static_nodes,
        max_nodes=max_nodes,
    )
    steered = [p for p in policies if p != STATIC]
    steered += [b for b in baselines if b == ORACLE]
    lo = max(1, static_nodes)
    if max_nodes < lo:
        return result
    grid = sorted({round(lo + (max_nodes - lo) * k / max(points - 1, 1)) for k in range(points)})
    sizes = _Sizes(
        scenario,
        site.policy,
        runner,
        feed,
        gpn,
        keep_inner=keep_inner,
        metric=metric,
        breaker=breaker,
    )

    def over_threshold(p: str) -> Fails:
        return lambda pt: (pt.weighted_loss[p] if metric == "weighted" else pt.loss[p]) > threshold

    searches: dict[str, tuple[str, Fails]] = {p: (p, over_threshold(p)) for p in steered}
    if UNCAPPED in baselines:
        searches[NO_TRIP] = (UNCAPPED, lambda pt: pt.trips[UNCAPPED] > 0)
        searches[NEVER_OVER] = (UNCAPPED, lambda pt: pt.over_budget_s[UNCAPPED] > 0)
    if searches:
        fits = sizes.fits(searches, grid)
        result.fit_nodes.update({p: fits[p] for p in steered})
        if UNCAPPED in baselines:
            result.uncapped_fit_nodes = {k: fits[k] for k in (NO_TRIP, NEVER_OVER)}
    else:  # static alone: its time over budget at every grid size
        sizes.evaluate_each({n: [] for n in grid})
    result.points = [sizes.evaluated[n] for n in sorted(sizes.evaluated)]
    log.info(
        "sim_oversubscription",
        feed_w=feed,
        static_tdp_gpus=result.static_tdp_gpus,
        fit_gpus={p: result.fit_gpus(p) for p in steered},
        uncapped_fit_gpus={k: result.uncapped_fit_gpus(k) for k in result.uncapped_fit_nodes},
    )
    return result
