"""Agent settings: defaults < a TOML or YAML file < `POWERD_` environment < explicit values."""

from __future__ import annotations

import os
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

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

    # What must survive a restart (the highest leader epoch applied, so a deposed leader's
    # late command is still refused after one). Default: systemd's $STATE_DIRECTORY
    # (StateDirectory= in the unit), else nothing is kept.
    state_dir: Path | None = Field(default_factory=_systemd_state_directory)

    # Append every telemetry sample to this file in nvidia-smi's CSV format (a recording
    # for `powerd sim`, docs/simulator.md, "Recorded traces"); None: no recording.
    record: Path | None = None

    def client_name(self) -> str:
        return f"powerd-agent-{self.node_id}"
