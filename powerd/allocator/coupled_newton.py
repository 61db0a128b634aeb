"""The exact solver when GPUs are grouped into jobs: semismooth Newton on the multipliers.

A job's m GPUs share one cap q. Its utility is m times one member's, its damping
Σ ε(q − prev_i)² is m·ε(q − mean prev)² plus a constant, and a price μ_g on group g charges
it n_jg·q, n_jg being its members under g. So at prices μ a job answers like one GPU whose
price is the mean of its members' path prices, with the closed-form response of the tree
solver (tree_solver.py): q(λ) = lo + Σ_k clip(a_k − λ/2ε, 0, len_k). A job that spans groups
couples them, so the tree solver's level-by-level root finding no longer applies.

The dual D(μ) = max_p L(p, μ) is convex and piecewise quadratic, with gradient C − S(μ)
(capacity minus the group sums of the response) and generalised Hessian
H = Σ_units d_u c_u c_uᵀ, where c_u counts a unit's GPUs per group and d_u = 1/(2ε·m_u)
while the unit is inside a segment. Each iteration is a projected Newton step (Bertsekas):
Newton on the groups not held at μ = 0 (groups no unit answers to move by their scaled
gradient beside it), then an exact search along the projected arc: along a ray D's slope is
monotone and piecewise linear in the step (kernel.ray_minimum), and the arc bends where a
multiplier reaches 0. Where the residual stops halving, a search along the chord of the
last two steps breaks the zigzag between two faces of D. It starts from last tick's
multipliers and, where those do not converge within WARM_ITERATIONS (or there are none),
from the tree solver's prices for the same problem with each job relaxed to its parts on
each node (tree_solver._tree_solve, rough).
The passes go over units (free GPUs, then jobs by their (group, GPUs under it) pairs), not
GPUs. Groups made of one job's GPUs alone become a bound on that job's
cap in build_problem, which removes the dual's worst degeneracy (a job alone on several
nodes leaves a price direction free). The caller repairs and verifies the caps as for
every solver (solve.allocate_arrays).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from powerd.allocator.problem import TOL_KW, BoolArray, FloatArray, JobMap, Problem

MAX_ITERATIONS = 200
# Iterations (and passes) from last tick's multipliers before the relaxed problem's are
# looked at: a poor warm start must leave the relaxed one most of MAX_PASSES.
WARM_ITERATIONS = 12
WARM_PASSES = 48
MAX_SEARCH = 16
# Bends of the projected arc (a multiplier reaching 0) one exact search follows; where it
# bends on, one jump to the projected minimum of the ray from the last bend.
MAX_BENDS = 8
# Each step minimises D(μ) + ½ Σ_g w_g (μ_g − μ_now,g)² along its direction, w_g this share of
# group g's curvature were every GPU under it to answer: the steps stay where Newton's model
# holds. Without it the steps overshoot where most GPUs sit at a kink, cold solves take
# several times the passes, and tight budgets can make the iterates cycle.
PROXIMAL = 1e-6
# Iterations without the residual halving before chord steps join in.
CHORD_AFTER = 2
# Passes over the GPUs one solve may take: a tick's solve stays bounded (its cost at 100k
# GPUs: docs/performance.md, "With jobs"), and where it has not converged by then the caller
# gets the caps repaired to every budget and the certificate (gap) says how far they may be
# from the best.
MAX_PASSES = 400
# A group is solved when its sum is this close to its capacity (relative). Tighter (1e-12)
# is below the noise of sums over 1e5 caps: the method then idles at the optimum.
REL_TOL = 1e-10
# Working sets up to this size are factorised dense; above, conjugate gradients (at most
# CG_ITERATIONS, to CG_RTOL of the right-hand side) on H applied without building it.
DENSE_MAX = 400
CG_ITERATIONS = 100
CG_RTOL = 1e-6
# Diagonal shift of the Newton system: relative to each group's curvature were every GPU
# under it to answer (a job alone under several groups leaves directions almost free), and
# to the largest entry. Kept small: a larger shift turns Newton's quadratic convergence in
# the last iterations into a linear one.
REGULARISE_REL = 1e-6
REGULARISE = 1e-12
# Sufficient decrease for the search along the projected arc.
ARMIJO = 1e-4
# D values this close (relative) are equal to rounding: the search then judges steps by the
# budgets' residual instead.
FLAT = 1e-12


@dataclass
class _Eval:
    """The response at one price vector: caps per unit, group sums, units inside a
    segment, the dual function's value, and each unit's price."""

    x: FloatArray
    sums: FloatArray
    partial: BoolArray
    value: float
    price: FloatArray  # per unit: its GPUs' mean path price


class _Dual:
    def __init__(self, problem: Problem, jobs: JobMap, capacity: FloatArray | None = None) -> None:
        from powerd.allocator import kernel  # numba: loaded by the first solve

        tree = problem.tree
        self.tree = tree
        self.jobs = jobs
        if capacity is None:
            capacity = problem.solver_capacity  # (budgets that cannot bind alone left out)
        self.finite = np.isfinite(capacity)
        self.cap_f = np.where(self.finite, capacity, 0.0)
        self.tol = np.maximum(TOL_KW, REL_TOL * np.abs(self.cap_f))
        self.inv = 1.0 / (2.0 * problem.eps)
        member = jobs.member
        unit, size, rep = jobs.units  # kept with the jobs from tick to tick
        self.unit = unit
        self.rep = rep
        self.n_units = size.size
        self.size = size
        prev = problem.unit_prev(unit, size)
        # Unit-major segments for the compiled passes (one row per unit, from its first
        # GPU: members share bounds, class and segments): a = prev − start + (slope + δ)/2ε.
        classes = problem.classes
        self.a_rows, self.len_rows, self.slope_rows = kernel.unit_rows(
            rep, problem.lo, problem.hi, problem.flat, prev, problem.fleet.class_index,
            problem.weight, classes.knots_kw, classes.slopes_kw, problem.delta, self.inv,
        )  # fmt: skip
        self.lo = problem.lo[rep]
        self.prev = prev
        self.delta = problem.delta
        self.eps = problem.eps
        # Each node's path once, and each GPU's row there (topology only: kept on the tree);
        # each free GPU's row, and each job's groups with its GPUs under each: the passes
        # go over units, not GPUs.
        node_rows, node_row = tree.node_paths
        free_node = np.ascontiguousarray(node_row[~member])
        self.incidence = (node_rows, free_node, *jobs.incidence(tree))
        self.count = tree.counts.astype(np.float64)
        # The proximal weight of each group (PROXIMAL of its curvature were every GPU
        # under it to answer): see _iterate.
        self.damp = PROXIMAL * self.count * self.inv
        self.passes = 0
        # The last pass's multipliers and D there (gap() asks for D at the solve's answer).
        self.last: tuple[FloatArray, float] | None = None

    def at(self, mu: FloatArray) -> _Eval:
        """One pass (compiled: kernel.unit_dual): D(μ) = max_p L(p, μ), every unit's gain at
        its response less what it pays, with the response and its group sums."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        self.passes += 1
        x, sums, partial, value, price = kernel.unit_dual(
            np.ascontiguousarray(mu, dtype=np.float64),
            *self.incidence,
            self.size,
            self.a_rows,
            self.len_rows,
            self.slope_rows,
            self.lo,
            self.prev,
            self.cap_f,
            self.delta,
            self.eps,
            self.inv,
        )
        self.last = (mu.copy(), float(value))
        return _Eval(
            np.asarray(x), np.asarray(sums), np.asarray(partial), float(value), np.asarray(price)
        )

    def caps(self, ev: _Eval) -> FloatArray:
        """Each GPU's cap at ev: its unit's."""
        return ev.x[self.unit]

    def means(self, vec: FloatArray) -> FloatArray:
        """Per unit, the mean of its GPUs' path sums of vec (per group)."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        vec = np.ascontiguousarray(vec, dtype=np.float64)
        return np.asarray(kernel.incidence_means(vec, *self.incidence, self.size))

    def response(self, price: FloatArray) -> tuple[FloatArray, FloatArray, BoolArray]:
        """The units' caps at their prices `price` (per kW), the group sums, and which
        units are inside a segment."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        self.passes += 1  # as costly as one: it counts against MAX_PASSES
        x, sums, partial = kernel.incidence_response_sums(
            price, *self.incidence, self.a_rows, self.len_rows, self.lo, self.inv,
            self.tree.n_groups,
        )  # fmt: skip
        return np.asarray(x), np.asarray(sums), np.asarray(partial)

    def primal_value(self, p: FloatArray) -> float:
        """The units' gain at caps p (one per unit: a job's members share theirs)."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        return float(
            kernel.unit_value(
                np.ascontiguousarray(p[self.rep]), self.lo, self.len_rows, self.slope_rows,
                self.prev, self.size, self.delta, self.eps,
            )
        )  # fmt: skip

    def gradient(self, ev: _Eval) -> FloatArray:
        """∇D = C − S on groups with a budget (0 elsewhere)."""
        return np.where(self.finite, self.cap_f - ev.sums, 0.0)

    def gradient_step(self, mu: FloatArray, grad: FloatArray) -> FloatArray:
        """The projected gradient, scaled by the Hessian's diagonal were every GPU below a
        group to answer (a direction of descent wherever D is not at its minimum)."""
        scale = self.count * self.inv
        d = np.where(self.finite, -grad / np.maximum(scale, 1e-300), 0.0)
        return np.where((mu <= 0.0) & (d < 0.0), 0.0, d)

    def step(self, ev: _Eval, mu: FloatArray, grad: FloatArray) -> FloatArray:
        """The projected Newton direction (Bertsekas 1982) for D plus the proximal term
        (`damp`): Newton on the groups that are not held at μ = 0, a scaled gradient step
        on those about to be."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        scale = self.count * self.inv  # the Hessian's diagonal if every GPU below answered
        scaled = np.where(self.finite, grad / np.maximum(scale, 1e-300), 0.0)
        width = float(np.max(np.abs(mu - np.maximum(mu - scaled, 0.0)), initial=0.0))
        held = self.finite & (mu <= min(1e-9, width)) & (grad >= 0.0)
        work = np.flatnonzero(self.finite & ~held & ((mu > 0.0) | (grad < 0.0)))
        direction = np.where(held, -scaled, 0.0)
        if work.size == 0:
            return direction
        if work.size > DENSE_MAX:
            # Many groups bind (tight node or rack budgets): conjugate gradients on H
            # applied without building it, an inexact Newton direction.
            mask = np.zeros(self.tree.n_groups, dtype=np.bool_)
            mask[work] = True
            shift = np.zeros(self.tree.n_groups)
            shift[work] = REGULARISE_REL * scale[work] + self.damp[work]
            rhs = np.zeros(self.tree.n_groups)
            rhs[work] = -grad[work]
            d = kernel.newton_cg(
                rhs, mask, shift, ev.partial, *self.incidence, self.size, self.inv,
                CG_ITERATIONS, CG_RTOL,
            )  # fmt: skip
            direction[work] = np.where(np.isfinite(d[work]), d[work], 0.0)
            return direction
        col = np.full(self.tree.n_groups, -1, dtype=np.int64)
        col[work] = np.arange(work.size)
        dense = kernel.incidence_hessian(
            ev.partial, *self.incidence, self.size, col, int(work.size), self.inv
        )
        diag = np.diag(dense) + self.damp[work]
        flat = diag <= 0.0
        if flat.any():
            # No unit under these groups answers to their price here (all at a knot or a
            # bound): D is linear along them and their rows of H are zero. They move by the
            # scaled gradient, the others by Newton on their block; the exact search finds
            # where along both D stops falling.
            direction[work[flat]] = -scaled[work[flat]]
            keep = ~flat
            work, diag = work[keep], diag[keep]
            dense = dense[np.ix_(keep, keep)]
            if work.size == 0:
                return direction
        reg = REGULARISE_REL * scale[work] + REGULARISE * float(diag.max(initial=0.0))
        reg += self.damp[work]
        rhs = -grad[work]
        dense.flat[:: work.size + 1] += reg
        try:
            d = np.asarray(np.linalg.solve(dense, rhs), dtype=np.float64)
        except (np.linalg.LinAlgError, ValueError):
            d = np.asarray(np.linalg.lstsq(dense, rhs, rcond=None)[0], dtype=np.float64)
        direction[work] = np.where(np.isfinite(d), d, 0.0)
        return direction

    def converged(self, ev: _Eval, mu: FloatArray) -> bool:
        excess = np.where(self.finite, ev.sums - self.cap_f, 0.0)
        if np.any(excess > self.tol):
            return False
        slack = mu > 0.0
        return not np.any(np.abs(excess[slack]) > self.tol[slack])

    def residual(self, ev: _Eval, mu: FloatArray) -> float:
        """How far from optimal (kW): the largest excess over a budget, or shortfall under
        a priced one."""
        excess = np.where(self.finite, ev.sums - self.cap_f, 0.0)
        short = np.where(mu > 0.0, np.abs(excess), np.maximum(excess, 0.0))
        return float(np.max(short, initial=0.0))


