"""Synchronous training in the simulator (docs/simulator.md, "Synchronous training"): a
job's ranks meet at every step, so the job runs at its slowest GPU's pace, and its nodes
report the job, which the controller couples as the policy's `control.reported_jobs` says."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from powerd.policy import Policy, load_policy
from powerd.safety import SafePlan
from powerd.sim.run import simulate
from powerd.sim.scenario import Scenario, load_scenario
from powerd.sim.site import Mix, Site, build_mix, site_for
from powerd.wire import REPORTED_JOB_PATTERN

SCENARIOS = Path(__file__).resolve().parents[1] / "policies" / "scenarios"


def shipped(name: str, **overrides: Any) -> tuple[Scenario, Policy]:
    sc = load_scenario(SCENARIOS / f"{name}.yaml", overrides)
    assert sc.policy_path is not None
    return sc, load_policy(sc.policy_path)


def with_reported_jobs(policy: Policy, scope: str) -> Policy:
    control = policy.spec.control.model_copy(update={"reported_jobs": scope})
    return replace(policy, spec=policy.spec.model_copy(update={"control": control}))


def test_each_training_job_is_one_synchronous_group_its_nodes_report() -> None:
    sc, policy = shipped("mixed-50")
    site = site_for(sc, policy)
    mix = build_mix(sc, site)
    names = [w.name for w in sc.spec.workloads]
    kinds = {w.name: w.kind for w in sc.spec.workloads}
    per_gpu = [names[k] for k in mix.workload_index.tolist()]
    expected = sum(w.jobs for w in sc.spec.workloads if w.kind == "training")
    assert len(mix.sync_jobs) == expected
    seen = np.concatenate(mix.sync_jobs)
    assert len(seen) == len(set(seen.tolist()))  # a GPU in one job at most
    for gpus in mix.sync_jobs:
        # One workload (the same demand pattern), one name, whole nodes.
        assert len({id(mix.workloads[i]) for i in gpus.tolist()}) == 1
        assert len({mix.gpu_jobs[i] for i in gpus.tolist()}) == 1
        nodes = {site.gpu_nodes[i] for i in gpus.tolist()}
        assert sum(site.gpu_nodes.count(n) for n in nodes) == len(gpus)
    assert len({mix.gpu_jobs[int(g[0])] for g in mix.sync_jobs}) == expected
    for i, job in enumerate(mix.gpu_jobs):
        if kinds[per_gpu[i]] == "training":
            assert job is not None and re.match(REPORTED_JOB_PATTERN, job)
        else:
            assert job is None  # serving and steady GPUs are in no job


def test_a_synchronous_job_runs_at_its_slowest_gpus_pace() -> None:
    sc, policy = shipped("training-sync")
    mix = build_mix(sc, site_for(sc, policy))
    n = len(mix.workloads)
    tput = np.linspace(0.5, 1.0, n)
    out = mix.sync_throughput(tput)
    members = np.concatenate(mix.sync_jobs)
    for gpus in mix.sync_jobs:
        assert np.all(out[gpus] == tput[gpus].min())
    alone = np.setdiff1d(np.arange(n), members)
    assert np.array_equal(out[alone], tput[alone])
    assert np.array_equal(tput, np.linspace(0.5, 1.0, n))  # not changed in place
    # A block of sub-steps (rows), each row on its own.
    block = np.vstack([tput, tput[::-1]])
    both = mix.sync_throughput(block)
    assert np.array_equal(both[0], out)
    assert np.array_equal(both[1], mix.sync_throughput(tput[::-1]))
    # Replayed GPUs (a recording or traces) are each their own: no groups.
    rec, rec_policy = shipped("recorded")
    rec_mix = build_mix(rec, site_for(rec, rec_policy))
    assert rec_mix.sync_jobs == () and set(rec_mix.gpu_jobs) == {None}
    assert rec_mix.sync_throughput(tput[: len(rec_mix.workloads)]) is not None


def spread_of_jobs(sc: Scenario, site: Site, mix: Mix) -> tuple[float, float]:
    """The largest spread of committed caps within one job over the run (W), and the work."""
    where: dict[str, int] = {}
    spread = 0.0

    def keep(report: object, plan: SafePlan) -> None:
        nonlocal spread
        if plan.layout is None:
            return
        if not where:
            where.update({u: i for i, u in enumerate(plan.layout.uuids)})
        for gpus in mix.sync_jobs:
            idx = [where[site_uuid[i]] for i in gpus.tolist()]
            caps = plan.committed_w[idx]
            spread = max(spread, float(caps.max() - caps.min()))

    site_uuid = [f"GPU-sim-{sc.spec.seed:x}-{i:06d}" for i in range(site.n_gpus)]
    result = simulate(sc, site, mix, "fast", trace=keep)
    assert result.over_budget_s == 0
    return spread, result.work_gpu_s


def test_reported_jobs_couple_a_jobs_gpus_across_nodes_and_recover_its_work() -> None:
    sc, policy = shipped("training-sync", duration_h=0.1, tick_s=5)
    runs = {}
    for scope in ("off", "site"):
        site = site_for(sc, with_reported_jobs(policy, scope))
        runs[scope] = spread_of_jobs(sc, site, build_mix(sc, site))
    # Steered GPU by GPU, a job's caps part (racks' budgets differ); reported site-wide,
    # the job holds one cap and none of its GPUs' power waits on the slowest.
    assert runs["off"][0] > 10.0
    assert runs["site"][0] < 1.0
    assert runs["site"][1] > runs["off"][1]


def test_the_baselines_read_a_swing_of_a_few_seconds_at_its_true_mean() -> None:
    # The baselines read demand once a sub-step (1 s). Read at each sub-step's start, a job
    # swinging every 2.5-4 s was seen at the same few points of its cycle: the oracle's
    # unconstrained work on training-sync was 13 % under the integrated model's.
    from powerd.sim.baselines import oracle

    sc, policy = shipped("training-sync", duration_h=0.1, tick_s=5)
    site = site_for(sc, policy)
    mix = build_mix(sc, site)
    reference = simulate(sc, site, mix, "static")  # every GPU at TDP: its demand, integrated
    result, unconstrained = oracle(sc, site, mix)
    assert unconstrained == pytest.approx(reference.work_gpu_s, rel=0.02)
    assert result.work_gpu_s <= unconstrained
