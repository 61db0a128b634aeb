"""Which job runs on each GPU, from Kubernetes: the kubelet says which pod holds each GPU,
the pod's labels say its job and class (docs/operations.md, "Jobs from Kubernetes").

- **Pods**: `v1.PodResourcesLister/List` over the kubelet's unix socket (gRPC; the proto is
  vendored in `podresources/` with its licence, and its Python module generated from it).
  Devices of the resources named (default `nvidia.com/gpu`) map to this node's GPUs by their
  id: a GPU uuid (the NVIDIA device plugin's default), `<uuid>::<n>` (a replica of a
  time-sliced GPU), or a GPU index (the plugin's `index` device-id strategy). MIG devices
  and DRA claims name no whole GPU, and a power limit is a whole GPU's: they are counted as
  unmatched and their GPUs report no job.
- **Labels**: PodResources gives a pod's namespace and name only. With a job or class label
  configured, this node's pods are listed from the API server (one GET with a
  `spec.nodeName` field selector, metadata only, with the pod's service-account token and
  the cluster's CA; plain HTTP only where the operator gives such a URL, e.g. `kubectl
  proxy`) when a pod holding a GPU is new, and every `labels_max_age_s`.
- **Job**: `<namespace>/<label value>`; without a job label, the pod itself:
  `<namespace>/<pod>`. A GPU held by pods of different jobs (time-slicing) reports none.
  The class label's value is reported as the GPU's `workload` (the class it asks for).

Reading runs in a thread of its own (gRPC and HTTP with timeouts, every answer bounded);
the agent's loop only looks up the latest result, and a result older than `max_age_s`
(the kubelet unreachable) is not reported. grpcio and protobuf are the `kubernetes`
extra's, imported only here, when the source is built.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from powerd.agent.poller import Poller
from powerd.settings import SettingsError
from powerd.wire import REPORTED_JOB_PATTERN

log = structlog.get_logger(__name__)

DEFAULT_SOCKET = Path("/var/lib/kubelet/pod-resources/kubelet.sock")
SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")
GPU_RESOURCE = "nvidia.com/gpu"
LIST_METHOD = "/v1.PodResourcesLister/List"
# Bounds on what the kubelet and the API server may hand us: far above a real node (the
# kubelet's default is 110 pods), small enough that a broken answer costs little.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MAX_READ_BYTES = 16 * 1024 * 1024
MAX_PODS = 4096
MAX_DEVICE_IDS = 4096
MAX_JOB_CHARS = 128
# Metadata only (labels are all we need; a node's pods in full can be megabytes), else the
# full list from an API server that does not offer it.
ACCEPT = "application/json;as=PartialObjectMetadataList;g=meta.k8s.io;v=v1,application/json"
# Kubernetes' own syntax for label keys and values.
LABEL_KEY_PATTERN = (
    r"^([a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_JOB = re.compile(REPORTED_JOB_PATTERN)
_REPLICA = re.compile(r"^(.+)::[0-9]+$")


class KubeReadError(Exception):
    """The kubelet or the API server could not be read this time (logged, retried)."""


@dataclass(frozen=True, order=True)
class PodRef:
    namespace: str
    name: str


@dataclass(frozen=True)
class GpuPod:
    """What the agent reports for one GPU: its job and the class its pod asks for (None:
    not known)."""

    job: str | None
    cls: str | None


@dataclass(frozen=True)
class KubeConfig:
    socket: Path = DEFAULT_SOCKET
    resources: tuple[str, ...] = (GPU_RESOURCE,)
    node_name: str = ""
    job_label: str | None = None
    class_label: str | None = None
    api_url: str | None = None  # where pods' labels are read (None: no label asked for)
    token_file: Path | None = SERVICE_ACCOUNT_DIR / "token"
    ca_file: Path | None = SERVICE_ACCOUNT_DIR / "ca.crt"
    period_s: float = 10.0
    timeout_s: float = 3.0
    labels_max_age_s: float = 300.0

    @property
    def needs_labels(self) -> bool:
        return self.job_label is not None or self.class_label is not None

    @property
    def max_age_s(self) -> float:
        """A mapping older than this (three polls missed) is not reported."""
        return 3 * self.period_s + self.timeout_s


def in_cluster_api_url(env: Mapping[str, str] = os.environ) -> str | None:
    """The API server as a pod sees it (the variables every pod gets), or None."""
    host = env.get("KUBERNETES_SERVICE_HOST", "")
    if not host:
        return None
    port = env.get("KUBERNETES_SERVICE_PORT", "443")
    return f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"


# -- what the kubelet says ---------------------------------------------------------------


def pod_devices(response: Any, resources: Iterable[str]) -> dict[str, set[PodRef]]:
    """Device id → the pods holding it, for the resources named, from a List response."""
    wanted = set(resources)
    out: dict[str, set[PodRef]] = {}
    seen = 0
    for pod in list(response.pod_resources)[:MAX_PODS]:
        ref = PodRef(str(pod.namespace), str(pod.name))
        for container in pod.containers:
            for device in container.devices:
                if str(device.resource_name) not in wanted:
                    continue
                for device_id in device.device_ids:
                    seen += 1
                    if seen > MAX_DEVICE_IDS:
                        raise KubeReadError(f"more than {MAX_DEVICE_IDS} device ids listed")
                    out.setdefault(str(device_id), set()).add(ref)
    return out


def gpu_pods(
    devices: Mapping[str, set[PodRef]], gpus: Mapping[str, int]
) -> tuple[dict[str, set[PodRef]], list[str]]:
    """This node's GPUs (uuid → index) with the pods holding each, and the device ids that
    name none of them (MIG devices, another plugin's ids, a GPU the backend does not see)."""
    by_index = {str(i): u for u, i in gpus.items()}
    held: dict[str, set[PodRef]] = {}
    unmatched: list[str] = []
    for device_id, pods in devices.items():
        replica = _REPLICA.match(device_id)
        key = replica.group(1) if replica else device_id
        uuid = key if key in gpus else by_index.get(key)
        if uuid is None:
            unmatched.append(device_id)
            continue
        held.setdefault(uuid, set()).update(pods)
    return held, sorted(unmatched)


def job_name(namespace: str, name: str) -> str | None:
    """`namespace/name` within the wire's bounds: a longer one keeps its first 117
    characters and a digest of the whole (two long names do not share one by accident);
    None when it holds characters the wire refuses."""
    full = f"{namespace}/{name}"
    if len(full) > MAX_JOB_CHARS:
        digest = hashlib.sha256(full.encode()).hexdigest()[:10]
        full = f"{full[: MAX_JOB_CHARS - 11]}-{digest}"
    return full if _JOB.match(full) else None


# -- what the API server says -------------------------------------------------------------


def parse_pod_list(doc: Any, keep: Iterable[str]) -> dict[PodRef, dict[str, str]]:
    """Each pod of a PodList (or PartialObjectMetadataList) with the labels in `keep`."""
    if not isinstance(doc, dict) or not isinstance(doc.get("items"), list):
        raise KubeReadError("the API server's answer is not a list of pods")
    wanted = tuple(keep)
    out: dict[PodRef, dict[str, str]] = {}
    for item in doc["items"][:MAX_PODS]:
        meta = item.get("metadata") if isinstance(item, dict) else None
        if not isinstance(meta, dict):
            continue
        namespace, name = meta.get("namespace"), meta.get("name")
        if not isinstance(namespace, str) or not isinstance(name, str):
            continue
        labels = meta.get("labels")
        labels = labels if isinstance(labels, dict) else {}
        out[PodRef(namespace, name)] = {
            k: labels[k] for k in wanted if isinstance(labels.get(k), str)
        }
    return out


def _read_within(resp: Any, timeout_s: float) -> bytes:
    """The body, at most MAX_READ_BYTES, read within about `timeout_s` in all (a socket
    timeout bounds each read only: a body dripped slowly would hold the poller for ever)."""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    while True:
        if time.monotonic() > deadline:
            raise KubeReadError(f"the API server's answer not read within {timeout_s:g} s")
        chunk = resp.read1(MAX_READ_BYTES + 1 - size)
        if not chunk:
            return b"".join(chunks)
        chunks.append(chunk)
        size += len(chunk)
        if size > MAX_READ_BYTES:
            raise KubeReadError(f"the API server's answer is over {MAX_READ_BYTES} bytes")


def fetch_pod_labels(config: KubeConfig) -> dict[PodRef, dict[str, str]]:
    """This node's pods and the labels configured, from the API server."""
    assert config.api_url is not None
    selector = urllib.parse.quote(f"spec.nodeName={config.node_name}", safe="")
    url = f"{config.api_url.rstrip('/')}/api/v1/pods?fieldSelector={selector}"
    headers = {"Accept": ACCEPT}
    # Read at every request: a projected service-account token is rotated by the kubelet.
    if config.token_file is not None and config.token_file.is_file():
        token = config.token_file.read_text(encoding="ascii").strip()
        headers["Authorization"] = f"Bearer {token}"
    context = None
    if url.startswith("https:"):
        ca = config.ca_file if config.ca_file is not None and config.ca_file.is_file() else None
        context = ssl.create_default_context(cafile=None if ca is None else str(ca))
    request = urllib.request.Request(url, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=config.timeout_s, context=context) as resp:
            raw = _read_within(resp, config.timeout_s)
    except urllib.error.HTTPError as exc:
        hint = ""
        if exc.code in (401, 403):
            hint = ": the agent's service account needs `list` on pods (docs/operations.md)"
        raise KubeReadError(f"the API server answered {exc.code} {exc.reason}{hint}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise KubeReadError(f"cannot reach the API server at {config.api_url}: {exc}") from None
    try:
        doc = json.loads(raw)
    except ValueError:
        raise KubeReadError("the API server's answer is not JSON") from None
    keep = [k for k in (config.job_label, config.class_label) if k is not None]
    return parse_pod_list(doc, keep)


# -- the source the agent reads -----------------------------------------------------------

Lister = Callable[[], Any]


def grpc_lister(config: KubeConfig) -> tuple[Lister, Callable[[], None]]:
    """The kubelet's List over its socket, and a close; SettingsError without the extra."""
    try:
        import grpc

        from powerd.agent.podresources import api_pb2
    except ImportError as exc:
        need = f"needs the kubernetes extra: pip install 'powerd[kubernetes]' ({exc})"
        raise SettingsError("agent settings", [("kube_socket", need)]) from None
    channel = grpc.insecure_channel(
        f"unix://{config.socket.absolute()}",
        options=[("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)],
    )
    call = channel.unary_unary(
        LIST_METHOD,
        request_serializer=api_pb2.ListPodResourcesRequest.SerializeToString,
        response_deserializer=api_pb2.ListPodResourcesResponse.FromString,
    )

    def list_pods() -> Any:
        try:
            return call(api_pb2.ListPodResourcesRequest(), timeout=config.timeout_s)
        except grpc.RpcError as exc:
            raise KubeReadError(
                f"PodResources List on {config.socket}: {exc.code().name}: {exc.details()}"
            ) from None

    return list_pods, channel.close


class PodSource:
    """Latest job and class per GPU uuid from the kubelet (and the API server's labels);
    `poll` reads them once."""

    def __init__(
        self,
        config: KubeConfig,
        gpus: Mapping[str, int],  # uuid → index
        lister: Lister,
        labels: Callable[[], dict[PodRef, dict[str, str]]] | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        close: Callable[[], None] | None = None,  # the lister's, at `stop`
    ) -> None:
        if config.needs_labels and labels is None:
            raise ValueError("a job or class label needs a source of pod labels")
        self.config = config
        self.clock = clock
        self._gpus = dict(gpus)
        self._list = lister
        self._fetch_labels = labels
        self._labels: dict[PodRef, dict[str, str]] = {}
        self._labels_at = -math.inf
        self._lock = threading.Lock()
        self._latest: dict[str, GpuPod] = {}
        self._at = -math.inf
        self.errors = 0
        self.unmatched: list[str] = []  # device ids that name no GPU of this node, last poll
        self._close = close
        self._poller = Poller("powerd-kube", self.poll, config.period_s, 2 * config.timeout_s + 1.0)

    # -- reading (the poller thread) -------------------------------------------------------

    def poll(self) -> None:
        """Read the kubelet (and labels where asked) once; never raises."""
        now = self.clock()
        try:
            held, unmatched = gpu_pods(pod_devices(self._list(), self.config.resources), self._gpus)
            if self.config.needs_labels:
                self._refresh_labels({p for pods in held.values() for p in pods}, now)
            latest = {uuid: self._describe(pods) for uuid, pods in held.items()}
        except KubeReadError as exc:
            self.errors += 1
            log.warning("kube_read_failed", error=str(exc)[:300])
            return
        except Exception:  # a bug here must not kill the poller
            self.errors += 1
            log.exception("kube_read_crashed")
            return
        if unmatched != self.unmatched:
            if unmatched:
                log.info("kube_devices_unmatched", devices=unmatched[:16], count=len(unmatched))
            self.unmatched = unmatched
        with self._lock:
            changed = latest != self._latest
            self._latest, self._at = latest, now
        if changed:
            log.info(
                "kube_gpu_jobs",
                jobs={u: g.job for u, g in sorted(latest.items())},
                classes={u: g.cls for u, g in sorted(latest.items()) if g.cls is not None},
            )

    def _refresh_labels(self, pods: set[PodRef], now: float) -> None:
        """The labels of the pods holding GPUs: fetched when one is new or they are old; on
        a failure the labels known are kept and the new pods report none until a poll
        succeeds."""
        assert self._fetch_labels is not None
        known = self._labels
        if pods <= known.keys() and now - self._labels_at < self.config.labels_max_age_s:
            self._labels = {p: known[p] for p in pods}
            return
        try:
            fetched = self._fetch_labels()
        except KubeReadError as exc:
            self.errors += 1
            log.warning("kube_labels_failed", error=str(exc)[:300])
            self._labels = {p: known[p] for p in pods if p in known}
            return
        self._labels = {p: fetched[p] for p in pods if p in fetched}
        self._labels_at = now

    def _describe(self, pods: set[PodRef]) -> GpuPod:
        """One GPU's job and class: the one its pods agree on, else none."""
        jobs = {self._job(p) for p in pods}
        classes = {self._label(p, self.config.class_label) for p in pods}
        return GpuPod(
            job=jobs.pop() if len(jobs) == 1 else None,
            cls=classes.pop() if len(classes) == 1 else None,
        )

    def _job(self, pod: PodRef) -> str | None:
        if self.config.job_label is None:
            return job_name(pod.namespace, pod.name)
        value = self._label(pod, self.config.job_label)
        return None if value is None else job_name(pod.namespace, value)

    def _label(self, pod: PodRef, key: str | None) -> str | None:
        if key is None:
            return None
        value = self._labels.get(pod, {}).get(key)
        return value if value is not None and _LABEL_VALUE.match(value) else None

    # -- the agent's side (its loop: a dict lookup, nothing else) ---------------------------

    def of(self, uuid: str) -> GpuPod | None:
        """This GPU's job and class as last read; None when no pod holds it, or when the
        kubelet has not answered for `max_age_s`."""
        with self._lock:
            if self.clock() - self._at > self.config.max_age_s:
                return None
            return self._latest.get(uuid)

    # -- the poller thread -----------------------------------------------------------------

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()
        if self._close is not None:
            self._close()


def build_pod_source(config: KubeConfig, gpus: Mapping[str, int]) -> PodSource:
    """The source for these settings, polling in its own thread once started."""
    lister, close = grpc_lister(config)
    if not config.socket.exists():
        # The kubelet may come up after us: the poller retries.
        log.warning("kube_socket_missing", socket=str(config.socket))
    labels = partial(fetch_pod_labels, config) if config.needs_labels else None
    return PodSource(config, gpus, lister, labels, close=close)
