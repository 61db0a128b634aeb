"""`powerd bmc-agent` settings: the broker (as every daemon's), the node agent's own
(period, failsafe, state), and the BMC-managed nodes, each with its BMC URL, credentials
from files, TLS trust and limits (docs/operations.md, "BMC-managed nodes").

A file (TOML or YAML) is the only place nodes are given; passwords are read from the files
they name, never from the command line or the settings file itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal, Self

import httpx
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from powerd.agent.settings import AgentSettings
from powerd.bmc.backend import LimitsAt
from powerd.bmc.redfish import BmcTrust
from powerd.settings import BrokerSettings, SettingsError
from powerd.wire import MAX_SANE_WATTS, NodeId

MAX_NODES = 10_000
MAX_PASSWORD_BYTES = 4096


class BmcNode(BaseModel):
    """One BMC-managed node."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    node_id: NodeId
    url: str = Field(pattern=r"^https://[^/\s]+/?$", max_length=300)  # https://host[:port]
    username: str = Field(min_length=1, max_length=200)
    password_file: Path  # the password alone; a trailing newline is ignored
    # TLS trust: the CA bundle the BMC's certificate must chain to, or the BMC's own
    # certificate pinned; neither: the system's trust store.
    ca_file: Path | None = None
    pinned_cert_file: Path | None = None
    auth: Literal["session", "basic"] = "session"
    # Where its GPU limits are: None, the bmc-agent's `limits` below.
    limits: LimitsAt | None = None
    # Per BMC; None: the bmc-agent's defaults below.
    timeout_s: float | None = Field(default=None, gt=0, le=60)
    retries: int | None = Field(default=None, ge=0, le=5)
    concurrency: int | None = Field(default=None, ge=1, le=64)

    @field_validator("url")
    @classmethod
    def _bmc_address(cls, url: str) -> str:
        """Only a scheme, a host and a port: the pattern lets through a user name and
        password, a query, an empty host or a port out of range (or one httpx cannot parse
        at all), which would fail each request, or start, with no clear word of why."""
        try:
            parsed = httpx.URL(url)
            port = parsed.port
        except (httpx.InvalidURL, ValueError) as exc:
            raise ValueError(f"{url!r} is not https://host[:port] ({exc})") from None
        if (
            not parsed.host
            or parsed.userinfo
            or parsed.query
            or parsed.fragment
            or (port is not None and not 0 < port < 65536)
        ):
            raise ValueError(
                f"{url!r} is not https://host[:port] (no user, query or fragment; "
                "a port in 1..65535)"
            )
        return url

    @model_validator(mode="after")
    def _one_trust(self) -> Self:
        if self.ca_file is not None and self.pinned_cert_file is not None:
            raise ValueError("give ca_file or pinned_cert_file, not both")
        return self

    def trust(self) -> BmcTrust:
        return BmcTrust(ca_file=self.ca_file, pinned_cert_file=self.pinned_cert_file)


