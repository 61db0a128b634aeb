"""The BMC agent's parts against the Redfish emulator over HTTPS (in this process): the
client (sessions, basic auth, TLS trust, retries), the backend (discovery, samples, sets
read back), the settings' errors, and the node agent running on a BMC backend (commands
applied through the BMC, acks of what it enforces, failsafe on a lost lease)."""

from __future__ import annotations

import asyncio
import math
import socket
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
from support.bmc import scripted_client

from powerd.agent.agent import Agent
from powerd.backends.base import BackendError, NoPermission
from powerd.backends.mock import Workload
from powerd.bmc.agent import BmcAgent, NewestCommandOnly, NodeRunner
from powerd.bmc.backend import IoLoop, RedfishBackend
from powerd.bmc.redfish import BmcTrust, RedfishClient
from powerd.bmc.settings import BmcAgentSettings
from powerd.clock import SystemClock
from powerd.sdnotify import Notifier
from powerd.settings import SettingsError
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.redfish import (
    EmulatorServer,
    Faults,
    Json,
    RedfishService,
    Response,
    TestCa,
)
from powerd.transport.base import Message
from powerd.transport.memory import MemoryBroker
from powerd.wire import (
    MAX_GPUS_PER_NODE,
    AckError,
    CapAck,
    CapCommand,
    GpuTelemetry,
    NodeState,
    NodeTelemetry,
    Topics,
    decode,
    encode,
)

NODE = "bmc-1"
TOPICS = Topics()


# Every test on `hgx` or `small` runs on both layouts: limits in the Processors'
# EnvironmentMetrics, and limits as Chassis Controls (found when the former have none).
LAYOUTS = ["processors", "controls"]


@pytest.fixture(params=LAYOUTS)
def hgx(request: pytest.FixtureRequest) -> RedfishService:
    return RedfishService.hgx(
        8, Workload.steady(650.0), password="pw", node=NODE, limits=request.param
    )


@pytest.fixture
def server(hgx: RedfishService, ca: TestCa) -> Iterator[EmulatorServer]:
    with EmulatorServer([hgx], ca) as s:
        yield s


def backend_for(
    server: EmulatorServer,
    io: IoLoop,
    trust: BmcTrust,
    *,
    auth: str = "session",
    timeout_s: float = 2.0,
    retries: int = 1,
    max_age_s: float = 0.2,
) -> RedfishBackend:
    client = RedfishClient(
        server.url(),
        "admin",
        "pw",
        trust=trust,
        auth="basic" if auth == "basic" else "session",
        timeout_s=timeout_s,
        retries=retries,
    )
    return RedfishBackend(NODE, client, io, max_age_s=max_age_s)


def truth(hgx: RedfishService) -> list[float]:
    """The limits the emulated GPUs really enforce."""
    assert hgx.gpus is not None
    return [hgx.gpus.enforced_limit_w(g.uuid) for g in hgx.gpus.gpus()]


def test_discovery_reads_and_sets_through_the_bmc(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa
) -> None:
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file))
    try:
        gpus = backend.discover()
        assert [g.uuid for g in gpus] == [f"GPU-{hgx.processor_uuid(i)}" for i in range(8)]
        assert {(g.min_cap_w, g.max_cap_w, g.default_cap_w) for g in gpus} == {(200, 700, 700)}
        before = hgx.requests.get("GET", 0)
        readings = [backend.read(g.uuid) for g in gpus]
        # One sample serves the whole node: 8 GETs, one per GPU, not one per read and field.
        assert hgx.requests["GET"] - before == 8
        assert all(r.cap_w == 700.0 and r.power_w > 600 for r in readings)
        assert backend.set_power_limit_w(gpus[2].uuid, 300.0) == 300.0
        assert truth(hgx)[2] == 300.0
        assert backend.enforced_limit_w(gpus[2].uuid) == 300.0
        with pytest.raises(BackendError, match="outside"):
            backend.set_power_limit_w(gpus[2].uuid, 900.0)
        assert len(hgx.sessions) == 1  # one session for all of it
    finally:
        backend.close()
    assert hgx.sessions == {}  # logged out


