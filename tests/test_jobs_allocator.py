"""Jobs in the allocator and the safety planner: one cap per job, optimally, and raised
together or not at all.

Properties on random sites (hypothesis): `fast` (semismooth Newton when jobs exist) agrees
with the cvxpy reference, which states the same problem with an equality per member;
every solver gives every GPU of a job one cap and breaks no budget or bound. Then the rules
that fold a job's members into one range, and the planner's rule for raises.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from support.planner import ack_all, simple_fleet, teach

from powerd.allocator import SOLVERS, GpuArrays, allocate_arrays, build_problem
from powerd.policy import Policy
from powerd.safety import SafetyPlanner
from powerd.testing.synthetic import make_policy, random_fleet, with_jobs

TOL_W = 1e-6
CASES = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
# Small cases: .ci/run also runs them as plain Python (NUMBA_DISABLE_JIT=1, docs/allocator.md).
pytestmark = pytest.mark.plain_python


@st.composite
def sites_with_jobs(draw: st.DrawFn, exact_fit: bool = False) -> tuple[Policy, GpuArrays]:
    shape = (
        draw(st.integers(1, 2)),
        draw(st.integers(1, 3)),
        draw(st.integers(1, 4)),
        draw(st.sampled_from([2, 4, 8])),
    )
    fractions = tuple(draw(st.floats(0.7, 1.0)) for _ in range(4))
    if exact_fit:  # the facility's budget the sum of its rows', a row's maybe its racks'
        fractions = (1.0, draw(st.sampled_from([1.0, fractions[1]])), *fractions[2:])
    policy = make_policy(
        *shape,
        fractions=fractions,  # type: ignore[arg-type]
        damping=draw(st.sampled_from([0.001, 0.01, 0.1])),
        slew_w=draw(st.sampled_from([None, 40.0, 150.0])),
    )
    seed = draw(st.integers(0, 2**31))
    share = st.sampled_from([0.0, 0.0, 0.2])
    fleet = random_fleet(
        policy,
        seed,
        stale_share=draw(share),
        pinned_share=draw(share),
        limited_share=draw(st.sampled_from([0.2, 0.5, 0.9])),
    )
    fleet = with_jobs(
        fleet,
        seed,
        share=draw(st.sampled_from([0.3, 0.7, 1.0])),
        sizes=(2, 3, 4, 8, 16, 32),
        scattered=draw(st.sampled_from([0.0, 0.5, 1.0])),
    )
    return policy, fleet


def one_cap_per_job(fleet: GpuArrays, caps_w: np.ndarray, split: tuple[str, ...]) -> None:
    assert fleet.job_index is not None
    for j, name in enumerate(fleet.job_names):
        members = np.flatnonzero(fleet.job_index == j)
        if members.size and name not in split:
            assert np.ptp(caps_w[members]) == 0.0, name


def budgets_and_bounds(policy: Policy, fleet: GpuArrays, caps_w: np.ndarray) -> None:
    problem = build_problem(fleet, policy)
    topo = fleet.topology
    over = topo.group_sums(caps_w) / 1000.0 - problem.capacity
    assert np.all(over <= 1e-9)
    assert np.all(caps_w >= problem.lo * 1000.0 - TOL_W)
    assert np.all(caps_w <= problem.hi * 1000.0 + TOL_W)
    assert np.all(caps_w >= fleet.min_cap_w - TOL_W)
    assert np.all(caps_w <= fleet.max_cap_w + TOL_W)


@CASES
@given(sites_with_jobs())
def test_fast_agrees_with_cvxpy_with_jobs(site: tuple[Policy, GpuArrays]) -> None:
    policy, fleet = site
    fast = allocate_arrays(fleet, policy, "fast")
    ref = allocate_arrays(fleet, policy, "cvxpy")
    assert fast.status == ref.status
    assert fast.split_jobs == ref.split_jobs
    assert abs(fast.objective - ref.objective) <= 1e-6 * max(abs(ref.objective), 1.0)
    # The certificate agrees: converged, so the dual bound meets the caps' value.
    assert 0.0 <= fast.gap <= 1e-6
    one_cap_per_job(fleet, fast.caps_w, fast.split_jobs)
    one_cap_per_job(fleet, ref.caps_w, ref.split_jobs)


@CASES
@given(sites_with_jobs(exact_fit=True))
def test_budgets_their_childrens_imply_are_left_to_them(site: tuple[Policy, GpuArrays]) -> None:
    """A budget set to the sum of its children's binds only when they all do, and then
    adds nothing: the exact solvers leave it out (Problem.solver_capacity), so that no
    price can wander between it and them. The answer is cvxpy's (which holds every budget),
    and repair holds it too."""
    policy, fleet = site
    problem = build_problem(fleet, policy)
    # (Not where even some minimums break a budget: those GPUs are fixed, their group left
    # out, and what they take may leave the facility's budget binding after all.)
    assume(problem.infeasible_groups.size == 0)
    assert np.isfinite(problem.capacity[0])
    assert not np.isfinite(problem.solver_capacity[0])
    fast = allocate_arrays(fleet, policy, "fast")
    ref = allocate_arrays(fleet, policy, "cvxpy")
    assert abs(fast.objective - ref.objective) <= 1e-6 * max(abs(ref.objective), 1.0)
    budgets_and_bounds(policy, fleet, fast.caps_w)
    one_cap_per_job(fleet, fast.caps_w, fast.split_jobs)


@CASES
@given(sites_with_jobs())
def test_the_start_relaxes_jobs_to_their_parts_on_each_node(site: tuple[Policy, GpuArrays]) -> None:
    """coupled_newton.py's cold start is the tree solver's answer with each job cut into its parts
    on each node (JobMap.parts), one unit per part: where a job's caps in force are equal (a
    steered job's are), that is the problem with every member free, in fewer units."""
    from powerd.allocator import objective, tree_solver

    policy, fleet = site
    problem = build_problem(fleet, policy)
    jobs = problem.jobs
    assume(jobs is not None)
    assert jobs is not None
    unit, size, rep = jobs.parts(problem.tree)
    node = problem.tree.node_of_gpu
    # Each unit: one free GPU, or the GPUs of one job on one node, all of them.
    assert np.array_equal(np.bincount(unit), size)
    assert np.array_equal(unit[rep], np.arange(size.size))
    assert np.all(node[rep][unit] == node)
    assert np.all(jobs.job[rep][unit] == jobs.job)
    assert np.all(size[unit[~jobs.member]] == 1.0)
    key = np.where(jobs.member, jobs.job * problem.tree.n_groups + node, -1 - np.arange(fleet.n))
    assert size.size == np.unique(key).size
    # With equal caps in force per job, the parts answer as the members would if free.
    steered = replace(fleet, cap_w=jobs.max(fleet.cap_w))
    problem = build_problem(steered, policy)
    assume(problem.jobs is not None)
    caps, _ = tree_solver._tree_solve(problem, None, rough=True)
    free = replace(problem, jobs=None)
    caps_free, _ = tree_solver._tree_solve(free, None, rough=True)
    over = problem.tree.sums(caps) - problem.solver_capacity
    assert np.all(over <= np.maximum(1e-9, 1e-7 * np.abs(problem.solver_capacity)))
    a, b = objective(free, caps), objective(free, caps_free)
    assert abs(a - b) <= 1e-6 * max(abs(b), 1.0)


