"""Operators' state survives restarts and database faults: the controller as systemd runs
it (a real process, a real Mosquitto, a mock agent, SQLite or a real PostgreSQL behind a
proxy the test closes and opens), driven over real HTTP."""

from __future__ import annotations

import json
import signal
import sqlite3
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy.engine import make_url
from support.daemons import Site
from support.live_api import POLICY, LiveApi, wait_until
from support.pg import pg_database
from support.tcpproxy import TcpProxy

from powerd.controller.opstate import (
    BudgetState,
    OperatorState,
    StateFile,
    StateFileError,
    restore,
)
from powerd.policy import load_policy_text
from powerd.testing.mosquitto import LocalMosquitto


@pytest.fixture
def sqlite_site(tmp_path: Path, mosquitto: LocalMosquitto) -> Iterator[Site]:
    site = Site(tmp_path, mosquitto, f"sqlite:///{tmp_path / 'powerd.db'}")
    try:
        yield site
    finally:
        site.close()


def facility_budget_w(c: httpx.Client) -> float | None:
    """The facility's budget in force at the last tick (None before the first)."""
    facility = c.get("/api/v1/fleet").json()["facility"]
    return None if facility is None else float(facility["budget_w"])


def overrides(c: httpx.Client) -> dict[str, Any]:
    r = c.get("/api/v1/overrides")
    assert r.status_code == 200
    body: dict[str, Any] = r.json()
    return body


@pytest.mark.process
def test_restart_keeps_operators_state_and_an_api_policy_until_the_file_is_edited(
    sqlite_site: Site,
) -> None:
    site = sqlite_site
    with site.start() as c:
        uuid = c.get("/api/v1/gpus").json()["items"][0]["uuid"]
        writes = [
            c.put(
                "/api/v1/budgets/rack-1",
                json={"budget_w": 1200, "ttl_s": 7200, "reason": "grid DR-7, 2 h"},
            ),
            c.put("/api/v1/nodes/rack-2-n2/drain", json={"reason": "PSU swap"}),
            c.put(f"/api/v1/gpus/{uuid}/pin", json={"watts": 250, "reason": "thermal check"}),
            c.post(
                "/api/v1/classes/assign",
                json={"class": "inference", "uuids": [], "nodes": ["rack-2-n1"], "reason": "j1"},
            ),
            c.post(
                "/api/v1/classes/assign",
                json={"class": "inference", "uuids": ["GPU-x-1"], "nodes": [], "reason": "j2"},
            ),
            c.put(
                "/api/v1/policy",
                params={"reason": "new contract"},
                content=POLICY.replace("budget_w: 4000", "budget_w: 3900"),
            ),
        ]
        for r in writes:
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["applied"], body["durable"], body["audited"]) == (True, True, True)
        assert writes[-1].json()["version"] == 2
        before = overrides(c)
        assert before["budgets"][0]["group"] == "rack-1"
    site.stop()

    with site.start() as c:
        after = overrides(c)
        assert after == before  # the same budget (its expiry too), drain, pin, classes
        assert after["budgets"][0]["expires_at"] == pytest.approx(
            before["budgets"][0]["expires_at"]
        )
        assert after["pins_w"] == {uuid: 250} and after["drained"] == ["rack-2-n2"]
        assert after["node_classes"] == {"rack-2-n1": "inference"}
        assert after["gpu_classes"] == {"GPU-x-1": "inference"}
        policy = c.get("/api/v1/policy").json()
        assert policy["source"] == "api" and policy["version"] == 2
        wait_until(lambda: facility_budget_w(c) == 3900, "the facility budget 3900 W")
        wait_until(
            lambda: (
                c.get("/api/v1/groups", params={"level": "rack"}).json()["items"][0]["budget_w"]
                == 1200
            ),
            "the temporary budget in force after the restart",
        )
    assert site.events("policy_from_api")
    site.stop()

    # An operator edits the policy file after the API replaced it: the file wins.
    site.policy.write_text(POLICY.replace("budget_w: 4000", "budget_w: 3800"))
    with site.start() as c:
        policy = c.get("/api/v1/policy").json()
        assert policy["source"] == str(site.policy)
        wait_until(lambda: facility_budget_w(c) == 3800, "the facility budget 3800 W")
        assert overrides(c)["drained"] == ["rack-2-n2"]  # the rest of the state stays
    [chosen] = site.events("policy_from_file")
    assert "changed since the API replaced" in chosen["why"]
    # The file won: the state saved at that start no longer holds the API's policy.
    saved = json.loads(site.state_file.read_text())
    assert saved["api_policy"] is None and saved["revision"] == 7  # 6 writes, then this
    site.stop()

    # The state file lost (a new disk): the database's revision restores the same state.
    site.state_file.unlink()
    with site.start() as c:
        assert overrides(c) == before
    [restored] = site.events("operator_state_from_database")
    assert restored["revision"] == 7