def test_controls_are_found_where_processors_have_no_limits_and_as_configured(
    server: EmulatorServer, hgx: RedfishService, io: IoLoop, ca: TestCa
) -> None:
    """ "auto" takes the Processors' limits where they are, else the Chassis Controls; a node
    configured for one path finds no GPU on a BMC that has only the other. Either way a GPU
    is named by its Processor's UUID, and is read and set where its limit is."""
    trust = BmcTrust(ca_file=ca.ca_file)
    other = "processors" if hgx.limits == "controls" else "controls"
    for limits, expected in (("auto", 8), (hgx.limits, 8), (other, 0)):
        backend = backend_for(server, io, trust)
        backend.limits = limits  # type: ignore[assignment]
        try:
            gpus = backend.discover()
            assert len(gpus) == expected, limits
            if not expected:
                continue
            assert [g.uuid for g in gpus] == [f"GPU-{hgx.processor_uuid(i)}" for i in range(8)]
            uris = {g.uri for g in backend.found.values()}
            where = "/Controls/" if hgx.limits == "controls" else "/EnvironmentMetrics"
            assert all(where in u for u in uris)
            before = dict(hgx.requests)
            assert backend.set_power_limit_w(gpus[5].uuid, 420.0) == 420.0
            assert truth(hgx)[5] == 420.0
            # One PATCH, read back from the resource its answer carries: no GET.
            assert hgx.requests["PATCH"] - before.get("PATCH", 0) == 1
            assert hgx.requests["GET"] == before["GET"]
            other_gpu = backend.read(gpus[4].uuid)  # a sample of the node, where it is read
            assert other_gpu.cap_w == 700.0 and other_gpu.power_w == pytest.approx(650, rel=0.02)
        finally:
            backend.close()


class _NoContent(RedfishService):
    """A BMC answering a PATCH with 204 No Content (Redfish allows it)."""

    def _patch(self, path: str, body: bytes) -> Response:
        r = super()._patch(path, body)
        return Response(204) if r.status == 200 else r


def test_a_patch_answered_without_the_resource_is_read_back_with_a_get(
    io: IoLoop, ca: TestCa
) -> None:
    gpus = RedfishService.hgx(2, Workload.steady(650.0), node=NODE).gpus
    hgx = _NoContent(gpus=gpus, password="pw")
    with EmulatorServer([hgx], ca) as server:
        backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file))
        try:
            found = backend.discover()
            before = hgx.requests["GET"]
            assert backend.set_power_limits_w([(g.uuid, 333.0) for g in found]) == [333.0] * 2
            assert hgx.requests["GET"] - before == 2 and truth(hgx) == [333.0] * 2
            hgx.faults.lie_limit_w = 555.0  # the read-back is what the BMC says
            assert backend.set_power_limit_w(found[0].uuid, 300.0) == 555.0
        finally:
            backend.close()


