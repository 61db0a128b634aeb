"""What a test needs from outside its own process, as pytest marks, and the guard that
proves the marks right.

Four marks name what a test needs (pyproject.toml registers them): `broker`, `postgres`,
`browser` and `process`. A test gets them from the fixtures it uses (`FIXTURE_NEEDS`,
applied in tests/conftest.py) or from a mark of its own (`pytestmark`, `@pytest.mark.x`).
`slow` is apart: it says how long a test takes, not what it needs. A test with none of the
five is `quick`.

The guard is an audit hook (PEP 578): while a test runs (its fixtures' setup and teardown
included), every process started, every connection to the well-known MQTT and PostgreSQL
ports and every throwaway database of support/pg.py is noted as a need, and a need the
test is not marked with fails the test at teardown. So `pytest -m quick` cannot start a
broker, a daemon or a browser, nor touch PostgreSQL, without saying so.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterable
from pathlib import PurePath
from typing import Any

import pytest

# What each mark means; pyproject.toml says the same in one line each.
NEEDS = ("broker", "postgres", "browser", "process")

# A fixture of this name, wherever it is defined, gives the test these marks.
FIXTURE_NEEDS: dict[str, tuple[str, ...]] = {
    "mosquitto": ("broker",),
    "broker": ("broker",),
    "pg_url": ("postgres",),
    "browser": ("browser",),
}

# support/pg.py raises this audit event whenever it reaches the server: psycopg connects
# through libpq, below Python's sockets, where the hook cannot see it.
POSTGRES_EVENT = "powerd.tests.postgres"

_BROKERS = {"mosquitto", "amqtt"}
_BROWSERS = {"chromium", "chromium-browser", "chromedriver"}
_PORTS = {1883: "broker", 5432: "postgres"}
_SPAWNS = {"os.exec", "os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system"}


def marks_from_fixtures(fixturenames: Iterable[str]) -> set[str]:
    return {need for name in fixturenames for need in FIXTURE_NEEDS.get(name, ())}


def _program(args: Any) -> str:
    """The basename of what a `subprocess.Popen` audit event runs (its first argument)."""
    return PurePath(os.fsdecode(args[0])).name


def need_of(event: str, args: Any) -> str | None:
    """What an audit event shows the running test needs, or None for an event of no note."""
    if event == "subprocess.Popen":
        program = _program(args)
        if program in _BROKERS:
            return "broker"
        return "browser" if program in _BROWSERS else "process"
    if event in _SPAWNS:
        return "process"
    if event == "socket.connect":
        address = args[1]
        if isinstance(address, tuple) and len(address) >= 2:
            return _PORTS.get(address[1])
        return None
    return "postgres" if event == POSTGRES_EVENT else None


class Guard:
    """Notes what the running test uses; `unmarked` says what it used without a mark."""

    def __init__(self) -> None:
        self.marked: set[str] | None = None  # None: no test is running
        self.used: dict[str, str] = {}  # need → the first thing that showed it

    def begin(self, item: pytest.Item) -> None:
        self.marked = {m.name for m in item.iter_markers()}
        self.used = {}

    def end(self) -> tuple[dict[str, str], set[str]]:
        """Stop watching; say what the test used without its mark (need → what showed
        it) and which of its marks it did not use."""
        marked, self.marked = self.marked or set(), None
        unmarked = {need: what for need, what in self.used.items() if need not in marked}
        return unmarked, (marked & set(NEEDS)) - set(self.used)

    def hook(self, event: str, args: Any) -> None:
        if self.marked is None:
            return
        need = need_of(event, args)
        if need is not None and need not in self.used:
            self.used[need] = f"{event} {_describe(event, args)}"

    def install(self) -> None:
        sys.addaudithook(self.hook)  # for the rest of the process: hooks cannot be removed


def _describe(event: str, args: Any) -> str:
    if event == "subprocess.Popen":
        return _program(args)
    if event == "socket.connect":
        return str(args[1])
    return ""


def complaint(nodeid: str, unmarked: dict[str, str]) -> str:
    lines = [f"{nodeid} used what it is not marked for (tests/support/needs.py):"]
    lines += [f"  {need}: {what} -> mark it @pytest.mark.{need}" for need, what in unmarked.items()]
    return "\n".join(lines)
