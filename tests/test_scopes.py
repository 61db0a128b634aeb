"""Scopes under a coordinator, as real processes on real PostgreSQL and Mosquitto: one
`powerd controller --scope` per rack of the end-to-end site (tests/test_e2e.py), a
`powerd coordinator` splitting the facility's budget between them, four mock agents, and
the end-to-end monitor checking every budget of the whole policy after every message.

Through one run: both scopes steered under the coordinator's budgets; a facility budget
cut through the coordinator's API, obeyed within two coordinator ticks; the coordinator
killed (each scope falls to its failsafe budget within the budget lease); a new
coordinator (the scopes resume above their failsafe budgets).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.e2e import LEASE_S, NODES, TICK_S, TOL_W, WAIT_S, Monitor, Procs, site_policy
from support.pg import pg_database

from powerd.auth import new_token_entry
from powerd.policy import Policy, failsafe_budget_w, load_policy
from powerd.testing.mosquitto import LocalMosquitto, free_port

# Controllers, a coordinator and agents as processes for minutes, a database each.
pytestmark = [pytest.mark.slow, pytest.mark.process, pytest.mark.postgres]

SCOPES = ("rack-1", "rack-2")


class Site:
    def __init__(
        self, procs: Procs, monitor: Monitor, policy_file: Path, dbs: dict[str, str]
    ) -> None:
        self.procs = procs
        self.monitor = monitor
        self.policy_file = policy_file
        self.policy: Policy = load_policy(policy_file)
        self.dbs = dbs
        self.ports: dict[str, int] = {}  # each coordinator's API
        self.leader = ""  # the coordinator `api()` asks
        self.scope_ports = {name: free_port() for name in SCOPES}
        token, entry = new_token_entry("grid", "operator")
        self.token = token
        self.tokens = procs.workdir / "tokens.toml"
        self.tokens.write_text(entry)

    def scope(self, name: str) -> None:
        self.procs.start(
            name,
            "controller",
            f"--policy={self.policy_file}",
            f"--broker={self.procs.broker_url}",
            f"--db={self.dbs[name]}",
            f"--state-file={self.procs.workdir / f'{name}-state.json'}",
            f"--controller-id=ctl-{name}",
            f"--scope={name}",
            f"--learn-s={TICK_S * 2}",
            f"--api-port={self.scope_ports[name]}",
            f"--tokens-file={self.tokens}",
        )

    def coordinator(self, name: str) -> None:
        self.ports.setdefault(name, free_port())
        self.procs.start(
            name,
            "coordinator",
            f"--policy={self.policy_file}",
            f"--broker={self.procs.broker_url}",
            f"--db={self.dbs['coordinator']}",
            f"--coordinator-id={name}",
            "--scope-level=rack",
            f"--state-file={self.procs.workdir / f'{name}-state.json'}",
            f"--api-port={self.ports[name]}",
            f"--tokens-file={self.tokens}",
        )

    def api(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.ports[self.leader]}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=10,
        )

    def scopes_view(self) -> dict[str, Any] | None:
        try:
            with self.api() as c:
                r = c.get("/api/v1/scopes")
        except httpx.HTTPError:
            return None
        return r.json() if r.status_code == 200 else None

    async def until(self, cond: Any, what: str) -> float:
        """Wait until cond(); the seconds it took."""
        t0 = time.monotonic()
        while not cond():
            self.procs.check_alive()
            if time.monotonic() - t0 > WAIT_S:
                pytest.fail(
                    f"timed out waiting until {what}; breaches: {self.monitor.breaches}; "
                    f"coordinator: {self.scopes_view()}; scopes: {self.scope_views()}"
                )
            await asyncio.sleep(0.02)
        return time.monotonic() - t0

    def scope_views(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, port in self.scope_ports.items():
            try:
                with httpx.Client(
                    base_url=f"http://127.0.0.1:{port}",
                    headers={"Authorization": f"Bearer {self.token}"},
                    timeout=10,
                ) as c:
                    fleet = c.get("/api/v1/fleet").json()
                    out[name] = {
                        k: fleet.get(k) for k in ("tick", "status", "facility", "rows", "alarms")
                    } | {"groups": c.get("/api/v1/groups", params={"level": "rack"}).json()}
            except httpx.HTTPError as exc:
                out[name] = str(exc)
        return out

    def steered(self) -> bool:
        views = self.monitor.nodes
        return all(
            v.status is not None and v.status.state.value == "steered" and v.commands
            for v in (views[n] for n in NODES)
        )

    def committed(self, group: str) -> float:
        return self.monitor.group_committed(group)


@pytest.fixture
async def site(mosquitto: LocalMosquitto, tmp_path: Path) -> AsyncIterator[Site]:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(site_policy()))
    monitor = Monitor(mosquitto.url, load_policy(policy_file))
    await monitor.start()
    procs = Procs(tmp_path, mosquitto.url)
    with ExitStack() as stack:
        dbs = {name: stack.enter_context(pg_database()) for name in (*SCOPES, "coordinator")}
        try:
            yield Site(procs, monitor, policy_file, dbs)
        finally:
            procs.close()
            await monitor.stop()


async def test_scopes_keep_every_budget_through_a_cut_and_the_coordinators_death(
    site: Site,
) -> None:
    mon = site.monitor
    failsafe = {s: failsafe_budget_w(site.policy, s) for s in SCOPES}
    for node in NODES:
        site.procs.agent(node)
    for s in SCOPES:
        site.scope(s)
    site.coordinator("coord-a")
    site.leader = "coord-a"

    # -- both scopes steered under the coordinator's budgets -----------------------------
    await site.until(site.steered, "every node is steered by its scope")

    def split_in_force() -> bool:
        view = site.scopes_view()
        return bool(
            view
            and view["tick"]
            and not view["waiting"]
            and all(p["budget_w"] is not None and not p["held"] for p in view["scopes"])
        )

    await site.until(split_in_force, "the coordinator splits the budget between both scopes")
    # The budget is used: the facility's 8000 W bind, not the scopes' failsafe budgets.
    await site.until(lambda: site.committed("dc") > 0.9 * 8000, "the facility budget in use")
    assert any(site.committed(s) > failsafe[s] + 100 for s in SCOPES)
    site.coordinator("coord-b")  # a standby
    assert mon.breaches == []

    # -- a facility budget cut through the API: obeyed within two coordinator ticks -------
    with site.api() as c:
        r = c.put("/api/v1/budgets/dc", json={"budget_w": 6000, "reason": "grid event"})
    assert r.status_code == 200, r.text
    assert r.json()["shared"] is True  # in the database, where the standby reads it
    cut = [g.budget_w for g in site.policy.groups]
    cut[0] = 6000.0
    mon.budget_w = [max(a, b) for a, b in zip(mon.budget_w, cut, strict=True)]
    took = await site.until(lambda: site.committed("dc") <= 6000 + TOL_W, "the cut obeyed")
    # Two coordinator ticks, plus the scope's tick that turns the budget into caps and the
    # acks of the agents (on a shared 2-core machine, allow a tick of scheduling).
    assert took <= 3 * TICK_S + 0.5, f"the cut took {took:.2f} s"
    mon.budget_w = cut  # from here on the strict check
    assert mon.breaches == []

    # -- the leading coordinator killed: its standby leads before any scope's lease ends --
    site.procs.kill("coord-a")
    site.leader = "coord-b"
    await site.until(
        lambda: (site.scopes_view() or {}).get("leadership", {}).get("role") == "leader",
        "coord-b leads",
    )
    await asyncio.sleep(LEASE_S + 2 * TICK_S)
    # No scope fell to its failsafe budget, and the cut holds under the new leader.
    assert all(site.committed(s) > failsafe[s] + 100 for s in SCOPES)
    assert site.committed("dc") <= 6000 + TOL_W
    assert mon.breaches == []

    # -- every coordinator killed: every scope falls to its failsafe budget --------------
    site.procs.kill("coord-b")
    killed = time.monotonic()
    await site.until(
        lambda: all(site.committed(s) <= failsafe[s] + TOL_W for s in SCOPES),
        "every scope at its failsafe budget",
    )
    assert time.monotonic() - killed <= LEASE_S + 3 * TICK_S + 0.5
    await asyncio.sleep(3 * TICK_S)
    assert all(site.committed(s) <= failsafe[s] + TOL_W for s in SCOPES)
    assert mon.breaches == []

    # -- a new coordinator: the scopes resume, the cut still in force (the database) ------
    site.coordinator("coord-c")
    site.leader = "coord-c"
    await site.until(
        lambda: any(site.committed(s) > failsafe[s] + 100 for s in SCOPES),
        "the scopes resume above their failsafe budgets",
    )
    await site.until(lambda: site.committed("dc") > 0.9 * 6000, "the cut budget in use")
    await asyncio.sleep(4 * TICK_S)
    assert site.committed("dc") <= 6000 + TOL_W
    assert mon.breaches == []
    assert mon.bad == []
