"""Controller settings: defaults < a TOML or YAML file < `POWERD_` environment < flags."""

from __future__ import annotations

import socket
from dataclasses import replace
from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field
from sqlalchemy.engine import make_url

from powerd.controller.leadership import mode_for
from powerd.settings import ApiSettings
from powerd.store import Retention
from powerd.store.aggregate import CAP_EPSILON_W, CAP_INTERVAL_S
from powerd.transport.mqtt import MqttConfig

_RETENTION = Retention()
STATE_FILE_NAME = "powerd-state.json"


class ControllerSettings(ApiSettings):
    kind: ClassVar[str] = "controller settings"

    policy: Path = Path("/etc/powerd/policy.yaml")
    db: str = "sqlite:///powerd.db"
    # Operators' changes in force (docs/operations.md), written before the API answers and
    # read at start. None: `powerd-state.json` next to a SQLite database, else in the
    # working directory (systemd: /var/lib/powerd).
    state_file: Path | None = None
    solver: Literal["fast", "cvxpy", "uniform", "priority-bands"] = "fast"
    # Names this controller in its status topic, commands and the lease: distinct for
    # every controller of a standby pair, and stable across restarts.
    controller_id: str = Field(
        default_factory=lambda: f"powerd-{socket.gethostname()}",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,118}$",
    )
    # Who commands (docs/operations.md, "A standby pair"). auto: "alone" on SQLite (one
    # controller, which steers through database outages; a second one refuses to start),
    # "lease" on any other database (any number of controllers; the lease holder leads).
    leadership: Literal["auto", "lease", "alone"] = "auto"
    # Decide every tick as if steering, store what would have been commanded, and send
    # nothing: how a site tries powerd beside what it runs today (docs/operations.md).
    shadow: bool = False
    # A shadow's own database, where it records what the fleet did (draw, perf, the caps
    # the agents report, each budget's draw): the baseline of a pilot (docs/operations.md,
    # "Pilot"). Never `db`, which a shadow only reads; None: it records nothing.
    record_db: str | None = None
    # Steer only the subtree under this row or rack of the policy, under the budget a
    # `powerd coordinator` gives it (docs/operations.md, "Scopes"); None: the whole policy.
    scope: str | None = Field(default=None, pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
    # The leader's lease in seconds; None: 0.4 × the policy's lease_s (4 s by default),
    # renewed every min(lease / 4, tick_s). A takeover completes within about lease +
    # renewal + one tick, which must fit the agents' lease_s (checked at start).
    leader_lease_s: float | None = Field(default=None, gt=0, le=3600)
    # A leader that cannot reach its database keeps commanding past its lease until it
    # hears a newer leader of its authority (docs/safety.md, "Steering through a database
    # outage"); False: it stops at its lease deadline and the fleet falls to failsafe.
    through_outage: bool = True
    # Listen this long before the first tick so retained status and telemetry teach the caps
    # in force; None: the policy's stale_after_s.
    learn_s: float | None = Field(default=None, ge=0, le=3600)

    # QoS 1 commands sent ahead of the broker's acknowledgements; 0: no limit. A tick sends
    # one command per node, and they should leave in one burst: with a window, the rest of
    # a large fleet's commands wait for broker round trips (docs/controller.md has figures).
    command_window: int = Field(default=0, ge=0, le=65535)

    # What the store keeps (docs/storage.md); the defaults are the store's own.
    keep_minutes_days: float = Field(default=_RETENTION.keep_minutes_days, gt=0)
    keep_ticks_days: float = Field(default=_RETENTION.keep_ticks_days, gt=0)
    keep_cap_changes_days: float | None = Field(
        default=_RETENTION.keep_cap_changes_days, gt=0
    )  # None: as ticks
    cap_epsilon_w: float = Field(default=CAP_EPSILON_W, ge=0)  # smaller moves: not stored
    # A GPU's cap is stored at most once per this many seconds (0: every move).
    cap_interval_s: float = Field(default=CAP_INTERVAL_S, ge=0)

    api_host: str = "127.0.0.1"
    api_port: int | None = Field(default=None, ge=0, le=65535)  # None: no admin API
    tokens_file: Path | None = None
    dev: bool = False

    def client_name(self) -> str:
        return self.controller_id

    def mqtt_config(self) -> MqttConfig:
        return replace(super().mqtt_config(), max_inflight_messages=self.command_window)

    def leadership_mode(self) -> Literal["lease", "alone"]:
        return mode_for(self.leadership, self.db)

    def state_path(self) -> Path:
        if self.state_file is not None:
            return self.state_file
        url = make_url(self.db) if "://" in self.db else None
        database = url.database if url is not None and url.get_backend_name() == "sqlite" else None
        if database and database != ":memory:":
            return Path(database).parent / STATE_FILE_NAME
        return Path(STATE_FILE_NAME)

    def retention(self) -> Retention:
        return Retention(
            keep_minutes_days=self.keep_minutes_days,
            keep_ticks_days=self.keep_ticks_days,
            keep_cap_changes_days=self.keep_cap_changes_days,
        )
