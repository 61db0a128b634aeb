"""The shipped hard workloads (docs/simulator.md, "Workloads"): each scenario's demand has
the swings, dips, steps and surges its file documents, checked on the model's demand."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from powerd.backends.mock import IDLE_W, SimulatedGpus
from powerd.policy import load_policy
from powerd.sim.scenario import HOUR_S, load_scenario
from powerd.sim.site import Mix, build_mix, site_for

SCENARIOS = Path(__file__).resolve().parents[1] / "policies" / "scenarios"


def load(name: str) -> tuple[Mix, SimulatedGpus, list[str]]:
    sc = load_scenario(SCENARIOS / f"{name}.yaml")
    assert sc.policy_path is not None
    site = site_for(sc, load_policy(sc.policy_path))
    mix = build_mix(sc, site)
    model = SimulatedGpus(site.n_gpus, list(mix.workloads), seed=sc.spec.seed)
    names = [w.name for w in sc.spec.workloads]
    return mix, model, [names[k] for k in mix.workload_index.tolist()]


def demand(model: SimulatedGpus, times: np.ndarray) -> np.ndarray:
    return np.array([model.demand_at(float(t)) for t in times.ravel()])


def jobs_of(mix: Mix, names: list[str], workload: str) -> list[np.ndarray]:
    """The GPUs of each job (or service) of a workload: those that share one Workload."""
    gpus = [i for i, n in enumerate(names) if n == workload]
    by_job: dict[int, list[int]] = {}
    for i in gpus:
        by_job.setdefault(id(mix.workloads[i]), []).append(i)
    return [np.array(v) for v in by_job.values()]


def test_training_jobs_swing_together_with_the_documented_depth_and_period() -> None:
    mix, model, names = load("training-sync")
    (pretrain,) = jobs_of(mix, names, "pretrain")
    finetune = jobs_of(mix, names, "finetune")
    assert [pretrain.size, *sorted(j.size for j in finetune)] == [384, 64, 64]
    times = 600.0 + np.arange(0.0, 60.0, 0.05)  # a minute while every job runs
    d = demand(model, times)
    job = d[:, pretrain]
    # Every GPU of a job in phase, at every instant.
    assert np.all(job == job[:, :1])
    level = job[:, 0]
    work = level[level > 150]  # outside a checkpoint dip, if one falls in the minute
    assert set(np.unique(work)) == {170.0, 690.0}  # the 520 W swing, compute to communication
    on = work == 690.0
    assert on.mean() == pytest.approx(0.7, abs=0.03)  # duty
    rises = times[: work.size][1:][np.diff(on.astype(int)) == 1]
    assert np.allclose(np.diff(rises), 4.0, atol=0.06)  # one iteration every 4 s
    # The jobs are not in phase with each other.
    assert not np.array_equal(d[:, finetune[0][0]], d[:, finetune[1][0]])


def test_checkpoints_dip_every_job_to_near_idle_together() -> None:
    mix, model, names = load("training-sync")
    (pretrain,) = jobs_of(mix, names, "pretrain")
    times = np.arange(0.0, 0.7 * HOUR_S, 1.0)
    level = demand(model, times)[:, pretrain]
    assert np.all(level == level[:, :1])
    dipped = level[:, 0] == 110.0
    starts = times[1:][np.diff(dipped.astype(int)) == 1]
    # Every 20 minutes, for 45 s (at 1 s sampling: 45 or 46 samples per dip).
    assert np.allclose(np.diff(starts), 1200.0, atol=1.0)
    assert dipped.sum() in range(45 * len(starts), 46 * (len(starts) + 1) + 1)
    assert 2 <= len(starts) <= 3
    # No work while checkpointing, work again after.
    t_dip = float(times[np.argmax(dipped)])
    assert not model.demand_and_working_at(t_dip)[1][pretrain].any()
    assert model.demand_and_working_at(t_dip + 60.0)[1][pretrain].all()


def test_job_starts_and_ends_are_steps_of_all_its_gpus() -> None:
    mix, model, names = load("training-steps-3k")
    (job,) = jobs_of(mix, names, "pretrain")
    assert job.size == 2048
    at = demand(model, np.array([0.05 * HOUR_S - 1, 0.05 * HOUR_S + 1, 0.25 * HOUR_S + 1]))
    assert np.all(at[0, job] == IDLE_W)  # before the start
    assert np.all(at[1, job] == at[1, job[0]]) and at[1, job[0]] > 150  # all on at once
    assert np.all(at[2, job] == IDLE_W)  # crashed: all off at once
    swing = float(at[1, job].sum() - at[0, job].sum())
    assert swing >= 2048 * (170 - IDLE_W)  # ≥ 205 kW in one step, up to 1.27 MW


def test_services_surge_together_and_gpus_prefill_alone() -> None:
    mix, model, names = load("inference-diurnal")
    chat = jobs_of(mix, names, "chat")
    assert sorted(s.size for s in chat) == [64] * 5
    times = 14 * HOUR_S + np.arange(0.0, 3600.0, 2.0)  # one 2 s sample per prefill slot
    d = demand(model, times)
    service = chat[0]
    # The daily curve at the sample, without bursts, is the least any GPU of a service
    # draws; a surge lifts every GPU of the service by 150 W at once.
    floor = d[:, service].min(axis=1)
    surging = floor - np.median(floor) > 100
    assert 0.02 < surging.mean() < 0.2  # documented probability 0.08, in 180 s slots
    other = d[:, chat[1]].min(axis=1)
    other_surging = other - np.median(other) > 100
    assert not np.array_equal(surging, other_surging)  # services surge independently
    # Prefill bursts: per GPU, independent, about 15 % of 2 s slots, 330 W above decode.
    extra = d[:, service] - floor[:, None]
    bursting = extra > 300
    assert bursting.mean() == pytest.approx(0.15, abs=0.02)
    together = bursting.all(axis=1).mean()
    assert together < 0.01  # a service's GPUs do not prefill in step


def test_the_daily_curves_peak_when_the_file_says() -> None:
    _, model, names = load("inference-diurnal")
    chat = np.array([n == "chat" for n in names])
    code = ~chat
    hours = np.arange(0.0, 24.0, 0.25)
    # The least any GPU of a workload draws over five surge slots is its decode curve (a
    # surge would have to reach every service in every slot): it peaks at the documented
    # hour, from 170 to 320 W for chat.
    offsets = np.arange(5) * 180.0
    d = demand(model, (hours * HOUR_S)[:, None] + offsets[None, :]).reshape(
        hours.size, offsets.size, -1
    )
    chat_curve, code_curve = (d[:, :, w].min(axis=(1, 2)) for w in (chat, code))
    assert hours[np.argmax(chat_curve)] == pytest.approx(15, abs=0.5)
    assert hours[np.argmax(code_curve)] == pytest.approx(10, abs=0.5)
    assert chat_curve.min() == pytest.approx(170, abs=2)
    assert chat_curve.max() == pytest.approx(320, abs=2)


def test_mixed_scenario_holds_both_halves() -> None:
    mix, model, names = load("mixed-correlated")
    assert names.count("chat") == names.count("pretrain") == 256
    jobs = jobs_of(mix, names, "pretrain")
    d = demand(model, np.array([0.1 * HOUR_S, 0.4 * HOUR_S, 1.3 * HOUR_S]))
    queued, started = sorted(jobs, key=lambda j: int(d[0, j[0]] > IDLE_W))
    assert np.all(d[0, queued] == IDLE_W) and np.all(d[1, queued] > IDLE_W)
    assert np.all(d[2, started] == IDLE_W)  # the first job ended at 1.2 h
