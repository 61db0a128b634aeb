"""Ramped budgets: the budget in force each tick when budget changes are planned.

A grid operator's load target for a window (a scheduled budget) must not reach the feed as a
step. With `control.ramp_w_per_s` (up, down) in the policy, the budget in force moves toward
a scheduled cut early enough to reach it on time, and back up after the window, no faster
than those rates; any other raise of a budget in force (a temporary cut cleared or expired,
a policy raised) also ramps up. An immediate cut (a temporary budget without a schedule, the
policy, a coordinator's share, an overload rule) still goes at once: safety wins over the feed.

Everything here is pure: times are plain numbers on one timeline, chosen by the caller.
docs/safety.md, "Ramps", says which timelines the controller uses and why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from numpy.typing import NDArray

from powerd.policy import RampRates

FloatArray = NDArray[np.float64]

# A scheduled cut is in force this many ticks before its start: one to send the cuts, one
# for their acknowledgements, so that the caps committed are within the target at its start.
LEAD_TICKS = 2


def lead_s(tick_s: float) -> float:
    return LEAD_TICKS * tick_s


def window_ceiling_w(
    budget_w: float,
    start: float,
    end: float | None,
    t: float,
    rates: RampRates | None,
    *,
    lead_s: float = 0.0,
) -> float:
    """The highest budget a scheduled window `[start, end)` at `budget_w` allows at time `t`.

    Before the window it descends toward `budget_w` at `rates.down`, reaching it `lead_s`
    before `start` (the caps a cut needs must be acknowledged by then); after `end` it rises
    at `rates.up`. Without rates the window is a step (inf outside it). A convex function of
    `t` with slopes within the rates, so the least of several windows is ramp-limited too."""
    s = start - lead_s
    if t < s:
        return math.inf if rates is None else budget_w + rates.down * (s - t)
    if end is None or t < end:
        return budget_w
    return math.inf if rates is None else budget_w + rates.up * (t - end)


def ramp_down_from(
    budget_now_w: float, budget_w: float, start: float, rates: RampRates | None, lead_s: float
) -> float:
    """When a cut from `budget_now_w` to `budget_w` at `start` begins to move the budget."""
    if rates is None or not math.isfinite(budget_now_w):
        return start - lead_s
    return start - lead_s - max(0.0, budget_now_w - budget_w) / rates.down


def window_done(
    budget_w: float, end: float | None, t: float, ceiling_w: float, rates: RampRates | None
) -> bool:
    """True once a window has ended and its ramp back up has passed `ceiling_w` (the group's
    policy budget): it no longer shapes anything. For a group without a budget, once the ramp
    has doubled the window's budget (BudgetRamp carries the rise on from there)."""
    if end is None or t < end:
        return False
    if rates is None:
        return True
    top = ceiling_w if math.isfinite(ceiling_w) else 2.0 * budget_w
    return budget_w + rates.up * (t - end) >= top


class BudgetRamp:
    """The stateful half: a budget in force that rises, for whatever reason, rises no faster
    than `rates.up` from where it was at the previous tick. Cuts pass at once."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._t: float | None = None

    def reset(self) -> None:
        self._last, self._t = {}, None

    def step(
        self,
        names: Sequence[str],
        target_w: FloatArray,
        t: float,
        rates: RampRates | None,
        most_w: FloatArray,
    ) -> FloatArray:
        """The budgets in force at `t` given the targets. `most_w` per group is the most its
        committed caps could ever reach: a ramp above it holds nothing, and ends there (so a
        group without a budget is not left ramping toward infinity)."""
        out = np.asarray(target_w, dtype=np.float64)
        if rates is not None and self._t is not None and t >= self._t:
            prev = np.fromiter(
                (self._last.get(n, math.inf) for n in names), dtype=np.float64, count=len(names)
            )
            ramped = np.minimum(out, prev + rates.up * (t - self._t))
            out = np.where(ramped >= most_w, out, ramped)
        self._last = dict(zip(names, out.tolist(), strict=True))
        self._t = t
        return out

    def hold(self, names: Sequence[str], target_w: FloatArray) -> FloatArray:
        """The targets, none above where the ramp stood at its last step (a tick that could
        not step it: the fallback)."""
        last = np.fromiter(
            (self._last.get(n, math.inf) for n in names), dtype=np.float64, count=len(names)
        )
        return np.minimum(np.asarray(target_w, dtype=np.float64), last)
