"""The simulator: scenario validation, determinism, budgets under every policy, studies, outputs."""

from __future__ import annotations

import copy
import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support.sim import scenario_dict, small_policy

from powerd.cli import main as powerd_main
from powerd.policy import Policy, parse_policy
from powerd.sim.report import Report, headline_lines, text, to_json, write_outputs
from powerd.sim.run import STATIC, simulate
from powerd.sim.scenario import (
    Scenario,
    ScenarioError,
    check_against_policy,
    load_scenario,
    parse_scenario,
)
from powerd.sim.site import Site, assign_nodes, build_mix, build_site, site_for
from powerd.sim.study import Runner, budget_sweep, compare, oversubscribe, static_provisioning
from powerd.testing.synthetic import policy_dict

ROOT = Path(__file__).resolve().parents[1]
SCENARIOS = ROOT / "policies" / "scenarios"


@pytest.fixture(scope="module")
def policy() -> Policy:
    return parse_policy(small_policy(), "<small>")


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return parse_scenario(scenario_dict(), "<small scenario>")


@pytest.fixture(scope="module")
def site(policy: Policy) -> Site:
    # The synthetic policy's budgets leave 0.92^3 × 0.85 of nameplate at the facility: binding.
    return build_site(policy)


@pytest.fixture(scope="module")
def runs(scenario: Scenario, site: Site) -> dict[str, Any]:
    return compare(scenario, site, ["fast", "uniform", "priority-bands", STATIC], Runner())


# -- scenario files ------------------------------------------------------------------------


def problems(exc: pytest.ExceptionInfo[ScenarioError]) -> dict[str, str]:
    return dict(exc.value.problems)


def test_shipped_scenarios_are_valid_against_their_policies() -> None:
    files = sorted(SCENARIOS.glob("*.yaml"))
    assert len(files) >= 3
    from powerd.policy import load_policy

    for f in files:
        sc = load_scenario(f)
        assert sc.policy_path is not None
        pol = load_policy(sc.policy_path)
        check_against_policy(sc, pol)
        s = site_for(sc, pol)
        assert s.n_gpus in (512, 1000, 3072)


def test_shares_must_add_up_to_one() -> None:
    data = scenario_dict()
    data["workloads"][0]["share"] = 0.25
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "s.yaml")
    assert "add up to 0.75" in problems(exc)["workloads"]
    assert str(exc.value).startswith("s.yaml: invalid scenario")


def test_unknown_keys_types_and_ranges_name_the_path() -> None:
    data = scenario_dict(tick_s=0.5)
    data["workloads"][1]["duty"] = 1.5
    data["workloads"][2]["hihg_w"] = 600
    data["workloads"][0]["pattern"] = "serving"
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "s.yaml")
    p = problems(exc)
    assert "tick_s" in p
    assert "workloads[1].duty" in p
    assert "unknown key" in p["workloads[2].hihg_w"]
    assert "'inference', 'training', 'steady', 'idle' or 'trace'" in p["workloads[0].pattern"]


def test_pattern_keys_are_checked_where_they_apply() -> None:
    # Swings shorter than a tick are integrated piece by piece, up to a bound per tick; keys
    # of one pattern on another, and runs of jobs that do not exist, are refused by path.
    data = scenario_dict()
    data["workloads"][1]["period_s"] = 90  # shorter than a 60 s tick's two: fine now
    parse_scenario(data, "s.yaml")
    data["workloads"][1]["period_s"] = 0.1
    data["workloads"][1]["runs"] = [{"job": 3, "start_h": 1}]
    data["workloads"][0]["checkpoint"] = {"every_min": 10, "duration_s": 30}
    data["workloads"][1]["surges"] = {"extra_w": 100}
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "s.yaml")
    p = problems(exc)
    assert "period_s >= 0.12" in p["workloads[1].period_s"]
    assert "jobs are numbered 1 to 2" in p["workloads[1].runs[0].job"]
    assert "applies to pattern training, not inference" in p["workloads[0].checkpoint"]
    assert "applies to pattern inference, not training" in p["workloads[1].surges"]
    data = scenario_dict()
    data["workloads"][1]["checkpoint"] = {"every_min": 1, "duration_s": 60}
    with pytest.raises(ScenarioError) as exc:
        parse_scenario(data, "s.yaml")
    assert "shorter than every_min" in problems(exc)["workloads[1].checkpoint"]