@CASES
@given(sites_with_jobs(), st.sampled_from([s for s in SOLVERS if s != "cvxpy"]))
def test_every_solver_gives_a_job_one_cap_within_every_budget(
    site: tuple[Policy, GpuArrays], solver: str
) -> None:
    policy, fleet = site
    alloc = allocate_arrays(fleet, policy, solver)
    one_cap_per_job(fleet, alloc.caps_w, alloc.split_jobs)
    if alloc.status != "infeasible_min":
        budgets_and_bounds(policy, fleet, alloc.caps_w)


def small_site(job: list[int], **fleet_changes: object) -> tuple[Policy, GpuArrays]:
    policy = make_policy(1, 1, 2, 4, fractions=(1.0, 1.0, 1.0, 0.8))
    fleet = random_fleet(policy, 7, limited_share=1.0)
    fleet = replace(
        fleet,
        class_index=np.zeros(fleet.n, dtype=np.int64),
        job_index=np.array(job, dtype=np.int64),
        job_names=("a", "b"),
        **fleet_changes,  # type: ignore[arg-type]
    )
    return policy, fleet


def test_a_job_that_mixes_classes_is_split_and_reported() -> None:
    policy, fleet = small_site([0, 0, 0, 0, 1, 1, -1, -1])
    cls = fleet.class_index.copy()
    cls[1] = 1
    fleet = replace(fleet, class_index=cls)
    for solver in ("fast", "cvxpy"):
        alloc = allocate_arrays(fleet, policy, solver)
        assert alloc.split_jobs == ("a",)
        one_cap_per_job(fleet, alloc.caps_w, alloc.split_jobs)
    assert "split_jobs" in alloc.to_json()