def _exact_search(
    dual: _Dual, mu: FloatArray, d: FloatArray, ev0: _Eval, damp: FloatArray | None = None
) -> tuple[FloatArray, _Eval]:
    """The first minimum of D along the projected arc max(μ + αd, 0), found exactly.

    Along a ray D's slope is continuous, non-decreasing and piecewise linear in α (each
    unit's price moves linearly): kernel.ray_minimum finds its root over the units, without
    a pass over the GPUs. Where a multiplier reaches 0 first the arc bends there: that group
    leaves the direction and the search goes on (MAX_BENDS times, then one jump to the
    projected minimum of the ray from the last bend). `damp`: the proximal weights, the
    term around mu searched with D. One pass at the end."""
    from powerd.allocator import kernel  # numba: loaded by the first solve

    d = np.where((mu <= 0.0) & (d < 0.0), 0.0, d)
    grad = dual.gradient(ev0)
    base = mu.copy()
    price, x, partial = ev0.price, ev0.x, ev0.partial

    def ray_minimum(rate: FloatArray, alpha_max: float) -> float:
        """The minimum along base + αd (α ≤ alpha_max), the units at `price` (caps x)."""
        return float(
            kernel.ray_minimum(
                price, rate, dual.size, dual.a_rows, dual.len_rows, dual.lo, dual.inv,
                float(np.einsum("g,g->", d, grad)), alpha_max, x, partial,
                0.0 if damp is None else float(np.einsum("g,g,g->", damp, d, d)),
            )
        )  # fmt: skip

    moved = False
    bent = 0
    for _ in range(MAX_BENDS):
        rate = dual.means(d)
        falling = d < 0.0
        alpha_max = float(np.min(base[falling] / -d[falling])) if falling.any() else np.inf
        alpha = ray_minimum(rate, alpha_max)
        if alpha <= 0.0:
            break
        moved = True
        nxt = base + alpha * d
        if alpha < alpha_max:
            base = np.maximum(nxt, 0.0)
            break
        # The groups that reach 0 here stay there: the arc bends.
        bent += 1
        reached = falling & (nxt <= 1e-15 * np.maximum(base, 1.0))
        base = np.maximum(nxt, 0.0)
        base[reached] = 0.0
        d = np.where(reached, 0.0, d)
        price = price + alpha * rate
        x, sums, partial = dual.response(price)
        grad = np.where(dual.finite, dual.cap_f - sums, 0.0)
        if damp is not None:
            grad = grad + damp * (base - mu)
        if not np.any(d):
            bent = 0
            break
    if not moved:
        return mu, ev0
    ev = dual.at(base)
    if bent == MAX_BENDS:
        # The arc goes on bending (many multipliers reach 0 along Newton's direction, as
        # under tight budgets): one jump to where the ray from here, projected, has its
        # minimum, kept if it lowers the searched function.
        alpha = ray_minimum(dual.means(d), np.inf)
        if alpha > 0.0:
            jump = np.maximum(base + alpha * d, 0.0)
            ev_jump = dual.at(jump)
            if _prox_value(ev_jump, jump, mu, damp) < _prox_value(ev, base, mu, damp):
                return jump, ev_jump
    return base, ev