class _MixedControls(RedfishService):
    """A BMC whose Controls include a chassis's power limit (no GPU's), a GPU's without its
    Sensor excerpt, and a GPU's that links no Processor (named by its chassis)."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        if i == 0:
            del doc["RelatedItem"]
            doc["PhysicalContext"] = "Chassis"
        elif i == 1:
            del doc["Sensor"]
        elif i == 2:
            del doc["RelatedItem"]
        return doc


def test_only_a_gpus_power_controls_with_a_reading_are_steered(io: IoLoop, ca: TestCa) -> None:
    gpus = RedfishService.hgx(4, Workload.steady(650.0), node=NODE).gpus
    hgx = _MixedControls(gpus=gpus, password="pw", limits="controls")
    with EmulatorServer([hgx], ca) as server:
        backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file))
        try:
            found = backend.discover()
        finally:
            backend.close()
    assert [g.uuid for g in found] == [
        f"{NODE}.HGX_GPU_SXM_3.TotalGPU_Power_0",
        f"GPU-{hgx.processor_uuid(3)}",
    ]


def test_a_forgotten_session_logs_in_again(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa
) -> None:
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file), max_age_s=0.0)
    try:
        gpu = backend.discover()[0]
        hgx.drop_sessions()  # the BMC rebooted
        assert backend.read(gpu.uuid).cap_w == 700.0
        assert backend.client.logins == 2 and len(hgx.sessions) == 1
    finally:
        backend.close()


def test_basic_auth_makes_no_session(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa
) -> None:
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file), auth="basic")
    try:
        gpu = backend.discover()[0]
        assert backend.set_power_limit_w(gpu.uuid, 450.0) == 450.0
        assert hgx.sessions == {} and hgx.requests.get("POST", 0) == 0
    finally:
        backend.close()


def test_a_pinned_certificate_and_a_wrong_one(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa, tmp_path: Path
) -> None:
    backend = backend_for(server, io, BmcTrust(pinned_cert_file=ca.cert_file))
    try:
        assert len(backend.discover()) == 8
    finally:
        backend.close()
    hgx.requests.clear()
    other = TestCa.make(tmp_path / "other")
    for trust in (BmcTrust(pinned_cert_file=other.cert_file), BmcTrust(ca_file=other.ca_file)):
        stranger = backend_for(server, io, trust)
        try:
            with pytest.raises(BackendError, match="CERTIFICATE_VERIFY_FAILED"):
                stranger.discover()
        finally:
            stranger.close()
    assert hgx.requests == {}  # refused in the handshake: no request, no password sent


def test_a_silent_bmc_fails_a_sample_once_per_period(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa
) -> None:
    backend = backend_for(
        server, io, BmcTrust(ca_file=ca.ca_file), timeout_s=0.3, retries=1, max_age_s=60.0
    )
    try:
        gpus = backend.discover()
        backend.read(gpus[0].uuid)
        backend._sample = None  # the next period
        hgx.faults.hang = True
        sent = backend.client.requests
        for g in gpus:
            with pytest.raises(BackendError, match="no answer"):
                backend.read(g.uuid)
        # One sample of 8 GETs, each tried twice; the other reads of the period reuse it.
        assert backend.client.requests - sent == 16
        hgx.faults.hang = False
        hgx.faults.status = 503
        backend._sample = None
        with pytest.raises(BackendError, match="HTTP 503"):
            backend.read(gpus[0].uuid)
        hgx.faults.status = None
        hgx.faults.patch_status = 403
        with pytest.raises(NoPermission):
            backend.set_power_limit_w(gpus[0].uuid, 300.0)
        assert truth(hgx)[0] == 700.0
    finally:
        hgx.faults = Faults()
        backend.close()


# -- settings ------------------------------------------------------------------------------


def settings_file(tmp_path: Path, text: str) -> Path:
    (tmp_path / "pw").write_text("secret\n")
    path = tmp_path / "bmc.toml"
    path.write_text(text)
    return path


NODE_TOML = (
    'node_id = "{id}"\nurl = "https://10.0.0.1"\nusername = "admin"\npassword_file = "{pw}"\n'
)


@pytest.mark.parametrize(
    ("extra", "node_extra", "where", "what"),
    [
        ("", 'ca_file = "/a"\npinned_cert_file = "/b"\n', "nodes[0]", "not both"),
        ("period_s = 2.0\n", "timeout_s = 1.5\n", "<top>", "shorter than period_s"),
        ("", 'url = "http://10.0.0.1"\n', "nodes[0].url", "pattern"),
        ("", 'url = "https://[::1"\n', "nodes[0].url", "https://host[:port]"),
        ("", 'url = "https://bmc:99999"\n', "nodes[0].url", "https://host[:port]"),
        ("", 'url = "https://admin:pw@bmc"\n', "nodes[0].url", "https://host[:port]"),
        ("", 'url = "https://bmc?x=1"\n', "nodes[0].url", "https://host[:port]"),
        ("", 'url = "https://:443"\n', "nodes[0].url", "https://host[:port]"),
        ("", "concurrency = 0\n", "nodes[0].concurrency", "greater than or equal to 1"),
        ("", "password = 'x'\n", "nodes[0].password", "unknown key"),
        ("", 'limits = "chassis"\n', "nodes[0].limits", "'processors' or 'controls'"),
        ('limits = "sensors"\n', "", "limits", "'processors' or 'controls'"),
    ],
)
def test_settings_errors_name_the_field(
    tmp_path: Path, extra: str, node_extra: str, where: str, what: str
) -> None:
    node = NODE_TOML.format(id="n1", pw=tmp_path / "pw")
    if "url" in node_extra:
        node = node.replace('url = "https://10.0.0.1"\n', "")
    text = extra + "[[nodes]]\n" + node + node_extra
    with pytest.raises(SettingsError) as err:
        BmcAgentSettings.load(settings_file(tmp_path, text))
    assert f"at {where}" in str(err.value) and what in str(err.value)


def test_each_node_looks_for_limits_where_it_is_told(tmp_path: Path, io: IoLoop) -> None:
    pw = tmp_path / "pw"
    text = 'limits = "processors"\n' + "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=pw)
    text += "[[nodes]]\n" + NODE_TOML.format(id="n2", pw=pw) + 'limits = "controls"\n'
    settings = BmcAgentSettings.load(settings_file(tmp_path, text))
    runners = [NodeRunner(settings, i, io) for i in range(2)]
    assert [r.backend.limits for r in runners] == ["processors", "controls"]
    default = BmcAgentSettings.load(
        settings_file(tmp_path, "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=pw))
    )
    assert NodeRunner(default, 0, io).backend.limits == "auto"


def test_discovery_waits_for_a_slot(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa, tmp_path: Path
) -> None:
    """Nodes walk their BMCs a few at a time: a walk waits while every slot is taken."""
    pw = tmp_path / "pw"
    pw.write_text("pw\n")
    settings = BmcAgentSettings.model_validate(
        {
            "nodes": [
                {
                    "node_id": NODE,
                    "url": server.url(),
                    "username": "admin",
                    "password_file": pw,
                    "ca_file": ca.ca_file,
                }
            ]
        }
    )
    slots = threading.BoundedSemaphore(1)
    runner = NodeRunner(settings, 0, io, slots)
    found: list[int] = []
    slots.acquire()  # another node is walking its BMC
    walker = threading.Thread(target=lambda: found.append(len(runner._discover_in_turn())))
    walker.start()
    try:
        walker.join(0.5)
        assert walker.is_alive() and hgx.requests == {}
    finally:
        slots.release()
    walker.join(10)
    runner.backend.close()
    assert found == [8]


def test_settings_read_passwords_from_files(tmp_path: Path) -> None:
    pw = tmp_path / "pw"
    text = "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=pw)
    text += "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=pw)
    with pytest.raises(SettingsError, match="'n1' is listed twice"):
        BmcAgentSettings.load(settings_file(tmp_path, text))
    text = "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=pw)
    text += "[[nodes]]\n" + NODE_TOML.format(id="n2", pw=tmp_path / "missing")
    settings = BmcAgentSettings.load(settings_file(tmp_path, text))
    assert settings.bmc_password(0) == "secret"
    with pytest.raises(SettingsError, match=r"at nodes\[1\].password_file: cannot read"):
        settings.check_files()
    agent = settings.agent_settings(settings.nodes[1])
    assert agent.node_id == "n2" and agent.period_s == settings.period_s == 2.0


# -- the node agent on a BMC ---------------------------------------------------------------


@pytest.fixture(params=LAYOUTS)
def small(
    ca: TestCa, request: pytest.FixtureRequest
) -> Iterator[tuple[RedfishService, EmulatorServer]]:
    """A BMC of two GPUs (a node agent sets its GPUs one by one)."""
    hgx = RedfishService.hgx(
        2, Workload.steady(650.0), password="pw", node=NODE, limits=request.param
    )
    with EmulatorServer([hgx], ca) as s:
        yield hgx, s


async def test_the_node_agent_steers_through_the_bmc(
    small: tuple[RedfishService, EmulatorServer], io: IoLoop, ca: TestCa, tmp_path: Path
) -> None:
    """Commands are applied through the BMC and acked with what it enforces after reading
    back; a lying BMC's read-back shows in the ack; a lost lease lowers every GPU to its
    failsafe cap through the BMC; stopping leaves the failsafe caps, which the BMC keeps."""
    hgx, server = small
    broker = MemoryBroker()
    settings = BmcAgentSettings.model_validate(
        {
            "nodes": [
                {
                    "node_id": NODE,
                    "url": server.url(),
                    "username": "admin",
                    "password_file": tmp_path / "pw",
                    "ca_file": ca.ca_file,
                }
            ],
            "period_s": 0.5,
            "timeout_s": 0.2,
        }
    )
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file), max_age_s=0.25)
    backend.discover()
    transport = NewestCommandOnly(broker.client(NODE))
    agent = Agent(settings.agent_settings(settings.nodes[0]), backend, transport, SystemClock())
    controller = broker.client("controller")
    await controller.connect()
    for kind in ("ack", "telemetry"):
        await controller.subscribe(TOPICS.all_nodes(kind))
    received: asyncio.Queue[Message] = asyncio.Queue()

    async def listen() -> None:
        async for m in controller.messages():
            received.put_nowait(m)

    async def next_of(kind: type[CapAck] | type[NodeTelemetry]) -> CapAck | NodeTelemetry:
        while True:
            m = await asyncio.wait_for(received.get(), 10)
            if m.topic.endswith("/ack" if kind is CapAck else "/telemetry"):
                return decode(m.payload, kind)

    uuids = list(agent.gpus)
    stop = asyncio.Event()
    listener = asyncio.create_task(listen())
    running = asyncio.create_task(agent.run(stop))
    try:
        # Unsteered at start: every GPU at the failsafe cap (no failsafe_w: the minimum).
        telemetry = await next_of(NodeTelemetry)
        assert isinstance(telemetry, NodeTelemetry) and telemetry.state == "starting"
        assert truth(hgx) == [200.0] * 2
        caps = {u: 300.0 + 10 * i for i, u in enumerate(uuids)}
        command = CapCommand(
            node_id=NODE, tick=1, lease_s=1.5, caps=caps, failsafe_w=dict.fromkeys(uuids, 250.0)
        )
        await controller.publish(TOPICS.caps(NODE), encode(command), qos=1)
        ack = await next_of(CapAck)
        assert isinstance(ack, CapAck) and ack.tick == 1
        assert {u: a.enforced_w for u, a in ack.gpus.items()} == caps
        assert truth(hgx) == list(caps.values())  # what the BMC enforces
        # A lying BMC: the ack reports the limit it reads back, flagged.
        hgx.faults.lie_limit_w = 650.0
        command = command.model_copy(update={"tick": 2})
        await controller.publish(TOPICS.caps(NODE), encode(command), qos=1)
        ack = await next_of(CapAck)
        assert isinstance(ack, CapAck)
        assert {a.error for a in ack.gpus.values()} == {AckError.OVERRIDDEN}
        assert {a.enforced_w for a in ack.gpus.values()} == {650.0}
        hgx.faults.lie_limit_w = None
        # No newer command for the lease: failsafe through the BMC, never a raise.
        for _ in range(100):
            if agent.state is NodeState.FAILSAFE and truth(hgx) == [250.0] * 2:
                break
            await asyncio.sleep(0.1)
        assert agent.state is NodeState.FAILSAFE
        assert truth(hgx) == [250.0] * 2
    finally:
        stop.set()
        await asyncio.wait_for(running, 20)
        listener.cancel()
        backend.close()
    assert truth(hgx) == [250.0] * 2  # the BMC keeps the failsafe caps after the agent


async def test_only_the_newest_command_waits_for_a_busy_node() -> None:
    """Commands that arrived while the node was busy setting its BMC: the newest only."""
    broker = MemoryBroker()
    node = NewestCommandOnly(broker.client(NODE))
    await node.connect()
    await node.subscribe(TOPICS.caps(NODE))
    await node.subscribe(TOPICS.caps("other"))
    controller = broker.client("controller")
    await controller.connect()
    for tick in (1, 2, 3):
        await controller.publish(TOPICS.caps(NODE), str(tick).encode(), qos=1)
    await controller.publish(TOPICS.caps("other"), b"x", qos=1)
    messages = node.messages()
    first = await asyncio.wait_for(anext(messages), 5)
    second = await asyncio.wait_for(anext(messages), 5)
    assert (first.topic, first.payload) == (TOPICS.caps(NODE), b"3")
    assert (second.topic, second.payload) == (TOPICS.caps("other"), b"x")
    assert node.superseded == 2
    await controller.publish(TOPICS.caps(NODE), b"4", qos=1)
    assert (await asyncio.wait_for(anext(messages), 5)).payload == b"4"
    await node.disconnect()


def test_a_phase_of_sets_goes_to_the_bmc_at_once(
    hgx: RedfishService, server: EmulatorServer, io: IoLoop, ca: TestCa
) -> None:
    """`set_power_limits_w`: every GPU's PATCH and read-back in flight together, each result
    its own (a bad target fails alone)."""
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file), timeout_s=0.3, retries=0)
    try:
        gpus = backend.discover()
        targets = [(g.uuid, 300.0 + 10 * i) for i, g in enumerate(gpus)]
        targets[3] = (gpus[3].uuid, 900.0)  # above AllowableMax
        results = backend.set_power_limits_w(targets)
        assert isinstance(results[3], BackendError) and "outside" in str(results[3])
        expected = [300.0 + 10 * i for i in range(8)]
        expected[3] = 700.0  # unchanged
        assert [r for k, r in enumerate(results) if k != 3] == [
            w for k, w in enumerate(expected) if k != 3
        ]
        assert truth(hgx) == expected
        hgx.faults.hang = True
        failed = backend.set_power_limits_w([(g.uuid, 250.0) for g in gpus])
        assert all(isinstance(r, BackendError) and "no answer" in str(r) for r in failed)
    finally:
        hgx.faults = Faults()
        backend.close()


def test_the_command_refuses_bad_settings_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from powerd.cli import main

    text = "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=tmp_path / "missing")
    assert main(["bmc-agent", f"--config={settings_file(tmp_path, text)}"]) == 2
    err = capsys.readouterr().err
    assert "at nodes[0].password_file: cannot read" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("limit_w", "draw_factor"),
    [
        (math.nan, 1.0),
        (math.inf, 1.0),
        (1e9, 1.0),
        (-50.0, 1.0),
        (None, math.nan),
        (None, -1.0),
        (None, 1e9),
    ],
)
def test_a_bmc_reporting_impossible_values_fails_the_read_and_the_agent_goes_on(
    small: tuple[RedfishService, EmulatorServer],
    io: IoLoop,
    ca: TestCa,
    tmp_path: Path,
    limit_w: float | None,
    draw_factor: float,
) -> None:
    """A limit or a draw that is not a number, or is out of the wire's bounds, is no reading:
    the read fails (as a BMC that does not answer), and the node agent's sample reports the
    GPU's error instead of crashing on the invalid value, its cap the last one known."""
    hgx, server = small
    backend = backend_for(server, io, BmcTrust(ca_file=ca.ca_file), max_age_s=0.0)
    try:
        gpus = backend.discover()
        settings = BmcAgentSettings.model_validate(
            {
                "nodes": [
                    {
                        "node_id": NODE,
                        "url": server.url(),
                        "username": "admin",
                        "password_file": tmp_path / "pw",
                        "ca_file": ca.ca_file,
                    }
                ],
            }
        )
        agent = Agent(
            settings.agent_settings(settings.nodes[0]),
            backend,
            NewestCommandOnly(MemoryBroker().client(NODE)),
            SystemClock(),
        )
        assert [s.error for s in agent._sample()] == [None, None]
        hgx.faults.lie_limit_w = limit_w
        hgx.faults.lie_draw_factor = draw_factor
        with pytest.raises(BackendError, match="unusable answer"):
            backend.read(gpus[0].uuid)
        samples = agent._sample()  # no exception: each GPU's error instead
        assert all(s.error is not None for s in samples)
        assert [s.cap_w for s in samples] == [agent.caps_w[g.uuid] for g in gpus]
        assert all(200.0 <= s.cap_w <= 700.0 for s in samples)
    finally:
        backend.close()


