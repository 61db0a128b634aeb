"""A simulated GPU fleet with a physical power model, and a `GpuBackend` view on it.

`SimulatedGpus` holds every GPU's state in numpy arrays, so one model drives a node's mock
backend, an in-process demo of hundreds of GPUs and a simulator of thousands in virtual time.

Physics per GPU, integrated exactly over each step (the target is held over the step):
- draw follows target = min(enforced cap, demand(t)) through a first-order lag (tau_s);
- energy integrates that draw (the lag's closed-form integral, not a rectangle);
- temperature follows ambient + k·draw through a slower first-order lag;
- throughput = profile(draw); util and SM clock are derived from demand and cap.

Demand comes from workload patterns that are pure functions of time and seed, so the same
seed gives the same demand whatever the step sizes.
"""

from __future__ import annotations

import functools
import math
import os
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from types import ModuleType
from typing import Protocol, TypeVar

import numpy as np
from numpy.typing import NDArray

from powerd.backends.base import (
    BackendError,
    GpuBackend,
    GpuInfo,
    GpuLost,
    GpuReading,
    InvalidArgument,
    UnknownGpu,
)
from powerd.clock import Clock
from powerd.profile import Profile

FloatArray = NDArray[np.float64]
Selector = int | slice | NDArray[np.int64]
T = TypeVar("T")

IDLE_W = 70.0
MAX_SM_CLOCK_MHZ = 1980.0
IDLE_SM_CLOCK_MHZ = 345.0
SW_POWER_CAP = "sw_power_cap"
ALL = slice(None)
MIN_STEP_S = 1e-3  # the backend view advances the model at most this finely

_TRAINING_PROFILE = Profile.from_points(
    "llm-training", [(200, 0.35), (300, 0.58), (400, 0.76), (500, 0.89), (600, 0.97), (700, 1.0)]
)
_INFERENCE_PROFILE = Profile.from_points(
    "llm-inference", [(200, 0.55), (300, 0.78), (400, 0.92), (500, 0.98), (600, 1.0)]
)
_BATCH_PROFILE = Profile.from_points(
    "batch", [(200, 0.40), (300, 0.62), (400, 0.79), (500, 0.90), (600, 0.97), (700, 1.0)]
)


class Pattern(StrEnum):
    STEADY = "steady"
    TRAINING = "training"
    INFERENCE = "inference"
    IDLE = "idle"
    TRACE = "trace"


class DemandTrace(Protocol):
    """Recorded draw to replay as demand (powerd.sim.traces.GpuTrace)."""

    def draw_at(self, t_s: FloatArray | float) -> FloatArray: ...


_PATTERN_CODES = {p: i for i, p in enumerate(Pattern)}


@dataclass(frozen=True)
class Workload:
    """What a GPU runs: a demand pattern, the class name it reports and its profile.

    - steady: demand = high_w.
    - training: high_w for `duty` of every `period_s`, low_w for the rest; every GPU given the
      same Workload (same phase) swings in step, like the ranks of one job. Optionally a
      checkpoint every `ckpt_every_s` (from `ckpt_phase_s`) for `ckpt_s` at `ckpt_w`, doing
      no work, and `runs` (start_s, end_s) windows outside which the job's GPUs idle
      (IDLE_W, no work): a job starting or ending is a step of all its GPUs at once.
    - inference: a daily curve from low_w to high_w over `period_s`, plus bursts of burst_w
      in slots of burst_slot_s, each slot bursting with probability burst_prob (per GPU),
      plus surges of surge_w in slots of surge_slot_s with probability surge_prob, drawn
      once for every GPU given the same Workload (a service's replicas surge together).
    - idle: demand = IDLE_W, throughput 0.
    - trace: demand = a recorded GPU's draw at t + phase_s (looping); high_w is its peak.
    """

    pattern: Pattern
    name: str
    profile: Profile = field(repr=False, compare=False)
    high_w: float = 650.0
    low_w: float = 250.0
    period_s: float = 10.0
    duty: float = 0.7
    phase_s: float = 0.0
    burst_w: float = 0.0
    burst_prob: float = 0.0
    burst_slot_s: float = 2.0
    trace: DemandTrace | None = field(default=None, repr=False, compare=False)
    # training: checkpoints and the windows the job runs in (empty: always)
    ckpt_every_s: float = 0.0
    ckpt_s: float = 0.0
    ckpt_w: float = IDLE_W
    ckpt_phase_s: float = 0.0
    runs: tuple[tuple[float, float], ...] = ()
    # inference: correlated surges of every GPU of this Workload (a service)
    surge_w: float = 0.0
    surge_prob: float = 0.0
    surge_slot_s: float = 60.0
    key: int = 0  # seeds the surges: services with other keys surge independently

    @classmethod
    def steady(cls, level_w: float = 600.0, name: str = "batch") -> Workload:
        return cls(Pattern.STEADY, name, _BATCH_PROFILE, high_w=level_w, low_w=level_w)

    @classmethod
    def training(
        cls,
        *,
        high_w: float = 680.0,
        low_w: float = 250.0,
        period_s: float = 10.0,
        duty: float = 0.7,
        phase_s: float = 0.0,
        name: str = "training",
    ) -> Workload:
        return cls(
            Pattern.TRAINING,
            name,
            _TRAINING_PROFILE,
            high_w=high_w,
            low_w=low_w,
            period_s=period_s,
            duty=duty,
            phase_s=phase_s,
        )

    @classmethod
    def inference(
        cls,
        *,
        high_w: float = 550.0,
        low_w: float = 200.0,
        day_s: float = 86_400.0,
        phase_s: float = 0.0,
        burst_w: float = 150.0,
        burst_prob: float = 0.1,
        burst_slot_s: float = 2.0,
        name: str = "inference",
    ) -> Workload:
        return cls(
            Pattern.INFERENCE,
            name,
            _INFERENCE_PROFILE,
            high_w=high_w,
            low_w=low_w,
            period_s=day_s,
            phase_s=phase_s,
            burst_w=burst_w,
            burst_prob=burst_prob,
            burst_slot_s=burst_slot_s,
        )

    @classmethod
    def idle(cls, name: str = "idle") -> Workload:
        # high_w = low_w = IDLE_W: demand is that one level, like a steady workload.
        return cls(Pattern.IDLE, name, _BATCH_PROFILE, high_w=IDLE_W, low_w=IDLE_W)

    @classmethod
    def of(cls, pattern: Pattern | str) -> Workload:
        """The default workload of a pattern."""
        match Pattern(pattern):
            case Pattern.STEADY:
                return cls.steady()
            case Pattern.TRAINING:
                return cls.training()
            case Pattern.INFERENCE:
                return cls.inference()
            case Pattern.IDLE:
                return cls.idle()
            case Pattern.TRACE:
                raise ValueError("a trace workload replays a recording: give it one")


