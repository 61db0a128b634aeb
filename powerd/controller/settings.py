"""Controller settings: defaults < a TOML or YAML file < `POWERD_` environment < flags."""

from __future__ import annotations

import socket
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field

from powerd.settings import BrokerSettings


class ControllerSettings(BrokerSettings):
    kind: ClassVar[str] = "controller settings"

    policy: Path = Path("/etc/powerd/policy.yaml")
    db: str = "sqlite:///powerd.db"
    solver: Literal["fast", "cvxpy", "uniform", "priority-bands"] = "fast"
    controller_id: str = Field(default_factory=lambda: f"powerd-{socket.gethostname()}")
    # Listen this long before the first tick so retained status and telemetry teach the caps
    # in force; None: the policy's stale_after_s.
    learn_s: float | None = Field(default=None, ge=0, le=3600)

    api_host: str = "127.0.0.1"
    api_port: int | None = Field(default=None, ge=0, le=65535)  # None: no admin API
    tokens_file: Path | None = None
    dev: bool = False

    def client_name(self) -> str:
        return self.controller_id
