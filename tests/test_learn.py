"""Profiles learned online (powerd/allocator/learn.py): the fit, its rules, the buffer, the
allocator steering by learned curves, and the tick engine learning from telemetry's perf."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from structlog.testing import capture_logs
from support.honest import GPUS, NODES, HonestNode, policy_dict

from powerd.allocator import ClassTable, allocate_arrays
from powerd.allocator.learn import ProfileLearner, bin_points, fit_curve, learner_for
from powerd.allocator.problem import build_problem
from powerd.controller.tick import TickEngine
from powerd.policy import Learn, parse_policy
from powerd.profile import Profile
from powerd.testing.synthetic import make_policy, random_fleet
from powerd.wire import NodeTelemetry

# The truth the workloads follow, and the (wrong) curve the policy states.
TRUE = Profile.from_points("true", [(200, 0.25), (400, 0.58), (550, 0.8), (700, 1.0)])
SATURATING = Profile.from_points("policy", [(200, 0.6), (300, 0.85), (450, 1.0)])


def samples(
    profile: Profile, n: int, *, seed: int = 0, lo: float = 200, hi: float = 700, units=1000.0
) -> tuple[np.ndarray, np.ndarray]:
    """(draw, perf) of busy and underloaded GPUs: most on the curve (in perf units, with
    1 % noise), a third below it (few requests: less work at the same power)."""
    rng = np.random.default_rng(seed)
    p = rng.uniform(lo, hi, n)
    load = np.where(rng.random(n) < 0.33, rng.uniform(0.3, 0.9, n), 1.0)
    y = units * profile.value(p) * load * (1 + 0.01 * rng.standard_normal(n))
    return p, y


def test_the_fit_recovers_a_concave_curve_from_underloaded_noisy_samples() -> None:
    p, y = samples(TRUE, 3000)
    fit = fit_curve(p, y, settings=Learn(), base=SATURATING, max_w=700.0, name="c")
    assert fit.ok, fit.reason
    assert fit.profile is not None and fit.error is not None and fit.error <= 0.1
    grid = np.linspace(220, 690, 40)
    # Normalised to the policy's peak (1.0): the learned curve is the true one within 4 %.
    assert np.max(np.abs(fit.profile.value(grid) - TRUE.value(grid))) < 0.04
    slopes = fit.profile.slopes_per_w
    assert np.all(np.diff(slopes) <= 1e-12) and np.all(slopes >= 0)  # concave, rising


def test_a_curve_seen_only_below_its_top_continues_its_last_slope_and_a_flat_one_stays_flat():
    # Seen up to 450 W only: the learned curve goes on rising to the device maximum.
    p, y = samples(TRUE, 2000, hi=450)
    fit = fit_curve(p, y, settings=Learn(), base=SATURATING, max_w=700.0, name="c")
    assert fit.ok and fit.profile is not None
    assert fit.profile.peak_w == 700.0 and fit.profile.peak_throughput == pytest.approx(1.0)
    assert fit.profile.value(650.0) > fit.profile.value(450.0) + 0.1
    # Seen flat past 450 W: the curve peaks there, more power buys nothing.
    p, y = samples(SATURATING, 2000)
    fit = fit_curve(p, y, settings=Learn(), base=TRUE, max_w=700.0, name="c")
    assert fit.ok and fit.profile is not None
    assert fit.profile.peak_w < 480.0


@pytest.mark.parametrize(
    ("n", "lo", "hi", "why"),
    [
        (50, 200, 700, "samples <"),
        (3000, 400, 420, "power bins <"),
        (3000, 400, 500, "spans"),
    ],
)
def test_a_fit_steers_only_with_enough_samples_bins_and_span(
    n: int, lo: float, hi: float, why: str
) -> None:
    p, y = samples(TRUE, n, lo=lo, hi=hi)
    fit = fit_curve(p, y, settings=Learn(), base=SATURATING, max_w=700.0, name="c")
    assert not fit.ok and fit.profile is None and why in fit.reason


def test_a_fit_far_from_concave_is_refused_by_its_error_bound() -> None:
    # Perf that falls and rises again (two workloads mixed in one class, say).
    rng = np.random.default_rng(3)
    p = rng.uniform(200, 700, 3000)
    y = 1000 * (1.0 - 0.8 * np.sin((p - 200) / 500 * np.pi))
    fit = fit_curve(p, y, settings=Learn(), base=SATURATING, max_w=700.0, name="c")
    assert not fit.ok and fit.error is not None and fit.error > 0.1
    assert "error" in fit.reason


def test_bins_take_a_quantile_of_perf_and_need_three_samples() -> None:
    # Bins of 25 W: [200, 225) holds 4 samples, [225, 250) 2 and [300, 325) 1 (both dropped).
    p = np.array([205.0, 210, 215, 220, 230, 240, 301])
    y = np.array([1.0, 5, 3, 4, 2, 9, 7])
    xs, ys, n = bin_points(p, y, 25.0, 1.0)
    assert n == 1 and xs.tolist() == [212.5] and ys.tolist() == [5.0]
    _, median, _ = bin_points(p, y, 25.0, 0.5)
    assert median.tolist() == [3.0]  # sorted 1, 3, 4, 5: index floor(0.5 × 3) = 1


def learner(**settings: Any) -> ProfileLearner:
    s = Learn(enabled=True, **settings)
    return ProfileLearner(
        ["a", "b"], [SATURATING, SATURATING], [True, False], s, max_w=700.0, tick_s=1.0
    )


def test_the_buffer_is_bounded_spans_its_window_and_forgets_old_samples() -> None:
    lrn = learner(buffer=100, window_s=50.0, per_tick=10, min_samples=10)
    n = 1000
    key = np.zeros(n, dtype=np.int64)
    p, y = samples(TRUE, n)
    for t in range(200):
        lrn.observe(float(t), key, p, y, np.ones(n, dtype=np.bool_))
    ring = lrn._rings[0]
    # buffer × tick / window = 2 samples per tick: the buffer holds the last 50 ticks.
    assert lrn.rate == pytest.approx(2.0)
    assert ring.filled == 100 and ring.t.min() >= 150.0
    assert lrn._rings[1].filled == 0  # key b does not learn
    # Samples older than the window are not fitted.
    lrn.refit(400.0)
    assert lrn.states()[0].samples == 0 and not lrn.states()[0].in_use


def test_samples_are_only_taken_from_usable_busy_gpus() -> None:
    lrn = learner(buffer=64, window_s=1.0, per_tick=64)
    key = np.zeros(6, dtype=np.int64)
    p = np.array([300.0, 300, 300, 100, 300, 300])
    y = np.array([1.0, np.nan, 0.0, 1.0, np.inf, 1.0])
    usable = np.array([True, True, True, True, True, False])
    lrn.observe(0.0, key, p, y, usable, min_w=200.0)
    # Only GPU 0: NaN, 0 (idle), below the device minimum, inf, stale are all left out.
    assert lrn._rings[0].filled == 1


def test_a_good_fit_is_kept_while_samples_lack_spread_and_dropped_when_they_contradict():
    lrn = learner(buffer=4000, window_s=4.0, per_tick=1000, min_samples=100, refit_ticks=1)
    n = 2000
    key = np.zeros(n, dtype=np.int64)
    ok = np.ones(n, dtype=np.bool_)
    p, y = samples(TRUE, n)
    lrn.observe(0.0, key, p, y, ok)
    assert lrn.refit(0.0)  # the learned curve now steers class a
    assert set(lrn.profiles()) == {"a"} and lrn.states()[0].in_use
    lrn2 = learner(buffer=300, window_s=1.0, per_tick=300, min_samples=100, refit_ticks=1)
    lrn2.observe(0.0, key, p, y, ok)
    lrn2.refit(0.0)
    assert lrn2.states()[0].in_use
    # Later samples all at one power (caps held): too little spread, the fit is kept.
    lrn2.observe(1.0, key, np.full(n, 450.0), np.full(n, 700.0), ok)
    assert not lrn2.refit(1.0)
    st = lrn2.states()[0]
    assert st.in_use and st.reason.startswith("last good fit kept")
    # Then samples with spread that no concave curve explains: the policy's profile again.
    rng = np.random.default_rng(4)
    wavy_p = rng.uniform(200, 700, n)
    wavy_y = 1000 * (1.0 - 0.8 * np.sin((wavy_p - 200) / 500 * np.pi))
    lrn2.observe(2.0, key, wavy_p, wavy_y, ok)
    assert lrn2.refit(2.0)
    assert lrn2.profiles() == {} and "error" in lrn2.states()[0].reason


def test_learned_profiles_replace_the_policys_in_every_solver_alike() -> None:
    policy = make_policy(1, 2, 2, 4)
    fleet = random_fleet(policy, seed=5)
    name = policy.defaults.class_
    learned = {name: TRUE}
    table = ClassTable.from_policy(policy, learned)
    assert table.profiles[table.names.index(name)] is TRUE
    fast = allocate_arrays(fleet, policy, "fast", classes=table)
    ref = allocate_arrays(fleet, policy, "cvxpy", classes=table)
    assert fast.objective == pytest.approx(ref.objective, rel=1e-6, abs=1e-6)
    problem = build_problem(fleet, policy, classes=table)
    assert problem.classes is table


def test_learning_is_off_unless_the_policy_turns_it_on() -> None:
    assert learner_for(parse_policy(policy_dict())) is None
    d = policy_dict()
    d["classes"]["c"]["learn"] = True
    lrn = learner_for(parse_policy(d))
    assert lrn is not None and lrn.enabled == (True,)


class PerfNode(HonestNode):
    """An honest node whose GPUs' demand varies (each its own level, moving with time) and
    which reports perf from the TRUE curve, in tokens/s."""

    t = 0.0

    def draw(self) -> dict[str, float]:
        out = {}
        for i, (u, cap) in enumerate(self.caps.items()):
            demand = 400 + 250 * np.sin(self.t / 7.0 + i + NODES.index(self.name))
            out[u] = float(min(cap, demand))
        return out

    def sample(self, wall: float) -> NodeTelemetry:
        msg = super().sample(wall)
        gpus = [
            g.model_copy(update={"perf": 5000.0 * float(TRUE.value(g.power_w))}) for g in msg.gpus
        ]
        return msg.model_copy(update={"gpus": gpus})


def learning_engine() -> TickEngine:
    """An engine whose one class learns quickly: 100 samples, a refit every 10 ticks."""
    d = policy_dict()
    d["profiles"]["p"] = {"points": [[200, 0.6], [300, 0.85], [450, 1.0]]}
    d["control"]["learn"] = {
        "enabled": True,
        "buffer": 2000,
        "window_s": 200.0,
        "refit_ticks": 10,
        "min_samples": 100,
    }
    return TickEngine(parse_policy(d))


def test_the_engine_learns_a_class_curve_from_telemetry_and_steers_by_it() -> None:
    engine = learning_engine()
    assert engine.targets.learner is not None
    nodes = {n: PerfNode(n) for n in NODES}
    before = engine.targets.classes
    for t in range(120):
        now = float(t)
        for node in nodes.values():
            node.t = now
            assert engine.on_telemetry(node.sample(1e9 + t), now)
        report, plan = engine.step(now, 1e9 + t)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                engine.on_ack(cmd.node, ack)
        # Learning never moves a cap outside the device's bounds, nor a budget.
        assert np.all((report.targets_w >= 200 - 1e-6) & (report.targets_w <= 700 + 1e-6))
        assert not (plan.group_over & ~plan.group_settling).any()
    state = engine.targets.learner.states()[0]
    assert state.in_use, state.reason
    assert engine.targets.classes is not before
    learned = engine.targets.classes.profiles[0]
    grid = np.linspace(250, 640, 20)
    assert np.max(np.abs(learned.value(grid) - TRUE.value(grid))) < 0.06
    assert len(report.uuids) == GPUS * len(NODES)


def test_a_fault_in_learning_never_costs_a_tick_its_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    d = policy_dict()
    d["control"]["learn"] = {"enabled": True}
    engine = TickEngine(parse_policy(d))
    assert engine.targets.learner is not None

    def broken(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("bug in learning")

    monkeypatch.setattr(engine.targets.learner, "observe", broken)
    nodes = {n: PerfNode(n) for n in NODES}
    for node in nodes.values():
        engine.on_telemetry(node.sample(1e9), 0.0)
    with capture_logs() as logs:
        report, plan = engine.step(0.0, 1e9)
    assert report.status == "optimal" and plan.commands
    assert "tick_failed" not in engine.alarms.active
    assert any(e["event"] == "learning_failed" for e in logs)


class LyingPerfNode(PerfNode):
    """A node that claims its GPUs run at full speed at any power: draws of 200–700 W, each
    with the top perf of the TRUE curve (a compromised or buggy exporter)."""

    def sample(self, wall: float) -> NodeTelemetry:
        msg = super().sample(wall)
        step = int(wall) * len(msg.gpus)  # every 25 W bin from 200 to 700 W in turn
        gpus = [
            g.model_copy(update={"power_w": 212.0 + 25 * ((step + i) * 7 % 20), "perf": 5000.0})
            for i, g in enumerate(msg.gpus)
        ]
        return msg.model_copy(update={"gpus": gpus})


def test_one_lying_node_cannot_bend_its_classes_curve_for_the_other_nodes() -> None:
    """One node of four reports full perf at every draw. Unchecked, its samples set every
    bin's 0.9 quantile and the fit was a flat curve from 200 W: every GPU of the class, on
    every node, would be held near 200 W (no power past a peak). A bin now needs samples
    from two nodes and its point is no higher than a second node saw there."""
    engine = learning_engine()
    assert engine.targets.learner is not None
    liar = NODES[-1]
    nodes = {n: (LyingPerfNode(n) if n == liar else PerfNode(n)) for n in NODES}
    used = 0
    for t in range(120):
        now = float(t)
        for node in nodes.values():
            node.t = now
            assert engine.on_telemetry(node.sample(1e9 + t), now)
        _, plan = engine.step(now, 1e9 + t)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                engine.on_ack(cmd.node, ack)
        learned = engine.targets.learner.profiles().get("c")
        if learned is not None:  # whenever a learned curve steers, it is the honest one
            used += 1
            assert learned.peak_w > 600, f"tick {t}: peak at {learned.peak_w:.0f} W"
            grid = np.linspace(250, 600, 15)
            assert np.max(np.abs(learned.value(grid) - TRUE.value(grid))) < 0.1
    assert used > 0, engine.targets.learner.states()[0].reason


def test_bins_need_two_nodes_and_one_node_cannot_lift_a_bin_above_the_next() -> None:
    # Bin 0 (200 W): nodes 1 and 2, node 2 lying at 1e9. Bin 1 (250 W): node 2 alone.
    p = np.array([205.0, 206, 207, 208, 209, 210, 255, 256, 257])
    y = np.array([10.0, 11, 12, 1e9, 1e9, 1e9, 1e9, 1e9, 1e9])
    s = np.array([1, 1, 1, 2, 2, 2, 2, 2, 2])
    xs, ys, n = bin_points(p, y, 50.0, 0.9, s)
    assert n == 1 and xs.tolist() == [pytest.approx(207.5)] and ys.tolist() == [12.0]
    # Without sources (a simulator's own model) every sample counts as before.
    _, ys, n = bin_points(p, y, 50.0, 0.9)
    assert n == 2 and ys.tolist() == [1e9, 1e9]
