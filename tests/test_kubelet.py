"""Jobs from Kubernetes, the agent's side: the kubelet's PodResources API (a real gRPC server
built from the vendored proto, on a unix socket) says which pod holds each GPU, a fake of
the API server's pod list gives the labels, and the agent reports each GPU's job and class.
(The controller's side, lying nodes and the loop end to end: tests/test_jobs_reported.py.)"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from grpc_tools import protoc
from structlog.testing import capture_logs
from support.kubelet import FakeApiServer, api_server, kubelet, short_dir

from powerd.agent import Agent, AgentSettings, SettingsError, build_backend
from powerd.agent.kubelet import (
    DEFAULT_SOCKET,
    LIST_METHOD,
    MAX_JOB_CHARS,
    GpuPod,
    KubeConfig,
    KubeReadError,
    PodRef,
    PodSource,
    build_pod_source,
    fetch_pod_labels,
    grpc_lister,
    in_cluster_api_url,
    job_name,
    parse_pod_list,
)
from powerd.agent.podresources import api_pb2
from powerd.cli.daemons import KUBELET_SOCKET
from powerd.clock import SystemClock
from powerd.transport.memory import MemoryBroker
from powerd.wire import REPORTED_JOB_PATTERN, GpuTelemetry

ROOT = Path(__file__).resolve().parent.parent
PODRESOURCES = ROOT / "powerd" / "agent" / "podresources"
GPUS = {f"GPU-n1-{i}": i for i in range(8)}  # uuid → index, as the backend sees them


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def socket() -> Iterator[Path]:
    with short_dir() as d:
        yield d / "kubelet.sock"


def source_for(config: KubeConfig, clock: Clock | None = None) -> PodSource:
    lister, close = grpc_lister(config)
    labels = None
    if config.needs_labels:

        def labels() -> dict[PodRef, dict[str, str]]:
            return fetch_pod_labels(config)

    return PodSource(config, GPUS, lister, labels, clock=clock or Clock(), close=close)


def test_the_generated_module_is_protocs_output_from_the_vendored_proto(tmp_path: Path) -> None:
    """api_pb2.py and .pyi are what the pinned grpcio-tools makes of api.proto, byte for
    byte; the proto is Kubernetes' own, with its licence."""
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "powerd/agent/podresources").mkdir(parents=True)
    proto = tmp_path / "powerd/agent/podresources/api.proto"
    proto.write_bytes((PODRESOURCES / "api.proto").read_bytes())
    rc = protoc.main(
        [
            "protoc",
            f"-I{tmp_path}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            str(proto),
        ]
    )
    assert rc == 0
    for name in ("api_pb2.py", "api_pb2.pyi"):
        made = (out / "powerd/agent/podresources" / name).read_text()
        assert made == (PODRESOURCES / name).read_text(), f"regenerate {name}: see __init__.py"
    text = (PODRESOURCES / "api.proto").read_text()
    assert "service PodResourcesLister" in text and "package v1;" in text
    assert "Apache License" in (PODRESOURCES / "LICENSE").read_text()
    service = api_pb2.DESCRIPTOR.services_by_name["PodResourcesLister"]
    assert f"/{service.full_name}/{service.methods_by_name['List'].name}" == LIST_METHOD


def test_gpus_map_to_pods_by_uuid_replica_and_index(socket: Path) -> None:
    """The NVIDIA device plugin's ids: a uuid (its default), `<uuid>::<n>` (a time-sliced
    replica), an index (its `index` strategy). A MIG device and another resource name no
    GPU of the node: unmatched, or ignored."""
    with kubelet(socket) as server:
        server.pods = [
            ("team-a", "train-0", {"nvidia.com/gpu": ["GPU-n1-0", "GPU-n1-1"]}),
            ("team-b", "infer-7", {"nvidia.com/gpu": ["GPU-n1-2::0", "GPU-n1-2::1"]}),
            ("team-b", "legacy", {"nvidia.com/gpu": ["5"]}),
            ("team-c", "mig", {"nvidia.com/gpu": ["MIG-0f3e2d1c-aaaa"]}),
            ("team-c", "nic", {"example.com/rdma": ["GPU-n1-6"]}),
        ]
        source = source_for(KubeConfig(socket=socket, node_name="n1"))
        with capture_logs() as logs:
            source.poll()
        source.stop()
    assert source.errors == 0
    assert {u: source.of(u) for u in GPUS} == {
        "GPU-n1-0": GpuPod("team-a/train-0", None),
        "GPU-n1-1": GpuPod("team-a/train-0", None),
        "GPU-n1-2": GpuPod("team-b/infer-7", None),
        "GPU-n1-3": None,
        "GPU-n1-4": None,
        "GPU-n1-5": GpuPod("team-b/legacy", None),
        "GPU-n1-6": None,  # not a GPU resource
        "GPU-n1-7": None,
    }
    assert source.unmatched == ["MIG-0f3e2d1c-aaaa"]
    assert [e["event"] for e in logs] == ["kube_devices_unmatched", "kube_gpu_jobs"]


