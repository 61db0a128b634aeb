"""The oversubscription search (powerd/sim/study.py `_Search`) finds the fit a walk of the
whole grid finds, from fewer sizes: the grid is walked upwards only to a policy's first
failing size, then bisected as before, or narrowed by the secant on the loss; and a steered
run at a size that fails ends once it provably fails (`StopRule`), with the same fits."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.sim import scenario_dict

from powerd.policy import parse_policy
from powerd.sim import STATIC
from powerd.sim.report import oversub_lines
from powerd.sim.run import RunResult, simulate
from powerd.sim.scenario import Scenario, parse_scenario
from powerd.sim.site import Mix, Site, build_mix, build_site
from powerd.sim.study import OversubPoint, Runner, StopRule, _Search, oversubscribe
from powerd.testing.synthetic import policy_dict


def whole_grid_fit(grid: Sequence[int], fails: Callable[[int], bool]) -> int | None:
    """The search as it was: every grid size simulated, then bisection below the first
    failing one."""
    failing = [n for n in grid if fails(n)]
    if not failing:
        return grid[-1]
    bad = failing[0]
    passing = [n for n in grid if n < bad]
    good = passing[-1] if passing else 0
    while bad - good > 1:
        mid = (good + bad) // 2
        if fails(mid):
            bad = mid
        else:
            good = mid
    return good or None


def search(
    grid: Sequence[int], fails: Callable[[int], bool], share: int
) -> tuple[int | None, set[int]]:
    s = _Search(grid)
    asked: set[int] = set()
    while not s.done:
        sizes = s.next_sizes(share)
        asked.update(sizes)
        s.learn({n: fails(n) for n in sizes})
    return s.fit, asked


@pytest.mark.parametrize("share", [1, 2, 3])
def test_the_search_finds_the_whole_grids_fit_from_fewer_sizes(share: int) -> None:
    rng = random.Random(7)
    saved = 0
    for _ in range(300):
        lo = rng.randint(1, 40)
        hi = lo + rng.randint(0, 60)
        points = rng.randint(2, 9)
        grid = sorted({round(lo + (hi - lo) * k / (points - 1)) for k in range(points)})
        if rng.random() < 0.5:  # loss growing with the size: one crossing
            cross = rng.randint(lo - 2, hi + 2)
            table = {n: n > cross for n in range(hi + 1)}
        else:  # any loss at all (noisy near the crossing)
            table = {n: rng.random() < 0.3 for n in range(hi + 1)}
        fit, asked = search(grid, table.__getitem__, share)
        assert fit == whole_grid_fit(grid, table.__getitem__)
        first_bad = next((k for k, n in enumerate(grid) if table[n]), len(grid) - 1)
        # No grid size beyond the first failing one, but the jobs' look-ahead.
        assert max(asked & set(grid)) <= grid[min(len(grid) - 1, first_bad + share - 1)]
        saved += len(set(grid) - asked)
    assert saved > 0


# -- the secant: the same fit from fewer sizes -----------------------------------------------


def secant_search(
    grid: Sequence[int],
    loss: Callable[[int], float],
    threshold: float,
    share: int,
    *,
    first_passes: bool = False,
) -> tuple[int | None, list[int]]:
    s = _Search(grid, secant=True, threshold=threshold, first_passes=first_passes)
    asked: list[int] = []
    while not s.done:
        sizes = s.next_sizes(share)
        assert sizes and not set(sizes) & set(asked)  # every round asks new sizes
        asked += sizes
        s.learn({n: loss(n) > threshold for n in sizes}, {n: loss(n) - threshold for n in sizes})
    return s.fit, asked


# A grid from `lo` to `lo + width` and a loss that rises with the size: flat at 0 up to
# `flat`, then by random steps, some of them 0.
RISING = {
    "lo": st.integers(1, 40),
    "width": st.integers(0, 80),
    "points": st.integers(2, 9),
    "steps": st.lists(st.floats(0.0, 0.02), min_size=130, max_size=130),
    "flat": st.integers(0, 120),
    "share": st.integers(1, 3),
}


def rising(
    lo: int, width: int, points: int, steps: list[float], flat: int
) -> tuple[list[int], Callable[[int], float]]:
    hi = lo + width
    grid = sorted({round(lo + (hi - lo) * k / (points - 1)) for k in range(points)})
    curve = [0.0] * (flat + 1) + list(itertools.accumulate(steps))
    return grid, lambda n: curve[min(n, len(curve) - 1)]


@settings(max_examples=300, deadline=None)
@given(**RISING)
def test_the_secant_finds_the_bisections_fit_on_any_loss_that_rises(
    lo: int, width: int, points: int, steps: list[float], flat: int, share: int
) -> None:
    """Any loss that rises with the size (`rising`): the secant's fit is the bisection's,
    from sizes on 1..the grid's top, in at most about twice the bisection's steps (its
    guarantee)."""
    grid, loss = rising(lo, width, points, steps, flat)
    fit, asked = secant_search(grid, loss, 0.03, share)
    bisected, bisection_asked = search(grid, lambda n: loss(n) > 0.03, share)
    assert fit == bisected == whole_grid_fit(grid, lambda n: loss(n) > 0.03)
    assert all(1 <= n <= grid[-1] for n in asked)
    assert len(asked) <= 2 * share * len(bisection_asked) + 2


@settings(max_examples=300, deadline=None)
@given(**RISING)
def test_static_provisionings_size_is_run_only_where_it_is_the_fit(
    lo: int, width: int, points: int, steps: list[float], flat: int, share: int
) -> None:
    """Where the grid's first size passes by construction (`first_passes`: every budget at
    nameplate), the search takes it as the bracket's lower end and runs it only where it
    is the fit: the same fit as the bisection that runs it, never more sizes."""
    grid, rises = rising(lo, width, points, steps, flat)

    def loss(n: int) -> float:
        return 0.0 if n <= grid[0] else rises(n)

    fit, asked = secant_search(grid, loss, 0.03, share, first_passes=True)
    ran_first, asked_before = secant_search(grid, loss, 0.03, share)
    assert fit == ran_first == whole_grid_fit(grid, lambda n: loss(n) > 0.03)
    assert (grid[0] in asked) == (fit == grid[0] or len(grid) == 1)
    assert len(asked) <= len(asked_before)


def test_the_secant_asks_fewer_sizes_than_bisection_on_smooth_losses() -> None:
    """Losses shaped as the simulator's are (0 up to a size, then convex): the point of it."""
    rng = random.Random(3)
    grid = [37, 49, 61, 72, 84, 96]  # mixed-50's 6-point grid
    secant = bisection = 0
    for _ in range(300):
        knee, power = rng.uniform(20, 60), rng.uniform(1.0, 2.5)
        scale = 0.03 / (rng.uniform(knee + 1, 100) - knee) ** power

        def loss(n: int, knee: float = knee, power: float = power, scale: float = scale) -> float:
            return scale * max(0.0, n - knee) ** power

        fit, asked = secant_search(grid, loss, 0.03, 1)
        bisected, bisection_asked = search(grid, lambda n: loss(n) > 0.03, 1)
        assert fit == bisected
        secant += len(asked)
        bisection += len(bisection_asked)
    assert secant < bisection


