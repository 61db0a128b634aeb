"""Scheduled budgets through the admin API over real HTTP, the CLI, across restarts of the
controller as systemd runs it (SQLite, and a real PostgreSQL without the state file), and a
standby following them (SQLite and PostgreSQL)."""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.daemons import Site
from support.live_api import POLICY, LiveApi, run, wait_until
from support.pg import BACKENDS, pg_database

from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from powerd.clock import ManualClock
from powerd.controller.build import build_controller
from powerd.controller.controller import Controller
from powerd.controller.opstate import StateFile
from powerd.policy import load_policy_text
from powerd.store import Store, upgrade
from powerd.testing.mosquitto import LocalMosquitto
from powerd.transport import MemoryBroker

UP, DOWN = 500.0, 1000.0  # W/s
RAMP_POLICY = POLICY.replace(
    "  stale_after_s: 1.0\n",
    f"  stale_after_s: 1.0\n  ramp_w_per_s: {{up: {UP:g}, down: {DOWN:g}}}\n",
)
assert RAMP_POLICY != POLICY
WALL0 = 1_800_000_000.0


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path, RAMP_POLICY).start()
    try:
        yield api
    finally:
        api.close()


def facility(c: httpx.Client) -> dict[str, Any]:
    fac: dict[str, Any] = c.get("/api/v1/fleet").json()["facility"]
    return fac


@pytest.mark.slow  # seconds of real time: a ramp
def test_a_scheduled_cut_ramps_in_on_time_and_out_after_cancel(live: LiveApi) -> None:
    with live.client("operator") as c:
        wait_until(lambda: facility(c)["budget_w"] == 4000, "the policy budget in force")
        start = time.time() + 3.0
        r = c.post(
            "/api/v1/budgets/site/schedule",
            json={"budget_w": 3000, "start": start, "end": start + 60, "reason": "DR-9"},
        )
        assert r.status_code == 200, r.text
        body = r.json()
        sid = body["target"]
        assert body["action"] == "budget.schedule" and sid.startswith("s-")
        assert body["applied"] and body["audited"]
        listed = c.get("/api/v1/schedules").json()
        assert [s["id"] for s in listed] == [sid]
        s = listed[0]
        assert (s["group"], s["budget_w"], s["policy_budget_w"]) == ("site", 3000, 4000)
        assert s["start"] == pytest.approx(start) and s["end"] == pytest.approx(start + 60)
        # 1,000 W at 1,000 W/s, done two ticks (0.4 s) before the start.
        assert s["ramp_from"] == pytest.approx(start - 1.4)
        assert s["state"] == "pending"
        assert c.get("/api/v1/overrides").json()["schedules"] == listed

        wait_until(lambda: time.time() >= start + 0.5, "the window's start")
        assert facility(c)["budget_w"] == pytest.approx(3000)
        assert c.get("/api/v1/schedules").json()[0]["state"] == "active"

        cancel = c.delete(f"/api/v1/schedules/{sid}", params={"reason": "DR-9 called off"})
        assert cancel.status_code == 200 and cancel.json()["action"] == "budget.unschedule"
        assert c.get("/api/v1/schedules").json() == []
        wait_until(lambda: facility(c)["budget_w"] == 4000, "the policy budget back")
        again = c.delete(f"/api/v1/schedules/{sid}", params={"reason": "twice"})
        assert again.status_code == 404

        # The facility's budget moved no faster than the ramp, either way, tick to tick.
        # The stored ticks (the store lags a second or so): down, held, back up.
        def stored() -> list[dict[str, Any]]:
            got = c.get("/api/v1/ticks", params={"limit": 1000, "since": start - 10})
            return sorted(got.json(), key=lambda t: t["tick"])

        ticks = wait_until(
            lambda: (t := stored()) and t[-1]["budget_w"] == 4000 and t, "the ticks stored"
        )
        # On time: from the first tick at or after the start, committed caps fit the target.
        first = next(t for t in ticks if t["ts"] >= start)
        assert first["budget_w"] == pytest.approx(3000)
        assert first["committed_w"] <= 3000 + 1e-6
        moved = [
            (b["budget_w"] - a["budget_w"]) / max(b["ts"] - a["ts"], 1e-3)
            for a, b in itertools.pairwise(ticks)
            if a["budget_w"] != b["budget_w"]
        ]
        assert moved and min(moved) >= -DOWN * 1.05 and max(moved) <= UP * 1.05
        assert min(moved) < 0 < max(moved)

        audit = c.get("/api/v1/audit", headers={"Authorization": f"Bearer {live.tokens['admin']}"})
        actions = [(a["action"], a["target"], a["result"]) for a in audit.json()["items"]]
        assert ("budget.schedule", sid, "ok") in actions
        assert ("budget.unschedule", sid, "ok") in actions
        assert ("budget.unschedule", sid, f"refused: no scheduled budget '{sid}'") in actions


