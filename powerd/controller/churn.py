"""How many caps move from one tick to the next, and by how much: churn.

Every cap move is a call on the node (NVML today, a BMC's Redfish PATCH later) and a message
on the broker, so at a large site the share of caps that move each tick is load. The
controller counts it per tick (TickReport's `caps_moved`, the metrics), the simulator over a
run (RunResult's `churn`). Moves are counted against the cap in force before the tick:
a GPU whose cap changes by more than MOVE_TOL_W has moved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

FloatArray = NDArray[np.float64]

# A cap changed by less than this has not moved (float noise, a read-back's rounding).
MOVE_TOL_W = 0.5


def cap_moves(before_w: FloatArray, after_w: FloatArray) -> FloatArray:
    """The size of every move (W, > 0) from `before_w` to `after_w` (NaN on either side: a
    GPU with no cap known or none sent does not count)."""
    delta = np.abs(np.asarray(after_w, dtype=np.float64) - before_w)
    return delta[delta > MOVE_TOL_W]  # NaN compares False


@dataclass
class Churn:
    """Cap moves over many ticks: the share of GPUs whose cap moved per tick, the size of a
    move (a histogram in 1 W bins, so a day at 5 s ticks costs no memory) and W moved per
    tick."""

    ticks: int = 0
    gpu_ticks: int = 0
    moves: int = 0
    moved_w: float = 0.0
    busiest_share: float = 0.0  # the highest share of one tick
    hist: NDArray[np.int64] = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    def add(self, before_w: FloatArray, after_w: FloatArray) -> None:
        """One tick: the caps in force before it and after it (per GPU, same order)."""
        moves = cap_moves(before_w, after_w)
        n = len(before_w)
        self.ticks += 1
        self.gpu_ticks += n
        self.moves += moves.size
        self.moved_w += float(moves.sum())
        if n:
            self.busiest_share = max(self.busiest_share, moves.size / n)
        if moves.size:
            counts = np.bincount(moves.astype(np.int64))
            if counts.size > self.hist.size:
                self.hist = np.pad(self.hist, (0, counts.size - self.hist.size))
            self.hist[: counts.size] += counts

    def quantile_w(self, q: float) -> float:
        """The q-quantile of a move's size (W, to the 1 W bin's middle); 0 with no moves."""
        total = int(self.hist.sum())
        if not total:
            return 0.0
        cum = np.cumsum(self.hist)
        return float(np.searchsorted(cum, q * total)) + 0.5

    @property
    def share_moved(self) -> float:
        """Mean share of the GPUs whose cap moved per tick."""
        return self.moves / self.gpu_ticks if self.gpu_ticks else 0.0

    def summary(self) -> dict[str, float | int]:
        return {
            "ticks": self.ticks,
            "share_moved": self.share_moved,
            "busiest_share_moved": self.busiest_share,
            "moves_per_tick": self.moves / self.ticks if self.ticks else 0.0,
            "median_move_w": self.quantile_w(0.5),
            "p95_move_w": self.quantile_w(0.95),
            "moved_w_per_tick": self.moved_w / self.ticks if self.ticks else 0.0,
        }
