"""Throughput-vs-power profiles: measured points turned into a concave, non-decreasing curve.

Measured points are noisy (a point a little above its neighbours' chord, a dip after the
peak). The allocator needs a concave non-decreasing utility, so a profile keeps the upper
concave envelope of the points and holds it flat after its peak: power past the peak buys
nothing. Below the first point the first segment's slope continues, so a GPU capped under the
measured range still has a concave curve to steer by (reported throughput is clamped at 0).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from numpy.typing import ArrayLike, NDArray

FloatArray = NDArray[np.float64]


class ProfileError(ValueError):
    """The points cannot describe a throughput profile."""


def concave_envelope(points: Sequence[Sequence[float]]) -> tuple[FloatArray, FloatArray]:
    """Upper concave, non-decreasing envelope of (power_w, throughput) points.

    Returns the envelope's breakpoints (power, throughput), power strictly increasing.
    Points after the highest throughput are dropped (the curve stays flat there).
    """
    if len(points) == 0:
        raise ProfileError("a profile needs at least one point")
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2 or pts.shape[1] != 2:
        raise ProfileError("profile points must be [power_w, throughput] pairs")
    if not np.all(np.isfinite(pts)):
        raise ProfileError("profile points must be finite numbers")
    if np.any(pts[:, 0] < 0) or np.any(pts[:, 1] < 0):
        raise ProfileError("profile power and throughput must not be negative")
    order = np.lexsort((-pts[:, 1], pts[:, 0]))
    pts = pts[order]
    # One point per power value: the best measurement.
    _, first = np.unique(pts[:, 0], return_index=True)
    pts = pts[first]
    # Non-decreasing: cut everything after the peak (the envelope is flat from there).
    peak = int(np.argmax(pts[:, 1]))
    pts = pts[: peak + 1]
    hull: list[tuple[float, float]] = []
    for x, y in pts:
        while len(hull) >= 2:
            (x1, y1), (x2, y2) = hull[-2], hull[-1]
            # Drop the middle point when it lies on or below the chord from hull[-2] to (x, y).
            if (y2 - y1) * (x - x1) <= (y - y1) * (x2 - x1):
                hull.pop()
            else:
                break
        hull.append((float(x), float(y)))
    arr = np.asarray(hull, dtype=np.float64)
    return arr[:, 0].copy(), arr[:, 1].copy()


@dataclass(frozen=True)
class Profile:
    """A concave, non-decreasing, piecewise-linear throughput curve over power in watts."""

    name: str
    power_w: FloatArray = field(repr=False)
    throughput: FloatArray = field(repr=False)

    @classmethod
    def from_points(cls, name: str, points: Sequence[Sequence[float]]) -> Profile:
        power, tput = concave_envelope(points)
        return cls(name=name, power_w=power, throughput=tput)

    @property
    def peak_w(self) -> float:
        """Power at which the curve reaches its maximum (more buys nothing)."""
        return float(self.power_w[-1])

    @property
    def peak_throughput(self) -> float:
        return float(self.throughput[-1])

    @cached_property
    def slopes_per_w(self) -> FloatArray:
        """Slope of each envelope segment, decreasing (concavity). Computed once (every
        throughput a simulated GPU reports asks for it): read-only."""
        out: FloatArray = (
            np.zeros(0)
            if self.power_w.size < 2
            else np.diff(self.throughput) / np.diff(self.power_w)
        )
        out.setflags(write=False)
        return out

    @cached_property
    def first_slope_per_w(self) -> float:
        s = self.slopes_per_w
        if s.size:
            return float(s[0])
        # A single point: throughput proportional to power up to it.
        return float(self.throughput[0] / self.power_w[0]) if self.power_w[0] > 0 else 0.0

    def value(self, power_w: ArrayLike) -> FloatArray:
        """Throughput at the given power (vectorised)."""
        p = np.asarray(power_w, dtype=np.float64)
        inside = np.interp(p, self.power_w, self.throughput)
        low = p < self.power_w[0]
        if not low.any():  # (most calls: every draw on the curve; the line below unused)
            return np.asarray(inside, dtype=np.float64)
        below = self.throughput[0] - self.first_slope_per_w * (self.power_w[0] - p)
        out = np.where(low, np.maximum(below, 0.0), inside)
        return np.asarray(out, dtype=np.float64)
