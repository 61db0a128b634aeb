"""Properties of the allocator on random instances (hypothesis): budgets, bounds, floors,
monotonicity in budget, permutation, fast = cvxpy, and where power is left unallocated."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.allocator import policy_for

from powerd.allocator import (
    FLOORS_DROPPED,
    OPTIMAL,
    SOLVERS,
    Allocation,
    GpuArrays,
    allocate_arrays,
    build_problem,
)
from powerd.allocator.problem import Problem, Tree
from powerd.policy import Policy, parse_policy
from powerd.testing.synthetic import random_fleet
from powerd.topology import Topology

TOL_W = 1e-6
# Hypothesis settings: how many examples a property test tries (not the `slow` mark).
EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FEW_EXAMPLES = settings(EXAMPLES, max_examples=25)
# Small cases: .ci/run also runs them as plain Python (NUMBA_DISABLE_JIT=1, docs/allocator.md).
pytestmark = pytest.mark.plain_python


@dataclass(frozen=True)
class Case:
    policy: Policy
    fleet: GpuArrays


fraction = st.floats(0.75, 1.0).map(lambda f: round(f, 3))


@st.composite
def cases(
    draw: st.DrawFn,
    *,
    damping: st.SearchStrategy[float] | None = None,
    odd_gpus: bool = True,
    slew: bool = True,
    leftover: st.SearchStrategy[str] | None = None,
) -> Case:
    shape = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 4)),
    )
    fractions = (draw(fraction), draw(fraction), draw(fraction), draw(fraction))
    damp = draw(damping if damping is not None else st.sampled_from([0.0, 0.001, 0.01, 0.1]))
    slew_w = draw(st.sampled_from([None, 40.0, 150.0])) if slew else None
    left = draw(leftover if leftover is not None else st.sampled_from(["peak", "max"]))
    policy = policy_for(shape, fractions, damp, slew_w, left)
    share = st.sampled_from([0.0, 0.0, 0.25])
    fleet = random_fleet(
        policy,
        draw(st.integers(0, 2**31)),
        stale_share=draw(share) if odd_gpus else 0.0,
        pinned_share=draw(share) if odd_gpus else 0.0,
        limited_share=draw(st.sampled_from([0.2, 0.5, 0.9])),
    )
    return Case(policy, fleet)


def excess_w(fleet: GpuArrays, caps_w: np.ndarray) -> float:
    topo = fleet.topology
    return float(np.max(topo.group_sums(caps_w) + topo.overhead_w - topo.budget_w))


def device_bounds(case: Case, alloc: Allocation) -> None:
    f, caps = case.fleet, alloc.caps_w
    assert np.all(caps >= f.min_cap_w - TOL_W)
    assert np.all(caps <= f.max_cap_w + TOL_W)
    pinned = ~np.isnan(f.pinned_w)
    assert np.allclose(caps[pinned], f.pinned_w[pinned], rtol=0, atol=TOL_W)
    stale = f.stale & ~pinned
    assert np.all(caps[stale] <= np.maximum(f.cap_w[stale], f.min_cap_w[stale]) + TOL_W)


@EXAMPLES
@given(cases(), st.sampled_from([s for s in SOLVERS if s != "cvxpy"]))
def test_every_budget_and_bound_holds(case: Case, solver: str) -> None:
    alloc = allocate_arrays(case.fleet, case.policy, solver)
    problem = build_problem(case.fleet, case.policy)
    if alloc.status != "infeasible_min":
        assert excess_w(case.fleet, alloc.caps_w) <= TOL_W
    assert np.all(alloc.caps_w >= problem.lo * 1000 - TOL_W)
    assert np.all(alloc.caps_w <= problem.hi * 1000 + TOL_W)
    device_bounds(case, alloc)
    assert alloc.caps_w.shape == (case.fleet.n,)


@EXAMPLES
@given(cases(), st.integers(0, 2**31), st.sampled_from([0.0, 0.5, 1.0]))
def test_every_budget_and_bound_holds_with_swinging_gpus(
    case: Case, seed: int, share: float
) -> None:
    """GPUs judged by their recent peak (`control.demand.swing_keep_w`) move demand and
    anchors only: every budget and bound holds as without them."""
    rng = np.random.default_rng(seed)
    fleet = case.fleet
    recent = np.minimum(fleet.power_w + rng.uniform(0.0, 400.0, fleet.n), fleet.max_cap_w)
    fleet = replace(fleet, recent_w=recent, swinging=rng.random(fleet.n) < share)
    alloc = allocate_arrays(fleet, case.policy)
    problem = build_problem(fleet, case.policy)
    if alloc.status != "infeasible_min":
        assert excess_w(fleet, alloc.caps_w) <= TOL_W
    assert np.all(alloc.caps_w >= problem.lo * 1000 - TOL_W)
    assert np.all(alloc.caps_w <= problem.hi * 1000 + TOL_W)
    device_bounds(Case(case.policy, fleet), alloc)


@EXAMPLES
@given(cases(odd_gpus=False, slew=False))
def test_floors_are_honoured_when_they_fit(case: Case) -> None:
    alloc = allocate_arrays(case.fleet, case.policy)
    f = case.fleet
    specs = [case.policy.classes[c] for c in case.policy.classes]
    floor = np.array([s.floor_w or 0.0 for s in specs])[f.class_index]
    ceiling = np.array([s.ceiling_w or np.inf for s in specs])[f.class_index]
    want = np.minimum(np.maximum(f.min_cap_w, floor), np.minimum(f.max_cap_w, ceiling))
    if alloc.status == OPTIMAL:
        assert np.all(alloc.caps_w >= want - TOL_W)
        assert alloc.dropped_floors == ()
    else:
        assert alloc.status == FLOORS_DROPPED
        dropped = np.isin(np.array(f.uuids), np.array(alloc.dropped_floors))
        kept = ~dropped
        assert np.all(alloc.caps_w[kept] >= want[kept] - TOL_W)
        assert np.all(floor[dropped] > 0)


@EXAMPLES
@given(cases(odd_gpus=False, slew=False), st.floats(1.0, 1.5), st.integers(0, 10_000))
def test_more_budget_never_lowers_the_objective(case: Case, factor: float, pick: int) -> None:
    topo = case.fleet.topology
    budget = topo.budget_w.copy()
    group = pick % topo.n_groups
    budget[group] = topo.overhead_w[group] + (budget[group] - topo.overhead_w[group]) * factor
    before = allocate_arrays(case.fleet, case.policy)
    after = allocate_arrays(case.fleet, case.policy, budget_w=budget)
    if before.status == after.status == OPTIMAL:
        assert after.objective >= before.objective - 1e-9 * abs(before.objective)


def permuted(fleet: GpuArrays, order: np.ndarray) -> GpuArrays:
    t = fleet.topology
    topo = Topology(
        names=t.names,
        level=t.level,
        parent=t.parent,
        budget_w=t.budget_w,
        overhead_w=t.overhead_w,
        gpu_groups=t.gpu_groups[order],
    )
    return replace(
        fleet,
        uuids=tuple(fleet.uuids[i] for i in order),
        topology=topo,
        min_cap_w=fleet.min_cap_w[order],
        max_cap_w=fleet.max_cap_w[order],
        power_w=fleet.power_w[order],
        cap_w=fleet.cap_w[order],
        class_index=fleet.class_index[order],
        stale=fleet.stale[order],
        pinned_w=fleet.pinned_w[order],
    )


@EXAMPLES
@given(cases(), st.sampled_from(["fast", "uniform", "priority-bands"]), st.integers(0, 2**32))
def test_permuting_gpus_permutes_caps(case: Case, solver: str, seed: int) -> None:
    order = np.random.default_rng(seed).permutation(case.fleet.n)
    a = allocate_arrays(case.fleet, case.policy, solver)
    b = allocate_arrays(permuted(case.fleet, order), case.policy, solver)
    assert np.allclose(b.caps_w, a.caps_w[order], rtol=0, atol=1e-6)
    assert b.status == a.status
    assert sorted(b.dropped_floors) == sorted(a.dropped_floors)


@FEW_EXAMPLES
@given(cases(damping=st.sampled_from([0.001, 0.01, 0.1])))
def test_fast_agrees_with_cvxpy(case: Case) -> None:
    fast = allocate_arrays(case.fleet, case.policy, "fast")
    ref = allocate_arrays(case.fleet, case.policy, "cvxpy")
    assert ref.status == fast.status
    assert abs(fast.objective - ref.objective) <= 1e-6 * max(abs(ref.objective), 1.0)
    assert np.max(np.abs(fast.caps_w - ref.caps_w), initial=0.0) <= 0.5
    if ref.status != "infeasible_min":
        assert excess_w(case.fleet, ref.caps_w) <= TOL_W


@EXAMPLES
@given(cases())
def test_a_gpu_sits_below_its_maximum_only_under_a_full_group(case: Case) -> None:
    alloc = allocate_arrays(case.fleet, case.policy)
    problem = build_problem(case.fleet, case.policy)
    sums = problem.tree.sums(alloc.caps_w / 1000.0)
    full = sums >= problem.capacity - 1e-6  # within 1 mW
    below = alloc.caps_w < problem.hi * 1000.0 - 1e-3
    under_full = full[case.fleet.topology.gpu_groups].any(axis=1)
    assert np.all(under_full[below])


@FEW_EXAMPLES
@given(cases(damping=st.sampled_from([0.01])))
def test_baselines_never_beat_the_optimum(case: Case) -> None:
    best = allocate_arrays(case.fleet, case.policy, "fast").objective
    for solver in ("uniform", "priority-bands"):
        other = allocate_arrays(case.fleet, case.policy, solver).objective
        assert other <= best + 1e-9 * abs(best)


def peak_w(case: Case) -> np.ndarray:
    names = list(case.policy.classes)
    return np.array([case.policy.class_profile(c).peak_w for c in names])[case.fleet.class_index]


@EXAMPLES
@given(cases(leftover=st.just("peak")))
def test_no_gpu_gets_power_past_its_peak(case: Case) -> None:
    f = case.fleet
    alloc = allocate_arrays(f, case.policy)
    specs = [case.policy.classes[c] for c in case.policy.classes]
    floor = np.array([s.floor_w or 0.0 for s in specs])[f.class_index]
    # Past the peak only where something wins over it: a pin, the device minimum, a floor.
    allowed = np.maximum(np.maximum(peak_w(case), floor), f.min_cap_w)
    free = np.isnan(f.pinned_w)
    assert np.all(alloc.caps_w[free] <= allowed[free] + TOL_W)
    # What is left at the root is reported, and nobody could have used it.
    problem = build_problem(f, case.policy)
    room = problem.capacity[0] * 1000.0
    if np.isfinite(room):
        assert alloc.unused_w == pytest.approx(max(room - alloc.caps_w.sum(), 0.0), abs=1e-6)
        if alloc.unused_w > 1e-3:
            # Room at the root: every GPU is at its bound or under a full group below it.
            sums = problem.tree.sums(alloc.caps_w / 1000.0)
            full = (sums >= problem.capacity - 1e-6)[f.topology.gpu_groups[:, 1:]].any(axis=1)
            assert np.all(full | (alloc.caps_w >= problem.hi * 1000.0 - 1e-3))


@EXAMPLES
@given(cases(odd_gpus=False, slew=False, leftover=st.just("peak")))
def test_leftover_max_only_adds_power_past_the_peaks(case: Case) -> None:
    """Same fleet, leftover: max: the power past the peaks is handed out, so no less power in
    all and no more left unused (every GPU wants its upper bound; max only raises bounds)."""
    peak = allocate_arrays(case.fleet, case.policy)
    data = case.policy.spec.model_dump(by_alias=True)
    data["control"]["leftover"] = "max"
    maxed = allocate_arrays(case.fleet, parse_policy(data))
    assert peak.caps_w.sum() <= maxed.caps_w.sum() + 1e-6
    assert maxed.unused_w <= peak.unused_w + 1e-6


@FEW_EXAMPLES
@given(
    cases(damping=st.sampled_from([0.001, 0.01, 0.1])),
    st.integers(0, 2**32),
    st.sampled_from(["optimum", "max", "random"]),
)
def test_fast_from_any_start_agrees_with_cvxpy(case: Case, seed: int, start: str) -> None:
    """The fast solver holds first only the budgets the caps in force fill and those that
    bound last tick (its warm start), and adds the budgets its caps break: from caps at the
    last optimum (steady state), at every GPU's maximum (a first start: every budget over)
    or anywhere, warm-started from a tick whose draws differ, it lands on cvxpy's optimum."""
    rng = np.random.default_rng(seed)
    fleet = case.fleet
    last = allocate_arrays(fleet, case.policy, "fast")
    if start == "optimum":
        caps = last.caps_w
    elif start == "max":
        caps = fleet.max_cap_w.copy()
    else:
        caps = rng.uniform(fleet.min_cap_w, fleet.max_cap_w)
    power = np.minimum(caps, fleet.power_w * rng.uniform(0.8, 1.2, fleet.n))
    moved = replace(fleet, cap_w=caps, power_w=power)
    for warm in (None, last):
        fast = allocate_arrays(moved, case.policy, "fast", warm=warm)
        ref = allocate_arrays(moved, case.policy, "cvxpy")
        assert ref.status == fast.status
        assert abs(fast.objective - ref.objective) <= 1e-6 * max(abs(ref.objective), 1.0)
        if ref.status != "infeasible_min":
            assert excess_w(moved, fast.caps_w) <= TOL_W