def test_jobs_and_classes_come_from_the_pods_labels(socket: Path, tmp_path: Path) -> None:
    """With a job label, the job is `<namespace>/<value>`; the class label is the class.
    The labels come from one GET of this node's pods, metadata only, with the token read
    anew each time (the kubelet rotates it); they are fetched again only when a new pod
    holds a GPU, or when they are older than labels_max_age_s."""
    token = tmp_path / "token"
    token.write_text("t-1\n")
    job_label, class_label = "batch.kubernetes.io/job-name", "powerd.io/class"
    fake = FakeApiServer(token="t-1")
    fake.labels["node-a"] = {
        ("team-a", "llama-0-x"): {job_label: "llama", class_label: "training"},
        ("team-a", "llama-1-y"): {job_label: "llama", class_label: "training"},
        ("team-b", "serve"): {class_label: "inference"},  # no job label: no job
        ("team-c", "bad"): {job_label: "has space", class_label: "-bad"},  # not label values
        ("kube-system", "other"): {},
    }
    clock = Clock()
    with kubelet(socket) as server, api_server(fake) as url:
        server.pods = [
            ("team-a", "llama-0-x", {"nvidia.com/gpu": ["GPU-n1-0"]}),
            ("team-a", "llama-1-y", {"nvidia.com/gpu": ["GPU-n1-1"]}),
            ("team-b", "serve", {"nvidia.com/gpu": ["GPU-n1-2"]}),
            ("team-c", "bad", {"nvidia.com/gpu": ["GPU-n1-3"]}),
        ]
        config = KubeConfig(
            socket=socket,
            node_name="node-a",
            job_label=job_label,
            class_label=class_label,
            api_url=url,
            token_file=token,
        )
        source = source_for(config, clock)
        source.poll()
        assert [source.of(f"GPU-n1-{i}") for i in range(5)] == [
            GpuPod("team-a/llama", "training"),
            GpuPod("team-a/llama", "training"),
            GpuPod(None, "inference"),
            GpuPod(None, None),
            None,
        ]
        [request] = fake.requests
        assert request["path"] == "/api/v1/pods"
        assert request["authorization"] == "Bearer t-1"
        assert request["accept"].startswith("application/json;as=PartialObjectMetadataList")
        # Nothing new: no second request.
        clock.t += 10
        source.poll()
        assert len(fake.requests) == 1
        # A new pod on a GPU: fetched again, with the rotated token.
        token.write_text("t-2")
        fake.token = "t-2"
        fake.labels["node-a"][("team-d", "new")] = {job_label: "j9", class_label: "batch"}
        server.pods.append(("team-d", "new", {"nvidia.com/gpu": ["GPU-n1-4"]}))
        clock.t += 10
        source.poll()
        assert len(fake.requests) == 2 and fake.requests[1]["authorization"] == "Bearer t-2"
        assert source.of("GPU-n1-4") == GpuPod("team-d/j9", "batch")
        # Old labels are fetched again.
        clock.t += config.labels_max_age_s
        source.poll()
        assert len(fake.requests) == 3
        source.stop()
    assert source.errors == 0


def test_a_gpu_shared_by_pods_of_different_jobs_reports_none(socket: Path) -> None:
    with kubelet(socket) as server:
        server.pods = [
            ("a", "p1", {"nvidia.com/gpu": ["GPU-n1-0::0", "GPU-n1-1::0"]}),
            ("a", "p2", {"nvidia.com/gpu": ["GPU-n1-0::1"]}),
        ]
        source = source_for(KubeConfig(socket=socket, node_name="n1"))
        source.poll()
        source.stop()
    assert source.of("GPU-n1-0") == GpuPod(None, None)
    assert source.of("GPU-n1-1") == GpuPod("a/p1", None)


