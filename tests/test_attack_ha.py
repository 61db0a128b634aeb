"""An outside attack on the standby pairs and the scopes (leases, epochs, the coordinator),
with real processes on real PostgreSQL and Mosquitto. Each test here shows a fault found;
they fail until it is fixed.
"""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
import yaml
from support.e2e import NODES, TICK_S, Procs, site_policy
from support.ha import Pair
from support.pg import pg_database

from powerd.auth import new_token_entry
from powerd.controller.leadership import Leadership, for_daemon, process_name
from powerd.coordinator.main import CoordinatorSettings
from powerd.policy import parse_policy
from powerd.store import upgrade
from powerd.testing.mosquitto import LocalMosquitto, free_port

# -- 1. a ScopeReport with extreme (valid) prices kills the coordinator's tick loop ------


def _report(scope: str, prices: list[float], budgets: list[float]) -> bytes:
    """A report that passes the wire model: finite watts in range, a non-increasing curve."""
    return json.dumps(
        {
            "v": 1,
            "scope": scope,
            "controller_id": f"ctl-{scope}",
            "epoch": 1,
            "tick": 1,
            "budget_w": 2000.0,
            "committed_w": 2000.0,
            "failsafe_w": 2200.0,
            "lo_w": 1800.0,
            "hi_w": 4400.0,
            "offset_w": 200.0,
            "curve_budget_w": budgets,
            "curve_price": prices,
        }
    ).encode()


def _pub(mosquitto: LocalMosquitto, topic: str, payload: bytes) -> None:
    subprocess.run(
        [
            "mosquitto_pub",
            "-h",
            "127.0.0.1",
            "-p",
            str(mosquitto.port),
            "-q",
            "1",
            "-t",
            topic,
            "-s",
        ],
        input=payload,
        check=True,
        timeout=10,
    )


@pytest.fixture
def coord_db() -> Iterator[str]:
    with pg_database() as url:
        yield url


@pytest.mark.slow
@pytest.mark.postgres
@pytest.mark.process
async def test_a_scope_report_with_extreme_prices_does_not_stop_the_coordinator(
    mosquitto: LocalMosquitto, coord_db: str, tmp_path: Path
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(site_policy()))
    token, entry = new_token_entry("grid", "operator")
    (tmp_path / "tokens.toml").write_text(entry)
    port = free_port()
    procs = Procs(tmp_path, mosquitto.url)
    try:
        procs.start(
            "coord",
            "coordinator",
            f"--policy={policy}",
            f"--broker={mosquitto.url}",
            f"--db={coord_db}",
            "--coordinator-id=coord-a",
            "--scope-level=rack",
            f"--state-file={tmp_path / 'coord-state.json'}",
            f"--api-port={port}",
            f"--tokens-file={tmp_path / 'tokens.toml'}",
        )
        api = httpx.Client(
            base_url=f"http://127.0.0.1:{port}",
            headers={"Authorization": f"Bearer {token}"},
            timeout=5,
        )
        deadline = time.monotonic() + 60
        while True:  # the coordinator leads and ticks
            procs.check_alive()
            try:
                if (await asyncio.to_thread(api.get, "/readyz")).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the coordinator never became ready"
            await asyncio.sleep(0.2)
        # Prices at the ends of the doubles (finite, non-increasing: the wire model takes
        # them). The split overflows to NaN for rack-1; min(NaN, its budget) is NaN, and
        # the NaN budget fails ScopeBudget's validation inside tick_once, outside any
        # handler: the tick task raises and the coordinator exits.
        r1 = _report("rack-1", [1e308, -1e308], [1800.0, 4400.0])
        r2 = _report("rack-2", [1e308, 1.0], [0.0, 1_000_000.0])
        for _ in range(8):
            _pub(mosquitto, "powerd/v1/scopes/rack-1/report", r1)
            _pub(mosquitto, "powerd/v1/scopes/rack-2/report", r2)
            await asyncio.sleep(TICK_S / 2)
        await asyncio.sleep(3 * TICK_S)
        alive = procs.running["coord"].poll() is None
        tail = procs.tail("coord") if not alive else ""
        assert alive, f"the coordinator died on its scopes' reports:\n{tail[-3000:]}"
        ready = await asyncio.to_thread(api.get, "/readyz")
        assert ready.status_code == 200, "the coordinator stopped ticking"
    finally:
        procs.close()


