"""The exact tree solver: every budget's multiplier, by nested water-filling.

With price λ per kW on a GPU (the sum of the multipliers of the groups above it), its best
cap maximises f(p) − λp with f = weighted utility + δp − ε(p − prev)². Written per segment,
in the scaled price u = λ / 2ε (kW), the response is

    p(u) = lo + Σ_k clip(a_k − u, 0, len_k),    a_k = prev − start_k + (slope_k + δ) / 2ε

continuous, non-increasing and piecewise linear in u, with slope −1 while a segment is
partly filled. A group's GPUs answer to its price and its ancestors' only, so each
multiplier is zero or the root of a monotone piecewise-linear equation: kernel.py finds
them from the nodes up, compiled.

Jobs (every member one cap): a job with m members answers like one GPU of multiplicity m
whose price is the mean of its members' path prices (coupled_newton.py). Where every group that
holds some of a job's GPUs holds all of them, or only them (build_problem made that a bound on
the job's cap), the job's price is a chain of multipliers like a GPU's: it is one more unit
of the tree solver, hung at the deepest group that holds it whole (*laminar*). A job spread
over groups shared with others couples their prices; then coupled_newton.py (semismooth Newton on
the multipliers) answers, started from last tick's multipliers or, where those do not lead
to the optimum soon (or there are none), this solver's prices for the same problem with
every job relaxed to its parts on each node (a part's GPUs share one cap, parts of a job
need not: each part is one unit hung at its node).
"""

from __future__ import annotations

from contextlib import ExitStack
from dataclasses import dataclass

import numpy as np

from powerd.allocator import coupled_newton
from powerd.allocator.problem import TOL_KW, FloatArray, IntArray, JobMap, Problem
from powerd.topology import N_LEVELS

# Rounds of the active set before a solve with every group (tree_solver._tree_solve).
ACTIVE_ROUNDS = 4
# Where coupled_newton.py does not converge on a site of at most this many GPUs, the reference
# answers.
REFERENCE_UP_TO = 4096
# A group counts as full (or over) within this share of its capacity.
ACTIVE_TOL = 1e-12
# The relaxed problem's roots, coupled_newton.py's start, are found to this share of each capacity
# only: coupled_newton.py's Newton steps refine them anyway, so kernel.REL_TOL there would be wasted
# steps in every group.
ROUGH_TOL = 1e-7
# Caps in force this close to a budget (share) say it bound when they were set.
FULL_SHARE = 1e-6


_Work = tuple[IntArray, FloatArray, FloatArray]  # the tree's workspace (problem.work_arrays)


@dataclass(frozen=True)
class _Units:
    """What gets one cap: free GPUs and laminar jobs; `of_gpu` maps each GPU to its unit."""

    rep: IntArray  # a GPU of each unit (its bounds, class and segments are the unit's)
    mult: FloatArray
    prev: FloatArray
    attach: IntArray
    of_gpu: IntArray


def _units(problem: Problem, jobs: JobMap | None, hang: IntArray | None) -> _Units:
    """Units for the GPUs: one per free GPU, one per job of `jobs` (hung at `hang`)."""
    tree = problem.tree
    n = problem.n
    if jobs is None or hang is None:
        idx = np.arange(n)
        return _Units(idx, np.ones(n), problem.prev, tree.node_of_gpu, idx)
    of_gpu, mult, rep = jobs.units  # free GPUs, then jobs (kept with the jobs)
    n_free = mult.size - jobs.n_jobs
    attach = np.concatenate([tree.node_of_gpu[rep[:n_free]], hang])
    return _Units(rep, mult, problem.unit_prev(of_gpu, mult), attach, of_gpu)


def _part_units(problem: Problem, jobs: JobMap) -> _Units:
    """Units for the jobs relaxed to their parts on each node (JobMap.parts): a part's
    GPUs share its cap, different parts of a job need not."""
    of_gpu, mult, rep = jobs.parts(problem.tree)
    return _Units(rep, mult, problem.unit_prev(of_gpu, mult), problem.tree.node_of_gpu[rep], of_gpu)