class _Tree:
    """A BMC's documents by path, for a client that only GETs (discovery)."""

    def __init__(self, docs: dict[str, dict[str, object]]) -> None:
        self.docs = docs
        self.base_url = "https://bmc.example"
        self.timeout_s = 1.0
        self.retries = 0

    async def get(self, path: str) -> dict[str, object]:
        return self.docs[path]


def test_discovery_keeps_only_what_the_wire_accepts(io: IoLoop) -> None:
    """A BMC's names, UUIDs, limits and GPU count are untrusted: a Model longer than the
    wire's name, a UUID with characters (or a length) the wire refuses, an AllowableMax
    beyond MAX_SANE_WATTS or infinite, more GPUs than a node may report: each GPU found can
    be reported on the wire (else the node's every telemetry message would fail)."""
    procs = [f"/S/1/P/{i}" for i in range(70)]
    docs: dict[str, dict[str, object]] = {
        "/redfish/v1": {"Systems": {"@odata.id": "/S"}},
        "/S": {"Members": [{"@odata.id": "/S/1"}]},
        "/S/1": {"Id": "1", "Processors": {"@odata.id": "/S/1/P"}},
        "/S/1/P": {"Members": [{"@odata.id": p} for p in procs]},
    }
    for i, p in enumerate(procs):
        docs[p] = {
            "Id": str(i),
            "ProcessorType": "GPU",
            "Model": "M" * 300,
            "UUID": f"weird uuid/{i} ✓" + "x" * 200 if i % 2 else f"{i:08d}-aaaa",
            "EnvironmentMetrics": {"@odata.id": f"{p}/E"},
        }
        hi = [700, 1e9, math.inf, 1e300][i % 4]
        docs[f"{p}/E"] = {
            "PowerLimitWatts": {"SetPoint": 700, "AllowableMin": 200, "AllowableMax": hi}
        }
    backend = RedfishBackend(NODE, _Tree(docs), io, max_age_s=1.0)  # type: ignore[arg-type]
    gpus = backend.discover()
    assert 0 < len(gpus) <= MAX_GPUS_PER_NODE
    assert len({g.uuid for g in gpus}) == len(gpus)
    for g in gpus:  # each one as a failed GPU's telemetry reports it
        GpuTelemetry(
            uuid=g.uuid,
            index=g.index,
            name=g.name,
            power_w=0.0,
            energy_j=0.0,
            cap_w=g.max_cap_w,
            min_cap_w=g.min_cap_w,
            max_cap_w=g.max_cap_w,
            default_cap_w=g.default_cap_w,
            temp_c=0.0,
            util_pct=0.0,
            sm_clock_mhz=0.0,
        )


