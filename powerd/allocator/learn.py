"""Profiles learned online: each class's throughput curve fitted from what its GPUs report.

Where telemetry carries `perf` (a workload's own progress rate), every GPU sample is a point
(draw, perf) of its workload's curve: the allocator's model is U(p) = profile(min(p, demand)),
so a GPU drawing `d` delivers profile(d) whatever held it there, its cap or its load. Real
samples sit *below* the curve more often than on it (a server with few requests makes few
tokens at any power), so a fit takes a high quantile of perf in each power bin and keeps the
upper concave envelope of those points (concave and non-decreasing by construction).

Learning observes only: it never moves a cap to learn. The points come from the natural
variation of load (daily curves, training steps, bursts) under the caps the allocator and the
safety planner chose anyway, so every cap stays within [floor, ceiling] and every budget.

Rules (docs/allocator.md, "Profiles learned online"):
- samples per key (a class today; any string, e.g. a job, tomorrow) in a ring buffer of
  `buffer`, taken at buffer × tick_s / window_s per key per tick (so the buffer spans the
  window; at most `per_tick`), dropped after `window_s`;
- a refit every `refit_ticks` ticks, one key a tick, vectorised over its buffer;
- a fit steers once it has `min_samples` samples, `min_bins` bins of `bin_w` watts with
  enough samples each, spans `min_span_w` watts and its error (RMS gap between the bins'
  points and the envelope, as a share of the peak) is at most `max_error`; otherwise the
  policy's profile steers, and the state says why. A curve in use is kept while newer
  samples lack the spread (bins, span) to refit, dropped when a refit with enough data
  misses the error bound or too few samples are left;
- units: perf is in the workload's own units (tokens/s); the learned curve is scaled so its
  peak (extrapolated where not observed) equals the policy profile's peak: the policy still
  says what a GPU at full speed is worth, the measurements say how power buys that speed;
- the curve peaks at the first bin within PEAK_TOLERANCE of the highest (noise on a flat
  top must not move the peak along it);
- past the highest power observed the curve continues its last slope up to the device
  maximum (a curve observed flat stays flat): a curve cut at the last power seen would
  never be given more power, so it could never learn more.

Pure: numpy in, profiles out, no I/O and no clock (times are passed in).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from powerd.policy import Learn, Policy
from powerd.profile import Profile, concave_envelope

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

# A bin counts toward the fit only with this many samples (one sample is one moment).
MIN_PER_BIN = 3
# The wire's bound on perf; anything above is not a rate.
MAX_PERF = 1e12
# Samples are taken in batches of this many per key (fewer ticks touch the fleet's arrays).
SAMPLE_BATCH = 16
# Gains under this share of the peak are noise: the curve peaks at the first power within
# it of the highest point (else noise on a flat top moves the peak anywhere along it).
PEAK_TOLERANCE = 0.01


@dataclass(frozen=True)
class LearnState:
    """One key's learning as the API and metrics show it."""

    key: str
    enabled: bool
    samples: int  # in the buffer, within the window
    bins: int
    span_w: float
    fit_error: float | None  # None: not fitted
    in_use: bool
    reason: str  # why it is (not) in use
    points: tuple[tuple[float, float], ...]  # the learned curve, policy units
    fitted_at: float | None

    def to_json(self) -> dict[str, object]:
        return {
            "key": self.key,
            "enabled": self.enabled,
            "samples": self.samples,
            "bins": self.bins,
            "span_w": self.span_w,
            "fit_error": self.fit_error,
            "in_use": self.in_use,
            "reason": self.reason,
            "points": [list(p) for p in self.points],
            "fitted_at": self.fitted_at,
        }


@dataclass(frozen=True)
class Fit:
    """A fit of one key's samples: its curve (policy units) and how good it is."""

    profile: Profile | None
    samples: int
    bins: int
    span_w: float
    error: float | None
    ok: bool
    reason: str


