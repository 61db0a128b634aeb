"""Jobs the nodes report (telemetry's per-GPU `job`, e.g. from Kubernetes), the controller's
side: how the tick couples them under `control.reported_jobs` (node, site, off), that an
operator's job wins, that a lying node reaches no GPU but its own (scope node) and never
changes another GPU's class, and the loop end to end: real agents reading a kubelet's
PodResources server and the API server's labels, a controller steering the job as its class.
(The agent's reading alone: tests/test_kubelet.py.)"""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Mapping
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from support.honest import NODES, HonestNode, policy_dict
from support.kubelet import FakeApiServer, api_server, kubelet, short_dir
from test_jobs import job, run_ticks

from powerd.agent import Agent, AgentSettings, build_backend
from powerd.agent.kubelet import build_pod_source
from powerd.api.app import create_app
from powerd.auth import TokenStore, new_token_entry
from powerd.clock import SystemClock
from powerd.controller.build import build_controller
from powerd.controller.jobs import ReportedJobs
from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.policy import Policy, parse_policy
from powerd.transport.memory import MemoryBroker
from powerd.wire import NodeTelemetry, WireError, decode


def policy(scope: str | None = None, **control: Any) -> Policy:
    data = policy_dict()
    data["classes"]["batch"] = {"weight": 0.5, "floor_w": 250, "profile": "p"}
    if scope is not None:
        data["control"]["reported_jobs"] = scope
    data["control"].update(control)
    return parse_policy(data)


class ReportingNode(HonestNode):
    """An honest node whose GPUs report a job and a workload (class), by GPU index."""

    def __init__(
        self,
        name: str,
        jobs: Mapping[int, str] | None = None,
        workloads: Mapping[int, str] | None = None,
    ) -> None:
        super().__init__(name)
        self.jobs = dict(jobs or {})
        self.workloads = dict(workloads or {})

    def sample(self, wall: float) -> NodeTelemetry:
        msg = super().sample(wall)
        gpus = [
            g.model_copy(update={"job": self.jobs.get(i), "workload": self.workloads.get(i)})
            for i, g in enumerate(msg.gpus)
        ]
        return msg.model_copy(update={"gpus": gpus})


def members(report: TickReport) -> dict[str, str]:
    """uuid → job name, as the tick handed the allocator."""
    frame = report.why
    assert frame is not None
    if frame.job_index is None:
        return {}
    return {
        u: frame.job_names[j]
        for u, j in zip(frame.uuids, frame.job_index.tolist(), strict=True)
        if j >= 0
    }


def classes(report: TickReport) -> dict[str, str]:
    return dict(zip(report.uuids, report.classes, strict=True))


def targets(report: TickReport) -> dict[str, float]:
    return dict(zip(report.uuids, report.targets_w.tolist(), strict=True))


def site(scope: str | None, nodes: dict[str, HonestNode], ticks: int = 3) -> TickReport:
    """The last of `ticks` ticks of a fresh engine over `nodes`."""
    engine = TickEngine(policy(scope))
    report: TickReport = run_ticks(engine, nodes, range(ticks))
    return report


def gpu(node: str, i: int) -> str:
    return f"GPU-{node}-{i}"


def test_by_default_a_reported_job_couples_one_nodes_gpus() -> None:
    """Scope node (the default): two nodes reporting one job make two jobs, each of its
    node's GPUs, named `<job>@<node>`; each gets one cap and steers as the class most of
    its GPUs ask for."""
    nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
    nodes["r1-n1"] = ReportingNode(
        "r1-n1", dict.fromkeys(range(4), "ml/llama"), {0: "batch", 1: "batch", 2: "batch"}
    )
    nodes["r2-n1"] = ReportingNode("r2-n1", {0: "ml/llama", 1: "ml/llama"})
    report = site(None, nodes)
    assert policy().control.reported_jobs == "node"
    r1 = {gpu("r1-n1", i): "ml/llama@r1-n1" for i in range(3)}  # GPU 3 is class c: alone
    r2 = {gpu("r2-n1", i): "ml/llama@r2-n1" for i in range(2)}
    assert members(report) == r1 | r2
    got = classes(report)
    assert {got[u] for u in r1} == {"batch"} and got[gpu("r1-n1", 3)] == "c"
    assert {got[u] for u in r2} == {"c"}
    caps = targets(report)
    for job_gpus in (r1, r2):
        assert len({round(caps[u], 6) for u in job_gpus}) == 1


