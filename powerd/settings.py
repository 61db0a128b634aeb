"""Process settings shared by the agent and the controller: how to reach the broker, and
how settings are layered: defaults < a TOML or YAML file < `POWERD_` environment < flags."""

from __future__ import annotations

import tomllib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Self

import yaml
from pydantic import Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, EnvSettingsSource, SettingsConfigDict

from powerd.input_errors import InputError, validation_problems
from powerd.transport.mqtt import MqttConfig
from powerd.wire import DEFAULT_PREFIX


class SettingsError(InputError):
    kind = "settings"


class BrokerSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="POWERD_", extra="forbid", frozen=True)
    kind: ClassVar[str] = "settings"  # names the source in errors

    broker: str = "mqtt://127.0.0.1:1883"  # mqtt://host:port or mqtts://host:port
    username: str | None = None
    password: SecretStr | None = None
    # mqtts:// only. The CA the broker's certificate must be signed by (the site's, and then
    # only it: docs/safety.md, "Which broker"); None: the system's trust store.
    tls_ca_file: Path | None = None
    # This client's certificate and key, for a broker that requires one (the certificate's
    # common name is then the username the ACL sees: deploy/pki/mosquitto-tls.conf).
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None  # None: the key is in tls_cert_file
    tls_insecure: bool = False  # no certificate check at all: tests and lab benches only
    reconnect_max_s: float = Field(default=30.0, gt=0, le=3600)
    topic_prefix: str = DEFAULT_PREFIX

    @model_validator(mode="after")
    def _tls_settings_agree(self) -> Self:
        tls_files = [
            name
            for name in ("tls_ca_file", "tls_cert_file", "tls_key_file")
            if getattr(self, name) is not None
        ]
        if not self.broker.startswith("mqtts://") and (tls_files or self.tls_insecure):
            # A CA given and silently unused would leave the broker unchecked.
            given = ", ".join([*tls_files, *(["tls_insecure"] if self.tls_insecure else [])])
            raise ValueError(f"{given}: for mqtts:// only, and the broker is {self.broker!r}")
        if self.tls_insecure and self.tls_ca_file is not None:
            raise ValueError("tls_insecure turns off the check that tls_ca_file is for: give one")
        if self.tls_key_file is not None and self.tls_cert_file is None:
            raise ValueError("tls_key_file needs tls_cert_file (the certificate of that key)")
        return self

    @classmethod
    def load(cls, config_file: Path | None = None, **overrides: Any) -> Self:
        """Settings from a file (.toml, .yaml or .yml), the environment and explicit values.

        `overrides` (e.g. command-line flags) win; None values among them are ignored, so a
        CLI can pass every flag whether given or not. Raises SettingsError.
        """
        source = str(config_file) if config_file is not None else cls.kind
        file_values = read_settings_file(config_file) if config_file is not None else {}
        given = {k: v for k, v in overrides.items() if v is not None}
        try:
            env_values = EnvSettingsSource(cls)()
            return cls(**{**file_values, **env_values, **given})
        except ValidationError as exc:
            raise SettingsError(source, validation_problems(exc)) from None

    def client_name(self) -> str:
        """The broker client id's stem (a random suffix is added per process)."""
        return "powerd"

    def mqtt_config(self) -> MqttConfig:
        return MqttConfig.from_url(
            self.broker,
            username=self.username,
            password=self.password.get_secret_value() if self.password else None,
            ca_file=self.tls_ca_file,
            cert_file=self.tls_cert_file,
            key_file=self.tls_key_file,
            tls_insecure=self.tls_insecure,
            # Unique per process: a restarted one must not take over (and trigger the will
            # of) a session the broker still holds for its previous life.
            client_id=f"{self.client_name()}-{uuid.uuid4().hex[:8]}",
            reconnect_max_s=self.reconnect_max_s,
        )


@dataclass(frozen=True)
class ApiTls:
    """HTTPS for an admin API: its certificate (the chain, PEM), its key (None: in the
    certificate's file) and, for mutual TLS, the CA its clients' certificates must be
    signed by (None: any client may connect; the bearer token still decides)."""

    cert_file: Path
    key_file: Path | None = None
    client_ca_file: Path | None = None


class ApiSettings(BrokerSettings):
    """A daemon that serves an admin API (the controller, the coordinator): HTTPS."""

    # The API's certificate and key; None: plain HTTP (keep it on loopback then).
    api_tls_cert_file: Path | None = None
    api_tls_key_file: Path | None = None
    # Mutual TLS: only clients with a certificate of this CA get a connection.
    api_tls_client_ca_file: Path | None = None

    @model_validator(mode="after")
    def _api_tls_complete(self) -> Self:
        if self.api_tls_cert_file is None:
            given = [
                name
                for name in ("api_tls_key_file", "api_tls_client_ca_file")
                if getattr(self, name) is not None
            ]
            if given:
                raise ValueError(f"{', '.join(given)} need api_tls_cert_file (the API's own)")
        return self

    def api_tls(self) -> ApiTls | None:
        if self.api_tls_cert_file is None:
            return None
        return ApiTls(self.api_tls_cert_file, self.api_tls_key_file, self.api_tls_client_ca_file)


def read_settings_file(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise SettingsError(str(path), [("", f"cannot read: {exc.strerror}")]) from None
    try:
        if path.suffix == ".toml":
            data: object = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        else:
            raise SettingsError(str(path), [("", "use a .toml, .yaml or .yml file")])
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise SettingsError(str(path), [("", f"not valid {path.suffix[1:]}: {exc}")]) from None
    if not isinstance(data, dict):
        raise SettingsError(str(path), [("", "the file must hold a table of settings")])
    return data
