"""Scopes: one site solved as separate subtrees whose budgets a coordinator splits.

A scope is the subtree under one group (a row, or a rack). Its controller solves only that
subtree; a coordinator splits the budgets above the scopes between them from each scope's
**demand curve**: the power its subtree takes as a function of the price charged at its
root, inner budgets respected, the root's own budget not applied.

The price frame. The exact solver (tree_solver.py) charges u = λ/2ε at a GPU and its response is
lo + Σ_k clip(a_k − u, 0, len_k) with a_k = prev − start_k + (slope_k + δ)/2ε. The δ term
depends on which GPUs are in the problem (δ = 2ε·(max(hi − prev) + 1 kW)), so a scope's δ_s
differs from the whole site's δ. Written in the net price ν = λ − δ (per kW) the response
is lo + Σ_k clip(A_k − ν/2ε, 0, len_k) with A_k = prev − start_k + slope_k/2ε: δ is gone,
and so is it from every inner group's clamp T_v = min(capacity_v, Σ_children T_c). So a
curve D(ν) means the same thing in the scope's problem and in the site's, and:

- A scope solved alone with root budget B charges λ_root = ν(B) + δ_s at its root, where
  ν(B) is the curve's price at B (the slope of the scope's value function there).
- The site's optimum charges each scope ν* = Σ(multipliers of the groups above it, root
  included) − δ; its draw is D(ν*). δ ≥ δ_s (a maximum over more GPUs), so where no budget
  above binds the scope takes D(−δ) = D(−δ_s) = its whole demand hi_w: prices below −δ_s
  never matter, and the coordinator needs neither δ.
- A scope solved alone with B_s = D_s(ν*) draws exactly what it draws in the site's
  optimum: where its root binds, Σδp is fixed and δ_s cannot change the split; where it
  does not, both take hi_w.

So a split that equalises net prices under each binding group above the scopes reproduces
the global optimum exactly, if the curves are exact where the optimum lies.

Accuracy and size. D is continuous, non-increasing and piecewise linear, with a vertex
wherever a GPU's segment starts or stops filling or an inner group starts to bind: up to
2·segments·GPUs vertices. A curve keeps at most `points` of them, exact: every vertex when
they fit (the curve is exact everywhere), otherwise evenly spaced budgets from lo_w to hi_w
plus, with `around_w`, the true vertices nearest that budget (the last one the coordinator
gave); in between, linear. A split that lands inside every scope's exact window is the
global optimum; in steady state each tick's window is centred on the last split, so the
split settles on it within a few ticks (docs/allocator.md, "Scopes").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from powerd.allocator.problem import BoolArray, FloatArray, IntArray, Problem
from powerd.topology import N_LEVELS, Topology

# np.argsort(kind="stable") is a radix sort for integers of 16 bits or less.
_RADIX_LIMIT = 1 << 16
# A split within this share of a vertex's budget sits on it (sums of caps carry rounding).
WINDOW_TOL = 1e-12


@dataclass(frozen=True, eq=False)
class DemandCurve:
    """A scope's demand: points (budget_w[j], price[j]) of D⁻¹, linear in between.

    `budget_w` (W of GPU caps) is non-decreasing from lo_w (every GPU at its lower bound) to
    hi_w (every GPU at its upper bound, inner budgets applied); `price` is the net price
    ν = λ − δ per kW at each, non-increasing. Two points with one budget and two prices are
    a jump of the price: D is flat between them. Every point is exact; between
    `exact_lo_w` and `exact_hi_w` so is the line between them (NaN: nowhere).
    """

    budget_w: FloatArray
    price: FloatArray
    exact_lo_w: float
    exact_hi_w: float

    @property
    def lo_w(self) -> float:
        return float(self.budget_w[0])

    @property
    def hi_w(self) -> float:
        return float(self.budget_w[-1])

    @property
    def points(self) -> int:
        return int(self.budget_w.size)

    def demand_w(self, price: FloatArray | float) -> FloatArray:
        """D(ν): the budget the scope takes at net price ν (per kW)."""
        return np.asarray(np.interp(price, self.price[::-1], self.budget_w[::-1]))


def demand_curve(
    problem: Problem, root: int, points: int = 256, *, around_w: float | None = None
) -> DemandCurve:
    """The demand curve of the subtree under group `root` (index in problem.tree's topology).

    `points` bounds its size (≥ 2); `around_w` (W) is where the coordinator's last split put
    this scope: the true vertices nearest it take half the points (see module doc), so a
    window is worth having from about 8 points.
    """
    if points < 2:
        raise ValueError(f"a demand curve needs at least 2 points, not {points}")
    budget_kw, x = _vertices(problem, root)
    price = 2.0 * problem.eps * x
    budget = budget_kw * 1000.0
    if budget.size <= points:
        return DemandCurve(budget, price, float(budget[0]), float(budget[-1]))
    n_window = points // 2 if around_w is not None else 0
    even = np.linspace(budget[0], budget[-1], points - n_window)
    at = np.searchsorted(budget, even, side="left")
    left = np.maximum(at - 1, 0)
    width = budget[at] - budget[left]
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(width > 0.0, (even - budget[left]) / width, 1.0)
    even_price = price[left] + share * (price[at] - price[left])
    even[0], even_price[0], even[-1], even_price[-1] = budget[0], price[0], budget[-1], price[-1]
    if around_w is None:
        return DemandCurve(even, even_price, np.nan, np.nan)
    # The window holds the vertices on both sides of around_w (a split that lands on a
    # vertex needs the pieces on both sides) and as many more as fit, centred.
    # Budgets within rounding of around_w count as it (a jump's two vertices among them).
    near = WINDOW_TOL * max(abs(around_w), 1.0)
    below = max(int(np.searchsorted(budget, around_w - near, side="left")) - 1, 0)
    above = min(int(np.searchsorted(budget, around_w + near, side="right")), budget.size - 1)
    n_window = max(n_window, above - below + 1)
    spare = n_window - (above - below + 1)
    first = min(max(below - spare // 2, 0), budget.size - n_window)
    window = slice(first, first + n_window)
    b = np.concatenate([even, budget[window]])
    p = np.concatenate([even_price, price[window]])
    order = np.lexsort((-p, b))
    b, p = b[order], p[order]
    fresh = np.r_[True, (b[1:] != b[:-1]) | (p[1:] != p[:-1])]
    return DemandCurve(b[fresh], p[fresh], float(budget[first]), float(budget[window][-1]))


def _vertices(problem: Problem, root: int) -> tuple[FloatArray, FloatArray]:
    """Every vertex of D under `root`: budgets (kW) ascending, x = ν/2ε descending.

    Each GPU segment adds a hinge at A_k (it starts filling as ν/2ε falls below A_k) and
    removes one at A_k − len_k (full). Going up the tree, a capped group's sum is constant
    below the price where it reaches its capacity: its hinges below that price are dropped
    and one hinge there cancels the slope. Events stay in one order, x descending; each
    level groups them by group with a stable sort of the group ids.
    """
    tree = problem.tree
    topo = tree.topology
    top_level = int(topo.level[root])
    gpus = np.flatnonzero(tree.gpu_groups[:, top_level] == root)
    lo_sums = tree.sums(problem.lo)
    lengths = problem.lengths[:, gpus]
    upper = problem.slopes[:, gpus] / (2.0 * problem.eps)
    upper += problem.prev[gpus] - problem.starts[:, gpus]
    seg, col = np.nonzero(lengths > 0.0)
    top = upper[seg, col]
    x = np.concatenate([top, top - lengths[seg, col]])
    order = np.argsort(-x)  # ties in any order: they make one vertex
    x = x[order]
    w = np.where(order < top.size, 1, -1).astype(np.int64)
    group = np.tile(tree.node_of_gpu[gpus[col]], 2)[order]
    rank = _level_ranks(topo)
    for level in range(N_LEVELS - 1, top_level, -1):
        if level < N_LEVELS - 1:
            group = topo.parent[group]
        x, w, group = _clamp(x, w, group, lo_sums=lo_sums, capacity=problem.capacity, rank=rank)
    lo_root = float(lo_sums[root])
    if x.size == 0:
        return np.array([lo_root]), np.array([0.0])
    # Events at one x make one vertex; a vertex whose weights cancel is not a vertex.
    last = np.r_[x[1:] != x[:-1], True]
    net = np.add.reduceat(w, np.flatnonzero(np.r_[True, last[:-1]]))
    slope = np.cumsum(w)[last]  # slope magnitude just below each distinct x
    xv = x[last]
    s = lo_root + np.r_[0.0, np.cumsum(slope[:-1] * (xv[:-1] - xv[1:]))]
    real = net != 0
    return s[real], xv[real]


def _level_ranks(topo: Topology) -> IntArray:
    """Each group's position among the groups of its level (small ids sort faster)."""
    rank = np.zeros(topo.n_groups, dtype=np.int64)
    for level in range(N_LEVELS):
        g = topo.groups_at(level)
        rank[g] = np.arange(g.size)
    return rank


def _clamp(
    x: FloatArray,
    w: IntArray,
    group: IntArray,
    *,
    lo_sums: FloatArray,
    capacity: FloatArray,
    rank: IntArray,
) -> tuple[FloatArray, IntArray, IntArray]:
    """Apply each group's capacity to its sum of hinges (events in x-descending order)."""
    capped = np.isfinite(capacity[group])
    if not capped.any():
        return x, w, group
    idx = np.flatnonzero(capped)
    key = rank[group[idx]]
    key = key.astype(np.uint16) if key.size and key.max() < _RADIX_LIMIT else key
    idx = idx[np.argsort(key, kind="stable")]
    xs, ws, gs = x[idx], w[idx], group[idx]
    first = np.r_[True, gs[1:] != gs[:-1]]
    starts = np.flatnonzero(first)
    run = np.cumsum(first) - 1
    cw = np.cumsum(ws)
    after = cw - (cw[starts] - ws[starts])[run]  # slope magnitude just below each event
    inc = np.empty(xs.size)
    inc[0] = 0.0
    np.multiply(after[:-1], xs[:-1] - xs[1:], out=inc[1:])
    inc[first] = 0.0
    cs = np.cumsum(inc)
    # Per run (group), then spread once: the sum above lo, and the room above lo.
    lo_run = lo_sums[gs[starts]]
    room_run = np.maximum(capacity[gs[starts]] - lo_run, 0.0)
    above = cs - cs[starts][run]
    over = above > room_run[run]  # a suffix of each group's run: the sum only grows
    cross = np.flatnonzero(over & np.r_[True, ~over[:-1] | first[1:]])
    keep = np.ones(x.size, dtype=np.bool_)
    keep[idx[over]] = False
    if cross.size == 0:
        return x, w, group
    before = cross - 1
    m = after[before]
    room = room_run[run[cross]] - above[before]
    with np.errstate(divide="ignore", invalid="ignore"):
        new_x = np.where(m > 0, xs[before] - room / m, xs[before])
    new_x = np.where(first[cross], xs[cross], new_x)  # cannot happen (lo fits), kept safe
    new_w = -np.where(first[cross], 0, m)
    new_g = gs[cross]
    x, w, group = x[keep], w[keep], group[keep]
    o = np.argsort(-new_x, kind="stable")
    at = np.searchsorted(-x, -new_x[o], side="right")
    return np.insert(x, at, new_x[o]), np.insert(w, at, new_w[o]), np.insert(group, at, new_g[o])


@dataclass(frozen=True, eq=False)
class UpperTree:
    """The groups above the scopes, as the coordinator sees them.

    Upper groups are listed parents first; `capacity_w` is each one's room for GPU caps (its
    budget in force minus the overhead and reservations below it), inf when unconstrained.
    `scope_capacity_w` is each scope root's own room, the most its budget may be.
    """

    parent: IntArray  # per upper group: index of its parent, -1 at the top
    capacity_w: FloatArray
    scope_parent: IntArray  # per scope: index of the upper group it hangs from
    scope_capacity_w: FloatArray
    groups: IntArray  # per upper group: its index in the topology (when built from one)
    scopes: IntArray  # per scope: its root's index in the topology

    @property
    def n_scopes(self) -> int:
        return int(self.scope_parent.size)

    @classmethod
    def from_topology(
        cls, topology: Topology, level: int, capacity_w: FloatArray | None = None
    ) -> UpperTree:
        """Scopes are the groups at `level` (1 rows, 2 racks); `capacity_w` per group (W),
        default the topology's budgets less overhead."""
        if not 1 <= level < N_LEVELS:
            raise ValueError(f"scopes sit at level 1 (rows) to {N_LEVELS - 1}, not {level}")
        cap = topology.capacity_w if capacity_w is None else capacity_w
        groups = np.flatnonzero(topology.level < level)
        index = np.full(topology.n_groups, -1, dtype=np.int64)
        index[groups] = np.arange(groups.size)
        scopes = topology.groups_at(level)
        parents = topology.parent[groups]
        return cls(
            parent=np.where(parents >= 0, index[np.maximum(parents, 0)], -1),
            capacity_w=np.asarray(cap[groups], dtype=np.float64),
            scope_parent=index[topology.parent[scopes]],
            scope_capacity_w=np.asarray(cap[scopes], dtype=np.float64),
            groups=groups,
            scopes=scopes,
        )


@dataclass(frozen=True, eq=False)
class Split:
    """The coordinator's answer: each scope's budget for GPU caps (W; its root's budget is
    this plus the overhead below it) and the net price ν per kW it is charged (−inf where no
    budget binds; NaN for a fixed budget). `infeasible` marks upper groups whose scopes'
    lo_w (and fixed budgets) alone exceed their capacity: there every scope gets its lo_w.
    `exact`: every budget lies where its curve is exact, so this is the optimum."""

    budget_w: FloatArray
    price: FloatArray
    group_price: FloatArray
    infeasible: BoolArray
    exact: bool


def split_budgets(
    upper: UpperTree,
    curves: Sequence[DemandCurve | None],
    fixed_w: FloatArray | None = None,
) -> Split:
    """Split the upper budgets between the scopes: maximise Σ V_s(B_s) under every upper
    capacity and B_s ≤ scope_capacity_w, V_s' = the curve's price.

    Nested water-filling, bottom-up: a group's total T_v(ν) = Σ_children T_c(max(ν, c_c)) is
    clamped by its capacity at the price c_v where it reaches it; then each scope's price is
    the largest c on its path. A scope without a curve gets `fixed_w` (W), reserved above it.

    Where the curves carry exact windows (demand_curve's `around_w`) and the split lands
    outside one, it is solved again with each scope kept inside its window: a step that
    cannot lose (the last split lies inside every window, where the curves are exact), so
    ticks cannot cycle and settle on the optimum (`Split.exact`).
    """
    n = upper.n_scopes
    if len(curves) != n:
        raise ValueError(f"{len(curves)} curves for {n} scopes")
    missing = np.array([c is None for c in curves], dtype=np.bool_)
    if missing.any() and fixed_w is None:
        raise ValueError("a scope has no curve and no fixed budget")
    fixed = np.zeros(n) if fixed_w is None else np.asarray(fixed_w, dtype=np.float64)
    table = _Curves.build(curves, fixed)
    tree = _Upper.build(upper)
    ceiling = table.price_at_budget(upper.scope_capacity_w)  # each scope's own budget
    no_floor = np.full(n, np.inf)
    split = tree.solve(table, ceiling, no_floor, missing)
    window_lo = np.array([np.nan if c is None else c.exact_lo_w for c in curves])
    window_hi = np.array([np.nan if c is None else c.exact_hi_w for c in curves])
    windowed = ~missing
    if np.isnan(window_lo[windowed]).any():
        return split  # a curve without a window: nothing exact to hold on to
    b = split.budget_w
    # Strictly inside its window, or the window reaches that end of the curve: there the
    # split sees the true pieces on both sides.
    to_lo = window_lo <= table.lo
    to_hi = window_hi >= table.hi
    inside = ((b > window_lo) | to_lo) & ((b < window_hi) | to_hi)
    ends = to_lo & to_hi  # exact all along
    if np.all(inside | missing):
        return replace(split, exact=True)
    low = np.where(missing | ends, table.lo, window_lo)
    high = np.where(missing | ends, table.hi, window_hi)
    kept = tree.solve(
        table,
        np.maximum(ceiling, table.price_at_budget(high)),
        table.price_at_budget(low, floor=True),
        missing,
    )
    if kept.infeasible.any() and not split.infeasible.any():
        return split  # the windows no longer fit the budgets (the scopes moved)
    return kept


@dataclass(frozen=True, eq=False)
class _Upper:
    """The upper tree prepared: each scope's ancestor at every depth."""

    upper: UpperTree
    depth: IntArray
    ancestor: IntArray  # (scopes, depths): the upper group above each scope at each depth

    @classmethod
    def build(cls, upper: UpperTree) -> _Upper:
        n_groups = upper.parent.size
        depth = np.zeros(n_groups, dtype=np.int64)
        for g in range(n_groups):
            if upper.parent[g] >= 0:
                depth[g] = depth[upper.parent[g]] + 1
        deepest = int(depth.max(initial=0))
        ancestor = np.zeros((upper.n_scopes, deepest + 1), dtype=np.int64)
        g_of = upper.scope_parent.copy()
        for d in range(deepest, -1, -1):
            if not np.all(depth[g_of] == d):
                raise ValueError("every scope must hang from a group at the deepest upper level")
            ancestor[:, d] = g_of
            g_of = np.where(upper.parent[g_of] >= 0, upper.parent[g_of], g_of)
        return cls(upper=upper, depth=depth, ancestor=ancestor)

    def solve(
        self, table: _Curves, ceiling: FloatArray, floor: FloatArray, missing: BoolArray
    ) -> Split:
        """Each scope's price is min(max(clamps on its path, ceiling_s), floor_s): its own
        budget (ceiling) and lower bound (floor) as prices."""
        upper, ancestor = self.upper, self.ancestor
        n_groups = upper.parent.size
        group_clamp = np.full(n_groups, -np.inf)
        infeasible = np.zeros(n_groups, dtype=np.bool_)
        clamp = ceiling
        for d in range(ancestor.shape[1] - 1, -1, -1):
            at = ancestor[:, d]
            c, bad = _solve_groups(
                table, clamp, floor, at=at, capacity=upper.capacity_w, n_groups=n_groups
            )
            level_groups = self.depth == d
            group_clamp[level_groups] = c[level_groups]
            infeasible |= bad & level_groups
            clamp = np.maximum(clamp, c[at])
        price = np.minimum(clamp, floor)
        budget = _fit(table.demand(price), table.lo, ancestor, upper.capacity_w, n_groups)
        path_price = np.maximum.accumulate(group_clamp[ancestor], axis=1)
        group_price = np.full(n_groups, -np.inf)
        for d in range(ancestor.shape[1]):
            np.maximum.at(group_price, ancestor[:, d], path_price[:, d])
        return Split(
            budget_w=budget,
            price=np.where(missing, np.nan, price),
            group_price=group_price,
            infeasible=infeasible,
            exact=False,
        )


@dataclass(frozen=True, eq=False)
class _Curves:
    """All curves as rows, price ascending (budget non-increasing), padded with +inf."""

    nu: FloatArray  # (scopes, width)
    budget: FloatArray  # (scopes, width)
    last: IntArray  # per scope: index of its last real point
    lo: FloatArray
    hi: FloatArray

    @classmethod
    def build(cls, curves: Sequence[DemandCurve | None], fixed: FloatArray) -> _Curves:
        n = len(curves)
        width = max((c.points for c in curves if c is not None), default=1)
        nu = np.full((n, width), np.inf)
        budget = np.zeros((n, width))
        last = np.zeros(n, dtype=np.int64)
        for s, c in enumerate(curves):
            if c is None:  # a fixed budget: one point, the same at every price
                nu[s, 0], budget[s, :] = 0.0, fixed[s]
                continue
            k = c.points
            nu[s, :k] = c.price[::-1]
            budget[s, :k] = c.budget_w[::-1]
            budget[s, k:] = c.budget_w[0]
            last[s] = k - 1
        lo = budget[np.arange(n), last]
        return cls(nu=nu, budget=budget, last=last, lo=lo, hi=budget[:, 0].copy())

    def demand(self, price: FloatArray) -> FloatArray:
        """Each scope's D at its own price (±inf allowed)."""
        rows = np.arange(self.nu.shape[0])
        at = np.count_nonzero(self.nu <= price[:, None], axis=1)
        i0 = np.minimum(np.maximum(at - 1, 0), self.last)
        i1 = np.minimum(at, self.last)
        n0, n1 = self.nu[rows, i0], self.nu[rows, i1]
        b0, b1 = self.budget[rows, i0], self.budget[rows, i1]
        inside = i1 > i0
        with np.errstate(invalid="ignore", divide="ignore"):
            share = np.where(inside, (price - n0) / (n1 - n0), 0.0)
        out: FloatArray = np.where(inside, b0 + share * (b1 - b0), b0)
        return out

    def price_at_budget(self, budget_w: FloatArray, *, floor: bool = False) -> FloatArray:
        """The price where D reaches `budget_w`: −inf when it never exceeds it, +inf when
        even lo_w does (`floor`: +inf when it never falls below it, −inf when hi_w does)."""
        rows = np.arange(self.nu.shape[0])
        # Budgets fall along each row: count the points above the budget.
        valid = np.arange(self.nu.shape[1])[None, :] <= self.last[:, None]
        above = np.count_nonzero((self.budget > budget_w[:, None]) & valid, axis=1)
        out = np.full(rows.size, -np.inf)
        never = above == 0
        all_above = above > self.last
        mid = ~never & ~all_above
        i1 = np.minimum(above, self.last)
        i0 = np.maximum(i1 - 1, 0)
        b0, b1 = self.budget[rows, i0], self.budget[rows, i1]
        n0, n1 = self.nu[rows, i0], self.nu[rows, i1]
        with np.errstate(invalid="ignore", divide="ignore"):
            cross = n0 + (b0 - budget_w) / (b0 - b1) * (n1 - n0)
        out = np.where(mid, cross, out)
        out = np.where(all_above, np.inf, out)
        if floor:
            out = np.where(never, np.where(budget_w >= self.hi, -np.inf, out), out)
            out = np.where(budget_w <= self.lo, np.inf, out)
        return out


def _solve_groups(
    table: _Curves,
    clamp: FloatArray,
    floor: FloatArray,
    *,
    at: IntArray,
    capacity: FloatArray,
    n_groups: int,
) -> tuple[FloatArray, BoolArray]:
    """For every group: the price c where Σ_{scopes below} D_s(max(ν, clamp_s)) = capacity
    (−inf if its total never exceeds it, +inf if even at lo), and whether lo is too much.

    The total is piecewise linear with vertices only at the scopes' points and clamps: a
    binary search over those (merged and sorted per group) finds the piece holding the
    capacity, all groups at once, and one linear step lands on c exactly.
    """

    def total(price: FloatArray) -> FloatArray:
        d = table.demand(np.minimum(np.maximum(price[at], clamp), floor))
        return np.bincount(at, weights=d, minlength=n_groups).astype(np.float64)

    top = total(np.full(n_groups, -np.inf))
    bottom = total(np.full(n_groups, np.inf))
    c = np.full(n_groups, -np.inf)
    bad = bottom > capacity
    c[bad] = np.inf
    open_ = (top > capacity) & ~bad
    if not open_.any():
        return c, bad
    rows = open_[at]
    real = np.isfinite(table.nu[rows])
    ends = np.concatenate([clamp[rows], floor[rows]])
    prices = np.concatenate([table.nu[rows][real], ends[np.isfinite(ends)]])
    owner = np.concatenate(
        [
            np.broadcast_to(at[rows][:, None], real.shape)[real],
            np.tile(at[rows], 2)[np.isfinite(ends)],
        ]
    )
    order = np.argsort(prices)
    owner = owner[order]
    if open_.sum() > 1:
        key = owner.astype(np.uint16) if n_groups < _RADIX_LIMIT else owner
        by_group = np.argsort(key, kind="stable")
        order, owner = order[by_group], owner[by_group]
    prices = prices[order]
    groups = np.flatnonzero(open_)
    first = np.searchsorted(owner, groups, side="left")
    stop = np.searchsorted(owner, groups, side="right")
    # Invariant: total(prices[lo]) > capacity ≥ total(prices[hi]): true at the ends, where
    # the totals are `top` and `bottom`.
    lo, hi = first, stop - 1
    cap = capacity[groups]
    f_lo, f_hi = top[groups] - cap, bottom[groups] - cap
    probe = np.zeros(n_groups)
    while True:
        wide = hi - lo > 1
        if not wide.any():
            break
        mid = (lo + hi) // 2
        probe[groups] = prices[mid]
        f = total(probe)[groups] - cap
        over = wide & (f > 0.0)
        under = wide & ~(f > 0.0)
        lo, f_lo = np.where(over, mid, lo), np.where(over, f, f_lo)
        hi, f_hi = np.where(under, mid, hi), np.where(under, f, f_hi)
    p_lo, p_hi = prices[lo], prices[hi]
    with np.errstate(divide="ignore", invalid="ignore"):
        step = np.where(f_lo > f_hi, f_lo / (f_lo - f_hi), 1.0)
    c[groups] = np.minimum(p_lo + step * (p_hi - p_lo), p_hi)
    return c, bad


def _fit(
    budget: FloatArray, lo: FloatArray, ancestor: IntArray, capacity: FloatArray, n_groups: int
) -> FloatArray:
    """Shave rounding excess (a few ulps) so every upper capacity holds exactly, deepest
    groups first, in proportion to each scope's room above its lo_w."""
    b = budget.copy()
    for d in range(ancestor.shape[1] - 1, -1, -1):
        at = ancestor[:, d]
        sums = np.bincount(at, weights=b, minlength=n_groups)
        target = capacity - 4.0 * np.finfo(np.float64).eps * np.abs(
            np.where(np.isfinite(capacity), capacity, 0.0)
        )
        excess = sums - target
        if not np.any(excess > 0.0):
            continue
        room = np.bincount(at, weights=b - lo, minlength=n_groups)
        with np.errstate(divide="ignore", invalid="ignore"):
            keep = np.where(excess > 0.0, 1.0 - excess / room, 1.0)
        keep = np.clip(np.nan_to_num(keep, nan=0.0), 0.0, 1.0)
        b = lo + (b - lo) * keep[at]
    return b