def _prox_value(ev: _Eval, at: FloatArray, center: FloatArray, damp: FloatArray | None) -> float:
    """D at `at` plus the proximal term around `center`: what _exact_search minimises."""
    if damp is None:
        return ev.value
    step = at - center
    return ev.value + 0.5 * float(np.einsum("g,g,g->", damp, step, step))


def _dual_of(problem: Problem, jobs: JobMap) -> _Dual:
    """The dual for the problem's jobs, built once per problem (the solve and the gap's
    certificate share it)."""
    memo = problem.memo
    dual = memo.get("jobs_dual")
    if not isinstance(dual, _Dual) or dual.jobs is not jobs:
        dual = _Dual(problem, jobs)
        memo["jobs_dual"] = dual
    dual.passes = 0
    return dual


def _search(dual: _Dual, mu: FloatArray, d: FloatArray, ev0: _Eval) -> tuple[FloatArray, _Eval]:
    """Armijo search along the projected arc max(μ + αd, 0): from α = 1 it stretches while D
    keeps falling (flat stretches of D) and halves while it does not fall enough."""
    grad0 = dual.gradient(ev0)

    def point(alpha: float) -> FloatArray:
        return np.maximum(mu + alpha * d, 0.0)

    def enough(alpha: float, ev: _Eval) -> bool:
        slope = float(np.einsum("g,g->", grad0, point(alpha) - mu))
        return ev.value <= ev0.value + ARMIJO * slope

    alpha = 1.0
    ev = dual.at(point(alpha))
    if enough(alpha, ev):
        for _ in range(MAX_SEARCH):
            nxt = dual.at(point(2.0 * alpha))
            if not (nxt.value < ev.value and enough(2.0 * alpha, nxt)):
                break
            alpha, ev = 2.0 * alpha, nxt
        return point(alpha), ev
    # Near the optimum D changes by less than its rounding (~1e-14 of its value) along d:
    # then a step that brings the budgets' sums closer to their capacities is taken anyway.
    best, best_res = None, dual.residual(ev0, mu)
    if dual.residual(ev, point(alpha)) < best_res:
        best, best_res = (point(alpha), ev), dual.residual(ev, point(alpha))
    for _ in range(MAX_SEARCH):
        alpha *= 0.5
        ev = dual.at(point(alpha))
        if enough(alpha, ev):
            return point(alpha), ev
        res = dual.residual(ev, point(alpha))
        if res < best_res:
            best, best_res = (point(alpha), ev), res
    if best is not None and abs(ev0.value - best[1].value) <= FLAT * max(abs(ev0.value), 1.0):
        return best
    return mu, ev0


