"""The exact tree solver: nested water-filling on the budgets' multipliers, level by level.

With price λ per kW on a GPU (the sum of the multipliers of the groups above it), its best
cap maximises f(p) − λp with f = weighted utility + δp − ε(p − prev)². Written per segment,
in the scaled price u = λ / 2ε (kW), the response is

    p(u) = lo + Σ_k clip(a_k − u, 0, len_k),    a_k = prev − start_k + (slope_k + δ) / 2ε

continuous, non-increasing and piecewise linear in u, with slope −1 while a segment is
partly filled. A group v whose ancestors charge u draws T_v(u) = min(capacity_v,
Σ_children T_c(u)), so each multiplier is zero or the root of a monotone piecewise-linear
equation. Levels are solved top-down, all groups of a level at once, each with a
safeguarded Newton step (bisection when Newton would leave the bracket). Newton lands
exactly once the bracket holds a single linear piece, so a few passes over the GPUs per
level suffice; each pass is a handful of numpy operations on (K, n) arrays.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from powerd.allocator import jobs as _jobs
from powerd.allocator.model import TOL_KW, BoolArray, FloatArray, IntArray, Problem
from powerd.topology import N_LEVELS

MAX_ITERATIONS = 200
# Relative residual at which a group counts as solved: sums of 1e5 caps carry ~1e-12.
REL_TOL = 1e-13
# Passes drop the GPUs of solved groups once fewer than this share of groups is left.
SHRINK_SHARE = 0.5


@dataclass
class _Pass:
    """One evaluation at given prices: caps, and for every group at or below the level
    evaluated, Σ_children T_c (children clamped to capacity) and its slope magnitude."""

    p: FloatArray
    sums: FloatArray
    slopes: FloatArray


@dataclass
class _Part:
    """The GPUs a pass evaluates: all of them, or those under groups still being solved."""

    a: FloatArray
    lengths: FloatArray
    lo: FloatArray
    node: IntArray  # node group of each GPU
    base: FloatArray  # price from the levels already solved
    gidx: IntArray  # group of each GPU at the level being solved

    def __post_init__(self) -> None:
        # Scratch space reused by every pass: fresh (K, n) arrays each pass cost page faults.
        self.t = np.empty_like(self.a)
        self.inside = np.empty(self.a.shape, dtype=np.bool_)
        self.full = np.empty(self.a.shape, dtype=np.bool_)

    def take(self, keep: BoolArray) -> _Part:
        idx = np.flatnonzero(keep)
        return _Part(
            a=np.ascontiguousarray(self.a[:, idx]),
            lengths=np.ascontiguousarray(self.lengths[:, idx]),
            lo=self.lo[idx],
            node=self.node[idx],
            base=self.base[idx],
            gidx=self.gidx[idx],
        )


class _Response:
    def __init__(self, problem: Problem) -> None:
        self.tree = problem.tree
        self.capacity = problem.capacity
        inv = 1.0 / (2.0 * problem.eps)
        a = np.add(problem.slopes, problem.delta)
        a *= inv
        a -= problem.starts
        a += problem.prev
        # Above this price a GPU sits at lo: segment 0 starts lowest with the steepest slope.
        self.top = a[0]
        self.all = _Part(
            a=a,
            lengths=problem.lengths,
            lo=problem.lo,
            node=self.tree.node_of_gpu,
            base=np.zeros(problem.n),
            gidx=self.tree.gpu_groups[:, 0],
        )
        self.lo_sums = self.tree.sums(problem.lo)

    def at(self, part: _Part, u: FloatArray, level: int) -> _Pass:
        t = np.subtract(part.a, u, out=part.t)
        np.maximum(t, 0.0, out=t)
        np.minimum(t, part.lengths, out=t)
        p = part.lo + t.sum(axis=0)
        # Segment intervals of one GPU are disjoint in u, so at most one is partly filled.
        inside = np.greater(t, 0.0, out=part.inside)
        inside &= np.less(t, part.lengths, out=part.full)
        partial = np.logical_or.reduce(inside, axis=0)
        tree = self.tree
        n_groups = tree.n_groups
        s = np.bincount(part.node, weights=p, minlength=n_groups).astype(np.float64)
        ds = np.bincount(part.node, weights=partial, minlength=n_groups).astype(np.float64)
        for lv in range(N_LEVELS - 1, level, -1):
            g = tree.levels[lv]
            cap = self.capacity[g]
            clamped = s[g] > cap
            s += np.bincount(tree.parents[lv], np.where(clamped, cap, s[g]), n_groups)
            ds += np.bincount(tree.parents[lv], np.where(clamped, 0.0, ds[g]), n_groups)
        return _Pass(p, s, ds)


def solve(problem: Problem, warm: FloatArray | None = None) -> tuple[FloatArray, FloatArray]:
    """Optimal caps (kW) and each group's multiplier λ per kW (`warm`: last tick's).

    With jobs the tree's levels are coupled, and jobs.solve (semismooth Newton) answers."""
    if problem.jobs is not None:
        start = None if warm is not None else solve(replace(problem, jobs=None))[1]
        return _jobs.solve(problem, warm, start)
    n_groups = problem.tree.n_groups
    mu = np.zeros(n_groups)
    if problem.n == 0:
        return np.zeros(0), mu
    resp = _Response(problem)
    tree = problem.tree
    part = resp.all
    current = resp.at(part, part.base, 0)
    inv = 1.0 / (2.0 * problem.eps)
    for level in range(N_LEVELS):
        groups = tree.levels[level]
        part.gidx = tree.gpu_groups[:, level]
        start = None if warm is None else warm[groups] * inv
        x, current, exact = _solve_level(
            resp, part, groups=groups, level=level, current=current, start=start
        )
        mu[groups] = x
        part.base = part.base + mu[part.gidx]
        if not exact:
            current = resp.at(part, part.base, min(level + 1, N_LEVELS - 1))
    return current.p, mu * 2.0 * problem.eps