def test_classes_and_profiles_must_exist_in_the_policy(policy: Policy) -> None:
    data = scenario_dict()
    data["workloads"][0]["class"] = "serving"
    data["workloads"][1]["profile"] = "llm-trainnig"
    sc = parse_scenario(data, "s.yaml")
    with pytest.raises(ScenarioError) as exc:
        check_against_policy(sc, policy)
    p = problems(exc)
    assert "valid: batch, inference, training" in p["workloads[0].class"]
    assert "unknown profile 'llm-trainnig'" in p["workloads[1].profile"]


def test_bad_scenario_on_the_command_line_exits_2_naming_file_and_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.yaml"
    data = scenario_dict()
    data["workloads"][2]["bursts"] = {"probability": 2}
    bad.write_text(yaml.safe_dump(data))
    assert powerd_main(["sim", str(bad), "--policy", str(ROOT / "policies" / "example.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{bad}: invalid scenario" in err
    assert "workloads[2].bursts.probability" in err
    assert "Traceback" not in err


# -- sites and mixes -----------------------------------------------------------------------


def test_growing_a_site_keeps_its_design_and_its_feed(policy: Policy) -> None:
    grown = build_site(policy, nodes=13, facility_budget_w=50_000)
    assert grown.n_nodes == 13
    assert grown.n_gpus == 52
    levels = grown.topology.level
    # Racks of 2 nodes, rows of 2 racks: 7 racks, 4 rows; template budgets below the feed.
    assert (levels == 2).sum() == 7
    assert (levels == 1).sum() == 4
    assert grown.feed_w == 50_000
    base = build_site(policy)
    base_racks = base.topology.budget_w[base.topology.level == 2]
    assert set(grown.topology.budget_w[levels == 2]) == set(base_racks)


def test_nodes_are_dealt_out_in_proportion() -> None:
    spread = assign_nodes([0.5, 0.375, 0.125], 16, "spread")
    packed = assign_nodes([0.5, 0.375, 0.125], 16, "packed")
    assert np.bincount(spread).tolist() == [8, 6, 2] == np.bincount(packed).tolist()
    assert packed.tolist() == sorted(packed.tolist())
    assert len(set(spread[:4].tolist())) >= 2  # a stretch of the site holds the mix


# -- runs ----------------------------------------------------------------------------------


def test_powerd_never_exceeds_a_budget_by_measured_draw(runs: dict[str, Any]) -> None:
    for name in ("fast", "uniform", "priority-bands"):
        r = runs[name]
        assert r.over_budget_s == 0, name
        assert r.max_excess_ratio <= 1.0 + 1e-9, name
        assert r.committed_over_ticks == 0, name


def test_static_exceeds_budgets_below_tdp(runs: dict[str, Any], site: Site) -> None:
    assert site.feed_w < site.nameplate_w
    assert runs[STATIC].over_budget_s > 0
    assert runs[STATIC].max_excess_w > 0


def test_fast_delivers_at_least_the_baselines_weighted_throughput(runs: dict[str, Any]) -> None:
    fast = runs["fast"].weighted_work_gpu_s
    assert fast >= runs["uniform"].weighted_work_gpu_s
    assert fast >= runs["priority-bands"].weighted_work_gpu_s
    # The budget binds: every steered policy delivers less than unconstrained GPUs.
    assert runs["fast"].work_gpu_s < runs[STATIC].work_gpu_s


def test_inference_floor_is_kept_when_it_fits(runs: dict[str, Any]) -> None:
    r = runs["fast"]
    assert r.floors_fit
    assert r.below_floor_share == {"inference": 0.0}


def test_idle_windows_idle_the_gpus(scenario: Scenario, site: Site) -> None:
    mix = build_mix(scenario, site)
    starts = [e for e in mix.events if e[0] == 1800.0]
    assert starts and all(w.pattern == "idle" for _, _, w in starts)
    assert sum(idx.size for _, idx, _ in starts) == 12  # 3 of 8 nodes × 4 GPUs train


@pytest.mark.process  # the parallel runs are worker processes
def test_same_seed_same_results_sequential_or_parallel(
    scenario: Scenario, site: Site, runs: dict[str, Any]
) -> None:
    again = compare(scenario, site, list(runs), Runner(jobs=2))
    a = to_json(Report(scenario, site, compare=runs))
    b = to_json(Report(scenario, site, compare=again))
    assert a == b
    for p, r in runs.items():
        assert np.array_equal(r.series.facility_draw_w, again[p].series.facility_draw_w)
    other = parse_scenario(scenario_dict(seed=8), "<other seed>")
    changed = simulate(other, site, build_mix(other, site), "fast")
    assert changed.work_gpu_s != runs["fast"].work_gpu_s


def test_budget_sweep_is_monotone_for_fast(scenario: Scenario, site: Site) -> None:
    points = budget_sweep(scenario, site, [0.45, 0.6, 0.75, 0.9], ["fast", STATIC], Runner())
    work = [pt.results["fast"].work_gpu_s for pt in points]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(work))
    assert work[-1] > work[0]
    assert all(pt.results["fast"].over_budget_s == 0 for pt in points)
    # Static draws the same whatever the feed, so a small feed is exceeded more often.
    over = [pt.results[STATIC].over_budget_s for pt in points]
    assert over[0] >= over[-1]


def test_oversubscription_fits_more_gpus_with_fast_than_static() -> None:
    short = parse_scenario(scenario_dict(duration_h=0.5), "<short>")
    feed = 20_000.0
    # Nodes, racks and rows sized for their nameplate: only the feed limits.
    roomy = parse_policy(policy_dict(2, 2, 2, 4, overhead_w=400.0, fractions=(1, 1, 1, 1)))
    site = build_site(roomy, facility_budget_w=feed)
    o = oversubscribe(short, site, ["fast", STATIC], Runner(), threshold=0.03, points=4)
    assert o.static_tdp_gpus == int(feed // (4 * 700 + 400)) * 4
    fit = o.fit_gpus("fast")
    assert fit is not None and fit > o.static_tdp_gpus
    assert STATIC not in o.fit_nodes
    losses = {pt.gpus: pt.loss["fast"] for pt in o.points}
    assert losses[fit] <= 0.03
    assert any(g > fit and v > 0.03 for g, v in losses.items()) or fit == o.max_nodes * 4


# -- outputs -------------------------------------------------------------------------------


def test_cli_json_plots_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pol = tmp_path / "policy.yaml"
    pol.write_text(
        yaml.safe_dump(policy_dict(2, 2, 2, 4, overhead_w=400.0, fractions=(1, 1, 1, 1)))
    )
    sc = tmp_path / "scenario.yaml"
    sc.write_text(yaml.safe_dump({**scenario_dict(duration_h=0.5), "policy": "policy.yaml"}))
    out = tmp_path / "out"
    argv = [str(sc), "--json", "--out", str(out), "--budget-sweep", "0.5,0.8", "--jobs", "1"]
    argv += ["--oversubscribe", "--points", "2", "--policies", "fast,static", "--progress", "never"]
    assert powerd_main(["sim", *argv]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert set(doc) == {
        "scenario",
        "site",
        "compare",
        "provisioned",
        "budget_sweep",
        "oversubscribe",
        "runtime",
        "baselines",
        "headline",
    }
    # The headline's baseline is the oversubscription search's static TDP provisioning.
    assert doc["provisioned"]["gpus"] == doc["oversubscribe"]["static_tdp_gpus"]
    assert set(doc["compare"]) == {"fast", "static"}
    fast = doc["compare"]["fast"]
    for key in ("mean_throughput", "work_gpu_h_by_class", "gpu_energy_kwh", "work_per_joule"):
        assert key in fast
    assert fast["over_budget_s"] == 0
    assert fast["below_floor_share"] == {"inference": 0.0}
    assert [p["fraction"] for p in doc["budget_sweep"]] == [0.5, 0.8]
    assert doc["oversubscribe"]["fit_gpus"]["fast"] >= doc["oversubscribe"]["static_tdp_gpus"]
    for name in ("power.png", "throughput.png", "pareto.png", "oversubscription.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == 4
    assert "<img" in page and "src='power.png'" not in page
    assert json.loads((out / "results.json").read_text())["compare"] == doc["compare"]


def test_table_names_every_policy(runs: dict[str, Any], scenario: Scenario, site: Site) -> None:
    from powerd.sim.report import text

    table = text(Report(scenario, site, compare=runs))
    for p in runs:
        assert f"\n{p} " in table
    assert "over budget" in table


def test_write_outputs_without_studies(
    runs: dict[str, Any], scenario: Scenario, site: Site, tmp_path: Path
) -> None:
    written = write_outputs(Report(scenario, site, compare=copy.copy(runs)), tmp_path)
    assert sorted(p.name for p in written) == ["power.png", "report.html", "throughput.png"]


def test_the_headline_judges_steering_against_the_gpus_the_feed_holds_at_tdp(
    scenario: Scenario, site: Site, runs: dict[str, Any]
) -> None:
    base = static_provisioning(scenario, site, Runner())
    assert base is not None
    node = next(g for g in site.policy.groups if g.level == 3)
    nodes = int(site.feed_w // (node.gpus * site.tdp_w + node.overhead_w))
    assert base.n_gpus == nodes * node.gpus < site.n_gpus
    assert base.over_budget_s == 0  # at TDP, within the feed: how sites provision today
    report = Report(scenario=scenario, site=site, compare=runs, provisioned=base)
    doc = to_json(report)
    assert doc["provisioned"]["gpus"] == base.n_gpus
    gain = doc["compare"]["fast"]["vs_provisioned"]
    assert gain["work"] == pytest.approx(runs["fast"].work_gpu_s / base.work_gpu_s)
    assert gain["facility_energy"] == pytest.approx(
        runs["fast"].facility_energy_j / base.facility_energy_j
    )
    out = text(report)
    assert f"provisioned at TDP (static), {base.n_gpus:,} GPUs" in out
    assert f"{runs['fast'].work_gpu_s / base.work_gpu_s - 1:+.0%} work" in out


def test_work_per_joule_is_on_the_energy_printed_beside_it(
    scenario: Scenario, site: Site, runs: dict[str, Any]
) -> None:
    # Before: the headline gave facility energy and, beside it, "work per joule" of GPU
    # energy, so the gains did not add up (+44% work for +40% energy read "+10% per joule").
    base = static_provisioning(scenario, site, Runner())
    assert base is not None
    fast = runs["fast"]
    work = fast.work_gpu_s / base.work_gpu_s
    facility = fast.facility_energy_j / base.facility_energy_j
    gpu = fast.gpu_energy_j / base.gpu_energy_j
    assert abs(facility - gpu) > 0.005  # node overhead: the two energies differ here
    doc = to_json(Report(scenario=scenario, site=site, compare=runs, provisioned=base))
    gain = doc["compare"]["fast"]["vs_provisioned"]
    assert gain["work_per_facility_joule"] == pytest.approx(work / facility)
    assert gain["work_per_joule"] == pytest.approx(work / gpu)  # its meaning kept: GPU energy
    summary = doc["compare"]["fast"]
    assert summary["work_per_facility_joule"] == pytest.approx(
        fast.work_gpu_s / fast.facility_energy_j
    )
    assert summary["work_per_joule"] == pytest.approx(fast.work_gpu_s / fast.gpu_energy_j)
    line = next(
        x for x in headline_lines(runs, base) if x.startswith(f"  fast on {fast.n_gpus:,} GPUs")
    )
    assert work < 3 and line.endswith(
        f"({facility - 1:+.0%} energy, {work / facility - 1:+.0%} work per facility joule)"
    )