@pytest.mark.slow  # seconds of real time: waits for ticks
def test_bad_schedules_are_refused_and_audited(live: LiveApi) -> None:
    now = time.time()
    with live.client("operator") as c:

        def post(group: str, **body: Any) -> httpx.Response:
            base = {"budget_w": 3000, "start": now + 600, "end": now + 1200, "reason": "x"}
            return c.post(f"/api/v1/budgets/{group}/schedule", json=base | body)

        assert post("nowhere").status_code == 404
        above = post("site", budget_w=5000)
        assert above.status_code == 422 and "can only lower" in above.json()["detail"]
        past = post("site", start=now - 3600)
        assert past.status_code == 422 and "in the past" in past.json()["detail"]
        backwards = post("site", end=now + 300)
        assert backwards.status_code == 422
        assert "end must be after start" in backwards.text
        assert post("site", start="tomorrow").status_code == 422
        assert post("site", start=1e12).status_code == 422
        assert post("site", extra=1).status_code == 422
        for _ in range(64):
            assert post("rack-1", budget_w=1500).status_code == 200
        full = post("rack-1", budget_w=1500)
        assert full.status_code == 422 and "64 scheduled budgets" in full.json()["detail"]
    with live.client("viewer") as c:
        assert c.get("/api/v1/schedules").status_code == 200
        r = c.post(
            "/api/v1/budgets/site/schedule",
            json={"budget_w": 3000, "start": now + 600, "reason": "x"},
        )
        assert r.status_code == 403
        assert c.delete("/api/v1/schedules/s-x", params={"reason": "x"}).status_code == 403
    with live.client(None) as c:
        assert c.get("/api/v1/schedules").status_code == 401


def test_cli_schedules_lists_and_cancels(live: LiveApi, capsys: pytest.CaptureFixture[str]) -> None:
    op = ["--url", live.url, "--token", live.tokens["operator"]]
    code, out = run(
        [
            "budget",
            "set",
            "rack-2",
            "1500",
            "--start",
            "2099-07-01T14:00:00+00:00",
            "--end",
            "2099-07-01T16:00:00+02:00",
            "--reason",
            "DR-10",
            *op,
        ]
    )
    # 16:00 at +02:00 is 14:00 UTC: the window would end as it starts.
    assert code == EXIT_BAD_INPUT
    assert "end must be after start" in capsys.readouterr().err
    code, out = run(
        [
            *("budget", "set", "rack-2", "1500", "--start", "2099-07-01T14:00:00Z"),
            *("--ttl", "2h", "--reason", "DR-10", *op),
        ]
    )
    # Too far ahead (more than a year): refused with the reason.
    assert code == EXIT_BAD_INPUT
    assert "days ahead" in capsys.readouterr().err
    start = time.time() + 3600
    iso = time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime(start))
    code, out = run(
        ["budget", "set", "rack-2", "1500", "--start", iso, "--ttl", "2h", "--reason", "DR", *op]
    )
    assert code == EXIT_OK and out.startswith("budget.schedule s-")
    sid = out.split()[1].rstrip(":")
    code, out = run(["budget", "schedules", *op])
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["id", "group", "budget", "ramp"]
    assert lines[1].startswith(sid) and "rack-2" in lines[1] and "1.5 kW" in lines[1]
    assert "pending" in lines[1] and "operator-user" in lines[1]
    code, out = run(["status", *op])
    assert code == EXIT_OK and "scheduled budgets" in out and sid in out
    code, out = run(["budget", "schedules", "--json", *op])
    assert code == EXIT_OK and '"end": ' in out
    with live.client("viewer") as c:
        [s] = c.get("/api/v1/schedules").json()
    assert s["end"] - s["start"] == pytest.approx(7200)
    assert run(["budget", "cancel", sid, "--reason", "off", *op])[0] == EXIT_OK
    assert run(["budget", "schedules", *op])[1].strip() == "no scheduled budgets"
    assert run(["budget", "cancel", sid, "--reason", "off", *op])[0] == EXIT_BAD_INPUT