def test_scope_site_couples_a_job_across_nodes_and_off_ignores_it() -> None:
    def build() -> dict[str, HonestNode]:
        nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
        nodes["r1-n1"] = ReportingNode("r1-n1", {0: "ml/llama", 1: "ml/llama"})
        nodes["r2-n2"] = ReportingNode("r2-n2", dict.fromkeys(range(4), "ml/llama"))
        return nodes

    report = site("site", build())
    want = {gpu("r1-n1", i) for i in range(2)} | {gpu("r2-n2", i) for i in range(4)}
    assert members(report) == dict.fromkeys(want, "ml/llama")
    caps = targets(report)
    assert len({round(caps[u], 6) for u in want}) == 1  # one cap across racks
    assert members(site("off", build())) == {}


def test_an_operators_job_wins() -> None:
    """A GPU an operator's job holds is that job's, whatever its node reports; with scope
    site a reported name an operator's job has is left to the operator's job."""
    nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
    nodes["r1-n1"] = ReportingNode("r1-n1", dict.fromkeys(range(4), "ml/llama"))
    nodes["r1-n2"] = ReportingNode("r1-n2", dict.fromkeys(range(4), "slurm-7"))
    engine = TickEngine(policy("site"))
    run_ticks(engine, nodes, range(2))
    fleet = engine.fleet

    def node_of(u: str) -> str | None:
        rec = fleet.gpus.get(u)
        return None if rec is None else rec.node

    engine.overrides.put_job(
        engine.policy,
        job("slurm-7", uuids=(gpu("r1-n1", 0), gpu("r2-n1", 0)), class_="batch"),
        node_of,
        fleet.gpus_of,
    )
    report = run_ticks(engine, nodes, range(2, 4))
    got = members(report)
    assert got == {
        gpu("r1-n1", 0): "slurm-7",
        gpu("r2-n1", 0): "slurm-7",
        **{gpu("r1-n1", i): "ml/llama" for i in (1, 2, 3)},
        # r1-n2 reported "slurm-7": an operator's name, so not coupled by the report.
    }
    assert classes(report)[gpu("r1-n1", 0)] == "batch"
    assert {classes(report)[gpu("r1-n2", i)] for i in range(4)} == {"c"}


def test_a_lying_node_reaches_only_its_own_gpus() -> None:
    """Scope node: a node that reports the job of its neighbours' GPUs, in another class,
    couples nothing of theirs and changes none of their classes or memberships."""

    def build(lie: bool) -> dict[str, HonestNode]:
        nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
        nodes["r1-n1"] = ReportingNode("r1-n1", dict.fromkeys(range(4), "ml/llama"))
        nodes["r1-n2"] = ReportingNode("r1-n2", dict.fromkeys(range(4), "ml/llama"))
        if lie:
            nodes["r2-n2"] = ReportingNode(
                "r2-n2", dict.fromkeys(range(4), "ml/llama"), dict.fromkeys(range(4), "batch")
            )
        return nodes

    honest, lied = site(None, build(False)), site(None, build(True))
    mine = {u for u in honest.uuids if not u.startswith("GPU-r2-n2")}
    assert {u: j for u, j in members(lied).items() if u in mine} == members(honest)
    assert {u: c for u, c in classes(lied).items() if u in mine} == {
        u: c for u, c in classes(honest).items() if u in mine
    }
    assert {j for u, j in members(lied).items() if u not in mine} == {"ml/llama@r2-n2"}


