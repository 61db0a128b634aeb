"""The mock GPU model's per-step arithmetic, compiled (powerd/backends/mock.py).

A simulated step is a few dozen numpy calls on a few hundred GPUs, each costing more in its
call than in its work; here each loop does them all in one pass. Every value comes out bit
for bit as the numpy expressions it replaces: the same operations in the same order, on
IEEE doubles (no fast-math), and no function whose result may differ by a last bit from
numpy's (`cos` stays numpy's: its callers pass it in). Imported on the model's first step
(numba loads in about half a second; a backend that never steps does not pay it).
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import NDArray

from powerd.allocator.kernel import jit_exact

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
UintArray = NDArray[np.uint64]
BoolArray = NDArray[np.bool_]


@jit_exact
def _uniform_one(key: np.uint64) -> float:
    """mock._uniform of one key: splitmix64's finaliser, its top 53 bits in [0, 1)."""
    x = (key ^ (key >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return float(x >> np.uint64(11)) * (1.0 / 2**53)


@jit_exact
def demand_now(
    t: float,
    demand: FloatArray,
    tr: IntArray,
    tr_cols: FloatArray,
    inf: IntArray,
    inf_cols: FloatArray,
    inf_seeds: UintArray,
    inf_cos: FloatArray,
) -> bool:
    """`SimulatedGpus._grid` at one time `t` for the training and inference GPUs (`tr`,
    `inf`), written into `demand` (every GPU's high level already). Their columns as rows:
    `tr_cols` phase, period, duty, high and low level; `inf_cols` high, low, phase, period
    (unused: `inf_cos` is each one's `cos(2π (t + phase) / period)`, numpy's), burst slot,
    burst probability and burst watts. False, with `demand` part written, where a burst
    slot is beyond ±9e18 (numpy's conversion to uint64 not checked there): the caller then
    takes numpy's way."""
    for j in range(tr.size):
        cycle = (t + tr_cols[0, j]) / tr_cols[1, j]
        on = cycle - np.floor(cycle) < tr_cols[2, j]
        demand[tr[j]] = tr_cols[3, j] if on else tr_cols[4, j]
    golden = np.uint64(0x9E3779B97F4A7C15)
    for j in range(inf.size):
        high, low = inf_cols[0, j], inf_cols[1, j]
        shifted = t + inf_cols[2, j]
        daily = low + (high - low) * (0.5 - 0.5 * inf_cos[j])
        slot_f = np.floor(shifted / inf_cols[4, j])
        if not (-9.0e18 < slot_f < 9.0e18):
            return False
        # numpy's conversion of a slot before the origin: its int64, wrapped (2**64 - k).
        slot = np.uint64(slot_f) if slot_f >= 0.0 else np.uint64(np.int64(slot_f))
        burst = _uniform_one(inf_seeds[j] + slot * golden) < inf_cols[5, j]
        demand[inf[j]] = daily + (inf_cols[6, j] if burst else 0.0)
    return True


@jit_exact
def step_held(
    cap: FloatArray,
    demand: FloatArray,
    x0: FloatArray,
    energy_j: FloatArray,
    temp_c: FloatArray,
    dt: float,
    tau: float,
    decay: float,
    ambient: float,
    temp_per_w: float,
    temp_tau: float,
    temp_decay: float,
    target: FloatArray,
    lagged: FloatArray,
    temp_out: FloatArray,
) -> None:
    """`SimulatedGpus.advance` where every GPU holds its target over the step: its draw's
    lag integrated (into `energy_j`, in place), its draw at the end (`lagged`), its
    temperature (`temp_out`), its target `min(cap, demand)` (`target`)."""
    lag_share = 1.0 - decay
    gap_share = tau - temp_tau
    for i in range(cap.size):
        c, d = cap[i], demand[i]
        tgt = c if c <= d else d
        gap = x0[i] - tgt
        energy_j[i] += tgt * dt + gap * tau * lag_share
        lagged[i] = tgt + gap * decay
        settled = ambient + temp_per_w * tgt
        passed = temp_per_w * gap * tau / gap_share
        own = (temp_c[i] - settled - passed) * temp_decay
        temp_out[i] = settled + passed * decay + own
        target[i] = tgt


@jit_exact
def reported_power(
    lagged: FloatArray,
    cap: FloatArray,
    seeds: UintArray,
    t_bits: np.uint64,
    spread_w: float,
    out: FloatArray,
) -> None:
    """`SimulatedGpus._update_reported_power` with noise: each draw times (1 + its noise
    hashed from (GPU, time), `spread_w` its scale), never above the higher of its cap and
    its lagged draw, never below 0."""
    for i in range(lagged.size):
        x = lagged[i]
        spread = spread_w * (_uniform_one(seeds[i] ^ t_bits) - 0.5)
        p = x * (1.0 + spread)
        c = cap[i]
        ceiling = c if c >= x else x
        p = p if p <= ceiling else ceiling
        out[i] = p if p >= 0.0 else 0.0


@jit_exact
def gauges(
    demand: FloatArray,
    high: FloatArray,
    lagged: FloatArray,
    idle_w: float,
    idle_mhz: float,
    max_mhz: float,
    util_pct: FloatArray,
    sm_clock_mhz: FloatArray,
) -> None:
    """`SimulatedGpus.util_pct` and `sm_clock_mhz` of every GPU: busy share from demand,
    clocks from it and the square root of the power cut."""
    span_mhz = max_mhz - idle_mhz
    for i in range(demand.size):
        d = demand[i]
        room = high[i] - idle_w
        busy = (d - idle_w) / (room if room >= 1.0 else 1.0)
        busy = busy if busy >= 0.0 else 0.0
        util = 100.0 * (busy if busy <= 1.0 else 1.0)
        util_pct[i] = util
        share = lagged[i] / (d if d >= 1.0 else 1.0)
        share = share if share >= 0.0 else 0.0
        share = np.sqrt(share if share <= 1.0 else 1.0)
        sm_clock_mhz[i] = idle_mhz + span_mhz * (util / 100.0) * share


@jit_exact
def _interp(x: float, xs: FloatArray, ys: FloatArray, c: int, n: int) -> float:
    """numpy's `interp(x, xs[c, :n], ys[c, :n])` of one value (xs strictly increasing):
    its branches and its formula, slope · (x − xs[j]) + ys[j], as numpy computes them."""
    first: float = ys[c, 0]
    last: float = ys[c, n - 1]
    if n == 1:
        return first  # (numpy's one-point case: NaN too)
    if math.isnan(x):
        return x
    if x < xs[c, 0]:
        return first
    if x >= xs[c, n - 1]:
        return last
    lo, hi = 0, n - 1  # xs[c, lo] <= x < xs[c, hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if xs[c, mid] <= x:
            lo = mid
        else:
            hi = mid
    x0: float = xs[c, lo]
    y0: float = ys[c, lo]
    if x0 == x:
        return y0
    x1: float = xs[c, lo + 1]
    y1: float = ys[c, lo + 1]
    slope = (y1 - y0) / (x1 - x0)
    out: float = slope * (x - x0) + y0
    if math.isnan(out):  # (numpy's retry from the other end)
        out = slope * (x - x1) + y1
        if math.isnan(out) and y0 == y1:
            out = y0
    return out


@jit_exact
def throughput(
    power_w: FloatArray,
    gpus: IntArray,
    profile: IntArray,
    idle: BoolArray,
    working: BoolArray,
    xs: FloatArray,
    ys: FloatArray,
    n_points: IntArray,
    first_slope: FloatArray,
    out: FloatArray,
) -> None:
    """Each GPU's throughput at its draw `power_w[k]` (GPU `gpus[k]`, curve `profile[k]`:
    row of the curves' points `xs`, `ys`, their count and first slope), as `Profile.value`
    computes it (below the first point, the first slope continued, never below 0); 0 where
    the GPU is idle or does no work."""
    for k in range(power_w.size):
        i = gpus[k]
        if idle[i] or not working[i]:
            out[k] = 0.0
            continue
        c = profile[k]
        x = power_w[k]
        x0, y0 = xs[c, 0], ys[c, 0]
        if x < x0:
            below = y0 - first_slope[c] * (x0 - x)
            out[k] = below if below >= 0.0 else 0.0
        else:
            out[k] = _interp(x, xs, ys, c, n_points[c])
