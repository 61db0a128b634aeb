"""The simulator under a grid schedule: windows ramp in on time and out at the rates, no
budget is exceeded by measured draw, and the report shows the facility's ramp rate."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support.sim import small_policy

from powerd.cli import main as powerd_main
from powerd.policy import load_policy, parse_policy
from powerd.sim.report import Report, text, to_json
from powerd.sim.run import simulate
from powerd.sim.scenario import ScenarioError, load_scenario, parse_scenario
from powerd.sim.site import build_mix, build_site, site_for

UP, DOWN = 10.0, 20.0  # W/s
TICK_S = 60.0


def scenario_dict(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "dr",
        "duration_h": 1,
        "tick_s": TICK_S,
        "seed": 3,
        "ramp_w_per_s": {"up": UP, "down": DOWN},
        "schedule": [{"fraction": 0.7, "start_h": 0.25, "end_h": 0.5}],
        # Every GPU wants its maximum: the facility budget binds throughout.
        "workloads": [
            {
                "name": "train",
                "class": "training",
                "share": 1.0,
                "pattern": "steady",
                "high_w": 690,
                "low_w": 690,
            }
        ],
    }
    data.update(changes)
    return data


def run(data: dict[str, Any], policy: str = "fast") -> tuple[Any, Any]:
    scenario = parse_scenario(data, "<dr>")
    site = build_site(parse_policy(small_policy(), "<small>"))
    return simulate(scenario, site, build_mix(scenario, site), policy), site


def test_a_window_ramps_in_on_time_and_out_within_the_rates() -> None:
    result, site = run(scenario_dict())
    feed = site.feed_w
    target = 0.7 * feed
    committed = result.series.facility_committed_w
    t = np.arange(committed.size) * TICK_S  # each tick steers at its start (+1 s)
    window = (t >= 0.25 * 3600) & (t < 0.5 * 3600)
    assert window.any()
    # On time: the target holds over the whole window.
    assert (committed[window] <= target + 1e-6).all()
    # Before the ramp and long after it, the feed is used in full.
    assert committed[0] == pytest.approx(feed, rel=1e-3)
    assert committed[-1] == pytest.approx(feed, rel=1e-3)
    rates = result.ramp_w_per_s
    assert 0 < rates["committed_down"] <= DOWN + 1e-6
    assert 0 < rates["committed_up"] <= UP + 1e-6
    # Draw follows (it may move faster with the workload; here it is steady).
    assert rates["draw_down"] > 0 and rates["draw_up"] > 0
    assert result.over_budget_s == 0 and result.committed_over_ticks == 0


def test_without_rates_a_window_is_a_step() -> None:
    result, site = run(scenario_dict(ramp_w_per_s=None))
    drop = 0.3 * site.feed_w
    assert result.ramp_w_per_s["committed_down"] == pytest.approx(drop / TICK_S, rel=0.02)
    assert result.over_budget_s == 0


def test_report_shows_the_ramp_rate_in_text_and_json() -> None:
    data = scenario_dict()
    scenario = parse_scenario(data, "<dr>")
    site = build_site(parse_policy(small_policy(), "<small>"))
    runs = {"fast": simulate(scenario, site, build_mix(scenario, site), "fast")}
    report = Report(scenario, site, compare=runs)
    out = text(report)
    assert "1 scheduled windows, ramp limit up 10, down 20" in out
    row = next(
        line
        for line in out.splitlines()
        if line.startswith("fast ") and "W/s" not in line and line.split()[1].isdigit()
    )
    assert int(row.split()[1]) <= UP and int(row.split()[2]) <= DOWN
    doc = to_json(report)
    rates = doc["compare"]["fast"]["ramp_w_per_s"]
    assert set(rates) == {"committed_up", "committed_down", "draw_up", "draw_down"}
    assert rates == runs["fast"].ramp_w_per_s


def test_bad_schedules_name_the_path() -> None:
    data = scenario_dict(
        schedule=[
            {"budget_w": 1000, "fraction": 0.5, "start_h": 0, "end_h": 1},
            {"budget_w": 1000, "start_h": 2, "end_h": 1},
            {"budget_w": -1, "start_h": 0, "end_h": 1},
        ],
        ramp_w_per_s={"up": 0, "down": 1},
    )
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "s.yaml")
    paths = dict(exc.value.problems)
    assert "one of them" in paths["schedule[0]"]
    assert "must be after start_h" in paths["schedule[1]"]
    assert "schedule[2].budget_w" in paths
    assert "ramp_w_per_s.up" in paths
    scenario = parse_scenario(
        scenario_dict(schedule=[{"group": "nowhere", "budget_w": 1, "start_h": 0, "end_h": 1}]),
        "s.yaml",
    )
    site = build_site(parse_policy(small_policy(), "<small>"))
    with pytest.raises(ScenarioError, match="no group 'nowhere'"):
        simulate(scenario, site, build_mix(scenario, site), "fast")


def test_the_shipped_demand_response_scenario_runs_from_the_cli(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = Path(__file__).resolve().parents[1] / "policies/scenarios/demand-response.yaml"
    sc = load_scenario(path)
    assert len(sc.spec.schedule) == 2 and sc.spec.ramp_w_per_s is not None
    # Two hours around the morning window, to keep the test short.
    data = yaml.safe_load(path.read_text())
    data.update(policy=str(path.parent / data["policy"]), duration_h=2.5)
    data["schedule"] = [{"budget_w": 220000, "start_h": 0.75, "end_h": 1.5}]
    short = tmp_path / "dr.yaml"
    short.write_text(yaml.safe_dump(data))
    assert site_for(load_scenario(short), load_policy(data["policy"])).n_gpus == 512
    code = powerd_main(
        ["sim", str(short), "--policies", "fast", "--json", "--baselines", "none", "--jobs", "1"]
    )
    assert code == 0
    doc = json.loads(capsys.readouterr().out)
    fast = doc["compare"]["fast"]
    assert fast["over_budget_s"] == 0
    # Committed caps within the ramped budget in force at every tick (the ramp is on the
    # budget: below it, caps handed back after a dip may rise faster than `up`).
    assert fast["committed_over_ticks"] == 0
    assert 0 < fast["ramp_w_per_s"]["committed_down"] <= 100 + 1e-6
    assert fast["ramp_w_per_s"]["committed_up"] > 0