class BmcAgentSettings(BrokerSettings):
    kind: ClassVar[str] = "bmc-agent settings"

    nodes: list[BmcNode] = Field(min_length=1, max_length=MAX_NODES)

    # Telemetry period of every node: BMCs answer in 100–500 ms, so slower than a node
    # agent's 1 s by default, and well inside the policy's `stale_after_s` (5 s by
    # default; docs/operations.md, "BMC-managed nodes").
    period_s: float = Field(default=2.0, gt=0, le=3600)
    failsafe_w: float | None = Field(default=None, gt=0, le=MAX_SANE_WATTS)
    # Each node's authority and epoch survive restarts in STATE_DIR/<node_id>/.
    state_dir: Path | None = None

    # Defaults of every BMC's request timeout (per attempt), retries and connections.
    timeout_s: float = Field(default=0.8, gt=0, le=60)
    retries: int = Field(default=1, ge=0, le=5)
    concurrency: int = Field(default=4, ge=1, le=64)
    # The bmc-agent's own Prometheus metrics (per BMC: requests, failures, latency); None:
    # off. 9401 is the node agent's example port, 9400 dcgm-exporter's.
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # Where GPU limits are: "auto" (the Processors' EnvironmentMetrics, else Chassis
    # Controls of type Power), "processors" or "controls" (that path only).
    limits: LimitsAt = "auto"

    @field_validator("nodes")
    @classmethod
    def _unique(cls, nodes: list[BmcNode]) -> list[BmcNode]:
        seen: set[str] = set()
        for node in nodes:
            if node.node_id in seen:
                raise ValueError(f"node {node.node_id!r} is listed twice")
            seen.add(node.node_id)
        return nodes

    @model_validator(mode="after")
    def _timeouts_fit_the_period(self) -> Self:
        for i, node in enumerate(self.nodes):
            timeout = node.timeout_s or self.timeout_s
            retries = self.retries if node.retries is None else node.retries
            if timeout * (retries + 1) >= self.period_s:
                raise ValueError(
                    f"nodes[{i}] ({node.node_id}): timeout_s × (retries + 1) = "
                    f"{timeout * (retries + 1):g} s must be shorter than period_s "
                    f"({self.period_s:g} s), or one silent BMC delays its node's telemetry "
                    "past a period"
                )
        return self

    def bmc_password(self, i: int) -> str:
        """Node i's password from its file; SettingsError naming the field if unreadable."""
        node = self.nodes[i]
        where = f"nodes[{i}].password_file"
        try:
            with node.password_file.open("rb") as f:  # a wrong path (/dev/zero) read whole
                raw = f.read(MAX_PASSWORD_BYTES + 1)  # would never end
            if len(raw) > MAX_PASSWORD_BYTES:
                raise SettingsError(
                    self.kind,
                    [(where, f"{node.password_file} is over {MAX_PASSWORD_BYTES} bytes: "
                      "it should hold the password alone")],
                )  # fmt: skip
            text = raw.decode("utf-8")
        except OSError as exc:
            raise SettingsError(self.kind, [(where, f"cannot read: {exc.strerror}")]) from None
        except UnicodeDecodeError:
            raise SettingsError(self.kind, [(where, "not UTF-8 text")]) from None
        password = text.rstrip("\r\n")
        if not password:
            raise SettingsError(self.kind, [(where, f"{node.password_file} is empty")])
        return password

    def check_files(self) -> None:
        """Every password readable and every trust file a certificate file: SettingsError
        naming the first that is not (at start, before any node runs)."""
        for i, node in enumerate(self.nodes):
            self.bmc_password(i)
            for name in ("ca_file", "pinned_cert_file"):
                path = getattr(node, name)
                if path is None:
                    continue
                try:
                    node.trust().ssl_context()
                except (OSError, ValueError) as exc:
                    raise SettingsError(
                        self.kind,
                        [(f"nodes[{i}].{name}", f"{path}: not a PEM certificate ({exc})")],
                    ) from None

    def agent_settings(self, node: BmcNode) -> AgentSettings:
        """The node agent's settings for one node: this process's broker, period, failsafe
        cap and state (a directory per node), validated as any agent's."""
        state = None if self.state_dir is None else self.state_dir / node.node_id
        return AgentSettings.model_validate(
            {
                "node_id": node.node_id,
                "period_s": self.period_s,
                "failsafe_w": self.failsafe_w,
                "state_dir": state,
                "broker": self.broker,
                "username": self.username,
                "password": self.password,
                "tls_ca_file": self.tls_ca_file,
                "tls_cert_file": self.tls_cert_file,
                "tls_key_file": self.tls_key_file,
                "tls_insecure": self.tls_insecure,
                "reconnect_max_s": self.reconnect_max_s,
                "topic_prefix": self.topic_prefix,
            }
        )

    def client_name(self) -> str:
        return "powerd-bmc-agent"