def bin_points(
    power_w: FloatArray,
    perf: FloatArray,
    bin_w: float,
    quantile: float,
    source: IntArray | None = None,
) -> tuple[FloatArray, FloatArray, int]:
    """Per power bin with MIN_PER_BIN samples: mean power, the perf quantile; and the count
    of such bins. Vectorised: one sort, no loop over bins.

    `source`: who reported each sample (its node). Given, a bin counts only with samples
    of two sources, and its point is no higher than the best sample of the source second
    best there: one node that lies can neither make bins of its own nor lift one above
    what another node saw (it cannot bend the curve the other nodes' GPUs steer by)."""
    b = np.floor(power_w / bin_w).astype(np.int64)
    order = np.lexsort((perf, b))
    b, p, y = b[order], power_w[order], perf[order]
    if b.size == 0:
        return np.zeros(0), np.zeros(0), 0
    _, start, count = np.unique(b, return_index=True, return_counts=True)
    sums = np.add.reduceat(p, start)
    keep = count >= MIN_PER_BIN
    # Within a bin perf is sorted ascending: the quantile is an index.
    value = y[start + np.floor(quantile * (count - 1)).astype(np.int64)]
    if source is not None:
        second, sources = _second_source_best(b, source[order], y)
        keep &= sources >= 2
        value = np.minimum(value, second)
    count, sums, value = count[keep], sums[keep], value[keep]
    return sums / count, value, int(count.size)


def _second_source_best(
    b: IntArray, source: IntArray, y: FloatArray
) -> tuple[FloatArray, IntArray]:
    """Per bin (in the order of np.unique(b)): the best perf of the source second best in
    it (-inf with one source), and how many sources it has."""
    order = np.lexsort((y, source, b))
    b, source, y = b[order], source[order], y[order]
    # The last sample of each (bin, source) run is that source's best in that bin.
    last = np.r_[(b[1:] != b[:-1]) | (source[1:] != source[:-1]), True]
    pb, pbest = b[last], y[last]
    order = np.lexsort((pbest, pb))
    pb, pbest = pb[order], pbest[order]
    _, first, n = np.unique(pb, return_index=True, return_counts=True)
    second = np.where(n >= 2, pbest[np.maximum(first + n - 2, 0)], -np.inf)
    return second, n.astype(np.int64)


def fit_curve(
    power_w: FloatArray,
    perf: FloatArray,
    *,
    settings: Learn,
    base: Profile,
    max_w: float,
    name: str,
    source: IntArray | None = None,
) -> Fit:
    """One key's curve from its samples, in the base profile's units, and whether it steers.
    `source`: each sample's node (bin_points)."""
    n = int(power_w.size)
    xs, ys, n_bins = bin_points(power_w, perf, settings.bin_w, settings.quantile, source)
    span = float(xs.max() - xs.min()) if n_bins else 0.0
    peak = float(ys.max()) if n_bins else 0.0
    short = _shortfall(settings, n, n_bins, span, peak)
    if short is not None:
        return Fit(None, n, n_bins, span, None, False, short)
    first_top = int(np.argmax(ys >= (1.0 - PEAK_TOLERANCE) * peak))
    keep = xs <= xs[first_top]
    env_x, env_y = concave_envelope(np.column_stack([xs[keep], ys[keep]]).tolist())
    # The envelope starts at the lowest bin and is flat past its peak, as Profile.value.
    on_env = np.interp(xs, env_x, env_y)
    error = float(np.sqrt(np.mean(((on_env - ys) / peak) ** 2)))
    px, py = env_x, env_y
    top = float(px[-1])
    # Continue the last slope to the device maximum, unless the envelope already ended at its
    # peak before the highest power observed (then it is flat past it: observed).
    if top < max_w and top >= float(xs.max()) - settings.bin_w and px.size >= 2:
        slope = float((py[-1] - py[-2]) / (px[-1] - px[-2]))
        if slope > 0.0:
            px = np.r_[px, max_w]
            py = np.r_[py, py[-1] + slope * (max_w - top)]
    # Policy units: the curve's peak (extrapolated where not observed) is worth the policy
    # profile's peak. Scaled after extrapolating, so a curve seen only up to 450 W is not
    # taken to be at its best there.
    py = py * (base.peak_throughput / float(py[-1]))
    profile = Profile.from_points(name, np.column_stack([px, py]).tolist())
    ok = error <= settings.max_error
    why = "fitted" if ok else f"error {error:.3f} > {settings.max_error:g}"
    return Fit(profile, n, n_bins, span, error, ok, why)


def _shortfall(settings: Learn, n: int, n_bins: int, span: float, peak: float) -> str | None:
    """Why samples cannot support a fit yet (None: they can)."""
    if n < settings.min_samples:
        return f"{n} samples < {settings.min_samples}"
    if n_bins < settings.min_bins:
        return f"{n_bins} power bins < {settings.min_bins}"
    if span < settings.min_span_w:
        return f"spans {span:.0f} W < {settings.min_span_w:g} W"
    if not peak > 0.0:
        return "perf is zero everywhere"
    return None


