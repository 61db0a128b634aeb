"""The exact tree solver, compiled: each budget's price found bottom-up, one group at a time.

A *unit* is what gets one cap: a GPU, or a job whose GPUs all answer to the same chain of
budgets (`laminar` below). Unit i with multiplicity m_i (its GPUs) hangs at one group; at the
scaled price u (kW, u = λ / 2ε) it takes

    p_i(u) = lo_i + Σ_k clip(a_ik − u, 0, len_ik)

(tree_solver.py derives the segments). For a group g, let M_i be the highest price at which a group
strictly between unit i and g binds (0 if none). Below M_i that group holds its GPUs at its
budget, so g sees F_g(u) = Σ_i m_i p_i(max(u, M_i)) over the units under it: continuous,
non-increasing, piecewise linear. g's own price U_g is 0 if F_g(0) fits its capacity, else
the root of F_g(u) = capacity. Groups are solved from the nodes up; a unit's price is the
highest U on its path, and the group multipliers are what each U adds to its ancestors'
highest (so each GPU's path sums to its price).

Each root is exact. Groups of up to KINKS_UP_TO units are solved from their kinks
(`_root_kinks`, quickselect on F's breakpoints); larger ones by false position inside a
shrinking bracket, at the median of a sample of the kinks still inside it where a step did
not halve the residual (`_root`). A group's first look is at `guess` (last tick's U, or
where the caps in force put it). The caller decides which groups are held (tree_solver.py's
active set).

`unit_dual`, `incidence_hessian` and `ray_minimum` are coupled_newton.py's pass over its units, its
Newton system and its line search.

`deadband_hold` is the deadband (controller/deadband.py's hold_small_cuts): its sums
add in numpy's order (no fast-math), so the held caps come out bit for bit as numpy's did.
`absorb_rows` is the safety planner's fold of queued readings and acks into what it knows
of the caps in force (safety.py, `SafetyPlanner._absorb`).

numba compiles these functions on first use and caches the machine code next to this file
(or in the user's cache directory where that is not writable). `warm_up` compiles or loads
them all before a first solve, says when numba starts compiling and reports what it did.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numba
import numba.core.dispatcher
import numba.core.event
import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator.problem import work_arrays

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

F = TypeVar("F", bound=Callable[..., Any])
log = structlog.get_logger(__name__)
# Relative residual at which a group counts as solved: sums of 1e5 caps carry ~1e-12.
REL_TOL = 1e-13
MAX_STEPS = 200
# kernel._root bisects where this many steps in a row moved the same end of its bracket:
# false position creeps from an end whose residual is near tol, and a budget nested just
# below its child's could otherwise use up MAX_STEPS and be left watts short
# (tests/test_allocator_attack.py).
SAME_END = 3
# Median steps while more units than this can change slope (kernel._root).
MEDIAN_ABOVE = 512
SAMPLE = 192
# Groups of up to this many units are solved from their kinks (kernel._root_kinks).
KINKS_UP_TO = 256
# A large group with no guess starts at the root of a sample of this many of its units,
# scaled to the group (kernel._sample_root).
SAMPLE_UNITS = 256


# Fast-math without "no NaN / no inf": capacities may be +inf and are tested for it.
_FASTMATH = {"nsz", "arcp", "contract", "reassoc"}


def _compile(fn: F, fastmath: set[str] | bool = _FASTMATH, **options: Any) -> F:
    try:
        return cast(F, numba.njit(cache=True, nogil=True, fastmath=fastmath, **options)(fn))
    except RuntimeError:
        # No writable cache directory (a read-only install, no home; NUMBA_CACHE_DIR names
        # one): compile in memory at every start instead.
        return cast(F, numba.njit(nogil=True, fastmath=fastmath, **options)(fn))


def _jit(fn: F) -> F:
    return _compile(fn)


def jit_exact(fn: F) -> F:
    """A kernel whose floating-point sums must come out bit for bit as numpy's (no
    fast-math: its `reassoc` would let the compiler add in another order), cached where a
    cache directory is writable, else compiled in memory. The simulator's kernels
    (powerd/sim/kernel.py, powerd/backends/mock_kernel.py) are compiled by it too."""
    return _compile(fn, fastmath=False)


def _inline(fn: F) -> F:
    """A helper compiled into its callers (a call per GPU costs more than its work)."""
    return _compile(fn, inline="always")


def _inline_exact(fn: F) -> F:
    """A helper compiled into `jit_exact` callers, without fast-math like them."""
    return _compile(fn, fastmath=False, inline="always")


@_inline
def _segment_row(
    a: FloatArray,
    ln: FloatArray,
    j: int,
    lo: float,
    hi: float,
    flat: float,
    prev: float,
    knots: FloatArray,
    slopes: FloatArray,
    c: int,
    weight: float,
    delta: float,
    inv: float,
) -> None:
    """Row j of a and len for one unit of class c (problem._segments, in closed form): its
    profile's pieces cut to [lo, flat], then [flat, hi] flat."""
    n_knots = knots.shape[1]
    start = lo
    for k in range(n_knots):
        end = min(max(knots[c, k], lo), flat)
        a[j, k] = prev - start + (weight * slopes[c, k] + delta) * inv
        ln[j, k] = end - start
        start = end
    a[j, n_knots] = prev - start + delta * inv
    ln[j, n_knots] = hi - start


@_inline
def _response(a: FloatArray, ln: FloatArray, lo: float, i: int, x: float) -> float:
    p = lo
    for k in range(a.shape[1]):
        t = a[i, k] - x
        if t > 0.0:
            p += t if t < ln[i, k] else ln[i, k]
    return p


@_inline
def _sample(
    a: FloatArray,
    ln: FloatArray,
    i: int,
    fl: float,
    left: float,
    right: float,
    buf: FloatArray,
    cnt: int,
) -> int:
    """Add unit i's kinks inside (left, right) to buf (while it has room); the new count."""
    size = buf.size
    if left < fl < right and cnt < size:
        buf[cnt] = fl
        cnt += 1
    for k in range(a.shape[1]):
        if ln[i, k] > 0.0:
            top = a[i, k]
            bottom = top - ln[i, k]
            if left < top < right and top > fl and cnt < size:
                buf[cnt] = top
                cnt += 1
            if left < bottom < right and bottom > fl and cnt < size:
                buf[cnt] = bottom
                cnt += 1
    return cnt


