"""The daemons as systemd runs them: real processes, a real broker, a NOTIFY_SOCKET."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from support.daemons import stop

from powerd.testing.mosquitto import LocalMosquitto, free_port

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.process  # every test starts `python -m powerd.cli`


@pytest.fixture
def notify(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(60)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def start(args: list[str], notify_path: str, tmp_path: Path, name: str) -> subprocess.Popen[bytes]:
    env = os.environ | (
        {"NOTIFY_SOCKET": notify_path, "WATCHDOG_USEC": "2000000"} if notify_path else {}
    )
    log = (tmp_path / f"{name}.log").open("wb")
    return subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", "--log-format", "json", *args],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=tmp_path,
    )


def receive_until(sock: socket.socket, wanted: bytes) -> list[bytes]:
    seen: list[bytes] = []
    while not any(wanted in m for m in seen):
        seen.append(sock.recv(4096))
    return seen


def test_agent_notifies_ready_then_pings_the_watchdog(
    mosquitto: LocalMosquitto, notify: tuple[socket.socket, str], tmp_path: Path
) -> None:
    sock, path = notify
    proc = start(
        [
            "agent",
            "--node-id",
            "n1",
            "--broker",
            mosquitto.url,
            "--backend",
            "mock",
            "--period",
            "0.5",
        ],
        path,
        tmp_path,
        "agent",
    )
    try:
        messages = receive_until(sock, b"READY=1")
        assert b"STATUS=agent n1 connected" in messages[-1]
        receive_until(sock, b"WATCHDOG=1")
        receive_until(sock, b"WATCHDOG=1")
    finally:
        assert stop(proc) == 0
    assert any(b"STOPPING=1" in m for m in receive_until(sock, b"STOPPING=1"))


def test_controller_notifies_ready_after_its_first_tick_and_pings_each_tick(
    mosquitto: LocalMosquitto, notify: tuple[socket.socket, str], tmp_path: Path
) -> None:
    sock, path = notify
    db = f"sqlite:///{tmp_path / 'c.db'}"
    proc = start(
        [
            "controller",
            "--policy",
            str(ROOT / "policies" / "example.yaml"),
            "--broker",
            mosquitto.url,
            "--db",
            db,
            "--learn-s",
            "0.5",
        ],
        path,
        tmp_path,
        "controller",
    )
    try:
        messages = receive_until(sock, b"READY=1")
        assert b"STATUS=steering 0 GPUs" in messages[-1]
        receive_until(sock, b"WATCHDOG=1")
        receive_until(sock, b"WATCHDOG=1")
    finally:
        assert stop(proc) == 0


def test_controller_refuses_an_api_without_tokens(tmp_path: Path) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "powerd.cli",
            "controller",
            "--policy",
            str(ROOT / "policies" / "example.yaml"),
            "--db",
            f"sqlite:///{tmp_path / 'c.db'}",
            "--api-port",
            "0",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 2
    assert "tokens_file: the admin API needs a tokens file" in out.stderr


def test_agent_serves_its_own_metrics(mosquitto: LocalMosquitto, tmp_path: Path) -> None:
    port = free_port()
    proc = start(
        [
            "agent",
            "--node-id",
            "n1",
            "--broker",
            mosquitto.url,
            "--backend",
            "mock",
            "--period",
            "0.3",
            "--metrics-port",
            str(port),
        ],
        "",
        tmp_path,
        "agent",
    )
    try:
        text = ""
        for _ in range(200):
            try:
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
            except httpx.TransportError:
                text = ""
            if "DCGM_FI_DEV_POWER_USAGE{" in text:
                break
            time.sleep(0.1)
        assert 'Hostname="n1"' in text or 'node="n1"' in text
        assert text.count("DCGM_FI_DEV_POWER_USAGE{") == 8
        assert "powerd_agent_commands" in text
    finally:
        assert stop(proc) == 0
