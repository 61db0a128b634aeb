"""The coordinator's rules one level up, without a broker: which budgets it sends, when a
raise waits for the cut that pays for it, and how a scope's controller takes budgets
(ordering, lease, failsafe)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from powerd.controller.overrides import BudgetOverride
from powerd.controller.scope import ScopeLink
from powerd.coordinator.main import Coordinator
from powerd.coordinator.split import BudgetSplitter
from powerd.policy import Policy, failsafe_budget_w, parse_policy, scoped
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.wire import ScopeBudget, ScopeReport

EPOCH = 3
TICK_S = 1.0


def rack(k: int) -> dict[str, object]:
    return {"name": f"rack-{k}", "nodes": [{"name": f"r{k}-n{{1..2}}", "overhead_w": 100}]}


def site(facility_w: float = 10_000.0) -> Policy:
    """Two racks of two 4-GPU nodes under one facility budget."""
    return parse_policy(
        {
            "version": 1,
            "facility": {
                "name": "dc",
                "budget_w": facility_w,
                "rows": [
                    {
                        "name": "row",
                        "racks": [
                            {
                                "name": "rack-1",
                                "nodes": [{"name": "r1-n{1..2}", "overhead_w": 100}],
                            },
                            {
                                "name": "rack-2",
                                "nodes": [{"name": "r2-n{1..2}", "overhead_w": 100}],
                            },
                        ],
                    }
                ],
            },
            **TRAIN_AND_INFER,
            "defaults": {"class": "training", "failsafe_w": 250.0, "gpus_per_node": 4},
        }
    )


def report(
    scope: str,
    *,
    budget_w: float,
    committed_w: float,
    tick: int | None = None,
    epoch: int | None = EPOCH,
    price: float = 1.0,
    hi_w: float = 6000.0,
) -> ScopeReport:
    """A scope that wants everything up to hi_w at a flat price (linear value)."""
    lo_w = 2 * (4 * 200.0 + 100)
    return ScopeReport(
        scope=scope,
        tick=1,
        budget_epoch=None if tick is None else epoch,
        budget_tick=tick,
        budget_w=budget_w,
        committed_w=committed_w,
        failsafe_w=2 * (4 * 250.0 + 100),
        lo_w=lo_w,
        hi_w=hi_w,
        curve_budget_w=[lo_w, hi_w],
        curve_price=[price, price],
    )


def settled() -> BudgetSplitter:
    """Both racks at 5000 W, confirmed under our epoch (tick 1)."""
    eng = BudgetSplitter(site(), "rack")
    for s in ("rack-1", "rack-2"):
        eng.on_report(report(s, budget_w=5000, committed_w=5000), 0.0, EPOCH)
    eng.step(0.0, 0.0, TICK_S)
    for s in ("rack-1", "rack-2"):
        eng.on_report(report(s, budget_w=5000, committed_w=5000, tick=1), 0.5, EPOCH)
    return eng


def sent(plan: object) -> dict[str, float | None]:
    return {p.scope: p.budget_w for p in plan.budgets}  # type: ignore[attr-defined]


def test_unheard_scopes_get_nothing_and_unconfirmed_ones_only_holds_or_cuts() -> None:
    eng = BudgetSplitter(site(), "rack")
    first = eng.step(0.0, 0.0, TICK_S)
    assert sent(first) == {"rack-1": None, "rack-2": None}
    assert set(first.waiting) == {"rack-1", "rack-2"}
    # Both report what a predecessor gave them: 5000 W each (one may still get more).
    for s in ("rack-1", "rack-2"):
        assert eng.on_report(report(s, budget_w=5000, committed_w=4000), 1.0, EPOCH)
    plan = eng.step(1.0, 1.0, TICK_S)
    # The split gives each 5000 W of the 10 kW; nothing above what they enforce is sent.
    for p in plan.budgets:
        assert p.budget_w is not None and p.budget_w <= 5000 + 1e-6
        assert p.committed_w == pytest.approx(eng.scopes[p.scope].max_w)  # not confirmed


def test_a_raise_waits_until_the_cut_that_pays_for_it_is_confirmed() -> None:
    eng = settled()
    # rack-2's work is worth twice as much now: the split moves power to it.
    eng.on_report(report("rack-1", budget_w=5000, committed_w=5000, tick=1, price=1.0), 1.0, EPOCH)
    eng.on_report(report("rack-2", budget_w=5000, committed_w=5000, tick=1, price=2.0), 1.0, EPOCH)
    plan = eng.step(1.0, 1.0, TICK_S)  # tick 2
    b = {p.scope: p for p in plan.budgets}
    assert b["rack-1"].budget_w is not None and b["rack-1"].budget_w < 5000  # the cut: at once
    assert b["rack-2"].budget_w == pytest.approx(5000)  # the raise waits
    assert b["rack-2"].held
    # rack-1 obeys (its caps fit the new budget) and says so: now rack-2 rises.
    cut = b["rack-1"].budget_w
    assert cut is not None
    eng.on_report(
        report("rack-1", budget_w=cut, committed_w=cut - 50, tick=2, price=1.0), 1.5, EPOCH
    )
    eng.on_report(report("rack-2", budget_w=5000, committed_w=5000, tick=2, price=2.0), 1.5, EPOCH)
    plan = eng.step(2.0, 2.0, TICK_S)
    b = {p.scope: p for p in plan.budgets}
    assert b["rack-2"].budget_w is not None and b["rack-2"].budget_w > 5000
    # What every scope may draw still fits the facility.
    total = sum(s.committed_w() for s in eng.scopes.values())
    assert total <= 10_000 + 1e-6


def test_a_silent_scope_keeps_its_reservation_and_gets_nothing() -> None:
    eng = settled()
    # rack-2 goes quiet; rack-1 keeps reporting and would like everything.
    for t in range(2, 8):
        eng.on_report(
            report("rack-1", budget_w=5000, committed_w=5000, tick=t - 1, price=5.0),
            float(t),
            EPOCH,
        )
        plan = eng.step(float(t), float(t), TICK_S)
    b = {p.scope: p for p in plan.budgets}
    assert b["rack-2"].budget_w is None and b["rack-2"].silent
    # rack-2 may still draw its 5000 W: rack-1 cannot have it.
    assert b["rack-1"].budget_w is not None and b["rack-1"].budget_w <= 5000 + 1e-6


def test_a_temporary_facility_cut_is_split_and_sent_at_once() -> None:
    eng = settled()
    eng.overrides.set_budget(
        eng.policy, BudgetOverride("dc", 6000.0, None, "grid", "alice", created_at=0.0)
    )
    plan = eng.step(1.0, 1.0, TICK_S)
    budgets = [p.budget_w for p in plan.budgets]
    assert all(b is not None for b in budgets)
    assert sum(b for b in budgets if b is not None) <= 6000 + 1e-6


def test_the_coordinators_state_keeps_an_operators_budget_in_its_stored_form() -> None:
    """The coordinator stores its operators' budgets like the controller (BudgetState.of):
    a field the runtime override grew (a monotonic expiry) once made every budget PUT on
    the coordinator fail with a 500 (caught by tests/test_scopes.py)."""
    eng = settled()
    override = BudgetOverride("dc", 6000.0, 2000.0, "grid", "alice", created_at=1.0)
    eng.overrides.set_budget(eng.policy, override.anchored(now_wall=1.0, now_mono=50.0))
    owner = SimpleNamespace(revision=3, clock=SimpleNamespace(wall=lambda: 10.0), splitter=eng)
    state = Coordinator._state(owner)  # type: ignore[arg-type]
    assert [(b.group, b.budget_w, b.expires_at) for b in state.budgets] == [("dc", 6000.0, 2000.0)]
    assert state.revision == 3


def test_a_scope_takes_budgets_in_epoch_then_tick_order_and_falls_back_on_silence() -> None:
    policy = site()
    f = failsafe_budget_w(policy, "rack-1")
    assert f == 2 * (4 * 250 + 100)
    link = ScopeLink("rack-1", f, lease_s=10.0, started_at=0.0)
    # Before any budget: wait one lease, then the failsafe budget.
    assert link.in_force(1.0).budget_w is None
    assert link.in_force(10.0).budget_w == f
    b = ScopeBudget(scope="rack-1", budget_w=1500, tick=7, epoch=2, lease_s=3.0)
    assert link.on_budget(b, 11.0)
    assert link.in_force(12.0).budget_w == 1500
    # Older ticks and lower epochs are refused; a higher epoch is taken at any tick.
    assert not link.on_budget(b.model_copy(update={"tick": 6, "budget_w": 9000}), 12.0)
    assert not link.on_budget(b.model_copy(update={"epoch": 1, "tick": 99}), 12.0)
    assert link.refused == 2
    assert link.on_budget(b.model_copy(update={"epoch": 3, "tick": 1, "budget_w": 3000}), 12.5)
    assert link.in_force(13.0).budget_w == 3000
    # The coordinator goes silent: min(last budget, failsafe budget), never a raise.
    assert link.in_force(15.6).budget_w == min(3000, f)
    assert link.in_force(15.6).source == "failsafe"
    link2 = ScopeLink("rack-1", f, lease_s=10.0, started_at=0.0)
    link2.on_budget(b, 1.0)  # 1500 W, below the failsafe budget
    assert link2.in_force(100.0).budget_w == 1500


def test_a_scope_policy_lifts_the_budgets_above_it() -> None:
    policy = site(facility_w=7000.0)
    sub = scoped(policy, "rack-2")
    names = [g.name for g in sub.groups]
    assert names == ["dc", "row", "rack-2", "r2-n1", "r2-n2"]
    assert math.isinf(sub.groups[0].budget_w)  # the coordinator's to decide
    with pytest.raises(ValueError, match="row or a rack"):
        scoped(policy, "dc")
    with pytest.raises(ValueError, match="not a group"):
        scoped(policy, "rack-9")


def test_a_scope_under_its_own_lower_cut_still_counts_at_the_budget_it_was_sent() -> None:
    """A scope enforcing a temporary cut of its own (below our budget) may rise to our
    budget when that cut ends: it is counted at what we sent, not at what it reports."""
    eng = settled()
    plan = eng.step(1.0, 1.0, TICK_S)
    sent_w = {p.scope: p.budget_w for p in plan.budgets}
    assert sent_w["rack-1"] is not None
    eng.on_report(report("rack-1", budget_w=3000, committed_w=2900, tick=plan.tick), 1.5, EPOCH)
    assert eng.scopes["rack-1"].committed_w() >= sent_w["rack-1"] - 1e-6


def test_absurd_prices_are_refused_on_the_wire() -> None:
    from pydantic import ValidationError

    body = report("rack-1", budget_w=5000, committed_w=5000).model_dump()
    with pytest.raises(ValidationError, match="curve_price"):
        ScopeReport.model_validate(body | {"curve_price": [1e308, -1e308]})


# -- a property: scopes that take budgets late, obey them late and report late ------------


@dataclass
class LateScope:
    """A scope's controller as the coordinator sees it through the broker: budgets arrive
    in order but late, its caps follow a cut only once acknowledged (until then it may
    still draw the higher budget), and its reports arrive in order but late."""

    name: str
    applied_w: float  # the budget in force
    applied_tick: int | None = None
    draw_w: float = 0.0  # the most its caps may draw now
    inbox: list[tuple[int, float]] = field(default_factory=list)  # budgets in flight
    outbox: list[ScopeReport] = field(default_factory=list)  # reports in flight
    price: float = 1.0

    def receive(self) -> None:
        if self.inbox:
            tick, budget = self.inbox.pop(0)
            if self.applied_tick is None or tick > self.applied_tick:
                self.applied_w, self.applied_tick = budget, tick
                self.draw_w = max(self.draw_w, budget)  # a raise: at once; a cut: later

    def may_draw_w(self) -> float:
        """What its caps may draw now or once the budgets in flight arrive."""
        late = [b for t, b in self.inbox if self.applied_tick is None or t > self.applied_tick]
        return max([self.draw_w, *late])

    def settle(self) -> None:
        self.draw_w = self.applied_w  # the cuts acknowledged

    def report(self) -> None:
        self.outbox.append(
            report(
                self.name,
                budget_w=self.applied_w,
                committed_w=self.draw_w,
                tick=self.applied_tick,
                price=self.price,
            )
        )


@pytest.mark.slow  # seconds of CPU: a thousand examples
@settings(max_examples=1000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    events=st.lists(
        st.tuples(
            st.sampled_from(["tick", "receive", "settle", "report", "deliver", "price", "cap"]),
            st.integers(0, 1),
            st.floats(0.2, 5.0),
        ),
        min_size=20,
        max_size=150,
    )
)
def test_budgets_above_the_scopes_hold_through_late_budgets_acks_and_reports(
    events: list[tuple[str, int, float]],
) -> None:
    """Whatever the order in which budgets arrive, cuts are acknowledged and reports come
    back, what the scopes may draw (their caps, and the budgets in flight to them) never
    exceeds the facility's budget once it has fit under it (a cut, once obeyed, stays
    obeyed), and never rises above what it was when the budget last changed."""
    eng = BudgetSplitter(site(), "rack")
    scopes = [LateScope(f"rack-{k}", 5000.0, draw_w=5000.0) for k in (1, 2)]
    cap = 10_000.0
    fitted = True  # Σ draw has fit the current budget since it last changed
    peak = 10_000.0  # Σ draw when the budget last changed
    now = 0.0
    for kind, k, x in events:
        s = scopes[k]
        if kind == "tick":
            now += 1.0
            for sc in scopes:
                while sc.outbox:
                    eng.on_report(sc.outbox.pop(0), now, EPOCH)
            plan = eng.step(now, now, TICK_S)
            for p, sc in zip(plan.budgets, scopes, strict=True):
                if p.budget_w is not None:
                    sc.inbox.append((plan.tick, p.budget_w))
        elif kind == "receive":
            s.receive()
        elif kind == "settle":
            s.settle()
        elif kind == "report":
            s.report()
        elif kind == "deliver":
            while s.outbox:
                eng.on_report(s.outbox.pop(0), now, EPOCH)
        elif kind == "price":
            s.price = x
        else:  # the facility's budget set anywhere between 4 and 10 kW
            cap = 4000.0 + 6000.0 * (x - 0.2) / 4.8
            eng.overrides.set_budget(
                eng.policy, BudgetOverride("dc", cap, None, "grid", "test", created_at=now)
            )
            peak = sum(sc.may_draw_w() for sc in scopes)
            fitted = peak <= cap + 1e-6
        total = sum(sc.may_draw_w() for sc in scopes)
        assert total <= max(cap, peak) + 1e-6, (kind, total, cap, peak)
        if fitted:
            assert total <= cap + 1e-6, (kind, total, cap)
        fitted = fitted or total <= cap + 1e-6