def _better(dual: _Dual, ev0: _Eval, mu0: FloatArray, ev: _Eval, mu: FloatArray) -> bool:
    """Whether the step to mu decreased D (or, within rounding of D, the residual)."""
    if ev is ev0:
        return False
    if ev.value < ev0.value - FLAT * max(abs(ev0.value), 1.0):
        return True
    if ev.value > ev0.value + FLAT * max(abs(ev0.value), 1.0):
        return False
    return dual.residual(ev, mu) < dual.residual(ev0, mu0)


def gap(problem: Problem, p: FloatArray, prices: FloatArray) -> float:
    """How far caps p can be from the optimum: (dual bound − value of p) / |value|, ≥ 0.

    The dual function at any μ ≥ 0 bounds the optimum from above (weak duality), so this
    is a certificate: 0 up to rounding when the solver converged."""
    if problem.jobs is None or problem.n == 0:
        return 0.0
    left_out = np.isfinite(problem.capacity) & ~np.isfinite(problem.solver_capacity)
    if np.any(prices[left_out] > 0.0):
        # Prices from the reference (fast's fallback) price every budget, those the exact
        # solvers leave out too: D over the budgets as given, or the bound is loose (6 % on
        # a site whose caps were cvxpy's).
        dual = _Dual(problem, problem.jobs, problem.capacity)
    else:
        dual = _dual_of(problem, problem.jobs)
    mu = np.where(dual.finite, np.maximum(prices, 0.0), 0.0)
    last = dual.last
    bound = last[1] if last is not None and np.array_equal(last[0], mu) else dual.at(mu).value
    value = dual.primal_value(p)
    return max(0.0, (bound - value) / max(abs(value), 1.0))


