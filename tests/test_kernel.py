"""The compiled kernels against plain references: a group's root found by stepping (large
groups) against the one found exactly from every kink, the budget cuts of repair against
numpy, and the jobs gap's reuse of the last pass."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerd.allocator import Tree, allocate_arrays, build_problem, coupled_newton, kernel
from powerd.allocator.problem import TOL_KW, FloatArray, IntArray, objective, repair
from powerd.testing.synthetic import make_policy, random_fleet, with_jobs
from powerd.topology import N_LEVELS

EXAMPLES = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _group(seed: int, n: int) -> tuple[FloatArray, FloatArray, FloatArray, FloatArray, FloatArray]:
    """n units of a group: segments as the tree solver's (tops falling, gaps between), many
    of them sharing their kinks (one class, GPUs at the same caps), floors from groups
    below (a share of the units frozen at one of a few prices)."""
    rng = np.random.default_rng(seed)
    n_k = 4
    ln = rng.uniform(0.0, 0.2, (n, n_k)) * (rng.random((n, n_k)) < 0.9)
    gaps = rng.choice([0.0, 0.05, 0.3], (n, n_k))
    top = rng.choice([1.0, 1.5, 2.0], n)[:, None] + rng.normal(0.0, 0.3, (n, 1)) * (
        rng.random((n, 1)) < 0.5
    )
    a = top - np.cumsum(np.c_[np.zeros(n), (ln + gaps)[:, :-1]], axis=1)
    lo = rng.uniform(0.1, 0.3, n)
    mult = rng.choice([1.0, 1.0, 8.0], n)
    floor = np.where(rng.random(n) < 0.4, rng.choice([0.5, 0.9, 1.2], n), 0.0)
    return np.ascontiguousarray(a), np.ascontiguousarray(ln), lo, mult, floor


def _total(
    a: FloatArray, ln: FloatArray, lo: FloatArray, m: FloatArray, fl: FloatArray, x: float
) -> float:
    xi = np.maximum(x, fl)[:, None]
    return float(np.sum(m * (lo + np.clip(a - xi, 0.0, ln).sum(axis=1))))


@EXAMPLES
@given(
    st.integers(0, 2**32 - 1),
    st.integers(600, 3000),
    st.floats(0.05, 0.95),
    st.sampled_from([0.0, 0.5, 1.0, 1.5, 1.9]),
)
def test_large_group_root_is_exact(seed: int, n: int, share: float, guess: float) -> None:
    """kernel._root (false position, Newton's first step, median steps where it stalls)
    lands where F meets the capacity, as _root_kinks (every kink, exact) does: same F."""
    a, ln, lo, m, fl = _group(seed, n)
    f_hi = _total(a, ln, lo, m, fl, 1e9)
    cap = f_hi + share * (_total(a, ln, lo, m, fl, 0.0) - f_hi)
    tol = max(1e-9, kernel.REL_TOL * abs(cap))
    room = n * (2 * a.shape[1] + 1)
    u = kernel._root(0, n, a, ln, lo, m, fl, cap, tol, np.empty(kernel.SAMPLE), guess)
    exact = kernel._root_kinks(0, n, a, ln, lo, m, fl, cap, tol, np.empty(room), np.empty(room))
    assert abs(_total(a, ln, lo, m, fl, u) - cap) <= 1e-9 * cap
    assert abs(_total(a, ln, lo, m, fl, exact) - cap) <= 1e-9 * cap


@EXAMPLES
@given(st.integers(0, 2**32 - 1), st.integers(300, 4000), st.floats(0.05, 0.95))
def test_sample_root_starts_a_large_group_near_its_root(seed: int, n: int, share: float) -> None:
    """A large group with no guess looks first where F of a sample of its units meets the
    capacity: exactly the root where the sample is the whole group (fewer than twice
    SAMPLE_UNITS units: stride 1), and a price inside the range of F's kinks elsewhere."""
    a, ln, lo, m, fl = _group(seed, n)
    f_hi = _total(a, ln, lo, m, fl, 1e9)
    cap = f_hi + share * (_total(a, ln, lo, m, fl, 0.0) - f_hi)
    x1 = kernel._sample_root(0, n, a, ln, lo, m, fl, cap)
    if n < 2 * kernel.SAMPLE_UNITS:
        # (Compiled with reassociation, the sums round differently: F there, not x1, is
        # compared.)
        assert abs(_total(a, ln, lo, m, fl, x1) - cap) <= 1e-8 * abs(cap)
    assert x1 <= float(np.max(a)) + 1.0


def _jobs_setup_numpy(tree: Tree, job: IntArray) -> tuple[tuple[IntArray, ...], ...]:
    """JobMap.incidence, JobMap.parts and the single-job groups by numpy sorts: the code the
    compiled ones replaced."""
    member = job >= 0
    n, n_groups = job.size, tree.n_groups
    n_jobs = int(job.max(initial=-1)) + 1
    members = np.flatnonzero(member)
    keys = (job[members, None] * n_groups + tree.gpu_groups[members]).ravel()
    pairs, counts = np.unique(keys, return_counts=True)
    ptr = np.searchsorted(pairs // n_groups, np.arange(n_jobs + 1))
    incidence = (ptr, pairs % n_groups, counts.astype(np.float64))
    key = np.where(member, n + job * n_groups + tree.node_of_gpu, np.arange(n))
    _, first, unit = np.unique(key, return_index=True, return_inverse=True)
    unit = unit.ravel()
    parts = (unit, np.bincount(unit).astype(np.float64), first)
    first_gpu = tree.first_gpu
    job_of = np.where(first_gpu >= 0, job[np.maximum(first_gpu, 0)], -1)
    same = np.zeros(n_groups)
    for level in range(N_LEVELS):
        idx = tree.gpu_groups[:, level]
        same += np.bincount(idx, weights=job == job_of[idx], minlength=n_groups)
    single = ((job_of >= 0) & (same == tree.counts),)
    n_free = int(np.count_nonzero(~member))
    unit = np.where(member, n_free + job, 0)
    unit[~member] = np.arange(n_free)
    rep = np.empty(n_free + n_jobs, dtype=np.int64)
    rep[unit[::-1]] = np.arange(n)[::-1]
    units = (unit, np.bincount(unit).astype(np.float64), rep)
    return incidence, parts, single, units


def test_tree_first_gpus_and_node_paths_match_numpy() -> None:
    """Tree.first_gpu (each group's lowest-numbered GPU, -1 for none) and Tree.node_paths
    (each node's path, each GPU's row there) equal what a pass per level and np.unique give,
    GPUs in any order."""
    from dataclasses import replace

    policy = make_policy(2, 3, 4, 4)
    fleet = random_fleet(policy, 7)
    rng = np.random.default_rng(7)
    order = rng.permutation(fleet.n)[: fleet.n - 5]  # shuffled, some nodes left short
    topo = fleet.topology
    tree = Tree(replace(topo, gpu_groups=topo.gpu_groups[order]))
    first = np.full(tree.n_groups, -1, dtype=np.int64)
    gpus = np.arange(tree.gpu_groups.shape[0])[::-1]
    for level in range(N_LEVELS):
        first[tree.gpu_groups[::-1, level]] = gpus
    assert np.array_equal(tree.first_gpu, first)
    _, at, row = np.unique(tree.node_of_gpu, return_index=True, return_inverse=True)
    paths, rows = tree.node_paths
    assert np.array_equal(paths, tree.gpu_groups[at])
    assert np.array_equal(rows, row.ravel())


@EXAMPLES
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.0), st.floats(0.0, 1.0))
def test_job_setup_matches_numpy(seed: int, share: float, scattered: float) -> None:
    """The jobs' (group, GPUs) pairs, their parts on each node and the groups one job holds
    alone, compiled, equal what numpy's sorts give (fleets with some GPUs in no job, jobs
    on one node or scattered, jobs renumbered after others were dissolved)."""
    from powerd.allocator.problem import JobMap, _single_job_groups

    rng = np.random.default_rng(seed)
    policy = make_policy(2, 3, 4, int(rng.choice([1, 2, 8])))
    fleet = random_fleet(policy, seed % 1000)
    if share > 0.0:
        fleet = with_jobs(
            fleet, seed % 1000, share=share, sizes=(1, 2, 3, 8, 16), scattered=scattered
        )
    jobs_map = JobMap.of(fleet)
    if jobs_map is not None and rng.random() < 0.3:
        jobs_map = jobs_map.without(rng.random(fleet.n) < 0.1)
    if jobs_map is None:
        return
    tree = Tree(fleet.topology)
    incidence, parts, single, units = _jobs_setup_numpy(tree, jobs_map.job)
    for got, want in zip(jobs_map.units, units, strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(jobs_map.incidence(tree), incidence, strict=True):
        assert np.array_equal(got, want)
    for got, want in zip(jobs_map.parts(tree), parts, strict=True):
        assert np.array_equal(got, want)
    assert np.array_equal(_single_job_groups(tree, jobs_map), single[0])


def _cut_numpy(
    p: FloatArray, lo: FloatArray, gpu_groups: IntArray, target: FloatArray
) -> FloatArray:
    """repair's cuts as numpy bincounts (what the compiled loop replaced)."""
    n_groups = target.size
    for level in range(N_LEVELS - 1, -1, -1):
        idx = gpu_groups[:, level]
        sums = np.bincount(idx, weights=p, minlength=n_groups)
        floor = np.bincount(idx, weights=lo, minlength=n_groups)
        excess = sums - np.maximum(target, floor)
        room = sums - floor
        with np.errstate(divide="ignore", invalid="ignore"):
            keep = np.where(excess > 0.0, np.where(room > 0.0, 1.0 - excess / room, 0.0), 1.0)
        p = lo + (p - lo) * np.clip(keep, 0.0, 1.0)[idx]
    return p


@EXAMPLES
@given(st.integers(0, 2**32 - 1), st.floats(0.3, 1.2))
def test_budget_cuts_match_numpy_and_hold(seed: int, scale: float) -> None:
    """kernel.cut_to_budgets cuts as the numpy reference does, and after it every group is
    within its target (or at its GPUs' lower bounds where those exceed it)."""
    policy = make_policy(2, 3, 2, 4)
    fleet = random_fleet(policy, seed)
    tree = Tree(fleet.topology)
    rng = np.random.default_rng(seed)
    lo = rng.uniform(0.1, 0.2, fleet.n)
    p = lo + rng.uniform(0.0, 0.6, fleet.n)
    target = scale * tree.sums(p) * rng.uniform(0.7, 1.1, tree.n_groups)
    target[rng.random(tree.n_groups) < 0.2] = np.inf
    got = p.copy()
    kernel.cut_to_budgets(got, lo, tree.node_of_gpu, tree.parent, tree.deepest_first, target)
    want = _cut_numpy(p.copy(), lo, tree.gpu_groups, target)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15)
    over = tree.sums(got) - np.maximum(target, tree.sums(lo))
    assert np.all(
        over <= 1e-9 * np.maximum(np.abs(np.where(np.isfinite(target), target, 0.0)), 1.0)
    )