# -- early stop: a steered run ends once it provably fails ------------------------------------

FEED_W = 20_000.0


@pytest.fixture(scope="module")
def small() -> tuple[Scenario, Site]:
    scenario = parse_scenario(scenario_dict(duration_h=1, tick_s=30), "<small>")
    roomy = parse_policy(policy_dict(2, 2, 2, 4, overhead_w=400.0, fractions=(1, 1, 1, 1)))
    return scenario, build_site(roomy, facility_budget_w=FEED_W)


def sized(small: tuple[Scenario, Site], nodes: int) -> tuple[Scenario, Site, Mix]:
    scenario, site = small
    s = build_site(site.policy, nodes=nodes, facility_budget_w=FEED_W).inner_at_nameplate()
    return scenario, s, build_mix(scenario, s)


def test_static_in_the_steered_steps_outworks_every_steered_tick(
    small: tuple[Scenario, Site],
) -> None:
    """The stop rule's bound: tick by tick, no steered run does more work than `static` in
    the same steps, though it may do more than `static` in whole ticks."""
    scenario, site, mix = sized(small, 9)
    bound = simulate(scenario, site, mix, STATIC, steered_steps=True)
    whole = simulate(scenario, site, mix, STATIC)
    for policy in ("fast", "uniform"):
        run = simulate(scenario, site, mix, policy)
        for series in ("throughput", "weighted_throughput"):
            ours, most = getattr(run.series, series), getattr(bound.series, series)
            assert np.all(ours <= most + 1e-9 * np.abs(most).max())
    assert np.any(whole.series.throughput != bound.series.throughput)