@dataclass
class _Ring:
    """One key's samples: (time, power, perf, source) in a ring of fixed size (source -1:
    not known)."""

    size: int
    t: FloatArray = field(init=False)
    p: FloatArray = field(init=False)
    y: FloatArray = field(init=False)
    head: int = 0
    filled: int = 0

    def __post_init__(self) -> None:
        self.t = np.full(self.size, -math.inf)
        self.p = np.zeros(self.size)
        self.y = np.zeros(self.size)
        self.s = np.full(self.size, -1, dtype=np.int64)

    def add(self, now: float, p: FloatArray, y: FloatArray, s: IntArray | None = None) -> None:
        k = min(p.size, self.size)
        idx = (self.head + np.arange(k)) % self.size
        self.t[idx] = now
        self.p[idx] = p[:k]
        self.y[idx] = y[:k]
        self.s[idx] = -1 if s is None else s[:k]
        self.head = int((self.head + k) % self.size)
        self.filled = min(self.size, self.filled + k)

    def recent(self, since: float) -> tuple[FloatArray, FloatArray, IntArray | None]:
        """Samples since `since`; their sources, or None where any is not known."""
        keep = self.t >= since
        s = self.s[keep]
        return self.p[keep], self.y[keep], (s if (s >= 0).all() else None)


