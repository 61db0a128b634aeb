"""Jobs through the admin API over real HTTP: writes, conflicts, validation, roles and the
audit log (a live controller on SQLite); restarts on SQLite and PostgreSQL (the controller
as systemd runs it); `powerd job ...`; and the Slurm prolog/epilog scripts with a fake
`scontrol` against the live API."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from schemathesis import GenerationMode
from support.daemons import Site
from support.live_api import POLICY, LiveApi, run, wait_until
from support.pg import BACKENDS, pg_database
from support.schema import CHECKS, fuzz

from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from powerd.clock import SystemClock
from powerd.controller.build import ControllerOptions, build_controller
from powerd.controller.controller import Controller
from powerd.controller.opstate import StateFile
from powerd.policy import load_policy_text
from powerd.store import Store, upgrade
from powerd.testing.mosquitto import LocalMosquitto, free_port
from powerd.transport import MemoryBroker

ROOT = Path(__file__).resolve().parent.parent
SLURM = ROOT / "contrib" / "slurm"
PROFILE = [[200, 0.3], [450, 0.9], [600, 1.0]]


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path, state_file=tmp_path / "state.json").start()
    try:
        yield api
    finally:
        api.close()


def uuids_of(c: httpx.Client, node: str) -> list[str]:
    items = c.get("/api/v1/gpus", params={"node": node}).json()["items"]
    return [g["uuid"] for g in sorted(items, key=lambda g: g["index"])]


def jobs_of_gpus(c: httpx.Client) -> dict[str, str | None]:
    return {g["uuid"]: g["job"] for g in c.get("/api/v1/gpus").json()["items"]}


def test_put_get_delete_a_job_across_racks(live: LiveApi) -> None:
    with live.client("operator") as c:
        n1, n22 = uuids_of(c, "rack-1-n1"), uuids_of(c, "rack-2-n2")
        r = c.put(
            "/api/v1/jobs/4242",
            json={
                "class": "inference",
                # A GPU of a node it also holds: named twice, counted once.
                "uuids": [n1[0], "GPU-not-yet-1", n22[0], n1[0]],
                "nodes": ["rack-2-n2"],
                "profile": PROFILE,
                "reason": "slurm job 4242",
            },
        )
        assert r.status_code == 200, r.text
        body = r.json()
        assert (body["action"], body["target"], body["replaced"]) == ("job.put", "4242", False)
        assert (body["applied"], body["durable"], body["audited"]) == (True, True, True)
        job = body["job"]
        assert job["class"] == "inference" and job["nodes"] == ["rack-2-n2"]
        assert job["uuids"] == [n1[0], "GPU-not-yet-1", n22[0]]  # once each
        assert job["profile"] == PROFILE and job["actor"] == "operator-user"
        # Accepted though not heard yet: the answer says which; 1 + 2 (the node's) heard.
        assert job["unseen_uuids"] == ["GPU-not-yet-1"] and job["gpus_seen"] == 3

        with live.client("viewer") as v:
            listed = v.get("/api/v1/jobs").json()
            assert listed["total"] == 1 and listed["items"][0] == job
            assert v.get("/api/v1/jobs/4242").json() == job
            assert v.get("/api/v1/jobs/nope").status_code == 404
            # The GPU view names each GPU's job; ?job= selects them.
            members = {
                g["uuid"] for g in v.get("/api/v1/gpus", params={"job": "4242"}).json()["items"]
            }
            assert members == {n1[0], *uuids_of(v, "rack-2-n2")}
            assert jobs_of_gpus(v)[n1[1]] is None
            # A viewer may not write.
            denied = v.put(
                "/api/v1/jobs/x", json={"class": "inference", "nodes": ["rack-1-n2"], "reason": "x"}
            )
            assert denied.status_code == 403

        # The engine steers the members as the job (the report shows its class).
        after = body["after_tick"]

        def steered() -> bool:
            a = c.get("/api/v1/allocation").json()
            return a["tick"] > after and {
                g["class"] for g in a["caps"]["items"] if g["uuid"] in members
            } == {"inference"}

        wait_until(steered, "the job's GPUs steered as its class")
        assert live.controller is not None
        view = live.controller.engine.targets.jobs
        assert view is not None and view.names == ("4242",)

        # Re-PUT replaces: the node is dropped, the uuid kept.
        r = c.put(
            "/api/v1/jobs/4242", json={"class": "training", "uuids": [n1[0]], "reason": "resize"}
        )
        assert r.status_code == 200 and r.json()["replaced"] is True
        assert r.json()["job"]["nodes"] == [] and r.json()["job"]["profile"] is None
        assert jobs_of_gpus(c)[uuids_of(c, "rack-2-n2")[0]] is None

        r = c.delete("/api/v1/jobs/4242", params={"reason": "job ended"})
        assert r.status_code == 200, r.text
        assert (r.json()["action"], r.json()["gpus"], r.json()["nodes"]) == ("job.delete", 1, 0)
        assert c.get("/api/v1/jobs").json()["total"] == 0
        assert c.delete("/api/v1/jobs/4242", params={"reason": "again"}).status_code == 404
        audit = [
            (a["action"], a["target"], a["result"].split(":")[0])
            for a in c.get("/api/v1/audit").json()["items"]
        ]
        assert audit[:4] == [
            ("job.delete", "4242", "refused"),
            ("job.delete", "4242", "ok"),
            ("job.put", "4242", "ok"),
            ("job.put", "4242", "ok"),
        ]


def test_a_gpu_of_another_job_is_a_409_that_names_it(live: LiveApi) -> None:
    with live.client("operator") as c:
        n1, n2 = uuids_of(c, "rack-1-n1"), uuids_of(c, "rack-1-n2")
        put = {"class": "training", "reason": "prolog"}
        assert c.put("/api/v1/jobs/a", json=put | {"uuids": [n1[0]]}).status_code == 200
        assert c.put("/api/v1/jobs/b", json=put | {"nodes": ["rack-1-n2"]}).status_code == 200
        cases = [
            ({"uuids": [n1[1], n1[0]]}, f"GPU {n1[0]} is in job 'a'"),
            ({"nodes": ["rack-1-n1"]}, f"GPU {n1[0]} on node rack-1-n1 is in job 'a'"),
            ({"uuids": [n2[1]]}, f"GPU {n2[1]} is on node rack-1-n2 of job 'b'"),
            ({"nodes": ["rack-1-n2"]}, "node rack-1-n2 is in job 'b'"),
        ]
        for names, why in cases:
            r = c.put("/api/v1/jobs/c", json=put | names)
            assert r.status_code == 409, r.text
            assert why in r.json()["detail"] and r.json()["applied"] is False
        assert sorted(j["name"] for j in c.get("/api/v1/jobs").json()["items"]) == ["a", "b"]
        audit = c.get("/api/v1/audit", params={"limit": 4}).json()["items"]
        assert {(a["action"], a["target"]) for a in audit} == {("job.put", "c")}
        assert all(a["result"].startswith("refused: job 'c' not set: ") for a in audit)


def test_bad_jobs_are_refused_and_nothing_changes(live: LiveApi) -> None:
    with live.client("operator") as c:
        ok = {"class": "training", "nodes": ["rack-1-n1"], "reason": "x"}
        cases: list[tuple[str, dict[str, Any], int, str]] = [
            ("bad:name", ok, 422, "job"),
            ("x" * 65, ok, 422, "job"),
            ("j", ok | {"class": "gaming"}, 422, "valid: inference, training"),
            ("j", ok | {"nodes": ["ghost"]}, 404, "unknown node(s): ghost"),
            ("j", ok | {"nodes": []}, 422, "name at least one GPU"),
            ("j", ok | {"profile": [[200, -1]]}, 422, "profile"),
            ("j", ok | {"profile": []}, 422, "profile"),
            ("j", ok | {"uuids": ["bad uuid"]}, 422, "uuids"),
            ("j", ok | {"uuids": [f"GPU-{i}" for i in range(16_385)]}, 422, "uuids"),
            ("j", ok | {"reason": " "}, 422, "reason"),
            ("j", ok | {"extra": 1}, 422, "extra"),
        ]
        for name, body, status, why in cases:
            r = c.put(f"/api/v1/jobs/{name}", json=body)
            assert r.status_code == status, (name, body.keys(), r.text[:300])
            assert why in r.text
        assert c.get("/api/v1/jobs").json()["total"] == 0


def test_the_number_of_jobs_is_bounded(live: LiveApi, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("powerd.controller.overrides.MAX_JOBS", 2)
    with live.client("operator") as c:
        for name, node in (("a", "rack-1-n1"), ("b", "rack-1-n2")):
            assert (
                c.put(
                    f"/api/v1/jobs/{name}",
                    json={"class": "training", "nodes": [node], "reason": "x"},
                ).status_code
                == 200
            )
        r = c.put(
            "/api/v1/jobs/c", json={"class": "training", "nodes": ["rack-2-n1"], "reason": "x"}
        )
        assert r.status_code == 422 and "at most 2 jobs" in r.json()["detail"]


def test_the_gpus_named_across_all_jobs_are_bounded(
    live: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every job may name MAX_JOB_GPUS uuids and there may be MAX_JOBS jobs: 327 million
    uuids, which the controller keeps, indexes on the loop and writes to its state file at
    every job write. The total is bounded too (a replacement counts without its old self)."""
    monkeypatch.setattr("powerd.controller.overrides.MAX_JOBS_UUIDS", 5)

    def put(name: str, n: int) -> httpx.Response:
        uuids = [f"GPU-{name}-{i}" for i in range(n)]
        return c.put(
            f"/api/v1/jobs/{name}", json={"class": "training", "uuids": uuids, "reason": "x"}
        )

    with live.client("operator") as c:
        assert put("a", 4).status_code == 200
        r = put("b", 2)
        assert r.status_code == 422 and "at most 5 GPUs by uuid" in r.json()["detail"], r.text
        assert c.get("/api/v1/jobs/b").status_code == 404
        assert put("a", 5).status_code == 200  # replacing a: its old 4 do not count
        assert put("b", 1).status_code == 422
        assert c.delete("/api/v1/jobs/a", params={"reason": "done"}).status_code == 200
        assert put("b", 1).status_code == 200


