"""Jobs without HTTP: the overrides' rules (one job per GPU), the state file round trip,
the tick engine filling the allocator's job_index/job_names, and snapshots naming jobs.
(The API, CLI, restarts and the Slurm scripts: tests/test_jobs_api.py.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.honest import NODES, HonestNode, policy_dict, tick

import powerd.controller.targets as targets_module
from powerd.allocator import GpuArrays, allocate
from powerd.allocator.solve import fleet_from_snapshot
from powerd.controller.jobs import GpuPlaces, JobView
from powerd.controller.opstate import OperatorState, StateFile, capture, restore
from powerd.controller.overrides import (
    MAX_PROFILE_POINTS,
    Conflict,
    Job,
    Jobs,
    NotFound,
    OverrideError,
    Overrides,
)
from powerd.controller.tick import TickEngine
from powerd.policy import Policy, parse_policy
from powerd.snapshot import SnapshotError, load_snapshot, parse_snapshot
from powerd.topology import Topology

ROOT = Path(__file__).resolve().parent.parent


def two_class_policy() -> Policy:
    data = policy_dict()
    data["profiles"]["steep"] = {"points": [[200, 0.2], [700, 2.0]]}
    data["classes"]["batch"] = {"weight": 0.5, "floor_w": 250, "profile": "p"}
    return parse_policy(data)


def job(name: str, *, uuids: tuple[str, ...] = (), nodes: tuple[str, ...] = (), **kw: Any) -> Job:
    fields: dict[str, Any] = {
        "class_": "c",
        "profile": None,
        "reason": "test",
        "actor": "alice",
        "created_at": 1.0,
    }
    fields.update(kw)
    return Job(name=name, uuids=uuids, nodes=nodes, **fields)


def no_fleet(_uuid: str) -> str | None:
    return None


def no_gpus(_node: str) -> list[str]:
    return []


def test_a_gpu_belongs_to_at_most_one_job() -> None:
    policy = two_class_policy()
    o = Overrides()
    heard = {"GPU-r1-n1-0": "r1-n1", "GPU-r2-n1-0": "r2-n1"}
    on_node = {"r1-n1": ["GPU-r1-n1-0"], "r2-n1": ["GPU-r2-n1-0"]}
    node_of, gpus_of = heard.get, lambda n: on_node.get(n, [])
    assert not o.put_job(policy, job("a", uuids=("GPU-r2-n1-0", "GPU-new")), node_of, gpus_of)
    assert not o.put_job(policy, job("b", nodes=("r1-n2",)), node_of, gpus_of)
    before = o.jobs
    # A uuid of another job; a node of another job; a GPU another job names, on a node this
    # one names; a GPU on a node another job holds: each refused, naming the other job.
    cases = [
        (job("c", uuids=("GPU-new",)), "GPU GPU-new is in job 'a'"),
        (job("c", nodes=("r1-n2",)), "node r1-n2 is in job 'b'"),
        (job("c", nodes=("r2-n1",)), "GPU GPU-r2-n1-0 on node r2-n1 is in job 'a'"),
    ]
    for j, why in cases:
        with pytest.raises(Conflict, match=why):
            o.put_job(policy, j, node_of, gpus_of)
    heard["GPU-late"] = "r1-n2"
    with pytest.raises(Conflict, match="GPU GPU-late is on node r1-n2 of job 'b'"):
        o.put_job(policy, job("c", uuids=("GPU-late",)), node_of, gpus_of)
    assert o.jobs is before  # nothing changed
    # Re-putting a job replaces it, GPUs it dropped are free for others.
    assert o.put_job(policy, job("a", uuids=("GPU-new",)), node_of, gpus_of)
    assert o.jobs.job_of("GPU-r2-n1-0", "r2-n1") is None
    o.put_job(policy, job("c", uuids=("GPU-r2-n1-0",)), node_of, gpus_of)
    assert o.jobs.job_of("GPU-r2-n1-0", "r2-n1") == "c"
    assert o.jobs.job_of("GPU-x", "r1-n2") == "b"  # every GPU of the node
    assert o.delete_job("b").nodes == ("r1-n2",)
    assert o.jobs.job_of("GPU-x", "r1-n2") is None
    with pytest.raises(NotFound, match="no job 'b'"):
        o.delete_job("b")


def test_job_validation() -> None:
    policy = two_class_policy()
    o = Overrides()
    bad = [
        (job("x:y", uuids=("G",)), OverrideError, "job name 'x:y' must be"),
        (job("a", uuids=("G",), class_="gaming"), OverrideError, "valid: batch, c"),
        (job("a"), OverrideError, "at least one GPU"),
        (job("a", nodes=("ghost",)), NotFound, "unknown node"),
        (job("a", uuids=("G",), profile=((200.0, -1.0),)), OverrideError, "profile: "),
        (
            job("a", uuids=("G",), profile=tuple((float(i), 1.0) for i in range(65))),
            OverrideError,
            f"at most {MAX_PROFILE_POINTS} points",
        ),
    ]
    for j, exc, why in bad:
        with pytest.raises(exc, match=why):
            o.put_job(policy, j, no_fleet, no_gpus)
    assert len(o.jobs) == 0


def test_the_number_of_jobs_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("powerd.controller.overrides.MAX_JOBS", 2)
    policy = two_class_policy()
    o = Overrides()
    o.put_job(policy, job("a", uuids=("A",)), no_fleet, no_gpus)
    o.put_job(policy, job("b", uuids=("B",)), no_fleet, no_gpus)
    with pytest.raises(OverrideError, match="at most 2 jobs"):
        o.put_job(policy, job("c", uuids=("C",)), no_fleet, no_gpus)
    o.put_job(policy, job("b", uuids=("B", "B2")), no_fleet, no_gpus)  # a replacement fits


def test_jobs_round_trip_through_the_state_file(tmp_path: Path) -> None:
    policy = two_class_policy()
    o = Overrides()
    o.put_job(
        policy,
        job("j1", uuids=("U1", "U2"), nodes=("r1-n1",), profile=((200.0, 0.5), (600.0, 1.0))),
        no_fleet,
        no_gpus,
    )
    o.put_job(policy, job("j2", nodes=("r2-n2",), class_="batch"), no_fleet, no_gpus)
    f = StateFile(tmp_path / "state.json")
    f.save(OperatorState(revision=3, **capture(o)))
    loaded = f.load()
    assert loaded is not None
    back = restore(loaded, policy, now_wall=0.0)
    assert dict(back.jobs.by_name) == dict(o.jobs.by_name)
    assert dict(back.jobs.uuid_job) == {"U1": "j1", "U2": "j1"}
    assert dict(back.jobs.node_job) == {"r1-n1": "j1", "r2-n2": "j2"}
    # A hand edit that puts a GPU in two jobs: the later job is dropped, not both kept.
    raw = json.loads((tmp_path / "state.json").read_text())
    raw["jobs"].append(dict(raw["jobs"][0], name="j3"))
    (tmp_path / "state.json").write_text(json.dumps(raw))
    loaded = f.load()
    assert loaded is not None
    assert sorted(restore(loaded, policy, 0.0).jobs.by_name) == ["j1", "j2"]
    # A state file without jobs (an older powerd's) reads as none.
    del raw["jobs"]
    (tmp_path / "state.json").write_text(json.dumps(raw))
    loaded = f.load()
    assert loaded is not None and len(restore(loaded, policy, 0.0).jobs) == 0


class Spy:
    """Records the GpuArrays each tick hands the allocator (the real allocator still runs)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.fleets: list[GpuArrays] = []
        self.policies: list[Policy] = []
        real = targets_module.allocate_arrays

        def spy(fleet: GpuArrays, policy: Policy, *args: Any, **kwargs: Any) -> Any:
            self.fleets.append(fleet)
            self.policies.append(policy)
            return real(fleet, policy, *args, **kwargs)

        monkeypatch.setattr(targets_module, "allocate_arrays", spy)


