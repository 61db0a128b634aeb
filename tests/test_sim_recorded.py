"""`powerd sim --from-db`: a controller's recorded per-minute draw, in a real store, replayed
as the GPUs' demand, each at its place."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml
from sqlalchemy.orm import Session
from support.sim import scenario_dict, small_policy

from powerd.cli import main as powerd_main
from powerd.policy import parse_policy
from powerd.sim.recorded import read_recording
from powerd.sim.scenario import parse_scenario
from powerd.sim.site import build_mix, build_site
from powerd.sim.traces import TraceError
from powerd.store import Store, upgrade
from powerd.store.tables import Gpu, GpuMinute

T0 = 1_796_000_000 // 60 * 60  # a minute boundary


def record(url: str, minutes: int = 60) -> dict[str, float]:
    """What a controller's writer keeps: the inventory and per-minute draw of every GPU of
    the small site, each GPU at its own level (so replay by place can be seen)."""
    upgrade(url)
    policy = parse_policy(small_policy())
    store = Store(url)
    means = {}
    with Session(store.engine) as s, s.begin():
        for g in policy.groups:
            if g.level != 3:
                continue
            for k in range(g.gpus):
                uuid = f"GPU-{g.name}-{k}"
                s.add(
                    Gpu(uuid=uuid, node=g.name, index=k, name="H200", min_cap_w=200, max_cap_w=700)
                )
                level = 250.0 + 10.0 * len(means)
                means[uuid] = level
                for m in range(minutes):
                    w = level + 20.0 * np.sin(m / 5.0)
                    s.add(
                        GpuMinute(
                            uuid=uuid,
                            minute=T0 + 60 * m,
                            mean_power_w=w,
                            max_power_w=w + 5,
                            energy_j=60 * w,
                            mean_cap_w=700.0,
                            samples=60,
                        )
                    )
    store.close()
    return means


def test_each_gpu_replays_its_own_recording(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'rec.db'}"
    means = record(url)
    rec = read_recording(url, since=T0, until=T0 + 3600)
    policy = parse_policy(small_policy())
    sc = parse_scenario(scenario_dict(duration_h=0.5), "s.yaml")
    mix = build_mix(replace(sc, recording=rec), build_site(policy))
    assert mix.events == ()
    replayed = [w.trace.gpu for w in mix.workloads if w.trace is not None]  # type: ignore[attr-defined]
    assert replayed == list(means)  # site order is the inventory's: node by node, by index
    # The window cuts the recording.
    short = read_recording(url, since=T0 + 600, until=T0 + 1200)
    assert all(t.duration_s == pytest.approx(540.0) for t in short.traces)
    with pytest.raises(TraceError, match="no GPU has two or more"):
        read_recording(url, since=T0 + 10 * 3600, until=None)


def test_powerd_sim_from_db_keeps_budgets_on_the_recording(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"sqlite:///{tmp_path / 'rec.db'}"
    record(url)
    capsys.readouterr()  # the setup's own log lines
    pol = tmp_path / "policy.yaml"
    pol.write_text(yaml.safe_dump(small_policy()))
    sc = tmp_path / "scenario.yaml"
    sc.write_text(yaml.safe_dump({**scenario_dict(duration_h=0.5), "policy": "policy.yaml"}))
    argv = ["sim", str(sc), "--from-db", url, "--since", str(T0), "--json"]
    argv += ["--policies", "fast,static", "--progress", "never", "--jobs", "1"]
    assert powerd_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["compare"]["fast"]["over_budget_s"] == 0
    bad = ["sim", str(sc), "--from-db", f"sqlite:///{tmp_path / 'none.db'}", "--json"]
    assert powerd_main(bad) == 2
