"""The command line as a user runs it: real processes, exit codes, output formats."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from support.cli import EXAMPLE, ROOT, powerd

SNAPSHOT = ROOT / "policies" / "example-snapshot.json"

pytestmark = pytest.mark.process  # every test runs `python -m powerd.cli`


def test_policy_check_summarises_the_example() -> None:
    out = powerd("policy", "check", str(EXAMPLE))
    assert out.returncode == 0, out.stderr
    assert "64 nodes, 512 GPUs expected" in out.stdout
    summary = json.loads(powerd("policy", "check", str(EXAMPLE), "--json").stdout)
    assert summary["gpus"] == 512
    assert summary["failsafe_total_w"] == 512 * 300 + 64 * 1000


def test_bad_policy_exits_2_with_the_path_and_no_traceback(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("profile: llm-training", "profile: nope"))
    out = powerd("policy", "check", str(bad))
    assert out.returncode == 2
    assert f"{bad}: invalid policy" in out.stderr
    assert "at classes.training.profile: unknown profile 'nope'" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("solver", ["fast", "cvxpy", "uniform", "priority-bands"])
def test_solve_prints_caps_that_fit_the_budgets(solver: str) -> None:
    args = ["--policy", str(EXAMPLE), "--snapshot", str(SNAPSHOT), "--solver", solver, "--json"]
    out = powerd("solve", *args)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["solver"] == solver
    assert result["status"] == "optimal"
    assert result["solve_ms"] > 0
    assert result["load_ms"] >= 0  # the compiled code, loaded before the timed solve
    caps = result["caps"]
    assert len(caps) == 512
    # 64 nodes × 1 kW overhead leave 186 kW of the 250 kW feed for GPU caps.
    assert sum(caps.values()) <= 186_000 + 1e-3
    assert all(200 - 1e-9 <= w <= 700 + 1e-9 for w in caps.values())


def test_solve_prints_whole_watts_for_people() -> None:
    """The table rounds (the solver's caps carry float noise such as 499.9999999998924 W);
    --json keeps every digit."""
    out = powerd("solve", "--policy", str(EXAMPLE), "--snapshot", str(SNAPSHOT))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("optimal (fast): 512 GPUs, caps 186.0 kW")
    assert re.fullmatch(
        r"solve \d+\.\d ms \(the compiled code loaded first in \d+ ms, not counted\)", lines[1]
    )
    header = lines.index(next(line for line in lines if line.startswith("gpu ")))
    assert lines[header].split() == ["gpu", "node", "class", "job", "draw", "cap", "now", "cap"]
    rows = lines[header + 1 :]
    assert len(rows) == 512
    caps = json.loads(
        powerd("solve", "--policy", str(EXAMPLE), "--snapshot", str(SNAPSHOT), "--json").stdout
    )["caps"]
    for row in rows:
        uuid, *_, cap, unit = row.split()
        assert unit == "W" and re.fullmatch(r"\d+", cap), row
        assert int(cap) == round(caps[uuid])


def test_warm_reports_the_cache_it_loaded_from() -> None:
    out = powerd("warm", "--json")
    assert out.returncode == 0, out.stderr
    w = json.loads(out.stdout)
    assert w["cached"] and w["jit"] and w["cache_dir"]
    assert w["compiled"] + w["loaded"] >= 17  # a fresh process: every kernel, one way or other


@pytest.mark.slow
def test_warm_compiles_once_then_loads(tmp_path: Path) -> None:
    """What ExecStartPre and an image build rely on: the first `powerd warm` compiles into
    NUMBA_CACHE_DIR and says so as it starts; the next process only loads (~10 s, then
    ~0.3 s on two cores)."""
    env = {**os.environ, "NUMBA_CACHE_DIR": str(tmp_path / "numba")}
    cmd = [sys.executable, "-m", "powerd.cli", "--log-format", "json", "--log-level", "info"]
    first = subprocess.run(
        [*cmd, "warm"], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300, check=False
    )
    assert first.returncode == 0, first.stderr
    said = first.stdout.splitlines()
    assert said[0].startswith("compiling the allocator's kernels (once per install; numba ")
    where = re.escape(str(tmp_path / "numba"))
    assert re.fullmatch(
        rf"solver ready in [\d.]+ s: \d+ kernels compiled, cached in {where}/\S+", said[1]
    )
    events = [json.loads(line)["event"] for line in first.stderr.splitlines()]
    assert events[:2] == ["solver_compiling", "solver_ready"]
    again = subprocess.run(
        [*cmd, "warm", "--json"],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    w = json.loads(again.stdout)
    compiled = int(re.findall(r"(\d+) kernels compiled", said[1])[0])
    assert (w["compiled"], w["loaded"]) == (0, compiled)
    assert w["cache_dir"].startswith(str(tmp_path))
    assert "solver_compiling" not in again.stderr


def test_solve_refuses_a_bad_snapshot_with_exit_2(tmp_path: Path) -> None:
    data = json.loads(SNAPSHOT.read_text())
    data["gpus"][3]["node"] = "ghost"
    data["gpus"][5]["power_w"] = -10
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps(data))
    out = powerd("solve", "--policy", str(EXAMPLE), "--snapshot", str(bad))
    assert out.returncode == 2
    assert "gpus[5].power_w" in out.stderr
    data["gpus"][5]["power_w"] = 10
    bad.write_text(json.dumps(data))
    out = powerd("solve", "--policy", str(EXAMPLE), "--snapshot", str(bad))
    assert out.returncode == 2
    assert "at gpus[3].node: node 'ghost' is not in the policy's tree" in out.stderr


def test_db_upgrade_is_idempotent(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    first = powerd("db", "upgrade", "--db", url)
    assert first.returncode == 0, first.stderr
    assert "migrated empty ->" in first.stdout
    second = powerd("db", "upgrade", "--db", url)
    assert "already at" in second.stdout


def test_db_id_prints_the_store_id_once_migrated(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'p.db'}"
    before = powerd("db", "id", "--db", url)
    assert before.returncode == 1 and "run `powerd db upgrade`" in before.stderr
    assert powerd("db", "upgrade", "--db", url).returncode == 0
    first, again = powerd("db", "id", "--db", url), powerd("db", "id", "--db", url)
    assert first.returncode == 0 and len(first.stdout.strip()) == 32
    assert again.stdout == first.stdout  # made once, when the database was created


def test_bad_broker_url_is_a_clear_error() -> None:
    out = powerd("agent", "--node-id", "n1", "--broker", "http://x", "--backend", "mock")
    assert out.returncode == 2
    assert "must start with mqtt:// or mqtts://" in out.stderr


def test_demo_steers_within_budgets_and_reports_json() -> None:
    out = powerd("demo", "--duration", "4", "--nodes", "16", "--json", timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [json.loads(line) for line in out.stdout.splitlines()]
    ticks, summary = lines[:-1], lines[-1]["summary"]
    assert ticks, "the demo printed no tick"
    assert all(not t["over_budget"] for t in ticks)
    # Start-up (GPUs counted at their maximum until their first ack) is flagged; past it,
    # committed caps stay within the budget.
    assert ticks[0]["startup"] and not ticks[-1]["startup"]
    assert all(t["committed_w"] <= t["budget_w"] + 1e-6 for t in ticks if not t["startup"])
    assert summary["ticks"] == len(ticks)
    assert summary["startup_ticks"] == sum(t["startup"] for t in ticks)
    assert summary["gpus"] == 128
    assert summary["ticks_committed_over_budget"] == 0
    assert summary["max_committed_over_budget_ratio"] <= 1.0 + 1e-6
    assert summary["startup_max_committed_ratio"] > 1.0  # its nodes: 8 × 700 W + 1 kW > 6.5 kW
    # The headline compares work under the same feed: static provisioning's GPUs at full
    # speed for this mix (fewer GPUs, none capped) against the steered fleet.
    static = summary["gpus_static_provisioning"]
    assert 0 < static <= summary["gpus"]
    assert 0 < summary["static_throughput"] <= static  # GPU-equivalents: at most 1 each
    # ...and the energy: the static GPUs' draw at their demand fits the feed they were sized
    # for (TDP and overhead each within it).
    assert 0 < summary["static_mean_draw_w"] <= summary["facility_budget_w"] + 1e-6