def run_ticks(engine: TickEngine, nodes: dict[str, HonestNode], ticks: range) -> Any:
    report = None
    for t in ticks:
        report, _ = tick(engine, nodes, t, wall0=1_700_000_000.0)
    return report


def test_the_engine_fills_job_index_and_steers_members_as_the_jobs_class(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = two_class_policy()
    engine = TickEngine(policy)
    spy = Spy(monkeypatch)
    nodes = {n: HonestNode(n) for n in NODES}
    run_ticks(engine, nodes, range(2))
    assert spy.fleets[-1].job_index is None and spy.fleets[-1].job_names == ()

    fleet = engine.fleet

    def node_of(u: str) -> str | None:
        rec = fleet.gpus.get(u)
        return None if rec is None else rec.node

    o = engine.overrides
    # Across racks: two GPUs of r1-n1 by uuid, all of r2-n2 by node; its own profile.
    o.put_job(
        policy,
        job(
            "train-7",
            uuids=("GPU-r1-n1-0", "GPU-r1-n1-1"),
            nodes=("r2-n2",),
            class_="batch",
            profile=((200.0, 0.3), (500.0, 1.0)),
        ),
        node_of,
        fleet.gpus_of,
    )
    o.put_job(policy, job("infer-1", uuids=("GPU-r1-n2-3",)), node_of, fleet.gpus_of)
    # The same class and curve as train-7: the two share the class made for that curve.
    o.put_job(
        policy,
        job(
            "train-8", uuids=("GPU-r2-n1-2",), class_="batch", profile=((200.0, 0.3), (500.0, 1.0))
        ),
        node_of,
        fleet.gpus_of,
    )
    report = run_ticks(engine, nodes, range(2, 4))
    f = spy.fleets[-1]
    assert f.job_index is not None and f.job_names == ("train-7", "infer-1", "train-8")
    members = {
        u: f.job_names[j] for u, j in zip(f.uuids, f.job_index.tolist(), strict=True) if j >= 0
    }
    assert members == {
        "GPU-r1-n1-0": "train-7",
        "GPU-r1-n1-1": "train-7",
        **{f"GPU-r2-n2-{i}": "train-7" for i in range(4)},
        "GPU-r1-n2-3": "infer-1",
        "GPU-r2-n1-2": "train-8",
    }
    # The allocator's policy has a class made for the job with its own profile: the
    # class's weight and floor, the job's curve; the report shows the job's class.
    allocator_policy = spy.policies[-1]
    [own] = [c for c in allocator_policy.classes if c.startswith("job:")]  # infer-1: none
    assert own.startswith("job:batch:")
    made = allocator_policy.classes[own]
    assert (made.weight, made.floor_w) == (0.5, 250)
    assert allocator_policy.class_profile(own).peak_w == 500.0
    names = engine.targets.classes.names
    in_train = [i for i, u in enumerate(f.uuids) if members.get(u) in ("train-7", "train-8")]
    assert {names[c] for c in f.class_index[in_train].tolist()} == {own}
    assert {report.classes[i] for i in in_train} == {"batch"}
    assert report.classes[f.uuids.index("GPU-r1-n2-3")] == "c"
    assert policy.classes.keys() == {"c", "batch"}  # the operators' policy is untouched

    # Nothing changed: the view and the per-GPU index are reused, not rebuilt.
    view, index = engine.targets.jobs, engine.targets.job_index
    run_ticks(engine, nodes, range(4, 5))
    assert engine.targets.jobs is view and engine.targets.job_index is index
    # A job deleted: the next tick has one job left, the GPUs back to their own class.
    o.delete_job("train-7")
    o.delete_job("train-8")
    run_ticks(engine, nodes, range(5, 6))
    f = spy.fleets[-1]
    assert f.job_names == ("infer-1",) and f.job_index is not None
    assert int((f.job_index >= 0).sum()) == 1
    assert own not in spy.policies[-1].classes


def test_job_view_without_jobs_is_the_policy() -> None:
    policy = two_class_policy()
    view = JobView.compile(policy, Jobs())
    assert view.policy is policy and view.names == ()
    places = GpuPlaces.build(["a"], Topology.build(policy, ["r1-n1"]))
    assert view.index(places) is None


def test_the_job_index_is_each_gpus_job_of() -> None:
    """The vectorised index agrees with Jobs.job_of GPU by GPU: by uuid first, else by
    node; a uuid the fleet lacks changes nothing."""
    policy = two_class_policy()
    nodes = [n for n in NODES for _ in range(4)]
    uuids = [f"GPU-{n}-{i}" for n in NODES for i in range(4)]
    jobs, dropped = Jobs.build(
        [
            job("by-node", nodes=("r1-n1", "r2-n2")),
            job("by-uuid", uuids=("GPU-r1-n1-2", "GPU-r2-n1-0", "GPU-gone")),
            job("node-curve", nodes=("r1-n2",), profile=((200.0, 0.5), (600.0, 1.0))),
        ]
    )
    assert not dropped
    view = JobView.compile(policy, jobs)
    # r2-n1 reports only its GPU 0: positions shift, as a fleet's do.
    uuids2, nodes2 = uuids[:9] + uuids[12:], nodes[:9] + nodes[12:]
    index = view.index(GpuPlaces.build(uuids2, Topology.build(policy, nodes2)))
    assert index is not None
    got = [view.names[j] if j >= 0 else None for j in index.tolist()]
    assert got == [jobs.job_of(u, n) for u, n in zip(uuids2, nodes2, strict=True)]
    assert got[2] == "by-uuid" and got[0] == "by-node" and got[8] == "by-uuid"
    assert got.count("node-curve") == 4 and got.count(None) == 0


# ---- snapshots ----


def snapshot_gpus() -> list[dict[str, Any]]:
    return [
        {
            "uuid": f"G{i}",
            "node": NODES[i // 2],
            "min_cap_w": 200,
            "max_cap_w": 700,
            "power_w": 400,
            "cap_w": 700,
        }
        for i in range(8)
    ]


def test_a_snapshot_names_jobs_and_the_fleet_carries_them() -> None:
    policy = two_class_policy()
    gpus = snapshot_gpus()
    for i in (0, 1, 6):
        gpus[i] |= {"job": "j-a", "workload": "batch"}
    for i in (2, 4):
        gpus[i]["job"] = "j-b"
    snapshot = parse_snapshot({"gpus": gpus}, policy)
    fleet = fleet_from_snapshot(snapshot, policy)
    assert fleet.job_names == ("j-a", "j-b")
    assert fleet.job_index is not None
    assert fleet.job_index.tolist() == [0, 0, 1, -1, 1, -1, 0, -1]
    # Without jobs: None, as the engine gives it.
    plain = fleet_from_snapshot(parse_snapshot({"gpus": snapshot_gpus()}, policy), policy)
    assert plain.job_index is None and plain.job_names == ()


def test_a_job_steers_as_one_class_and_its_name_is_bounded() -> None:
    policy = two_class_policy()
    gpus = snapshot_gpus()
    gpus[0] |= {"job": "j", "workload": "batch"}
    gpus[3] |= {"job": "j"}  # the default class, c
    with pytest.raises(SnapshotError) as err:
        parse_snapshot({"gpus": gpus}, policy, "s.json")
    assert "gpus[3].workload" in str(err.value)
    assert "job 'j' steers as one class: gpus[0] is 'batch', this GPU 'c'" in str(err.value)
    gpus = snapshot_gpus()
    gpus[0]["job"] = ""
    gpus[1]["job"] = "x" * 129
    with pytest.raises(SnapshotError) as err:
        parse_snapshot({"gpus": gpus}, policy)
    assert "at gpus[0].job: String should have at least 1 character" in str(err.value)
    assert "at gpus[1].job: String should have at most 128 characters" in str(err.value)


def test_the_example_snapshot_with_jobs_solves() -> None:
    from powerd.policy import load_policy

    policy = load_policy(ROOT / "policies" / "example.yaml")
    snapshot = load_snapshot(ROOT / "policies" / "example-snapshot-jobs.json", policy)
    fleet = fleet_from_snapshot(snapshot, policy)
    assert fleet.job_index is not None
    sizes = np.bincount(fleet.job_index[fleet.job_index >= 0])
    assert len(fleet.job_names) == len(sizes) >= 3 and sizes.min() >= 8
    # The allocator solves it (equal caps within a job are the allocator's own tests).
    alloc = allocate(snapshot, policy)
    assert alloc.status in ("optimal", "floors_dropped") and len(alloc.caps_w) == fleet.n