def solve(
    problem: Problem, warm: FloatArray | None = None, start: FloatArray | None = None
) -> tuple[FloatArray, FloatArray]:
    """Optimal caps (kW), one per job, and each group's multiplier λ per kW.

    `warm`: last tick's multipliers; `start`: the relaxed problem's (used when no warm)."""
    p, mu, _ = solve_checked(problem, warm, start)
    return p, mu


def solve_checked(
    problem: Problem,
    warm: FloatArray | None = None,
    start: FloatArray | Callable[[], FloatArray] | None = None,
) -> tuple[FloatArray, FloatArray, bool]:
    """solve(), and whether it converged (every budget met to REL_TOL, complementary).

    `start` may be a function: it is called only where last tick's multipliers (`warm`) do
    not lead to the optimum within WARM_ITERATIONS (in steady state they do, in fewer
    passes than the relaxed problem's prices, and the tree solve for those is saved)."""
    n_groups = problem.tree.n_groups
    jobs = problem.jobs
    if problem.n == 0 or jobs is None:
        return np.zeros(problem.n), np.zeros(n_groups), True
    dual = _dual_of(problem, jobs)

    def usable(guess: FloatArray | None) -> FloatArray | None:
        if guess is None or guess.size != n_groups or not np.all(np.isfinite(guess)):
            return None
        return np.where(dual.finite, np.maximum(guess, 0.0), 0.0)

    mu, ev = np.zeros(n_groups), None
    cand = usable(warm)
    if cand is not None:
        mu, ev = cand, dual.at(cand)
        if callable(start):
            mu, ev = _iterate(dual, mu, ev, WARM_ITERATIONS, WARM_PASSES)
            if dual.converged(ev, mu):
                return dual.caps(ev), mu, True
    cand = usable(start() if callable(start) else start)
    if cand is not None:
        # Of last tick's multipliers (or where they led) and the relaxed problem's, the
        # lower D is nearer.
        cand_ev = dual.at(cand)
        if ev is None or cand_ev.value < ev.value:
            mu, ev = cand, cand_ev
    if ev is None:
        ev = dual.at(mu)
    mu, ev = _iterate(dual, mu, ev, MAX_ITERATIONS, MAX_PASSES)
    return dual.caps(ev), mu, dual.converged(ev, mu)


