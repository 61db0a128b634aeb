"""The reference formulation in cvxpy, rebuilt on every call.

Rebuilding is deliberate: cvxpy's compile-once (DPP) path costs memory growing like n² and
is no faster per call here (docs/allocator.md, "Measurements behind the design"). The
problem is stated in kW, each level's budgets as one sparse 0/1 matrix, the utility as the
minimum of its affine pieces (concave, so DCP). Clarabel runs with tightened tolerances;
SCS is the fallback on a solver error. The caller verifies and repairs whatever comes
back (solve.allocate_arrays).
"""

from __future__ import annotations

from typing import Any

import cvxpy as _cvxpy
import numpy as np
import scipy.sparse as sp

from powerd.allocator.problem import FloatArray, IntArray, Problem, SolverFailed
from powerd.topology import N_LEVELS

# cvxpy's own annotations are partial (atoms are re-exported untyped); treat it as dynamic.
cp: Any = _cvxpy

CLARABEL_OPTIONS: dict[str, Any] = {
    "tol_gap_abs": 1e-10,
    "tol_gap_rel": 1e-10,
    "tol_feas": 1e-10,
    "tol_ktratio": 1e-8,
    "max_iter": 400,
}
SCS_OPTIONS: dict[str, Any] = {"eps_abs": 1e-9, "eps_rel": 1e-9, "max_iters": 200_000}
_OK = (cp.OPTIMAL, cp.OPTIMAL_INACCURATE)


def build(problem: Problem) -> tuple[Any, Any, IntArray]:
    """The cvxpy problem over the GPUs whose cap is not fixed; returns it, its variable and
    the indices of those GPUs."""
    prob, p, free, _ = _build(problem)
    return prob, p, free


def _build(problem: Problem) -> tuple[Any, Any, IntArray, list[tuple[Any, IntArray]]]:
    """build(), and each budget constraint with the groups of its rows."""
    free = np.flatnonzero(problem.hi - problem.lo > 0.0)
    fixed_p = np.where(problem.hi - problem.lo > 0.0, 0.0, problem.lo)
    m = free.size
    p = cp.Variable(m, name="caps_kw")
    lo, hi, prev = problem.lo[free], problem.hi[free], problem.prev[free]
    starts, slopes = problem.starts[:, free], problem.slopes[:, free]
    # Piece k is the tangent of the (weighted) utility along segment k: U(start_k) + s_k·(p −
    # start_k), with U(lo) = 0. Each lies above a concave curve, so their minimum is the
    # curve itself: maximise Σ t with t below every piece of a non-empty segment (the
    # pieces of empty ones are redundant and only cost solver time).
    lengths = problem.lengths[:, free]
    offsets = np.cumsum(slopes * lengths, axis=0) - slopes * lengths
    seg, gpu = np.nonzero(lengths > 0.0)
    t = cp.Variable(m, name="utility")
    hypograph = t[gpu] <= (
        offsets[seg, gpu]
        - slopes[seg, gpu] * starts[seg, gpu]
        + cp.multiply(slopes[seg, gpu], p[gpu])
    )
    gain = cp.sum(t) + problem.delta * cp.sum(p) - problem.eps * cp.sum_squares(p - prev)
    constraints: list[Any] = [p >= lo, p <= hi, hypograph]
    if problem.jobs is not None:
        # One cap per job: every member equals the job's first member (members share lo and
        # hi, so a job's GPUs are all free or all fixed).
        pos = np.full(problem.n, -1, dtype=np.int64)
        pos[free] = np.arange(m)
        job = problem.jobs.job
        members = np.flatnonzero((job >= 0) & (pos >= 0))
        if members.size:
            first = np.full(problem.jobs.n_jobs, -1, dtype=np.int64)
            first[job[members[::-1]]] = members[::-1]
            rest = members[first[job[members]] != members]
            if rest.size:
                constraints.append(p[pos[rest]] == p[pos[first[job[rest]]]])
    budgets: list[tuple[Any, IntArray]] = []
    tree = problem.tree
    fixed_sums = tree.sums(fixed_p)
    hi_sums = tree.sums(np.where(problem.hi - problem.lo > 0.0, problem.hi, fixed_p))
    for level in range(N_LEVELS):
        groups = tree.levels[level]
        room = problem.capacity[groups] - fixed_sums[groups]
        # Only budgets that could bind: the others cannot change the optimum.
        binding = np.flatnonzero(hi_sums[groups] > problem.capacity[groups])
        if binding.size == 0 or m == 0:
            continue
        row_of_group = np.full(tree.n_groups, -1, dtype=np.int64)
        row_of_group[groups[binding]] = np.arange(binding.size)
        rows = row_of_group[tree.gpu_groups[free, level]]
        member = rows >= 0
        a = sp.csr_matrix(
            (np.ones(int(member.sum())), (rows[member], np.flatnonzero(member))),
            shape=(binding.size, m),
        )
        constraints.append(a @ p <= room[binding])
        budgets.append((constraints[-1], groups[binding]))
    prob = cp.Problem(cp.Maximize(gain), constraints)
    if not prob.is_dcp():
        raise SolverFailed(
            "the cvxpy allocation problem is not DCP: every class profile must be concave "
            "and non-decreasing (Profile builds the envelope) and damping must be >= 0"
        )
    return prob, p, free, budgets


def solve(problem: Problem, warm: FloatArray | None = None) -> tuple[FloatArray, None]:
    """Caps (kW) from Clarabel, or SCS when Clarabel errors; SolverFailed when neither works."""
    del warm
    return solve_with_prices(problem)[0], None


def solve_with_prices(problem: Problem) -> tuple[FloatArray, FloatArray]:
    """solve(), and each group's multiplier per kW (the budget constraints' duals; 0 for
    budgets that cannot bind)."""
    out = problem.lo.copy()
    prices = np.zeros(problem.tree.n_groups)
    prob, p, free, budgets = _build(problem)
    if free.size == 0:
        return out, prices
    errors: list[str] = []
    for name, options in (("CLARABEL", CLARABEL_OPTIONS), ("SCS", SCS_OPTIONS)):
        try:
            prob.solve(solver=name, **options)
        except cp.SolverError as exc:
            errors.append(f"{name}: {exc}")
            continue
        if prob.status in _OK and p.value is not None:
            out[free] = np.asarray(p.value, dtype=np.float64)
            for constraint, groups in budgets:
                if constraint.dual_value is not None:
                    prices[groups] = np.maximum(np.asarray(constraint.dual_value), 0.0)
            return out, prices
        errors.append(f"{name}: status {prob.status}")
    raise SolverFailed("cvxpy could not solve the allocation: " + "; ".join(errors))
