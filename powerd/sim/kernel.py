"""A simulated run's loops, compiled: each step's accounting and each steer's check of the
committed caps (powerd/sim/run.py), the agents' telemetry check and their setting of a plan's
caps (powerd/sim/agents.py).

Each step checks every group's measured draw against its budgets and adds up the GPUs' work,
and each steer checks the fleet's sample against the wire's bounds: a few dozen numpy calls
on arrays of a few hundred, each costing more in its call than in its work; here one pass
each. Every value comes out bit for bit as the numpy expressions it replaces: the same
operations in the same order on IEEE doubles (no fast-math), sums in the order numpy's
`bincount` adds them, maxima (which no order changes) in any.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from powerd.allocator.kernel import jit_exact

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]


@jit_exact
def check_groups(
    mean_sum: FloatArray,
    closing_sum: FloatArray,
    overhead_w: FloatArray,
    mean_budget: FloatArray,
    budget: FloatArray,
    finite: BoolArray,
    ratio_budget: FloatArray,
    level: IntArray,
    tol_w: float,
    dt: float,
    over_run_s: FloatArray,
    over_levels: BoolArray,
    step_peak: FloatArray,
) -> tuple[float, float, float]:
    """Each group's measured draw (its GPUs' sum plus its overhead) against its budgets
    over a step of `dt`: its mean draw against their mean, its closing sample against them
    at the end. Per group, how long it has been over (`over_run_s`, 0 where it is not); per
    level, whether any group of it is over (`over_levels`, written whole) and its highest
    draw / `ratio_budget` (into `step_peak`, a max). Returns the longest run over (-inf: no
    group over), the highest excess (-inf: none) and the highest ratio."""
    over_levels[:] = False
    longest = -np.inf
    excess_max = -np.inf
    ratio_max = -np.inf
    for g in range(mean_sum.size):
        m, c = mean_sum[g] + overhead_w[g], closing_sum[g] + overhead_w[g]
        draw = m if m >= c else c
        if finite[g]:
            a, b = m - mean_budget[g], c - budget[g]
            excess = a if a >= b else b
        else:
            excess = -np.inf
        if excess > tol_w:
            run = over_run_s[g] + dt
            over_run_s[g] = run
            longest = max(longest, run)
            excess_max = max(excess_max, excess)
            over_levels[level[g]] = True
        else:
            over_run_s[g] = 0.0
        ratio = draw / ratio_budget[g]
        ratio_max = max(ratio_max, ratio)
        lv = level[g]
        step_peak[lv] = max(step_peak[lv], ratio)
    return longest, excess_max, ratio_max


@jit_exact
def add_work(cls: IntArray, tput: FloatArray, dt: float, work: FloatArray) -> None:
    """`work += np.bincount(cls, weights=tput, minlength=work.size) * dt`: each class's
    throughput summed in GPU order, times dt, added to its work."""
    total = np.zeros(work.size)
    for i in range(cls.size):
        total[cls[i]] += tput[i]
    for c in range(work.size):
        work[c] += total[c] * dt


@jit_exact
def add_below_floor(
    floored: BoolArray,
    caps: FloatArray,
    floor_w: FloatArray,
    demand: FloatArray,
    tol_w: float,
    cls: IntArray,
    dt: float,
    below_floor_s: FloatArray,
) -> None:
    """Each class's GPUs held below their floor over a step of `dt` (capped more than
    `tol_w` under it, and wanting more than `tol_w` over the cap), times dt, added to its
    `below_floor_s` (untouched where none is)."""
    held = np.zeros(below_floor_s.size, dtype=np.int64)
    any_held = False
    for i in range(cls.size):
        if floored[i] and caps[i] < floor_w[i] - tol_w and demand[i] > caps[i] + tol_w:
            held[cls[i]] += 1
            any_held = True
    if any_held:
        for c in range(below_floor_s.size):
            below_floor_s[c] += held[c] * dt


@jit_exact
def within(
    columns: tuple[FloatArray, ...],
    lo: FloatArray,
    hi: FloatArray,
    positive: BoolArray,
    lower: int,
    upper: int,
) -> bool:
    """Whether every value of every column is finite and within its bounds (`lo[k]`,
    `hi[k]`; above 0 too where `positive[k]`), and column `lower` nowhere above column
    `upper` (-1: no such pair). False at the first value that fails (NaN fails)."""
    for k in range(len(columns)):
        col = columns[k]
        a, b = lo[k], hi[k]
        if positive[k] and not a > 0.0:
            a = np.nextafter(0.0, 1.0)  # above 0: at least the least double above it
        ok = True
        for i in range(col.size):
            v = col[i]
            # Within the bounds and finite (inf - inf is NaN), without a branch per value.
            ok &= (a <= v) & (v <= b) & (v - v == 0.0)
        if not ok:
            return False
    if lower >= 0:
        mins, maxes = columns[lower], columns[upper]
        for i in range(mins.size):
            if mins[i] > maxes[i]:
                return False
    return True


@jit_exact
def apply_caps(
    sent_w: FloatArray,
    expected: int,
    position: IntArray,
    max_w: float,
    min_cap_w: FloatArray,
    max_cap_w: FloatArray,
    override_w: FloatArray,
    requested_cap_w: FloatArray,
    cap_w: FloatArray,
    out: FloatArray,
) -> bool:
    """Every cap a plan sends (`sent_w[k]`, NaN: none, for the model's GPU `position[k]`)
    clamped to the device's limits (as numpy's clip) and set (`requested_cap_w`), the limit
    it enforces (the lower of that and an out-of-band one) into `cap_w` and `out[k]`. False,
    with nothing set, where a cap is out of [0, max_w] or they are not `expected` many."""
    sent = 0
    for k in range(sent_w.size):
        w = sent_w[k]
        if not math.isnan(w):
            if not (w >= 0.0 and w <= max_w):
                return False
            sent += 1
    if sent != expected:
        return False
    for k in range(sent_w.size):
        w = sent_w[k]
        if math.isnan(w):
            continue
        i = position[k]
        lo, hi = min_cap_w[i], max_cap_w[i]
        target = w if w > lo else lo
        target = target if target < hi else hi
        requested_cap_w[i] = target
        limit = override_w[i]
        enforced = target if target <= limit else limit
        cap_w[i] = enforced
        out[k] = enforced
    return True


@jit_exact
def any_over(
    gpu_groups: IntArray,
    per_gpu: FloatArray,
    overhead_w: FloatArray,
    limit_w: FloatArray,
    tol_w: float,
) -> bool:
    """Whether any group's sum of `per_gpu` over its GPUs (each GPU's groups in
    `gpu_groups`, added in the order numpy's bincount of them adds) plus its overhead
    exceeds its limit by more than `tol_w`."""
    sums = np.zeros(overhead_w.size)
    for i in range(gpu_groups.shape[0]):
        w = per_gpu[i]
        for lv in range(gpu_groups.shape[1]):
            sums[gpu_groups[i, lv]] += w
    over = False
    for g in range(sums.size):
        over |= sums[g] + overhead_w[g] > limit_w[g] + tol_w
    return over