def test_a_kept_tree_answers_each_ticks_budgets_as_a_new_one() -> None:
    """The tree keeps which budgets their children's imply (Problem.solver_capacity) while
    capacities and bounds stay the same: a budget that changes between two problems on one
    tree is answered as on a new tree, before and after it changes back."""
    policy = policy_for((1, 2, 2, 2), (1.0, 1.0, 1.0, 1.0), 0.01, None, "peak")
    fleet = random_fleet(policy, 11, limited_share=0.5)
    tree = Tree(fleet.topology)
    roomy = fleet.topology.budget_w * 10.0
    tight = roomy.copy()
    tight[0] = 0.8 * fleet.topology.budget_w[0]  # the facility's below its rows' sum
    for budget in (roomy, tight, roomy, tight):
        kept = build_problem(fleet, policy, tree=tree, budget_w=budget).solver_capacity
        fresh = build_problem(fleet, policy, budget_w=budget).solver_capacity
        assert np.array_equal(kept, fresh)
    implied = build_problem(fleet, policy, tree=tree, budget_w=roomy).solver_capacity
    assert not np.isfinite(implied).all()  # the roomy budgets are implied: left out
    assert np.isfinite(build_problem(fleet, policy, tree=tree, budget_w=tight).solver_capacity[0])


def test_tree_sums_add_as_the_bincounts_do() -> None:
    """Tree.sums (compiled) adds in numpy's bincount order: each node's GPUs in order, then
    each level's groups by parent, the sum added to the parent's: the same bits."""
    policy = policy_for((2, 3, 2, 4), (1.0, 1.0, 1.0, 1.0), 0.01, None, "peak")
    fleet = random_fleet(policy, 3, limited_share=0.5)
    tree = Tree(fleet.topology)
    rng = np.random.default_rng(7)
    for _ in range(50):
        x = rng.uniform(-1e3, 1e3, fleet.n) * rng.choice([1e-9, 1.0, 1e9], fleet.n)
        want = np.bincount(tree.node_of_gpu, weights=x, minlength=tree.n_groups)
        for level in range(len(tree.levels) - 1, 0, -1):
            g = tree.levels[level]
            want += np.bincount(tree.parents[level], weights=want[g], minlength=tree.n_groups)
        assert tree.sums(x).tobytes() == want.tobytes()
    x[1] = np.nan
    assert np.isnan(tree.sums(x)[tree.gpu_groups[1]]).all()


