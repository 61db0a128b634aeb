"""Controller settings: defaults < a TOML or YAML file < `POWERD_` environment < flags."""

from __future__ import annotations

import socket
import uuid
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from powerd.agent.settings import read_settings_file
from powerd.errors import InputError, validation_problems
from powerd.transport.mqtt import MqttConfig
from powerd.wire import DEFAULT_PREFIX


class ControllerSettingsError(InputError):
    kind = "controller settings"


class ControllerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="POWERD_", extra="forbid", frozen=True)

    policy: Path = Path("/etc/powerd/policy.yaml")
    db: str = "sqlite:///powerd.db"
    solver: Literal["fast", "cvxpy", "uniform", "priority-bands"] = "fast"
    controller_id: str = Field(default_factory=lambda: f"powerd-{socket.gethostname()}")

    broker: str = "mqtt://127.0.0.1:1883"
    username: str | None = None
    password: SecretStr | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    tls_insecure: bool = False
    reconnect_max_s: float = Field(default=30.0, gt=0, le=3600)
    topic_prefix: str = DEFAULT_PREFIX
    # Listen this long before the first tick so retained status and telemetry teach the caps
    # in force; None: the policy's stale_after_s.
    learn_s: float | None = Field(default=None, ge=0, le=3600)

    api_host: str = "127.0.0.1"
    api_port: int | None = Field(default=None, ge=0, le=65535)  # None: no admin API
    tokens_file: Path | None = None
    dev: bool = False

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> ControllerSettings:
        source = str(config_file) if config_file is not None else "controller settings"
        file_values = read_settings_file(config_file) if config_file is not None else {}
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            env_values = EnvSettingsSource(cls)()
            return cls(**{**file_values, **env_values, **given})
        except ValidationError as exc:
            raise ControllerSettingsError(source, validation_problems(exc)) from None

    def mqtt_config(self) -> MqttConfig:
        return MqttConfig.from_url(
            self.broker,
            username=self.username,
            password=self.password.get_secret_value() if self.password else None,
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            tls_insecure=self.tls_insecure,
            client_id=f"{self.controller_id}-{uuid.uuid4().hex[:8]}",
            reconnect_max_s=self.reconnect_max_s,
        )
