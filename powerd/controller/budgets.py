"""The tick's budgets stage: per group, the budget in force this tick and the limit
committed caps may reach under it (docs/safety.md, "Ramps" and "Overload").

In force: the policy's budget, or a lower temporary one (expired ones end here), or a
scheduled one's ramp, or at a scope's root the coordinator's if lower; a rise is ramped at
the policy's rate (powerd.ramp). The limit: the budget, or above it where a group is rated
for an overload and its GPUs do not draw their reservation (OverloadRule), the room lent
once per reading. A metered group's draw is its meter's where the reading is fresh (never
below the nodes' figure), and its strict budget where a meter reading is not.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from powerd.allocator.solve import group_values
from powerd.controller.fleet import FleetArrays
from powerd.controller.meters import MeteredDraw
from powerd.controller.overrides import Overrides
from powerd.controller.shape import Shape
from powerd.policy import Policy
from powerd.ramp import BudgetRamp, lead_s
from powerd.safety import OverloadRule
from powerd.topology import Topology

FloatArray = NDArray[np.float64]


@dataclass(frozen=True)
class Budgets:
    """This tick's budgets: in force (`budget_w`) and what committed caps may reach
    (`limit_w`: the budget, or above it for a rated group)."""

    budget_w: FloatArray
    limit_w: FloatArray
    meter: MeteredDraw | None = None  # this tick's meter readings, where groups have one
    # Per group the measured draw (`BudgetsInForce.measured_draw_w`), where the tick reads
    # it: a rating's limits, the deadband's funding (None: neither asks).
    draw_w: FloatArray | None = None


@dataclass(frozen=True)
class ScopeRoot:
    """A scope's root and the coordinator's budget there (None: none given)."""

    group: int
    budget_w: float | None


class BudgetsInForce:
    """The state the budgets keep from tick to tick: the ramp's, last tick's budgets (for
    the grace a ramp's step down gets) and the overload limit lent on the last reading."""

    def __init__(self) -> None:
        self.ramp = BudgetRamp()
        # Per group: the budgets of the last tick, and this tick's before any schedule (a
        # ramp's step down is not `budget_over` while the cut that follows it is on its way).
        # (Over the groups of `_last_names`: the last tick's topology's.)
        self._last_names: tuple[str, ...] = ()
        self._last_budget_w: FloatArray = np.zeros(0)
        self._immediate_w: FloatArray | None = None
        # The overload limits of the last tick, with the telemetry count and shape they
        # were computed at.
        self._last_limit: tuple[int, Shape, FloatArray] | None = None
        # Per group, the meter reading the last limits were lent on (0: none).
        self._last_meter_seq: tuple[Shape, NDArray[np.int64]] | None = None
        self._rises = RiseReserve()

    def in_force(
        self,
        policy: Policy,
        overrides: Overrides,
        topo: Topology,
        now: float,
        wall: float,
        *,
        most_w: FloatArray | None = None,
        scope: ScopeRoot | None = None,
    ) -> FloatArray:
        """Per group: the policy's budget, or a lower temporary one (expired ones end here),
        or a scheduled one's ramp, or at a scope's root the coordinator's if lower. Given
        `most_w` (what each group's committed caps could reach), a rise is ramped at the
        policy's rate (powerd.ramp): the ramp's state moves only then."""
        budgets = overrides.active_budgets(policy, wall, now)
        out = group_values(topo, budgets, topo.budget_w) if budgets else topo.budget_w
        self._immediate_w = out
        control = policy.control
        scheduled = overrides.scheduled_budgets(policy, now, wall, lead_s(control.tick_s))
        if scheduled:
            out = np.minimum(out, group_values(topo, scheduled, np.full(topo.n_groups, np.inf)))
        if most_w is not None:
            out = self.ramp.step(topo.names, out, now, control.ramp_w_per_s, most_w)
        if scope is not None and scope.budget_w is not None and scope.budget_w < out[scope.group]:
            out = out.copy()
            out[scope.group] = scope.budget_w
            self._immediate_w = np.minimum(self._immediate_w, out)
        return out

    def held(self, topo: Topology, budget_w: FloatArray) -> FloatArray:
        """The budgets, none above where the ramp stood at its last step (a tick that could
        not step it: the fallback)."""
        return self.ramp.hold(topo.names, budget_w)

    def limits(
        self,
        rule: OverloadRule | None,
        budget_w: FloatArray,
        committed: FloatArray,
        shape: Shape,
        *,
        draw_w: FloatArray | None,
        heard: int,
        meter: MeteredDraw | None = None,
        now: float,
    ) -> FloatArray:
        """Per group, what committed caps may reach (OverloadRule): the budget, unless the
        group is rated. `draw_w`: the measured draw (`measured_draw_w`; read where `rule`
        is given). Draw and committed count alike: overhead, the reserve for GPUs not
        heard, and GPUs without fresh telemetry at their committed caps. `heard`: how many
        telemetry messages the tick has heard, ever. `meter`: a group whose reading is not
        fresh gets its budget. Either way a metered group's limit is lowered by
        the overhead its meter has learned beyond the policy's (`MeteredDraw.unseen_w`): the
        budget assumed less, and the meter is what the breaker sees. Where a group keeps its
        draw's rises in reserve (`Overload.rise_s`), its draw counts with them (RiseReserve;
        `now`: the controller's monotonic clock)."""
        if rule is None:
            return budget_w if meter is None else self._less_unseen(budget_w, meter)
        assert draw_w is not None, "a rating's limits read the measured draw"
        topo = shape.topology
        base = topo.overhead_w + shape.reserve_w
        draw = draw_w
        committed_w = topo.group_sums(committed) + base
        if rule.rise_s is not None:
            draw = draw + self._rises.reserve_w(
                now, shape, heard, draw_w=draw, committed_w=committed_w, window_s=rule.rise_s
            )
        limit = rule.limits_w(budget_w, committed_w, draw)
        if meter is not None:
            limit = np.where(meter.metered & ~meter.fresh, budget_w, limit)
        # The room between draw and target is lent once per reading: a tick that heard no
        # telemetry since the last one (ticks faster than the agents report) would
        # otherwise lend the same room again on top of what it already committed; nor a
        # metered group's, until its meter reads anew.
        last = self._last_limit
        if last is not None and last[1] is shape:
            same = np.full(topo.n_groups, last[0] == heard)
            seen = self._last_meter_seq
            if meter is not None and seen is not None and seen[0] is shape:
                same |= meter.fresh & (meter.seq == seen[1])
            limit = np.where(same, np.maximum(np.minimum(limit, last[2]), budget_w), limit)
        self._last_limit = (heard, shape, limit)
        if meter is not None:
            self._last_meter_seq = (shape, meter.seq)
            limit = self._less_unseen(limit, meter)
        return limit

    @staticmethod
    def _less_unseen(limit_w: FloatArray, meter: MeteredDraw) -> FloatArray:
        """The limits, each lowered by the overhead its group's meter sees beyond the
        policy's (kept out of the once-per-reading memory above, which never goes below the
        budget)."""
        if meter.unseen_w is None or not meter.unseen_w.any():
            return limit_w
        return np.asarray(limit_w, dtype=np.float64) - meter.unseen_w

    @classmethod
    def measured_draw_w(
        cls,
        committed: FloatArray,
        arrays: FleetArrays,
        shape: Shape,
        meter: MeteredDraw | None,
    ) -> FloatArray:
        """Per group, the measured draw: the nodes' figure (`nodes_draw_w`), or where a
        group has a fresh meter reading, that reading if higher (`MeteredDraw.draw_w`: a
        meter that reads low lends no more than the nodes' figures would)."""
        if meter is None:
            return cls.nodes_draw_w(committed, arrays, shape)
        return meter.draw_w(meter.nodes_w)  # the nodes' figure the tick summed for the meters

    @staticmethod
    def nodes_draw_w(committed: FloatArray, arrays: FleetArrays, shape: Shape) -> FloatArray:
        """Per group, the draw as the nodes report it: GPUs with fresh telemetry at their
        draw, others at their committed caps, plus overhead and the reserve for GPUs not
        heard."""
        topo = shape.topology
        fresh = ~arrays.stale & np.isfinite(arrays.power_w)
        power = np.where(fresh, arrays.power_w, committed)
        return topo.group_sums(power) + topo.overhead_w + shape.reserve_w

    def ramp_grace(self, topo: Topology, budget_w: FloatArray) -> FloatArray:
        """Per group, what committed caps may still be while a ramp's step down is on its way:
        last tick's budget where only a schedule's ramp lowered it since (an immediate cut
        gets no grace: `budget_over` until its acks, as ever)."""
        names = topo.names
        if names == self._last_names:
            last = self._last_budget_w
        else:  # by name, where the groups changed
            before = dict(zip(self._last_names, self._last_budget_w.tolist(), strict=True))
            last = np.fromiter(
                (before.get(n, -np.inf) for n in names), dtype=np.float64, count=topo.n_groups
            )
        self._last_names = names
        self._last_budget_w = np.array(budget_w, dtype=np.float64)
        immediate = budget_w if self._immediate_w is None else self._immediate_w
        return np.maximum(budget_w, np.minimum(last, immediate))


class RiseReserve:
    """Per group, how far its draw, net of its committed caps, stands below the highest it
    reached over a window (`Overload.rise_s`): the rise it has shown it may make again. An
    overload rating lends the room between draw and target; work whose GPUs swing together
    (synchronous training's compute and communication phases, every few seconds) would
    draw it in its next high phase, over the budget until the cut lands, and every lend
    and withdrawal moves caps. Counting that rise with the draw lends only the reservation
    the GPUs left unused all window (the rule's limit becomes target + the least unused
    reservation of the window); the steering's own raises move the caps and the draw
    alike and are not counted. It only lowers what is lent, never below the budget."""

    def __init__(self) -> None:
        self._shape: Shape | None = None
        self._heard = -1
        # Per second of the window: when its first reading was, and per group the least
        # reservation left unused (committed − draw) at a reading within it.
        self._since: list[float] = []
        self._least: list[FloatArray] = []

    def reserve_w(
        self,
        now: float,
        shape: Shape,
        heard: int,
        *,
        draw_w: FloatArray,
        committed_w: FloatArray,
        window_s: FloatArray,
    ) -> FloatArray:
        """Per group, the rise to keep in reserve now (0 where its window is 0 or its draw
        is not known): the reservation unused now less the least unused at a reading in
        the window. A reading is the first call after new telemetry (`heard`: messages
        heard, ever); readings less than a second apart share a slot (at most `rise_s` + 1
        are kept); a new shape starts the memory over."""
        if shape is not self._shape:
            self._shape, self._heard = shape, -1
            self._since, self._least = [], []
        unused = np.asarray(committed_w, dtype=np.float64) - np.asarray(draw_w, dtype=np.float64)
        known = np.isfinite(unused)
        if heard != self._heard:
            self._heard = heard
            seen = np.where(known, unused, np.inf)  # a draw not known bounds nothing
            if self._since and now - self._since[-1] < 1.0:
                self._least[-1] = np.minimum(self._least[-1], seen)
            else:
                self._since.append(now)
                self._least.append(seen)
        oldest = now - float(window_s.max())
        while self._since and self._since[0] < oldest:
            del self._since[0], self._least[0]
        least = np.where(known, unused, np.inf)
        for window in np.unique(window_s[window_s > 0]).tolist():  # (one or two, mostly)
            within = least.copy()
            for since, slot in zip(self._since, self._least, strict=True):
                if since >= now - window:
                    np.minimum(within, slot, out=within)
            least = np.where(window_s == window, within, least)
        reserve = np.where(known & (window_s > 0), unused - least, 0.0)
        return np.asarray(np.maximum(reserve, 0.0), dtype=np.float64)