def _cleared(
    problem: Problem, p: np.ndarray, want: np.ndarray, groups: np.ndarray, g: int, i: int
) -> bool:
    """Group g has nothing above demand left and every band below GPU i's at its minimum."""
    tol = 1e-9
    members = np.flatnonzero((groups == g).any(axis=1))
    lower = members[problem.weight[members] < problem.weight[i]]
    return bool(
        np.all(p[members] <= want[members] + tol) and np.all(p[lower] <= problem.lo[lower] + tol)
    )


@EXAMPLES
@given(cases())
def test_priority_bands_caps_only_where_a_budget_needs_it(case: Case) -> None:
    # Dynamo's scheme: a GPU stays at its maximum unless a group above it is full; one is
    # held below its demand only where such a group has no power above demand left to cut,
    # and a higher band's GPU only where that group's lower bands are at their minimum.
    from powerd.allocator.baselines import priority_bands

    problem = build_problem(case.fleet, case.policy)
    if problem.status == "infeasible_min":
        return
    p, _ = priority_bands(problem)
    tree, lo, hi = problem.tree, problem.lo, problem.hi
    want = np.clip(problem.demand_w / 1000.0, lo, hi)
    sums = tree.sums(p)
    assert np.all(sums <= problem.capacity + 1e-9)
    full = sums >= problem.capacity - 1e-9
    groups = case.fleet.topology.gpu_groups
    under_full = full[groups].any(axis=1)
    assert np.all(p[~under_full] == hi[~under_full])
    tol = 1e-9
    for i in np.flatnonzero(p < want - tol):
        binding = [g for g in groups[i] if full[g]]
        assert binding

        # In the group that cut it (one of the full ones), nothing above demand is left and
        # every lower band sits at its minimum.
        assert any(_cleared(problem, p, want, groups, g, i) for g in binding)