def test_in_scope_site_a_liar_cannot_change_a_class() -> None:
    """Scope site trusts a node to say which job its GPUs run (it can hold that job's cap,
    as a member's trouble would), but not to change anyone's class: a job steers as the
    class most of its GPUs have, and GPUs of another class steer alone."""
    nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
    nodes["r1-n1"] = ReportingNode("r1-n1", dict.fromkeys(range(4), "ml/llama"))
    nodes["r1-n2"] = ReportingNode("r1-n2", {0: "ml/llama", 1: "ml/llama"})
    nodes["r2-n1"] = ReportingNode(
        "r2-n1", dict.fromkeys(range(4), "ml/llama"), dict.fromkeys(range(4), "batch")
    )
    report = site("site", nodes)
    honest = {gpu("r1-n1", i) for i in range(4)} | {gpu("r1-n2", i) for i in range(2)}
    assert members(report) == dict.fromkeys(honest, "ml/llama")  # 6 of class c outvote 4
    assert {classes(report)[gpu("r2-n1", i)] for i in range(4)} == {"batch"}
    assert {classes(report)[u] for u in honest} == {"c"}


def test_reported_jobs_are_bounded_on_the_wire() -> None:
    """A job the wire refuses makes the node's message invalid (dropped and counted, like
    any bad field); it never reaches the tick."""
    node = ReportingNode("r1-n1", {0: "ml/llama"})
    good = node.telemetry(1.0)
    assert decode(good, NodeTelemetry).gpus[0].job == "ml/llama"
    for bad in ("x" * 129, "has space", "/leading", "ünïcode", 7, ["a"]):
        doc = node.sample(1.0).model_dump(mode="json")
        doc["gpus"][0]["job"] = bad
        with pytest.raises(WireError, match="invalid"):
            decode(json.dumps(doc).encode(), NodeTelemetry)


def test_coupling_is_kept_while_nothing_changes_and_redone_when_a_report_does() -> None:
    nodes: dict[str, HonestNode] = {n: HonestNode(n) for n in NODES}
    reporting = ReportingNode("r1-n1", dict.fromkeys(range(4), "ml/a"))
    nodes["r1-n1"] = reporting
    engine = TickEngine(policy())
    run_ticks(engine, nodes, range(3))
    kept = engine.targets._reported
    run_ticks(engine, nodes, range(3, 5))
    assert engine.targets._reported is kept
    reporting.jobs = {0: "ml/a", 1: "ml/a", 2: "ml/b", 3: "ml/b"}
    report = run_ticks(engine, nodes, range(5, 6))
    assert set(members(report).values()) == {"ml/a@r1-n1", "ml/b@r1-n1"}
    # A pod gone: its GPUs steer alone again at the next tick.
    reporting.jobs = {}
    assert members(run_ticks(engine, nodes, range(6, 7))) == {}


def test_couple_alone() -> None:
    """The rule on arrays: majority class per job (ties: the lower class), operators'
    GPUs and names left out, names ordered by (node, job as first reported)."""
    reported = ["a", "a", "a", None, "b", "a", "x", "a"]
    got = ReportedJobs.couple(
        reported,
        free=np.array([True] * 7 + [False]),
        class_index=np.array([1, 0, 1, 0, 0, 0, 0, 1]),
        nodes=["n1"] * 4 + ["n2"] * 4,
        node_index=np.array([0] * 4 + [1] * 4),
        scope="node",
        taken=("x",),
    )
    assert got.names == ("a@n1", "a@n2", "b@n2")
    assert got.index.tolist() == [0, -1, 0, -1, 2, 1, -1, -1]
    tie = ReportedJobs.couple(
        ["a", "a"],
        free=np.array([True, True]),
        class_index=np.array([1, 0]),
        nodes=["n1", "n2"],
        node_index=np.array([0, 1]),
        scope="site",
    )
    assert tie.names == ("a",) and tie.index.tolist() == [-1, 0]


