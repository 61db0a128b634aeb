"""The study runner (powerd/sim/study.py `Runner`): `powerd sim`'s runs started in the
background (the policies on the site, static provisioning) beside the oversubscription
search give what they gave one after another; the search's runs go first; the run that
static provisioning and the search's first size share is run once; a failed run in a
worker ends the command with its error; one progress count covers every run."""

from __future__ import annotations

import multiprocessing
import time
from collections.abc import Callable
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any

import pytest
from support.sim import scenario_dict

from powerd.policy import parse_policy
from powerd.sim import STATIC, study
from powerd.sim.report import Report, to_json
from powerd.sim.run import RunResult
from powerd.sim.scenario import Scenario, parse_scenario
from powerd.sim.site import Site, build_mix, build_site
from powerd.sim.study import (
    Runner,
    Task,
    compare,
    oversubscribe,
    run_one,
    start_compare,
    start_static_provisioning,
    static_provisioning,
)
from powerd.testing.synthetic import policy_dict

FEED_W = 20_000.0
POLICIES = ["fast", STATIC]
BASELINES = ["uncapped", "oracle"]
SEARCH: dict[str, Any] = {"threshold": 0.03, "points": 4, "baselines": BASELINES}


@pytest.fixture(scope="module")
def small() -> tuple[Scenario, Site]:
    scenario = parse_scenario(scenario_dict(duration_h=0.5, tick_s=30), "<small>")
    roomy = parse_policy(policy_dict(2, 2, 2, 4, overhead_w=400.0, fractions=(1, 1, 1, 1)))
    return scenario, build_site(roomy, facility_budget_w=FEED_W)


def in_turn(scenario: Scenario, site: Site, runner: Runner) -> Report:
    """The command's studies one after another, as `powerd sim` ran them before."""
    runs = compare(scenario, site, POLICIES, runner, baselines=BASELINES)
    report = Report(scenario, site, compare={p: runs[p] for p in POLICIES})
    report.baselines = {b: runs[b] for b in BASELINES}  # type: ignore[misc]
    report.provisioned = static_provisioning(scenario, site, runner)
    report.oversub = oversubscribe(scenario, site, POLICIES, runner, **SEARCH)
    return report


def overlapped(scenario: Scenario, site: Site, runner: Runner) -> Report:
    """As `powerd sim` runs them now: the day's runs started, the search, then the day."""
    runs = start_compare(scenario, site, POLICIES, runner, baselines=BASELINES)
    provisioned = start_static_provisioning(scenario, site, runner)
    oversub = oversubscribe(scenario, site, POLICIES, runner, **SEARCH)
    done = runs.result()
    report = Report(scenario, site, compare={p: done[p] for p in POLICIES})
    report.baselines = {b: done[b] for b in BASELINES}  # type: ignore[misc]
    report.provisioned = provisioned.result()
    report.oversub = oversub
    return report


@pytest.mark.process  # worker processes
def test_runs_beside_the_search_give_what_they_gave_in_turn(small: tuple[Scenario, Site]) -> None:
    scenario, site = small
    ticks: list[tuple[int, int]] = []

    def progress(done: int, total: int) -> None:
        ticks.append((done, total))

    before = to_json(in_turn(scenario, site, Runner(jobs=2)))
    with Runner(jobs=2, progress=progress) as runner:
        after = to_json(overlapped(scenario, site, runner))
    assert after == before
    assert after["oversubscribe"]["fit_gpus"]["fast"] > after["oversubscribe"]["static_tdp_gpus"]
    # One count across every worker's runs: it never goes back, never passes the ticks
    # asked for so far, and ends on all of them (stopped runs count their ticks left).
    done = [d for d, _ in ticks]
    assert done == sorted(done)
    assert all(d <= t for d, t in ticks)
    assert ticks[-1][0] == ticks[-1][1] == runner.total_ticks > 0
    # --jobs 1: the same order, one run after another, the same results (its search asks
    # no look-ahead sizes, so its fits are compared, not its points).
    with Runner(jobs=1) as alone:
        serial = to_json(overlapped(scenario, site, alone))
    assert serial["compare"] == before["compare"]
    assert serial["provisioned"] == before["provisioned"]
    assert serial["oversubscribe"]["fit_gpus"] == before["oversubscribe"]["fit_gpus"]
    assert (
        serial["oversubscribe"]["uncapped_fit_gpus"] == before["oversubscribe"]["uncapped_fit_gpus"]
    )


