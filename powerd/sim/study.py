"""Studies built from runs: policies side by side, a budget sweep, the oversubscription search.

Runs are independent, so a `Runner` spreads them over processes (`jobs`) and keeps one
progress count in ticks across all of them. Results do not depend on `jobs`.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.sharedctypes
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


def _init_worker(counter: Any) -> None:
    global _counter
    _counter = counter


def _tick(n: int) -> None:
    with _counter.get_lock():
        _counter.value += n


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
        base = self.done_ticks
        out: dict[tuple[Any, ...], RunResult] = {}
        with ProcessPoolExecutor(
            max_workers=min(self.jobs, len(tasks)),
            mp_context=ctx,
            initializer=_init_worker,
            initargs=(counter,),
        ) as pool:
            # Longest first (most GPUs × ticks), so the last worker does not start last.
            order = sorted(tasks, key=lambda t: -t.site.n_gpus * t.scenario.ticks)
            pending: dict[Future[RunResult], Task] = {pool.submit(_run_task, t): t for t in order}
            while pending:
                done, _ = wait(pending, timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    out[pending.pop(fut).key] = fut.result()
                self.done_ticks = base + int(counter.value)
                if self.progress is not None:
                    self.progress(self.done_ticks, self.total_ticks)
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
    # `uncapped`'s sizes at the same risk: the most nodes with no breaker trip
    # (`no_trip`), and with draw never over a budget (`never_over`).
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

    def evaluate(self, sizes: Iterable[int], which: Sequence[str]) -> None:
        tasks = []
        for n in sizes:
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
        for n in sizes:
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

    def fit(
        self,
        p: str,
        grid: Sequence[int],
        threshold: float,
        fails: Callable[[OversubPoint], bool] | None = None,
    ) -> int | None:
        """The most nodes on which policy `p` loses at most `threshold` (or, given `fails`,
        where its run does not fail it): the grid's first failing size, then bisection down
        to one node (None: not even the smallest)."""

        def failed(n: int) -> bool:
            if fails is not None:
                return fails(self.evaluated[n])
            return self.loss(n, p) > threshold

        failing = [n for n in grid if failed(n)]
        if not failing:
            return grid[-1]
        bad = failing[0]
        passing = [n for n in grid if n < bad]
        good = passing[-1] if passing else 0
        while bad - good > 1:
            mid = (good + bad) // 2
            self.evaluate([mid], [p])
            if failed(mid):
                bad = mid
            else:
                good = mid
        return good or None


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
    the feed draws the curve; each policy's crossing is then bisected to one node.
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
    evaluated = steered + ([UNCAPPED] if UNCAPPED in baselines else [])
    sizes.evaluate(grid, evaluated)
    for p in steered:
        result.fit_nodes[p] = sizes.fit(p, grid, threshold)
    if UNCAPPED in baselines:
        result.uncapped_fit_nodes = {
            "no_trip": sizes.fit(UNCAPPED, grid, threshold, lambda pt: pt.trips[UNCAPPED] > 0),
            "never_over": sizes.fit(
                UNCAPPED, grid, threshold, lambda pt: pt.over_budget_s[UNCAPPED] > 0
            ),
        }
    result.points = [sizes.evaluated[n] for n in sorted(sizes.evaluated)]
    log.info(
        "sim_oversubscription",
        feed_w=feed,
        static_tdp_gpus=result.static_tdp_gpus,
        fit_gpus={p: result.fit_gpus(p) for p in steered},
        uncapped_fit_gpus={k: result.uncapped_fit_gpus(k) for k in result.uncapped_fit_nodes},
    )
    return result