def test_a_kubelet_gone_silent_reports_nothing_after_max_age(socket: Path) -> None:
    """A failed read is logged and counted, never raised; the last mapping holds for
    max_age_s (three polls), then nothing is reported until the kubelet answers again."""
    clock = Clock()
    config = KubeConfig(socket=socket, node_name="n1", period_s=2.0, timeout_s=1.0)
    with kubelet(socket) as server:
        server.pods = [("a", "p", {"nvidia.com/gpu": ["GPU-n1-0"]})]
        source = source_for(config, clock)
        source.poll()
        server.fail = True
        clock.t += config.max_age_s - 0.5
        with capture_logs() as logs:
            source.poll()
        assert source.errors == 1 and logs[0]["event"] == "kube_read_failed"
        assert "UNAVAILABLE" in logs[0]["error"]
        assert source.of("GPU-n1-0") == GpuPod("a/p", None)  # within max_age
        clock.t += 1.0
        assert source.of("GPU-n1-0") is None
        server.fail = False
        source.poll()
        assert source.of("GPU-n1-0") == GpuPod("a/p", None)
    # No kubelet at all (its socket gone): the same, within the call's timeout.
    clock.t += 1.0
    source.poll()
    assert source.errors == 2
    source.stop()


def test_the_api_servers_refusals_and_garbage_cost_the_labels_only(socket: Path) -> None:
    """A 403 (no RBAC) is logged with what to grant; garbage or an oversized answer is
    refused; the pods' labels known before are kept, new pods report none until it works."""
    fake = FakeApiServer()
    fake.labels["n1"] = {("a", "p"): {"job": "j1"}, ("a", "q"): {"job": "j2"}}
    clock = Clock()
    with kubelet(socket) as server, api_server(fake) as url:
        server.pods = [("a", "p", {"nvidia.com/gpu": ["GPU-n1-0"]})]
        config = KubeConfig(socket=socket, node_name="n1", job_label="job", api_url=url)
        source = source_for(config, clock)
        source.poll()
        assert source.of("GPU-n1-0") == GpuPod("a/j1", None)
        server.pods.append(("a", "q", {"nvidia.com/gpu": ["GPU-n1-1"]}))
        fake.status = 403
        with capture_logs() as logs:
            source.poll()
        [failed] = [e for e in logs if e["event"] == "kube_labels_failed"]
        assert "403" in failed["error"] and "list` on pods" in failed["error"]
        assert source.of("GPU-n1-0") == GpuPod("a/j1", None)  # kept
        assert source.of("GPU-n1-1") == GpuPod(None, None)  # not known yet
        fake.status, fake.body = None, b"<html>not json"
        source.poll()
        fake.body = b'{"items": 5}'
        source.poll()
        assert source.errors == 3
        fake.body = None
        source.poll()
        assert source.of("GPU-n1-1") == GpuPod("a/j2", None)
        source.stop()
    with pytest.raises(KubeReadError, match="not a list of pods"):
        parse_pod_list([], ["job"])
    # Entries of the wrong shape are skipped; only the labels asked for are kept.
    doc = {
        "items": [
            None,
            {"metadata": "x"},
            {"metadata": {"name": 3, "namespace": "a"}},
            {"metadata": {"name": "p", "namespace": "a", "labels": {"job": "j", "x": "y"}}},
            {"metadata": {"name": "q", "namespace": "a", "labels": {"job": 7}}},
        ]
    }
    assert parse_pod_list(doc, ["job"]) == {PodRef("a", "p"): {"job": "j"}, PodRef("a", "q"): {}}


def test_job_names_fit_the_wire() -> None:
    import re

    pattern = re.compile(REPORTED_JOB_PATTERN)
    assert job_name("team-a", "llama") == "team-a/llama"
    long_a, long_b = job_name("ns", "p" * 300), job_name("ns", "p" * 299 + "q")
    assert long_a is not None and long_b is not None and long_a != long_b
    assert len(long_a) == MAX_JOB_CHARS and pattern.match(long_a)
    assert long_a.startswith("ns/ppp")
    assert job_name("ns", "white space") is None
    # Every name the kubelet source makes is one the wire takes.
    GpuTelemetry.model_validate(
        {
            "uuid": "GPU-0",
            "index": 0,
            "power_w": 1,
            "energy_j": 0,
            "cap_w": 300,
            "min_cap_w": 200,
            "max_cap_w": 700,
            "default_cap_w": 700,
            "temp_c": 40,
            "util_pct": 1,
            "sm_clock_mhz": 1,
            "job": long_a,
        }
    )


