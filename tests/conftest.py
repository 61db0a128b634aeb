"""Shared fixtures: a private broker per test (Mosquitto, or either of two independent
brokers), a clock the test moves, and a waiter."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import structlog
from amqttbroker import Broker, LocalAmqtt, amqtt_command

from powerd.testing.mosquitto import MOSQUITTO, LocalMosquitto


class SteppedClock:
    """Virtual time for code that sleeps: `sleep` waits until the test `advance`s past it.

    Unlike ManualClock (whose sleep moves time itself), several loops can sleep at once and
    the test decides when each period passes, while real I/O (the broker) runs freely.
    """

    def __init__(self, start: float = 1000.0, wall_offset: float = 1.7e9) -> None:
        self.now = start
        self.wall_offset = wall_offset
        self._sleepers: list[tuple[float, asyncio.Future[None]]] = []

    def monotonic(self) -> float:
        return self.now

    def wall(self) -> float:
        return self.now + self.wall_offset

    async def sleep(self, seconds: float) -> None:
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._sleepers.append((self.now + seconds, fut))
        await fut

    def advance(self, seconds: float) -> None:
        self.now += seconds
        due = [(d, f) for d, f in self._sleepers if d <= self.now + 1e-9]
        self._sleepers = [(d, f) for d, f in self._sleepers if d > self.now + 1e-9]
        for _, fut in due:
            if not fut.done():
                fut.set_result(None)


Condition = Callable[[], bool]
Eventually = Callable[..., Awaitable[None]]


async def _eventually(cond: Condition, what: str = "") -> None:
    """Wait (in real time, generously: 10 s) until cond() holds; fail the test if it never does."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    pytest.fail(f"timed out waiting for {what or cond}")


@pytest.fixture
def eventually() -> Eventually:
    return _eventually


@pytest.fixture
def stepped_clock() -> SteppedClock:
    return SteppedClock()


@pytest.fixture
def mosquitto(tmp_path: Path) -> Iterator[LocalMosquitto]:
    """A Mosquitto of this test's own on a free loopback port; `kill()` and `start()` it."""
    if not Path(MOSQUITTO).exists():
        pytest.skip(f"{MOSQUITTO} is not installed")
    broker = LocalMosquitto(tmp_path / "mosquitto")
    broker.start()
    try:
        yield broker
    finally:
        broker.kill()


@pytest.fixture(params=["mosquitto", "amqtt"])
def broker(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Broker]:
    """A broker of this test's own, once Mosquitto and once amqtt (an independent
    implementation of MQTT 3.1.1); `kill()` and `start()` it. CI installs both: there a
    missing one fails the test instead of skipping it."""
    b: Broker
    if request.param == "mosquitto":
        missing, b = not Path(MOSQUITTO).exists(), LocalMosquitto(tmp_path / "mosquitto")
    else:
        missing, b = not amqtt_command().exists(), LocalAmqtt(tmp_path / "amqtt")
    if missing:
        reason = f"{request.param} is not installed (pip install -c constraints.txt -e '.[test]')"
        if os.environ.get("CI"):
            pytest.fail(reason)
        pytest.skip(reason)
    b.start()
    try:
        yield b
    finally:
        b.kill()


@pytest.fixture(autouse=True)
def _structlog_as_it_was() -> Iterator[None]:
    """A test that runs a command in-process (`powerd ... --log-level warning`) configures
    structlog for the whole process; later tests that capture info events would see none."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