def test_a_stale_or_pinned_member_holds_its_whole_job() -> None:
    stale = np.zeros(8, dtype=np.bool_)
    stale[2] = True
    policy, fleet = small_site([0, 0, 0, 0, 1, 1, 1, 1], stale=stale)
    alloc = allocate_arrays(fleet, policy, "fast")
    held = max(fleet.cap_w[2], fleet.min_cap_w[:4].max())
    assert np.all(alloc.caps_w[:4] <= held + TOL_W)  # a stale GPU is never raised
    pinned = np.full(8, np.nan)
    pinned[5] = 400.0
    policy, fleet = small_site([0, 0, 0, 0, 1, 1, 1, 1], pinned_w=pinned)
    alloc = allocate_arrays(fleet, policy, "fast")
    assert np.allclose(alloc.caps_w[4:], 400.0)


def test_a_node_held_by_one_job_bounds_that_job() -> None:
    """Node n0's four GPUs are all job a: its budget becomes a bound on a's cap, and the
    job spanning both nodes still gets one cap that fits both budgets."""
    policy, fleet = small_site([0, 0, 0, 0, 0, 0, -1, -1])
    problem = build_problem(fleet, policy)
    node0 = fleet.topology.gpu_groups[0, -1]
    assert np.all(problem.hi[:6] <= problem.capacity[node0] / 4 + 1e-12)
    fast = allocate_arrays(fleet, policy, "fast")
    ref = allocate_arrays(fleet, policy, "cvxpy")
    assert abs(fast.objective - ref.objective) <= 1e-6 * abs(ref.objective)
    budgets_and_bounds(policy, fleet, fast.caps_w)


# ---- the planner -------------------------------------------------------------------------


def test_a_job_with_a_stale_member_waits_whole() -> None:
    policy, layout = simple_fleet([2, 2], facility=10_000.0)
    planner = SafetyPlanner(policy, layout)
    teach(planner, layout, np.full(4, 200.0), at=0.0)
    jobs = np.array([0, 0, 0, -1])
    # n1 reported long ago: its GPUs are stale, so g1-0 may not rise, nor its job.
    planner.on_telemetry("n0", {"g0-0": 200.0, "g0-1": 200.0}, received_at=10.0)
    plan = planner.plan(1, 10.0, np.full(4, 300.0), jobs=jobs)
    assert plan.sent_w[:3].tolist() == [200.0, 200.0, 200.0]
    assert not plan.raised[:3].any()


def test_a_job_is_raised_whole_or_not_at_all_and_free_gpus_take_what_is_left() -> None:
    policy, layout = simple_fleet([2, 2], facility=1000.0)
    planner = SafetyPlanner(policy, layout)
    teach(planner, layout, np.full(4, 200.0), at=0.0)
    jobs = np.array([0, 0, 0, -1])
    # 200 W of room: the job wants 3 × 100 W and waits; the free GPU takes its 100 W.
    plan = planner.plan(1, 0.0, np.full(4, 300.0), jobs=jobs)
    assert plan.sent_w.tolist() == [200.0, 200.0, 200.0, 300.0]
    ack_all(planner, plan, at=0.1)
    # With room for all of it the job rises as one.
    budget = layout.topology.budget_w.copy()
    budget[0] = 1200.0
    plan = planner.plan(2, 0.5, np.full(4, 300.0), jobs=jobs, budget_w=budget)
    assert plan.sent_w.tolist() == [300.0, 300.0, 300.0, 300.0]


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(100.0, 400.0), min_size=6, max_size=6),
    st.lists(st.floats(100.0, 400.0), min_size=6, max_size=6),
    st.lists(st.integers(-1, 1), min_size=6, max_size=6),
    st.floats(1000.0, 2400.0),
    st.lists(st.floats(0.0, 5.0), min_size=6, max_size=6),
)
def test_a_raise_never_splits_a_job(
    start: list[float], target: list[float], job: list[int], facility: float, prio: list[float]
) -> None:
    """Whatever the caps in force, the targets and the room: members either all get their
    raise or none does, and no budget is exceeded."""
    policy, layout = simple_fleet([3, 3], facility=facility)
    planner = SafetyPlanner(policy, layout)
    caps = np.array(start)
    teach(planner, layout, caps, at=0.0)
    jobs = np.array(job)
    # The allocator gives a job one target.
    targets = np.array(target)
    for j in (0, 1):
        targets[jobs == j] = targets[jobs == j].min(initial=400.0)
    plan = planner.plan(1, 0.0, targets, jobs=jobs, priority=np.array(prio))
    committed_before = np.maximum(caps, 0.0)
    for j in (0, 1):
        members = np.flatnonzero(jobs == j)
        wants = members[targets[members] > committed_before[members] + 1e-6]
        if wants.size:
            got = plan.sent_w[wants] > committed_before[wants] + 1e-6
            assert got.all() or not got.any()
            if got.all():
                assert np.allclose(plan.sent_w[wants], targets[wants])
    total = float(np.sum(np.maximum(plan.committed_w, 0.0)))
    assert total <= max(facility, float(caps.sum())) + 1e-6
