"""A controller that steers one scope (a row or rack of the policy) under a coordinator.

`powerd controller --scope NAME` steers only the subtree under group NAME. Its budget at
NAME comes from the coordinator (`ScopeBudget`, docs/protocol.md), and it reports back each
tick (`ScopeReport`): the budget it enforces, what its caps commit, and its demand curve.

The budget in force at the scope's root, in order:

- the coordinator's latest budget (ordered by (epoch, tick); a lower epoch is refused),
  while its lease runs (`lease_s` from its arrival, on our clock);
- once that lapses, min(that budget, the scope's failsafe budget): the failsafe budget is
  what the failsafe caps of its GPUs plus overhead take, and the policy proves that every
  scope at its failsafe budget fits every budget above. Taking the lower of the two never
  raises a scope on a coordinator's silence, so scopes whose leases lapse at different
  moments never add up to more than the coordinator planned;
- after a start, before any budget is heard: nothing is commanded for one budget lease
  (the coordinator may have given this scope less than its failsafe budget, and the other
  scopes may still hold theirs); then the failsafe budget, since by then every other
  scope's budget has lapsed to at most its own failsafe budget too.

The policy's own budget at NAME (and temporary budgets on it) still apply: the lowest wins.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from powerd.wire import ScopeBudget


@dataclass(frozen=True)
class BudgetInForce:
    budget_w: float | None  # None: none yet (the scope waits, commanding nothing)
    epoch: int | None  # of the coordinator budget in force (None: failsafe, or none)
    tick: int | None
    source: str  # "coordinator", "failsafe" or "waiting"


class ScopeLink:
    """The scope's side of the coordinator's budgets (leader and standby alike hear them)."""

    def __init__(self, name: str, failsafe_w: float, *, lease_s: float, started_at: float) -> None:
        self.name = name
        self.failsafe_w = failsafe_w
        self.lease_s = lease_s  # until a budget says its own
        self.started_at = started_at
        self.last: ScopeBudget | None = None
        self.received_at = -math.inf
        self.refused = 0  # budgets of a lower epoch, or not newer

    def on_budget(self, msg: ScopeBudget, now: float) -> bool:
        """Take a budget that is newer by (epoch, tick); False (counted) otherwise."""
        if msg.scope != self.name:
            return False
        last = self.last
        if last is not None and (msg.epoch, msg.tick) <= (last.epoch, last.tick):
            self.refused += 1
            return False
        self.last = msg
        self.received_at = now
        return True

    def in_force(self, now: float) -> BudgetInForce:
        last = self.last
        if last is not None and now < self.received_at + last.lease_s:
            return BudgetInForce(last.budget_w, last.epoch, last.tick, "coordinator")
        if last is not None:
            return BudgetInForce(min(last.budget_w, self.failsafe_w), None, None, "failsafe")
        if now < self.started_at + self.lease_s:
            return BudgetInForce(None, None, None, "waiting")
        return BudgetInForce(self.failsafe_w, None, None, "failsafe")