def test_an_enormous_answer_is_refused_before_it_is_read_whole() -> None:
    """A BMC's answer is read up to MAX_BODY_BYTES: a larger one (a broken or hostile BMC
    streaming without end) fails the request instead of filling the agent's memory."""
    from powerd.bmc.redfish import MAX_BODY_BYTES, RedfishError

    sent = [0]

    async def chunks() -> AsyncIterator[bytes]:
        yield b'{"Name": "'
        while sent[0] < 50 * MAX_BODY_BYTES:
            sent[0] += 1 << 16
            yield b"x" * (1 << 16)
        yield b'"}'

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chunks())

    async def go() -> None:
        client = scripted_client(handler)
        with pytest.raises(RedfishError, match="larger than"):
            await client.get("/redfish/v1")
        await client.close()

    asyncio.run(go())
    assert sent[0] <= 2 * MAX_BODY_BYTES  # stopped reading soon after the bound


def test_a_redirect_is_an_error_and_is_not_followed() -> None:
    """A BMC answering 3xx (to another host, say) is not followed, and its body is no
    document: a GET fails, and a PATCH is not taken as applied."""
    from powerd.bmc.redfish import RedfishError

    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(
            302,
            headers={"Location": "https://elsewhere.example/redfish/v1"},
            json={"PowerLimitWatts": {"SetPoint": 700}},
        )

    async def go() -> None:
        client = scripted_client(handler)
        with pytest.raises(RedfishError, match="HTTP 302"):
            await client.get("/redfish/v1")
        with pytest.raises(RedfishError, match="HTTP 302"):
            await client.patch("/x", {"PowerLimitWatts": {"SetPoint": 300}})
        await client.close()

    asyncio.run(go())
    assert set(hosts) == {"bmc.example"}