def _tree_solve(
    problem: Problem, warm: FloatArray | None, rough: bool = False
) -> tuple[FloatArray, FloatArray]:
    """Caps (kW, per GPU) and multipliers (per kW, per group); `rough`: the problem with
    every job relaxed to its parts on each node (free of one another), every root to
    ROUGH_TOL of its capacity instead of kernel.REL_TOL: coupled_newton.py's start.

    Most budgets do not bind at the optimum: a group whose own price is below an
    ancestor's leaves room. So the solve first holds only the groups that bound last tick
    (`warm`) or that the caps in force fill (state the snapshot carries), then checks every
    other group against the caps found: where none is over, the caps are optimal for the
    whole tree (they are for a relaxation of it, and they fit it); otherwise the groups
    over their budget join the set and it solves again (ACTIVE_ROUNDS at most, then with
    every group).

    Jobs are units of the tree solver while they are laminar for the budgets held. Once a
    held budget holds part of a job (a job crossing a rack's or a row's edge, under a
    budget that binds), the prices couple: coupled_newton.py solves the problem, from last tick's
    multipliers or this solver's answer with every job's GPUs free."""

    tree = problem.tree
    capacity = problem.solver_capacity  # (budgets that cannot bind alone left out)
    finite = np.isfinite(capacity)
    rel_tol = ROUGH_TOL if rough else ACTIVE_TOL
    tol = np.where(finite, np.maximum(TOL_KW, rel_tol * np.abs(capacity)), 0.0)
    # Caps in force within FULL_SHARE of a budget: it bound when they were set.
    room = tree.sums(problem.prev) - capacity
    active = finite & (room >= -FULL_SHARE * np.abs(capacity) - tol)
    if warm is not None:
        active |= finite & (warm > 0.0)
    guess = _guess(problem, warm)
    coupled = False
    parts = _part_units(problem, problem.jobs) if rough and problem.jobs is not None else None
    with ExitStack() as stack:
        work: _Work | None = None
        prepared: _Units | None = None  # the units in the workspace
        for rnd in range(ACTIVE_ROUNDS + 1):
            held = np.where(active, capacity, np.inf)
            units = parts if parts is not None else _held_units(problem, held)
            if units is None:
                coupled = True  # coupled_newton.py answers: this loop's caps would go unused
                break
            if work is None:
                n_k = problem.classes.knots_kw.shape[1] + 1
                work = stack.enter_context(tree.workspace.take(units.rep.size, tree.n_groups, n_k))
            if prepared is None or not np.array_equal(prepared.attach, units.attach):
                _prepare(problem, units, work)  # (the same units every round without jobs)
                prepared = units
            p, u = _kernel_solve(problem, units, held, guess, work, rough=rough)
            over = finite & ~active & (tree.sums(p) > capacity + tol)
            if not over.any():
                break
            # The last round holds every group: its answer is the tree's.
            active = over | active if rnd < ACTIVE_ROUNDS - 1 else finite
            guess = np.where(u > 0.0, u, guess)  # this round's roots are close
    if not coupled:
        return p, _multipliers(problem, u)

    # coupled_newton.py starts from last tick's multipliers; where they do not lead to the optimum
    # within a few iterations (or there are none), from the tree's answer with every job
    # relaxed to its parts on each node if that has the lower dual value (with the laminar
    # jobs kept whole its Newton steps can zigzag for a hundred iterations). A part answers
    # as its GPUs would if free where their caps in force are equal (a steered job's are;
    # bounds and class they share), and a job's parts are far fewer units than its GPUs, so
    # this start is also the cheaper one (docs/performance.md, "With jobs").
    def start() -> FloatArray:
        return _tree_solve(problem, warm, rough=True)[1]

    p, mu, done = coupled_newton.solve_checked(
        problem, warm, start if warm is not None else start()
    )
    if done or problem.n > REFERENCE_UP_TO:
        return p, mu  # where not done, Allocation.gap says how far from the best
    # Newton stalled (its dual is piecewise, and some sites make it zigzag): on a site this
    # small the interior-point reference (Clarabel) answers in well under a second.
    from powerd.allocator import reference  # cvxpy: imported on first use only

    return reference.solve_with_prices(problem)


