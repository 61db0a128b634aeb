"""Scopes solved apart equal one global solve (powerd.allocator.scopes), on random fleets
split at rows or racks with budgets binding at every level: each demand curve agrees with
the exact solver at its points, and the coordinator's split, each scope then solved alone,
reaches the global optimum within 1e-6 and keeps every budget."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.allocator import policy_for

from powerd.allocator import GpuArrays, allocate_arrays, build_problem
from powerd.allocator.problem import Problem, objective
from powerd.allocator.scopes import (
    DemandCurve,
    UpperTree,
    demand_curve,
    split_budgets,
)
from powerd.policy import Policy
from powerd.testing.synthetic import make_policy, random_fleet, scope_fleet

TOL_W = 1e-6
REL_GAP = 1e-6
EXAMPLES = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Scope:
    name: str
    policy: Policy
    fleet: GpuArrays
    gpus: np.ndarray  # indices in the site's fleet
    root: int  # the scope's group in its own topology

    def solve(self, budget_w: float) -> np.ndarray:
        """Caps (W) with the coordinator's budget for GPU caps at the scope's root."""
        topo = self.fleet.topology
        budget = topo.budget_w.copy()
        budget[self.root] = budget_w + topo.overhead_w[self.root]
        return allocate_arrays(self.fleet, self.policy, budget_w=budget).caps_w

    def curve(self, points: int, around_w: float | None = None) -> DemandCurve:
        problem = build_problem(self.fleet, self.policy)
        return demand_curve(problem, self.root, points, around_w=around_w)


@dataclass(frozen=True)
class Site:
    policy: Policy
    fleet: GpuArrays
    upper: UpperTree
    scopes: tuple[Scope, ...]


fraction = st.floats(0.75, 1.0).map(lambda f: round(f, 3))


@st.composite
def sites(draw: st.DrawFn) -> Site:
    level = draw(st.sampled_from([1, 2]))
    if level == 1:  # 2–4 rows
        shape = (draw(st.integers(2, 4)), draw(st.integers(1, 2)), 2, draw(st.integers(1, 4)))
    else:  # 2–8 racks
        shape = (draw(st.integers(1, 2)), draw(st.integers(2, 4)), 2, draw(st.integers(1, 4)))
    # Budgets above the scopes bind but leave room for every lower bound: a global solve
    # that has to relax bounds above the scopes is not one the split can reproduce.
    fractions = (
        round(draw(st.floats(0.8, 0.97)), 3),
        round(draw(st.floats(0.8, 1.0)), 3),
        draw(fraction),
        draw(fraction),
    )
    damping = draw(st.sampled_from([0.0, 0.001, 0.01, 0.1]))
    slew_w = draw(st.sampled_from([None, 150.0]))
    policy = policy_for(shape, fractions, damping, slew_w, draw(st.sampled_from(["peak", "max"])))
    share = st.sampled_from([0.0, 0.25])
    fleet = random_fleet(
        policy,
        draw(st.integers(0, 2**31)),
        stale_share=draw(share),
        pinned_share=draw(share),
        limited_share=draw(st.sampled_from([0.2, 0.5, 0.9])),
    )
    upper = UpperTree.from_topology(fleet.topology, level)
    scopes = []
    for g in upper.scopes:
        name = fleet.topology.names[int(g)]
        scope_policy, part, gpus = scope_fleet(fleet, policy, name)
        scopes.append(Scope(name, scope_policy, part, gpus, part.topology.names.index(name)))
    return Site(policy, fleet, upper, tuple(scopes))


def same_bounds(site: Site) -> bool:
    """Whether the global problem's bounds are the scopes' own (nothing relaxed above)."""
    whole = build_problem(site.fleet, site.policy)
    if whole.status != "optimal":
        return False
    for scope in site.scopes:
        part = build_problem(scope.fleet, scope.policy)
        if part.status != "optimal":
            return False
        if not (np.array_equal(part.lo, whole.lo[scope.gpus])):
            return False
        if not np.array_equal(part.hi, whole.hi[scope.gpus]):
            return False
    return True


def same_problem(scope: Scope, problem: Problem, budget_w: np.ndarray) -> bool:
    """Whether another root budget leaves the scope's bounds alone: a budget below what the
    slew's lower bounds need relaxes them (build_problem), and the curve is of the other."""
    other = build_problem(scope.fleet, scope.policy, budget_w=budget_w)
    return np.array_equal(other.lo, problem.lo) and np.array_equal(other.hi, problem.hi)