async def test_end_to_end_kubernetes_jobs_steer_as_their_class(tmp_path: Path) -> None:
    """Real agents on mock GPUs, each reading its node's kubelet (a gRPC PodResources
    server built from the proto) and the API server's labels (a loopback fake); a real
    controller on an in-process broker. A training job's pods on two nodes (class label
    `batch`) become one job across them (scope site): one cap, steered as batch, and
    `GET /api/v1/gpus?job=` lists its GPUs."""
    data = policy_dict()
    data["classes"]["batch"] = {"weight": 0.5, "floor_w": 250, "profile": "p"}
    data["control"] = {
        "tick_s": 0.2,
        "lease_s": 2.0,
        "stale_after_s": 1.0,
        "reported_jobs": "site",
    }
    pol = parse_policy(copy.deepcopy(data))
    broker = MemoryBroker()
    clock = SystemClock()
    controller = build_controller(pol, broker.client("controller"), clock)
    fake = FakeApiServer()
    label, cls = "batch.kubernetes.io/job-name", "powerd.io/class"
    with short_dir() as d, api_server(fake) as url, ExitStack() as stack:
        kubelets = {}
        agents = []
        for name in NODES:
            settings = AgentSettings(
                node_id=name,
                backend="mock",
                mock_gpus=4,
                period_s=0.2,
                failsafe_w=200.0,
                kube_socket=d / f"{name}.sock",
                kube_job_label=label,
                kube_class_label=cls,
                kube_api_url=url,
                kube_period_s=0.3,
                kube_timeout_s=0.25,
            )
            agent = Agent(settings, build_backend(settings, clock), broker.client(name), clock)
            agents.append(agent)
            kubelets[name] = stack.enter_context(kubelet(d / f"{name}.sock"))
        by_index = {a.node_id: sorted(a.gpus, key=lambda u: a.gpus[u].index) for a in agents}
        job_gpus = by_index["r1-n1"] + by_index["r2-n1"][:2]
        for pod, (node, uuids) in enumerate([("r1-n1", job_gpus[:4]), ("r2-n1", job_gpus[4:])]):
            kubelets[node].pods = [("ml", f"llama-{pod}", {"nvidia.com/gpu": uuids})]
            fake.labels[node] = {("ml", f"llama-{pod}"): {label: "llama", cls: "batch"}}
        # A pod without the job label: its GPU reports no job (and steers alone).
        kubelets["r1-n2"].pods = [("web", "serve", {"nvidia.com/gpu": by_index["r1-n2"][:1]})]
        fake.labels["r1-n2"] = {("web", "serve"): {}}
        sources = []
        for agent in agents:
            config = agent.settings.kube_config()
            assert config is not None
            source = build_pod_source(config, {u: g.index for u, g in agent.gpus.items()})
            agent.pod_source = source
            source.start()
            sources.append(source)
        token, entry = new_token_entry("v", "viewer")
        (tmp_path / "tokens.toml").write_text(entry)
        app = create_app(controller, TokenStore.from_file(tmp_path / "tokens.toml"))
        stop = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as tg:
                for agent in agents:
                    tg.create_task(agent.run(stop))
                tg.create_task(controller.run(stop, learn_s=0.2))
                report = await until_job_capped(controller, set(job_gpus))
                transport = httpx.ASGITransport(app=app)
                async with httpx.AsyncClient(transport=transport, base_url="http://api") as c:
                    r = await c.get(
                        "/api/v1/gpus",
                        params={"job": "ml/llama"},
                        headers={"Authorization": f"Bearer {token}"},
                    )
                stop.set()
        finally:
            for source in sources:
                source.stop()
    assert r.status_code == 200, r.text
    listed = r.json()["items"]
    assert {g["uuid"] for g in listed} == set(job_gpus)
    assert {(g["job"], g["class"]) for g in listed} == {("ml/llama", "batch")}
    got = dict(zip(report.uuids, report.classes, strict=True))
    assert {got[u] for u in set(report.uuids) - set(job_gpus)} == {"c"}


async def until_job_capped(controller: Any, job_gpus: set[str]) -> Any:
    """The first tick that couples `job_gpus` as one job, steered as batch, with one cap
    the agents enforce (the mock GPUs read it back), at least batch's floor."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        report = controller.last_tick
        frame = None if report is None else report.why
        if frame is not None and frame.job_index is not None:
            names = {
                u: frame.job_names[j]
                for u, j in zip(frame.uuids, frame.job_index.tolist(), strict=True)
                if j >= 0
            }
            got = dict(zip(report.uuids, report.classes, strict=True))
            gpus = controller.fleet.gpus
            caps = {round(gpus[u].cap_w, 1) for u in job_gpus if u in gpus}
            if (
                names == dict.fromkeys(job_gpus, "ml/llama")
                and {got[u] for u in job_gpus} == {"batch"}
                and len(caps) == 1
                and min(caps) >= 250.0  # batch's floor: steered, not at failsafe
            ):
                return report
        await asyncio.sleep(0.1)
    pytest.fail("the job was never steered as one, as batch")
