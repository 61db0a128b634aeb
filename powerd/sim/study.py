"""Studies built from runs: policies side by side, a budget sweep, the oversubscription search.

Runs are independent, so a `Runner` spreads them over processes (`jobs`), runs some in the
background while others go first (`powerd sim`'s day beside its oversubscription search),
and keeps one progress count in ticks across all of them. Results do not depend on the
order, nor (the search's fits) on `jobs`.
"""

from __future__ import annotations

import math
import multiprocessing
import multiprocessing.sharedctypes
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.policy import Policy
from powerd.sim import (
    BASELINES,
    DEFAULT_POINTS,
    DEFAULT_THRESHOLD,
    ORACLE,
    STATIC,
    STEERED,
    UNCAPPED,
)
from powerd.sim.baselines import BaselineResult, Breaker, run_baseline
from powerd.sim.run import Progress, RunResult, simulate
from powerd.sim.scenario import Scenario
from powerd.sim.site import Mix, Site, build_mix, build_site

log = structlog.get_logger(__name__)

ProgressHook = Callable[[int, int], None]  # (ticks done, ticks in total)
# What fails a size in the oversubscription search, judged on the size's point.
Fails = Callable[["OversubPoint"], bool]
# How far a size's point is past the threshold (its loss − threshold: > 0 fails), for the
# search's secant; None where a search has no such measure (uncapped's, by risk).
Measure = Callable[["OversubPoint"], float]
# `uncapped`'s searches by risk: no breaker trip; draw never over a budget.
NO_TRIP = "no_trip"
NEVER_OVER = "never_over"


Results = dict[tuple[Any, ...], RunResult]
T = TypeVar("T")
K = TypeVar("K")


@dataclass(frozen=True)
class Task:
    key: tuple[Any, ...]
    scenario: Scenario
    site: Site
    mix: Mix
    policy: str  # a policy, or a baseline (powerd/sim/baselines.py)
    breaker: Breaker | None = None  # baselines: the breakers' model (default Breaker())
    objective: str = "weighted"  # the oracle's: weighted or total work
    stop: StopRule | None = None  # a steered run: end it once it provably fails
    steered_steps: bool = False  # `static` in a steered run's steps (a `StopRule`'s bound)
    # Tasks with the same `run_id` are the same run (the same scenario and policy objects,
    # site and settings): a runner runs it once and gives each the same result.
    run_id: tuple[Any, ...] | None = None


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
    result = simulate(
        task.scenario,
        task.site,
        task.mix,
        task.policy,
        progress=progress,
        stop=task.stop,
        steered_steps=task.steered_steps,
    )
    if progress is not None and result.stopped_s is not None:
        progress(task.scenario.ticks - round(result.stopped_s / task.scenario.spec.tick_s))
    return result


_counter: Any = None
_stop: Any = None  # set by the parent when it stops early (Ctrl-C, a failed run): workers leave
_parent = 0


# Seconds a stopped runner's workers get to leave at their next tick before they are ended.
ABORT_GRACE_S = 5.0


def _reap_workers(grace_s: float) -> None:
    """Wait up to `grace_s` for this process's worker processes to end, then end the ones
    left (`multiprocessing.active_children`: the live children multiprocessing started,
    which in `powerd sim` are the runner's workers): SIGTERM, and SIGKILL a second later
    (a forked worker inherits its parent's SIGTERM handler, which may not end it)."""
    deadline = time.monotonic() + grace_s
    for child in multiprocessing.active_children():
        child.join(max(0.0, deadline - time.monotonic()))
    left = multiprocessing.active_children()
    for child in left:
        log.warning("sim_worker_terminated", pid=child.pid)
        child.terminate()
    for child in left:
        child.join(1.0)
        if child.is_alive():
            child.kill()
            child.join()


def _init_worker(counter: Any, stop: Any) -> None:
    global _counter, _stop, _parent
    _counter, _stop, _parent = counter, stop, os.getppid()


def _tick(n: int) -> None:
    with _counter.get_lock():
        _counter.value += n
    # A worker outlives its parent (killed: SIGTERM) or finishes a run it was told to drop
    # (Ctrl-C, another run failed) only until its next progress step: no stray processes
    # burning CPU.
    if _stop.value or os.getppid() != _parent:
        os._exit(1)


def _run_task(task: Task) -> RunResult:
    return run_one(task, _tick if _counter is not None else None)


