"""A standby pair of controller processes on one PostgreSQL database, each behind a proxy the
test can cut, with agents and a monitor that notes when each command arrives (test_ha,
test_attack_ha)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url

from powerd.auth import new_token_entry
from powerd.store.db import make_engine
from powerd.store.leases import Lease, Leases
from powerd.testing.mosquitto import free_port
from powerd.wire import CapCommand, NodeState
from support.e2e import NODES, TICK_S, WAIT_S, Monitor, Procs
from support.tcpproxy import TcpProxy

SCOPE = "dc"  # the policy's root: a controller's lease covers what it steers


@dataclass
class Ctl:
    name: str
    port: int
    proxy: TcpProxy  # between this controller and PostgreSQL: cut it to lose the database


class Pair:
    """Controllers, agents, the monitor, and a way to ask each controller who leads."""

    def __init__(
        self, procs: Procs, monitor: Monitor, policy: Path, pg_url: str, workdir: Path
    ) -> None:
        self.procs = procs
        self.monitor = monitor
        self.policy = policy
        self.pg = make_url(pg_url)
        self.workdir = workdir
        token, entry = new_token_entry("watcher", "admin")
        self.token = token
        (workdir / "tokens.toml").write_text(entry)
        self.ctls: dict[str, Ctl] = {}
        self.leases = Leases(make_engine(pg_url))

    def start(self, name: str, *extra: str) -> Ctl:
        ctl = self.ctls.get(name)
        if ctl is None:
            proxy = TcpProxy(self.pg.port or 5432, self.pg.host or "127.0.0.1")
            proxy.open()
            ctl = self.ctls[name] = Ctl(name, free_port(), proxy)
        db = self.pg.set(port=ctl.proxy.port).render_as_string(hide_password=False)
        self.procs.start(
            name,
            "controller",
            f"--policy={self.policy}",
            f"--broker={self.procs.broker_url}",
            f"--db={db}",
            f"--state-file={self.workdir / f'{name}-state.json'}",
            f"--controller-id={name}",
            f"--learn-s={TICK_S * 2}",
            f"--api-port={ctl.port}",
            f"--tokens-file={self.workdir / 'tokens.toml'}",
            *extra,
        )
        return ctl

    def api(self, name: str) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.ctls[name].port}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )

    def leadership(self, name: str) -> dict[str, Any] | None:
        try:
            with self.api(name) as c:
                r = c.get("/api/v1/leadership")
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    def lease(self) -> Lease | None:
        return self.leases.current(SCOPE)

    async def until(self, cond: Any, what: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while not cond():
            self.procs.check_alive()
            if time.monotonic() > deadline:
                views = {n: self.leadership(n) for n in self.ctls if n in self.procs.running}
                pytest.fail(
                    f"timed out waiting until {what}; breaches: {self.monitor.breaches}; "
                    f"controllers: {views}"
                )
            await asyncio.sleep(0.02)

    def commands_of(self, name: str) -> list[tuple[float, CapCommand]]:
        return [(at, c) for at, c in self.monitor.arrivals if c.controller_id == name]

    def failsafe_nodes(self) -> list[str]:
        return [
            n
            for n in NODES
            if any(s.state is NodeState.FAILSAFE for s in self.monitor.nodes[n].statuses)
        ]

    def close(self) -> None:
        self.leases.engine.dispose()
        for ctl in self.ctls.values():
            ctl.proxy.close()


class ArrivalMonitor(Monitor):
    """The e2e monitor, also noting when each command arrived (this machine's wall clock,
    the one PostgreSQL's lease times are on)."""

    def __init__(self, broker_url: str, policy: Any) -> None:
        super().__init__(broker_url, policy)
        self.arrivals: list[tuple[float, CapCommand]] = []

    def handle(self, message: Any) -> None:
        parts = message.topic.split("/")
        if len(parts) == 5 and parts[4] == "caps":
            try:
                cmd = CapCommand.model_validate_json(message.payload)
            except ValueError:
                pass
            else:
                self.arrivals.append((time.time(), cmd))
        super().handle(message)