def test_a_deeply_nested_answer_is_not_json_to_us() -> None:
    """JSON nested deeper than the parser recurses (a few hundred kB) is an answer that is
    not JSON (RedfishError), not a RecursionError out of the backend's error mapping."""
    from powerd.bmc.redfish import RedfishError

    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=b"[" * 200_000 + b"]" * 200_000)

    async def go() -> None:
        client = scripted_client(handler)
        with pytest.raises(RedfishError, match="not JSON"):
            await client.get("/redfish/v1")
        await client.close()

    asyncio.run(go())


@pytest.mark.parametrize(
    "link", ["https://elsewhere.example/redfish/v1", "//elsewhere.example/redfish/v1"]
)
def test_a_link_to_another_host_is_not_followed_with_our_credentials(link: str) -> None:
    """A BMC's documents name the next ones (`@odata.id`); one naming another host (BMCs
    often share one password) is refused before any request: the credentials go to the
    configured BMC only."""
    from powerd.bmc.redfish import RedfishError

    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(200, json={})

    async def go() -> None:
        client = scripted_client(handler)
        with pytest.raises(RedfishError, match="not a path on the BMC"):
            await client.get(link)
        assert await client.get("/redfish/v1") == {}
        await client.close()

    asyncio.run(go())
    assert hosts == ["bmc.example"]


