"""Scheduled budgets and ramps on the tick engine (no broker, no clock): the facility's
committed caps move no faster than the policy's ramp except for immediate cuts, reach a
scheduled target by its start, ramp back up after its end, and a wall-clock step can
neither shorten a window nor lift a budget."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.honest import NODES, HonestNode, policy_dict

from powerd.controller.opstate import OperatorState, capture, restore
from powerd.controller.overrides import (
    BudgetOverride,
    NotFound,
    OverrideError,
    ScheduledBudget,
)
from powerd.controller.tick import TickEngine
from powerd.policy import PolicyError, RampRates, parse_policy
from powerd.ramp import BudgetRamp, ramp_down_from, window_ceiling_w

UP, DOWN = 150.0, 250.0  # W/s
TOL = 1e-6
WALL0 = 1_700_000_000.0
FACILITY_W = 7000.0


def ramp_policy(**control: Any) -> Any:
    d = policy_dict()
    d["control"] = {**d["control"], "ramp_w_per_s": {"up": UP, "down": DOWN}, **control}
    return parse_policy(d)


@dataclass
class Site:
    """The honest site under one engine; `tick` runs one tick at t seconds (monotonic),
    the wall clock at `WALL0 + t + wall_shift`, every node acknowledging at once."""

    engine: TickEngine
    nodes: dict[str, HonestNode] = field(default_factory=lambda: {n: HonestNode(n) for n in NODES})
    wall_shift: float = 0.0
    committed: list[float] = field(default_factory=list)  # facility, after the acks
    budget: list[float] = field(default_factory=list)  # facility, in force

    def wall(self, t: float) -> float:
        return WALL0 + t + self.wall_shift

    def tick(self, t: float) -> None:
        e = self.engine
        for node in self.nodes.values():
            assert e.on_telemetry(node.sample(self.wall(t)), t)
        report, plan = e.step(t, self.wall(t))
        for cmd in plan.commands:
            ack = self.nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                e.on_ack(cmd.node, ack)
        assert e.shape is not None
        topo = e.shape.topology
        committed = topo.group_sums(e.planner.committed_w()) + topo.overhead_w
        # Every budget in force holds once the tick's commands are acknowledged.
        assert (committed <= report.group_budget_w + TOL).all()
        self.committed.append(float(committed[0]))
        self.budget.append(float(report.group_budget_w[0]))

    def schedule(self, t: float, budget_w: float, start: float, end: float | None) -> str:
        """A window given in wall times, accepted at monotonic time t."""
        sid = f"s-{len(self.engine.overrides.schedules)}"
        entry = ScheduledBudget(sid, "dc", budget_w, start, end, "DR", "test", self.wall(t))
        self.engine.overrides.add_schedule(
            self.engine.policy, entry.on_monotonic(self.wall(t), t), self.wall(t)
        )
        return sid


def warm(site: Site, ticks: int = 8) -> None:
    for t in range(ticks):
        site.tick(float(t))
    assert site.committed[-1] == pytest.approx(FACILITY_W, abs=1.0)


@pytest.mark.slow  # seconds of CPU: many ramps
@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    target=st.floats(3600.0, 6800.0),
    lead=st.integers(1, 40),
    length=st.integers(1, 30),
    cut_at=st.one_of(st.none(), st.integers(0, 60)),
    cut_w=st.floats(3400.0, 6500.0),
    cut_for=st.integers(1, 20),
)
def test_committed_total_moves_within_the_ramp_and_reaches_the_target_on_time(
    target: float, lead: int, length: int, cut_at: int | None, cut_w: float, cut_for: int
) -> None:
    site = Site(TickEngine(ramp_policy()))
    warm(site)
    t0 = 8
    start = site.wall(t0) + lead
    end = start + length
    site.schedule(t0, target, start, end)
    immediate: set[int] = set()  # ticks (index into committed) where a cut went at once
    rates = RampRates(up=UP, down=DOWN)
    if ramp_down_from(FACILITY_W, target, start, rates, 2.0) < site.wall(t0):
        # Scheduled too soon to ramp all the way: it steps to where the ramp stands now.
        immediate.add(len(site.committed))
    last = max(lead + length, 0 if cut_at is None else cut_at + cut_for)
    horizon = t0 + last + math.ceil(FACILITY_W / UP) + 5
    for t in range(t0, horizon):
        if cut_at is not None and t == t0 + cut_at:
            site.engine.overrides.set_budget(
                site.engine.policy,
                BudgetOverride("dc", cut_w, None, "safety", "ops", site.wall(t)),
            )
            immediate.add(len(site.committed))
        if cut_at is not None and t == t0 + cut_at + cut_for:
            site.engine.overrides.clear_budget("dc")
        site.tick(float(t))
        wall = site.wall(t)
        if start <= wall < end:
            # The scheduled target holds from its start: the ramp began early enough.
            assert site.committed[-1] <= target + TOL
    steps = np.diff(np.array(site.committed[7:]))  # from the last warm tick on (1 s apart)
    for k, step in enumerate(steps.tolist(), start=8):
        assert step <= UP + TOL, f"rose {step:.1f} W in a tick at {k}"
        if k not in immediate:
            assert step >= -DOWN - TOL, f"fell {-step:.1f} W in a tick at {k}"
    # After the window (and any cut) the budget is back to the policy's, reached by ramp.
    assert site.committed[-1] == pytest.approx(FACILITY_W, abs=1.0)


def test_a_cut_starts_early_enough_and_ramps_back_after_its_end() -> None:
    site = Site(TickEngine(ramp_policy()))
    warm(site)
    start, end = site.wall(8) + 30, site.wall(8) + 40
    site.schedule(8, 4500.0, start, end)
    # 2,500 W at 250 W/s: 10 s, ending two ticks (send, acknowledge) before the start.
    begins = ramp_down_from(FACILITY_W, 4500.0, start, RampRates(up=UP, down=DOWN), 2.0)
    assert begins == pytest.approx(start - 12.0)
    site.engine.alarms.take()
    for t in range(8, 80):
        site.tick(float(t))
    # A ramp's step down, its cut on the way, is not `budget_over` (an immediate cut is).
    assert [c.kind for c in site.engine.alarms.take()] == []
    budget = dict(zip(range(8, 80), site.budget[8:], strict=True))
    # Nothing moves before the ramp's start; the target is in force from start - 2 ticks.
    assert budget[8 + 18] == pytest.approx(FACILITY_W)
    assert budget[8 + 19] == pytest.approx(FACILITY_W - DOWN)
    assert budget[8 + 28] == pytest.approx(4500.0)
    assert budget[8 + 39] == pytest.approx(4500.0)
    assert budget[8 + 41] == pytest.approx(4500.0 + UP)
    assert budget[79] == pytest.approx(FACILITY_W)
    # Over and ramped out: the entry is gone.
    assert site.engine.overrides.schedules == {}


def test_an_immediate_cut_goes_at_once_and_its_end_ramps_up() -> None:
    site = Site(TickEngine(ramp_policy()))
    warm(site)
    engine = site.engine
    engine.overrides.set_budget(
        engine.policy, BudgetOverride("dc", 4000.0, None, "overload", "ops", site.wall(8))
    )
    site.tick(8.0)
    assert site.committed[-1] <= 4000.0 + TOL  # at once: one tick
    assert "budget_over" in engine.alarms.active  # until the cut is acknowledged
    engine.overrides.clear_budget("dc")
    for t in range(9, 40):
        site.tick(float(t))
    rises = np.diff(np.array(site.committed[8:]))
    assert rises.max() <= UP + TOL and rises.max() > UP / 2
    assert site.committed[-1] == pytest.approx(FACILITY_W, abs=1.0)


def test_without_ramp_rates_a_window_is_a_step() -> None:
    site = Site(TickEngine(parse_policy(policy_dict())))
    warm(site)
    start = site.wall(8) + 5
    site.schedule(8, 4500.0, start, start + 5)
    for t in range(8, 16):
        site.tick(float(t))
    # In force two ticks before its start (send, acknowledge), off at its end: steps.
    assert site.budget[8:16] == pytest.approx([7000.0] * 3 + [4500.0] * 5)
    for t in range(16, 19):
        site.tick(float(t))
    assert site.budget[16:19] == pytest.approx([4500.0, 4500.0, 7000.0])


@pytest.mark.parametrize("step_s", [-3600.0, 3600.0])
def test_a_wall_clock_step_neither_shortens_a_window_nor_lifts_a_budget(step_s: float) -> None:
    site = Site(TickEngine(ramp_policy()))
    warm(site)
    start = site.wall(8) + 20
    site.schedule(8, 4500.0, start, start + 20)
    for t in range(8, 30):
        site.tick(float(t))
    assert site.budget[-1] == pytest.approx(4500.0)
    site.engine.alarms.take()
    site.wall_shift = step_s  # the wall clock steps in the middle of the window
    for t in range(30, 40):
        site.tick(float(t))
        # Until its end on the monotonic clock (t 48), the window binds.
        assert site.budget[-1] <= 4500.0 + TOL
    kinds = [c.kind for c in site.engine.alarms.take()]
    assert kinds.count("wall_clock_step") == 1
    for t in range(40, 48):
        site.tick(float(t))
        assert site.budget[-1] <= 4500.0 + TOL
    # Never above the policy's budget, whatever the clocks say.
    for t in range(48, 120):
        site.tick(float(t))
        assert site.budget[-1] <= FACILITY_W + TOL
    assert site.budget[-1] == pytest.approx(FACILITY_W)
    # Set back an hour, the wall reading has the window still ahead: it binds again then
    # (a cut repeated, never one cut short); stepped forward, both readings are past it.
    assert bool(site.engine.overrides.schedules) is (step_s < 0)


def test_window_shape_is_within_the_rates() -> None:
    rates = RampRates(up=UP, down=DOWN)
    ts = np.linspace(-100.0, 200.0, 3001)
    values = np.array(
        [
            min(
                window_ceiling_w(3000.0, 0.0, 50.0, t, rates, lead_s=1.0),
                window_ceiling_w(5000.0, 40.0, 100.0, t, rates, lead_s=1.0),
            )
            for t in ts
        ]
    )
    slopes = np.diff(values) / np.diff(ts)
    assert slopes.max() <= UP + 1e-6 and slopes.min() >= -DOWN - 1e-6
    assert values[ts.searchsorted(-1.0)] == pytest.approx(3000.0)


def test_budget_ramp_ends_where_nothing_more_can_be_committed() -> None:
    ramp = BudgetRamp()
    names = ("a",)
    rates = RampRates(up=10.0, down=10.0)
    most = np.array([100.0])
    assert ramp.step(names, np.array([50.0]), 0.0, rates, most).tolist() == [50.0]
    assert ramp.step(names, np.array([np.inf]), 1.0, rates, most).tolist() == [60.0]
    # Past all it could commit, an unlimited group is unlimited again, not ramping forever.
    for t in range(2, 6):
        ramp.step(names, np.array([np.inf]), float(t), rates, most)
    assert ramp.step(names, np.array([np.inf]), 6.0, rates, most).tolist() == [np.inf]


def test_schedules_are_validated() -> None:
    policy = ramp_policy()
    engine = TickEngine(policy)
    o = engine.overrides
    now = WALL0

    def entry(sid: str, **kw: Any) -> ScheduledBudget:
        base: dict[str, Any] = {
            "id": sid,
            "group": "dc",
            "budget_w": 5000.0,
            "start": now + 600,
            "end": now + 1200,
            "reason": "DR",
            "actor": "a",
            "created_at": now,
        }
        return ScheduledBudget(**(base | kw)).on_monotonic(now, 0.0)

    with pytest.raises(NotFound):
        o.add_schedule(policy, entry("x", group="nowhere"), now)
    for bad in (
        {"budget_w": 8000.0},  # above the policy's
        {"start": now - 3600},  # in the past
        {"end": now + 300},  # before its start
        {"start": now + 400 * 86400, "end": None},  # too far ahead
        {"end": now + 600 + 40 * 86400},  # too long
    ):
        with pytest.raises(OverrideError):
            o.add_schedule(policy, entry("x", **bad), now)
    o.add_schedule(policy, entry("s0", start=now - 30), now)  # within the grace
    for i in range(1, 64):
        o.add_schedule(policy, entry(f"s{i}"), now)
    with pytest.raises(OverrideError, match="64"):
        o.add_schedule(policy, entry("s64"), now)
    with pytest.raises(OverrideError, match="exists"):
        o.cancel_schedule("s1") and o.add_schedule(policy, entry("s2"), now)
    with pytest.raises(NotFound):
        o.cancel_schedule("s1")


def test_ramp_rates_are_validated() -> None:
    d = policy_dict()
    d["control"]["ramp_w_per_s"] = {"up": 0, "down": 100}
    with pytest.raises(PolicyError, match="ramp_w_per_s"):
        parse_policy(d)
    d["control"]["ramp_w_per_s"] = {"up": 100}
    with pytest.raises(PolicyError, match="down"):
        parse_policy(d)


def test_restore_converts_wall_times_again_and_the_tick_drops_finished_windows() -> None:
    policy = ramp_policy()
    engine = TickEngine(policy)
    o = engine.overrides
    for sid, start, end in (("live", WALL0 + 100, WALL0 + 200), ("old", WALL0 + 10, WALL0 + 20)):
        o.add_schedule(
            policy,
            ScheduledBudget(sid, "dc", 5000.0, start, end, "DR", "a", WALL0).on_monotonic(
                WALL0, 5.0
            ),
            WALL0,
        )
    state = OperatorState(**capture(o))
    # A new process, 100 s later by the wall clock, its monotonic clock elsewhere: "old"
    # has ended and ramped out (2,000 W at 150 W/s); "live" is anchored anew. A restore
    # keeps both (a standby's clock decides nothing); the tick's budgets drop "old".
    back = restore(
        OperatorState.model_validate_json(state.model_dump_json()), policy, WALL0 + 100, 1e6
    )
    assert set(back.schedules) == {"live", "old"}
    back.scheduled_budgets(policy, 1e6, WALL0 + 100, 1.0)
    assert set(back.schedules) == {"live"}
    live = back.schedules["live"]
    assert (live.start, live.end) == (WALL0 + 100, WALL0 + 200)
    assert (live.start_mono, live.end_mono) == (1e6, 1e6 + 100)


def test_a_forward_wall_step_does_not_end_a_temporary_budget_early() -> None:
    site = Site(TickEngine(ramp_policy()))
    warm(site)
    engine = site.engine
    cut = BudgetOverride("dc", 4000.0, site.wall(8) + 20, "DR", "ops", site.wall(8))
    engine.overrides.set_budget(engine.policy, cut.anchored(site.wall(8), 8.0))
    for t in range(8, 12):
        site.tick(float(t))
    site.wall_shift = 3600.0  # its expiry has passed on the wall clock
    for t in range(12, 28):
        site.tick(float(t))
        assert site.budget[-1] == pytest.approx(4000.0)  # held to its monotonic expiry
    site.tick(28.0)
    assert "dc" not in engine.overrides.budgets
    assert site.budget[-1] == pytest.approx(4000.0 + UP)  # and then ramps back up