def test_gap_reuses_the_last_pass_only_at_its_prices() -> None:
    """coupled_newton.gap takes D from the last pass where the prices are those it was made at (the
    solve's answer) and evaluates D afresh elsewhere: the same certificate either way."""
    policy = make_policy(1, 4, 4, 8, fractions=(0.9, 0.9, 0.9, 0.85))
    fleet = with_jobs(random_fleet(policy, 3), 3, share=0.7, scattered=0.5)
    alloc = allocate_arrays(fleet, policy, "fast")
    problem = build_problem(fleet, policy)
    assert problem.jobs is not None and alloc.prices is not None
    caps = repair(problem, alloc.caps_w / 1000.0)
    fresh = coupled_newton.gap(problem, caps, alloc.prices)  # a new problem: no pass made yet
    dual = coupled_newton._dual_of(problem, problem.jobs)
    assert dual.last is not None and np.array_equal(
        dual.last[0], np.where(dual.finite, np.maximum(alloc.prices, 0.0), 0.0)
    )
    again = coupled_newton.gap(problem, caps, alloc.prices)  # from the stored pass
    assert again == fresh
    other = alloc.prices * 1.5
    assert coupled_newton.gap(problem, caps, other) >= 0.0
    assert dual.last is not None and np.array_equal(
        dual.last[0], np.where(dual.finite, np.maximum(other, 0.0), 0.0)
    )
    assert max(fresh, 0.0) <= 1e-6 + TOL_KW