@dataclass(eq=False)
class _Job:
    task: Task
    foreground: bool  # asked for first (`Runner.run`, `first=True`): before the background
    seq: int  # the order it came in
    done: bool = False
    result: RunResult | None = None

    def order(self) -> tuple[bool, int, int]:
        """The queue's order, the least first: the tasks asked for first, in the order
        asked; then the background's, the largest (GPUs × ticks) first."""
        size = self.task.site.n_gpus * self.task.scenario.ticks
        return (not self.foreground, 0 if self.foreground else -size, self.seq)


class Pending(Generic[T]):
    """Runs started on a `Runner`, and what their results make once they are all in
    (`result`, which waits for them)."""

    def __init__(
        self, runner: Runner, jobs: dict[tuple[Any, ...], _Job], make: Callable[[Results], T]
    ) -> None:
        self._runner = runner
        self._jobs = jobs  # by the key of the task given (a job may be another task's run)
        self._make = make

    @property
    def done(self) -> bool:
        return all(job.done for job in self._jobs.values())

    def result(self) -> T:
        self._runner._drive(lambda: self.done)
        out: Results = {}
        for key, job in self._jobs.items():
            assert job.result is not None
            out[key] = job.result
        return self._make(out)


def _same(results: Results) -> Results:
    return results


class Runner:
    """Runs tasks, in parallel processes when jobs > 1, and keeps one progress count in
    ticks across all of them.

    `run` runs tasks and waits for them; `start` queues tasks and returns at once (a
    `Pending`, whose `result` waits for them), in the background, or with `first` as `run`
    does. A free worker takes the tasks asked for first, in the order asked, and a
    background task (the largest first: GPUs × ticks, so the last worker does not start
    last) only when none of those waits: a chain of them (the oversubscription search's
    rounds) keeps its pace and the background fills the workers it leaves idle. With
    jobs = 1 every task runs at once, in this process, in the order given. Used as a
    context manager, the runner keeps its worker processes from one `run` to the next
    (closed when the block ends; its background tasks not waited for are dropped);
    otherwise each `run` starts and closes its own. Results do not depend on the jobs nor
    the order: every run is a function of its task.
    """

    def __init__(self, jobs: int = 1, progress: ProgressHook | None = None) -> None:
        self.jobs = max(1, jobs)
        self.progress = progress
        self.done_ticks = 0
        self.total_ticks = 0
        self._keep = False  # keep the pool between runs (inside a `with` block)
        self._seq = 0
        self._queue: list[_Job] = []
        self._running: dict[Future[RunResult], _Job] = {}
        self._by_id: dict[tuple[Any, ...], _Job] = {}  # `Task.run_id` → its job
        self._pool: ProcessPoolExecutor | None = None
        self._stop: Any = None
        self._counter: Any = None  # ticks done in workers, over the runner's life
        self._local_ticks = 0  # ticks done in this process

    def __enter__(self) -> Runner:
        self._keep = True
        return self

    def __exit__(self, *exc: object) -> None:
        self._keep = False
        self._close(abort=bool(self._queue or self._running))

    def run(self, tasks: Sequence[Task]) -> Results:
        """Run the tasks and wait for them; before any task started in the background."""
        return self._submit(tasks, foreground=True, make=_same).result()

    def start(
        self, tasks: Sequence[Task], make: Callable[[Results], T], *, first: bool = False
    ) -> Pending[T]:
        """Queue the tasks (with jobs = 1, run them now), in the background unless `first`;
        `make` builds what the caller wants from their results (by task key) once `result`
        is asked."""
        return self._submit(tasks, foreground=first, make=make)

    def first_done(self, pending: dict[K, Pending[Any]]) -> K:
        """Wait until one of them has all its results in: the first such, in their order."""
        self._drive(lambda: any(p.done for p in pending.values()))
        return next(k for k, p in pending.items() if p.done)

    def _submit(
        self, tasks: Sequence[Task], *, foreground: bool, make: Callable[[Results], T]
    ) -> Pending[T]:
        jobs: dict[tuple[Any, ...], _Job] = {}
        for task in tasks:
            job = self._by_id.get(task.run_id) if task.run_id is not None else None
            if job is None:
                job = _Job(task, foreground, self._seq)
                self._seq += 1
                self.total_ticks += task.scenario.ticks
                self._queue.append(job)
                if task.run_id is not None:
                    self._by_id[task.run_id] = job
            job.foreground = job.foreground or foreground
            jobs[task.key] = job
        pending = Pending(self, jobs, make)
        if self.jobs == 1:
            pending.result()
        return pending

    def _drive(self, until: Callable[[], bool]) -> None:
        """Run tasks until `until()`: in this process with jobs = 1 (the queue in its
        order), or where one task alone is queued and no worker is busy; else over the
        pool."""
        if self.jobs == 1 or (self._pool is None and len(self._queue) == 1 and not self._running):
            while not until():
                job = self._queue.pop(0)
                job.result, job.done = run_one(job.task, self._step), True
            return
        try:
            while not until():
                self._fill()
                if not self._running:  # dropped when another run failed
                    raise RuntimeError("the runner stopped: its runs were dropped")
                done, _ = wait(self._running, timeout=0.25, return_when=FIRST_COMPLETED)
                for fut in done:
                    job = self._running.pop(fut)
                    job.result, job.done = fut.result(), True  # a failed run raises here
                self._report()
        except BaseException:  # Ctrl-C, or a run that failed: the others stop too
            self._close(abort=True)
            raise
        if not self._keep and not self._queue and not self._running:
            self._close(abort=False)

    def _fill(self) -> None:
        """Give each idle worker the next task (`_Job.order`), starting the pool if none."""
        if self._pool is None:
            ctx = multiprocessing.get_context()
            if self._counter is None:
                self._counter = ctx.Value("q", 0)
            self._stop = ctx.Value("b", 0, lock=False)  # one byte, written once
            self._pool = ProcessPoolExecutor(
                max_workers=self.jobs,
                mp_context=ctx,
                initializer=_init_worker,
                initargs=(self._counter, self._stop),
            )
        while self._queue and len(self._running) < self.jobs:
            job = self._next()
            self._running[self._pool.submit(_run_task, job.task)] = job

    def _next(self) -> _Job:
        """The queued task a worker takes next (taken off the queue)."""
        job = min(self._queue, key=_Job.order)
        self._queue.remove(job)
        return job

    def _close(self, *, abort: bool) -> None:
        """Close the pool; with `abort`, its workers leave their runs at their next tick and
        the queued runs are dropped."""
        if abort:
            if self._stop is not None:
                self._stop.value = 1
            self._queue.clear()
            self._running.clear()
        if self._pool is not None:
            pool, self._pool = self._pool, None
            if not abort:
                pool.shutdown(wait=True, cancel_futures=True)
                return
            # A worker leaves at its next tick; one that ticks no more (compiling, building
            # its site) must not hold the stop hostage, nor an executor that hangs on a
            # worker gone mid-task: after a grace period, the workers still alive end.
            pool.shutdown(wait=False, cancel_futures=True)
            _reap_workers(ABORT_GRACE_S)

    def _step(self, n: int) -> None:
        self._local_ticks += n
        self._report()

    def _report(self) -> None:
        workers = 0 if self._counter is None else int(self._counter.value)
        self.done_ticks = self._local_ticks + workers
        if self.progress is not None:
            self.progress(self.done_ticks, self.total_ticks)


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
    return start_compare(
        scenario, site, policies, runner, baselines=baselines, breaker=breaker
    ).result()


