"""`powerd agent --restore-defaults`: every GPU back to its default limit, read back and
reported, exit 0/1; refused while an agent of the node runs (its lock), unless --force.

The mock backend with a journal stands in for the GPUs: like a real GPU it keeps its limit
between processes (the journal), so an agent process leaves its failsafe caps and the
restore, another process, finds them."""

from __future__ import annotations

import asyncio
import io
import signal
import threading
import time
from pathlib import Path

import pytest
from support.cli import powerd
from support.daemons import popen

from powerd.agent import restore
from powerd.agent.restore import AgentLock, AgentRunning, restore_defaults, restore_node
from powerd.agent.settings import AgentSettings
from powerd.backends.base import NoPermission
from powerd.backends.mock import CapJournal, MockBackend, SimulatedGpus
from powerd.clock import SystemClock
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.testing.mosquitto import LocalMosquitto, free_port
from powerd.testing.synthetic import policy_dict
from powerd.transport import MqttConfig, MqttTransport
from powerd.transport.base import PublishUnconfirmed
from powerd.wire import NodeState, NodeStatus, Topics


def settings(tmp_path: Path, **extra: object) -> AgentSettings:
    values: dict[str, object] = {
        "node_id": "n1",
        "backend": "mock",
        "mock_gpus": 3,
        "mock_journal": tmp_path / "journal",
        "state_dir": tmp_path,
        # No broker listens there (tests with one give theirs).
        "broker": f"mqtt://127.0.0.1:{free_port()}",
    }
    return AgentSettings(**{**values, **extra})


@pytest.fixture(autouse=True)
def _quick_broker_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(restore, "CONNECT_TIMEOUT_S", 1.0)


def journalled_caps(path: Path) -> dict[str, float]:
    """Each GPU's cap in force, as last journalled; {} before the backend opens."""
    if not path.exists():
        return {}
    return {uuid: watts for _, _, uuid, watts in CapJournal.read(path)}


def test_every_gpu_goes_back_to_its_default_and_is_read_back() -> None:
    clock = SystemClock()
    gpus = SimulatedGpus(4, start_s=clock.monotonic())
    backend = MockBackend(gpus, clock)
    for i in range(4):
        gpus.set_cap(i, 250.0 + i)
    gpus.fail_set(1, NoPermission)  # the agent lacks CAP_SYS_ADMIN
    gpus.override(2, 500.0)  # a BMC holds it lower than the default

    restored = restore_defaults(backend)

    assert [(g.index, g.before_w, g.after_w, g.ok) for g in restored] == [
        (0, 250.0, 700.0, True),
        (1, 251.0, None, False),
        (2, 252.0, 500.0, False),
        (3, 253.0, 700.0, True),
    ]
    assert restored[1].error is not None and restored[1].error.startswith("no_permission")
    assert "FAILED: no_permission" in restored[1].line()
    assert "another limit holds it" in restored[2].line()
    assert restored[0].line().endswith("250 W -> 700 W (default 700 W) ok")


def test_the_restore_is_refused_while_an_agent_holds_the_lock(tmp_path: Path) -> None:
    s = settings(tmp_path)
    agent = AgentLock(tmp_path)
    agent.acquire()  # as a running agent does (another open file: flock conflicts)
    out, err = io.StringIO(), io.StringIO()
    try:
        with pytest.raises(AgentRunning):
            AgentLock(tmp_path).acquire()  # a second agent refuses to start
        assert restore_node(s, force=False, out=out, err=err) == 1
        assert "stop it first" in err.getvalue() and out.getvalue() == ""
        assert not (tmp_path / "journal").exists()  # the GPUs were never opened
        assert restore_node(s, force=True, out=out, err=err, settle_s=0) == 0
        assert "--force" in err.getvalue()
    finally:
        agent.release()
    assert "3 of 3 GPUs at their default power limit" in out.getvalue()


def test_without_a_state_dir_it_cannot_tell_and_wants_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(restore, "SERVICE_STATE_DIR", tmp_path / "no-such-dir")
    s = settings(tmp_path, state_dir=None)
    out, err = io.StringIO(), io.StringIO()
    assert restore_node(s, force=False, out=out, err=err) == 1
    assert "cannot tell whether an agent runs" in err.getvalue()
    assert restore_node(s, force=True, out=out, err=err, settle_s=0) == 0


def test_without_a_broker_the_controller_cannot_be_told_and_nothing_rises(
    tmp_path: Path,
) -> None:
    s = settings(tmp_path)
    out, err = io.StringIO(), io.StringIO()
    assert restore_node(s, force=False, out=out, err=err, settle_s=0) == 1
    assert "cannot reach the broker" in err.getvalue() and "Stop the controllers" in err.getvalue()
    assert not (tmp_path / "journal").exists()  # the GPUs were never opened


