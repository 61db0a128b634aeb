"""Baselines the simulator compares powerd against: one uniform cap, and Dynamo-style
priority bands. Both see the same bounds and budgets as the optimiser (build_problem)."""

from __future__ import annotations

import numpy as np

from powerd.allocator.problem import FloatArray, Problem
from powerd.topology import N_LEVELS

# Bisection on the common cap stops at this width (kW): far below a watt.
_CAP_RESOLUTION_KW = 1e-12


def uniform(problem: Problem, warm: FloatArray | None = None) -> tuple[FloatArray, None]:
    """The largest common cap c (each GPU clipped to its own [lo, hi]) that fits every budget."""
    del warm
    if problem.n == 0:
        return np.zeros(0), None
    lo, hi, tree, capacity = problem.lo, problem.hi, problem.tree, problem.capacity

    def fits(c: float) -> bool:
        return bool(np.all(tree.sums(np.clip(c, lo, hi)) <= capacity))

    low, high = 0.0, float(hi.max())
    if fits(high):
        return hi.copy(), None
    # Group totals are non-decreasing in c and c = 0 gives every GPU its lo, which fits.
    while high - low > _CAP_RESOLUTION_KW:
        mid = 0.5 * (low + high)
        if mid in (low, high):
            break
        if fits(mid):
            low = mid
        else:
            high = mid
    return np.clip(low, lo, hi), None


def priority_bands(problem: Problem, warm: FloatArray | None = None) -> tuple[FloatArray, None]:
    """Facebook Dynamo's scheme: a GPU is capped only where a budget needs it (every GPU
    starts at its maximum, as Dynamo leaves servers uncapped until a breaker's limit
    nears). Nodes first, then up, a group over budget cuts first what its GPUs have above
    their demand, proportionally, then its lowest-priority band below demand,
    proportionally to each GPU's room above its minimum, touching the next band only once
    the lower one is at its minimum."""
    del warm
    lo, hi = problem.lo, problem.hi
    want = np.clip(problem.demand_w / 1000.0, lo, hi)
    p = hi.copy()
    weights, band = np.unique(problem.weight, return_inverse=True)
    n_bands = max(weights.size, 1)
    tree = problem.tree
    n_groups = tree.n_groups
    for level in range(N_LEVELS - 1, -1, -1):
        idx = tree.gpu_groups[:, level]
        excess = np.bincount(idx, weights=p, minlength=n_groups) - problem.capacity
        if not np.any(excess > 0.0):
            continue
        # Power above demand goes first, alike for every band.
        spare = np.maximum(p - want, 0.0)
        pool = np.bincount(idx, weights=spare, minlength=n_groups)
        take = np.clip(excess, 0.0, pool)
        with np.errstate(divide="ignore", invalid="ignore"):
            frac = np.where(pool > 0.0, take / pool, 0.0)
        p = p - spare * frac[idx]
        excess = excess - take
        if not np.any(excess > 0.0):
            continue
        key = idx * n_bands + band
        room = np.bincount(key, weights=p - lo, minlength=n_groups * n_bands)
        room = room.reshape(n_groups, n_bands)
        before = np.cumsum(room, axis=1) - room
        cut = np.clip(np.maximum(excess, 0.0)[:, None] - before, 0.0, room)
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(room > 0.0, cut / room, 0.0)
        p = p - (p - lo) * share.ravel()[key]
    return p, None
