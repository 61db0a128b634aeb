"""Shadow mode with real processes: a controller steering four mock agents over a real
Mosquitto, and beside it `powerd controller --shadow` on its own store. The shadow decides
every tick, stores what it would have commanded, and sends nothing: no command of it ever
reaches the broker, and the caps the agents enforce are the steering controller's alone."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from test_e2e import NODES, TICK_S, WAIT_S, Monitor, Procs, site_policy

from powerd.auth import new_token_entry
from powerd.policy import load_policy
from powerd.store import Store
from powerd.testing.mosquitto import LocalMosquitto, free_port

pytestmark = pytest.mark.slow


def api_get(port: int, token: str, path: str) -> Any:
    with httpx.Client(
        base_url=f"http://127.0.0.1:{port}",
        headers={"Authorization": f"Bearer {token}"},
        timeout=5,
    ) as c:
        return c.get(path).json()


async def test_a_shadow_decides_stores_and_sends_nothing(
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
    store = Store(shadow_db)
    try:
        assert len(store.recent_ticks(limit=100)) >= 5  # its decisions, stored
        assert store.latest_caps(), "what it would have commanded is stored"
    finally:
        store.close()