@pytest.mark.parametrize(
    "location", ["https://elsewhere.example/s/1", "//elsewhere.example/s/1", "/s/1"]
)
def test_the_log_out_goes_to_the_bmc_whatever_location_the_log_in_named(location: str) -> None:
    """A session's Location names where to log out, with the session's token: only its
    path is taken, so the token goes to the configured BMC alone."""
    seen: list[tuple[str, str, str]] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append((request.method, request.url.host, request.url.path))
        if request.method == "POST":
            return httpx.Response(201, headers={"X-Auth-Token": "t", "Location": location})
        return httpx.Response(200, json={})

    async def go() -> None:
        client = RedfishClient(
            "https://bmc.example",
            "admin",
            "pw",
            trust=BmcTrust(),
            transport=httpx.MockTransport(handler),
        )
        await client.login()
        await client.close()

    asyncio.run(go())
    assert {host for _, host, _ in seen} == {"bmc.example"}
    assert seen[-1][0] == "DELETE" and seen[-1][2].endswith("/s/1")


def test_a_password_file_that_is_not_a_password_is_refused_in_one_line(tmp_path: Path) -> None:
    """A password file is read up to 4 KiB: a wrong path (a log, /dev/zero) is a one-line
    settings error, not the whole file (or endless zeros) read into memory as a password."""
    big = tmp_path / "big"
    big.write_bytes(b"x" * 5000)
    text = "[[nodes]]\n" + NODE_TOML.format(id="n1", pw=big)
    text += "[[nodes]]\n" + NODE_TOML.format(id="n2", pw="/dev/zero")
    settings = BmcAgentSettings.load(settings_file(tmp_path, text))
    for i in (0, 1):
        with pytest.raises(SettingsError, match=rf"at nodes\[{i}\].password_file: .*4096 bytes"):
            settings.bmc_password(i)