def _iterate(
    dual: _Dual, mu: FloatArray, ev: _Eval, iterations: int, passes: int
) -> tuple[FloatArray, _Eval]:
    """Projected Newton iterations from mu, until converged, out of iterations or of
    passes (dual.passes reaching `passes`), or out of descent."""
    # Exact searches take the best step along each direction (a pass per step, against
    # Armijo's several). Where the residual stops halving they can zigzag between two
    # faces of D: then a search along the chord of the last two steps follows each one.
    best, since = np.inf, 0
    older: FloatArray | None = None
    for _ in range(iterations):
        if dual.passes >= passes or dual.converged(ev, mu):
            break
        res = dual.residual(ev, mu)
        if res < 0.5 * best:
            best, since = res, 0
        else:
            since += 1
        grad = dual.gradient(ev)
        d = dual.step(ev, mu, grad)
        if not np.any(d):
            break
        nxt_mu, nxt = _exact_search(dual, mu, d, ev, dual.damp)
        if not _better(dual, ev, mu, nxt, nxt_mu):
            nxt_mu, nxt = _search(dual, mu, d, ev)  # rounding: Armijo's residual rule
        if nxt is ev:
            # Newton's direction found no decrease (a stall at a kink): one scaled
            # gradient step, stretched by the search, before giving up.
            nxt_mu, nxt = _search(dual, mu, dual.gradient_step(mu, grad), ev)
        if nxt is ev:
            break  # no decrease left to find: as exact as floating point allows
        if (
            since >= CHORD_AFTER
            and older is not None
            and dual.residual(nxt, nxt_mu) >= 0.5 * best  # (this step did not halve it)
            and float(np.einsum("g,g->", nxt_mu - mu, mu - older)) < 0.0  # (turned back)
        ):
            # Two faces of D zigzag the steps: along the chord of the last two (parallel
            # tangents) the search often goes much further.
            chord_mu, chord = _exact_search(dual, nxt_mu, nxt_mu - older, nxt)
            if _better(dual, nxt, nxt_mu, chord, chord_mu):
                nxt_mu, nxt = chord_mu, chord
        older = mu
        mu, ev = nxt_mu, nxt
    return mu, ev