def _held_units(problem: Problem, held: FloatArray) -> _Units | None:
    """The units for a solve holding the budgets of `held` (+inf elsewhere), or None where a
    job is not laminar for those budgets (its price couples theirs: coupled_newton.py answers)."""
    from powerd.allocator import kernel  # numba: loaded by the first solve, not at import

    jobs = problem.jobs
    if jobs is None:
        return _units(problem, None, None)
    tree = problem.tree
    laminar, hang = kernel.classify_jobs(
        *jobs.incidence(tree), jobs.size, tree.level_of, np.isfinite(held)
    )
    if not np.asarray(laminar).all():
        return None
    return _units(problem, jobs, np.asarray(hang))


def _prepare(problem: Problem, units: _Units, work: _Work) -> None:
    """The units, sorted under their groups with their segments, into the workspace."""
    from powerd.allocator import kernel  # numba: loaded by the first solve, not at import

    classes = problem.classes
    r = units.rep
    kernel.prepare(
        units.attach,
        problem.tree.dfs_rank,
        problem.tree.parent,
        problem.lo[r],
        problem.hi[r],
        problem.flat[r],
        units.prev,
        problem.fleet.class_index[r],
        problem.weight[r],
        units.mult,
        classes.knots_kw,
        classes.slopes_kw,
        problem.delta,
        1.0 / (2.0 * problem.eps),
        *work,
    )


def _kernel_solve(
    problem: Problem,
    units: _Units,
    held: FloatArray,
    guess: FloatArray,
    work: _Work,
    *,
    rough: bool = False,
) -> tuple[FloatArray, FloatArray]:
    """One bottom-up solve of the prepared units holding the budgets of `held`: caps per
    GPU (kW) and each group's U (`rough`: see _tree_solve)."""
    from powerd.allocator import kernel  # numba: loaded by the first solve, not at import

    tree = problem.tree
    n, n_groups, n_k = units.rep.size, tree.n_groups, problem.classes.knots_kw.shape[1] + 1
    rel_tol = ROUGH_TOL if rough else kernel.REL_TOL
    caps, u = kernel.solve_groups(n, n_groups, n_k, tree.deepest_first, held, guess, *work, rel_tol)
    return np.asarray(caps)[units.of_gpu], np.array(u)


def _guess(problem: Problem, warm: FloatArray | None) -> FloatArray:
    """Where each group's price U was last tick (`warm`: from _usable_warm): its path's
    multipliers summed (exact where the group bound; its ancestors' price where it did not,
    which brackets it)."""
    tree = problem.tree
    if warm is None:
        return np.zeros(tree.n_groups)
    mu = warm / (2.0 * problem.eps)
    path = mu.copy()
    for level in range(1, N_LEVELS):
        g = tree.levels[level]
        path[g] += path[tree.parents[level]]
    return path


def _multipliers(problem: Problem, u: FloatArray) -> FloatArray:
    """Each group's multiplier per kW from the prices U at which groups bind: what U adds to
    the highest U above it, so a GPU's path sums to the highest U on it."""
    tree = problem.tree
    above = np.zeros(tree.n_groups)
    for level in range(1, N_LEVELS):
        g = tree.levels[level]
        parent = tree.parents[level]
        above[g] = np.maximum(above[parent], u[parent])
    return np.maximum(u - above, 0.0) * (2.0 * problem.eps)


def _usable_warm(problem: Problem, warm: FloatArray | None) -> FloatArray | None:
    """Last tick's multipliers if they can serve as a start: one finite number per group,
    clipped into [0, the price past which every GPU sits at its lower bound]. No optimal
    multiplier lies above that price, and coupled_newton.py starts from `warm` as given: from a
    price like 1e300 it cannot walk back within its passes."""
    if warm is None or warm.size != problem.tree.n_groups or not np.all(np.isfinite(warm)):
        return None
    first = problem.classes.slopes_kw[problem.fleet.class_index, 0]
    top = np.max(
        problem.weight * first + problem.delta + 2.0 * problem.eps * (problem.prev - problem.lo),
        initial=0.0,
    )
    return warm.clip(0.0, top)


def solve(problem: Problem, warm: FloatArray | None = None) -> tuple[FloatArray, FloatArray]:
    """Optimal caps (kW) and each group's multiplier λ per kW.

    `warm`: last tick's multipliers (which groups bound, and where each root lies)."""
    if problem.n == 0:
        return np.zeros(0), np.zeros(problem.tree.n_groups)
    return _tree_solve(problem, _usable_warm(problem, warm))
