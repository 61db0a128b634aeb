"""The oversubscription search (powerd/sim/study.py `_Search`) finds the fit a walk of the
whole grid finds, from fewer sizes: the grid is walked upwards only to a policy's first
failing size, then bisected as before."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import pytest

from powerd.sim.study import _Search


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
