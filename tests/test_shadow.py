"""Shadow mode with real processes: a controller steering four mock agents over a real
Mosquitto, and beside it `powerd controller --shadow`. The shadow decides every tick, shows
what it would have commanded, and sends nothing: no command of it ever reaches the broker,
the caps the agents enforce are the steering controller's alone, and the database it is
given (the leader's, on SQLite and on PostgreSQL) is left exactly as it found it."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa
import yaml
from support.e2e import NODES, TICK_S, WAIT_S, Monitor, Procs, site_policy
from support.pg import BACKENDS, pg_database

from powerd.auth import new_token_entry
from powerd.policy import load_policy
from powerd.store import Store, upgrade
from powerd.testing.mosquitto import LocalMosquitto, free_port


def api_get(port: int, token: str, path: str) -> Any:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    ) as c:
        return c.get(path).json()


@pytest.mark.slow
@pytest.mark.process
async def test_a_shadow_decides_shows_and_sends_nothing(
    mosquitto: LocalMosquitto, tmp_path: Path
) -> None:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(site_policy()))
    monitor = Monitor(mosquitto.url, load_policy(policy_file))
    await monitor.start()
    procs = Procs(tmp_path, mosquitto.url)
    token, entry = new_token_entry("look", "viewer")
    (tmp_path / "tokens.toml").write_text(entry)
    port = free_port()
    shadow_db = f"sqlite:///{tmp_path / 'shadow.db'}"
    try:
        for node in NODES:
            procs.agent(node)
        procs.controller("ctl-a", policy_file, f"sqlite:///{tmp_path / 'steer.db'}")
        procs.start(
            "shadow",
            "controller",
            "--shadow",
            f"--policy={policy_file}",
            f"--broker={mosquitto.url}",
            f"--db={shadow_db}",
            f"--state-file={tmp_path / 'shadow-state.json'}",
            "--controller-id=ctl-shadow",
            f"--learn-s={TICK_S * 2}",
            f"--api-port={port}",
            f"--tokens-file={tmp_path / 'tokens.toml'}",
        )

        def shadow_ticks() -> int:
            try:
                return int(api_get(port, token, "/api/v1/fleet")["tick"] or 0)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return 0

        deadline = time.monotonic() + WAIT_S
        while shadow_ticks() < 10 or monitor.last_tick < 10:
            procs.check_alive()
            assert time.monotonic() < deadline, "the shadow and the controller never ticked"
            await asyncio.sleep(0.2)
        senders = {c.controller_id for n in NODES for c in monitor.nodes[n].commands}
        assert senders == {"ctl-a"}, f"commands came from {senders}"
        assert monitor.breaches == []
        alloc = api_get(port, token, "/api/v1/allocation")
        # What it would have sent, per GPU, within the caps it would have kept.
        planned = [g for g in alloc["caps"]["items"] if g.get("sent_w") is not None]
        assert len(planned) == 4 * len(NODES), alloc
    finally:
        procs.close()
        await monitor.stop()
    # What it decided lives in its API, /metrics and logs: its database gets nothing, not
    # even a schema.
    assert all(rows == [] for rows in table_rows(shadow_db).values())


def table_rows(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table, sorted: what a database holds, to compare."""
    engine = sa.create_engine(Store(url).engine.url)
    try:
        with engine.connect() as conn:
            return {
                t: sorted(map(tuple, conn.execute(sa.text(f'SELECT * FROM "{t}"'))), key=repr)
                for t in sa.inspect(conn).get_table_names()
            }
    finally:
        engine.dispose()


async def run_beside(
    mosquitto: LocalMosquitto, tmp_path: Path, db: str
) -> tuple[dict[str, list[tuple[Any, ...]]], dict[str, list[tuple[Any, ...]]], Any]:
    """A leader steers four agents on `db` and stops; a shadow on the same `db` ticks on
    beside the agents. The tables before the shadow started and after it stopped, and the
    shadow's allocation."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(site_policy()))
    monitor = Monitor(mosquitto.url, load_policy(policy_file))
    await monitor.start()
    procs = Procs(tmp_path, mosquitto.url)
    token, entry = new_token_entry("look", "viewer")
    (tmp_path / "tokens.toml").write_text(entry)
    port = free_port()
    try:
        for node in NODES:
            procs.agent(node)
        procs.controller("ctl-a", policy_file, db)
        deadline = time.monotonic() + WAIT_S
        while monitor.last_tick < 10:
            procs.check_alive()
            assert time.monotonic() < deadline, "the leader never ticked"
            await asyncio.sleep(0.2)
        assert procs.stop("controller") == 0
        state_file = tmp_path / "powerd-state.json"  # the leader's (Procs.controller)
        state = state_file.read_bytes() if state_file.exists() else None
        before = table_rows(db)
        assert before["ticks"] and before["cap_changes"] and before["policy_versions"]
        procs.start(
            "shadow",
            "controller",
            "--shadow",
            f"--policy={policy_file}",
            f"--broker={mosquitto.url}",
            f"--db={db}",
            f"--state-file={state_file}",
            "--controller-id=ctl-shadow",
            f"--learn-s={TICK_S * 2}",
            f"--api-port={port}",
            f"--tokens-file={tmp_path / 'tokens.toml'}",
        )
        deadline = time.monotonic() + WAIT_S
        while True:
            procs.check_alive()
            try:
                ticks = int(api_get(port, token, "/api/v1/fleet")["tick"] or 0)
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                ticks = 0
            if ticks >= 10:
                break
            assert time.monotonic() < deadline, "the shadow never ticked"
            await asyncio.sleep(0.2)
        alloc = api_get(port, token, "/api/v1/allocation")
        assert procs.stop("shadow") == 0
        assert (state_file.read_bytes() if state_file.exists() else None) == state
        return before, table_rows(db), alloc
    finally:
        procs.close()
        await monitor.stop()


@pytest.mark.slow
@pytest.mark.process
@pytest.mark.parametrize("backend", BACKENDS)
async def test_a_shadow_on_the_leaders_database_leaves_it_unchanged(
    mosquitto: LocalMosquitto, tmp_path: Path, backend: str
) -> None:
    if backend == "sqlite":
        before, after, alloc = await run_beside(
            mosquitto, tmp_path, f"sqlite:///{tmp_path / 'leader.db'}"
        )
    else:
        with pg_database() as url:
            before, after, alloc = await run_beside(mosquitto, tmp_path, url)
    assert after == before  # not a tick, cap, reason, event, version, state row or lease
    planned = [g for g in alloc["caps"]["items"] if g.get("sent_w") is not None]
    assert len(planned) == 4 * len(NODES), alloc  # it did decide, every tick


def test_a_read_only_store_refuses_every_write(tmp_path: Path) -> None:
    """What makes a shadow's writes impossible: the database refuses them, whatever code
    path tries (SQLite here; PostgreSQL in the test above)."""
    url = f"sqlite:///{tmp_path / 'leader.db'}"
    upgrade(url)
    Store(url).record_policy_version("a: 1", source="file", author="t", reason="t")
    ro = Store(url, read_only=True)
    try:
        assert ro.policy_versions().total == 1  # reads work
        with pytest.raises(sa.exc.OperationalError, match="readonly"):
            ro.record_policy_version("a: 2", source="file", author="t", reason="t")
        with pytest.raises(sa.exc.OperationalError, match="readonly"):
            ro.save_operator_state(1, 0.0, {})
    finally:
        ro.close()
    assert Store(url).policy_versions().total == 1
