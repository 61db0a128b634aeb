"""The learn-swapped scenario: the policy's profiles are the wrong way round, the GPUs' perf
tells the truth, and online learning recovers 95 % of the true-profile steering's weighted
throughput while the run without learning stays far below it (docs/simulator.md)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from powerd.cli import main
from powerd.policy import load_policy
from powerd.sim.learning import learning_study
from powerd.sim.scenario import load_scenario
from powerd.sim.site import build_mix, site_for

SCENARIO = Path(__file__).parent.parent / "policies" / "scenarios" / "learn-swapped.yaml"


def test_learning_recovers_95_percent_of_the_true_profiles_within_two_hours() -> None:
    scenario = load_scenario(SCENARIO, {"duration_h": 3})
    policy = load_policy(scenario.policy_path)  # type: ignore[arg-type]
    site = site_for(scenario, policy)
    study = learning_study(scenario, site, build_mix(scenario, site))
    recovered = study.recovered_h("on")
    assert recovered is not None and recovered <= 2.0
    on, off = study.ratio("on"), study.ratio("off")
    late = study.t_h > recovered
    assert np.all(on[late] >= 0.95)
    # Without learning the same hours fall well short: the scenario shows something.
    assert off[late].min() < 0.9
    assert study.totals()["on"] > study.totals()["off"] + 0.03
    # Learning bends no bound: no budget exceeded, no committed caps above one.
    assert all(v == 0 for v in study.over_budget_s.values())
    assert all(v == 0 for v in study.committed_over_ticks.values())


def test_sim_learning_cli_writes_the_curve_and_figure(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["sim", str(SCENARIO), "--learning", "--duration-h", "1", "--out", str(tmp_path)])
    assert rc == 0
    doc = json.loads((tmp_path / "learning.json").read_text())
    n = len(doc["series"]["t_h"])
    assert n == 60 and len(doc["series"]["ratio_on"]) == n
    assert set(doc["share_of_best"]) == {"off", "on", "best"}
    assert (tmp_path / "learning.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "learning study: learn-swapped" in capsys.readouterr().out