@EXAMPLES
@given(st.integers(0, 2**32 - 1), st.floats(0.05, 1.0), st.floats(0.0, 1.0))
def test_newton_matrix_matches_numpy(seed: int, share: float, inside: float) -> None:
    """coupled_newton.py's generalised Hessian on a working set: Σ over units inside a segment of
    inv/m · c cᵀ, c a unit's GPUs per group (a job's pairs, a free GPU's path), as numpy
    builds it from each GPU's groups."""
    rng = np.random.default_rng(seed)
    policy = make_policy(2, 3, 4, 8, fractions=(0.9, 0.9, 0.9, 0.85))
    fleet = with_jobs(random_fleet(policy, seed % 1000), seed % 1000, share=0.7, scattered=0.5)
    problem = build_problem(fleet, policy)
    assert problem.jobs is not None
    dual = coupled_newton._Dual(problem, problem.jobs)
    tree = problem.tree
    partial = rng.random(dual.n_units) < inside
    work = np.flatnonzero(rng.random(tree.n_groups) < share)
    col = np.full(tree.n_groups, -1, dtype=np.int64)
    col[work] = np.arange(work.size)
    h = kernel.incidence_hessian(partial, *dual.incidence, dual.size, col, int(work.size), dual.inv)
    # c per unit: its GPUs under each group.
    c = np.zeros((dual.n_units, tree.n_groups))
    for level in range(N_LEVELS):
        np.add.at(c, (dual.unit, tree.gpu_groups[:, level]), 1.0)
    d = np.where(partial, dual.inv / dual.size, 0.0)
    ref = (c[:, work].T * d) @ c[:, work]
    assert np.allclose(h, ref, rtol=1e-12, atol=1e-9)