@_jit
def _median_inside(buf: FloatArray, cnt: int, left: float, right: float) -> float:
    """The median of the sampled kinks still inside (left, right); −1 if none is."""
    keep = 0
    for j in range(cnt):
        if left < buf[j] < right:
            buf[keep] = buf[j]
            keep += 1
    if keep == 0:
        return -1.0
    return _select(buf, keep, keep // 2)


@_jit
def _select(buf: FloatArray, keep: int, want: int) -> float:
    """The want-th smallest of buf[:keep], by quickselect in place (no allocation: this
    runs once per step)."""
    lo_i, hi_i = 0, keep - 1
    while lo_i < hi_i:
        pivot = buf[(lo_i + hi_i) // 2]
        i, j = lo_i, hi_i
        while i <= j:
            while buf[i] < pivot:
                i += 1
            while buf[j] > pivot:
                j -= 1
            if i <= j:
                buf[i], buf[j] = buf[j], buf[i]
                i += 1
                j -= 1
        if want <= j:
            hi_i = j
        elif want >= i:
            lo_i = i
        else:
            break
    return float(buf[want])


@_inline
def _total(
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    mult: FloatArray,
    floor: FloatArray,
    s: int,
    e: int,
    x: float,
) -> float:
    """F(x) = Σ m·p(max(x, floor)) over units s..e-1: no branch, nothing but the sum (the
    slope would double the cost of a pass)."""
    f = 0.0
    for i in range(s, e):
        xi = max(x, floor[i])
        p = lo[i]
        for k in range(a.shape[1]):
            p += min(max(a[i, k] - xi, 0.0), ln[i, k])
        f += mult[i] * p
    return f


@_jit
def _root(
    s: int,
    e: int,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    mult: FloatArray,
    floor: FloatArray,
    cap: float,
    tol: float,
    buf: FloatArray,
    guess: float,
) -> float:
    """U for one group: units s..e-1 (sorted order), each priced at least floor[i];
    `guess` (> 0) is where to look first (last tick's price, or the last round's); a large
    group with none looks first where F of a sample of its units meets the capacity
    (_sample_root).

    A Newton step from the first look, then Illinois false position inside a shrinking
    bracket: exact once both ends lie on the piece of F that holds the root; a bisection
    where four steps did not halve the bracket. In large groups, after a step that did not
    halve the residual, the next evaluates at the median of a sample of the kinks still
    inside the bracket, so the bracket loses about half of them whatever the shape of F
    (every other step, as before, wasted passes where thousands of kinks coincide)."""
    n_k = a.shape[1]
    big = e - s > MEDIAN_ABOVE
    x1 = guess
    cnt = 0
    if x1 <= 0.0 and big:
        x1 = _sample_root(s, e, a, ln, lo, mult, floor, cap)
    if x1 <= 0.0 and big:
        cnt = _sample_range(a, ln, floor, s, e, 0.0, np.inf, buf)
        x1 = _median_inside(buf, cnt, 0.0, np.inf)
    # First pass: F at 0, at x1, and with every unit at lo (the bracket's right end).
    f0 = 0.0
    f1 = 0.0
    d1 = 0.0
    f_hi = 0.0
    top = 0.0
    for i in range(s, e):
        fl = floor[i]
        xi = max(x1, fl)
        p0 = lo[i]
        p1 = lo[i]
        part = False
        for k in range(n_k):
            ak = a[i, k]
            lk = ln[i, k]
            p0 += min(max(ak - fl, 0.0), lk)
            t = ak - xi
            p1 += min(max(t, 0.0), lk)
            part |= (t > 0.0) & (t < lk)
        m = mult[i]
        f0 += m * p0
        f1 += m * p1
        d1 += m * (part & (x1 > fl))
        f_hi += m * lo[i]
        top = max(top, a[i, 0])
    if f0 <= cap + tol:
        return 0.0
    left, g_left = 0.0, f0 - cap
    right, g_right = top + 1.0, f_hi - cap
    if g_right > tol:
        return right  # lower bounds over capacity: build_problem never lets this happen
    first = 0
    newton = -1.0
    best = np.inf  # the smallest |F − cap| seen
    if left < x1 < right:
        g1 = f1 - cap
        if abs(g1) <= tol:
            return x1
        best = abs(g1)
        if g1 > 0.0:
            left, g_left = x1, g1
        else:
            right, g_right = x1, g1
        if d1 > 0.0:
            newton = x1 + g1 / d1  # exact if x1 lies on the root's piece of F
        first = 1
    kept = 0  # side replaced by the last step: +1 left, −1 right (Illinois)
    same = 0  # steps in a row that replaced that side
    width = right - left
    stalled = newton < 0.0  # no Newton step to take first: start from the median
    for step in range(first, MAX_STEPS):
        x = newton
        newton = -1.0
        if big and stalled:
            cnt = _sample_range(a, ln, floor, s, e, left, right, buf)
            x = _median_inside(buf, cnt, left, right)
        if not left < x < right:
            x = left + g_left / (g_left - g_right) * (right - left)
            if not left < x < right:
                x = 0.5 * (left + right)
        if step % 4 == 3:
            # False position creeps where F is a staircase seen from just past a budget
            # (a residual of ~tol at one end): halve the bracket when four steps did not,
            # or where the last SAME_END steps all moved one end.
            if right - left > 0.5 * width:
                x = 0.5 * (left + right)
            width = right - left
        if same >= SAME_END:
            x = 0.5 * (left + right)
        gx = _total(a, ln, lo, mult, floor, s, e, x) - cap
        if abs(gx) <= tol:
            return x
        stalled = abs(gx) > 0.5 * best
        best = min(best, abs(gx))
        if gx > 0.0:
            left, g_left = x, gx
            if kept == 1:
                g_right *= 0.5
            same = same + 1 if kept == 1 else 1
            kept = 1
        else:
            right, g_right = x, gx
            if kept == -1:
                g_left *= 0.5
            same = same + 1 if kept == -1 else 1
            kept = -1
        if right - left <= 4.0 * np.spacing(max(right, 1.0)):
            return right
    return right


@_jit
def _sample_root(
    s: int,
    e: int,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    mult: FloatArray,
    floor: FloatArray,
    cap: float,
) -> float:
    """Where F of a sample of SAMPLE_UNITS units spread over s..e-1, scaled to the whole
    group, meets cap (exactly, from its kinks): a first point for a large group's root.
    Prices gather where many units share a kink (a class's slope), so a guess from
    statistics of the units' prices falls between those clusters or on the wrong one (the
    facility of 100k GPUs without jobs: guessed 41.55 or 1.55 from the caps in force,
    root 19.05); the sample's F has the group's clusters, in proportion."""
    n_k = a.shape[1]
    stride = max(1, (e - s) // SAMPLE_UNITS)
    n = (e - s + stride - 1) // stride
    sa = np.empty((n, n_k))
    sl = np.empty((n, n_k))
    slo = np.empty(n)
    sm = np.empty(n)
    sfl = np.empty(n)
    total = 0.0
    for i in range(s, e):
        total += mult[i]
    picked = 0.0
    for j in range(n):
        i = s + j * stride
        for k in range(n_k):
            sa[j, k] = a[i, k]
            sl[j, k] = ln[i, k]
        slo[j] = lo[i]
        sm[j] = mult[i]
        sfl[j] = floor[i]
        picked += mult[i]
    if not picked > 0.0:
        return -1.0
    if stride > 1:  # (the whole group: its own F, not a rescaled one)
        scale = total / picked
        for j in range(n):
            sm[j] *= scale
    room = n * (2 * n_k + 1)
    kv = np.empty(room)
    kd = np.empty(room)
    return _root_kinks(0, n, sa, sl, slo, sm, sfl, cap, 1e-9 * abs(cap), kv, kd)


@_jit
def _sample_range(
    a: FloatArray,
    ln: FloatArray,
    floor: FloatArray,
    s: int,
    e: int,
    left: float,
    right: float,
    buf: FloatArray,
) -> int:
    """Kinks inside (left, right) of about buf.size / 3 units spread over s..e-1."""
    cnt = 0
    stride = max(1, (e - s) // (buf.size // 3))
    for i in range(s, e, stride):
        cnt = _sample(a, ln, i, floor[i], left, right, buf, cnt)
    return cnt


@_jit
def _root_kinks(
    s: int,
    e: int,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    mult: FloatArray,
    floor: FloatArray,
    cap: float,
    tol: float,
    kv: FloatArray,
    kd: FloatArray,
) -> float:
    """U for one group of few units, exactly, from the kinks of F.

    Going down from a price where every unit sits at lo, F's slope grows by m at each
    segment's top and falls by m at its bottom and at a unit's floor. The kinks above 0
    (and above each unit's floor) are selected around pivots, quickselect-style: F at a
    pivot needs only the kinks above it, and each step keeps the side with the root. Once
    no kink is left in the bracket, F is affine there and the root is exact."""
    cnt = 0
    f_inf = 0.0
    for i in range(s, e):
        m = mult[i]
        fl = max(floor[i], 0.0)
        f_inf += m * lo[i]
        for k in range(a.shape[1]):
            lk = ln[i, k]
            if lk > 0.0:
                top = a[i, k]
                bottom = top - lk
                if top > fl:
                    kv[cnt] = top
                    kd[cnt] = m
                    cnt += 1
                    if bottom > fl:
                        kv[cnt] = bottom
                        kd[cnt] = -m
                        cnt += 1
                    elif fl > 0.0:
                        kv[cnt] = fl  # frozen below its floor
                        kd[cnt] = -m
                        cnt += 1
    # F(x) = const − slope·x + Σ_{kinks κ in lo_k..hi_k, κ > x} δ·(κ − x) on the bracket.
    const, slope = f_inf, 0.0
    f0 = f_inf
    for j in range(cnt):
        f0 += kd[j] * kv[j]
    if f0 <= cap + tol:
        return 0.0
    left = 0.0
    lo_k, hi_k = 0, cnt
    while hi_k > lo_k:
        v = kv[(lo_k + hi_k) // 2]
        # Three-way partition of lo_k..hi_k around v: below | equal | above.
        lt, i, gt = lo_k, lo_k, hi_k
        while i < gt:
            if kv[i] < v:
                kv[lt], kv[i] = kv[i], kv[lt]
                kd[lt], kd[i] = kd[i], kd[lt]
                lt += 1
                i += 1
            elif kv[i] > v:
                gt -= 1
                kv[gt], kv[i] = kv[i], kv[gt]
                kd[gt], kd[i] = kd[i], kd[gt]
            else:
                i += 1
        up_c, up_s = 0.0, 0.0  # Σ δκ and Σ δ over the kinks at v and above
        for j in range(lt, hi_k):
            up_c += kd[j] * kv[j]
            up_s += kd[j]
        fv = const + up_c - (slope + up_s) * v
        if abs(fv - cap) <= tol:
            return float(v)
        if fv > cap:
            left = v
            lo_k = gt  # the root is above v: keep the kinks above it
        else:
            const += up_c
            slope += up_s
            hi_k = lt  # below v: the kinks at and above v are now part of the affine term
    if slope <= 0.0:
        return left
    return max((const - cap) / slope, left)


_Views = tuple[
    IntArray, IntArray, IntArray, FloatArray, FloatArray, FloatArray, FloatArray, FloatArray
]


@_inline
def _views(
    n: int, n_groups: int, n_k: int, work_i: IntArray, work_f: FloatArray, work_k: FloatArray
) -> _Views:
    """The prepared units' arrays, as views into the workspace (problem.work_arrays; rows 2
    and 3 of work_f are solve_groups' floors and caps)."""
    base = n_groups + 1 + n
    return (
        work_i[n_groups + 1 : base],  # order: unit of each sorted position
        work_i[base : base + n_groups],  # start of each group's run
        work_i[base + n_groups : base + 2 * n_groups],  # end of each group's run
        work_k[0, :n, :n_k],  # a
        work_k[1, :n, :n_k],  # len
        work_f[0, :n],  # lo
        work_f[1, :n],  # multiplicity
        work_f[4, :n],  # prev
    )


@_jit
def prepare(
    attach: IntArray,
    rank: IntArray,
    parent: IntArray,
    lo: FloatArray,
    hi: FloatArray,
    flat: FloatArray,
    prev: FloatArray,
    cls: IntArray,
    weight: FloatArray,
    mult: FloatArray,
    knots: FloatArray,
    slopes: FloatArray,
    delta: float,
    inv: float,
    work_i: IntArray,
    work_f: FloatArray,
    work_k: FloatArray,
) -> None:
    """Units in depth-first order of their group, with their segments, into the workspace.

    Per unit: `attach` its group, bounds, `flat` (where gains stop), `prev` (its mean last
    cap), class, weight and multiplicity; per class `knots` and `slopes` (ClassTable, per
    kW). Per group: `rank` its position in a depth-first order (a group before its subtree,
    every subtree contiguous) and `parent`."""
    n = attach.size
    n_groups = parent.size
    n_k = knots.shape[1] + 1
    order, start, end, sa, sl, slo, sm, sprev = _views(n, n_groups, n_k, work_i, work_f, work_k)
    # Counting sort by the rank of each unit's group, so every subtree is a run.
    count = work_i[: n_groups + 1]
    count[:] = 0
    for i in range(n):
        count[rank[attach[i]] + 1] += 1
    for g in range(n_groups):
        count[g + 1] += count[g]
    for i in range(n):
        r = rank[attach[i]]
        order[count[r]] = i
        count[r] += 1
    start[:] = n
    end[:] = 0
    for j in range(n):
        g = attach[order[j]]
        while g >= 0:
            start[g] = min(start[g], j)
            end[g] = max(end[g], j + 1)
            g = parent[g]
    for j in range(n):
        i = order[j]
        _segment_row(
            sa,
            sl,
            j,
            lo[i],
            hi[i],
            flat[i],
            prev[i],
            knots,
            slopes,
            cls[i],
            weight[i],
            delta,
            inv,
        )
        slo[j] = lo[i]
        sm[j] = mult[i]
        sprev[j] = prev[i]


@_jit
def solve_groups(
    n: int,
    n_groups: int,
    n_k: int,
    by_level: IntArray,
    capacity: FloatArray,
    guess: FloatArray,
    work_i: IntArray,
    work_f: FloatArray,
    work_k: FloatArray,
    rel_tol: float,
) -> tuple[FloatArray, FloatArray]:
    """Each unit's cap (kW, in the units' order) and each group's U, on the prepared units.

    `capacity`: +inf where there is nothing to hold; `guess`: where to look first (0: no
    guess); `by_level`: the groups, deepest level first; `rel_tol`: how close to its
    capacity a group's sum must come (relative). The caps are a view into work_f."""
    order, start, end, sa, sl, slo, sm, _ = _views(n, n_groups, n_k, work_i, work_f, work_k)
    floor = work_f[2, :n]
    floor[:] = 0.0
    buf = np.empty(SAMPLE)
    kv = np.empty(KINKS_UP_TO * (2 * n_k + 1))
    kd = np.empty(KINKS_UP_TO * (2 * n_k + 1))
    u = np.zeros(n_groups)
    for g in by_level:
        s, e = start[g], end[g]
        cap = capacity[g]
        if s >= e or not np.isfinite(cap):
            continue
        tol = max(1e-9, rel_tol * abs(cap))
        if e - s <= KINKS_UP_TO and guess[g] <= 0.0:
            ug = _root_kinks(s, e, sa, sl, slo, sm, floor, cap, tol, kv, kd)
        else:
            ug = _root(s, e, sa, sl, slo, sm, floor, cap, tol, buf, guess[g])
        u[g] = ug
        if ug > 0.0:
            for j in range(s, e):
                floor[j] = max(floor[j], ug)
    caps = work_f[3, :n]
    for j in range(n):
        caps[order[j]] = _response(sa, sl, slo[j], j, floor[j])
    return caps, u


@_inline
def _unit_response(
    a: FloatArray, ln: FloatArray, lo: float, u: int, v: float
) -> tuple[float, float]:
    """A unit's cap at scaled price v, and how many of its segments are partly filled."""
    p = lo
    inside = 0.0
    for k in range(a.shape[1]):
        t = min(max(a[u, k] - v, 0.0), ln[u, k])
        p += t
        if t > 0.0 and t < ln[u, k]:
            inside += 1.0
    return p, inside


@_inline
def _ray_slope(
    alpha: float,
    act: IntArray,
    n_act: int,
    price: FloatArray,
    rate: FloatArray,
    size: FloatArray,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    inv: float,
    base: float,
    p0: FloatArray,
    p_now: FloatArray,
) -> tuple[float, float, float]:
    """g(α) = base − Σ m_u e_u (x_u(λ_u + α e_u) − x_u(λ_u)) over the units act[:n_act]
    (base: g0 less what the others, settled, add), g'(α), and the rounding g carries (a few
    ulps of each moving unit's caps). Changes are summed, not caps, so that units that do
    not move add no rounding. Each unit's cap goes to p_now."""
    g = base
    dg = 0.0
    mag = 0.0
    for j in range(n_act):
        u = act[j]
        e = rate[u]
        p, inside = _unit_response(a, ln, lo[u], u, (price[u] + alpha * e) * inv)
        p_now[u] = p
        g -= size[u] * e * (p - p0[u])
        mag += size[u] * abs(e) * (abs(p) + abs(p0[u]))
        dg += size[u] * e * e * inv * inside
    return g, dg, 4e-16 * mag


@_jit
def ray_minimum(
    price: FloatArray,
    rate: FloatArray,
    size: FloatArray,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    inv: float,
    g0: float,
    alpha_max: float,
    x0: FloatArray,
    partial0: BoolArray,
    curv: float = 0.0,
) -> float:
    """The step α in [0, alpha_max] that minimises coupled_newton.py's dual along a ray μ + αd: the
    root of its slope g, continuous, non-decreasing and piecewise linear in α (a unit at
    mean price λ_u moving at rate e_u answers x_u(λ_u + α e_u); g0 = d·∇D(μ)). Newton
    steps inside a shrinking bracket, false position (Illinois) where one would leave it,
    bisection where the bracket stops halving: on a linear piece Newton lands on the root.
    x0, partial0: the units' caps at α = 0 and which are inside a segment there (the pass
    at μ made them). Once the root is bracketed, a unit whose cap is
    the same at both ends (at a bound or a knot throughout) is settled: later steps look
    only at the units still moving. 0 if g0 ≥ 0, alpha_max if g stays below 0 up to it."""
    if not g0 < 0.0:
        return 0.0
    n_units = size.size
    p0 = np.empty(n_units)
    p_now = np.empty(n_units)
    p_left = np.empty(n_units)
    p_right = np.empty(n_units)
    act = np.empty(n_units, dtype=np.int64)
    n_act = 0
    dg = 0.0
    n_k = a.shape[1]
    for u in range(n_units):
        p0[u] = x0[u]  # the caps at α = 0, and which units are inside a segment there
        p_left[u] = p0[u]
        e = rate[u]
        if e == 0.0:
            continue
        v = price[u] * inv
        if (e > 0.0 and v >= a[u, 0]) or (e < 0.0 and v <= a[u, n_k - 1] - ln[u, n_k - 1]):
            continue  # at its lower bound, price rising; at its upper one, price falling
        act[n_act] = u
        n_act += 1
        if partial0[u]:  # (a unit is inside one segment at most)
            dg += size[u] * e * e * inv
    dg += curv
    g = g0
    base = g0
    tol = 1e-10 * -g0
    left, right = 0.0, np.inf
    g_left, g_right = g0, 0.0
    alpha, width = 0.0, np.inf
    last_side = 0
    for step in range(MAX_STEPS):
        nxt = alpha - g / dg if dg > 0.0 else np.inf
        if right == np.inf:
            if not nxt < np.inf:
                nxt = max(2.0 * left, 1.0)  # a flat stretch: stretch out
            if nxt >= alpha_max:
                gm, _, _ = _ray_slope(
                    alpha_max, act, n_act, price, rate, size, a, ln, lo, inv, base, p0, p_right
                )
                gm += curv * alpha_max
                if gm <= 0.0:
                    return alpha_max
                right, g_right = alpha_max, gm
        if right < np.inf:
            if not left < nxt < right:
                # Newton left the bracket: false position (Illinois) inside it.
                nxt = left - g_left * (right - left) / (g_right - g_left)
            if not left < nxt < right or (step % 4 == 3 and right - left > width):
                nxt = 0.5 * (left + right)  # or it crept: bisect
            if step % 4 == 3:
                width = 0.5 * (right - left)
        elif abs(nxt - alpha) <= 1e-12 * alpha:
            return alpha  # Newton creeping up to a root it cannot pass for rounding
        alpha = nxt
        g, dg, noise = _ray_slope(
            alpha, act, n_act, price, rate, size, a, ln, lo, inv, base, p0, p_now
        )
        g += curv * alpha
        dg += curv
        if abs(g) <= max(tol, noise):
            return alpha
        if g < 0.0:
            left, g_left = alpha, g
            if last_side < 0:
                g_right *= 0.5
            last_side = -1
            for j in range(n_act):
                p_left[act[j]] = p_now[act[j]]
        else:
            right, g_right = alpha, g
            if last_side > 0:
                g_left *= 0.5
            last_side = 1
            for j in range(n_act):
                p_right[act[j]] = p_now[act[j]]
        if right < np.inf:
            # Settle the units whose caps no longer change inside the bracket.
            kept = 0
            for j in range(n_act):
                u = act[j]
                if p_left[u] == p_right[u]:
                    base -= size[u] * rate[u] * (p_left[u] - p0[u])
                else:
                    act[kept] = u
                    kept += 1
            n_act = kept
            if right - left <= 1e-10 * right:
                break
    return left


@_inline
def _incidence_means(
    vec: FloatArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    size: FloatArray,
    out: FloatArray,
) -> None:
    """Per unit, its GPUs' mean path sum of vec (per group): a free GPU's node path; a
    job's (group, members under it) pairs, job_ptr delimiting each job's."""
    n_nodes, depth = node_path.shape
    path = np.empty(n_nodes)
    for nd in range(n_nodes):
        s = 0.0
        for lv in range(depth):
            s += vec[node_path[nd, lv]]
        path[nd] = s
    n_free = free_node.size
    for u in range(n_free):
        out[u] = path[free_node[u]]
    for j in range(job_ptr.size - 1):
        s = 0.0
        for k in range(job_ptr[j], job_ptr[j + 1]):
            s += job_cnt[k] * vec[job_grp[k]]
        out[n_free + j] = s / size[n_free + j]


@_inline
def _incidence_sums(
    x: FloatArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    n_groups: int,
) -> FloatArray:
    """Group sums of the units' caps x (per unit; a job's cap on each of its GPUs)."""
    n_nodes, depth = node_path.shape
    node_sum = np.zeros(n_nodes)
    n_free = free_node.size
    for u in range(n_free):
        node_sum[free_node[u]] += x[u]
    sums = np.zeros(n_groups)
    for nd in range(n_nodes):
        if node_sum[nd] != 0.0:
            for lv in range(depth):
                sums[node_path[nd, lv]] += node_sum[nd]
    for j in range(job_ptr.size - 1):
        xj = x[n_free + j]
        for k in range(job_ptr[j], job_ptr[j + 1]):
            sums[job_grp[k]] += job_cnt[k] * xj
    return sums


@_jit
def unit_dual(
    mu: FloatArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    size: FloatArray,
    a: FloatArray,
    ln: FloatArray,
    slopes: FloatArray,
    lo: FloatArray,
    prev: FloatArray,
    cap: FloatArray,
    delta: float,
    eps: float,
    inv: float,
) -> tuple[FloatArray, FloatArray, BoolArray, float, FloatArray]:
    """coupled_newton.py's dual at multipliers mu (per kW), over units rather than GPUs: each unit's
    cap, the group sums, units inside a segment, D(mu), and each unit's price (its GPUs'
    mean path price). Units are the free GPUs (`free_node`: each one's row of node_path),
    then the jobs (their (group, members) pairs); a, ln, slopes are (units, K)."""
    n_units = size.size
    lam = np.empty(n_units)
    _incidence_means(mu, node_path, free_node, job_ptr, job_grp, job_cnt, size, lam)
    x = np.empty(n_units)
    partial = np.empty(n_units, dtype=np.bool_)
    value = 0.0
    for u in range(n_units):
        price = lam[u]
        v = price * inv
        p = lo[u]
        gain = 0.0
        part = False
        for k in range(a.shape[1]):
            t = min(max(a[u, k] - v, 0.0), ln[u, k])
            p += t
            gain += slopes[u, k] * t
            part |= (t > 0.0) & (t < ln[u, k])
        x[u] = p
        partial[u] = part
        gain += delta * p - eps * (p - prev[u]) ** 2 - price * p
        value += size[u] * gain
    for g in range(cap.size):
        value += mu[g] * cap[g]
    sums = _incidence_sums(x, node_path, free_node, job_ptr, job_grp, job_cnt, cap.size)
    return x, sums, partial, value, lam


@_jit
def incidence_means(
    vec: FloatArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    size: FloatArray,
) -> FloatArray:
    """Per unit, its GPUs' mean path sum of vec: its price at multipliers vec, or how fast
    that moves along a direction vec."""
    out = np.empty(size.size)
    _incidence_means(vec, node_path, free_node, job_ptr, job_grp, job_cnt, size, out)
    return out


@_jit
def incidence_response_sums(
    price: FloatArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    a: FloatArray,
    ln: FloatArray,
    lo: FloatArray,
    inv: float,
    n_groups: int,
) -> tuple[FloatArray, FloatArray, BoolArray]:
    """The caps coupled_newton.py's units take at their prices `price` (per kW), their group sums,
    and which units are inside a segment."""
    x = np.empty(price.size)
    partial = np.empty(price.size, dtype=np.bool_)
    for u in range(price.size):
        x[u], inside = _unit_response(a, ln, lo[u], u, price[u] * inv)
        partial[u] = inside > 0.0
    sums = _incidence_sums(x, node_path, free_node, job_ptr, job_grp, job_cnt, n_groups)
    return x, sums, partial


@_inline
def _answering(
    partial: BoolArray, n_nodes: int, free_node: IntArray, size: FloatArray, inv: float
) -> tuple[FloatArray, FloatArray]:
    """The Hessian's weights: per node, its free GPUs inside a segment; per job,
    1/(2ε m) where it is inside one (0 where not)."""
    n_free = free_node.size
    node_partial = np.zeros(n_nodes)
    for u in range(n_free):
        if partial[u]:
            node_partial[free_node[u]] += 1.0
    job_w = np.zeros(size.size - n_free)
    for j in range(job_w.size):
        if partial[n_free + j]:
            job_w[j] = inv / size[n_free + j]
    return node_partial, job_w


@_inline
def _hess_apply(
    v: FloatArray,
    out: FloatArray,
    node_partial: FloatArray,
    node_path: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    job_w: FloatArray,
    inv: float,
) -> None:
    """out = H v (v zero outside the working set): node_partial[nd] free GPUs inside a
    segment on node nd's path, job_w[j] = 1/(2ε m_j) for a job inside one (0 if not)."""
    out[:] = 0.0
    n_nodes, depth = node_path.shape
    for nd in range(n_nodes):
        c = node_partial[nd]
        if c == 0.0:
            continue
        t = 0.0
        for lv in range(depth):
            t += v[node_path[nd, lv]]
        t *= c * inv
        for lv in range(depth):
            out[node_path[nd, lv]] += t
    for j in range(job_ptr.size - 1):
        w = job_w[j]
        if w == 0.0:
            continue
        t = 0.0
        for k in range(job_ptr[j], job_ptr[j + 1]):
            t += job_cnt[k] * v[job_grp[k]]
        t *= w
        for k in range(job_ptr[j], job_ptr[j + 1]):
            out[job_grp[k]] += job_cnt[k] * t


@_jit
def newton_cg(
    rhs: FloatArray,
    work: BoolArray,
    shift: FloatArray,
    partial: BoolArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    size: FloatArray,
    inv: float,
    max_iter: int,
    rtol: float,
) -> FloatArray:
    """coupled_newton.py's Newton system (H + diag(shift)) d = rhs on the working set (`work`, per
    group; rhs and shift per group), by conjugate gradients preconditioned with the
    diagonal, H applied without being built (one pass over nodes and jobs' pairs, far
    cheaper than factorising a sparse H of thousands of groups). Stops at
    max_iter or where the residual is rtol of rhs: an inexact Newton direction, still one
    of descent, which the exact search then follows."""
    n_groups = rhs.size
    n_nodes = node_path.shape[0]
    node_partial, job_w = _answering(partial, n_nodes, free_node, size, inv)
    diag = shift.copy()
    for nd in range(n_nodes):
        c = node_partial[nd] * inv
        if c != 0.0:
            for lv in range(node_path.shape[1]):
                diag[node_path[nd, lv]] += c
    for j in range(job_w.size):
        if job_w[j] != 0.0:
            for k in range(job_ptr[j], job_ptr[j + 1]):
                diag[job_grp[k]] += job_w[j] * job_cnt[k] * job_cnt[k]
    x = np.zeros(n_groups)
    r = np.zeros(n_groups)
    z = np.zeros(n_groups)
    p = np.zeros(n_groups)
    q = np.zeros(n_groups)
    norm0 = 0.0
    rz = 0.0
    for g in range(n_groups):
        if work[g] and diag[g] > 0.0:
            r[g] = rhs[g]
            z[g] = r[g] / diag[g]
            p[g] = z[g]
            rz += r[g] * z[g]
            norm0 += r[g] * r[g]
    if norm0 == 0.0:
        return x
    for _ in range(max_iter):
        _hess_apply(p, q, node_partial, node_path, job_ptr, job_grp, job_cnt, job_w, inv)
        pq = 0.0
        for g in range(n_groups):
            if work[g] and diag[g] > 0.0:
                q[g] += shift[g] * p[g]
                pq += p[g] * q[g]
            else:
                q[g] = 0.0
        if not pq > 0.0:
            break
        step = rz / pq
        rr = 0.0
        rz_new = 0.0
        for g in range(n_groups):
            if work[g] and diag[g] > 0.0:
                x[g] += step * p[g]
                r[g] -= step * q[g]
                rr += r[g] * r[g]
                z[g] = r[g] / diag[g]
                rz_new += r[g] * z[g]
        if rr <= rtol * rtol * norm0:
            break
        beta = rz_new / rz
        rz = rz_new
        for g in range(n_groups):
            if work[g] and diag[g] > 0.0:
                p[g] = z[g] + beta * p[g]
    return x


@_jit
def incidence_hessian(
    partial: BoolArray,
    node_path: IntArray,
    free_node: IntArray,
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    size: FloatArray,
    col: IntArray,
    n_work: int,
    inv: float,
) -> FloatArray:
    """coupled_newton.py's generalised Hessian on the working set (`col`: each group's row there, -1
    outside), dense: inv per free GPU inside a segment on its path's pairs, inv / m times
    the outer product of its GPUs per group for a job of m GPUs inside a segment."""
    n_nodes, depth = node_path.shape
    h = np.zeros((n_work, n_work))
    per_node, job_w = _answering(partial, n_nodes, free_node, size, inv)
    for nd in range(n_nodes):
        w = per_node[nd] * inv
        if w == 0.0:
            continue
        for i in range(depth):
            ca = col[node_path[nd, i]]
            if ca < 0:
                continue
            for k in range(depth):
                cb = col[node_path[nd, k]]
                if cb >= 0:
                    h[ca, cb] += w
    # A job's pairs in the working set first (a job of 4,096 GPUs has ~600 pairs, a few of
    # them in the working set): the outer product over those alone.
    sel = np.empty(n_work, dtype=np.int64)
    cnt = np.empty(n_work)
    for j in range(job_w.size):
        w = job_w[j]
        if w == 0.0:
            continue
        n_sel = 0
        for k in range(job_ptr[j], job_ptr[j + 1]):
            c = col[job_grp[k]]
            if c >= 0:
                sel[n_sel] = c
                cnt[n_sel] = job_cnt[k]
                n_sel += 1
        for a in range(n_sel):
            wa = w * cnt[a]
            for b in range(n_sel):
                h[sel[a], sel[b]] += wa * cnt[b]
    return h


@_jit
def unit_value(
    x: FloatArray,
    lo: FloatArray,
    ln: FloatArray,
    slopes: FloatArray,
    prev: FloatArray,
    size: FloatArray,
    delta: float,
    eps: float,
) -> float:
    """coupled_newton.py's primal objective at the units' caps x: Σ_u m_u (gain along its segments
    + δx − ε(x − prev)²)."""
    value = 0.0
    for u in range(size.size):
        xu = x[u]
        start = lo[u]
        gain = 0.0
        for k in range(ln.shape[1]):
            gain += slopes[u, k] * min(max(xu - start, 0.0), ln[u, k])
            start += ln[u, k]
        gain += delta * xu - eps * (xu - prev[u]) ** 2
        value += size[u] * gain
    return value


@_jit
def unit_rows(
    rep: IntArray,
    lo: FloatArray,
    hi: FloatArray,
    flat: FloatArray,
    prev: FloatArray,
    cls: IntArray,
    weight: FloatArray,
    knots: FloatArray,
    slopes: FloatArray,
    delta: float,
    inv: float,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """coupled_newton.py's segments, one row per unit (its GPU rep[u]; prev per unit): a, len (as
    _segment_row) and each segment's slope (weight included; 0 past flat)."""
    n_units = rep.size
    n_k = knots.shape[1] + 1
    a = np.empty((n_units, n_k))
    ln = np.empty((n_units, n_k))
    sl = np.zeros((n_units, n_k))
    for u in range(n_units):
        i = rep[u]
        c = cls[i]
        _segment_row(
            a, ln, u, lo[i], hi[i], flat[i], prev[u], knots, slopes, c, weight[i], delta, inv
        )
        for k in range(n_k - 1):
            sl[u, k] = weight[i] * slopes[c, k]
    return a, ln, sl


@_jit
def objective_value(
    p_kw: FloatArray,
    demand_w: FloatArray,
    cls: IntArray,
    weight: FloatArray,
    prev: FloatArray,
    table_w: FloatArray,
    table_y: FloatArray,
    offset_w: float,
    delta: float,
    eps: float,
) -> float:
    """problem.objective in one pass: Σ w·profile(min(p, demand)) + δΣp − εΣ(p − prev)², the
    profile interpolated in ClassTable.value_table (class c's curve at c·offset_w)."""
    n_t = table_w.size
    total = 0.0
    for i in range(p_kw.size):
        p = p_kw[i]
        x = max(min(p * 1000.0, demand_w[i]), 0.0) + cls[i] * offset_w
        # np.interp: the table's end values outside it, linear between its points; NaN in,
        # NaN out (as numpy's minimum and maximum pass it on).
        if np.isnan(p) or np.isnan(demand_w[i]):
            y = np.nan
        elif x <= table_w[0]:
            y = table_y[0]
        elif x >= table_w[n_t - 1]:
            y = table_y[n_t - 1]
        else:
            lo_i, hi_i = 0, n_t - 1
            while hi_i - lo_i > 1:
                mid = (lo_i + hi_i) // 2
                if table_w[mid] <= x:
                    lo_i = mid
                else:
                    hi_i = mid
            x0, x1 = table_w[lo_i], table_w[hi_i]
            y0, y1 = table_y[lo_i], table_y[hi_i]
            y = y0 + (y1 - y0) * (x - x0) / (x1 - x0) if x1 > x0 else y1
        d = p - prev[i]
        total += weight[i] * y + delta * p - eps * d * d
    return total


@_jit
def cut_to_budgets(
    p: FloatArray,
    lo: FloatArray,
    node_of_gpu: IntArray,
    parent: IntArray,
    deepest_first: IntArray,
    target: FloatArray,
) -> None:
    """problem.repair's cuts, in place: level by level from the nodes up, each group over
    `target` cut in proportion to its GPUs' room above lo (never below the sum of lo).

    A cut scales the room of every GPU below the group by one factor, so each group's room
    after the cuts below it is the sum of its children's (each times its own factor): the
    factors follow from the nodes' sums, and each GPU takes the product of those on its
    path."""
    n_groups = target.size
    room = np.zeros(n_groups)
    floor = np.zeros(n_groups)
    for i in range(p.size):
        room[node_of_gpu[i]] += p[i] - lo[i]
        floor[node_of_gpu[i]] += lo[i]
    keep = np.ones(n_groups)
    cut = False
    for g in deepest_first:  # children before their parent
        excess = floor[g] + room[g] - max(target[g], floor[g])
        if excess > 0.0:
            cut = True
            keep[g] = min(max(1.0 - excess / room[g], 0.0), 1.0) if room[g] > 0.0 else 0.0
            room[g] *= keep[g]
        if parent[g] >= 0:
            room[parent[g]] += room[g]
            floor[parent[g]] += floor[g]
    if not cut:
        return
    for k in range(deepest_first.size - 1, -1, -1):  # parents first: the path's product
        g = deepest_first[k]
        if parent[g] >= 0:
            keep[g] *= keep[parent[g]]
    for i in range(p.size):
        f = keep[node_of_gpu[i]]
        if f != 1.0:
            p[i] = lo[i] + (p[i] - lo[i]) * f


@_jit
def classify_jobs(
    job_ptr: IntArray,
    job_grp: IntArray,
    job_cnt: FloatArray,
    job_size: FloatArray,
    level_of: IntArray,
    held: BoolArray,
) -> tuple[BoolArray, IntArray]:
    """Which jobs are laminar, and where each hangs, from their (group, GPUs under it)
    pairs (JobMap.incidence).

    A job is laminar when every held group (`held`: the budgets the solve holds, never a
    group one job holds alone, which build_problem made a bound on that job) with some of
    its GPUs holds all of them: its price is then a chain of multipliers, as a single GPU's.
    It hangs at the deepest group holding all its GPUs."""
    n_jobs = job_ptr.size - 1
    laminar = np.ones(n_jobs, dtype=np.bool_)
    hang = np.full(n_jobs, -1, dtype=np.int64)
    for j in range(n_jobs):
        deepest = -1
        for k in range(job_ptr[j], job_ptr[j + 1]):
            g = job_grp[k]
            whole = job_cnt[k] == job_size[j]
            if held[g] and not whole:
                laminar[j] = False
            if whole and level_of[g] > deepest:
                deepest = level_of[g]
                hang[j] = g
    return laminar, hang


@_inline
def _ascending(v: IntArray) -> IntArray:
    """v in ascending order: v itself where it already is (a job's groups and nodes come in
    id order where GPUs do, as a depth-first topology numbers them), else a sorted copy
    (a sort per job cost 2.5x numpy's whole-array one with a job per GPU)."""
    for t in range(1, v.size):
        if v[t] < v[t - 1]:
            return np.sort(v)
    return v


@_jit
def job_incidence(
    job: IntArray,
    members: IntArray,
    starts: IntArray,
    gpu_groups: IntArray,
    n_groups: int,
    n_jobs: int,
) -> tuple[IntArray, IntArray, FloatArray]:
    """problem.JobMap.incidence: each job's groups (ascending) and its GPUs under each, as
    (job_ptr, group, count); `members` are the member GPUs grouped by job in ascending job
    order, each run from starts[r] (a count per group in scratch, not a sort of every
    (job, group) key). A job without members gets no pairs."""
    n_runs = starts.size
    n_members = members.size
    depth = gpu_groups.shape[1]
    count = np.zeros(n_groups)
    touched = np.empty(n_members * depth, dtype=np.int64)
    grp = np.empty(n_members * depth, dtype=np.int64)
    cnt = np.empty(n_members * depth)
    ptr = np.zeros(n_jobs + 1, dtype=np.int64)
    out = 0
    for r in range(n_runs):
        end = starts[r + 1] if r + 1 < n_runs else n_members
        n_t = 0
        for k in range(starts[r], end):
            i = members[k]
            for lv in range(depth):
                g = gpu_groups[i, lv]
                if count[g] == 0.0:
                    touched[n_t] = g
                    n_t += 1
                count[g] += 1.0
        ts = _ascending(touched[:n_t])
        for t in range(n_t):
            g = ts[t]
            grp[out] = g
            cnt[out] = count[g]
            count[g] = 0.0
            out += 1
        ptr[job[members[starts[r]]] + 1] = out
    for j in range(n_jobs):  # (a job without members: its pairs end where the last ended)
        ptr[j + 1] = max(ptr[j + 1], ptr[j])
    return ptr, grp[:out].copy(), cnt[:out].copy()


@_jit
def job_parts(
    job: IntArray, members: IntArray, starts: IntArray, node_of_gpu: IntArray, n_groups: int
) -> tuple[IntArray, FloatArray, IntArray]:
    """problem.JobMap.parts: each GPU's unit (free GPUs first, in GPU order, then each job's
    parts by ascending node), each unit's GPU count and its lowest-numbered GPU; `members`
    grouped by job, in GPU order within each (a stable sort)."""
    n = job.size
    unit = np.empty(n, dtype=np.int64)
    size = np.empty(n)
    rep = np.empty(n, dtype=np.int64)
    n_units = 0
    for i in range(n):
        if job[i] < 0:
            unit[i] = n_units
            size[n_units] = 1.0
            rep[n_units] = i
            n_units += 1
    part = np.full(n_groups, -1, dtype=np.int64)
    nodes = np.empty(members.size, dtype=np.int64)
    n_jobs = starts.size
    for j in range(n_jobs):
        end = starts[j + 1] if j + 1 < n_jobs else members.size
        n_nd = 0
        for k in range(starts[j], end):
            nd = node_of_gpu[members[k]]
            if part[nd] < 0:
                part[nd] = 0
                nodes[n_nd] = nd
                n_nd += 1
        ordered = _ascending(nodes[:n_nd])
        for t in range(n_nd):
            part[ordered[t]] = n_units + t
            size[n_units + t] = 0.0
        for k in range(starts[j], end):
            i = members[k]
            u = part[node_of_gpu[i]]
            unit[i] = u
            if size[u] == 0.0:
                rep[u] = i  # (members come in GPU order: the first is the lowest)
            size[u] += 1.0
        for t in range(n_nd):
            part[ordered[t]] = -1
        n_units += n_nd
    return unit, size[:n_units].copy(), rep[:n_units].copy()


@_jit
def job_units(job: IntArray, n_jobs: int) -> tuple[IntArray, FloatArray, IntArray]:
    """problem.JobMap.units: each GPU's unit (free GPUs first, in GPU order, then the jobs),
    each unit's GPU count and its lowest-numbered GPU."""
    n = job.size
    n_free = 0
    for i in range(n):
        n_free += job[i] < 0
    unit = np.empty(n, dtype=np.int64)
    size = np.zeros(n_free + n_jobs)
    rep = np.full(n_free + n_jobs, -1, dtype=np.int64)
    free = 0
    for i in range(n):
        if job[i] < 0:
            u = free
            free += 1
        else:
            u = n_free + job[i]
        unit[i] = u
        if rep[u] < 0:
            rep[u] = i
        size[u] += 1.0
    return unit, size, rep


@_jit
def single_job_groups(job: IntArray, gpu_groups: IntArray, n_groups: int) -> BoolArray:
    """problem._single_job_groups: the groups whose GPUs all belong to one job."""
    owner = np.full(n_groups, -2, dtype=np.int64)  # -2: no GPU seen yet
    mixed = np.zeros(n_groups, dtype=np.bool_)
    for i in range(job.shape[0]):
        for lv in range(gpu_groups.shape[1]):
            g = gpu_groups[i, lv]
            if owner[g] == -2:
                owner[g] = job[i]
            elif owner[g] != job[i]:
                mixed[g] = True
    out = np.empty(n_groups, dtype=np.bool_)
    for g in range(n_groups):
        out[g] = owner[g] >= 0 and not mixed[g]
    return out


@dataclass(frozen=True)
class WarmUp:
    """What `warm_up` did."""

    seconds: float
    compiled: int  # kernels numba compiled now (its cache lacked them, or it has none)
    loaded: int  # kernels loaded from numba's cache
    cache_dir: str | None  # where numba keeps the machine code; None: nowhere (or no JIT)
    jit: bool  # False under NUMBA_DISABLE_JIT: plain Python, nothing to compile

    @property
    def cached(self) -> bool:
        """The next process loads the kernels instead of compiling them."""
        return self.cache_dir is not None or not self.jit


class _CompileWatch(numba.core.event.Listener):
    """Calls `on_first` when numba starts compiling a kernel of a module named `prefix` or
    below it: numba sends "numba:compile" only after its cache missed, so a load from the
    cache is silent."""

    def __init__(self, on_first: Callable[[], None], prefix: str) -> None:
        self.on_first = on_first
        self.prefix = prefix
        self.started = False

    def on_start(self, event: Any) -> None:
        fn = getattr(event.data.get("dispatcher"), "py_func", None)
        module = getattr(fn, "__module__", None) or ""
        if not self.started and (module == self.prefix or module.startswith(self.prefix + ".")):
            self.started = True
            self.on_first()

    def on_end(self, event: Any) -> None:
        pass


@contextlib.contextmanager
def watch_compiles(on_first: Callable[[], None], prefix: str = __name__) -> Iterator[None]:
    """Within the block, call `on_first` once, when numba starts compiling a kernel of the
    module `prefix` or a module below it (`powerd`: every kernel of powerd's), not when it
    loads one from its cache."""
    with numba.core.event.install_listener("numba:compile", _CompileWatch(on_first, prefix)):
        yield


@jit_exact
def tree_sums(
    node_of_gpu: IntArray,
    per_gpu: FloatArray,
    n_groups: int,
    groups: IntArray,
    parents: IntArray,
    starts: IntArray,
) -> FloatArray:
    """Tree.sums: each group's sum of a per-GPU value, bit for bit as its bincounts add
    (each node's GPUs in order; then level by level, deepest first — `groups[starts[k]:
    starts[k + 1]]` with their `parents` — each parent's children summed in order from 0
    and that added to what the parent held)."""
    s = np.zeros(n_groups)
    for i in range(node_of_gpu.size):
        s[node_of_gpu[i]] += per_gpu[i]
    t = np.empty(n_groups)
    for lv in range(starts.size - 1):
        t[:] = 0.0
        for j in range(starts[lv], starts[lv + 1]):
            t[parents[j]] += s[groups[j]]
        for k in range(n_groups):
            s[k] = s[k] + t[k]
    return s


@jit_exact
def verify_caps(
    p: FloatArray,
    lo: FloatArray,
    hi: FloatArray,
    tol: float,
    job: IntArray,
    n_jobs: int,
    node_of_gpu: IntArray,
    capacity: FloatArray,
    groups: IntArray,
    parents: IntArray,
    starts: IntArray,
) -> tuple[int, int]:
    """solve._verify's checks of caps p (kW) in one pass: 0 where all hold, else the first
    that fails (1: a cap not finite; 2: a cap outside [lo − tol, hi + tol]; 3: a job's GPUs
    (`job`, -1: none) apart; 4: a group's sum (as Tree.sums adds it) over its capacity
    by more than tol), with the group most over it (4; else -1)."""
    n = p.size
    for i in range(n):
        if not np.isfinite(p[i]):
            return 1, -1
    for i in range(n):
        if p[i] < lo[i] - tol or p[i] > hi[i] + tol:
            return 2, -1
    if n_jobs > 0:
        top = np.full(n_jobs, -np.inf)
        for i in range(n):
            if job[i] >= 0:
                top[job[i]] = max(top[job[i]], p[i])
        for i in range(n):
            if job[i] >= 0 and p[i] != top[job[i]]:
                return 3, -1
    sums = tree_sums(node_of_gpu, p, capacity.size, groups, parents, starts)
    over, worst, most = False, -1, -np.inf
    for g in range(capacity.size):
        excess = sums[g] - capacity[g]
        over = over or excess > tol
        if worst < 0 or excess > most or (np.isnan(excess) and not np.isnan(most)):
            worst, most = g, excess  # (np.argmax: the first largest, a NaN first of all)
    return (4, worst) if over else (0, -1)


@_inline_exact
def _at_least_zero(x: float) -> float:
    """np.maximum(x, 0.0) (NaN stays NaN)."""
    return 0.0 if x < 0.0 else x


@_inline_exact
def _move_keys(move: FloatArray, pressed: BoolArray, by_pressed: bool) -> FloatArray:
    """deadband's order of moves where room is short, as a sort key (ties by index): GPUs
    pressing on their cap first (`by_pressed`), then the largest `move`."""
    key = np.empty(move.size)
    for i in range(move.size):
        key[i] = -move[i] - 1e6 if by_pressed and pressed[i] else -move[i]
    return key


@_inline_exact
def _fill_moves(
    move: FloatArray,
    gpu_groups: IntArray,
    level: int,
    room: FloatArray,
    over: BoolArray,
    key: FloatArray,
) -> FloatArray:
    """Per GPU the part of its `move` (≥ 0) that is made: in full where its group is not
    `over`; under an over group, whole moves in turn (by `key`, then index) while the
    group's `room` lasts, the one it runs out on in part."""
    n = move.size
    kept = move.copy()
    m = 0
    for i in range(n):
        if over[gpu_groups[i, level]] and move[i] > 0.0:
            m += 1
    if m == 0:
        return kept
    idx = np.empty(m, dtype=np.int64)
    m = 0
    for i in range(n):
        if over[gpu_groups[i, level]] and move[i] > 0.0:
            idx[m] = i
            m += 1
    # By group, then key, then index: two stable sorts, the last by the first criterion.
    idx = idx[np.argsort(key[idx], kind="mergesort")]
    groups = np.empty(m, dtype=np.int64)
    for k in range(m):
        groups[k] = gpu_groups[idx[k], level]
    idx = idx[np.argsort(groups, kind="mergesort")]
    # As numpy's segmented cumulative sum: one running sum over all groups, less its value
    # where each group's run starts.
    cum = 0.0
    base = 0.0
    last = -1
    for k in range(m):
        i = idx[k]
        g = gpu_groups[i, level]
        r = move[i]
        cum = cum + r
        start_val = cum - r if g != last else 0.0
        base = start_val if k == 0 else max(base, start_val)
        last = g
        before = cum - r - base
        kept[i] = min(max(room[g] - before, 0.0), r)
    return kept


@jit_exact
def deadband_hold(
    targets: FloatArray,
    prev: FloatArray,
    holdable: BoolArray,
    pressed: BoolArray,
    by_pressed: bool,
    dwell: BoolArray,
    by_dwell: bool,
    cut_w: float,
    raise_w: float,
    dwell_max_w: float,
    fund_w: float,
    fund_ok: BoolArray,
    capacity: FloatArray,
    gpu_groups: IntArray,
    tol: float,
) -> tuple[FloatArray, BoolArray]:
    """deadband.hold_small_cuts after its settings are read, bit for bit as its numpy
    version did it: (targets, held). Held: a holdable GPU's cut of at most `cut_w`; where
    `by_dwell`, a `dwell`ing GPU's move of at most `dwell_max_w`; where `raise_w` > 0, a
    holdable GPU's raise of at most `raise_w` if it is not `pressed` (read where
    `by_pressed`). Where `fund_w` is not NaN, held cuts of at least `fund_w` of GPUs not
    pressed may fund the pressed GPUs' raises, under the groups `fund_ok` (per group) lets.
    Then `_deadband_levels`."""
    n = targets.size
    held = np.zeros(n, dtype=np.bool_)
    out = targets.copy()
    releasable = np.zeros(n, dtype=np.bool_)
    funds = by_pressed and not np.isnan(fund_w)
    any_held = False
    for i in range(n):
        d = targets[i] - prev[i]  # (NaN compares False, but != 0)
        h = holdable[i] and d < 0.0 and d >= -cut_w
        if by_dwell:
            h = h or (dwell[i] and d != 0.0 and abs(d) <= dwell_max_w)
        if raise_w > 0.0 and by_pressed:
            h = h or (holdable[i] and not pressed[i] and d > 0.0 and d <= raise_w)
        if h:
            held[i] = True
            any_held = True
            out[i] = prev[i]
            if funds:
                releasable[i] = not pressed[i] and prev[i] - targets[i] >= fund_w
    if not any_held:
        return out, held
    still = _deadband_levels(
        targets, prev, out, held, capacity, gpu_groups, pressed, by_pressed, releasable, funds,
        fund_ok, tol,
    )  # fmt: skip
    return out, still


@_inline_exact
def _deadband_levels(
    targets: FloatArray,
    prev: FloatArray,
    out: FloatArray,
    held_first: BoolArray,
    capacity: FloatArray,
    gpu_groups: IntArray,
    pressed: BoolArray,
    by_pressed: bool,
    releasable: BoolArray,
    funds: bool,
    fund_ok: BoolArray,
    tol: float,
) -> BoolArray:
    """The pass over the levels, in place on `out` (the targets with the held moves at
    the cap in force); returns per GPU whether it stays held. `pressed` is read where
    `by_pressed`; `releasable` (the held cuts that may fund a pressed raise) and `fund_ok`
    (per group, whether they may under it) where `funds`."""
    n = targets.size
    n_groups = capacity.size
    counted = np.empty(n)
    for i in range(n):
        counted[i] = prev[i] if np.isnan(out[i]) else out[i]
    sums = np.empty(n_groups)
    excess = np.empty(n_groups)
    over = np.zeros(n_groups, dtype=np.bool_)
    rises = np.empty(n_groups)
    room = np.empty(n_groups)
    rise = np.empty(n)
    trimmed = np.empty(n)
    key = np.empty(0)
    ranked = False
    for level in range(gpu_groups.shape[1]):
        sums[:] = 0.0
        for i in range(n):
            sums[gpu_groups[i, level]] += counted[i]
        any_over = False
        for g in range(n_groups):
            excess[g] = sums[g] - capacity[g]
            over[g] = excess[g] > tol
            any_over = any_over or over[g]
        if not any_over:
            continue
        for i in range(n):
            rise[i] = _at_least_zero(counted[i] - prev[i])
        if not ranked:  # (the order of the first level over its limit holds below it)
            key = _move_keys(rise, pressed, by_pressed)
            ranked = True
        if funds:
            # (deadband._fund_pressed)
            ups = np.zeros(n_groups)
            others = np.zeros(n_groups)
            for i in range(n):
                g = gpu_groups[i, level]
                ups[g] += rise[i] if pressed[i] else 0.0
                others[g] += 0.0 if pressed[i] else rise[i]
            need = np.zeros(n_groups)
            wanted = np.zeros(n_groups, dtype=np.bool_)
            any_wanted = False
            for g in range(n_groups):
                if over[g] and ups[g] > tol and fund_ok[g]:
                    need[g] = _at_least_zero(excess[g] - others[g])
                wanted[g] = need[g] > tol
                any_wanted = any_wanted or wanted[g]
            if any_wanted:
                made = _release_cuts(releasable, counted, targets, gpu_groups, level, need, wanted)
                freed = np.zeros(n_groups)
                for i in range(n):
                    counted[i] = counted[i] - made[i]
                    freed[gpu_groups[i, level]] += made[i]
                for g in range(n_groups):
                    excess[g] = excess[g] - freed[g]
        rises[:] = 0.0
        for i in range(n):
            rises[gpu_groups[i, level]] += rise[i]
        for g in range(n_groups):
            room[g] = _at_least_zero(rises[g] - excess[g])
        fill = _fill_moves(rise, gpu_groups, level, room, over, key)
        for i in range(n):
            trimmed[i] = prev[i] + fill[i] if rise[i] > 0.0 else counted[i]
        # Where no raise is left and the group still breaks its limit, held cuts go.
        short = np.empty(n_groups)
        tight = np.zeros(n_groups, dtype=np.bool_)
        any_tight = False
        for g in range(n_groups):
            short[g] = _at_least_zero(excess[g] - rises[g])
            tight[g] = short[g] > tol
            any_tight = any_tight or tight[g]
        if any_tight:
            made = _release_cuts(held_first, counted, targets, gpu_groups, level, short, tight)
            for i in range(n):
                if made[i] > 0.0:
                    trimmed[i] = counted[i] - made[i]
        for i in range(n):
            if np.isfinite(out[i]):
                out[i] = trimmed[i]
            counted[i] = prev[i] if np.isnan(out[i]) else out[i]
    held = np.empty(n, dtype=np.bool_)
    for i in range(n):
        held[i] = held_first[i] and counted[i] == prev[i]
    return held


@_inline_exact
def _release_cuts(
    may_go: BoolArray,
    counted: FloatArray,
    targets: FloatArray,
    gpu_groups: IntArray,
    level: int,
    amount: FloatArray,
    where: BoolArray,
) -> FloatArray:
    """deadband._release: per GPU the part of its held cut that goes."""
    n = counted.size
    cut = np.empty(n)
    for i in range(n):
        if may_go[i] and where[gpu_groups[i, level]]:
            cut[i] = _at_least_zero(counted[i] - targets[i])
        else:
            cut[i] = 0.0
    return _fill_moves(cut, gpu_groups, level, amount, where, _move_keys(cut, may_go, False))


@_inline_exact
def _np_max(a: float, b: float) -> float:
    """np.maximum of two floats (NaN wins)."""
    return a if a >= b or np.isnan(a) else b


@_inline_exact
def _np_min(a: float, b: float) -> float:
    """np.minimum of two floats (NaN wins)."""
    return a if a <= b or np.isnan(a) else b


def sparse_rows(n_rows: int, n_gpus: int) -> bool:
    """Whether `absorb_rows` finds the rows' GPUs by sorting the rows: they are few against
    the fleet (a pass over a 100,000-GPU fleet for one node's message took ~0.6 ms)."""
    return n_rows * 16 < n_gpus


@jit_exact
def absorb_rows(
    gpu: IntArray,
    hi: FloatArray,
    lo: FloatArray,
    key: IntArray,
    tick: IntArray,
    guess: BoolArray,
    defiant: IntArray,
    state_hi: FloatArray,
    state_lo: FloatArray,
    state_key: IntArray,
    pend_tick: IntArray,
    pend_hi: FloatArray,
    pend_lo: FloatArray,
    prior_hi: FloatArray,
    prior_tick: IntArray,
    state_defiant: BoolArray,
    max_cap_w: FloatArray,
    min_cap_w: FloatArray,
    alarm_tol_w: float,
    sparse: bool,
) -> tuple[BoolArray, FloatArray]:
    """safety.SafetyPlanner._absorb's fold of queued rows (row r of GPU `gpu[r]`) into the
    per-GPU state, in place (`hi` and `lo` widened in place where an ack guesses). Returns
    per row whether its reading lies above what was committed before, and that committed
    bound (for the alarms). `sparse`: the rows name few of the fleet's GPUs (`sparse_rows`),
    found by sorting the rows rather than by a pass over the fleet (the same result)."""
    n_rows, n_slots = gpu.size, pend_tick.shape[0]
    # The GPUs named (`touched`, in layout order) and each row's among them (`local`): by a
    # pass over the fleet where the rows cover much of it (a fleet's sample, its acks), by
    # sorting the rows where they are few (one node's message on a large fleet).
    if sparse:
        touched = np.unique(gpu)
        local = np.searchsorted(touched, gpu)
    else:
        slot = np.full(state_hi.size, -1, dtype=np.int64)
        for r in range(n_rows):
            slot[gpu[r]] = 0
        n_named = 0
        for i in range(state_hi.size):
            if slot[i] == 0:
                slot[i] = n_named
                n_named += 1
        touched = np.empty(n_named, dtype=np.int64)
        for i in range(state_hi.size):
            if slot[i] >= 0:
                touched[slot[i]] = i
        local = np.empty(n_rows, dtype=np.int64)
        for r in range(n_rows):
            local[r] = slot[gpu[r]]
    n_t = touched.size
    int_min = np.iinfo(np.int64).min
    known = np.empty(n_t, dtype=np.bool_)
    before = np.empty(n_t)
    newest = np.empty(n_t, dtype=np.int64)
    for t in range(n_t):
        i = touched[t]
        known[t] = not np.isnan(state_hi[i])
        b = state_hi[i] if known[t] else max_cap_w[i]
        m = pend_hi[0, i]
        for s in range(1, n_slots):
            m = _np_max(m, pend_hi[s, i])
        before[t] = _np_max(b, m)
        newest[t] = state_key[i] if known[t] else int_min
    any_ack = False
    for r in range(n_rows):
        if tick[r] >= 0:
            any_ack = True
            break
    if any_ack:
        # Acks that guess widen their bounds by the earlier ones and the commands they
        # resolve, before anything is resolved.
        for r in range(n_rows):
            if tick[r] < 0 or not guess[r]:
                continue
            i = gpu[r]
            res_hi, res_lo = 0.0, np.inf
            for s in range(n_slots):
                if pend_tick[s, i] >= 0 and pend_tick[s, i] <= tick[r]:
                    res_hi = _np_max(res_hi, pend_hi[s, i])
                    res_lo = _np_min(res_lo, pend_lo[s, i])
            prev_hi = max_cap_w[i] if np.isnan(state_hi[i]) else state_hi[i]
            prev_lo = min_cap_w[i] if np.isnan(state_lo[i]) else state_lo[i]
            hi[r] = _np_max(_np_max(hi[r], prev_hi), res_hi)
            lo[r] = _np_min(_np_min(lo[r], prev_lo), res_lo)
        upto = np.full(n_t, -1, dtype=np.int64)
        last_ack = np.full(n_t, -1, dtype=np.int64)
        for r in range(n_rows):
            if tick[r] >= 0:
                t = local[r]
                upto[t] = max(upto[t], tick[r])
                last_ack[t] = max(last_ack[t], r)
        for t in range(n_t):
            i = touched[t]
            for s in range(n_slots):  # (_resolve)
                if pend_tick[s, i] >= 0 and pend_tick[s, i] <= upto[t]:
                    pend_tick[s, i] = -1
                    pend_hi[s, i] = 0.0
                    pend_lo[s, i] = np.inf
            # Our own command acknowledged: nothing a predecessor sent can land any more.
            if upto[t] >= prior_tick[i]:
                prior_hi[i] = 0.0
            if last_ack[t] >= 0:
                state_defiant[i] = defiant[last_ack[t]] > 0
    # The newest tick wins; among readings of that tick the last to arrive, and whatever
    # arrived after it (older ticks) can only widen the bounds.
    for r in range(n_rows):
        newest[local[r]] = max(newest[local[r]], key[r])
    last_pos = np.full(n_t, -1, dtype=np.int64)
    for r in range(n_rows):
        if key[r] == newest[local[r]]:
            last_pos[local[r]] = max(last_pos[local[r]], r)
    new_hi = np.empty(n_t)
    new_lo = np.empty(n_t)
    for t in range(n_t):
        keep_state = known[t] and last_pos[t] < 0
        new_hi[t] = state_hi[touched[t]] if keep_state else -np.inf
        new_lo[t] = state_lo[touched[t]] if keep_state else np.inf
    above = np.zeros(n_rows, dtype=np.bool_)
    before_rows = np.empty(n_rows)
    for r in range(n_rows):
        t = local[r]
        before_rows[r] = before[t]
        if r >= last_pos[t]:  # kept
            new_hi[t] = _np_max(new_hi[t], hi[r])
            new_lo[t] = _np_min(new_lo[t], lo[r])
            above[r] = known[t] and hi[r] > before[t] + alarm_tol_w
    for t in range(n_t):
        i = touched[t]
        state_hi[i] = new_hi[t]
        state_lo[i] = new_lo[t]
        state_key[i] = newest[t]
    return above, before_rows


def _kernels() -> list[Any]:
    """The kernels Python calls (the private ones are called only by other kernels: they
    compile with their callers and are never loaded from the cache on their own)."""
    return [
        f
        for name, f in globals().items()
        if isinstance(f, numba.core.dispatcher.Dispatcher) and not name.startswith("_")
    ]


def _cache_counts(kernels: list[Any]) -> tuple[int, int]:
    """(hits, misses) of numba's cache so far, summed over the kernels."""
    stats = [k.stats for k in kernels]
    return (
        sum(sum(s.cache_hits.values()) for s in stats),
        sum(sum(s.cache_misses.values()) for s in stats),
    )


def warm_up(on_compiling: Callable[[str | None], None] | None = None) -> WarmUp:
    """Compile (or load from numba's cache) every kernel on a two-GPU tree, so the first
    tick does not wait for the compiler: ~20 s on two cores, ~0.3 s from the cache. Daemons
    call it in a thread at start; `powerd warm` runs it ahead (systemd's ExecStartPre, an
    image's build). Logs `solver_compiling` when numba starts compiling (and calls
    `on_compiling` with the cache directory) and `solver_ready` at the end."""
    kernels = _kernels()
    jit = not getattr(numba.config, "DISABLE_JIT", False)
    cache_dir = next((k.stats.cache_path for k in kernels), None) if jit else None

    def compiling() -> None:
        log.info("solver_compiling", cache_dir=cache_dir, hint="once per install; seconds")
        if on_compiling is not None:
            on_compiling(cache_dir)

    hits0, misses0 = _cache_counts(kernels)
    start = time.perf_counter()
    with watch_compiles(compiling):
        _run_every_kernel()
    seconds = time.perf_counter() - start
    hits, misses = _cache_counts(kernels)
    done = WarmUp(seconds, misses - misses0, hits - hits0, cache_dir, jit)
    log.info(
        "solver_ready",
        seconds=round(seconds, 3),
        compiled=done.compiled,
        loaded=done.loaded,
        cache_dir=cache_dir,
    )
    if done.compiled and not done.cached:
        log.warning(
            "solver_not_cached",
            hint="no writable cache directory: every start compiles again; set NUMBA_CACHE_DIR",
        )
    return done


def _run_every_kernel() -> None:
    parent = np.array([-1, 0], dtype=np.int64)
    attach = np.array([1, 1], dtype=np.int64)
    ones, zeros = np.ones(2), np.zeros(2)
    knots = np.array([[0.5, np.inf]])
    slopes = np.array([[1.0, 0.0]])
    n_k = knots.shape[1] + 1
    work = work_arrays(2, 2, n_k)
    prepare(
        attach,
        np.arange(2),
        parent,
        0.1 * ones,
        ones,
        0.8 * ones,
        0.5 * ones,
        np.zeros(2, dtype=np.int64),
        ones,
        ones,
        knots,
        slopes,
        1e-3,
        1e3,
        *work,
    )
    by_level = np.array([1, 0], dtype=np.int64)
    capacity = np.array([1.0, 1.5])
    solve_groups(2, 2, n_k, by_level, capacity, np.full(2, 0.5), *work, REL_TOL)
    solve_groups(2, 2, n_k, by_level, capacity, zeros, *work, REL_TOL)
    gg = np.array([[0, 1], [0, 1]], dtype=np.int64)
    # One free GPU and one job of one GPU, both on node 1.
    node_rows = gg[:1]
    free_node = np.zeros(1, dtype=np.int64)
    ptr = np.array([0, 2], dtype=np.int64)
    grp = np.array([0, 1], dtype=np.int64)
    cnt = np.ones(2)
    incidence = (node_rows, free_node, ptr, grp, cnt)
    size = np.ones(2)
    rows = np.ones((2, 1))
    lo = np.array([0.1, 0.1])
    unit_dual(zeros, *incidence, size, rows, rows, rows, lo, lo, capacity, 1e-3, 1e-3, 1e3)
    incidence_means(zeros, *incidence, size)
    incidence_response_sums(zeros, *incidence, rows, rows, lo, 1e3, 2)
    incidence_hessian(np.ones(2, dtype=np.bool_), *incidence, size, np.arange(2), 2, 1e3)
    ones_b = np.ones(2, dtype=np.bool_)
    newton_cg(-ones, ones_b, 1e-3 * ones, ones_b, *incidence, size, 1e3, 10, 1e-6)
    ray_minimum(zeros, -np.ones(2), size, rows, rows, lo, 1e3, -1.0, np.inf, lo, zeros > 0, 0.0)
    cut_to_budgets(np.ones(2), lo, attach, parent, by_level, capacity)
    objective_value(lo, ones, np.zeros(2, dtype=np.int64), ones, lo, knots[0, :1], ones[:1],
                    1e7, 1e-3, 1e-3)  # fmt: skip
    unit_rows(np.arange(2), lo, ones, ones, lo, np.zeros(2, dtype=np.int64), ones, knots,
              slopes, 1e-3, 1e3)  # fmt: skip
    unit_value(lo, lo, rows, rows, lo, size, 1e-3, 1e-3)
    classify_jobs(ptr, grp, cnt, np.array([2.0]), np.arange(2), np.ones(2, dtype=np.bool_))
    job = np.array([-1, 0], dtype=np.int64)
    one = np.array([1], dtype=np.int64)
    job_incidence(job, one, np.zeros(1, dtype=np.int64), gg, 2, 1)
    job_parts(job, one, np.zeros(1, dtype=np.int64), attach, 2)
    single_job_groups(job, gg, 2)
    tree_sums(np.array([1, 1], dtype=np.int64), ones, 2, np.array([1], dtype=np.int64),
              np.array([0], dtype=np.int64), np.array([0, 1], dtype=np.int64))  # fmt: skip
    job_units(job, 1)
    verify_caps(lo, lo, lo, 1e-9, job, 1, attach, capacity, np.array([1], dtype=np.int64),
                np.array([0], dtype=np.int64), np.array([0, 1], dtype=np.int64))  # fmt: skip
    nan_free = np.array([0.1, np.nan])
    deadband_hold(nan_free, lo, ones_b, ones_b, True, ones_b, True, 40.0, 40.0, 80.0, 0.0,
                  np.ones(capacity.size, dtype=np.bool_), capacity, gg, 1e-6)  # fmt: skip
    named = np.arange(2, dtype=np.int64)
    ticks = np.array([-1, 1], dtype=np.int64)
    absorb_rows(named, lo.copy(), lo.copy(), ticks, ticks, ones_b, ticks, lo.copy(), lo.copy(),
                ticks.copy(), np.full((2, 2), -1, dtype=np.int64), np.zeros((2, 2)),
                np.ones((2, 2)), lo.copy(), ticks.copy(), ones_b.copy(), ones, zeros,
                0.5, False)  # fmt: skip