# -- the process: metrics and systemd ------------------------------------------------------


async def test_the_bmc_agent_serves_its_metrics_and_tells_systemd(
    mosquitto: LocalMosquitto, ca: TestCa, tmp_path: Path
) -> None:
    """Per BMC: requests, failures, a latency histogram, GPUs found, whether it answers;
    READY and watchdog pings while the shared Redfish loop answers, STOPPING at the end."""
    hgx = RedfishService.hgx(2, Workload.steady(650.0), password="pw", node=NODE)
    (tmp_path / "pw").write_text("pw\n")
    notify = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(notify))
    sock.setblocking(False)
    with EmulatorServer([hgx], ca) as server:
        settings = BmcAgentSettings.model_validate(
            {
                "broker": mosquitto.url,
                "nodes": [
                    {
                        "node_id": NODE,
                        "url": server.url(),
                        "username": "admin",
                        "password_file": tmp_path / "pw",
                        "ca_file": ca.ca_file,
                    }
                ],
                "period_s": 0.5,
                "timeout_s": 0.2,
                "retries": 0,
                "metrics_port": 0,
            }
        )
        agent = BmcAgent(settings)
        notifier = Notifier({"NOTIFY_SOCKET": str(notify), "WATCHDOG_USEC": "600000"})
        stop = asyncio.Event()
        running = asyncio.create_task(agent.run(stop, notifier))

        async def scrape() -> dict[str, float]:
            assert agent.metrics_server is not None
            url = f"http://127.0.0.1:{agent.metrics_server.port}/metrics"
            async with httpx.AsyncClient() as client:
                text = (await client.get(url)).text
            return {
                line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
                for line in text.splitlines()
                if line.startswith("powerd_bmc_") and f'node="{NODE}"' in line
            }

        try:
            label = f'{{node="{NODE}"}}'
            for _ in range(100):
                await asyncio.sleep(0.1)
                if agent.metrics_server is not None and (await scrape()).get(
                    f"powerd_bmc_up{label}"
                ):
                    break
            m = await scrape()
            assert m[f"powerd_bmc_gpus{label}"] == 2 and m[f"powerd_bmc_up{label}"] == 1
            sent = m[f"powerd_bmc_requests_total{label}"]
            assert sent >= 2 + 2  # discovery's walk, then a sample of 2 GPUs at least
            assert m[f"powerd_bmc_request_seconds_count{label}"] == sent
            assert m[f'powerd_bmc_request_seconds_bucket{{le="+Inf",node="{NODE}"}}'] == sent
            assert m[f"powerd_bmc_request_failures_total{label}"] == 0
            hgx.faults.status = 503
            for _ in range(100):
                await asyncio.sleep(0.1)
                m = await scrape()
                if m[f"powerd_bmc_up{label}"] == 0:
                    break
            assert m[f"powerd_bmc_up{label}"] == 0
            assert m[f"powerd_bmc_request_failures_total{label}"] >= 1
            hgx.faults.status = None
        finally:
            stop.set()
            await asyncio.wait_for(running, 30)
        said = []
        while True:
            try:
                said.append(sock.recv(4096))
            except BlockingIOError:
                break
        sock.close()
    assert said[0].startswith(b"READY=1") and said[-1] == b"STOPPING=1"
    assert b"WATCHDOG=1" in said


def test_a_metrics_port_in_use_is_refused_naming_the_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from powerd.cli import main

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        text = f"metrics_port = {port}\n[[nodes]]\n" + NODE_TOML.format(id="n1", pw=tmp_path / "pw")
        assert main(["bmc-agent", f"--config={settings_file(tmp_path, text)}"]) == 2
    err = capsys.readouterr().err
    assert "at metrics_port: cannot serve on 127.0.0.1" in err and "Traceback" not in err