# -- 2. an operator-state row that does not validate: the new leader never commands -------


@pytest.mark.slow
@pytest.mark.process
async def test_a_bad_operator_state_row_does_not_leave_the_site_without_a_leader(
    pair: Pair,
) -> None:
    p = pair
    for node in NODES:
        p.procs.agent(node)
    p.start("ctl-a")
    await p.until(lambda: bool(p.commands_of("ctl-a")), "ctl-a leads")
    p.start("ctl-b")
    await p.until(lambda: (p.leadership("ctl-b") or {}).get("role") == "standby", "ctl-b stands by")
    # One row the model refuses (a later version's document, a hand edit, a bad restore).
    url = p.pg.set(drivername="postgresql").render_as_string(hide_password=False)
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO operator_state (revision, ts, state) VALUES (%s, %s, %s)",
            (10**6, time.time(), json.dumps({"v": 2, "budgets": "from a newer powerd"})),
        )
    held = p.lease()
    assert held is not None and process_name(held.holder) == "ctl-a"
    p.procs.kill("ctl-a")
    # The lease lapses after ~1.2 s (0.4 × lease_s); ctl-b takes it at once. Give it plenty.
    # It cannot read that row: it says so (an alarm) and commands from the state it has.
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if any(c.epoch > held.epoch for _, c in p.commands_of("ctl-b")):
            break
        await asyncio.sleep(0.1)
    lease = p.lease()
    view = p.leadership("ctl-b")
    assert any(c.epoch > held.epoch for _, c in p.commands_of("ctl-b")), (
        f"nobody commands 15 s after the leader died: the lease is held by "
        f"{lease.holder if lease else None} (epoch {lease.epoch if lease else None}), "
        f"ctl-b says {view}; nodes in failsafe: {p.failsafe_nodes()}"
    )
    with p.api("ctl-b") as c:
        alarms = {a["kind"] for a in c.get("/api/v1/alarms").json()}
    assert "operator_state_unreadable" in alarms
    assert p.failsafe_nodes() == []


# -- 3. two controllers with one controller id both lead, under one epoch -----------------


@pytest.mark.slow
@pytest.mark.process
async def test_two_controllers_with_one_id_do_not_both_lead(pair: Pair) -> None:
    p = pair
    for node in NODES:
        p.procs.agent(node)
    p.start("ctl-a")
    await p.until(lambda: bool(p.commands_of("ctl-a")), "ctl-a leads")
    # A second host given a copy of ctl-a's controller.toml (the id is the last flag).
    p.start("ctl-b", "--controller-id=ctl-a")
    both = 0
    deadline = time.monotonic() + 8
    while time.monotonic() < deadline:
        a, b = p.leadership("ctl-a"), p.leadership("ctl-b")
        if a and b and a.get("role") == "leader" and b.get("role") == "leader":
            both += 1
        await asyncio.sleep(0.2)
    assert both == 0, (
        f"both processes lead at once ({both} polls), one epoch: "
        f"{p.leadership('ctl-a')} / {p.leadership('ctl-b')}"
    )


@pytest.mark.postgres
async def test_two_coordinators_with_one_id_do_not_both_lead(coord_db: str) -> None:
    """`powerd coordinator` run twice with one id (a copied config, or the old constant
    default): the second process must not renew the first's lease and lead with it."""
    upgrade(coord_db)
    policy = parse_policy(site_policy())
    name = CoordinatorSettings().coordinator_id
    assert socket.gethostname()[:10] in name  # the default is per host now

    def one() -> Leadership:
        return for_daemon(
            coord_db,
            scope="dc/coordinator",
            holder=name,
            control=policy.control,
            lease_s=None,
            mode="lease",
        )

    first, second = one(), one()
    await first.attempt()
    await second.attempt()
    try:
        assert first.may_command()
        assert not second.may_command(), (
            f"a second coordinator with the id {name!r} leads beside the first, "
            f"epoch {second.epoch} (the first: {first.epoch})"
        )
        assert second.view().leader == name  # it sees the other process of its name lead
    finally:
        first.leases.engine.dispose()
        second.leases.engine.dispose()