def test_settings_say_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    assert str(DEFAULT_SOCKET) == KUBELET_SOCKET
    with pytest.raises(SettingsError, match="need kube_socket"):
        AgentSettings.load(None, node_id="n1", kube_job_label="batch.kubernetes.io/job-name")
    with pytest.raises(SettingsError, match="kube_job_label"):
        AgentSettings.load(None, node_id="n1", kube_socket="/s", kube_job_label="not a label!")
    with pytest.raises(SettingsError, match="shorter than kube_period_s"):
        AgentSettings.load(None, node_id="n1", kube_socket="/s", kube_timeout_s=10.0)
    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    settings = AgentSettings(node_id="n1", kube_socket=Path("/s"), kube_class_label="c")
    with pytest.raises(SettingsError, match="run the agent in a pod"):
        settings.kube_config()
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "fd00::1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "6443")
    config = settings.kube_config()
    assert config is not None and config.api_url == "https://[fd00::1]:6443"
    assert config.node_name == "n1"  # the node id, unless kube_node_name says otherwise
    assert in_cluster_api_url({"KUBERNETES_SERVICE_HOST": "10.0.0.1"}) == "https://10.0.0.1:443"
    assert AgentSettings(node_id="n1").kube_config() is None


def test_without_the_extra_the_agent_says_which_to_install(
    monkeypatch: pytest.MonkeyPatch, socket: Path
) -> None:
    monkeypatch.setitem(sys.modules, "grpc", None)  # import grpc raises ImportError
    with pytest.raises(SettingsError, match=r"pip install 'powerd\[kubernetes\]'"):
        build_pod_source(KubeConfig(socket=socket), GPUS)


async def test_the_agent_reports_each_gpus_job_and_class(socket: Path) -> None:
    """A real agent on mock GPUs: its telemetry carries the job, and the class label as
    the workload (over the mock's own); GPUs no pod holds report neither."""
    fake = FakeApiServer()
    with kubelet(socket) as server, api_server(fake) as url:
        settings = AgentSettings(
            node_id="n1",
            backend="mock",
            mock_gpus=4,
            kube_socket=socket,
            kube_job_label="app",
            kube_class_label="powerd.io/class",
            kube_api_url=url,
        )
        clock = SystemClock()
        agent = Agent(settings, build_backend(settings, clock), MemoryBroker().client(), clock)
        uuids = sorted(agent.gpus, key=lambda u: agent.gpus[u].index)
        fake.labels["n1"] = {("ml", "w0"): {"app": "bert", "powerd.io/class": "batch"}}
        server.pods = [("ml", "w0", {"nvidia.com/gpu": uuids[:2]})]
        config = settings.kube_config()
        assert config is not None
        source = build_pod_source(config, {u: g.index for u, g in agent.gpus.items()})
        agent.pod_source = source
        source.poll()
        sample = {g.uuid: g for g in agent._sample()}
        source.stop()
    assert [(sample[u].job, sample[u].workload) for u in uuids] == [
        ("ml/bert", "batch"),
        ("ml/bert", "batch"),
        (None, "training"),
        (None, "training"),
    ]


def test_a_gpu_no_source_knows_is_reported_as_before() -> None:
    """Without a pod source the telemetry is what it was: no job, the backend's workload."""
    settings = AgentSettings(node_id="n1", backend="mock", mock_gpus=2)
    clock = SystemClock()
    agent = Agent(settings, build_backend(settings, clock), MemoryBroker().client(), clock)
    assert [(g.job, g.workload) for g in agent._sample()] == [(None, "training")] * 2


def test_the_agents_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """`--kube-socket` alone means the kubelet's usual socket; a bad label is refused
    before anything starts, naming the setting."""
    from powerd.cli import build_parser, main

    args = build_parser().parse_args(
        ["agent", "--kube-socket", "--kube-job-label", "batch.kubernetes.io/job-name"]
    )
    assert args.kube_socket == str(DEFAULT_SOCKET)
    assert args.kube_job_label == "batch.kubernetes.io/job-name"
    argv = ["agent", "--node-id", "n1", "--backend", "mock", "--kube-class-label", "x"]
    assert main(argv) == 2
    assert "need kube_socket" in capsys.readouterr().err