class ProfileLearner:
    """Per-key sample buffers and fits; `profiles()` are the learned curves in use.

    `keys[k]`'s policy profile is `base[k]`; `enabled[k]` says whether key k learns at all.
    The caller feeds every tick (`observe`) and asks for a refit when `due` (cheap otherwise).
    """

    def __init__(
        self,
        keys: Sequence[str],
        base: Sequence[Profile],
        enabled: Sequence[bool],
        settings: Learn,
        *,
        max_w: float,
        tick_s: float,
        seed: int = 0,
    ) -> None:
        self.keys = tuple(keys)
        self.base = tuple(base)
        self.enabled = tuple(enabled)
        self.settings = settings
        self.max_w = max_w
        self._rings = [_Ring(settings.buffer) for _ in self.keys]
        self._fits: list[Fit | None] = [None] * len(self.keys)
        self._fitted_at: list[float | None] = [None] * len(self.keys)
        self._rng = np.random.default_rng(seed)
        self._ticks = 0
        self.refits = 0
        # Samples per key per tick so that the buffer spans the window (at most per_tick):
        # a buffer filled in a minute would forget the variation of the last hours.
        self.rate = min(float(settings.per_tick), settings.buffer * tick_s / settings.window_s)
        self._learning = [k for k, on in enumerate(self.enabled) if on]
        self._credit = np.zeros(len(self.keys))
        self._enabled = np.asarray(self.enabled, dtype=np.float64)
        self._cap = float(max(settings.per_tick, 1))
        self._batch = float(min(SAMPLE_BATCH, settings.per_tick))
        # The last fit that steered, kept while newer samples lack the spread to refit.
        self._good: list[Fit | None] = [None] * len(self.keys)

    @property
    def any_enabled(self) -> bool:
        return any(self.enabled)

    def observe(
        self,
        now: float,
        key_index: IntArray,
        power_w: FloatArray,
        perf: FloatArray,
        usable: BoolArray,
        *,
        min_w: FloatArray | float = 0.0,
        source: IntArray | None = None,
    ) -> None:
        """Take this tick's samples: GPUs `usable` (fresh, steered), with a finite perf above 0
        (a GPU doing nothing says nothing about power) and a draw at or above `min_w` (below
        the device minimum a GPU is idle, not capped). At most `per_tick` per key.
        `source`: each GPU's node (an integer >= 0): where given, one node cannot bend a
        curve alone (bin_points); the controller passes it, telemetry being untrusted."""
        self._ticks += 1
        if not self.any_enabled:
            return
        # Samples are due per key at `rate` a tick, taken in batches: most ticks touch no
        # GPU at all, and a batch tick costs a few passes over the fleet's arrays.
        credit = self._credit
        np.minimum(credit + self.rate * self._enabled, self._cap, out=credit)
        needy = np.flatnonzero(credit >= self._batch)
        if needy.size == 0:
            return
        ok = (
            usable
            & np.isfinite(perf)
            & (perf > 0.0)
            & (perf <= MAX_PERF)
            & np.isfinite(power_w)
            & (power_w >= min_w)
        )
        for k in needy.tolist():
            mine = np.flatnonzero(ok & (key_index == k))
            take = int(credit[k])
            if mine.size > take:
                mine = self._rng.choice(mine, take, replace=False)
            # None usable (no perf reported): wait a batch period before looking again.
            credit[k] = 0.0 if mine.size == 0 else credit[k] - mine.size
            if mine.size:
                self._rings[k].add(
                    now, power_w[mine], perf[mine], None if source is None else source[mine]
                )

    def due(self) -> bool:
        """True on the ticks that refit: the first of every `refit_ticks`, and the ones
        after it while keys remain (`refit_next` fits one key a tick)."""
        if not self._learning:
            return False
        return self._ticks % self.settings.refit_ticks < len(self._learning)

    def refit_next(self, now: float) -> bool:
        """Fit the next key due (one a tick: a tick pays for one fit at most); True when its
        curve in use changed."""
        k = self._learning[self._ticks % self.settings.refit_ticks % len(self._learning)]
        return self._fit(k, now)

    def refit(self, now: float) -> bool:
        """Fit every enabled key; True when the set of curves in use changed."""
        changed = False
        for k in self._learning:
            changed |= self._fit(k, now)
        return changed

    def _fit(self, k: int, now: float) -> bool:
        before = self._good[k]
        p, y, s = self._rings[k].recent(now - self.settings.window_s)
        fit = fit_curve(
            p,
            y,
            settings=self.settings,
            base=self.base[k],
            max_w=self.max_w,
            name=self.keys[k],
            source=s,
        )
        self._fitted_at[k] = now
        if fit.ok:
            self._good[k] = fit
        elif fit.profile is not None or fit.samples < self.settings.min_samples:
            # Enough data that fit badly, or too little data left: no learned curve.
            self._good[k] = None
        self._fits[k] = fit
        self.refits += 1
        after = self._good[k]
        return not _same(
            [None if before is None else before.profile], [None if after is None else after.profile]
        )

    def _in_use_profiles(self) -> list[Profile | None]:
        return [None if f is None else f.profile for f in self._good]

    def profiles(self) -> dict[str, Profile]:
        """Learned curves in use, by key (keys not in it steer by the policy's profile)."""
        return {
            key: prof
            for key, prof in zip(self.keys, self._in_use_profiles(), strict=True)
            if prof is not None
        }

    def states(self) -> list[LearnState]:
        """Per key: the last fit's figures, whether a learned curve steers and why (points:
        the curve in use, else the last fit's, else none)."""
        out = []
        for k, key in enumerate(self.keys):
            fit, good = self._fits[k], self._good[k]
            if not self.enabled[k]:
                reason = "learning off for this class"
            elif fit is None:
                reason = "not fitted yet"
            elif good is not None and good is not fit:
                reason = f"last good fit kept; now {fit.reason}"
            else:
                reason = fit.reason
            prof = good.profile if good is not None else (fit.profile if fit else None)
            out.append(
                LearnState(
                    key=key,
                    enabled=self.enabled[k],
                    samples=self._rings[k].filled if fit is None else fit.samples,
                    bins=0 if fit is None else fit.bins,
                    span_w=0.0 if fit is None else fit.span_w,
                    fit_error=None if fit is None else fit.error,
                    in_use=good is not None,
                    reason=reason,
                    points=()
                    if prof is None
                    else tuple(zip(prof.power_w.tolist(), prof.throughput.tolist(), strict=True)),
                    fitted_at=self._fitted_at[k],
                )
            )
        return out


def _same(a: list[Profile | None], b: list[Profile | None]) -> bool:
    for x, y in zip(a, b, strict=True):
        if (x is None) != (y is None):
            return False
        if x is not None and y is not None:
            if x.power_w.shape != y.power_w.shape:
                return False
            if not (
                np.array_equal(x.power_w, y.power_w) and np.array_equal(x.throughput, y.throughput)
            ):
                return False
    return True


def learner_for(policy: Policy, tick_s: float | None = None) -> ProfileLearner | None:
    """A learner over the policy's classes (allocator order), or None when no class learns.
    `tick_s`: how often it is fed (default: the policy's tick)."""
    settings = policy.control.learn
    names = list(policy.classes)
    enabled = [
        settings.enabled if policy.classes[c].learn is None else bool(policy.classes[c].learn)
        for c in names
    ]
    if not any(enabled):
        return None
    return ProfileLearner(
        names,
        [policy.class_profile(c) for c in names],
        enabled,
        settings,
        max_w=policy.defaults.gpu.max_cap_w,
        tick_s=policy.control.tick_s if tick_s is None else tick_s,
    )
