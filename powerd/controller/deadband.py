"""The deadband: a GPU's cap is cut only when its new target lies more than `deadband_w`
below the cap in force.

Between the allocator's targets and the safety planner (controller/tick.py). Under shared
budgets one GPU's swing of demand moves every neighbour's target by a little each tick; each
move is a call on the node (NVML, a BMC) and a message on the broker. The deadband:

- **holds small cuts**: a target at most `deadband_w` below the cap in force keeps the cap
  in force. That keeps room the allocator had handed to others, so wherever the held caps
  and the raises together no longer fit a group's limit, the raises under that group are
  funded from the room left, whole raises in turn (GPUs whose draw presses on their cap
  first, then the largest), the one the room runs out on in part: fewer, larger moves;
- **funds a pressed GPU's raise from held cuts** only where `control.fund_pressed_w` asks
  (off by default), and only under groups whose measured draw is at least
  `control.fund_room_pct` below their budget (`fund_under`): under such a group, once the
  raises of GPUs not pressed are trimmed, the held cuts of at least `fund_pressed_w` of
  GPUs not pressed go, the largest first (the last in part), before a pressed GPU's raise
  is trimmed (a pressed raise is work waiting, a held cut only churn avoided); measured,
  each release is a move: under the strict rule it tripled the moves on the recorded
  traces and cost synchronous training work (docs/performance.md, "Raises on acks"), and
  where the draw is near a budget a released cut is soon wanted back;
- **never holds back a cut a limit needs**: where the held cuts alone break a group's limit
  (a budget cut, a limit that fell), held cuts under that group go, the largest first,
  until it fits (the last in part): no more than the limit needs, so caps follow a ramping
  budget down as smoothly as without the deadband;
- **never holds a pressed GPU's raise** (but for the opt-in dwell below): a held raise
  would only leave power unused, but measured, holding raises cost the work the headroom
  above an inference GPU's draw is there for (docs/allocator.md, "Deadband"); only raises
  of at most `Bands.raise_w` (`control.raise_deadband_w`) of GPUs whose draw does not
  press on their cap are held (they follow the demand estimate's recent peak; no work
  waits on them);
- **holds the moves of a GPU whose cap moved lately** only where `control.dwell_s` asks
  (off by default): its moves of at most `dwell_max_w`, up or down, pressed or not, wait
  until its cap has stayed `dwell_s`; its cuts still go where a limit needs them.

So the targets it returns fit every group's limit wherever the allocator's did: each group
either fits as it is or ends at most at min(target, cap in force) per GPU (a released cut
stops at its target and only lowers every sum it is in). Pinned GPUs (an operator's cap, a
drained node), GPUs the planner holds (NaN targets) and GPUs whose cap in force lies
outside their bounds are never held.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from powerd.topology import Topology

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]

# Watts of float noise tolerated when testing a group against its limit.
TOL_W = 1e-6
# No per-GPU flags (the kernel's typed stand-in for None).
_NONE = np.zeros(0, dtype=np.bool_)


@dataclass(frozen=True)
class Bands:
    """The deadband's settings (`control`): cuts of at most `cut_w` (`deadband_w`) are held;
    raises of at most `raise_w` (`raise_deadband_w`) of GPUs not pressed too; a dwelling
    GPU's moves of at most `dwell_max_w`; held cuts of at least `fund_pressed_w` of GPUs
    not pressed go to fund pressed GPUs' raises (None: they do not)."""

    cut_w: float
    raise_w: float = 0.0
    dwell_max_w: float = np.inf
    fund_pressed_w: float | None = None


def hold_small_cuts(
    targets_w: FloatArray,
    in_force_w: FloatArray,
    *,
    bands: Bands,
    topology: Topology,
    capacity_w: FloatArray,
    holdable: BoolArray,
    pressed: BoolArray | None = None,
    dwelling: BoolArray | None = None,
    fund_under: BoolArray | None = None,
) -> tuple[FloatArray, BoolArray]:
    """(targets, held): the targets with every cut of at most `bands.cut_w` held at the cap
    in force, and per GPU whether it was held.

    `in_force_w`: per GPU the cap that may be in force (the planner's committed cap);
    `capacity_w`: per group what the GPUs' caps may sum to (limit − overhead − reserve);
    `holdable`: per GPU whether the deadband may hold it; `pressed`: per GPU whether its
    draw presses on its cap (its raise is work: funded first where room is short). NaN
    targets (hold the committed cap) pass through and count at the cap in force.
    `bands.raise_w`: raises of at most this much are held too, but only of holdable GPUs
    not `pressed` (None: no GPU's raise is held): such a raise follows the demand
    estimate's recent peak, no work waits on it, and holding it only leaves power unused.
    `dwelling`: per GPU whether its cap moved lately (`control.dwell_s`; None: none did):
    a holdable dwelling GPU's moves of at most `bands.dwell_max_w`, up or down, pressed or
    not, are held too (its cuts released, like any held cut, where a limit needs them).
    `bands.fund_pressed_w`: where a group is over, held cuts of at least this much of GPUs
    not pressed go, the largest first, to fund the pressed GPUs' raises before those are
    trimmed (None: the raises are trimmed first); `fund_under`: per group whether its held
    cuts may (None: every group's may).
    """
    deadband_w, raise_band_w = bands.cut_w, bands.raise_w
    dwell_max_w, fund_pressed_w = bands.dwell_max_w, bands.fund_pressed_w
    targets = np.asarray(targets_w, dtype=np.float64)
    dwell = None if dwelling is None or not dwelling.any() else holdable & dwelling
    if (deadband_w <= 0 and raise_band_w <= 0 and dwell is None) or targets.size == 0:
        return targets, np.zeros(targets.shape, dtype=np.bool_)
    from powerd.allocator import kernel  # numba: loaded by the first solve

    # The moves held, then level by level from the root, where a group breaks its limit:
    # its raises trimmed (the pressed first, then the largest), held cuts released to fund
    # pressed raises where `fund_pressed_w` asks, then held cuts released where the limit
    # still needs it (the module's docstring). Compiled (kernel.deadband_hold): ~60 numpy
    # calls a tick cost more than the work itself. A held raise only lowers a group's sum:
    # it never breaks a limit, and it is never released (its cut is 0).
    out, still = kernel.deadband_hold(
        targets,
        np.asarray(in_force_w, dtype=np.float64),
        np.asarray(holdable, dtype=np.bool_),
        _NONE if pressed is None else pressed,
        pressed is not None,
        _NONE if dwell is None else dwell,
        dwell is not None,
        deadband_w,
        raise_band_w,
        dwell_max_w,
        np.nan if fund_pressed_w is None else fund_pressed_w,
        np.ones(topology.n_groups, dtype=np.bool_) if fund_under is None else fund_under,
        np.asarray(capacity_w, dtype=np.float64),
        topology.gpu_groups,
        TOL_W,
    )
    return out, np.asarray(still, dtype=np.bool_)
