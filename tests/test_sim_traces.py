"""The simulator replaying recorded GPU power (nvidia-smi CSV traces written here): every
GPU replays one recorded GPU, nodes out of step unless asked, and powerd keeps every
budget on the replayed demand."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import structlog.testing
from support.sim import small_policy

from powerd.backends.mock import SimulatedGpus
from powerd.policy import parse_policy
from powerd.sim.run import STATIC, simulate
from powerd.sim.scenario import ScenarioError, parse_scenario
from powerd.sim.site import build_mix, build_site
from powerd.sim.traces import TraceError, read_nvidia_smi_csv
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.traces import write_trace


def scenario(tmp_path: Path, **workload: Any) -> dict[str, Any]:
    write_trace(tmp_path / "traces" / "train.csv", kind="training", seed=1, duration_s=300)
    write_trace(tmp_path / "traces" / "serve.csv", kind="inference", seed=2, duration_s=300)
    return {
        "name": "replay",
        "duration_h": 0.25,
        "tick_s": 5,
        "seed": 4,
        "workloads": [
            {"name": "serving", "class": "inference", "share": 0.5, "traces": ["traces/serve.csv"]}
            | workload,
            {"name": "training", "class": "training", "share": 0.5, "traces": ["traces/t*.csv"]},
        ],
    }


def test_each_gpu_replays_a_recorded_one_and_nodes_are_out_of_step(tmp_path: Path) -> None:
    policy = parse_policy(small_policy())
    sc = parse_scenario(scenario(tmp_path), "s.yaml", base_dir=tmp_path)
    site = build_site(policy)
    mix = build_mix(sc, site)
    # Every GPU's demand is a recorded draw: the fleet's mean over the run is the traces'.
    recorded = {
        Path(t.source).name: float(t.draw_w.mean())
        for f in ("serve.csv", "train.csv")
        for t in read_nvidia_smi_csv(tmp_path / "traces" / f)[:1]
    }
    serving = np.flatnonzero(mix.workload_index == 0)
    assert {w.pattern.value for w in mix.workloads} == {"trace"}
    model = SimulatedGpus(len(mix.workloads), list(mix.workloads))
    times = np.arange(0.0, 900.0, 2.0)
    demand = np.array([model.demand_at(t) for t in times])
    assert demand[:, serving].mean() == pytest.approx(recorded["serve.csv"], rel=0.05)
    # Out of step: two serving nodes' first GPUs do not see the same draw at the same time.
    first_of_node = serving[:: policy.groups[-1].gpus]
    assert len(first_of_node) >= 2
    a, b = demand[:, first_of_node[0]], demand[:, first_of_node[1]]
    assert not np.allclose(a, b)


def test_lockstep_replays_every_node_from_the_same_moment(tmp_path: Path) -> None:
    policy = parse_policy(small_policy())
    sc = parse_scenario(scenario(tmp_path, lockstep=True), "s.yaml", base_dir=tmp_path)
    mix = build_mix(sc, build_site(policy))
    serving = [w for w, k in zip(mix.workloads, mix.workload_index.tolist(), strict=True) if k == 0]
    assert {w.phase_s for w in serving} == {0.0}


def test_powerd_keeps_every_budget_on_replayed_demand(tmp_path: Path) -> None:
    policy = parse_policy(small_policy())
    sc = parse_scenario(scenario(tmp_path), "s.yaml", base_dir=tmp_path)
    site = build_site(policy)
    mix = build_mix(sc, site)
    fast = simulate(sc, site, mix, "fast")
    static = simulate(sc, site, mix, STATIC)
    assert fast.over_budget_s == 0 and fast.committed_over_ticks == 0
    assert fast.max_excess_ratio <= 1.0 + 1e-9
    assert static.over_budget_s > 0  # the recorded demand is more than the feed
    assert 0 < fast.work_gpu_s < static.work_gpu_s


def test_a_study_reads_a_growing_trace_once(tmp_path: Path) -> None:
    # Every run of a study builds its mix; each used to read the files again, so a
    # recording still being written replayed different samples per run (and a cut last
    # line warned once per run).
    sc = parse_scenario(scenario(tmp_path), "s.yaml", base_dir=tmp_path)
    serve = tmp_path / "traces" / "serve.csv"
    serve.write_text(serve.read_text()[:-5])  # cut mid-line, as while recording
    site = build_site(parse_policy(small_policy()))
    with structlog.testing.capture_logs() as logs:
        first = build_mix(sc, site)
        with serve.open("a") as f:  # the recording goes on
            f.write("1 W\n" + "garbage\n")
        again = build_mix(sc, site)
    assert [e["event"] for e in logs] == ["trace_last_line_dropped"]
    pairs = zip(first.workloads, again.workloads, strict=True)
    assert all(a.trace is b.trace and a.trace is not None for a, b in pairs)


def test_bad_trace_references_are_clear(tmp_path: Path) -> None:
    with pytest.raises(ScenarioError, match="pattern"):
        parse_scenario(scenario(tmp_path, pattern="training"), "s.yaml", base_dir=tmp_path)
    sc = parse_scenario(
        scenario(tmp_path, traces=["traces/none-*.csv"]), "s.yaml", base_dir=tmp_path
    )
    with pytest.raises(TraceError, match="no file matches"):
        build_mix(sc, build_site(parse_policy(small_policy())))


@pytest.mark.process
def test_an_agents_recording_is_a_trace_the_simulator_reads(
    tmp_path: Path, mosquitto: LocalMosquitto
) -> None:
    """`powerd agent --record FILE` (a real agent process, mock GPUs) writes nvidia-smi's
    CSV, which the trace reader takes as it takes nvidia-smi's own."""
    record = tmp_path / "node-1.csv"
    agent = subprocess.Popen(
        [
            *(sys.executable, "-m", "powerd.cli", "agent", "--node-id", "node-1"),
            *("--broker", mosquitto.url, "--backend", "mock", "--mock-gpus", "2"),
            *("--period", "0.2", "--record", str(record)),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if record.exists() and record.read_text().count("\n") >= 1 + 2 * 10:
                break
            time.sleep(0.1)
    finally:
        agent.send_signal(signal.SIGTERM)
        agent.wait(timeout=30)
    assert record.read_text().splitlines()[0].startswith("timestamp, index, uuid, power.draw [W]")
    traces = read_nvidia_smi_csv(record)
    assert len(traces) == 2
    for t in traces:
        assert t.interval_s == pytest.approx(0.2, abs=0.05)
        assert t.limit_w is not None and (t.limit_w > 0).all()
        assert (t.draw_w > 0).all()