def _solve_level(
    resp: _Response,
    everyone: _Part,
    *,
    groups: IntArray,
    level: int,
    current: _Pass,
    start: FloatArray | None,
) -> tuple[FloatArray, _Pass, bool]:
    """Multipliers (in u) of all groups of one level at once, given the pass at zero.

    Returns them, the last pass, and whether that pass covered every GPU at exactly these
    multipliers (then the next level reuses it instead of evaluating again). Once most
    groups are solved, passes cover only the GPUs under the others.
    """
    part = everyone
    cap = resp.capacity[groups]
    s, ds = current.sums[groups], current.slopes[groups]
    tol = np.maximum(TOL_KW, REL_TOL * np.where(np.isfinite(cap), cap, 0.0))
    todo: BoolArray = s > cap + tol
    x = np.zeros(groups.size)
    if not todo.any():
        return x, current, True
    # At this price every GPU is at lo, and lo fits every capacity (build_problem saw to it).
    upper = max(float(np.max(resp.top - part.base)), 0.0) + 1.0
    lo_b = np.zeros(groups.size)
    hi_b = np.full(groups.size, upper)
    f_lo = s - cap  # residuals at the bracket's ends (f_hi: all GPUs at lo)
    f_hi = resp.lo_sums[groups] - cap
    kept = np.zeros(groups.size, dtype=np.int8)  # side kept last time: +1 lo, -1 hi
    full = np.zeros(resp.tree.n_groups)
    covered = groups.size  # groups under the GPUs of `part`
    first = None
    if start is not None:
        first = todo & (start > 0.0) & (start < upper)
    for _ in range(MAX_ITERATIONS):
        with np.errstate(divide="ignore", invalid="ignore"):
            newton = x + (s - cap) / ds
            # Illinois false position: Newton overshoots where the slope changes fast.
            falsi = lo_b + f_lo / (f_lo - f_hi) * (hi_b - lo_b)
        inside = (newton > lo_b) & (newton < hi_b) & (ds > 0.0)
        fallback = np.where((falsi > lo_b) & (falsi < hi_b), falsi, 0.5 * (lo_b + hi_b))
        step = np.where(inside, newton, fallback)
        if first is not None and start is not None:
            # Warm start: last tick's multiplier is the first guess.
            step = np.where(first, start, step)
            first = None
        x = np.where(todo, step, x)
        full[groups] = x
        current = resp.at(part, part.base + full[part.gidx], level)
        s, ds = current.sums[groups], current.slopes[groups]
        f = s - cap
        over = todo & (f > 0.0)
        under = todo & ~(f > 0.0)
        lo_b = np.where(over, x, lo_b)
        f_lo = np.where(over, f, np.where(under & (kept == 1), 0.5 * f_lo, f_lo))
        hi_b = np.where(under, x, hi_b)
        f_hi = np.where(under, f, np.where(over & (kept == -1), 0.5 * f_hi, f_hi))
        kept = np.where(over, -1, np.where(under, 1, kept)).astype(np.int8)
        narrow = hi_b - lo_b <= 4.0 * np.spacing(np.maximum(hi_b, 1.0))
        todo &= ~((np.abs(f) <= tol) | narrow)
        n_todo = int(np.count_nonzero(todo))
        if n_todo == 0:
            break
        if n_todo < SHRINK_SHARE * covered:
            active = np.zeros(resp.tree.n_groups, dtype=np.bool_)
            active[groups[todo]] = True
            part = part.take(active[part.gidx])
            covered = n_todo
    # A bracket exhausted above the residual: its feasible end is the safe choice.
    stuck = s > cap + tol
    if stuck.any():
        return np.where(stuck, hi_b, x), current, False
    return x, current, part is everyone