@pytest.mark.parametrize("metric", ["total", "weighted"])
def test_a_stopped_run_fails_and_reports_the_least_it_lost(
    small: tuple[Scenario, Site], metric: str
) -> None:
    scenario, site, mix = sized(small, 11)
    ref = simulate(scenario, site, mix, STATIC)
    point = OversubPoint(11, 44, ref.work_gpu_s / 3600, ref.weighted_work_gpu_s / 3600, {}, {}, {})
    bound = simulate(scenario, site, mix, STATIC, steered_steps=True)
    rule = StopRule.of(bound, point, 0.03, metric)
    full = simulate(scenario, site, mix, "fast")
    stopped = simulate(scenario, site, mix, "fast", stop=rule)
    assert full.stopped_s is None
    assert stopped.stopped_s is not None and stopped.stopped_s < full.duration_s
    assert stopped.series.t_h.size * scenario.spec.tick_s == stopped.stopped_s
    losses = (
        1 - full.work_gpu_s / ref.work_gpu_s,
        1 - full.weighted_work_gpu_s / ref.weighted_work_gpu_s,
    )
    least = rule.least_loss(stopped)
    k = 1 if metric == "weighted" else 0
    assert 0.03 < least[k] <= losses[k]
    assert least[1 - k] <= losses[1 - k]
    # The same run, one tick earlier, could not yet prove it.
    ticks = stopped.series.t_h.size
    assert not rule(ticks - 2, *prefix_work(full, ticks - 1))


def prefix_work(run: RunResult, ticks: int) -> tuple[float, float]:
    tick_s = run.duration_s / run.series.t_h.size
    return (
        float(run.series.throughput[:ticks].sum() * tick_s),
        float(run.series.weighted_throughput[:ticks].sum() * tick_s),
    )


@pytest.mark.parametrize(
    ("metric", "keep_inner", "feed_w"),
    [("total", False, FEED_W), ("weighted", False, FEED_W), ("total", True, 24_400.0)],
)
def test_the_search_finds_the_fits_it_found_before(
    small: tuple[Scenario, Site], metric: str, keep_inner: bool, feed_w: float
) -> None:
    """The new search (the secant, runs stopped once they fail) against the old one (grid
    walk and bisection, every run to the end): the same fits, every policy and baseline.
    With the policy's own inner budgets, static provisioning's size already fails, and
    the fits lie below the grid."""
    scenario, site = small
    kw: dict[str, Any] = {"threshold": 0.03, "points": 5, "metric": metric, "feed_w": feed_w}
    kw |= {"keep_inner": keep_inner, "baselines": ["uncapped", "oracle"]}
    if keep_inner:
        site = build_site(parse_policy(policy_dict(2, 2, 2, 4, overhead_w=400.0)))
    new = oversubscribe(scenario, site, ["fast", "uniform"], Runner(), **kw)
    old = oversubscribe(
        scenario, site, ["fast", "uniform"], Runner(), secant=False, early_stop=False, **kw
    )
    assert new.fit_nodes == old.fit_nodes
    assert new.uncapped_fit_nodes == old.uncapped_fit_nodes
    if keep_inner:
        assert any(n is not None and n < new.static_tdp_nodes for n in new.fit_nodes.values())
    stopped = [(pt, p) for pt in new.points for p in pt.stopped_h]
    assert stopped and not any(pt.stopped_h for pt in old.points)
    for pt, p in stopped:
        assert (pt.weighted_loss if metric == "weighted" else pt.loss)[p] > 0.03
        assert 0 < pt.stopped_h[p] < scenario.duration_s / 3600
    table = "\n".join(oversub_lines(new))
    assert "(stopped at" in table
    # Each row shows the loss the search judged by: with --metric weighted, the weighted one.
    by_metric = [(pt, pt.weighted_loss if metric == "weighted" else pt.loss) for pt in new.points]
    shown = 0
    for pt, loss in by_metric:
        row = next(line for line in table.splitlines() if line.startswith(f"{pt.gpus:,} "))
        for p in ("fast", "uniform"):
            if p in loss and p not in pt.stopped_h:
                assert f"{loss[p]:.2%}" in row
                shown += 1
    assert shown