@EXAMPLES
@given(st.integers(0, 2**32 - 1), st.floats(0.0, 1.2))
def test_objective_matches_numpy_interpolation(seed: int, top: float) -> None:
    """problem.objective (compiled: kernel.objective_value) is the numpy formula: each class's
    profile interpolated at min(cap, demand), clamped at the table's ends, plus the linear
    and damping terms."""
    policy = make_policy(1, 2, 3, 4)
    fleet = random_fleet(policy, seed)
    problem = build_problem(fleet, policy)
    p = np.random.default_rng(seed).uniform(0.0, top, fleet.n)
    used = np.maximum(np.minimum(p * 1000.0, problem.demand_w), 0.0)
    table_w, table_y = problem.classes.value_table
    shift = fleet.class_index * problem.classes.TABLE_OFFSET_W
    util = np.interp(used + shift, table_w, table_y)
    want = (
        float(problem.weight @ util)
        + problem.delta * float(p.sum())
        - problem.eps * float(np.sum((p - problem.prev) ** 2))
    )
    assert abs(objective(problem, p) - want) <= 1e-12 * max(abs(want), 1.0)


def test_objective_passes_nan_on() -> None:
    """A NaN demand (the array path does not validate it; the snapshot path rejects it)
    gives a NaN objective, as the numpy formula did, not a finite number."""
    policy = make_policy(1, 1, 1, 4)
    fleet = random_fleet(policy, 0)
    problem = build_problem(fleet, policy)
    caps = problem.lo.copy()
    assert np.isfinite(objective(problem, caps))
    problem.demand_w[1] = np.nan
    assert np.isnan(objective(problem, caps))
    problem.demand_w[1] = 100.0
    caps[2] = np.nan
    assert np.isnan(objective(problem, caps))


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 300),
    rows=st.integers(1, 40),
    slots=st.integers(1, 3),
)
def test_absorb_rows_finds_a_few_rows_gpus_as_a_pass_over_the_fleet_does(
    seed: int, n: int, rows: int, slots: int
) -> None:
    """The planner's fold of queued readings and acks (`kernel.absorb_rows`) names the rows'
    GPUs by sorting the rows where they are few (`sparse_rows`), else by a pass over the
    fleet: the same results and state either way, on rows with repeats, acks that guess,
    and readings of older and newer ticks."""
    rng = np.random.default_rng(seed)
    gpu = rng.integers(0, n, rows).astype(np.int64)
    hi = rng.uniform(200.0, 700.0, rows)
    lo = hi - rng.uniform(0.0, 100.0, rows)
    key = rng.integers(0, 5, rows).astype(np.int64)
    tick = np.where(rng.random(rows) < 0.5, rng.integers(0, 5, rows), -1).astype(np.int64)
    guess = rng.random(rows) < 0.3
    defiant = np.where(tick >= 0, rng.integers(0, 2, rows), -1).astype(np.int64)
    state_hi = np.where(rng.random(n) < 0.2, np.nan, rng.uniform(200.0, 700.0, n))
    state = (
        state_hi,
        state_hi - 50.0,
        rng.integers(0, 5, n).astype(np.int64),
        np.where(rng.random((slots, n)) < 0.5, rng.integers(0, 5, (slots, n)), -1),
        rng.uniform(0.0, 700.0, (slots, n)),
        rng.uniform(100.0, 700.0, (slots, n)),
        np.where(rng.random(n) < 0.2, 700.0, 0.0),
        rng.integers(0, 5, n).astype(np.int64),
        rng.random(n) < 0.1,
    )
    limits = (np.full(n, 700.0), np.full(n, 200.0), 1.0)
    out = []
    for sparse in (True, False):
        rows_in = tuple(a.copy() for a in (gpu, hi, lo, key, tick, guess, defiant))
        kept = tuple(np.asarray(a).copy() for a in state)
        above, before = kernel.absorb_rows(*rows_in, *kept, *limits, sparse)
        out.append((above, before, rows_in, kept))
    (a1, b1, r1, s1), (a2, b2, r2, s2) = out
    np.testing.assert_array_equal(a1, a2)
    np.testing.assert_array_equal(b1, b2)
    for x, y in zip((*r1, *s1), (*r2, *s2), strict=True):
        np.testing.assert_array_equal(x, y)
