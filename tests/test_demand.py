"""Demand that follows the work: the per-GPU estimator and what the allocator makes of it
(docs/allocator.md, "Demand")."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from powerd.allocator import allocate_arrays
from powerd.allocator.problem import (
    CAP_LIMITED_SHARE,
    GpuArrays,
    build_problem,
    demand_w,
    held_back,
    held_share,
    pressing_cap_w,
)
from powerd.controller.demand import BUCKETS, DemandEstimator
from powerd.policy import DemandSpec, Policy
from powerd.testing.synthetic import make_policy, policy_dict, random_fleet

MAX = np.full(3, 700.0)
FRESH = np.ones(3, dtype=np.bool_)
UUIDS = ("a", "b", "c")


def feed(est: DemandEstimator, draws: list[list[float]], dt: float = 5.0) -> np.ndarray:
    out = None
    for k, row in enumerate(draws):
        out = est.observe(k * dt, UUIDS, np.array(row, dtype=np.float64), MAX, FRESH)
    assert out is not None
    return out


# -- the estimator -------------------------------------------------------------------------


def test_recent_covers_the_swing_the_last_sample_misses() -> None:
    est = DemandEstimator(DemandSpec(window_s=60.0, swing=0.0))
    # GPU a swings 300 ↔ 600 every tick; b is steady; c rose once, 30 s ago.
    rows = [[300.0 if k % 2 else 600.0, 400.0, 500.0 if k == 6 else 250.0] for k in range(13)]
    recent = feed(est, rows)
    assert rows[-1][0] == 600.0 or rows[-1][0] == 300.0
    assert recent[0] == pytest.approx(600.0)  # its peak, whichever sample came last
    assert recent[1] == pytest.approx(400.0)
    assert recent[2] == pytest.approx(500.0)  # still in the window


def test_swing_adds_the_largest_rise_between_samples() -> None:
    est = DemandEstimator(DemandSpec(window_s=60.0, swing=1.0))
    recent = feed(est, [[300.0, 400.0, 250.0], [450.0, 400.0, 250.0], [300.0, 400.0, 250.0]])
    assert recent[0] == pytest.approx(450.0 + 150.0)
    assert recent[1] == pytest.approx(400.0)  # steady: no swing


def test_the_window_forgets_and_the_clock_gap_clears_everything() -> None:
    est = DemandEstimator(DemandSpec(window_s=40.0, swing=0.0))
    feed(est, [[650.0, 650.0, 650.0]])
    recent = est.observe(41.0, UUIDS, np.array([300.0, 300.0, 300.0]), MAX, FRESH)
    assert recent is not None
    np.testing.assert_allclose(recent, 300.0)
    recent = est.observe(1000.0, UUIDS, np.array([200.0, 200.0, 200.0]), MAX, FRESH)
    assert recent is not None
    np.testing.assert_allclose(recent, 200.0)


def test_window_zero_is_the_last_sample() -> None:
    est = DemandEstimator(DemandSpec(window_s=0.0))
    assert est.observe(0.0, UUIDS, np.array([1.0, 2.0, 3.0]), MAX, FRESH) is None


def test_a_gpu_swinging_all_window_is_told_from_one_that_rose_once() -> None:
    est = DemandEstimator(DemandSpec(window_s=40.0))
    assert est.swinging(0.0) is None  # 0: off
    # 1 s samples for 40 s: a swings 200 ↔ 650 W every 4 s; b rose once (at 20 s); c
    # swings by 60 W only.
    for t in range(41):
        a = 650.0 if t % 4 else 200.0
        b = 600.0 if t >= 20 else 250.0
        c = 400.0 if t % 4 else 340.0
        est.observe(float(t), UUIDS, np.array([a, b, c]), MAX, FRESH)
    swinging = est.swinging(100.0)
    assert swinging is not None
    assert swinging.tolist() == [True, False, False]
    assert est.swinging(50.0).tolist() == [True, False, True]  # type: ignore[union-attr]
    # It stops swinging: within two slices of the window it no longer reads as swinging.
    for t in range(41, 41 + 12):
        est.observe(float(t), UUIDS, np.array([200.0, 600.0, 400.0]), MAX, FRESH)
    assert est.swinging(100.0).tolist() == [False, False, False]  # type: ignore[union-attr]
    assert DemandEstimator(DemandSpec(window_s=0.0)).swinging(100.0) is None


def test_a_swing_that_comes_up_in_steps_is_still_a_swing() -> None:
    # A synchronous job's GPU under a feed that binds: its cap is cut in the low phase and
    # raised again by the next ticks, so its draw climbs back in steps under 100 W each
    # (250 → 330 → 380 W every 4 s). b rises in steps too, but only for the first half of
    # the window; c is a bursty serving GPU: 200 W, a 2 s burst to 480 W every 12 s.
    est = DemandEstimator(DemandSpec(window_s=40.0))
    for t in range(41):
        a = (250.0, 330.0, 380.0, 380.0)[t % 4]
        b = (250.0, 330.0, 380.0, 380.0)[t % 4] if t < 20 else 380.0
        c = 480.0 if t % 12 in (0, 1) else 200.0
        est.observe(float(t), UUIDS, np.array([a, b, c]), MAX, FRESH)
    assert float(est.rise[0].max()) < 100.0  # no rise between two samples reaches 100 W
    assert est.swinging(100.0).tolist() == [True, False, False]  # type: ignore[union-attr]
    # A stale sample is not taken: the climb starts again from the samples taken.
    est.observe(41.0, UUIDS, np.array([0.0, 380.0, 200.0]), MAX, np.array([False, True, True]))
    assert est.low[0] == pytest.approx(250.0)  # the slice began at 40 s, after 380 W at 39 s


def test_state_is_bounded_and_follows_the_gpu_set() -> None:
    est = DemandEstimator(DemandSpec(window_s=60.0, swing=0.0))
    feed(est, [[600.0, 300.0, 500.0], [200.0, 200.0, 200.0]])
    assert est.peak.shape == (3, BUCKETS) and est.rise.shape == (3, BUCKETS)
    # b leaves, d arrives, the order changes: c keeps its history, d starts empty.
    now = ("c", "d", "a")
    recent = est.observe(10.0, now, np.array([200.0, 100.0, 200.0]), MAX, FRESH)
    assert recent is not None
    np.testing.assert_allclose(recent, [500.0, 100.0, 600.0])
    assert est.peak.shape == (3, BUCKETS)
    assert list(est.uuids) == list(now)


def test_a_wild_or_missing_draw_moves_only_its_own_gpu() -> None:
    est = DemandEstimator(DemandSpec(window_s=60.0, swing=1.0))
    feed(est, [[300.0, 300.0, 300.0]])
    recent = est.observe(5.0, UUIDS, np.array([1e9, np.nan, 310.0]), MAX, FRESH)
    assert recent is not None
    assert recent[0] == 700.0  # clipped to its own maximum cap
    assert recent[1] == pytest.approx(300.0)  # NaN: not taken
    assert recent[2] == pytest.approx(310.0 + 10.0)
    est.observe(10.0, UUIDS, np.array([300.0, 300.0, 300.0]), MAX, FRESH)
    assert est.peak[1:].max() <= 310.0 and est.rise[1:].max() <= 10.0


def test_a_stale_gpus_sample_is_not_taken() -> None:
    est = DemandEstimator(DemandSpec(window_s=60.0, swing=0.0))
    feed(est, [[300.0, 300.0, 300.0]])
    stale = np.array([True, False, False])
    est.observe(5.0, UUIDS, np.array([650.0, 300.0, 300.0]), MAX, ~stale)
    assert est.peak[0].max() == pytest.approx(300.0)


# -- what the allocator makes of it --------------------------------------------------------


def _policy(**demand: Any) -> Policy:
    d = policy_dict(1, 1, 2, 4, fractions=(1.0, 1.0, 1.0, 1.0), overhead_w=0.0)
    d["control"] = {**d.get("control", {}), "demand": demand}
    d["classes"] = {"training": {"weight": 1.0, "profile": next(iter(d["profiles"]))}}
    return make_policy_from(d)


def make_policy_from(d: dict[str, Any]) -> Policy:
    from powerd.policy import parse_policy

    return parse_policy(d, "<test>")


def _fleet(
    policy: Policy, power: np.ndarray, cap: np.ndarray, recent: np.ndarray | None
) -> GpuArrays:
    base = random_fleet(policy, 0)
    n = base.n
    return replace(
        base,
        min_cap_w=np.full(n, 200.0),
        max_cap_w=np.full(n, 700.0),
        power_w=power,
        cap_w=cap,
        class_index=np.zeros(n, dtype=np.int64),
        stale=np.zeros(n, dtype=np.bool_),
        pinned_w=np.full(n, np.nan),
        recent_w=recent,
    )


def _site_budget(policy: Policy, fleet: GpuArrays, total_w: float) -> np.ndarray:
    budget = fleet.topology.budget_w.copy()
    budget[:] = np.inf
    budget[0] = total_w
    return budget


def test_a_gpu_far_below_the_budget_keeps_room_for_its_recent_peak() -> None:
    # 8 GPUs: half steady at 400 W with caps at 700, half just fell from 650 W to 300 W.
    # The budget (4,300 W) holds every recent peak (4 × 400 + 4 × 650 = 4,200 W).
    power = np.array([400.0] * 4 + [300.0] * 4)
    recent = np.array([400.0] * 4 + [650.0] * 4)
    cap = np.array([700.0] * 4 + [360.0] * 4)
    with_recent = _policy()
    fleet = _fleet(with_recent, power, cap, recent)
    alloc = allocate_arrays(fleet, with_recent, budget_w=_site_budget(with_recent, fleet, 4300.0))
    assert np.all(alloc.caps_w >= recent - 1e-6)
    # The last sample alone spreads the spare power around the caps in force: the GPUs
    # that fell are held far below what they drew seconds ago.
    last = _policy(window_s=0.0)
    fleet0 = _fleet(last, power, cap, None)
    alloc0 = allocate_arrays(fleet0, last, budget_w=_site_budget(last, fleet0, 4300.0))
    assert np.any(alloc0.caps_w < recent - 50.0)


def test_a_held_back_gpu_climbs_from_its_recent_peak_instead_of_asking_its_maximum() -> None:
    policy = _policy()
    power = np.array([500.0] * 8)
    cap = np.array([500.0] * 4 + [700.0] * 4)  # the first four draw their cap
    recent = np.array([520.0] * 8)
    fleet = _fleet(policy, power, cap, recent)
    d = demand_w(fleet, 50.0, policy.control.demand)
    np.testing.assert_allclose(d[:4], 520.0 + 50.0)
    assert np.all(d[4:] < 500.0 / CAP_LIMITED_SHARE + 2.0)  # margin: least
    old = demand_w(fleet, 50.0, DemandSpec(held="max", margin="headroom"))
    np.testing.assert_allclose(old, [700.0] * 4 + [550.0] * 4)
    assert demand_w(replace(fleet, recent_w=None), 50.0, policy.control.demand)[0] == 700.0


def test_a_raise_since_the_sample_is_no_evidence_and_a_cut_since_is() -> None:
    # All eight drew their 500 W cap when sampled. Since then four were raised to 550 W (a
    # tick on acks, before the next sample) and two cut to 450 W: the raised ones still
    # read as held back and probe from the cap they pressed (no second step on the same
    # sample: 550 W, where they are), the cut ones press their new cap (probe from their
    # recent 500 W: 550 W).
    policy = _policy()
    power = np.full(8, 500.0)
    recent = np.full(8, 500.0)
    committed = np.array([550.0] * 4 + [450.0] * 2 + [500.0] * 2)
    fleet = replace(_fleet(policy, power, committed, recent), sampled_cap_w=np.full(8, 500.0))
    spec = policy.control.demand
    assert held_back(fleet, spec).all()
    np.testing.assert_allclose(pressing_cap_w(fleet), [500.0] * 4 + [450.0] * 2 + [500.0] * 2)
    np.testing.assert_allclose(demand_w(fleet, 50.0, spec), 550.0)
    # Judged against the committed caps alone (as before), the raised four read as no
    # longer held back, and their demand falls to the least cap of their draw: cut back.
    before = replace(fleet, sampled_cap_w=None)
    assert not held_back(before, spec)[:4].any()
    assert np.all(demand_w(before, 50.0, spec)[:4] < 550.0 - 20.0)
    # A GPU that reported no cap (NaN) is judged by its committed cap.
    unknown = replace(fleet, sampled_cap_w=np.full(8, np.nan))
    np.testing.assert_allclose(pressing_cap_w(unknown), committed)


def test_spare_power_reaches_held_back_gpus_first_with_held_spare() -> None:
    # Four GPUs draw their 500 W cap (held back: probe to 550 W), four draw 400 W with a
    # recent peak of 450 W (least cap ≈ 422 W). Demand fits 4,300 W with ~410 W to spare.
    power = np.array([500.0] * 4 + [400.0] * 4)
    cap = np.array([500.0] * 4 + [450.0] * 4)
    recent = np.array([500.0] * 4 + [450.0] * 4)
    caps = {}
    for extra in (0.0, 100.0):
        policy = _policy(held_spare_w=extra)
        fleet = _fleet(policy, power, cap, recent)
        budget = _site_budget(policy, fleet, 4300.0)
        alloc = allocate_arrays(fleet, policy, budget_w=budget)
        demand = demand_w(fleet, 50.0, policy.control.demand)
        assert np.all(alloc.caps_w >= demand - 1e-6)  # every demand is met either way
        assert alloc.caps_w.sum() <= 4300.0 + 1e-6
        caps[extra] = alloc.caps_w
    # Without it the spare goes around each GPU's recent peak alike (+37.5 W each); with
    # it, the held-back GPUs sit at their probe + 100 W less one common amount.
    np.testing.assert_allclose(caps[0.0], [587.5] * 4 + [487.5] * 4, atol=1.0)
    np.testing.assert_allclose(caps[100.0], [637.5] * 4 + [437.5] * 4, atol=1.0)


def test_a_gpu_drawing_just_under_held_share_is_not_probed() -> None:
    # 96 % of the cap: held back under the former 95 % rule (probed by the headroom, then
    # cut back the next tick when the draw stays), not under `held_share` 0.98.
    power, cap, recent = np.full(8, 480.0), np.full(8, 500.0), np.full(8, 480.0)
    policy = _policy()
    assert held_share(policy.control.demand) == 0.98
    fleet = _fleet(policy, power, cap, recent)
    d = demand_w(fleet, 50.0, policy.control.demand)
    np.testing.assert_allclose(d, 480.0 / CAP_LIMITED_SHARE + 1.0)
    former = demand_w(fleet, 50.0, DemandSpec(held_share=0.95))
    np.testing.assert_allclose(former, 500.0 + 50.0)
    # Without the estimate the former rule stands, whatever `held_share` says.
    assert held_share(DemandSpec(window_s=0.0)) == CAP_LIMITED_SHARE
    assert held_share(None) == CAP_LIMITED_SHARE


def test_a_swinging_gpu_wants_its_recent_peak_in_its_low_phase() -> None:
    # Eight GPUs in the low phase of a swing (200 W now, 650 W a second ago, caps 690 W):
    # the first four swing all window, the others do not. Not held back either way.
    policy = _policy(swing_keep_w=100.0)
    spec = policy.control.demand
    power, cap, recent = np.full(8, 200.0), np.full(8, 690.0), np.full(8, 650.0)
    swinging = np.array([True] * 4 + [False] * 4)
    fleet = replace(_fleet(policy, power, cap, recent), swinging=swinging)
    d = demand_w(fleet, 50.0, spec)
    np.testing.assert_allclose(d[:4], 650.0 / CAP_LIMITED_SHARE + 1.0)  # its peak's least cap
    np.testing.assert_allclose(d[4:], 200.0 / CAP_LIMITED_SHARE + 1.0)  # its draw's
    np.testing.assert_allclose(
        demand_w(fleet, 50.0, DemandSpec(swing_keep_w=100.0, margin="headroom"))[:4], 700.0
    )
    # Held back (pressing its cap), a swinging GPU probes as any other does; pressed in
    # its high phase (its peak at its cap), it is still held back in its low phase.
    pressed = replace(fleet, power_w=np.full(8, 690.0), recent_w=np.full(8, 690.0))
    np.testing.assert_allclose(demand_w(pressed, 50.0, spec), 700.0)
    low = replace(pressed, power_w=np.full(8, 200.0))
    assert held_back(low, spec).tolist() == [True] * 4 + [False] * 4
    np.testing.assert_allclose(demand_w(low, 50.0, spec)[:4], 700.0)
    # Under a budget that holds every GPU's peak, the swinging ones keep room for it.
    alloc = allocate_arrays(fleet, policy, budget_w=_site_budget(policy, fleet, 4000.0))
    assert np.all(alloc.caps_w[:4] >= 650.0 / CAP_LIMITED_SHARE)
    assert alloc.caps_w.sum() <= 4000.0 + 1e-6


def test_with_swing_keep_caps_do_not_follow_a_swing_in_the_tick() -> None:
    """One node's GPUs swing 200 ↔ 400 W every 4 s (synchronous training), the others
    draw 450 W steadily, under a site budget that binds. Without `swing_keep_w` the swinging
    GPUs' caps are cut in every low phase and probed back up in the high one (and their
    neighbours' caps move the other way); with it, once the window has seen the swing,
    the caps stay, and every budget holds either way."""
    from support.honest import NODES, HonestNode, tick
    from support.honest import policy_dict as honest_policy_dict

    from powerd.controller.tick import TickEngine

    class Node(HonestNode):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.t = 0
            self.swings = name == "r1-n1"

        def draw(self) -> dict[str, float]:
            want = 450.0
            if self.swings:
                want = 200.0 if self.t % 4 == 3 else 400.0
            return {u: min(cap, want) for u, cap in self.caps.items()}

    moves: dict[float, int] = {}
    for keep in (0.0, 100.0):
        d = honest_policy_dict()
        d["control"] = {**d.get("control", {}), "demand": {"swing_keep_w": keep}}
        engine = TickEngine(parse(d))
        nodes = {n: Node(n) for n in NODES}
        before = None
        moves[keep] = 0
        for t in range(100):
            for node in nodes.values():
                node.t = t
            tick(engine, nodes, t)
            caps = np.array([c for n in nodes.values() for c in n.caps.values()])
            assert caps.sum() <= 7000.0 + 1e-6
            if t >= 70 and before is not None:
                moves[keep] += int((np.abs(caps - before) > 1.0).sum())
            before = caps
        swinging = engine.targets.demand.swinging(keep)
        if keep:
            assert swinging is not None
            idx = {u: i for i, u in enumerate(engine.targets.demand.uuids)}
            for node in nodes.values():
                assert all(bool(swinging[idx[u]]) == node.swings for u in node.uuids)
        else:
            assert swinging is None
    assert moves[0.0] > 0
    assert moves[100.0] == 0


@settings(max_examples=300, deadline=None)
@given(
    cap=st.floats(200.0, 700.0),
    share=st.floats(CAP_LIMITED_SHARE, 1.0),
    at=st.floats(0.0, 1.0),
    above=st.floats(0.0, 1.0),
    headroom=st.floats(40.0, 100.0),  # ≥ 5 % of the largest cap: the least margin binds
)
def test_between_the_least_margin_and_held_share_a_cap_is_neither_cut_nor_probed(
    cap: float, share: float, at: float, above: float, headroom: float
) -> None:
    """The hysteresis: a GPU whose cap sits at its least cap (draw / 0.95 + 1 W) wobbles in
    draw between 95 % of the cap and `held_share` of it without its demand falling below
    the cap (a cut) or jumping by the headroom (a probe): its demand stays within
    cap × (held_share / 0.95 − 1) + 1 W of the cap, under the default raise deadband (40 W,
    held for a GPU not pressing on its cap) at any share up to 0.98. At `held_share` and
    above, it is probed."""
    policy = _policy(held_share=share)
    spec = policy.control.demand
    n = 8
    # Draws in [0.95, share) × cap (`at`), and in [share, 1] × cap (`above`).
    low = CAP_LIMITED_SHARE * cap + at * (share - CAP_LIMITED_SHARE) * cap
    low = min(low, np.nextafter(share * cap, 0.0)) if share > CAP_LIMITED_SHARE else None
    high = share * cap + above * (1.0 - share) * cap
    caps = np.full(n, cap)
    if low is not None:
        fleet = _fleet(policy, np.full(n, low), caps, np.full(n, low))
        d = demand_w(fleet, headroom, spec)
        assert np.all(d >= cap - 1e-9)  # no cut, and no probe:
        assert np.all(d - cap <= cap * (share / CAP_LIMITED_SHARE - 1.0) + 1.0 + 1e-9)
        if share <= 0.98:
            assert np.all(d - cap <= policy.control.raise_deadband_w)
    fleet = _fleet(policy, np.full(n, high), caps, np.full(n, high))
    d = demand_w(fleet, headroom, spec)
    np.testing.assert_allclose(d, np.minimum(700.0, np.maximum(high, cap) + headroom))


def test_following_floors_hold_only_up_to_recent_draw() -> None:
    d = policy_dict(1, 1, 2, 4, fractions=(1.0, 1.0, 1.0, 1.0), overhead_w=0.0)
    prof = next(iter(d["profiles"]))
    d["classes"] = {"training": {"weight": 1.0, "profile": prof, "floor_w": 400}}
    d["control"] = {"demand": {"floors": "follow"}}
    policy = make_policy_from(d)
    fleet = _fleet(policy, np.full(8, 250.0), np.full(8, 450.0), np.full(8, 260.0))
    problem = build_problem(fleet, policy)
    np.testing.assert_allclose(problem.lo * 1000.0, 260.0)
    d["control"] = {"demand": {"floors": "fixed"}}
    fixed = build_problem(fleet, make_policy_from(d))
    np.testing.assert_allclose(fixed.lo * 1000.0, 400.0)


@pytest.mark.parametrize(
    "demand",
    [{"window_s": -1}, {"window_s": 3601}, {"swing": 11}, {"swing": float("nan")},
     {"spare": "all"}, {"held": "guess"}, {"margin": 3}, {"floors": "none"}, {"bogus": 1},
     {"held_share": 0.9}, {"held_share": 1.01}, {"held_share": float("nan")},
     {"held_spare_w": -1}, {"held_spare_w": float("inf")}, {"swing_keep_w": -1},
     {"swing_keep_w": float("nan")}],
)  # fmt: skip
def test_demand_settings_are_validated(demand: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        DemandSpec(**demand)


def test_the_policy_carries_the_demand_settings() -> None:
    policy = make_policy(1, 1, 1, 2)
    assert policy.control.demand == DemandSpec()
    assert policy.control.demand.window_s > 0


# -- in the tick ----------------------------------------------------------------------------


def test_the_tick_feeds_every_gpus_draw_to_the_estimator() -> None:
    from support.honest import NODES, HonestNode, tick
    from support.honest import policy_dict as honest_policy_dict

    from powerd.controller.tick import TickEngine

    class Swinging(HonestNode):
        def __init__(self, name: str) -> None:
            super().__init__(name)
            self.want = 600.0

        def draw(self) -> dict[str, float]:
            return {u: min(cap, self.want) for u, cap in self.caps.items()}

    engine = TickEngine(parse(honest_policy_dict()))
    nodes = {n: Swinging(n) for n in NODES}
    for t in range(12):
        if t == 8:
            nodes["r1-n1"].want = 250.0  # its GPUs fall; the others keep drawing
        tick(engine, nodes, t)
    est = engine.targets.demand
    assert sorted(est.uuids) == sorted(u for n in nodes.values() for u in n.uuids)
    fell = [i for i, u in enumerate(est.uuids) if u.startswith("GPU-r1-n1-")]
    drew = np.array([nodes["r1-n1"].draw()[est.uuids[i]] for i in fell])
    assert np.all(drew == 250.0)
    # What they drew seconds ago is still their recent draw, not the last sample.
    assert np.all(est.peak[fell].max(axis=1) > 400.0)


def parse(d: dict[str, Any]) -> Policy:
    return make_policy_from(d)


def test_the_draw_counted_is_the_sample_within_its_bounds() -> None:
    """NaN counts as 0, +inf as the GPU's maximum, -inf and negatives as 0; a sample
    within [0, max cap] as itself, bit for bit (-0.0 included)."""
    from powerd.controller.demand import _draw

    power = np.array([np.nan, np.inf, -np.inf, -5.0, -0.0, 0.0, 312.25, 900.0])
    top = np.full(power.size, 700.0)
    want = np.array([0.0, 700.0, 0.0, 0.0, -0.0, 0.0, 312.25, 700.0])
    got = _draw(power, top)
    assert got.dtype == np.float64
    assert got.tobytes() == np.clip(np.nan_to_num(power, nan=0.0), 0.0, top).tobytes()
    assert np.array_equal(got, want)
