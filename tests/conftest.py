"""Shared fixtures: a private broker per test (Mosquitto, or either of two independent
brokers), a throwaway PostgreSQL database, the in-process live API, a standby pair of
controller processes, a clock the test moves, and a waiter; and the marks that say what a
test needs, given by the fixtures it uses and proved by a guard (tests/support/needs.py)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import structlog
import yaml
from support.amqttbroker import Broker, LocalAmqtt, amqtt_command
from support.clock import SteppedClock
from support.e2e import Procs, site_policy
from support.ha import ArrivalMonitor, Pair
from support.live_api import LiveApi
from support.needs import NEEDS, Guard, complaint, marks_from_fixtures
from support.pg import pg_database

from powerd.bmc.backend import IoLoop
from powerd.policy import load_policy
from powerd.testing.mosquitto import MOSQUITTO, LocalMosquitto
from powerd.testing.redfish import TestCa

GUARD = Guard()
UNUSED = pytest.StashKey[dict[str, set[str]]]()  # nodeid → needs marked but not used
PASSED = pytest.StashKey[bool]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--unused-needs",
        action="store_true",
        help="list the passed tests marked with a need (broker, postgres, ...) they did not use",
    )


def pytest_configure(config: pytest.Config) -> None:
    # matplotlib builds its font cache on first use by running `fc-list`: on a fresh machine
    # that would be the first plotting test's process, a need it does not have. Built here,
    # before any test runs, it is read from disk after.
    import matplotlib.font_manager  # noqa: F401

    GUARD.install()
    config.stash[UNUSED] = {}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by the marks given here
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test by the fixtures it uses; a test that needs nothing and is not slow
    is `quick`."""
    for item in items:
        for need in sorted(marks_from_fixtures(item.fixturenames)):
            item.add_marker(need)
        if not any(item.get_closest_marker(name) for name in (*NEEDS, "slow")):
            item.add_marker("quick")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    GUARD.begin(item)  # first of the setup hooks' work: fixtures start after it


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> pytest.TestReport:
    """At teardown, fail a test that used what it is not marked for."""
    report: pytest.TestReport = yield
    if call.when == "call":
        item.stash[PASSED] = report.passed
    if call.when != "teardown":
        return report
    unmarked, unused = GUARD.end()
    if unmarked:
        report.outcome = "failed"
        report.longrepr = complaint(item.nodeid, unmarked)
    elif unused and item.stash.get(PASSED, False):
        item.config.stash[UNUSED][item.nodeid] = unused
    return report


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    if not config.getoption("unused_needs"):
        return
    unused = config.stash[UNUSED]
    terminalreporter.section(f"marked with needs they did not use: {len(unused)}")
    for nodeid, needs in sorted(unused.items()):
        terminalreporter.write_line(f"{nodeid}: {', '.join(sorted(needs))}")


Condition = Callable[[], bool]
Eventually = Callable[..., Awaitable[None]]


async def _eventually(cond: Condition, what: str = "") -> None:
    """Wait (in real time, generously: 10 s) until cond() holds; fail the test if it never does."""
    for _ in range(2000):
        if cond():
            return
        await asyncio.sleep(0.005)
    pytest.fail(f"timed out waiting for {what or cond}")


@pytest.fixture(scope="module")
def ca(tmp_path_factory: pytest.TempPathFactory) -> TestCa:
    """A CA and a localhost certificate for the Redfish emulator over HTTPS."""
    return TestCa.make(tmp_path_factory.mktemp("ca"))


@pytest.fixture
def io() -> Iterator[IoLoop]:
    """The loop a bmc-agent's Redfish backends run their requests on."""
    loop = IoLoop()
    yield loop
    loop.close()


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


@pytest.fixture
def pg_url() -> Iterator[str]:
    """The URL of a new, empty PostgreSQL database of this test's own (support/pg.py)."""
    with pg_database() as url:
        yield url


@pytest.fixture(params=["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """The store's URL, once a SQLite file and once a database of `pg_url`."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'powerd.db'}"
    url: str = request.getfixturevalue("pg_url")
    return url


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveApi]:
    """The in-process controller and its API on the default test policy (support/live_api.py);
    modules that need another policy or a state file define their own `live`."""
    api = LiveApi(tmp_path).start()
    try:
        yield api
    finally:
        api.close()


@pytest.fixture
async def pair(mosquitto: LocalMosquitto, pg_url: str, tmp_path: Path) -> AsyncIterator[Pair]:
    """Two controllers on one fresh database, agents and a monitor (support/ha.py)."""
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(site_policy()))
    monitor = ArrivalMonitor(mosquitto.url, load_policy(policy_file))
    await monitor.start()
    procs = Procs(tmp_path, mosquitto.url)
    p = Pair(procs, monitor, policy_file, pg_url, tmp_path)
    try:
        yield p
    finally:
        procs.close()
        p.close()
        await monitor.stop()


@pytest.fixture(autouse=True)
def _structlog_as_it_was() -> Iterator[None]:
    """A test that runs a command in-process (`powerd ... --log-level warning`) configures
    structlog for the whole process; later tests that capture info events would see none."""
    saved = structlog.get_config()
    yield
    structlog.configure(**saved)