def test_static_provisioning_and_the_searchs_first_size_are_one_run(
    small: tuple[Scenario, Site], monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario, site = small
    import powerd.sim.study as study

    runs: list[Task] = []

    def counted(task: Task, progress: Callable[[int], None] | None) -> RunResult:
        runs.append(task)
        return run_one(task, progress)

    monkeypatch.setattr(study, "run_one", counted)
    runner = Runner(jobs=1)
    base = static_provisioning(scenario, site, runner)
    o = oversubscribe(scenario, site, POLICIES, runner, **SEARCH)
    assert base is not None
    first = o.points[0]
    # The search asked for static provisioning's size (uncapped's bisection starts there).
    assert first.gpus == base.n_gpus == o.static_tdp_gpus
    unconstrained = [t for t in runs if t.policy == STATIC and t.site.n_gpus == base.n_gpus]
    assert [t.key for t in unconstrained] == [("provisioned",)]  # not again as (n, static)
    # The same point as a search that runs that size itself.
    alone = oversubscribe(scenario, site, POLICIES, Runner(jobs=1), **SEARCH)
    assert alone.points[0] == first
    assert first.work_unconstrained_gpu_h == base.work_gpu_s / 3600.0
    # Another site's or feed's static run is another run.
    other = oversubscribe(scenario, site, POLICIES, runner, feed_w=FEED_W - 1000, **SEARCH)
    assert other.points[0].gpus < base.n_gpus
    assert len([t for t in runs if t.key == (other.static_tdp_gpus // 4, STATIC)]) == 1


class _Done:
    """A pool that runs each task when it is submitted, in this process, and records the
    order: which task a runner gives a worker next."""

    def __init__(self, *_: Any, **__: Any) -> None:
        self.order: list[tuple[Any, ...]] = []
        _Done.last = self

    last: _Done

    def submit(self, fn: Callable[[Task], RunResult], task: Task) -> Future[RunResult]:
        self.order.append(task.key)
        fut: Future[RunResult] = Future()
        fut.set_result(run_one(task, None))
        return fut

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        pass


def test_the_searchs_runs_go_first_and_the_background_fills_idle_workers(
    small: tuple[Scenario, Site], monkeypatch: pytest.MonkeyPatch
) -> None:
    scenario, site = small
    import powerd.sim.study as study

    monkeypatch.setattr(study, "ProcessPoolExecutor", _Done)
    mix = build_mix(scenario, site)
    bigger = build_site(site.policy, nodes=12, facility_budget_w=FEED_W)

    def task(key: str, s: Site = site) -> Task:
        return Task((key,), scenario, s, mix if s is site else build_mix(scenario, s), STATIC)

    with Runner(jobs=2) as runner:
        day = runner.start([task("day 1"), task("day 2", bigger)], sorted)
        first = runner.run([task("search 1"), task("search 2", bigger)])
        assert _Done.last.order == [("search 1",), ("search 2",)]  # in the order asked
        second = runner.run([task("search 3")])
        # One search run, two workers: the background's largest run takes the idle one.
        assert _Done.last.order[2:] == [("search 3",), ("day 2",)]
        assert day.result() == [("day 1",), ("day 2",)]
        assert _Done.last.order[4:] == [("day 1",)]
    assert set(first) == {("search 1",), ("search 2",)} and set(second) == {("search 3",)}


def _running(pid: int) -> str | None:
    """The state of process `pid` if it still runs (/proc), None once it is gone or a
    zombie (its status not yet read: it burns nothing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rpartition(")")[2].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return None
    return None if state in ("Z", "X") else state


@pytest.fixture
def reaped(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the workers alive when a stopped runner reaps them."""
    pids: list[int] = []
    reap = study._reap_workers

    def noting(grace_s: float) -> None:
        pids.extend(int(c.pid) for c in multiprocessing.active_children() if c.pid)
        reap(grace_s)

    monkeypatch.setattr(study, "_reap_workers", noting)
    return pids


def assert_gone(pids: list[int]) -> None:
    # Asked of the processes themselves, not of multiprocessing's list of children: that
    # keeps a child whose exit status another waiter took as alive for good.
    assert pids, "the runner reaped no workers"
    left = {pid: state for pid in pids if (state := _running(pid)) is not None}
    assert not left, f"workers still running (pid: state): {left}"


@pytest.mark.process  # worker processes
def test_a_run_that_fails_in_a_worker_ends_the_command_with_its_error(
    small: tuple[Scenario, Site], reaped: list[int]
) -> None:
    scenario, site = small
    mix = build_mix(scenario, site)
    with pytest.raises(ValueError, match="unknown policy 'nonesuch'"), Runner(jobs=2) as runner:
        bad = runner.start([Task(("bad",), scenario, site, mix, "nonesuch")], lambda r: r)
        runner.run([Task(("fast",), scenario, site, mix, "fast")])  # raises here, or:
        bad.result()
    assert_gone(reaped)  # the pool closed, its workers gone


def _stuck(task: Any) -> RunResult:
    """A worker's run that never ticks (as one compiling or building a large site would),
    or fails at once: forked workers see it in place of the module's `_run_task`."""
    if task.key == ("fails",):
        raise ValueError("this run failed")
    time.sleep(120)
    raise AssertionError("not stopped")


@pytest.mark.process  # worker processes
def test_a_stopped_runner_ends_workers_that_do_not_reach_their_next_tick(
    monkeypatch: pytest.MonkeyPatch, reaped: list[int]
) -> None:
    # A worker leaves at its next tick; before, one that did not tick held the command (and
    # Ctrl-C) until its run ended.
    if multiprocessing.get_start_method() != "fork":
        pytest.skip("the stand-in run reaches the workers through fork")
    monkeypatch.setattr(study, "_run_task", _stuck)
    monkeypatch.setattr(study, "ABORT_GRACE_S", 1.0)

    def task(name: str) -> Any:
        site = SimpleNamespace(n_gpus=1)
        return SimpleNamespace(
            key=(name,), site=site, scenario=SimpleNamespace(ticks=1), run_id=None
        )

    started = time.monotonic()
    with pytest.raises(ValueError, match="this run failed"), Runner(jobs=2) as runner:
        runner.run([task("stuck"), task("fails")])
    assert time.monotonic() - started < 30
    assert_gone(reaped)