@pytest.mark.process
def test_sighup_reload_logs_applied_and_stored(sqlite_site: Site) -> None:
    site = sqlite_site
    with site.start() as c:
        site.policy.write_text(POLICY.replace("budget_w: 4000", "budget_w: 3700"))
        assert site.controller is not None
        site.controller.send_signal(signal.SIGHUP)
        wait_until(lambda: site.events("policy_reloaded"), "policy_reloaded")
        assert c.get("/api/v1/policy").json()["version"] == 2
    assert not site.events("policy_version_not_stored")
    assert not site.events("policy_reload_failed")


@pytest.fixture
def pg_site(tmp_path: Path, mosquitto: LocalMosquitto) -> Iterator[tuple[Site, TcpProxy]]:
    with pg_database() as url:
        real = make_url(url)
        proxy = TcpProxy(real.port or 5432, real.host or "127.0.0.1")
        db = real.set(port=proxy.port).render_as_string(hide_password=False)
        site = Site(tmp_path, mosquitto, db)
        try:
            yield site, proxy
        finally:
            site.close()
            proxy.close()


@pytest.mark.postgres
@pytest.mark.process
def test_postgres_down_at_start_steers_alarms_and_catches_up(
    pg_site: tuple[Site, TcpProxy],
) -> None:
    site, proxy = pg_site  # the proxy is closed: the database refuses connections
    # A lone controller on PostgreSQL says so: it then steers through the outage (with
    # standbys, the default, it would stand by until it holds the lease: tests/test_ha.py).
    with site.start("--leadership", "alone") as c:
        alarms = wait_until(
            lambda: (
                {a["kind"] for a in c.get("/api/v1/alarms").json()} >= {"store_unreachable"}
                and c.get("/api/v1/alarms").json()
            ),
            "the store alarm",
        )
        assert alarms
        assert c.get("/api/v1/policy").json()["version"] is None
        cut = c.put(
            "/api/v1/budgets/site", json={"budget_w": 3000, "ttl_s": 3600, "reason": "DR-8"}
        )
        assert cut.status_code == 200
        body = cut.json()
        assert (body["applied"], body["durable"], body["audited"]) == (True, True, False)
        assert "queued" in body["detail"]
        refused = c.put("/api/v1/nodes/nowhere/drain", json={"reason": "typo"})
        assert refused.status_code == 404
        assert refused.json()["applied"] is False and refused.json()["audited"] is False
        wait_until(
            lambda: "audit_queued" in {a["kind"] for a in c.get("/api/v1/alarms").json()},
            "the audit_queued alarm",
        )
        wait_until(lambda: facility_budget_w(c) == 3000, "the cut applied")

        assert site.controller is not None
        site.controller.send_signal(signal.SIGHUP)
        wait_until(lambda: site.events("policy_version_not_stored"), "the SIGHUP's log")
        assert site.events("policy_reloaded") and not site.events("policy_reload_failed")
    # A restart during the outage: the queued audit rows live in the state file.
    site.stop()
    with site.start("--leadership", "alone") as c:
        assert overrides(c)["budgets"][0]["budget_w"] == 3000
        proxy.open()
        wait_until(lambda: c.get("/api/v1/policy").json()["version"], "a stored version")
        audit = wait_until(
            lambda: (
                (items := c.get("/api/v1/audit").json()["items"])
                and {a["action"] for a in items} >= {"budget.set", "node.drain", "policy.replace"}
                and items
            ),
            "the queued audit rows",
        )
        assert [(a["action"], a["result"]) for a in reversed(audit)] == [
            ("budget.set", "ok"),
            ("node.drain", "refused: unknown node 'nowhere'"),
            ("policy.replace", "ok"),
        ]  # each once, although the state file listed them at both starts
        wait_until(
            lambda: (
                not {"audit_queued", "store_unreachable"}
                & {a["kind"] for a in c.get("/api/v1/alarms").json()}
            ),
            "the alarms to clear",
        )
    assert site.events("operator_state_caught_up")