def start_compare(
    scenario: Scenario,
    site: Site,
    policies: Sequence[str],
    runner: Runner,
    *,
    baselines: Sequence[str] = (),
    breaker: Breaker | None = None,
) -> Pending[dict[str, RunResult]]:
    """`compare`, started in the runner's background."""
    mix = build_mix(scenario, site)
    names = [*policies, *(b for b in baselines if b not in policies)]
    tasks = [Task((p,), scenario, site, mix, p, breaker=breaker) for p in names]
    return runner.start(tasks, lambda results: {p: results[(p,)] for p in names})


def static_provisioning(scenario: Scenario, site: Site, runner: Runner) -> RunResult | None:
    """`static` on as many nodes as the site's feed holds at nameplate (every GPU at its
    TDP): what the same feed buys provisioned as sites are today, the baseline an operator
    judges steering against. None without a finite feed, or room for one node."""
    return start_static_provisioning(scenario, site, runner).result()


def start_static_provisioning(
    scenario: Scenario, site: Site, runner: Runner
) -> Pending[RunResult | None]:
    """`static_provisioning`, started in the runner's background. Its run is the
    oversubscription search's unconstrained run at the grid's first size (the same site,
    `unconstrained_run_id`): a runner runs it once for both."""
    feed = site.feed_w
    node = next(g for g in site.policy.groups if g.level == 3)
    nodes = int(feed // (node.gpus * site.tdp_w + node.overhead_w)) if math.isfinite(feed) else 0
    if nodes < 1:
        return runner.start([], lambda _: None)
    s = sized_site(site.policy, nodes, feed, keep_inner=False)
    key = ("provisioned",)
    run_id = unconstrained_run_id(scenario, site.policy, nodes, feed, keep_inner=False)
    task = Task(key, scenario, s, build_mix(scenario, s), STATIC, run_id=run_id)
    return runner.start([task], lambda results: results[key])


def sized_site(policy: Policy, nodes: int, feed_w: float, *, keep_inner: bool) -> Site:
    """`nodes` of the policy's design under the feed, its rows, racks and nodes budgeted at
    their nameplate unless `keep_inner` (the policy's own inner budgets): the search's site
    of a size, and static provisioning's."""
    s = build_site(policy, nodes=nodes, facility_budget_w=feed_w)
    return s if keep_inner else s.inner_at_nameplate()


def unconstrained_run_id(
    scenario: Scenario, policy: Policy, nodes: int, feed_w: float, *, keep_inner: bool
) -> tuple[Any, ...]:
    """The `Task.run_id` of `static` on `sized_site(policy, nodes, feed_w, keep_inner)`:
    the search's unconstrained run of a size, and at the grid's first size
    `static_provisioning`'s."""
    return (STATIC, id(scenario), id(policy), nodes, feed_w, keep_inner)


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
    return start_budget_sweep(scenario, site, fractions, policies, runner).result()


def start_budget_sweep(
    scenario: Scenario,
    site: Site,
    fractions: Iterable[float],
    policies: Sequence[str],
    runner: Runner,
) -> Pending[list[SweepPoint]]:
    """`budget_sweep`, started in the runner's background."""
    mix = build_mix(scenario, site)
    sites = {f: site.scaled(f * site.nameplate_w) for f in fractions}
    tasks = [Task((f, p), scenario, s, mix, p) for f, s in sites.items() for p in policies]

    def points(results: Results) -> list[SweepPoint]:
        return [
            SweepPoint(f, s.feed_w, {p: results[(f, p)] for p in policies})
            for f, s in sites.items()
        ]

    return runner.start(tasks, points)


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
    # Per steered run: time past what an overload rating allows (RunResult.beyond_rating_s);
    # a size where it is not 0 does not fit, whatever its loss.
    beyond_rating_s: dict[str, float] = field(default_factory=dict)
    trips: dict[str, int] = field(default_factory=dict)  # per run a breaker model watched
    # Per steered run a `StopRule` ended: the hour it stopped at. Its loss and weighted loss
    # are then the least it can have lost (the metric's already over the threshold), its
    # time over budget the time up to that hour.
    stopped_h: dict[str, float] = field(default_factory=dict)
    # And the metric's loss it would have had, lost at its rate so far: the secant's
    # estimate for the search's next size, not a result.
    projected_loss: dict[str, float] = field(default_factory=dict)


# A stop rule's margin, as a share of the unconstrained work: it covers rounding (the same
# sums taken in another order, ~1e-15 of them), and moves a stop by a few ticks at most.
STOP_MARGIN = 1e-6


@dataclass(frozen=True)
class StopRule:
    """Ends a steered run at the first tick where it provably loses more than `threshold`.

    The bound: the same GPUs' `static` run in the steered run's own steps (`simulate`'s
    `steered_steps`) does, tick by tick, at least the work of any run of them capped at or
    below their TDP (every GPU's draw follows min(cap, demand) through the same lag from a
    start no higher, demand depends on time alone, and throughput never falls as draw
    rises). So a steered run's work at the end is at most its work so far plus that run's
    work after this tick; once that is below (1 − threshold) × the unconstrained work (the
    loss's reference, the `static` run in whole ticks), the size fails whatever follows.
    The unconstrained run itself is no such bound: in its whole ticks a GPU whose demand
    rises within a tick draws less than one that steps at the reaction."""

    bound_gpu_s: NDArray[np.float64]  # per tick k: the bound's work up to tick k included
    bound_weighted_gpu_s: NDArray[np.float64]
    unconstrained_gpu_s: float  # the loss's reference
    unconstrained_weighted_gpu_s: float
    threshold: float
    weighted: bool  # the metric that decides

    @classmethod
    def of(cls, bound: RunResult, point: OversubPoint, threshold: float, metric: str) -> StopRule:
        tick_s = bound.duration_s / bound.series.t_h.size
        return cls(
            bound_gpu_s=np.cumsum(bound.series.throughput) * tick_s,
            bound_weighted_gpu_s=np.cumsum(bound.series.weighted_throughput) * tick_s,
            unconstrained_gpu_s=point.work_unconstrained_gpu_h * 3600.0,
            unconstrained_weighted_gpu_s=point.weighted_unconstrained_gpu_h * 3600.0,
            threshold=threshold,
            weighted=metric == "weighted",
        )

    def __call__(self, k: int, work_gpu_s: float, weighted_gpu_s: float) -> bool:
        if self.weighted:
            bound, done, ref = (
                self.bound_weighted_gpu_s,
                weighted_gpu_s,
                self.unconstrained_weighted_gpu_s,
            )
        else:
            bound, done, ref = self.bound_gpu_s, work_gpu_s, self.unconstrained_gpu_s
        most = done + float(bound[-1] - bound[k])
        return most < (1.0 - self.threshold - STOP_MARGIN) * ref

    def least_loss(self, run: RunResult) -> tuple[float, float]:
        """A stopped run's least loss, total and weighted: 1 − (its work so far + the
        bound's work after) / unconstrained work, less the margin."""
        k = run.series.t_h.size - 1
        return (
            1.0
            - (run.work_gpu_s + self._after(self.bound_gpu_s, k)) / self.unconstrained_gpu_s
            - STOP_MARGIN,
            1.0
            - (run.weighted_work_gpu_s + self._after(self.bound_weighted_gpu_s, k))
            / self.unconstrained_weighted_gpu_s
            - STOP_MARGIN,
        )

    def projected_loss(self, run: RunResult) -> float:
        """The metric's loss a stopped run would have kept its share of the bound's work
        at: an estimate, for the search's next size only (never reported as a loss)."""
        k = run.series.t_h.size - 1
        bound, done, ref = (
            (self.bound_weighted_gpu_s, run.weighted_work_gpu_s, self.unconstrained_weighted_gpu_s)
            if self.weighted
            else (self.bound_gpu_s, run.work_gpu_s, self.unconstrained_gpu_s)
        )
        share = done / float(bound[k]) if bound[k] > 0 else 1.0
        return 1.0 - share * float(bound[-1]) / ref

    @staticmethod
    def _after(bound: NDArray[np.float64], k: int) -> float:
        return float(bound[-1] - bound[k])


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


# A size's bound for stop rules: `static` in the steered runs' steps (`StopRule`).
BOUND = "static-bound"


@dataclass(frozen=True)
class _SearchSpec:
    """One search: the policy it simulates, what fails a size, and how far past the
    threshold a size is (None: no such measure; the search then bisects)."""

    policy: str
    fails: Fails
    measure: Measure | None = None


class _Sizes:
    """The site at each size tried by `oversubscribe`: built, simulated (the unconstrained
    `static` run once a size, each policy once), and its loss against unconstrained. With
    `early_stop`, a steered policy's run at a size its search expects to fail stops as soon
    as it provably fails (`StopRule`)."""

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
        threshold: float = DEFAULT_THRESHOLD,
        early_stop: bool = True,
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
        self.threshold = threshold
        self.early_stop = early_stop
        self.evaluated: dict[int, OversubPoint] = {}
        self.bounds: dict[int, RunResult] = {}  # size → its `BOUND` run

    def _record(
        self,
        n: int,
        which: Sequence[str],
        results: dict[tuple[Any, ...], RunResult | BaselineResult],
        rules: dict[tuple[Any, ...], StopRule],
    ) -> None:
        pt = self.evaluated[n]
        for p in which:
            r = results.get((n, p))
            if isinstance(r, BaselineResult):
                # Against the same GPUs unconstrained at the baseline's own sub-steps.
                pt.loss[p], pt.weighted_loss[p] = r.loss("total"), r.loss("weighted")
                pt.over_budget_s[p] = r.over_budget_s
                if r.trips is not None:
                    pt.trips[p] = r.trips.trips
            elif r is not None and r.stopped_s is not None:
                rule = rules[(n, p)]
                pt.loss[p], pt.weighted_loss[p] = rule.least_loss(r)
                pt.projected_loss[p] = max(rule.projected_loss(r), self.loss(n, p))
                pt.over_budget_s[p] = r.over_budget_s
                pt.beyond_rating_s[p] = r.beyond_rating_s
                pt.stopped_h[p] = r.stopped_s / 3600.0
            elif r is not None:
                pt.loss[p] = 1.0 - r.work_gpu_s / (pt.work_unconstrained_gpu_h * 3600.0)
                pt.weighted_loss[p] = 1.0 - r.weighted_work_gpu_s / (
                    pt.weighted_unconstrained_gpu_h * 3600.0
                )
                pt.over_budget_s[p] = r.over_budget_s
                pt.beyond_rating_s[p] = r.beyond_rating_s

    def _point(self, n: int, ref: RunResult) -> OversubPoint:
        """Size `n`'s point, made from its unconstrained run `ref`."""
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

    def fits(self, searches: dict[str, _SearchSpec], grid: Sequence[int]) -> dict[str, int | None]:
        """Per search (its name → what it simulates and judges), the most nodes its policy
        passes (`_Search`). Each round simulates every search's next sizes in one batch over
        the runner's jobs."""
        walks = {
            k: _Search(
                grid,
                secant=spec.measure is not None,
                threshold=self.threshold,
                first_passes=not self.keep_inner,
            )
            for k, spec in searches.items()
        }
        while True:
            active = [k for k, s in walks.items() if not s.done]
            if not active:
                return {k: s.fit for k, s in walks.items()}
            share = max(1, self.runner.jobs // len(active))
            want: dict[int, list[str]] = {}
            doubtful: set[tuple[int, str]] = set()
            for k in active:
                policy = searches[k].policy
                for n in walks[k].next_sizes(share):
                    which = want.setdefault(n, [])
                    if policy not in which:
                        which.append(policy)
                    if walks[k].doubtful(n):
                        doubtful.add((n, policy))
            self.evaluate_each(want, doubtful)
            for k in active:
                spec = searches[k]
                pts = {n: self.evaluated[n] for n in want if spec.policy in want[n]}
                walks[k].learn(
                    {n: spec.fails(pt) for n, pt in pts.items()},
                    {n: spec.measure(pt) for n, pt in pts.items()} if spec.measure else {},
                )

    def _site(self, n: int) -> tuple[Site, Mix]:
        s = sized_site(self.policy, n, self.feed_w, keep_inner=self.keep_inner)
        return s, build_mix(self.scenario, s)

    def evaluate_each(
        self, want: dict[int, list[str]], doubtful: set[tuple[int, str]] | None = None
    ) -> None:
        """Simulate each size for its policies (and unconstrained): first each size's
        unconstrained run, with the bound of the steered runs that `doubtful` names (size,
        policy: its search expects it to fail), and as soon as a size has them, its
        policies' runs, those with a stop rule. All of them before the runner's background,
        the smallest size first (the one most likely to pass, whose steered runs run to
        their end)."""
        stops = {
            (n, p)
            for n, p in doubtful or ()
            if self.early_stop and p in STEERED and p not in self._have(n)
        }
        refs: dict[int, Pending[Results]] = {}
        sites = {n: self._site(n) for n in sorted(want)}
        for n, (s, mix) in sites.items():
            tasks = []
            if n not in self.evaluated:
                run_id = unconstrained_run_id(
                    self.scenario, self.policy, n, self.feed_w, keep_inner=self.keep_inner
                )
                tasks.append(Task((n, STATIC), self.scenario, s, mix, STATIC, run_id=run_id))
            if n not in self.bounds and any(m == n for m, _ in stops):
                tasks.append(Task((n, BOUND), self.scenario, s, mix, STATIC, steered_steps=True))
            refs[n] = self.runner.start(tasks, _same, first=True)
        runs: list[Pending[Results]] = []
        rules: dict[tuple[Any, ...], StopRule] = {}
        while refs:
            n = self.runner.first_done(refs)
            for (_, key), r in refs.pop(n).result().items():
                if key == STATIC:
                    self._point(n, r)
                else:
                    self.bounds[n] = r
            s, mix = sites[n]
            tasks = []
            for p in want[n]:
                if p == STATIC or p in self.evaluated[n].loss:
                    continue
                if (n, p) in stops:
                    rules[(n, p)] = StopRule.of(
                        self.bounds[n], self.evaluated[n], self.threshold, self.metric
                    )
                tasks.append(
                    Task(
                        (n, p),
                        self.scenario,
                        s,
                        mix,
                        p,
                        breaker=self.breaker,
                        objective=self.metric,
                        stop=rules.get((n, p)),
                    )
                )
            runs.append(self.runner.start(tasks, _same, first=True))
        results: Results = {}
        for pending in runs:
            results.update(pending.result())
        for n, which in want.items():
            self._record(n, which, results, rules)

    def _have(self, n: int) -> dict[str, float]:
        pt = self.evaluated.get(n)
        return {} if pt is None else pt.loss


@dataclass
class _Search:
    """One search for a fit on a grid of sizes: the most nodes that pass, where a passing
    size has only passing sizes below it (the loss rises with the size).

    The grid is walked upwards to its first failing size (no further: larger sizes cannot
    change the fit) and the crossing then narrowed to one node: `bad` − `good` = 1, `good`
    passing (or 0: fit None) and `bad` failing. Without a measure (`secant` False) each step
    bisects, as the search always did. With one, the next size is where the line through the
    two known sizes nearest the threshold crosses it (the secant: `good` and `bad`, or while
    walking the two largest passing sizes, never past the next grid size), both sizes beside
    the crossing at once where the jobs allow; an end kept twice weighs half (Illinois), and
    where two steps did not halve the bracket the next bisects (Dekker); the walk starts at
    the grid's second size (`_walk`). Either way the answer is the size whose next one fails, so for
    a loss that rises with the size it is the one the bisection finds, from fewer runs."""

    grid: Sequence[int]
    secant: bool = False
    threshold: float = DEFAULT_THRESHOLD  # a value of −threshold: no loss at all
    good: int = 0  # the largest passing size below `bad` (0: none yet)
    bad: int | None = None  # the smallest failing size (None: none yet)
    done: bool = False
    fit: int | None = None
    failed: dict[int, bool] = field(default_factory=dict)  # size → lost over the threshold
    value: dict[int, float] = field(default_factory=dict)  # size → loss − threshold
    # The ends the secant's steps in a row moved ("good", "bad", "both"); None: the last
    # step was no secant step.
    moved: list[str] | None = None
    secant_step: bool = False  # the sizes asked for last came from the secant
    # With the secant: the grid's first size is taken to pass (static provisioning's, every
    # budget but the feed at nameplate: next to no loss), so it is run only where it would
    # be the fit; should it fail there, the search goes on below it.
    first_passes: bool = False
    widths: list[int] = field(default_factory=list)  # bad − good after each step, once bad

    def _walk(self) -> list[int]:
        """The grid sizes a walk would step to next. With the secant it starts at the
        second: the first, static provisioning's, loses nothing by construction (the
        estimate it starts from), so it is run only where a larger size fails with no
        passing size below it, and with `first_passes` only where it would be the fit
        (the bracket below the first failing size then starts at it)."""
        skip = self.secant and len(self.grid) > 1 and not self.failed
        return [m for m in self.grid[1 if skip else 0 :] if m > self.good and m not in self.failed]

    def _top(self) -> int:
        """The largest size the next step may try: below `bad`, or while walking, the next
        grid size above `good`."""
        if self.bad is not None:
            return self.bad - 1
        return self._walk()[0]

    def _values(self) -> dict[int, float]:
        """The known values, and the first grid size's estimate (no loss) if not known."""
        return {self.grid[0]: -self.threshold, **self.value} if self.secant else self.value

    def crossing(self) -> float | None:
        """Where the line through the two known sizes nearest the threshold crosses it."""
        if not self.secant:
            return None
        if self.bad is not None:
            a, b = self.good, self.bad
        else:
            passing = sorted(n for n, f in self.failed.items() if not f)
            if len(passing) == 1 and passing[0] > self.grid[0]:
                passing.insert(0, self.grid[0])  # from its estimate
            if len(passing) < 2:
                return None
            a, b = passing[-2], passing[-1]
        values = self._values()
        if a not in values or b not in values:
            return None
        va, vb = values[a], values[b]
        if vb <= va or (self.bad is not None and va <= -self.threshold):
            # Not rising; or within the bracket, from a size that lost nothing (where the
            # loss starts to rise is unknown). Beyond the largest passing size a line from
            # such a size still helps: a loss that rises ever faster crosses before it.
            return None
        # Illinois: an end the secant's last steps all kept weighs half as much per step
        # (regula falsi on a convex loss would otherwise creep up to the crossing).
        moved = self.moved or []
        kept = 0
        while kept < len(moved) and moved[-1 - kept] == moved[-1]:
            kept += 1
        if self.bad is not None and moved and moved[-1] == "good":
            vb /= 2.0**kept
        elif self.bad is not None and moved and moved[-1] == "bad":
            va /= 2.0**kept
        return a - va * (b - a) / (vb - va)

    def doubtful(self, n: int) -> bool:
        """Whether size n may well fail: beyond the crossing, or none known yet (but the
        grid's first size, static provisioning's, which only inner budgets could fail)."""
        x = self.crossing()
        return n > x if x is not None else n != self.grid[0]

    def next_sizes(self, share: int) -> list[int]:
        if self.done:
            return []
        lo, hi = self.good + 1, self._top()
        x = self.crossing()
        w = self.widths
        # As Dekker's method: a bisection step where the last two steps did not halve the
        # bracket, so the search takes at most twice the bisection's steps; while walking, a
        # grid step after a secant step that passed.
        slow = len(w) >= 3 and w[-1] > w[-3] / 2 if self.bad is not None else self.moved is not None
        self.secant_step = x is not None and not slow and (self.bad is not None or x < hi)
        if x is not None and self.secant_step:
            n = min(max(math.floor(x), self.good), hi)  # the fit it predicts
            pair = [m for m in (n + 1, n) if lo <= m <= hi and m not in self.failed]
            return pair[: max(1, share)]
        if self.bad is None:
            return self._walk()[:share]
        first = self.grid[0]
        if self.good == 0 and first < self.bad and first not in self.failed:
            if self.secant and self.first_passes and self.bad > first + 1:
                return [(first + self.bad) // 2]  # from the first size, known to pass
            return [first]  # as the walk would have been, had it started there
        return [(self.good + self.bad) // 2]

    def learn(self, failed: dict[int, bool], value: dict[int, float] | None = None) -> None:
        self.failed.update(failed)
        self.value.update(value or {})
        good, bad = self.good, self.bad
        failing = [n for n, f in self.failed.items() if f]
        self.bad = min(failing) if failing else None
        self.good = max(
            (n for n, f in self.failed.items() if not f and (self.bad is None or n < self.bad)),
            default=0,
        )
        ends = [e for e, moved in (("good", self.good != good), ("bad", self.bad != bad)) if moved]
        if self.bad is not None:
            self.widths.append(self.bad - self.good)
        if not self.secant_step:
            self.moved = None
        elif ends:
            self.moved = [*(self.moved or []), ends[0] if len(ends) == 1 else "both"]
        if self.bad is not None and self.bad - self.good <= 1:
            self.done, self.fit = True, self.good or None
        elif self.bad is None and self.good == self.grid[-1]:
            self.done, self.fit = True, self.grid[-1]


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
    secant: bool = True,
    early_stop: bool = True,
) -> Oversubscription:
    """Grow the site node by node under a fixed feed; per policy, the most nodes whose
    throughput stays within `threshold` of the same GPUs unconstrained (every GPU free to
    draw up to its TDP: the `static` run, ignoring budgets).

    A grid of `points` sizes from static TDP provisioning up to where device minimums fill
    the feed is walked upwards to each policy's first size over the threshold (no further:
    larger sizes cannot change the fit), and the crossing is then narrowed to one node
    (`_Search`: by the secant on the loss, `secant`, else by bisection). With `early_stop`,
    a steered run at a size its search expects to fail ends once it provably fails
    (`StopRule`; the point then holds the least loss it can have, and the hour it stopped).
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
        threshold=threshold,
        early_stop=early_stop,
        breaker=breaker,
    )

    def search(p: str) -> _SearchSpec:
        def loss(pt: OversubPoint) -> float:
            return pt.weighted_loss[p] if metric == "weighted" else pt.loss[p]

        return _SearchSpec(
            p,
            lambda pt: loss(pt) > threshold or pt.beyond_rating_s.get(p, 0.0) > 0,
            (lambda pt: pt.projected_loss.get(p, loss(pt)) - threshold) if secant else None,
        )

    searches = {p: search(p) for p in steered}
    if UNCAPPED in baselines:
        searches[NO_TRIP] = _SearchSpec(UNCAPPED, lambda pt: pt.trips[UNCAPPED] > 0)
        searches[NEVER_OVER] = _SearchSpec(UNCAPPED, lambda pt: pt.over_budget_s[UNCAPPED] > 0)
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
