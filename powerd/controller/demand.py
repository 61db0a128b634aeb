"""Per-GPU demand from the recent distribution of draw (docs/allocator.md, "Demand").

The allocator caps a GPU's gains at its demand. From the last sample alone (plus
`defaults.headroom_w`), a GPU whose draw swings is capped at whatever it drew a second ago,
and loses work for the whole next tick each time it rises. The estimator keeps, per GPU,
what it has drawn recently at most and how far its draw has risen from one sample to the
next, over the last `control.demand.window_s`, and the allocator sees

    recent_w = min(max_cap, recent peak + swing × largest rise between samples)

(docs/policy.md, `control.demand`). State is bounded: per GPU a fixed ring of `BUCKETS`
time slices of the window (each slice's largest draw, largest rise and largest climb) and
its last and lowest samples; a GPU that leaves the fleet leaves the estimator with it.
Node input is untrusted: a sample counts only for its own GPU, clipped to [0, the GPU's
max cap] (a wild or lying draw moves that GPU's demand, which `power_w` moved already, and
nobody else's); a NaN or a stale GPU's sample is not taken. `swinging` reads from the
climbs which GPUs climbed by at least `control.demand.swing_keep_w` in every slice of the
window but the newest (their draw swings all window: the allocator judges them by their
recent peak). A slice's climb is its largest rise above the lowest sample since the slice
began (the one before it included), so a swing that comes up in steps (a cap cut in the
low phase, then raised) is still one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from powerd.policy import DemandSpec

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

# Time slices of the window: the peak covers between (BUCKETS − 1)/BUCKETS of the window and
# all of it, at BUCKETS floats per GPU and per kind.
BUCKETS = 8
# The kinds the ring keeps per slice (the first axis of `DemandEstimator._ring`).
PEAK, RISE, CLIMB = range(3)
RINGS = 3


class DemandEstimator:
    """The recent peak and swing of every GPU's draw, in the fleet's order."""

    def __init__(self, spec: DemandSpec) -> None:
        self.spec = spec
        self.uuids: Sequence[str] = ()
        # The ring, per time slice: the largest draw taken (PEAK), the largest rise from one
        # sample to the next (RISE) and the largest climb above the slice's lowest sample
        # (CLIMB, for `swinging`). Slice by GPU (a GPU's ring is a column): the max over a
        # GPU's slices then runs along the long axis, ~15x faster than over 8 values per
        # row. `peak`/`rise`: GPU by slice.
        self._ring = np.zeros((RINGS, BUCKETS, 0))
        self.last = np.zeros(0)  # the last sample taken (NaN: none yet)
        # The lowest sample since the newest slice began (the one before it included).
        self.low = np.zeros(0)
        self.slot = -1  # the time slice (global count) the ring's newest column holds

    @property
    def peak(self) -> FloatArray:
        """Per GPU (rows) and time slice: the highest draw taken."""
        return np.asarray(self._ring[PEAK].T)

    @property
    def rise(self) -> FloatArray:
        """Per GPU (rows) and time slice: the largest rise from one sample to the next."""
        return np.asarray(self._ring[RISE].T)

    def adopt(self, spec: DemandSpec) -> None:
        """New settings: a new window length restarts the history (its slices mean
        something else); the swing factor alone keeps it."""
        if spec.window_s != self.spec.window_s:
            self._reset(self.uuids)
        self.spec = spec

    def _reset(self, uuids: Sequence[str]) -> None:
        n = len(uuids)
        self.uuids = uuids
        self._ring = np.zeros((RINGS, BUCKETS, n))
        self.last = np.full(n, np.nan)
        self.low = np.full(n, np.nan)
        self.slot = -1

    def _follow(self, uuids: Sequence[str]) -> None:
        """Rows for this GPU set: GPUs kept keep their history, new ones start empty, gone
        ones are forgotten."""
        if uuids is self.uuids or list(uuids) == list(self.uuids):
            self.uuids = uuids
            return
        old = {u: i for i, u in enumerate(self.uuids)}
        n = len(uuids)
        ring, last, low = np.zeros((RINGS, BUCKETS, n)), np.full(n, np.nan), np.full(n, np.nan)
        src = np.fromiter((old.get(u, -1) for u in uuids), dtype=np.int64, count=n)
        keep = src >= 0
        k = src[keep]
        ring[:, :, keep], last[keep], low[keep] = self._ring[:, :, k], self.last[k], self.low[k]
        self.uuids, self._ring, self.last, self.low = uuids, ring, last, low

    def observe(
        self,
        now: float,
        uuids: Sequence[str],
        power_w: FloatArray,
        max_cap_w: FloatArray,
        fresh: BoolArray,
    ) -> FloatArray | None:
        """Take this tick's samples (`fresh`: GPUs whose sample counts) and return each
        GPU's recent draw estimate, or None when the window is 0 (the last sample alone,
        as powerd did before the estimator)."""
        window = self.spec.window_s
        if window <= 0:
            return None
        self._follow(uuids)
        slot = math.floor(now / (window / BUCKETS))
        if slot != self.slot:
            # Clear the slices the clock has moved past (all of them after a long gap).
            for s in range(max(self.slot + 1, slot - BUCKETS + 1), slot + 1):
                self._ring[:, s % BUCKETS] = 0.0
            self.slot = max(slot, self.slot)
            self.low = self.last.copy()  # a slice's climb starts from the sample before it
        peak, rise, climb = self._ring[:, self.slot % BUCKETS]  # this slice's rows (views)
        draw = _draw(power_w, max_cap_w)
        take = fresh & np.isfinite(power_w)
        # In place where `take`: the row as it was elsewhere. fmax skips a NaN (no last or
        # lowest sample yet: no rise, no climb).
        np.maximum(peak, draw, out=peak, where=take)
        np.fmax(rise, draw - self.last, out=rise, where=take)
        np.fmax(climb, draw - self.low, out=climb, where=take)
        np.fmin(self.low, draw, out=self.low, where=take)
        self.last = np.where(take, draw, self.last)
        return self._recent(draw, max_cap_w)

    def swinging(self, rise_w: float) -> BoolArray | None:
        """Per GPU whether its draw swings all window: it climbed by at least `rise_w` above
        its lowest sample in every time slice of the window but the newest (which may have
        just begun). None where `rise_w` is 0 or the window is (off). Measured, allowing one
        slice anywhere without a rise read 8 % of bursty serving GPUs as swinging (a burst
        in 7 of 8 slices) and cost them work; a rise between two samples alone missed a
        synchronous job's GPUs whose cap was cut in the low phase and raised in steps
        (docs/performance.md, "Cap churn")."""
        if rise_w <= 0 or self.spec.window_s <= 0:
            return None
        rose = self._ring[CLIMB] >= rise_w
        rose[self.slot % BUCKETS] = True
        return np.asarray(rose.all(axis=0))

    def recent_w(self, power_w: FloatArray, max_cap_w: FloatArray) -> FloatArray:
        """Per GPU: min(max cap, max(draw now, recent peak) + swing × largest recent rise)."""
        return self._recent(_draw(power_w, max_cap_w), max_cap_w)

    def _recent(self, draw: FloatArray, max_cap_w: FloatArray) -> FloatArray:
        peak = np.maximum(self._ring[PEAK].max(axis=0), draw)
        swing = self.spec.swing * self._ring[RISE].max(axis=0)
        return np.asarray(np.minimum(peak + swing, max_cap_w), dtype=np.float64)


def _draw(power_w: FloatArray, max_cap_w: FloatArray) -> FloatArray:
    """Per GPU the draw the estimate counts: the sample within [0, max cap] (NaN: 0)."""
    # (NaN to 0 by np.where: nan_to_num's ±inf to ±max float clip to the same bounds, and
    # its Python-level checks cost twice this whole line.)
    return np.asarray(
        np.where(np.isnan(power_w), 0.0, power_w).clip(0.0, max_cap_w), dtype=np.float64
    )