# ---- in one process (the API helper of test_api.py): faults the test holds itself ----


@pytest.mark.slow  # seconds of real time: a lock
def test_a_locked_database_delays_the_audit_not_the_ticks(tmp_path: Path) -> None:
    """The attack that hung the loop 29 s: the SQLite database locked by another connection
    while `PUT /budgets` is in flight. The answer says the change is applied and durable,
    its audit row queued; ticks go on under the lock; the row lands once it is released."""
    live = LiveApi(tmp_path, state_file=tmp_path / "powerd-state.json").start()
    try:
        assert live.controller is not None
        ctl = live.controller
        locker = sqlite3.connect(tmp_path / "powerd.db", timeout=30, isolation_level=None)
        locker.execute("BEGIN EXCLUSIVE")  # no other connection may write (nor wait long)
        try:
            ticks_locked = ctl.counters.ticks
            with live.client("operator") as c:
                r = c.put(
                    "/api/v1/budgets/site",
                    json={"budget_w": 3000, "ttl_s": 600, "reason": "DR under a lock"},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                assert (body["applied"], body["durable"], body["audited"]) == (True, True, False)
                after_answer = ctl.counters.ticks
                # The loop kept ticking while the database was locked: before the answer
                # came (the API waits for the audit row up to db_wait_s, 10 ticks) and after.
                assert after_answer > ticks_locked
                wait_until(lambda: ctl.counters.ticks >= after_answer + 5, "ticks under the lock")
                assert c.get("/api/v1/overrides").json()["budgets"][0]["budget_w"] == 3000
                assert "audit row queued" in body["detail"]
        finally:
            locker.execute("ROLLBACK")
            locker.close()
        with live.client("viewer") as c:
            wait_until(
                lambda: (
                    [a["action"] for a in c.get("/api/v1/audit").json()["items"]] == ["budget.set"]
                ),
                "the queued audit row written after the lock",
            )
    finally:
        live.close()


def test_state_file_unwritable_lowering_applies_anything_else_rolls_back(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("a file where the state directory should be")
    live = LiveApi(tmp_path, state_file=blocker / "powerd-state.json").start()
    try:
        with live.client("admin") as c:
            cut = c.put("/api/v1/budgets/rack-1", json={"budget_w": 1500, "reason": "DR"})
            assert cut.status_code == 200
            body = cut.json()
            assert (body["applied"], body["durable"], body["audited"]) == (True, False, True)
            assert "state file not written" in body["detail"]
            drain = c.put("/api/v1/nodes/rack-1-n1/drain", json={"reason": "PSU"})
            assert drain.status_code == 200 and drain.json()["durable"] is False
            kinds = {a["kind"] for a in c.get("/api/v1/alarms").json()}
            assert "state_not_durable" in kinds

            uuid = c.get("/api/v1/gpus").json()["items"][0]["uuid"]
            pin = c.put(f"/api/v1/gpus/{uuid}/pin", json={"watts": 650, "reason": "bench"})
            assert pin.status_code == 503
            assert pin.json()["applied"] is False and pin.json()["audited"] is True
            policy = c.put(
                "/api/v1/policy",
                params={"reason": "r"},
                content=POLICY.replace("budget_w: 4000", "budget_w: 3900"),
            )
            assert policy.status_code == 503
            o = c.get("/api/v1/overrides").json()
            assert o["pins_w"] == {} and o["drained"] == ["rack-1-n1"]
            assert [b["budget_w"] for b in o["budgets"]] == [1500]
            assert live.controller is not None and live.controller.policy.source != "api"
            # The rolled-back policy never became a stored version.
            assert c.get("/api/v1/policy").json()["version"] == 1
            audit = c.get("/api/v1/audit").json()["items"]
            assert [(a["action"], a["result"].split(":")[0]) for a in audit] == [
                ("policy.replace", "rolled back"),
                ("gpu.pin", "rolled back"),
                ("node.drain", "ok"),
                ("budget.set", "ok"),
            ]
    finally:
        live.close()


# ---- the state file and its restore ----


def test_state_file_round_trip_is_atomic_and_refuses_garbage(tmp_path: Path) -> None:
    sf = StateFile(tmp_path / "var" / "powerd-state.json")
    assert sf.load() is None  # no file yet: nothing to restore
    state = OperatorState(
        revision=7,
        ts=1.7e9,
        budgets=[
            BudgetState(
                group="site",
                budget_w=3000,
                expires_at=1.7e9 + 7200,
                reason="DR",
                actor="grid",
                created_at=1.7e9,
            )
        ],
        pins_w={"GPU-a": 250.0},
        drained=["rack-1-n1"],
    )
    sf.save(state)
    sf.save(state.model_copy(update={"revision": 8}))
    assert sf.load() == state.model_copy(update={"revision": 8})
    assert [p.name for p in sf.path.parent.iterdir()] == ["powerd-state.json"]  # no temp left
    sf.path.write_text('{"v": 1, "revision": "many"}')
    with pytest.raises(StateFileError, match="not a powerd state file"):
        sf.load()


def test_restore_keeps_expired_budgets_for_the_tick_drops_groups_gone_keeps_redundant() -> None:
    policy = load_policy_text(POLICY, "p.yaml")
    now = 1.7e9
    budget = {"reason": "DR", "actor": "grid", "created_at": now - 100}
    state = OperatorState(
        budgets=[
            BudgetState(group="site", budget_w=3000, expires_at=now + 60, **budget),
            BudgetState(group="rack-1", budget_w=1000, expires_at=now - 1, **budget),  # over
            # Above the policy's 2,000 W now: kept, it binds again if the policy rises.
            BudgetState(group="rack-2", budget_w=2500, expires_at=None, **budget),
            BudgetState(group="gone", budget_w=10, expires_at=None, **budget),
        ],
        drained=["rack-1-n1", "old-node"],
        node_classes={"rack-2-n1": "inference", "rack-2-n2": "no-such-class"},
    )
    o = restore(state, policy, now)
    # An expired cut is kept as stored: a host's wall clock decides nothing at a restore (a
    # standby an hour ahead once dropped windows still in force); the tick ends it.
    assert list(o.budgets) == ["site", "rack-1", "rack-2"]
    assert o.budgets["site"].expires_at == now + 60
    active = o.active_budgets(policy, now)
    assert active["rack-2"] == 2000.0  # the lower of the two
    assert "rack-1" not in active
    assert list(o.budgets) == ["site", "rack-2"]  # ended by the tick's clock
    assert o.drained == {"rack-1-n1"}
    assert o.node_classes == {"rack-2-n1": "inference"}