def schedule(c: httpx.Client, start: float) -> str:
    r = c.post(
        "/api/v1/budgets/rack-1/schedule",
        json={"budget_w": 1200, "start": start, "end": start + 7200, "reason": "DR-11"},
    )
    assert r.status_code == 200, r.text
    assert (r.json()["applied"], r.json()["durable"]) == (True, True)
    return str(r.json()["target"])


def restart_keeps(site: Site, *extra: str, drop_state_file: bool = False) -> None:
    start = time.time() + 3600
    with site.start(*extra) as c:
        sid = schedule(c, start)
        before = c.get("/api/v1/schedules").json()
    site.stop()
    if drop_state_file:
        site.state_file.unlink()  # only the database has it now
    with site.start(*extra) as c:
        after = c.get("/api/v1/schedules").json()
        assert [s["id"] for s in after] == [sid]
        assert after[0]["start"] == pytest.approx(start)
        assert after[0]["end"] == pytest.approx(start + 7200)
        assert {k: v for k, v in after[0].items() if k != "ramp_from"} == {
            k: v for k, v in before[0].items() if k != "ramp_from"
        }
        r = c.delete(f"/api/v1/schedules/{sid}", params={"reason": "done"})
        assert r.status_code == 200
    site.stop()
    with site.start(*extra) as c:
        assert c.get("/api/v1/schedules").json() == []


@pytest.mark.process
def test_a_schedule_survives_a_restart_sqlite(tmp_path: Path, mosquitto: LocalMosquitto) -> None:
    site = Site(tmp_path, mosquitto, f"sqlite:///{tmp_path / 'powerd.db'}")
    site.policy.write_text(RAMP_POLICY)
    try:
        restart_keeps(site)
    finally:
        site.close()


@pytest.mark.postgres
@pytest.mark.process
def test_a_schedule_survives_a_restart_from_postgres_alone(
    tmp_path: Path, mosquitto: LocalMosquitto
) -> None:
    with pg_database() as url:
        site = Site(tmp_path, mosquitto, url)
        site.policy.write_text(RAMP_POLICY)
        try:
            restart_keeps(site, "--leadership", "alone", drop_state_file=True)
        finally:
            site.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_standby_follows_schedules_on_its_own_clock(tmp_path: Path, backend: str) -> None:
    """The leader schedules and cancels; a standby on the same database adopts the window
    by its wall times, anchored to its own monotonic clock (another process's readings mean
    nothing there), and drops it when the leader cancels it."""
    with contextlib.ExitStack() as stack:
        if backend == "sqlite":
            url = f"sqlite:///{tmp_path / 'powerd.db'}"
        else:
            url = stack.enter_context(pg_database())
        upgrade(url)
        store = Store(url)
        stack.callback(store.close)
        policy = load_policy_text(RAMP_POLICY, "policy.yaml")
        leader_clock = ManualClock(start=100.0, wall_offset=WALL0)
        standby_clock = ManualClock(start=5_000.0, wall_offset=WALL0 - 4_900.0)

        def controller(name: str, clock: ManualClock) -> Controller:
            return build_controller(
                policy,
                MemoryBroker().client(name),
                clock,
                store=store,
                state_file=StateFile(tmp_path / name / "s.json"),
            )

        leader, standby = controller("a", leader_clock), controller("b", standby_clock)
        start = WALL0 + 100.0 + 600.0
        out = await leader.ledger.commit(
            partial(
                leader.schedule_budget,
                "s-1",
                "site",
                3000.0,
                start=start,
                end=start + 3600.0,
                actor="grid",
                reason="DR-12",
            ),
            lowers_power=False,
        )
        assert (out.applied, out.durable, out.audited) == (True, True, True)
        assert await standby.ledger.follow()
        entry = standby.overrides.schedules["s-1"]
        assert (entry.start, entry.end, entry.budget_w) == (start, start + 3600.0, 3000.0)
        # Both clocks read the same wall time; the standby's monotonic one is 4,900 s ahead.
        assert entry.start_mono == pytest.approx(
            leader.overrides.schedules["s-1"].start_mono + 4900
        )
        await leader.ledger.commit(
            partial(leader.cancel_schedule, "s-1", actor="grid", reason="off"),
            lowers_power=False,
        )
        await leader.ledger.flush(5)
        assert await standby.ledger.follow()
        assert standby.overrides.schedules == {}