def combined_caps(site: Site, budgets_w: np.ndarray) -> np.ndarray:
    caps = np.full(site.fleet.n, np.nan)
    for scope, budget in zip(site.scopes, budgets_w, strict=True):
        caps[scope.gpus] = scope.solve(float(budget))
    return caps


def gap(site: Site, caps_w: np.ndarray) -> float:
    """The caps' shortfall from the global optimum, relative, on the global objective."""
    best = allocate_arrays(site.fleet, site.policy)
    value = objective(build_problem(site.fleet, site.policy), caps_w / 1000.0)
    return (best.objective - value) / max(abs(best.objective), 1.0)


def excess_w(fleet: GpuArrays, caps_w: np.ndarray) -> float:
    topo = fleet.topology
    return float(np.max(topo.group_sums(caps_w) + topo.overhead_w - topo.budget_w))


@EXAMPLES
@given(sites(), st.integers(0, 2**31))
def test_the_curve_is_the_solvers_price_at_its_points(site: Site, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for scope in site.scopes:
        problem = build_problem(scope.fleet, scope.policy)
        curve = scope.curve(points=int(rng.choice([8, 64, 4096])))
        assert np.all(np.diff(curve.budget_w) >= 0.0)
        assert np.all(np.diff(curve.price) <= 0.0)
        assert curve.lo_w == np.float64(problem.lo.sum() * 1000.0).round(6) or np.isclose(
            curve.lo_w, problem.lo.sum() * 1000.0, rtol=1e-12, atol=1e-6
        )
        free = scope.fleet.topology.budget_w.copy()
        free[scope.root] = np.inf
        if same_problem(scope, problem, free):
            unbounded = allocate_arrays(scope.fleet, scope.policy, budget_w=free)
            assert np.isclose(curve.hi_w, unbounded.caps_w.sum(), rtol=1e-12, atol=1e-6)
        # Every vertex, to know where the price jumps (D flat): there any price between
        # the jump's ends is right, the solver's and the curve's alike.
        full = demand_curve(problem, scope.root, 10**7)
        assert np.allclose(full.demand_w(curve.price), curve.budget_w, rtol=1e-12, atol=1e-6)
        for j in rng.choice(curve.points, size=min(curve.points, 5), replace=False):
            budget = float(curve.budget_w[j])
            topo = scope.fleet.topology
            budgets = topo.budget_w.copy()
            budgets[scope.root] = budget + topo.overhead_w[scope.root]
            if not same_problem(scope, problem, budgets):
                continue
            alloc = allocate_arrays(scope.fleet, scope.policy, budget_w=budgets)
            assert alloc.prices is not None
            price = alloc.prices[scope.root] - problem.delta
            tol = 1e-7 + 1e-9 * abs(curve.price[j])
            same = np.abs(full.budget_w - budget) <= TOL_W
            ends = np.r_[full.price[same], curve.price[j]]
            # At lo_w any price above is right; within the solver's tolerance of hi_w the
            # root does not bind (price −δ).
            high = np.inf if budget <= curve.lo_w + TOL_W else ends.max() + tol
            low = -np.inf if budget >= curve.hi_w - TOL_W else ends.min() - tol
            assert low <= price <= high


@EXAMPLES
@given(sites())
def test_split_of_exact_curves_is_the_global_optimum(site: Site) -> None:
    assume(same_bounds(site))
    curves = [scope.curve(points=4096) for scope in site.scopes]
    split = split_budgets(site.upper, curves)
    caps = combined_caps(site, split.budget_w)
    assert gap(site, caps) <= REL_GAP
    assert excess_w(site.fleet, caps) <= TOL_W


@EXAMPLES
@given(sites(), st.sampled_from([8, 16]))
def test_short_curves_reach_the_optimum_in_steady_state(site: Site, points: int) -> None:
    """With few points per curve the first split is approximate; each tick the scopes
    centre their exact window on the last split, and the split settles on the optimum.
    The window is narrow with so few points, so the split may walk there over several ticks
    (a two-scope site with 8 points took 9: each tick moved it a little, monotonically);
    the shipped curves have 256 points."""
    assume(same_bounds(site))
    around: list[float | None] = [None] * len(site.scopes)
    budgets = np.full(len(site.scopes), np.nan)
    for _ in range(16):
        curves = [s.curve(points, around_w=a) for s, a in zip(site.scopes, around, strict=True)]
        split = split_budgets(site.upper, curves)
        if split.exact and np.allclose(split.budget_w, budgets, rtol=1e-12, atol=1e-6):
            break
        budgets = split.budget_w
        around = list(budgets)
    else:
        raise AssertionError(f"no steady state after 16 ticks: {budgets}")
    caps = combined_caps(site, budgets)
    assert gap(site, caps) <= REL_GAP
    assert excess_w(site.fleet, caps) <= TOL_W


@EXAMPLES
@given(sites(), st.integers(0, 2**31))
def test_a_missing_curve_gets_its_fixed_budget(site: Site, seed: int) -> None:
    rng = np.random.default_rng(seed)
    curves: list[DemandCurve | None] = [s.curve(points=4096) for s in site.scopes]
    gone = int(rng.integers(len(curves)))
    lost = curves[gone]
    assert lost is not None
    fixed = np.zeros(len(curves))
    fixed[gone] = lost.lo_w + rng.uniform(0.0, 1.0) * (lost.hi_w - lost.lo_w)
    curves[gone] = None
    split = split_budgets(site.upper, curves, fixed_w=fixed)
    assert split.budget_w[gone] == fixed[gone]
    assert np.isnan(split.price[gone])
    # The others share what is left: the same as a site whose groups above the lost scope
    # have its fixed budget taken off.
    upper = site.upper
    taken = upper.capacity_w.copy()
    g = int(upper.scope_parent[gone])
    while g >= 0:
        taken[g] -= fixed[gone]
        g = int(upper.parent[g])
    keep = np.arange(len(curves)) != gone
    rest = UpperTree(
        parent=upper.parent,
        capacity_w=taken,
        scope_parent=upper.scope_parent[keep],
        scope_capacity_w=upper.scope_capacity_w[keep],
        groups=upper.groups,
        scopes=upper.scopes[keep],
    )
    others = split_budgets(rest, [c for c in curves if c is not None])
    if not others.infeasible.any():
        assert np.allclose(split.budget_w[keep], others.budget_w, rtol=1e-9, atol=1e-6)
    sums = np.zeros(upper.parent.size)
    for s, budget in enumerate(split.budget_w):
        g = int(upper.scope_parent[s])
        while g >= 0:
            sums[g] += budget
            g = int(upper.parent[g])
    ok = ~split.infeasible
    assert np.all(sums[ok] <= upper.capacity_w[ok] + TOL_W)


def test_a_scope_policy_keeps_its_subtree_and_frees_the_groups_above() -> None:
    policy = make_policy(2, 3, 2, 4)
    scope = policy.scope("row-2-rack-3")
    names = [g.name for g in scope.groups]
    assert names == [
        "site",
        "row-2",
        "row-2-rack-3",
        "row-2-rack-3-node-1",
        "row-2-rack-3-node-2",
    ]
    budgets = {g.name: g.budget_w for g in scope.groups}
    original = {g.name: g.budget_w for g in policy.groups}
    assert budgets["site"] == budgets["row-2"] == float("inf")
    for name in names[2:]:
        assert budgets[name] == original[name]
    assert [g.parent for g in scope.groups] == [-1, 0, 1, 2, 2]
