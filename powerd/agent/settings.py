"""Agent settings: defaults < a TOML or YAML file < `POWERD_` environment < explicit values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from powerd.agent.kubelet import (
    DEFAULT_SOCKET,
    GPU_RESOURCE,
    LABEL_KEY_PATTERN,
    SERVICE_ACCOUNT_DIR,
    KubeConfig,
    in_cluster_api_url,
)
from powerd.agent.perf import PerfConfig
from powerd.settings import BrokerSettings, SettingsError
from powerd.wire import MAX_GPUS_PER_NODE, MAX_SANE_WATTS, NodeId

__all__ = ["AgentSettings", "SettingsError"]


def _systemd_state_directory() -> Path | None:
    """The first directory systemd's StateDirectory= made for this service, if any."""
    value = os.environ.get("STATE_DIRECTORY", "")
    return Path(value.split(":")[0]) if value else None


class AgentSettings(BrokerSettings):
    kind: ClassVar[str] = "agent settings"

    node_id: NodeId

    period_s: float = Field(default=1.0, gt=0, le=3600)  # telemetry period
    # Failsafe cap per GPU until the first command brings the controller's own; None: the
    # device's minimum, the only cap known to fit any budget.
    failsafe_w: float | None = Field(default=None, gt=0, le=MAX_SANE_WATTS)

    # Serve the agent's own Prometheus metrics here (None: off; dcgm-exporter uses 9400).
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)

    backend: Literal["nvml", "mock"] = "nvml"
    mock_gpus: int = Field(default=8, ge=0, le=MAX_GPUS_PER_NODE)
    mock_workload: Literal["steady", "training", "inference", "idle"] = "training"
    mock_seed: int = 0
    # Journal every change of a mock GPU's cap in force here, and start from the caps last
    # journalled (a chaos harness's ground truth, docs/safety.md); None: no journal.
    mock_journal: Path | None = None

    # The site this agent is enrolled in (the policy's `site`): commands for any other site
    # are refused. None: the site of the first command it obeys, kept in `state_dir`.
    site: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$"
    )

    # What must survive a restart (the highest leader epoch applied, so a deposed leader's
    # late command is still refused after one). Default: systemd's $STATE_DIRECTORY
    # (StateDirectory= in the unit), else nothing is kept.
    state_dir: Path | None = Field(default_factory=_systemd_state_directory)

    # Append every telemetry sample to this file in nvidia-smi's CSV format (a recording
    # for `powerd sim`, docs/simulator.md, "Recorded traces"); None: no recording.
    record: Path | None = None

    # Workload perf (docs/operations.md, "Workload perf"): a Prometheus endpoint and metric,
    # or a file the job writes; None: the backend's (NVML has none).
    perf_url: str | None = Field(default=None, pattern=r"^https?://", max_length=2000)
    perf_metric: str | None = Field(default=None, min_length=1, max_length=200)
    perf_labels: dict[str, str] = Field(default_factory=dict, max_length=32)
    perf_gpu_label: str | None = Field(default=None, min_length=1, max_length=100)
    perf_file: Path | None = None
    perf_kind: Literal["counter", "gauge"] = "counter"
    perf_period_s: float = Field(default=5.0, gt=0, le=3600)
    perf_timeout_s: float = Field(default=2.0, gt=0, le=60)
    perf_max: float = Field(default=1e9, gt=0, le=1e12)
    perf_max_age_s: float = Field(default=30.0, gt=0, le=86400)
    perf_gpus: list[int] | None = Field(default=None, max_length=MAX_GPUS_PER_NODE)

    # Jobs from Kubernetes (docs/operations.md, "Jobs from Kubernetes"): the kubelet's
    # PodResources socket (None: off), the resources that are GPUs, the pod labels naming
    # the job and the class (None: the pod is the job; no class), and where labels are read.
    kube_socket: Path | None = None
    kube_resources: list[str] = Field(
        default_factory=lambda: [GPU_RESOURCE], min_length=1, max_length=16
    )
    kube_job_label: str | None = Field(default=None, pattern=LABEL_KEY_PATTERN)
    kube_class_label: str | None = Field(default=None, pattern=LABEL_KEY_PATTERN)
    kube_node_name: str | None = Field(default=None, min_length=1, max_length=253)
    kube_api_url: str | None = Field(default=None, pattern=r"^https?://", max_length=2000)
    kube_token_file: Path = SERVICE_ACCOUNT_DIR / "token"
    kube_ca_file: Path = SERVICE_ACCOUNT_DIR / "ca.crt"
    kube_period_s: float = Field(default=10.0, gt=0, le=3600)
    kube_timeout_s: float = Field(default=3.0, gt=0, le=60)
    kube_labels_max_age_s: float = Field(default=300.0, gt=0, le=86400)

    @model_validator(mode="after")
    def _kube(self) -> AgentSettings:
        labels = self.kube_job_label is not None or self.kube_class_label is not None
        if self.kube_socket is None and (labels or self.kube_api_url is not None):
            raise ValueError(
                f"kube_job_label, kube_class_label and kube_api_url need kube_socket "
                f"(the kubelet's PodResources socket, usually {DEFAULT_SOCKET})"
            )
        if self.kube_timeout_s >= self.kube_period_s:
            raise ValueError("kube_timeout_s must be shorter than kube_period_s")
        return self

    @model_validator(mode="after")
    def _one_perf_source(self) -> AgentSettings:
        if self.perf_url is not None and self.perf_file is not None:
            raise ValueError("give perf_url or perf_file, not both")
        if self.perf_url is not None and self.perf_metric is None:
            raise ValueError("perf_url needs perf_metric (the counter or gauge to read)")
        if self.perf_timeout_s >= self.perf_period_s + 1e-9 and self.perf_url is not None:
            raise ValueError("perf_timeout_s must be shorter than perf_period_s")
        return self

    def perf_config(self) -> PerfConfig | None:
        if self.perf_url is None and self.perf_file is None:
            return None
        return PerfConfig(
            url=self.perf_url,
            metric=self.perf_metric,
            labels=dict(self.perf_labels),
            gpu_label=self.perf_gpu_label,
            file=self.perf_file,
            kind=self.perf_kind,
            period_s=self.perf_period_s,
            timeout_s=self.perf_timeout_s,
            max_value=self.perf_max,
            max_age_s=self.perf_max_age_s,
            gpus=None if self.perf_gpus is None else tuple(self.perf_gpus),
        )

    def kube_config(self) -> KubeConfig | None:
        """Where jobs come from in Kubernetes (None: off). SettingsError when a label is
        asked for and no API server is known (neither kube_api_url nor in a pod)."""
        if self.kube_socket is None:
            return None
        config = KubeConfig(
            socket=self.kube_socket,
            resources=tuple(self.kube_resources),
            node_name=self.kube_node_name or self.node_id,
            job_label=self.kube_job_label,
            class_label=self.kube_class_label,
            api_url=self.kube_api_url or in_cluster_api_url(),
            token_file=self.kube_token_file,
            ca_file=self.kube_ca_file,
            period_s=self.kube_period_s,
            timeout_s=self.kube_timeout_s,
            labels_max_age_s=self.kube_labels_max_age_s,
        )
        if config.needs_labels and config.api_url is None:
            raise SettingsError(
                self.kind,
                [
                    (
                        "kube_api_url",
                        "a job or class label is read from the API server: give its URL, "
                        "or run the agent in a pod (KUBERNETES_SERVICE_HOST)",
                    )
                ],
            )
        return config

    def client_name(self) -> str:
        return f"powerd-agent-{self.node_id}"
