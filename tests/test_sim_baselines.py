"""The baselines beside powerd: no caps with a breaker's view (`uncapped`), perfect foresight
(`oracle`), and the breaker's trip curve against its calibration points."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support.sim import scenario_dict

from powerd.cli import main as powerd_main
from powerd.policy import parse_policy
from powerd.sim.baselines import (
    PICKUP,
    T_200_S,
    Breaker,
    oracle,
    oracle_step_s,
    trips_of,
    uncapped,
)
from powerd.sim.run import STATIC, simulate
from powerd.sim.scenario import Scenario, parse_scenario
from powerd.sim.site import Site, build_mix, build_site
from powerd.testing.synthetic import policy_dict

# One row, one rack, two nodes of four GPUs; inner budgets at nameplate (only the feed binds).
ROOMY = policy_dict(1, 1, 2, 4, overhead_w=400.0, fractions=(1, 1, 1, 1))
NAMEPLATE_W = 2 * (4 * 700 + 400)


def small(duration_h: float = 0.1, **changes: object) -> Scenario:
    return parse_scenario(scenario_dict(duration_h=duration_h, tick_s=10, **changes), "<small>")


def site_with_feed(feed_w: float) -> Site:
    return build_site(parse_policy(ROOMY, "<roomy>"), facility_budget_w=feed_w)


# -- the breaker ---------------------------------------------------------------------------


def test_trip_curve_meets_its_calibration_points() -> None:
    b = Breaker()
    # UL 489: 200 % of rating trips within 12 min (226-400 A); set to exactly that, from cold.
    assert b.trip_s(2.0) == pytest.approx(T_200_S)
    # UL 489: 135 % within 2 h; IEC 60947-2 (In > 63 A): 1.30 In within 2 h.
    assert b.trip_s(1.35) < 7200 and b.trip_s(1.30) < 7200
    # IEC 60898-1 / 60947-2 conventional non-tripping currents: 1.13 and 1.05 never trip.
    assert b.trip_s(PICKUP) == math.inf and b.trip_s(1.05) == math.inf and b.trip_s(1.0) == math.inf
    # Inverse time: more overload, sooner; the instantaneous region trips at once.
    times = [b.trip_s(r) for r in (1.2, 1.5, 2.0, 3.0, 6.0)]
    assert times == sorted(times, reverse=True)
    assert b.trip_s(b.instant) == 0.0
    # The I²t region: far above pickup, time × ratio² tends to tau × pickup².
    assert b.trip_s(9.0) * 81 == pytest.approx(b.tau_s * PICKUP**2, rel=0.01)
    # A warm breaker (carrying its rating) trips sooner than a cold one.
    assert b.trip_s(1.5, heat=1.0) < b.trip_s(1.5)


def test_stepping_the_thermal_image_trips_when_the_curve_says() -> None:
    b = Breaker()
    heat = np.zeros(1)
    ratio = np.array([1.5])
    t = 0.0
    while not b.tripped(heat, ratio)[0]:
        heat = b.heat(heat, ratio, 1.0)
        t += 1.0
    assert t == pytest.approx(b.trip_s(1.5), abs=1.0)
    # Below the pickup it never trips, however long.
    assert not b.tripped(b.heat(np.zeros(1), np.array([1.12]), 1e7), np.array([1.12]))[0]


def test_rating_relative_to_the_budget() -> None:
    b = Breaker(rating=1.25)  # NEC: a continuous load at 80 % of the breaker's rating
    assert b.safe_below() == pytest.approx(1.25 * PICKUP)
    # The model refuses what the command line does: one rule, whatever the caller.
    for below in (0.0, 0.5, math.nan, math.inf):
        with pytest.raises(ValueError, match="must be at least 1"):
            Breaker(rating=below)


# -- oracle --------------------------------------------------------------------------------


def test_oracle_never_exceeds_a_budget_and_bounds_every_steered_policy() -> None:
    sc = small()
    site = site_with_feed(0.6 * NAMEPLATE_W)
    mix = build_mix(sc, site)
    o, unconstrained = oracle(sc, site, mix)
    assert o.over_budget_s == 0 and o.committed_over_ticks == 0
    assert o.max_excess_ratio <= 1.0 + 1e-9
    for p in ("fast", "uniform", "priority-bands"):
        r = simulate(sc, site, mix, p)
        # The allocator's objective (weighted work) with perfect foresight is the upper bound.
        assert o.weighted_work_gpu_s >= r.weighted_work_gpu_s, p
    assert o.work_gpu_s < unconstrained  # the feed binds: it costs work


def test_oracle_holds_a_scheduled_window_and_its_ramp() -> None:
    window = {"budget_w": 0.4 * NAMEPLATE_W, "start_h": 0.03, "end_h": 0.07}
    sc = small(schedule=[window], ramp_w_per_s={"up": 20.0, "down": 20.0})
    site = site_with_feed(0.9 * NAMEPLATE_W)
    o, _ = oracle(sc, site, build_mix(sc, site))
    assert o.over_budget_s == 0 and o.committed_over_ticks == 0
    # It used the room outside the window: the facility drew above the window's budget.
    assert o.series.facility_draw_w.max() > 0.4 * NAMEPLATE_W
    assert o.series.facility_draw_w.min() <= 0.4 * NAMEPLATE_W + 1e-6  # and held the window


def test_oracle_equals_unconstrained_work_where_draw_never_reaches_the_feed() -> None:
    sc = small()
    site = site_with_feed(2 * NAMEPLATE_W)
    mix = build_mix(sc, site)
    o, unconstrained = oracle(sc, site, mix)
    assert o.work_gpu_s == pytest.approx(unconstrained, rel=1e-12)
    assert o.solve_ms_mean == 0.0  # nothing bound: no solve was needed
    static = simulate(sc, site, mix, STATIC)
    # The same GPUs at TDP, sampled per tick rather than per second: within sampling.
    assert o.work_gpu_s == pytest.approx(static.work_gpu_s, rel=0.02)


def test_oracle_step_is_at_most_a_second_and_the_tick() -> None:
    sc = small()
    site = site_with_feed(NAMEPLATE_W)
    assert oracle_step_s(sc, build_mix(sc, site)) == 1.0


# -- uncapped ------------------------------------------------------------------------------


def test_uncapped_over_a_feed_trips_and_loses_the_work_while_down() -> None:
    sc = small(duration_h=0.5)
    site = site_with_feed(0.5 * NAMEPLATE_W)
    mix = build_mix(sc, site)
    # A breaker that trips fast, so a short run shows it; restored after 5 min.
    b = Breaker(tau_s=30.0, restore_s=300.0)
    u, trips = uncapped(sc, site, mix, breaker=b)
    assert trips.trips >= 1 and trips.by_level["facility"] >= 1
    assert trips.first_trip_s is not None and trips.first_trip_s > 0
    assert trips.down_gpu_s >= 300.0 * site.n_gpus - 1e-6
    assert trips.lost_work_gpu_s > 0
    free, _ = uncapped(sc, site, mix, breaker=Breaker(rating=100.0))
    assert free.work_gpu_s - u.work_gpu_s == pytest.approx(trips.lost_work_gpu_s, rel=1e-9)
    assert u.over_budget_s > 0 and u.over_budget_s_by_level["facility"] > 0
    assert u.max_excess_ratio > 1.0 and u.max_excess_w > 0
    assert trips_of(simulate(sc, site, mix, "fast"), b) is not None
    assert trips_of(simulate(sc, site, mix, "fast"), b).trips == 0  # type: ignore[union-attr]


# -- reports -------------------------------------------------------------------------------


def test_reports_carry_the_baselines_and_the_headline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pol = tmp_path / "policy.yaml"
    pol.write_text(
        yaml.safe_dump(policy_dict(1, 1, 4, 4, overhead_w=400.0, fractions=(0.6, 1, 1, 1)))
    )
    sc = tmp_path / "scenario.yaml"
    # 4 nodes: serving and training on two each (the batch share would hold none).
    workloads = scenario_dict()["workloads"][:2]
    workloads[0]["share"] = workloads[1]["share"] = 0.5
    data = scenario_dict(duration_h=0.05, tick_s=10, workloads=workloads)
    sc.write_text(yaml.safe_dump({**data, "policy": "policy.yaml"}))
    argv = ["sim", str(sc), "--policies", "fast,static", "--jobs", "1", "--progress", "never"]
    argv += ["--breaker-rating", "1.25", "--restore-s", "600", "--oversubscribe", "--points", "2"]
    assert powerd_main([*argv, "--json", "--out", str(tmp_path / "out")]) == 0
    doc = json.loads(capsys.readouterr().out)
    base = doc["baselines"]
    assert set(base) == {"uncapped", "oracle"}
    u = base["uncapped"]
    assert u["breaker"]["rating_of_budget"] == 1.25 and u["breaker"]["restore_s"] == 600
    assert u["over_budget_s"] > 0 and u["over_budget_s_by_level"]["facility"] > 0
    assert u["max_draw_over_budget"] > 1 and u["max_excess_w"] > 0
    assert {"trips", "by_level", "lost_work_gpu_h", "down_gpu_h"} <= set(u["trips"])
    assert base["oracle"]["over_budget_s"] == 0 and base["oracle"]["step_s"] == 1.0
    head = doc["headline"]
    assert head["policy"] == "fast" and head["trips"] == 0
    assert head["vs_static"] > 1
    assert head["vs_uncapped"]["uncapped_trips"] == u["trips"]["trips"]
    # Over a budget with no trip is still more risk than powerd's (decision 0006).
    assert head["vs_uncapped"]["same_risk"] is False
    assert 0 < head["share_of_oracle"]["weighted_work"] <= 1
    fits = head["oversubscribe"]
    assert fits["oracle_gpus"] == doc["oversubscribe"]["fit_gpus"]["oracle"]
    assert fits["oracle_gpus"] >= fits["gpus"] >= fits["static_tdp_gpus"]
    assert fits["uncapped_never_over_gpus"] >= fits["static_tdp_gpus"]
    assert fits["uncapped_no_trip_gpus"] >= fits["uncapped_never_over_gpus"]
    assert fits["uncapped_same_risk_gpus"] == fits["uncapped_never_over_gpus"]
    assert doc["compare"]["fast"]["trips"]["trips"] == 0
    assert all("uncapped" in pt["trips"] for pt in doc["oversubscribe"]["points"])
    assert "oracle" in (tmp_path / "out" / "report.html").read_text()
    # The text report says the same.
    assert powerd_main([*argv[:-5], "--baselines", "uncapped,oracle"]) == 0
    out = capsys.readouterr().out
    assert "headline: fast" in out and "share of the oracle" in out
    assert "against uncapped on the same GPUs (more risk" in out
    assert "\nuncapped " in out and "\noracle " in out and "breakers rated 125%" in out
    # And none leaves them out.
    assert powerd_main([*argv[:-5], "--baselines", "none", "--json"]) == 0
    assert "baselines" not in json.loads(capsys.readouterr().out)


def test_bad_baseline_names_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        powerd_main(["sim", "x.yaml", "--baselines", "psychic"])
    assert "valid: uncapped, oracle" in capsys.readouterr().err


def test_the_demo_says_what_no_caps_would_do() -> None:
    from powerd.backends.mock import SimulatedGpus
    from powerd.demo import _first_nodes, baselines_line, default_policy, workload_mix

    policy, nodes = _first_nodes(default_policy(), 2)
    counts = [next(g for g in policy.groups if g.name == n).gpus for n in nodes]
    per_gpu = [workload_mix(policy, k, 1.0) for k, c in enumerate(counts) for _ in range(c)]
    model = SimulatedGpus(len(per_gpu), per_gpu, seed=0)
    gpu_nodes = [n for n, c in zip(nodes, counts, strict=True) for _ in range(c)]
    line = baselines_line(model, policy, gpu_nodes, 0.0, 10.0)
    assert f"these {len(per_gpu)} GPUs would draw up to" in line
    assert "static TDP caps fit 296 GPUs" in line and "powerd sim" in line


def test_breakers_start_warm_from_the_first_draw() -> None:
    b = Breaker()
    r = np.array([1.2, 1.1])
    # A site already running at 120 % of a rating trips at once; at 110 % it never does.
    assert b.tripped(b.heat(b.start_heat(r), r, 1.0), r).tolist() == [True, False]


def test_a_gain_against_a_baseline_that_delivered_almost_nothing_is_a_multiple() -> None:
    from powerd.sim.report import _gain

    assert _gain(145.0, 100.0) == "+45%"
    assert _gain(90.0, 100.0) == "-10%"
    assert _gain(295.26, 1.0) == "295× the"  # not "+29426%"
    assert _gain(1.0, 0.0) == "-"


def test_the_headline_names_a_rating_where_uncapped_never_reached_a_budget() -> None:
    """Under the strict rule a burst seen a tick late is lost whatever the allocator does
    (docs/performance.md, "Bursty serving"): where uncapped stayed under every budget and
    the lead lost work to it, the headline says what lends that room, and only then."""
    from types import SimpleNamespace

    from powerd.sim.report import _rating_hint

    def report(rated: bool) -> Any:
        groups = [SimpleNamespace(overload=object() if rated else None)]
        return SimpleNamespace(site=SimpleNamespace(policy=SimpleNamespace(groups=groups)))

    u = SimpleNamespace(work_gpu_s=1000.0, max_excess_ratio=0.873)
    lost = SimpleNamespace(work_gpu_s=972.0)
    (line,) = _rating_hint(report(False), lost, u, same=True)  # type: ignore[arg-type]
    assert "87.3% of a budget" in line and "--overload PCT:SECONDS[:TARGET[:RISE]]" in line
    assert _rating_hint(report(True), lost, u, same=True) == []  # type: ignore[arg-type]
    assert _rating_hint(report(False), lost, u, same=False) == []  # type: ignore[arg-type]
    kept = SimpleNamespace(work_gpu_s=999.5)  # 0.05 % lost: nothing to say
    assert _rating_hint(report(False), kept, u, same=True) == []  # type: ignore[arg-type]
