"""powerd daemons as real processes, the way systemd runs them: `popen` and `stop` (SIGTERM),
and `Site`, a controller started and stopped at will over the same policy, tokens, state
file and database, with one mock agent (test_durable, test_jobs_api, test_schedules)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from powerd.auth import new_token_entry
from powerd.testing.mosquitto import LocalMosquitto, free_port
from support.live_api import POLICY, wait_until

NODE = "rack-1-n1"


def popen(args: list[str], workdir: Path, name: str) -> subprocess.Popen[bytes]:
    log = (workdir / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", "--log-format", "json", *args],
        env=os.environ.copy(),
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=workdir,
    )


def stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()


class Site:
    """A policy file, tokens, a state file, one mock agent; controllers started and
    stopped at will against the same files and database."""

    def __init__(self, workdir: Path, broker: LocalMosquitto, db: str) -> None:
        self.workdir = workdir
        self.broker = broker
        self.db = db
        self.policy = workdir / "policy.yaml"
        self.policy.write_text(POLICY)
        self.state_file = workdir / "state" / "powerd-state.json"
        token, entry = new_token_entry("alice", "admin")
        self.token = token
        (workdir / "tokens.toml").write_text(entry)
        self.port = free_port()
        self.controller: subprocess.Popen[bytes] | None = None
        self.agent = popen(
            [
                "agent",
                "--node-id",
                NODE,
                "--broker",
                broker.url,
                "--backend",
                "mock",
                "--mock-gpus",
                "2",
                "--period",
                "0.2",
            ],
            workdir,
            "agent",
        )

    def start(self, *extra: str) -> httpx.Client:
        self.controller = popen(
            [
                "controller",
                "--policy",
                str(self.policy),
                "--broker",
                self.broker.url,
                "--db",
                self.db,
                "--state-file",
                str(self.state_file),
                "--learn-s",
                "0.5",
                "--api-port",
                str(self.port),
                "--tokens-file",
                str(self.workdir / "tokens.toml"),
                *extra,
            ],
            self.workdir,
            "controller",
        )
        with self.client() as c:
            wait_until(lambda: self._gpus(c) == 2, "the controller to steer the agent's GPUs")
        return self.client()

    def client(self) -> httpx.Client:
        return httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {self.token}"},
            timeout=30,
        )

    def _gpus(self, c: httpx.Client) -> int:
        assert self.controller is not None
        if self.controller.poll() is not None:
            pytest.fail(f"controller exited {self.controller.returncode}: {self.log()[-2000:]}")
        try:
            fleet = c.get("/api/v1/fleet")
        except httpx.HTTPError:
            return 0
        return int(fleet.json()["gpus"]) if fleet.status_code == 200 else 0

    def stop(self) -> None:
        assert self.controller is not None
        assert stop(self.controller) == 0
        self.controller = None

    def close(self) -> None:
        if self.controller is not None:
            stop(self.controller)
        stop(self.agent)

    def log(self) -> str:
        return (self.workdir / "controller.log").read_text()

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log().splitlines():
            if f'"{name}"' in line:
                ev = json.loads(line)
                if ev.get("event") == name:
                    out.append(ev)
        return out