def test_gpus_given_a_class_by_uuid_are_bounded_in_all(
    live: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Class assignments by uuid may name GPUs not heard yet, like jobs: each call names at
    most 10,000, and their total is bounded too (they live in the state file)."""
    monkeypatch.setattr("powerd.controller.overrides.MAX_CLASS_UUIDS", 5)

    def assign(uuids: list[str]) -> httpx.Response:
        body = {"class": "inference", "uuids": uuids, "reason": "x"}
        return c.post("/api/v1/classes/assign", json=body)

    with live.client("operator") as c:
        assert assign([f"GPU-a-{i}" for i in range(4)]).status_code == 200
        assert assign(["GPU-a-0", "GPU-a-1", "GPU-b-0"]).status_code == 200  # one new
        r = assign(["GPU-b-1"])
        assert r.status_code == 422 and "at most 5 GPUs have a class" in r.json()["detail"]
        assert "GPU-b-1" not in c.get("/api/v1/overrides").json()["gpu_classes"]
        body = {"uuids": ["GPU-a-3"], "reason": "x"}
        assert c.post("/api/v1/classes/clear", json=body).status_code == 200
        assert assign(["GPU-b-1"]).status_code == 200


# ---- restarts: the controller process on SQLite and PostgreSQL ----


@pytest.fixture(params=BACKENDS)
def site(
    request: pytest.FixtureRequest, tmp_path: Path, mosquitto: LocalMosquitto
) -> Iterator[Site]:
    if request.param == "sqlite":
        s = Site(tmp_path, mosquitto, f"sqlite:///{tmp_path / 'powerd.db'}")
        try:
            yield s
        finally:
            s.close()
        return
    with pg_database() as url:
        s = Site(tmp_path, mosquitto, url)
        try:
            yield s
        finally:
            s.close()


@pytest.mark.process
def test_jobs_survive_a_restart_and_a_lost_state_file(site: Site) -> None:
    # Alone: one controller, no lease to lose to a busy machine (a standby refuses writes;
    # leadership has its own tests).
    with site.start("--leadership", "alone") as c:
        gpu = c.get("/api/v1/gpus").json()["items"][0]["uuid"]
        r = c.put(
            "/api/v1/jobs/train-1",
            json={
                "class": "inference",
                "uuids": [gpu],
                "nodes": ["rack-2-n1"],
                "profile": PROFILE,
                "reason": "prolog",
            },
        )
        assert r.status_code == 200 and (r.json()["durable"], r.json()["audited"]) == (True, True)
        r = c.put(
            "/api/v1/jobs/train-2",
            json={"class": "training", "nodes": ["rack-2-n2"], "reason": "prolog"},
        )
        assert r.status_code == 200
        before = c.get("/api/v1/jobs").json()
        assert before["total"] == 2
    site.stop()
    with site.start("--leadership", "alone") as c:
        assert c.get("/api/v1/jobs").json() == before
        assert c.get("/api/v1/gpus").json()["items"][0]["job"] == "train-1"
        # A conflict is still a conflict after the restart.
        r = c.put(
            "/api/v1/jobs/x", json={"class": "training", "nodes": ["rack-2-n2"], "reason": "x"}
        )
        assert r.status_code == 409 and "job 'train-2'" in r.json()["detail"]
        assert c.delete("/api/v1/jobs/train-2", params={"reason": "ended"}).status_code == 200
        after = c.get("/api/v1/jobs").json()
    site.stop()
    # A new disk: the database's revision brings the jobs back.
    site.state_file.unlink()
    with site.start("--leadership", "alone") as c:
        assert c.get("/api/v1/jobs").json() == after
    [restored] = site.events("operator_state_from_database")
    assert restored["revision"] == 3  # two puts and a delete


# ---- the command line ----


def test_the_job_commands(
    live: LiveApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    op = ["--url", live.url, "--token", live.tokens["operator"]]
    with live.client("viewer") as c:
        n1 = uuids_of(c, "rack-1-n1")
    profile = tmp_path / "curve.yaml"
    profile.write_text("points: [[200, 0.3], [450, 0.9], [600, 1.0]]\n")
    code, out = run(
        [
            "job",
            "put",
            "77",
            "--gpus",
            f"{n1[0]},GPU-later",
            "--nodes",
            "rack-2-n1",
            "--class",
            "inference",
            "--profile",
            str(profile),
            *op,
        ]
    )
    assert code == EXIT_OK, capsys.readouterr().err
    assert "job 77: 2 GPUs by uuid, 1 nodes, class inference, own profile; 3 GPUs heard now" in out
    assert "not heard yet (they join when they report): GPU-later" in out
    assert "job.put 77: done, in force from tick " in out
    code, out = run(["job", "put", "77", "--nodes", "rack-2-n1", "--class", "training", *op])
    assert code == EXIT_OK and "job 77: replaced the job of that name" in out
    code, out = run(["job", "list", *op])
    lines = out.splitlines()
    assert lines[0].split() == [
        "job",
        "class",
        "profile",
        "uuids",
        "nodes",
        "heard",
        "by",
        "since",
        "reason",
    ]
    assert lines[1].split()[:6] == ["77", "training", "class", "0", "1", "2"]
    code, out = run(["job", "put", "78", "--nodes", "rack-2-n1", "--class", "training", *op])
    assert code == EXIT_FAILED and "node rack-2-n1 is in job '77'" in capsys.readouterr().err
    code, _ = run(["job", "put", "78", "--class", "training", *op])
    assert code == EXIT_BAD_INPUT and "give --gpus or --nodes" in capsys.readouterr().err
    code, _ = run(["job", "put", "78", "--nodes", "nope", "--class", "training", *op])
    assert code == EXIT_BAD_INPUT and "unknown node(s): nope" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("just text\n")
    code, _ = run(
        [
            "job",
            "put",
            "78",
            "--nodes",
            "rack-1-n2",
            "--class",
            "training",
            "--profile",
            str(bad),
            *op,
        ]
    )
    assert code == EXIT_BAD_INPUT and "a profile is a list of" in capsys.readouterr().err
    code, out = run(["job", "delete", "77", "--reason", "done", *op])
    assert code == EXIT_OK and out.startswith("job.delete 77: done")
    code, out = run(["job", "list", *op])
    assert code == EXIT_OK and out.strip() == "no jobs"
    code, _ = run(["job", "delete", "77", *op])
    assert code == EXIT_BAD_INPUT and "no job '77'" in capsys.readouterr().err


# ---- Slurm: prolog and epilog against the live API, a fake scontrol on PATH ----

FAKE_SCONTROL = """#!/bin/sh
# A stand-in for Slurm's `scontrol show hostnames LIST`: expands rack-1-n[1-2] and a,b.
[ "$1" = show ] && [ "$2" = hostnames ] || exit 2
exec "{python}" -c '
import re, sys
for part in re.findall(r"[^,\\[]+(?:\\[[^\\]]*\\])?", sys.argv[1]):
    m = re.fullmatch(r"(.*)\\[(\\d+)-(\\d+)\\]", part)
    names = [f"{{m[1]}}{{i}}" for i in range(int(m[2]), int(m[3]) + 1)] if m else [part]
    print("\\n".join(names))
' "$3"
"""


class Slurm:
    def __init__(self, workdir: Path, url: str, token: str) -> None:
        self.bin = workdir / "bin"
        self.bin.mkdir()
        scontrol = self.bin / "scontrol"
        scontrol.write_text(FAKE_SCONTROL.format(python=sys.executable))
        scontrol.chmod(0o755)
        self.env_file = workdir / "slurm.env"
        self.env_file.write_text(
            f"# powerd for Slurm\nPOWERD_URL={url}\nPOWERD_TOKEN='{token}'\n"
            "POWERD_PARTITION_CLASSES=serve:inference\nPOWERD_TIMEOUT_S=2\n"
        )

    def run(self, script: str, **env: str) -> subprocess.CompletedProcess[str]:
        full = {
            "PATH": f"{self.bin}:/usr/bin:/bin",
            "POWERD_SLURM_ENV": str(self.env_file),
            "POWERD_PYTHON": sys.executable,
            "SLURM_JOB_USER": "alice",
            **env,
        }
        return subprocess.run(
            [str(SLURM / script)], env=full, capture_output=True, text=True, timeout=60, check=False
        )


@pytest.mark.process
def test_slurm_prolog_registers_and_epilog_deletes(live: LiveApi, tmp_path: Path) -> None:
    slurm = Slurm(tmp_path, live.url, live.tokens["operator"])
    # A two-node job: held by whole nodes.
    p = slurm.run("prolog.sh", SLURM_JOB_ID="901", SLURM_JOB_NODELIST="rack-1-n[1-2]")
    assert p.returncode == 0 and "job slurm-901 registered: class training" in p.stderr, p.stderr
    with live.client("viewer") as c:
        job = c.get("/api/v1/jobs/slurm-901").json()
        assert job["nodes"] == ["rack-1-n1", "rack-1-n2"] and job["uuids"] == []
        assert job["reason"] == "slurm prolog: job 901 of alice"
        # One GPU of one node, in a partition mapped to a class: that GPU by uuid.
        p = slurm.run(
            "prolog.sh",
            SLURM_JOB_ID="902",
            SLURM_JOB_NODELIST="rack-2-n1",
            SLURM_JOB_GPUS="1",
            SLURM_JOB_PARTITION="serve",
        )
        assert p.returncode == 0 and "registered" in p.stderr, p.stderr
        job = c.get("/api/v1/jobs/slurm-902").json()
        assert job["class"] == "inference" and job["uuids"] == [uuids_of(c, "rack-2-n1")[1]]
        # A job that overlaps another is refused by powerd; the prolog still exits 0.
        p = slurm.run("prolog.sh", SLURM_JOB_ID="903", SLURM_JOB_NODELIST="rack-1-n2,rack-2-n2")
        assert p.returncode == 0 and "job slurm-903 not registered: HTTP 409" in p.stderr
        assert c.get("/api/v1/jobs/slurm-903").status_code == 404
        # The epilogs: deleted; one never registered is said so.
        for job_id in ("901", "902", "903"):
            e = slurm.run("epilog.sh", SLURM_JOB_ID=job_id)
            assert e.returncode == 0, e.stderr
        assert "job slurm-903 was not registered" in e.stderr
        assert c.get("/api/v1/jobs").json()["total"] == 0


@pytest.mark.process
def test_slurm_scripts_never_fail_the_job(tmp_path: Path) -> None:
    """powerd down (nothing listens), a bad config, a missing one: exit 0, fast, logged."""
    slurm = Slurm(tmp_path, f"http://127.0.0.1:{free_port()}", "t")
    t0 = time.monotonic()
    p = slurm.run("prolog.sh", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="rack-1-n1")
    e = slurm.run("epilog.sh", SLURM_JOB_ID="1")
    assert time.monotonic() - t0 < 30
    for r in (p, e):
        assert r.returncode == 0 and "no powerd controller answered" in r.stderr, r.stderr
    missing = slurm.run("prolog.sh", SLURM_JOB_ID="1", POWERD_SLURM_ENV=str(tmp_path / "nope"))
    assert missing.returncode == 0 and "failed" in missing.stderr
    slurm.env_file.write_text("POWERD_URL=\n")
    empty = slurm.run("prolog.sh", SLURM_JOB_ID="1", SLURM_JOB_NODELIST="rack-1-n1")
    assert empty.returncode == 0 and "POWERD_URL and POWERD_TOKEN are needed" in empty.stderr
    no_python = slurm.run("epilog.sh", SLURM_JOB_ID="1", POWERD_PYTHON=str(tmp_path / "none"))
    assert no_python.returncode == 0 and "epilog exited" in no_python.stderr
    assert os.access(SLURM / "prolog.sh", os.X_OK) and os.access(SLURM / "epilog.sh", os.X_OK)


# ---- the schema: documented, and fuzzed (with an operator's token, not the admin's) ----


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_job_endpoints_conform_to_the_schema(live: LiveApi, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    jobs = {(o.method.upper(), o.path): o for o in ops if o.path.startswith("/api/v1/jobs")}
    assert set(jobs) == {
        ("GET", "/api/v1/jobs"),
        ("GET", "/api/v1/jobs/{job}"),
        ("PUT", "/api/v1/jobs/{job}"),
        ("DELETE", "/api/v1/jobs/{job}"),
    }
    put = jobs["PUT", "/api/v1/jobs/{job}"].definition.raw
    assert {"200", "403", "404", "409", "422", "503"} <= set(put["responses"])
    auth = {"Authorization": f"Bearer {live.tokens['operator']}"}
    for op in jobs.values():  # no 5xx, every answer on the schema
        fuzz(op, mode, live.url, auth, CHECKS)


# ---- a standby follows the leader's jobs ----


def test_a_standby_follows_the_leaders_jobs(db_url: str, tmp_path: Path) -> None:
    policy = load_policy_text(POLICY, "policy.yaml")
    upgrade(db_url)
    store = Store(db_url)
    broker = MemoryBroker()
    clock = SystemClock()

    def controller(name: str) -> Controller:
        return build_controller(
            policy,
            broker.client(name),
            clock,
            ControllerOptions(controller_id=name),
            store=store,
            state_file=StateFile(tmp_path / f"{name}.json"),
        )

    leader, standby = controller("a"), controller("b")

    async def main() -> None:
        put = partial(
            leader.put_job,
            "j1",
            "inference",
            uuids=["GPU-x"],
            nodes=["rack-1-n1"],
            profile=[(200.0, 0.5), (500.0, 1.0)],
            actor="alice",
            reason="prolog",
        )
        outcome = await leader.ledger.commit(put, lowers_power=False)
        assert (outcome.applied, outcome.durable, outcome.audited) == (True, True, True)
        assert await standby.ledger.follow()
        assert dict(standby.overrides.jobs.by_name) == dict(leader.overrides.jobs.by_name)
        assert standby.overrides.jobs.job_of("GPU-y", "rack-1-n1") == "j1"
        gone = partial(leader.delete_job, "j1", actor="alice", reason="epilog")
        await leader.ledger.commit(gone, lowers_power=False)
        assert await standby.ledger.follow()
        assert len(standby.overrides.jobs) == 0

    try:
        asyncio.run(main())
    finally:
        store.close()


def test_a_job_not_made_durable_is_rolled_back(tmp_path: Path) -> None:
    """A job write is not a cut: if the state file cannot be written it is not applied
    (503), and the job in force before it stays."""
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    live = LiveApi(tmp_path, state_file=blocker / "powerd-state.json").start()
    try:
        with live.client("operator") as c:
            put = c.put(
                "/api/v1/jobs/j", json={"class": "training", "nodes": ["rack-1-n1"], "reason": "x"}
            )
            assert put.status_code == 503, put.text
            assert put.json()["applied"] is False and "state file" in put.json()["detail"]
            assert c.get("/api/v1/jobs").json()["total"] == 0
            assert all(g["job"] is None for g in c.get("/api/v1/gpus").json()["items"])
            [row] = c.get("/api/v1/audit", params={"action": "job.put"}).json()["items"]
            assert row["result"].startswith("rolled back: state file not written")
    finally:
        live.close()
