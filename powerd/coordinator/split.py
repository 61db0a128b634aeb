"""The coordinator's tick as a plain object: scope reports in, scope budgets out.

The site's tree above the scopes (the facility, and rows when the scopes are racks) is
split between the scopes each tick from their demand curves (`split_budgets`,
powerd/allocator/scopes.py), so that in steady state the caps equal one controller's
optimum for the whole site. The budgets then pass the same safety rules one level up as
caps do below (docs/safety.md, "Scopes"):

- a cut is sent at once; a raise only where every group above the scope still fits with
  what every scope *may* draw: its budget until it reports that its committed caps fit a
  lower one of ours (so a raise waits for the scopes that pay for it);
- a scope that has not confirmed a budget of this coordinator (a start, a takeover) counts
  at the most it may draw under any earlier budget: its policy budget, or its maximum;
- a silent scope (no report for `silent_ticks`) is sent its failsafe budget and keeps
  what it may draw reserved until it reports again;
- every budget carries a lease: a scope whose coordinator goes silent falls back to
  min(its last budget, its failsafe budget) (powerd/controller/scope.py).

No transport, no clock: the daemon (coordinator/main.py) hands it reports and the times.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import numpy as np
import structlog

from powerd.allocator.scopes import DemandCurve, UpperTree, split_budgets
from powerd.controller.overrides import Overrides
from powerd.numeric import finite_or_none
from powerd.policy import LEVELS, Policy, failsafe_budget_w, subtree_totals
from powerd.wire import ScopeReport

log = structlog.get_logger(__name__)

TOL_W = 1e-6
# A scope that has not reported for this many coordinator ticks is silent.
SILENT_TICKS = 3


@dataclass
class ScopeState:
    """What the coordinator knows of one scope."""

    name: str
    group: int  # index in the policy
    failsafe_w: float
    max_w: float  # the most it can draw: its policy budget, or every GPU at its maximum
    overhead_w: float = 0.0  # by the policy
    report: ScopeReport | None = None
    heard_at: float = -math.inf  # arrival of the latest report (our clock)
    confirmed_w: float | None = None  # a budget of ours it confirmed (committed fits)
    confirmed_tick: int = -1
    pending: dict[int, float] = field(default_factory=dict)  # tick → budget sent since

    def committed_w(self) -> float:
        """The most this scope may draw now or later from any budget sent to it."""
        if self.confirmed_w is None:
            return self.max_w  # what an earlier coordinator may have given it
        return max([self.confirmed_w, *self.pending.values()])

    def last_sent_w(self) -> float | None:
        """The budget this scope holds once everything sent has arrived (budgets are taken
        in tick order): our latest, else the one it confirmed, else the one it reports."""
        if self.pending:
            return self.pending[max(self.pending)]
        if self.confirmed_w is not None:
            return self.confirmed_w
        return None if self.report is None else self.report.budget_w


@dataclass(frozen=True)
class ScopeBudgetPlan:
    scope: str
    budget_w: float | None  # sent this tick (None: nothing sent, see `_plan`)
    target_w: float  # the split's
    committed_w: float  # after this tick's budget
    held: bool  # a raise held back until the scopes that pay for it confirm their cuts
    silent: bool


@dataclass(frozen=True)
class CoordinatorReport:
    tick: int
    budgets: tuple[ScopeBudgetPlan, ...]
    group_names: tuple[str, ...]  # the groups above the scopes
    group_budget_w: tuple[float, ...]
    group_committed_w: tuple[float, ...]  # Σ what its scopes may draw + own overhead
    solve_ms: float
    waiting: tuple[str, ...]  # scopes without a curve (silent, or not heard yet)
    # Every budget lies where its scope's curve is exact: the split is the site's optimum
    # (otherwise it moves toward it from tick to tick: docs/allocator.md, "Scopes").
    exact: bool = False


class BudgetSplitter:
    def __init__(self, policy: Policy, scope_level: str = "row") -> None:
        self.scope_level = LEVELS.index(scope_level)
        if self.scope_level not in (1, 2):
            raise ValueError("scopes are rows or racks")
        self.overrides = Overrides()
        self.tick_no = 0
        self.adopt(policy)

    def adopt(self, policy: Policy) -> None:
        self.policy = policy
        groups = policy.groups
        lv = self.scope_level
        self.upper = [i for i, g in enumerate(groups) if g.level < lv]
        old = getattr(self, "scopes", {})
        per_max = [
            g.gpus * policy.defaults.gpu.max_cap_w + g.overhead_w if g.level == 3 else g.overhead_w
            for g in groups
        ]
        most = subtree_totals(groups, per_max)
        self.scopes: dict[str, ScopeState] = {}
        for i, g in enumerate(groups):
            if g.level != lv:
                continue
            state = old.get(g.name) or ScopeState(name=g.name, group=i, failsafe_w=0.0, max_w=0.0)
            state.group = i
            state.failsafe_w = failsafe_budget_w(policy, g.name)
            state.max_w = min(g.budget_w, most[i])
            self.scopes[g.name] = state
        # The upper groups' own overhead (a row's switches): not inside any scope's budget.
        own = [g.overhead_w if g.level < lv else 0.0 for g in groups]
        self.upper_overhead_w = subtree_totals(groups, own)
        # Each scope's overhead by the policy (its offset until it reports one).
        inside = [g.overhead_w if g.level >= lv else 0.0 for g in groups]
        scope_overhead = subtree_totals(groups, inside)
        for st in self.scopes.values():
            st.overhead_w = scope_overhead[st.group]
        local = {g: k for k, g in enumerate(self.upper)}
        self._upper_parent = np.array(
            [local.get(groups[i].parent, -1) for i in self.upper], dtype=np.int64
        )
        self._scope_parent = np.array(
            [local[groups[st.group].parent] for st in self.scopes.values()], dtype=np.int64
        )

    # -- reports -------------------------------------------------------------------------

    def on_report(self, msg: ScopeReport, now: float, epoch: int) -> bool:
        """A scope's report (`epoch`: ours). False for a scope the policy lacks."""
        state = self.scopes.get(msg.scope)
        if state is None:
            return False
        state.report = msg
        state.heard_at = now
        if (
            msg.budget_epoch == epoch
            and msg.budget_tick is not None
            and msg.budget_tick > state.confirmed_tick
            and msg.committed_w <= msg.budget_w + TOL_W
        ):
            # Its caps fit a budget of ours: every earlier budget is superseded. It may rise
            # to what we sent then (its own temporary cuts may lift), not only to what it
            # reports enforcing now.
            state.confirmed_tick = msg.budget_tick
            state.confirmed_w = max(msg.budget_w, state.pending.get(msg.budget_tick, 0.0))
            state.pending = {t: w for t, w in state.pending.items() if t > msg.budget_tick}
        return True

    def forget_confirmations(self) -> None:
        """A new epoch (a takeover, or this coordinator leading again): what scopes
        confirmed under an earlier one says nothing about budgets in flight since."""
        for s in self.scopes.values():
            s.confirmed_w, s.confirmed_tick, s.pending = None, -1, {}

    # -- the tick ------------------------------------------------------------------------

    def budgets_in_force(self, wall: float) -> dict[str, float]:
        over = self.overrides.active_budgets(self.policy, wall)
        return {g.name: min(g.budget_w, over.get(g.name, math.inf)) for g in self.policy.groups}

    def step(self, now: float, wall: float, tick_s: float) -> CoordinatorReport:
        t0 = time.perf_counter()
        self.tick_no += 1
        tick = self.tick_no
        groups = self.policy.groups
        budgets = self.budgets_in_force(wall)
        scopes = list(self.scopes.values())
        silent = [now - s.heard_at > SILENT_TICKS * tick_s for s in scopes]
        # The split works on GPU caps: each scope's root budget less what it holds besides
        # (overhead, reserve for GPUs not reported: its report's offset).
        off = np.array(
            [s.report.offset_w if s.report is not None else s.overhead_w for s in scopes]
        )
        curves: list[DemandCurve | None] = []
        for s, quiet, o in zip(scopes, silent, off.tolist(), strict=True):
            r = s.report
            curves.append(None if quiet or r is None or not r.curve_budget_w else _curve(r, o))
        # A scope without a curve keeps its failsafe budget reserved (it gets nothing).
        fixed = np.array([max(0.0, s.failsafe_w - s.overhead_w) for s in scopes])
        below = self._upper_sums(off.tolist())
        upper = UpperTree(
            parent=self._upper_parent,
            capacity_w=np.array(
                [
                    budgets[groups[i].name] - self.upper_overhead_w[i] - below[k]
                    for k, i in enumerate(self.upper)
                ]
            ),
            scope_parent=self._scope_parent,
            scope_capacity_w=np.array([budgets[groups[s.group].name] for s in scopes]) - off,
            groups=np.array(self.upper, dtype=np.int64),
            scopes=np.array([s.group for s in scopes], dtype=np.int64),
        )
        split = split_budgets(upper, curves, fixed_w=fixed)
        targets = split.budget_w + off
        if not np.isfinite(targets).all():
            # Curves the split could not use (absurd prices): every scope at its failsafe
            # budget, which fits every group above, until the curves make sense again.
            bad = np.flatnonzero(~np.isfinite(targets)).tolist()
            log.error("split_failed", scopes=[scopes[k].name for k in bad])
            split = split_budgets(upper, [None] * len(scopes), fixed_w=fixed)
            targets = split.budget_w + off
        solve_ms = (time.perf_counter() - t0) * 1000.0
        upper_cap = {i: budgets[groups[i].name] - self.upper_overhead_w[i] for i in self.upper}
        plans = self._plan(tick, scopes, targets, upper_cap, silent)
        committed = self._upper_sums([s.committed_w() for s in scopes])
        return CoordinatorReport(
            tick=tick,
            budgets=tuple(plans),
            group_names=tuple(groups[i].name for i in self.upper),
            group_budget_w=tuple(budgets[groups[i].name] for i in self.upper),
            group_committed_w=tuple(
                committed[k] + self.upper_overhead_w[i] for k, i in enumerate(self.upper)
            ),
            solve_ms=solve_ms,
            waiting=tuple(s.name for s, c in zip(scopes, curves, strict=True) if c is None),
            exact=bool(split.exact),
        )

    def _upper_sums(self, per_scope: list[float]) -> list[float]:
        """Σ of a per-scope value under each upper group (in `self.upper` order)."""
        groups = self.policy.groups
        totals = dict.fromkeys(self.upper, 0.0)
        for s, v in zip(self.scopes.values(), per_scope, strict=True):
            i = groups[s.group].parent
            while i >= 0:
                totals[i] += v
                i = groups[i].parent
        return [totals[i] for i in self.upper]

    def _plan(
        self,
        tick: int,
        scopes: list[ScopeState],
        targets: np.ndarray,
        upper_cap: dict[int, float],
        silent: list[bool],
    ) -> list[ScopeBudgetPlan]:
        """The budgets to send: none to a scope not heard (its budget in force is unknown:
        anything could be a raise; its lease brings it to at most its failsafe budget);
        to every other scope at most the budget it was last sent (a hold or a cut), and a
        raise above that only to a scope that has confirmed a budget of ours, in order of
        the price it fetches, and only while every group above, with what every scope may
        draw (`committed_w`), still fits afterwards. While a cut is still in flight (what
        the scopes may draw does not fit yet) nothing rises, not even back up to what a
        scope may still draw: the cut is obeyed first, and once obeyed it stays obeyed."""
        groups = self.policy.groups
        committed = [s.committed_w() for s in scopes]
        last = [s.last_sent_w() for s in scopes]
        send: list[float | None] = []
        for t, was, quiet in zip(targets.tolist(), last, silent, strict=True):
            send.append(None if quiet or was is None else min(t, was))
        used = dict(zip(self.upper, self._upper_sums(committed), strict=True))
        order = sorted(
            range(len(scopes)),
            key=lambda k: -_price_at(scopes[k].report, float(targets[k])),
        )
        held = [False] * len(scopes)
        for k in order:
            base = send[k]
            want = float(targets[k]) - (committed[k] if base is None else base)
            if want <= TOL_W:
                continue
            if scopes[k].confirmed_w is None or base is None:
                held[k] = True
                continue
            room = math.inf
            path = []
            i = groups[scopes[k].group].parent
            while i >= 0:
                room = min(room, upper_cap[i] - used[i])
                path.append(i)
                i = groups[i].parent
            if room < -TOL_W:
                held[k] = True  # a cut above is still in flight
                continue
            # Up to what it may draw already costs nothing more; past that, the room.
            up = max(0.0, min(want, committed[k] + max(0.0, room) - base))
            held[k] = up < want - TOL_W
            if up > TOL_W:
                send[k] = base + up
                grew = max(0.0, base + up - committed[k])
                committed[k] = max(committed[k], base + up)
                for i in path:
                    used[i] += grew
        plans = []
        for k, s in enumerate(scopes):
            budget = send[k]
            if budget is not None:
                s.pending[tick] = budget
            plans.append(
                ScopeBudgetPlan(
                    scope=s.name,
                    budget_w=budget,
                    target_w=float(targets[k]),
                    committed_w=s.committed_w(),
                    held=held[k],
                    silent=silent[k] or s.report is None,
                )
            )
        return plans


def _curve(r: ScopeReport, offset_w: float) -> DemandCurve:
    """The report's curve in GPU-cap watts (the split's terms)."""
    budget = np.asarray(r.curve_budget_w, dtype=np.float64) - offset_w
    lo = r.curve_exact_lo_w if r.curve_exact_lo_w is not None else r.curve_budget_w[0]
    hi = r.curve_exact_hi_w if r.curve_exact_hi_w is not None else r.curve_budget_w[-1]
    return DemandCurve(
        budget_w=budget,
        price=np.asarray(r.curve_price, dtype=np.float64),
        exact_lo_w=lo - offset_w,
        exact_hi_w=hi - offset_w,
    )


def _price_at(r: ScopeReport | None, budget_w: float) -> float:
    """The marginal value of the scope's budget at `budget_w` (raises go to the dearest)."""
    if r is None or not r.curve_budget_w:
        return -math.inf
    v = np.interp(budget_w, r.curve_budget_w, r.curve_price)
    return finite_or_none(float(v)) or 0.0