def test_an_announcement_the_broker_never_confirms_refuses_the_raise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connected, but the status publish is never acknowledged (the connection dropped
    mid-publish): no controller is known to have heard it, so nothing rises."""

    async def unconfirmed(settings: AgentSettings, timeout_s: float | None = None) -> None:
        raise PublishUnconfirmed("the broker closed the connection before its PUBACK", sent=True)

    monkeypatch.setattr(restore, "announce_departure", unconfirmed)
    out, err = io.StringIO(), io.StringIO()
    assert restore_node(settings(tmp_path), force=False, out=out, err=err, settle_s=0) == 1
    assert "PublishUnconfirmed" in err.getvalue() and out.getvalue() == ""
    assert not (tmp_path / "journal").exists()  # the GPUs were never opened


@pytest.mark.broker
def test_the_node_is_announced_offline_without_caps_before_any_limit_rises(
    tmp_path: Path, mosquitto: LocalMosquitto
) -> None:
    """What a controller hears before the raise: the node's retained status, offline with no
    caps, which makes it count the node's GPUs at their maximum (and cut the others)."""
    s = settings(tmp_path, broker=mosquitto.url)
    journal = tmp_path / "journal"
    heard: list[tuple[NodeStatus, dict[str, float]]] = []
    subscribed = threading.Event()

    async def listen() -> None:
        client = MqttTransport(MqttConfig.from_url(mosquitto.url, client_id="a-controller"))
        await client.connect()
        await asyncio.wait_for(client.wait_connected(), 10)
        await client.subscribe(Topics().status("n1"), qos=1)
        subscribed.set()
        async for message in client.messages():
            # The caps the GPUs have when the status arrives: none raised yet.
            status = NodeStatus.model_validate_json(message.payload)
            heard.append((status, journalled_caps(journal)))
            break
        await client.disconnect()

    listener = threading.Thread(target=lambda: asyncio.run(asyncio.wait_for(listen(), 30)))
    listener.start()
    assert subscribed.wait(15)
    out, err = io.StringIO(), io.StringIO()
    code = restore_node(s, force=False, out=out, err=err, settle_s=1.0)
    listener.join(30)

    assert code == 0, err.getvalue()
    status, caps_then = heard[0]
    assert status.state is NodeState.OFFLINE and status.caps_w == {}
    assert caps_then == {}  # the restore had not opened the GPUs yet when it announced
    assert out.getvalue().startswith("node n1: announced offline")
    assert "3 of 3 GPUs at their default power limit" in out.getvalue()
    # A controller that hears it counts the node's GPUs at their maximum.
    engine = TickEngine(parse_policy(policy_dict(1, 1, 1, 3)))
    node = next(g.name for g in engine.policy.groups if g.level == 3)
    assert engine.on_status(node, status.model_copy(update={"node_id": node}))
    assert engine.fleet.nodes[node].state is NodeState.OFFLINE


@pytest.mark.process
def test_after_the_agent_stops_the_restore_brings_back_the_defaults(tmp_path: Path) -> None:
    config = tmp_path / "agent.toml"
    journal = tmp_path / "journal"
    config.write_text(
        'node_id = "n1"\nbackend = "mock"\nmock_gpus = 2\nfailsafe_w = 300\n'
        f'mock_journal = "{journal}"\nstate_dir = "{tmp_path}"\n'
        # No broker listens there: the agent runs on its own, at its failsafe caps.
        f'broker = "mqtt://127.0.0.1:{free_port()}"\n'
    )
    agent = popen(["agent", "--config", str(config)], tmp_path, "agent")
    try:
        deadline = time.monotonic() + 60
        while set(journalled_caps(journal).values()) != {300.0}:
            assert agent.poll() is None, (tmp_path / "agent.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the agent never set its failsafe caps"
            time.sleep(0.05)
        refused = powerd("agent", "--config", str(config), "--restore-defaults")
        assert refused.returncode == 1
        assert f"an agent (pid {agent.pid})" in refused.stderr
        second = powerd("agent", "--config", str(config))
        assert second.returncode == 1 and f"pid {agent.pid}" in second.stderr
        assert set(journalled_caps(journal).values()) == {300.0}  # untouched
    finally:
        agent.send_signal(signal.SIGTERM)
        code = agent.wait(timeout=60)
    assert code == 0
    # Stopped, the agent leaves the failsafe caps (its lease is nobody's to watch now).
    assert set(journalled_caps(journal).values()) == {300.0}

    # No broker to tell a controller (the agent ran alone): only with --force.
    alone = powerd("agent", "--config", str(config), "--restore-defaults", "--settle-s", "0")
    assert alone.returncode == 1 and "cannot reach the broker" in alone.stderr
    done = powerd(
        "agent", "--config", str(config), "--restore-defaults", "--force", "--settle-s", "0"
    )

    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "GPU 0 GPU-n1-0-000000: 300 W -> 700 W (default 700 W) ok",
        "GPU 1 GPU-n1-0-000001: 300 W -> 700 W (default 700 W) ok",
        "node n1: 2 of 2 GPUs at their default power limit",
    ]
    assert journalled_caps(journal) == {"GPU-n1-0-000000": 700.0, "GPU-n1-0-000001": 700.0}