_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _mix64(x: NDArray[np.uint64]) -> NDArray[np.uint64]:
    """splitmix64 finaliser: a stateless hash, so randomness depends on time, not on steps."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _uniform(keys: NDArray[np.uint64]) -> FloatArray:
    """A uniform number in [0, 1) per key."""
    return np.asarray((_mix64(keys) >> np.uint64(11)) * (1.0 / 2**53), dtype=np.float64)


def _surging(w: Workload, times: FloatArray) -> NDArray[np.bool_]:
    """Whether a service surges at each time (one draw per slot for all its GPUs)."""
    slot = np.floor((times + w.phase_s) / w.surge_slot_s).astype(np.uint64)
    key = _mix64(np.array([w.key], dtype=np.uint64))
    return _uniform(key + slot * _GOLDEN) < w.surge_prob


def _periodic(out: list[float], t0: float, t1: float, period: float, origin: float) -> None:
    """Append the times origin + n·period strictly inside (t0, t1)."""
    n = math.floor((t0 - origin) / period)
    x = origin + n * period
    while x < t1:
        if x > t0:
            out.append(x)
        n += 1
        x = origin + n * period


def _edges(w: Workload, t0: float, t1: float) -> list[float]:
    """Every time in (t0, t1) at which a job's or service's demand may change, sorted."""
    out: list[float] = []
    if w.pattern is Pattern.TRAINING:
        if 0.0 < w.duty < 1.0 and w.low_w != w.high_w:
            _periodic(out, t0, t1, w.period_s, -w.phase_s)
            _periodic(out, t0, t1, w.period_s, w.duty * w.period_s - w.phase_s)
        if w.ckpt_every_s > 0.0:
            _periodic(out, t0, t1, w.ckpt_every_s, -w.ckpt_phase_s)
            _periodic(out, t0, t1, w.ckpt_every_s, w.ckpt_s - w.ckpt_phase_s)
        out.extend(x for run in w.runs for x in run if t0 < x < t1)
    else:
        if w.burst_prob > 0.0 and w.burst_w != 0.0:
            _periodic(out, t0, t1, w.burst_slot_s, -w.phase_s)
        if w.surge_prob > 0.0 and w.surge_w != 0.0:
            _periodic(out, t0, t1, w.surge_slot_s, -w.phase_s)
    return sorted(set(out))


_NO_EDGES = np.zeros(0)


def _edge_series(workloads: Sequence[Workload]) -> tuple[FloatArray, FloatArray, FloatArray]:
    """What `_edges` of each workload walks, for `_all_edges`: its periodic edges as
    (periods, origins), one pair per series, and its fixed ones (a job's runs)."""
    periods: list[float] = []
    origins: list[float] = []
    fixed: list[float] = []

    def series(period: float, origin: float) -> None:
        periods.append(period)
        origins.append(origin)

    for w in workloads:
        if w.pattern is Pattern.TRAINING:
            if 0.0 < w.duty < 1.0 and w.low_w != w.high_w:
                series(w.period_s, -w.phase_s)
                series(w.period_s, w.duty * w.period_s - w.phase_s)
            if w.ckpt_every_s > 0.0:
                series(w.ckpt_every_s, -w.ckpt_phase_s)
                series(w.ckpt_every_s, w.ckpt_s - w.ckpt_phase_s)
            fixed.extend(x for run in w.runs for x in run)
        else:
            if w.burst_prob > 0.0 and w.burst_w != 0.0:
                series(w.burst_slot_s, -w.phase_s)
            if w.surge_prob > 0.0 and w.surge_w != 0.0:
                series(w.surge_slot_s, -w.phase_s)
    return (
        np.array(periods, dtype=np.float64),
        np.array(origins, dtype=np.float64),
        np.array(fixed, dtype=np.float64),
    )


def _all_edges(
    periods: FloatArray, origins: FloatArray, fixed: FloatArray, t0: float, t1: float
) -> FloatArray:
    """`sorted({x for w in workloads for x in _edges(w, t0, t1)})` of the workloads
    `_edge_series` took apart, as an array: the same times, computed as `_periodic` does
    (origin + n·period from n = floor((t0 - origin) / period)), for every series at once."""
    out = fixed[(fixed > t0) & (fixed < t1)]
    if periods.size:
        first = np.floor((t0 - origins) / periods)
        # Enough steps for the shortest period to pass t1 from at or below t0.
        k = int(np.ceil((t1 - t0) / periods.min())) + 3
        x = origins[:, None] + (first[:, None] + np.arange(k, dtype=np.float64)) * periods[:, None]
        out = np.concatenate((out, x[(x > t0) & (x < t1)]))
    return np.unique(out)


def _next_edge(periods: FloatArray, origins: FloatArray, fixed: FloatArray, t: float) -> float:
    """The first time after `t` at which any of the series `_edge_series` took apart has an
    edge (the same float `_all_edges` would give), inf where none ever does."""
    later = fixed[fixed > t]
    best = float(later.min()) if later.size else math.inf
    if periods.size:
        first = np.floor((t - origins) / periods)
        x = origins[:, None] + (first[:, None] + np.arange(4, dtype=np.float64)) * periods[:, None]
        best = min(best, float(x.min(initial=math.inf, where=x > t)))
    return best


@functools.cache
def _kernel() -> ModuleType:
    """mock_kernel, imported on the first step that needs it (numba takes ~0.5 s to load)."""
    from powerd.backends import mock_kernel

    return mock_kernel


def _curves_of(
    profiles: Sequence[Profile],
) -> tuple[FloatArray, FloatArray, NDArray[np.int64], FloatArray] | None:
    """The profiles' points as rows for mock_kernel.throughput: powers, throughputs (each
    row padded with its last point), their counts, the first slopes. None where a profile's
    powers are not finite and strictly increasing (as `concave_envelope` makes them) or there
    is none: then `Profile.value` evaluates each."""
    if not profiles or not all(
        p.power_w.ndim == 1
        and p.power_w.size == p.throughput.size >= 1
        and np.isfinite(p.power_w).all()
        and (np.diff(p.power_w) > 0).all()
        for p in profiles
    ):
        return None
    width = max(p.power_w.size for p in profiles)
    xs = np.array([np.pad(p.power_w, (0, width - p.power_w.size), mode="edge") for p in profiles])
    ys = np.array(
        [np.pad(p.throughput, (0, width - p.throughput.size), mode="edge") for p in profiles]
    )
    counts = np.array([p.power_w.size for p in profiles], dtype=np.int64)
    slopes = np.array([p.first_slope_per_w for p in profiles], dtype=np.float64)
    return xs.astype(np.float64), ys.astype(np.float64), counts, slopes


def _intern(items: list[T], item: T) -> int:
    """Index of `item` in `items` by identity, appending it if new (profiles hold arrays)."""
    for k, existing in enumerate(items):
        if existing is item:
            return k
    items.append(item)
    return len(items) - 1


@dataclass(frozen=True)
class MockGpuSpec:
    """What kind of GPU a model simulates: its power limits, the lag of its draw behind a
    cap, its thermal response and its measurement noise (defaults: an H200-like part)."""

    min_cap_w: float = 200.0
    max_cap_w: float = 700.0
    default_cap_w: float = 700.0
    tau_s: float = 0.2  # draw follows min(cap, demand) with this first-order lag
    ambient_c: float = 30.0
    temp_per_w: float = 0.08  # settled temperature rise per watt drawn
    temp_tau_s: float = 30.0
    noise_frac: float = 0.005  # reported draw's noise, as a share of the draw (uniform)
    name: str = "Mock H200"

    def __post_init__(self) -> None:
        if not self.min_cap_w <= self.default_cap_w <= self.max_cap_w:
            raise ValueError("need min_cap_w <= default_cap_w <= max_cap_w")
        if self.tau_s <= 0 or self.temp_tau_s <= 0 or self.tau_s == self.temp_tau_s:
            raise ValueError("time constants must be positive, and tau_s != temp_tau_s")


DEFAULT_SPEC = MockGpuSpec()


class SimulatedGpus:
    """State of n simulated GPUs as arrays; `advance(dt_s)` integrates them exactly.

    Public arrays (index = GPU): power_w (reported draw, with noise), energy_j, cap_w
    (enforced limit), requested_cap_w, temp_c, demand_w; min_cap_w, max_cap_w,
    default_cap_w. Derived per GPU on request (all GPUs, one index, a slice or an index
    array): throughput, util_pct, sm_clock_mhz, power_capped. Faults are injected per GPU
    with `fail_set`, `lose`, `override` (an out-of-band lower limit), `tamper` (a limit set
    behind powerd's back) and `reset` (a GPU reset or driver reload: the default limit).
    """

    # `throughput()` of the whole fleet: (draw, working GPUs, the values) it was taken from.
    _throughput_kept: tuple[FloatArray, NDArray[np.bool_], FloatArray] | None = None
    _group_all = False  # `_group_gpus` is every GPU (`_reindex`)

    def __init__(
        self,
        n: int,
        workloads: Workload | Sequence[Workload] | None = None,
        *,
        spec: MockGpuSpec = DEFAULT_SPEC,
        seed: int = 0,
        start_s: float = 0.0,
        uuid_prefix: str = "GPU-mock",
        compiled: bool = False,
    ) -> None:
        if n < 0:
            raise ValueError("n must not be negative")
        # `compiled`: steps in mock_kernel's loops (the same values as numpy's), for the
        # simulator's model. Agents and the demo step a model in real time on their event
        # loop, where numba's first compile (seconds) would stall it; an agent needs no numba.
        self.n, self._compiled = n, compiled
        self.t = start_s
        self.spec = spec
        self.tau_s = spec.tau_s
        self.ambient_c = spec.ambient_c
        self.temp_per_w = spec.temp_per_w
        self.temp_tau_s = spec.temp_tau_s
        self.noise_frac = spec.noise_frac
        self.name = spec.name
        self.uuids = [f"{uuid_prefix}-{seed:x}-{i:06d}" for i in range(n)]
        self._seeds = _mix64(np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(n + 1))

        self.min_cap_w = np.full(n, spec.min_cap_w)
        self.max_cap_w = np.full(n, spec.max_cap_w)
        self.default_cap_w = np.full(n, spec.default_cap_w)
        self.requested_cap_w = np.full(n, spec.default_cap_w)
        self.override_w = np.full(n, np.inf)  # out-of-band limit; inf = none
        self.cap_w = self.requested_cap_w.copy()
        self.lost = np.zeros(n, dtype=bool)
        self.set_errors: dict[int, type[BackendError]] = {}

        self._pattern = np.zeros(n, dtype=np.int8)
        self._high = np.zeros(n)
        self._low = np.zeros(n)
        self._period = np.ones(n)
        self._duty = np.ones(n)
        self._phase = np.zeros(n)
        self._burst_w = np.zeros(n)
        self._burst_prob = np.zeros(n)
        self._burst_slot = np.ones(n)
        # Checkpoints: every (0: none), length, level, phase.
        self._ckpt_every, self._ckpt_s, self._ckpt_w, self._ckpt_phase = np.zeros((4, n))
        self._profile_idx = np.zeros(n, dtype=np.int32)
        self._profiles: list[Profile] = []
        self._workloads: list[Workload] = []
        self._workload_idx = np.zeros(n, dtype=np.int32)
        self._traced: list[tuple[NDArray[np.int64], DemandTrace | None]] = []
        self._groups: list[tuple[NDArray[np.int64], Workload]] = []
        self._run_groups: list[tuple[NDArray[np.int64], Workload]] = []
        self._surge_groups: list[tuple[NDArray[np.int64], Workload]] = []
        self._group_gpus = np.zeros(0, dtype=np.int64)
        self._by_profile: list[tuple[Profile, NDArray[np.int64]]] = []
        self._group_profiles: list[tuple[Profile, NDArray[np.int64]]] = []
        self.demand_w = np.zeros(n)
        self._working = np.ones(n, dtype=bool)
        self._none = np.zeros(0, dtype=np.int64)
        given = Workload.of(Pattern.TRAINING) if workloads is None else workloads
        if isinstance(given, Workload):
            self.set_workload(np.arange(n), given)
        else:
            if len(given) != n:
                raise ValueError(f"{len(given)} workloads for {n} GPUs")
            groups: dict[int, list[int]] = {}
            for i, w in enumerate(given):
                groups.setdefault(id(w), []).append(i)
            # Every group's values first, then the derived indices and demand once: a
            # fleet of one workload per GPU (recorded traces) is built in O(n), not O(n²).
            for members in groups.values():
                self._assign(np.asarray(members, dtype=np.int64), given[members[0]])
            self._reindex()

        self._lagged_w = np.minimum(self.cap_w, self.demand_w)
        self.power_w = self._lagged_w.copy()
        self.energy_j = np.zeros(n)
        self.temp_c = self.ambient_c + self.temp_per_w * self._lagged_w
        # Mean throughput per GPU over the last `advance` (at the start: the current one).
        self.step_throughput = self.throughput()

    # -- workloads -----------------------------------------------------------------------

    def set_workload(self, indices: Sequence[int] | NDArray[np.int64], workload: Workload) -> None:
        """Give these GPUs `workload` (they share its phase, so a job's GPUs swing together)."""
        self._assign(np.asarray(indices, dtype=np.int64), workload)
        self._reindex()

    def _assign(self, idx: NDArray[np.int64], workload: Workload) -> None:
        """The per-GPU values of `workload` for these GPUs (`_reindex` then follows)."""
        self._workload_idx[idx] = _intern(self._workloads, workload)
        self._profile_idx[idx] = _intern(self._profiles, workload.profile)
        self._pattern[idx] = _PATTERN_CODES[workload.pattern]
        self._high[idx] = workload.high_w
        self._low[idx] = workload.low_w
        self._period[idx] = workload.period_s
        self._duty[idx] = workload.duty
        self._phase[idx] = workload.phase_s
        self._burst_w[idx] = workload.burst_w
        self._burst_prob[idx] = workload.burst_prob
        self._burst_slot[idx] = workload.burst_slot_s
        self._ckpt_every[idx] = workload.ckpt_every_s
        self._ckpt_s[idx] = workload.ckpt_s
        self._ckpt_w[idx] = workload.ckpt_w
        self._ckpt_phase[idx] = workload.ckpt_phase_s

    def _reindex(self) -> None:
        """What follows from every GPU's workload: the patterns' GPUs, the groups that share
        demand edges, the traces' GPUs; and the demand now."""
        training = _PATTERN_CODES[Pattern.TRAINING]
        self._training_idx = np.flatnonzero(self._pattern == training)
        self._ckpt_idx = np.flatnonzero((self._pattern == training) & (self._ckpt_every > 0))
        self._inference_idx = np.flatnonzero(self._pattern == _PATTERN_CODES[Pattern.INFERENCE])
        # Each pattern's GPUs' values, gathered once per change of workloads (`_grid` reads
        # them at every step; they change only with a workload).
        tr, ck, inf = self._training_idx, self._ckpt_idx, self._inference_idx
        self._idle = self._pattern == _PATTERN_CODES[Pattern.IDLE]
        self._tr_cols = tuple(a[tr] for a in (self._phase, self._period, self._duty))
        self._tr_levels = (self._high[tr], self._low[tr])
        self._ck_cols = tuple(
            a[ck] for a in (self._ckpt_phase, self._ckpt_every, self._ckpt_s, self._ckpt_w)
        )
        self._inf_cols = tuple(
            a[inf] for a in (self._high, self._low, self._phase, self._period, self._burst_slot)
        )
        self._inf_burst = (self._seeds[inf], self._burst_prob[inf], self._burst_w[inf])
        # The same as rows, for the compiled demand at one time (`_patterns_at`).
        self._tr_rows = np.array([*self._tr_cols, *self._tr_levels]).reshape(5, tr.size)
        self._inf_rows = np.array(
            [*self._inf_cols, self._burst_prob[inf], self._burst_w[inf]]
        ).reshape(7, inf.size)
        self._by_profile = [
            (p, np.flatnonzero(self._profile_idx == k)) for k, p in enumerate(self._profiles)
        ]
        self._by_profile = [(p, gpus) for p, gpus in self._by_profile if gpus.size]
        # Training jobs and inference services: GPUs that share one Workload share its
        # demand's edges (a job's phases, a service's surges), integrated piece by piece.
        grouped: dict[int, list[int]] = {}
        for code in (_PATTERN_CODES[Pattern.TRAINING], _PATTERN_CODES[Pattern.INFERENCE]):
            for i in np.flatnonzero(self._pattern == code).tolist():
                grouped.setdefault(int(self._workload_idx[i]), []).append(i)
        self._groups = [
            (np.array(gpus, dtype=np.int64), self._workloads[w]) for w, gpus in grouped.items()
        ]
        self._run_groups = [(g, w) for g, w in self._groups if w.runs]
        self._edge_series = _edge_series([w for _, w in self._groups])
        # (t, e): no edge in (t, e) (`_edges_within`); none known yet.
        self._no_edge = (math.inf, -math.inf)
        self._surge_groups = [
            (g, w) for g, w in self._groups if w.surge_prob > 0.0 and w.surge_w != 0.0
        ]
        # Steady, idle, training and inference GPUs alone, no checkpoint, run or surge:
        # demand at one time is `_patterns_at` (`demand_and_working_at`).
        self._patterned_only = not (self._ckpt_idx.size or self._run_groups or self._surge_groups)
        self._group_gpus = np.sort(np.concatenate([g for g, _ in self._groups] or [self._none]))
        # Every GPU a job's or a service's: `_group_gpus` is 0..n-1 (each GPU is in one group),
        # so a per-GPU array in its order is the array itself.
        self._group_all = self._group_gpus.size == self.n
        # Each profile's columns among the jobs' and services' GPUs.
        group_profile = self._profile_idx[self._group_gpus]
        self._group_profiles = [
            (p, np.flatnonzero(group_profile == k))
            for k, p in enumerate(self._profiles)
            if (group_profile == k).any()
        ]
        # The profiles' points as rows, for the compiled throughput (`_curves_of`); per GPU
        # and per job's or service's GPU, its row.
        self._curves = _curves_of(self._profiles)
        self._profile_of = self._profile_idx.astype(np.int64)
        self._group_profile_of = group_profile.astype(np.int64)
        self._all_gpus = np.arange(self.n, dtype=np.int64)
        # Traces: the GPUs that replay each recorded one, each at its own phase (GPUs whose
        # workloads differ only by phase replay one trace in one call).
        traced = np.flatnonzero(self._pattern == _PATTERN_CODES[Pattern.TRACE])
        by_trace: dict[int, tuple[DemandTrace | None, list[int]]] = {}
        workloads = self._workloads
        for i, w in zip(traced.tolist(), self._workload_idx[traced].tolist(), strict=True):
            trace = workloads[w].trace
            by_trace.setdefault(id(trace), (trace, []))[1].append(i)
        self._traced = [
            (np.array(gpus, dtype=np.int64), trace) for trace, gpus in by_trace.values()
        ]
        self._refresh_demand()

    def workload(self, i: int) -> Workload:
        return self._workloads[int(self._workload_idx[i])]

    def demand_at(self, t: float) -> FloatArray:
        """Every GPU's demand in watts at time t (a pure function of t and the seed)."""
        return self.demand_and_working_at(t)[0]

    def demand_and_working_at(self, t: float) -> tuple[FloatArray, NDArray[np.bool_]]:
        """Demand at t, and whether each GPU does work at t: not while its job checkpoints
        or is outside its runs (idle-pattern GPUs are told apart by their pattern). What
        samples demand to account work (a baseline) counts none where this is False."""
        demand = self._high.copy()
        if self._patterned_only and self._compiled and self._patterns_at(float(t), demand):
            # `_grid` at one time without checkpoints, runs or surges, in one pass.
            working = np.ones(self.n, dtype=bool)
        else:
            grid, works = self._grid(np.array([t], dtype=np.float64))
            demand, working = grid[0], works[0]
        for gpus, trace in self._traced:
            if trace is not None:
                demand[gpus] = trace.draw_at(t + self._phase[gpus])
        return demand, working

    def _grid(self, times: FloatArray) -> tuple[FloatArray, NDArray[np.bool_]]:
        """Every GPU's demand (traces aside) at each time, and whether it works: (times ×
        GPUs) arrays, from the same formulas at one time or many."""
        k = times.size
        at = times[:, None]
        demand = np.repeat(self._high[None, :], k, axis=0)  # steady, idle: one level
        working = np.ones((k, self.n), dtype=bool)
        # At one time (every step's demand), the training and inference GPUs' formulas in
        # one compiled pass (the same values); numpy's below where it declines.
        compiled = k == 1 and self._compiled and self._patterns_at(float(times[0]), demand[0])
        tr = self._training_idx
        if tr.size and not compiled:
            phase, period, duty = self._tr_cols
            cycle = (at + phase) / period
            on = cycle - np.floor(cycle) < duty
            demand[:, tr] = np.where(on, *self._tr_levels)
        ck = self._ckpt_idx
        if ck.size:
            ck_phase, every, ck_s, ck_w = self._ck_cols
            saving = np.mod(at + ck_phase, every) < ck_s
            demand[:, ck] = np.where(saving, ck_w, demand[:, ck])
            working[:, ck] = ~saving
        for gpus, w in self._run_groups:
            running = np.zeros(k, dtype=bool)
            for start, end in w.runs:
                running |= (times >= start) & (times < end)
            stopped = np.ix_(~running, gpus)
            demand[stopped] = IDLE_W
            working[stopped] = False
        inf = self._inference_idx
        if inf.size and not compiled:
            high, low, inf_phase, inf_period, burst_slot = self._inf_cols
            seeds, burst_prob, burst_w = self._inf_burst
            shifted = at + inf_phase
            daily = low + (high - low) * (0.5 - 0.5 * np.cos(2 * np.pi * shifted / inf_period))
            slot = np.floor(shifted / burst_slot).astype(np.uint64)
            burst = _uniform(seeds + slot * _GOLDEN) < burst_prob
            demand[:, inf] = daily + np.where(burst, burst_w, 0.0)
        for gpus, w in self._surge_groups:
            demand[np.ix_(_surging(w, times), gpus)] += w.surge_w
        return demand, working

    def _patterns_at(self, t: float, demand: FloatArray) -> bool:
        """`_grid`'s training and inference GPUs' demand at `t`, written into `demand`
        (mock_kernel.demand_now, the same values); False where it declines (then numpy's)."""
        inf_phase, inf_period = self._inf_cols[2:4]
        # numpy's cos, as `_grid` takes it: of 2π · (t + phase) / period.
        cos = np.add(t, inf_phase)
        np.multiply(2 * np.pi, cos, out=cos)
        np.divide(cos, inf_period, out=cos)
        np.cos(cos, out=cos)
        return bool(
            _kernel().demand_now(
                t, demand, self._training_idx, self._tr_rows, self._inference_idx,
                self._inf_rows, self._inf_burst[0], cos,
            )
        )  # fmt: skip

    def _refresh_demand(self) -> None:
        self.demand_w, self._working = self.demand_and_working_at(self.t)

    # -- time ----------------------------------------------------------------------------

    def advance(self, dt_s: float) -> None:
        """Integrate every GPU over dt_s with the caps in force (held over the step).

        Steady, idle and traced GPUs hold their demand at the start of the step. Training
        jobs and inference services are integrated exactly however often their demand
        changes within the step: the step is cut at every change of any of them (a phase
        edge, a checkpoint, a job's start or end, a burst or surge slot), each piece at its
        level (the daily curve at the piece's midpoint); a step without a change holds the
        demand at its start. Energy is the lag's exact integral over the pieces, their
        work the profile at each piece's draw times its length (the lag, 0.2 s, left out);
        `step_throughput` is the step's mean throughput per GPU.
        """
        if dt_s <= 0:
            return
        t0, t1 = self.t, self.t + dt_s
        x0 = self._lagged_w
        decay = np.exp(-dt_s / self.tau_s)
        g = self._group_gpus
        edges = self._edges_within(t0, t1)
        if not edges.size and self._compiled:
            # Every GPU holds its target over the step: the formulas below, compiled
            # (mock_kernel.step_held, the same values).
            target = np.empty(self.n)
            lagged = np.empty(self.n)
            temp = np.empty(self.n)
            _kernel().step_held(
                self.cap_w, self.demand_w, x0, self.energy_j, self.temp_c, dt_s, self.tau_s,
                decay, self.ambient_c, self.temp_per_w, self.temp_tau_s,
                np.exp(-dt_s / self.temp_tau_s), target, lagged, temp,
            )  # fmt: skip
            self._lagged_w, self.temp_c = lagged, temp
            pieces = None
            if g.size:
                pieces = self._group_throughput(target if self._group_all else target[g])
            self._end_step(dt_s, pieces)
            return
        target = np.minimum(self.cap_w, self.demand_w)
        gap = x0 - target
        # Closed-form integral of target + gap·exp(-t/tau) over [0, dt].
        energy = target * dt_s + gap * self.tau_s * (1.0 - decay)
        lagged = target + gap * decay
        # Per GPU, over the step (for the temperature): `target`, but where a job's or
        # service's demand changes within the step (then a copy, written below).
        mean_target = target
        pieces = None
        if edges.size:
            # Every job and service at once, cut at every edge of any of them.
            bounds = np.concatenate(([t0], edges, [t1]))
            lo, hi = bounds[:-1], bounds[1:]
            length = hi - lo
            grid, works = self._grid(0.5 * (lo + hi))
            level = np.minimum(self.cap_w[g][None, :], grid[:, g])
            integral = length @ level
            # The lag's state at the end: its start decayed, plus each piece's level
            # weighted by how much of it the lag still holds at the end.
            weight = np.exp(-(t1 - hi) / self.tau_s) - np.exp(-(t1 - lo) / self.tau_s)
            end = x0[g] * decay + weight @ level
            energy[g] = integral - self.tau_s * (end - x0[g])
            lagged[g] = end
            mean_target = target.copy()
            mean_target[g] = integral / dt_s
            tput = np.zeros(level.shape)
            for profile, cols in self._group_profiles:
                tput[:, cols] = profile.value(level[:, cols])
            pieces = length @ np.where(works[:, g], tput, 0.0) / dt_s
        elif g.size:
            # Jobs and services work at their level all step (lag-free, as over pieces).
            pieces = self._group_throughput(target if self._group_all else target[g])
        self.energy_j += energy
        self._lagged_w = lagged
        # Temperature: a slower lag driven by that draw. Its exact solution is the settled
        # value, plus the draw's decaying gap passed through, plus its own decaying start
        # (a job or service whose demand changed within the step: from its mean level).
        gap = x0 - mean_target
        settled = self.ambient_c + self.temp_per_w * mean_target
        passed = self.temp_per_w * gap * self.tau_s / (self.tau_s - self.temp_tau_s)
        own = (self.temp_c - settled - passed) * np.exp(-dt_s / self.temp_tau_s)
        self.temp_c = settled + passed * decay + own
        self._end_step(dt_s, pieces)

    def _end_step(self, dt_s: float, pieces: FloatArray | None) -> None:
        """The step's end: the clock, the demand and reported draw now, and the step's
        throughput: the jobs' and services' `pieces` (each at its level all step, lag-free,
        as over pieces; None: no such GPU), the others at their draw at the step's end, as
        they always have."""
        g = self._group_gpus
        self.t += dt_s
        self._refresh_demand()
        self._update_reported_power()
        if pieces is not None and self._group_all:
            # Every GPU a job's or a service's (`g` is all of them, in order): the step's
            # throughput is theirs alone; the fleet's at the step's end (`throughput`, what
            # the agents report) is computed when read.
            self.step_throughput = pieces
        else:
            self.step_throughput = self.throughput()
            if pieces is not None:
                self.step_throughput[g] = pieces

    def _group_throughput(self, power_w: FloatArray) -> FloatArray:
        """`_throughput_at(·, ALL)[_group_gpus]` from the jobs' and services' GPUs' draw
        alone (`power_w`, in `_group_gpus` order): the other GPUs' profiles not evaluated."""
        g = self._group_gpus
        if self._curves is not None and self._compiled:
            out = np.empty(g.size)
            _kernel().throughput(
                power_w, g, self._group_profile_of, self._idle, self._working, *self._curves, out
            )
            return out
        out = np.zeros(g.size)
        for profile, cols in self._group_profiles:
            out[cols] = profile.value(power_w[cols])
        if self._group_all:
            out[self._idle | ~self._working] = 0.0
        else:
            out[self._idle[g] | ~self._working[g]] = 0.0
        return out

    def _edges_within(self, t0: float, t1: float) -> FloatArray:
        """`_all_edges` of the jobs and services in (t0, t1): none, without looking, while
        the step ends before the first edge after the last step that looked (most steps)."""
        after, until = self._no_edge
        if after <= t0 and t1 <= until:
            return _NO_EDGES
        edges = _all_edges(*self._edge_series, t0, t1)
        self._no_edge = (t1, _next_edge(*self._edge_series, t1))
        return edges

    def advance_to(self, t: float) -> None:
        self.advance(t - self.t)

    def _update_reported_power(self) -> None:
        p = self._lagged_w
        if self.noise_frac > 0 and p.flags.c_contiguous and self._compiled:
            # The lines below, compiled (mock_kernel.reported_power, the same values).
            out = np.empty(p.size)
            t_bits = np.float64(self.t).view(np.uint64)
            spread_w = self.noise_frac * np.sqrt(12.0)
            _kernel().reported_power(p, self.cap_w, self._seeds, t_bits, spread_w, out)
            self.power_w = out
            return
        if self.noise_frac > 0:
            # Uniform noise with standard deviation noise_frac, hashed from (GPU, time) so it
            # is the same for the same seed whatever the step sizes; cheaper than an RNG draw.
            t_bits = np.float64(self.t).view(np.uint64)
            spread = self.noise_frac * np.sqrt(12.0) * (_uniform(self._seeds ^ t_bits) - 0.5)
            p = p * (1.0 + spread)
            # Noise never shows a GPU above its cap unless the lag itself is still above it.
            p = np.minimum(p, np.maximum(self.cap_w, self._lagged_w))
        self.power_w = np.maximum(p, 0.0)

    # -- derived quantities (computed on read, so stepping stays cheap) -------------------

    def throughput(self, sel: Selector = ALL) -> FloatArray:
        """Application throughput relative to the workload's best, from each GPU's draw."""
        if not (isinstance(sel, slice) and sel == ALL):
            return self._throughput_at(self._lagged_w, sel)
        # The whole fleet's, kept while the draw and the working GPUs are the same arrays
        # (both are replaced, never written in place: a step, a workload change): `advance`
        # asks for it, then the agents' sample at the same instant.
        kept = self._throughput_kept
        if kept is None or kept[0] is not self._lagged_w or kept[1] is not self._working:
            kept = self._throughput_kept = (
                self._lagged_w,
                self._working,
                self._throughput_at(self._lagged_w, ALL),
            )
        return kept[2].copy()

    def uncapped_throughput(self, sel: Selector = ALL) -> FloatArray:
        """The throughput each GPU would deliver at its demand, never capped (what a GPU
        provisioned at full TDP delivers)."""
        return self._throughput_at(self.demand_w, sel)

    def _throughput_at(self, power_w: FloatArray, sel: Selector) -> FloatArray:
        power = np.atleast_1d(power_w[sel])
        whole = isinstance(sel, slice) and sel == ALL
        if whole and self._curves is not None and power.ndim == 1 and self._compiled:
            out = np.empty(self.n)
            _kernel().throughput(
                power, self._all_gpus, self._profile_of, self._idle, self._working,
                *self._curves, out,
            )  # fmt: skip
            return out
        out = np.zeros(power.shape)
        if whole:
            for profile, gpus in self._by_profile:
                out[gpus] = profile.value(power[gpus])
            out[self._idle] = 0.0
        else:
            profile_idx = np.atleast_1d(self._profile_idx[sel])
            for k in np.unique(profile_idx):
                mask = profile_idx == k
                out[mask] = self._profiles[int(k)].value(power[mask])
            out[np.atleast_1d(self._pattern[sel]) == _PATTERN_CODES[Pattern.IDLE]] = 0.0
        out[~np.atleast_1d(self._working[sel])] = 0.0
        return out

    def util_pct(self, sel: Selector = ALL) -> FloatArray:
        """Busy share: capping slows a busy GPU down but leaves it busy."""
        high = np.atleast_1d(self._high[sel])
        busy = (np.atleast_1d(self.demand_w[sel]) - IDLE_W) / np.maximum(high - IDLE_W, 1.0)
        return np.asarray(100.0 * busy.clip(0.0, 1.0), dtype=np.float64)

    def sm_clock_mhz(
        self, sel: Selector = ALL, *, util_pct: FloatArray | None = None
    ) -> FloatArray:
        """Clocks rise with load and drop roughly with the square root of the power cut
        (`util_pct`: these GPUs' `util_pct`, where the caller has it already)."""
        demand = np.maximum(np.atleast_1d(self.demand_w[sel]), 1.0)
        share = np.sqrt((np.atleast_1d(self._lagged_w[sel]) / demand).clip(0.0, 1.0))
        busy = (self.util_pct(sel) if util_pct is None else util_pct) / 100.0
        clock = IDLE_SM_CLOCK_MHZ + (MAX_SM_CLOCK_MHZ - IDLE_SM_CLOCK_MHZ) * busy * share
        return np.asarray(clock, dtype=np.float64)

    def util_and_clock(self) -> tuple[FloatArray, FloatArray]:
        """`util_pct()` and `sm_clock_mhz(util_pct=...)` of every GPU, in one compiled pass
        (mock_kernel.gauges, the same values)."""
        if not self._compiled:
            util = self.util_pct()
            return util, self.sm_clock_mhz(util_pct=util)
        util, clock = np.empty(self.n), np.empty(self.n)
        _kernel().gauges(
            self.demand_w, self._high, self._lagged_w, IDLE_W, IDLE_SM_CLOCK_MHZ,
            MAX_SM_CLOCK_MHZ, util, clock,
        )  # fmt: skip
        return util, clock

    def power_capped(self, sel: Selector = ALL) -> NDArray[np.bool_]:
        """Demand above the enforced cap: the GPU is held back (NVML's sw_power_cap)."""
        return np.atleast_1d(self.demand_w[sel] > self.cap_w[sel])

    # -- caps and faults -----------------------------------------------------------------

    def set_cap(self, i: int, watts: float) -> float:
        """Request a limit (within the device's limits); returns the enforced one."""
        self.requested_cap_w[i] = watts
        self.cap_w[i] = min(watts, self.override_w[i])
        return float(self.cap_w[i])

    def fail_set(self, i: int, error: type[BackendError] | None = BackendError) -> None:
        """Make setting GPU i's limit raise `error` (None: succeed again)."""
        if error is None:
            self.set_errors.pop(i, None)
        else:
            self.set_errors[i] = error

    def lose(self, i: int, lost: bool = True) -> None:
        """GPU i falls off the bus: every backend call on it raises GpuLost."""
        self.lost[i] = lost

    def override(self, i: int, watts: float | None) -> None:
        """An out-of-band tool imposes a limit; the enforced limit is the lower of the two."""
        self.override_w[i] = np.inf if watts is None else watts
        self.cap_w[i] = min(self.requested_cap_w[i], self.override_w[i])

    def tamper(self, i: int, watts: float) -> None:
        """Someone sets GPU i's limit behind powerd's back (`nvidia-smi -pl`, another
        daemon): the same limit powerd sets, so up or down, until the next set."""
        if not self.min_cap_w[i] <= watts <= self.max_cap_w[i]:
            raise ValueError(f"{watts:g} W is outside GPU {i}'s limits")
        self.requested_cap_w[i] = watts
        self.cap_w[i] = min(watts, self.override_w[i])

    def reset(self, i: int) -> None:
        """GPU i is reset, or its driver reloaded: NVML limits do not survive either, so the
        limit is the default again; the energy counter counts from the reload. An
        out-of-band limit (a BMC's) is the board's and stays. With `lose` around it, the
        GPU is unreachable meanwhile, as while a driver reloads."""
        self.requested_cap_w[i] = self.default_cap_w[i]
        self.cap_w[i] = min(self.default_cap_w[i], self.override_w[i])
        self.energy_j[i] = 0.0


class CapJournal:
    """An append-only file of every change of a cap in force, for an outside watcher.

    One line per change: `<monotonic s> <event> <uuid> <enforced W>`, where the event is
    `start` (the cap in force when the backend opens), `set`, or `out_of_band` (a limit
    another holds came or went: `MockBackend.hold_out_of_band`). Each line is one `write` to
    a file opened with O_APPEND, so lines from a process killed at any moment are whole, and
    several processes may share a file. `time.monotonic()` is system-wide on Linux, so a
    watcher in another process can merge journals on one time line.

    The file is also the device's memory: a backend opened on a journal starts each GPU at
    its last journalled cap set (not one another held: that is the other's to hold again),
    as a real GPU keeps its limit when the agent process restarts.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def record(self, t_s: float, event: str, uuid: str, watts: float) -> None:
        os.write(self._fd, f"{t_s:.6f} {event} {uuid} {watts:.3f}\n".encode())

    def close(self) -> None:
        os.close(self._fd)

    @staticmethod
    def read(path: Path) -> list[tuple[float, str, str, float]]:
        """Every whole line of a journal, in file order: (t_s, event, uuid, watts)."""
        out = []
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                out.append((float(parts[0]), parts[1], parts[2], float(parts[3])))
        return out


class MockBackend(GpuBackend):
    """One node's GPUs: a slice of a fleet model, advanced lazily to the clock when used.

    With a `journal`, the GPUs start at their last journalled caps and every change of a
    cap in force is journalled (see `CapJournal`).
    """

    def __init__(
        self,
        fleet: SimulatedGpus,
        clock: Clock,
        start: int = 0,
        count: int | None = None,
        journal: Path | None = None,
    ) -> None:
        stop = fleet.n if count is None else start + count
        if not 0 <= start <= stop <= fleet.n:
            raise ValueError(f"GPUs {start}..{stop} are not all in a fleet of {fleet.n}")
        self.fleet = fleet
        self.clock = clock
        self._index = {fleet.uuids[i]: i for i in range(start, stop)}
        self._start = start
        # Every successful set, in order (uuid, watts): lets tests see the order of changes.
        self.set_log: deque[tuple[str, float]] = deque(maxlen=10_000)
        self.journal: CapJournal | None = None
        if journal is not None:
            self._open_journal(journal)

    def _open_journal(self, path: Path) -> None:
        lines = CapJournal.read(path) if path.exists() else []
        last = {u: w for _, event, u, w in lines if event != "out_of_band"}
        self.journal = CapJournal(path)
        now = self.clock.monotonic()
        for uuid, i in self._index.items():
            if uuid in last:
                self.fleet.set_cap(i, last[uuid])
            self.journal.record(now, "start", uuid, float(self.fleet.cap_w[i]))

    def gpus(self) -> list[GpuInfo]:
        f = self.fleet
        return [
            GpuInfo(
                uuid=uuid,
                index=i - self._start,
                name=f.name,
                min_cap_w=float(f.min_cap_w[i]),
                max_cap_w=float(f.max_cap_w[i]),
                default_cap_w=float(f.default_cap_w[i]),
            )
            for uuid, i in self._index.items()
            if not f.lost[i]
        ]

    def _locate(self, uuid: str) -> int:
        i = self._index.get(uuid)
        if i is None:
            raise UnknownGpu(f"no GPU {uuid} on this node", uuid)
        if self.fleet.lost[i]:
            raise GpuLost(f"GPU {uuid} is lost", uuid)
        now = self.clock.monotonic()
        # Calls in one burst (a node's sample, a command) share one step of the model.
        if now - self.fleet.t >= MIN_STEP_S:
            self.fleet.advance_to(now)
        return i

    def read(self, uuid: str) -> GpuReading:
        i = self._locate(uuid)
        f = self.fleet
        workload = f.workload(i)
        return GpuReading(
            uuid=uuid,
            index=i - self._start,
            power_w=float(f.power_w[i]),
            energy_j=float(f.energy_j[i]),
            cap_w=float(f.cap_w[i]),
            temp_c=float(f.temp_c[i]),
            util_pct=float(f.util_pct(i)[0]),
            sm_clock_mhz=float(f.sm_clock_mhz(i)[0]),
            throttle=[SW_POWER_CAP] if f.power_capped(i)[0] else [],
            perf=float(f.throughput(i)[0]),
            workload=workload.name,
            requested_w=float(f.requested_cap_w[i]),
        )

    def enforced_limit_w(self, uuid: str) -> float:
        return float(self.fleet.cap_w[self._locate(uuid)])

    def set_power_limit_w(self, uuid: str, watts: float) -> float:
        i = self._locate(uuid)
        f = self.fleet
        error = f.set_errors.get(i)
        if error is not None:
            raise error(f"setting the limit of {uuid} failed (injected)", uuid)
        if not f.min_cap_w[i] <= watts <= f.max_cap_w[i]:
            raise InvalidArgument(
                f"{watts:g} W is outside [{f.min_cap_w[i]:g}, {f.max_cap_w[i]:g}] W", uuid
            )
        before = float(f.cap_w[i])
        enforced = f.set_cap(i, watts)
        self.set_log.append((uuid, watts))
        if self.journal is not None and enforced != before:
            self.journal.record(self.clock.monotonic(), "set", uuid, enforced)
        return enforced

    def hold_out_of_band(self, uuid: str, watts: float | None) -> None:
        """A limit another holds on GPU `uuid` (a BMC's out-of-band cap: the lower of it and
        the one set is enforced), or none (None: back at the one set at once, with no set
        and no sample in between). Journalled where the cap in force changes."""
        i = self._locate(uuid)
        f = self.fleet
        before = float(f.cap_w[i])
        f.override(i, watts)
        after = float(f.cap_w[i])
        if self.journal is not None and after != before:
            self.journal.record(self.clock.monotonic(), "out_of_band", uuid, after)

    def close(self) -> None:
        if self.journal is not None:
            self.journal.close()
            self.journal = None
