"""The node agent against a real Mosquitto, with mock GPUs and a clock the test moves."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from powerd.agent import Agent, AgentSettings, SettingsError, build_backend
from powerd.backends.base import BackendError, GpuReading, NoPermission
from powerd.backends.mock import MockBackend, Pattern, SimulatedGpus, Workload
from powerd.testing.mosquitto import LocalMosquitto
from powerd.transport import ConnectionState, MqttConfig, MqttTransport
from powerd.wire import (
    MAX_PAYLOAD_BYTES,
    AckError,
    CapAck,
    CapCommand,
    NodeState,
    NodeStatus,
    NodeTelemetry,
    Topics,
    decode,
    encode,
)

NODE = "node-1"
PERIOD_S = 0.5
LEASE_S = 2.0
TOPICS = Topics()


class Harness:
    """One agent on 4 mock GPUs, and a controller-side client that sends and listens."""

    def __init__(
        self, agent: Agent, fleet: SimulatedGpus, backend: MockBackend, clock: Any, eventually: Any
    ):
        self.eventually = eventually
        self.agent = agent
        self.fleet = fleet
        self.backend = backend
        self.clock = clock
        self.uuids = list(agent.gpus)
        self.controller: MqttTransport | None = None
        self.acks: asyncio.Queue[CapAck] = asyncio.Queue()
        self.statuses: list[NodeStatus] = []
        self.telemetry: list[NodeTelemetry] = []

    async def listen(self, url: str) -> None:
        self.controller = MqttTransport(MqttConfig.from_url(url, reconnect_max_s=0.3))
        await self.controller.connect()
        for kind in ("ack", "status", "telemetry"):
            await self.controller.subscribe(TOPICS.all_nodes(kind))
        await asyncio.wait_for(self.controller.wait_connected(), 10)

    async def receive(self) -> None:
        assert self.controller is not None
        async for m in self.controller.messages():
            _, kind = TOPICS.parse_node_topic(m.topic)
            if kind == "ack":
                self.acks.put_nowait(decode(m.payload, CapAck))
            elif kind == "status":
                self.statuses.append(decode(m.payload, NodeStatus))
            elif kind == "telemetry":
                self.telemetry.append(decode(m.payload, NodeTelemetry))

    async def send(self, payload: bytes | CapCommand, retain: bool = False) -> None:
        assert self.controller is not None
        raw = encode(payload) if isinstance(payload, CapCommand) else payload
        await self.controller.publish(TOPICS.caps(NODE), raw, qos=1, retain=retain)

    async def next_ack(self) -> CapAck:
        return await asyncio.wait_for(self.acks.get(), 10)

    def command(
        self,
        tick: int,
        caps: list[float],
        failsafe: float = 300.0,
        lease_s: float = LEASE_S,
        epoch: int = 0,
    ) -> CapCommand:
        return CapCommand(
            node_id=NODE,
            tick=tick,
            epoch=epoch,
            lease_s=lease_s,
            caps=dict(zip(self.uuids, caps, strict=False)),
            failsafe_w=dict.fromkeys(self.uuids, failsafe),
        )

    async def apply(self, tick: int, caps: list[float], **kw: Any) -> CapAck:
        await self.send(self.command(tick, caps, **kw))
        ack = await self.next_ack()
        assert ack.tick == tick
        return ack

    def caps(self) -> list[float]:
        return [float(c) for c in self.fleet.cap_w]

    async def step(self, seconds: float) -> None:
        """Move virtual time in periods; after each, wait until the agent has sampled."""
        for _ in range(round(seconds / PERIOD_S)):
            seq = self.agent.seq
            self.clock.advance(PERIOD_S)
            await self.eventually(lambda seq=seq: self.agent.seq > seq, what="a sample")
            await asyncio.sleep(0.01)  # the lease loop, woken too, runs its check

    async def latest_telemetry(self) -> NodeTelemetry:
        """The last sample taken, once it has come through the broker."""
        seq = self.agent.seq - 1
        await self.eventually(
            lambda: bool(self.telemetry) and self.telemetry[-1].seq == seq, what="telemetry"
        )
        return self.telemetry[-1]


StartAgent = Callable[..., Any]


@pytest.fixture
async def start_agent(
    mosquitto: LocalMosquitto, stepped_clock: Any, eventually: Any
) -> AsyncIterator[StartAgent]:
    """Start an agent (settings overridable) on the test's broker; stopped at teardown."""
    running: list[tuple[asyncio.Event, asyncio.Task[None], asyncio.Task[None], Harness]] = []

    async def start(
        prepare: Callable[[SimulatedGpus], None] | None = None, **overrides: Any
    ) -> Harness:
        defaults: dict[str, Any] = {
            "node_id": NODE,
            "broker": mosquitto.url,
            "backend": "mock",
            "period_s": PERIOD_S,
            "failsafe_w": 400.0,
            "reconnect_max_s": 0.3,
        }
        settings = AgentSettings(**{**defaults, **overrides})
        fleet = SimulatedGpus(
            4, Workload.steady(650.0), start_s=stepped_clock.monotonic(), uuid_prefix="GPU-t"
        )
        if prepare is not None:
            prepare(fleet)
        backend = MockBackend(fleet, stepped_clock)
        transport = MqttTransport(settings.mqtt_config())
        agent = Agent(settings, backend, transport, stepped_clock)
        h = Harness(agent, fleet, backend, stepped_clock, eventually)
        await h.listen(mosquitto.url)
        stop = asyncio.Event()
        receiver = asyncio.create_task(h.receive(), name="test-controller")
        task = asyncio.create_task(agent.run(stop), name="test-agent")
        running.append((stop, task, receiver, h))
        await asyncio.wait_for(transport.wait_connected(), 10)
        # The agent is subscribed once its status (published after subscribing) is back.
        await eventually(lambda: bool(h.statuses), what="the agent's status")
        return h

    yield start
    for stop, task, receiver, h in running:
        stop.set()
        await asyncio.wait_for(task, 10)
        assert h.controller is not None
        await h.controller.disconnect()
        await asyncio.wait_for(receiver, 10)


# -- start and normal operation ----------------------------------------------------------------


async def test_start_lowers_to_failsafe_and_never_raises(start_agent: StartAgent) -> None:
    h = await start_agent(prepare=lambda fleet: fleet.set_cap(0, 300.0))
    # failsafe_w = 400 from the settings until the first command; GPU 0 was already lower.
    assert h.caps() == [300.0, 400.0, 400.0, 400.0]
    assert h.agent.state is NodeState.STARTING
    status = h.statuses[-1]
    assert status.state is NodeState.STARTING
    assert status.caps_w == dict(zip(h.uuids, [300.0, 400.0, 400.0, 400.0], strict=True))


async def test_start_lowers_a_limit_held_under_the_failsafe_by_another(
    start_agent: StartAgent,
) -> None:
    # A BMC holds GPU 2 at 300 W under the 700 W a predecessor left requested: the new
    # agent, knowing no set of its own, reads the requested limit from the driver and sets
    # its 400 W failsafe under the BMC's limit. Judged by the 300 W enforced alone it left
    # 700 W requested, where the GPU went the moment the BMC let go.
    h = await start_agent(prepare=lambda fleet: fleet.override(2, 300.0))
    assert h.caps() == [400.0, 400.0, 300.0, 400.0]
    status = h.statuses[-1]
    assert (status.caps_w[h.uuids[2]], status.set_w[h.uuids[2]]) == (300.0, 400.0)
    h.fleet.override(2, None)
    assert h.caps() == [400.0] * 4


async def test_cap_applied_and_acknowledged_end_to_end(start_agent: StartAgent, eventually: Any):
    h = await start_agent()
    # Out-of-range requests are clamped to the device's limits [200, 700] W.
    ack = await h.apply(1, [500.0, 650.0, 100.0, 900.0], lease_s=60.0)
    assert {u: (g.requested_w, g.enforced_w, g.error) for u, g in ack.gpus.items()} == {
        h.uuids[0]: (500.0, 500.0, None),
        h.uuids[1]: (650.0, 650.0, None),
        h.uuids[2]: (100.0, 200.0, None),
        h.uuids[3]: (900.0, 700.0, None),
    }
    assert h.caps() == [500.0, 650.0, 200.0, 700.0]
    await eventually(lambda: h.statuses[-1].state is NodeState.STEERED, what="steered status")
    assert h.statuses[-1].last_tick == 1
    assert h.statuses[-1].caps_w[h.uuids[0]] == 500.0

    await h.step(4 * PERIOD_S)  # 10 time constants of the mock's power lag
    sample = await h.latest_telemetry()
    assert sample.state == "steered"
    assert [g.cap_w for g in sample.gpus] == [500.0, 650.0, 200.0, 700.0]
    # Demand is 650 W: the GPUs capped below it are held back and say so.
    assert sample.gpus[0].throttle == ["sw_power_cap"]
    assert sample.gpus[3].throttle == []
    assert sample.gpus[0].power_w == pytest.approx(500.0, abs=1.0)


async def test_decreases_are_applied_before_increases(start_agent: StartAgent) -> None:
    h = await start_agent()
    await h.apply(1, [400.0, 600.0, 400.0, 600.0])
    h.backend.set_log.clear()
    await h.apply(2, [600.0, 300.0, 650.0, 250.0])
    order = [uuid for uuid, _ in h.backend.set_log]
    assert set(order[:2]) == {h.uuids[1], h.uuids[3]}  # the cuts
    assert set(order[2:]) == {h.uuids[0], h.uuids[2]}  # then the raises
    assert h.caps() == [600.0, 300.0, 650.0, 250.0]


async def test_unknown_gpu_gets_an_error_in_the_ack(start_agent: StartAgent) -> None:
    h = await start_agent()
    cmd = h.command(1, [500.0])
    cmd = cmd.model_copy(update={"caps": {**cmd.caps, "GPU-nonesuch": 500.0}})
    await h.send(cmd)
    ack = await h.next_ack()
    assert ack.gpus["GPU-nonesuch"].error is AckError.UNKNOWN_GPU
    assert ack.gpus[h.uuids[0]].enforced_w == 500.0
    assert h.agent.rejected["unknown_gpu"] == 1
    assert h.caps()[0] == 500.0


async def test_device_faults_are_reported_per_gpu(start_agent: StartAgent) -> None:
    def faults(fleet: SimulatedGpus) -> None:
        fleet.override(0, 450.0)
        fleet.fail_set(1, NoPermission)

    h = await start_agent(prepare=faults)
    h.fleet.lose(2)
    ack = await h.apply(1, [600.0, 600.0, 600.0, 600.0])
    g = [ack.gpus[u] for u in h.uuids]
    assert (g[0].error, g[0].enforced_w) == (AckError.OVERRIDDEN, 450.0)
    assert g[1].error is AckError.NO_PERMISSION
    assert g[2].error is AckError.GPU_LOST
    assert (g[3].error, g[3].enforced_w) == (None, 600.0)
    # A lost GPU is reported in telemetry, and the agent carries on.
    await h.step(PERIOD_S)
    assert (await h.latest_telemetry()).gpus[2].error == "gpu_lost"
    assert (await h.apply(2, [500.0, 500.0, 500.0, 500.0])).gpus[h.uuids[3]].enforced_w == 500.0


async def test_clean_stop_leaves_failsafe_caps_and_offline_status(
    mosquitto: LocalMosquitto, stepped_clock: Any, eventually: Any
) -> None:
    settings = AgentSettings(
        node_id=NODE, broker=mosquitto.url, backend="mock", mock_gpus=2, period_s=PERIOD_S
    )
    backend = build_backend(settings, stepped_clock)
    agent = Agent(settings, backend, MqttTransport(settings.mqtt_config()), stepped_clock)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop))
    await eventually(lambda: agent.transport.state is ConnectionState.CONNECTED)
    stop.set()
    await asyncio.wait_for(task, 10)
    # No failsafe_w configured and no command seen: the device minimum is the failsafe cap.
    assert [backend.read(g.uuid).cap_w for g in backend.gpus()] == [200.0, 200.0]

    watcher = MqttTransport(MqttConfig.from_url(mosquitto.url))
    await watcher.connect()
    await watcher.subscribe(TOPICS.status(NODE))
    message = await asyncio.wait_for(anext(watcher.messages()), 10)
    await watcher.disconnect()
    assert message.retain
    assert decode(message.payload, NodeStatus).state is NodeState.OFFLINE


# -- lease and failsafe ------------------------------------------------------------------------


async def test_failsafe_engages_within_lease_plus_one_period(
    start_agent: StartAgent, eventually: Any
) -> None:
    h = await start_agent(failsafe_w=None)
    await h.apply(1, [250.0, 600.0, 600.0, 600.0], failsafe=500.0)
    await h.step(LEASE_S - PERIOD_S)
    assert h.agent.state is NodeState.STEERED
    assert (await h.latest_telemetry()).state == "steered"

    await h.step(PERIOD_S)  # now at lease + at most one period since the command
    await eventually(lambda: h.agent.state is NodeState.FAILSAFE, what="failsafe")
    # min(current, failsafe): lowered to 500 W, GPU 0 stays at 250 W.
    assert h.caps() == [250.0, 500.0, 500.0, 500.0]
    await eventually(lambda: h.statuses[-1].state is NodeState.FAILSAFE)
    await h.step(PERIOD_S)
    assert (await h.latest_telemetry()).state == "failsafe"

    # The next valid command steers again, raises included.
    await h.apply(2, [650.0, 650.0, 650.0, 650.0])
    assert h.agent.state is NodeState.STEERED
    assert h.caps() == [650.0] * 4


async def test_failsafe_when_broker_dies_then_resumes(
    start_agent: StartAgent, mosquitto: LocalMosquitto, eventually: Any
) -> None:
    h = await start_agent()
    await h.apply(1, [600.0, 600.0, 600.0, 600.0], failsafe=350.0)
    mosquitto.kill()
    await eventually(lambda: h.agent.transport.state is not ConnectionState.CONNECTED)
    await h.step(LEASE_S + PERIOD_S)
    await eventually(lambda: h.agent.state is NodeState.FAILSAFE, what="failsafe")
    assert h.caps() == [350.0] * 4
    assert h.agent.unsent["telemetry"] > 0

    h.statuses.clear()
    mosquitto.start()
    # The agent reconnects and republishes its status (the restarted broker forgot it).
    await eventually(lambda: bool(h.statuses), what="status after reconnection")
    assert h.statuses[-1].state is NodeState.FAILSAFE
    assert h.statuses[-1].caps_w == dict.fromkeys(h.uuids, 350.0)
    # Retained statuses come while our side is still subscribing, before it counts as
    # connected: wait for that before sending (a publish before it is refused).
    assert h.controller is not None
    await asyncio.wait_for(h.controller.wait_connected(), 10)
    ack = await h.apply(2, [550.0, 550.0, 550.0, 550.0])
    assert all(g.enforced_w == 550.0 for g in ack.gpus.values())
    assert h.agent.state is NodeState.STEERED


# -- limits powerd did not set ----------------------------------------------------------------


async def test_a_limit_raised_behind_its_back_is_set_back_before_it_is_reported(
    start_agent: StartAgent,
) -> None:
    h = await start_agent()
    await h.apply(1, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
    h.fleet.tamper(0, 700.0)  # nvidia-smi -pl 700
    with capture_logs() as logs:
        await h.step(PERIOD_S)
    # Set back within the sample that found it: the published sample never shows 700 W.
    assert h.caps()[0] == 400.0
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.set_w, g.restores, g.found_w) == (400.0, 400.0, 1, 700.0)
    restored = [e for e in logs if e["event"] == "cap_restored"]
    assert [(e["gpu"], e["found_w"], e["set_w"]) for e in restored] == [(h.uuids[0], 700.0, 400.0)]
    # 700 W is this mock's default limit: the agent says it may be a reset.
    assert restored[0]["cause"] == "default_limit"
    h.fleet.tamper(0, 550.0)
    with capture_logs() as logs:
        await h.step(PERIOD_S)
    assert h.caps()[0] == 400.0
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.restores, g.found_w) == (400.0, 2, 550.0)
    assert [e["cause"] for e in logs if e["event"] == "cap_restored"] == ["foreign_limit"]
    # Raised between samples and set back by the next command: counted all the same.
    h.fleet.tamper(0, 650.0)
    with capture_logs() as logs:
        await h.apply(2, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
    assert [(e["by"], e["found_w"]) for e in logs if e["event"] == "cap_restored"] == [
        ("command", 650.0)
    ]
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.restores, g.found_w) == (400.0, 3, 650.0)
    # A set that fails is no restore: the limit stays above, and every sample says so.
    h.fleet.fail_set(0, NoPermission)
    h.fleet.tamper(0, 600.0)
    await h.apply(3, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.set_w, g.restores) == (600.0, 400.0, 3)


async def test_a_limit_lowered_behind_its_back_is_reported_and_not_raised(
    start_agent: StartAgent,
) -> None:
    h = await start_agent()
    await h.apply(1, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
    h.fleet.tamper(1, 250.0)
    with capture_logs() as logs:
        await h.step(2 * PERIOD_S)
    # Raising it back would be a raise the controller did not plan: only a command does.
    assert h.caps()[1] == 250.0
    g = (await h.latest_telemetry()).gpus[1]
    assert (g.cap_w, g.set_w, g.restores) == (250.0, 400.0, 0)
    differs = [e for e in logs if e["event"] == "cap_differs"]
    assert [(e["gpu"], e["enforced_w"], e["set_w"]) for e in differs] == [
        (h.uuids[1], 250.0, 400.0)
    ]
    with capture_logs() as logs:
        await h.apply(2, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
        await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[1]
    assert (g.cap_w, g.set_w) == (400.0, 400.0)
    assert [e["gpu"] for e in logs if e["event"] == "cap_matches"] == [h.uuids[1]]


async def test_an_out_of_band_limit_shows_in_every_sample_until_it_goes(
    start_agent: StartAgent,
) -> None:
    h = await start_agent()
    h.fleet.override(2, 350.0)  # a BMC's limit: the lower one is enforced
    ack = await h.apply(1, [400.0, 400.0, 400.0, 400.0], lease_s=60.0)
    assert (ack.gpus[h.uuids[2]].error, ack.gpus[h.uuids[2]].enforced_w) == (
        AckError.OVERRIDDEN,
        350.0,
    )
    for _ in range(2):
        await h.step(PERIOD_S)
        g = (await h.latest_telemetry()).gpus[2]
        assert (g.cap_w, g.set_w, g.restores) == (350.0, 400.0, 0)
    h.fleet.override(2, None)  # gone: the limit powerd set is enforced again
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[2]
    assert (g.cap_w, g.set_w) == (400.0, 400.0)


async def test_the_failsafe_lowers_the_limit_under_an_out_of_band_one_that_may_lift(
    start_agent: StartAgent, eventually: Any
) -> None:
    # A BMC holds GPU 2 at 350 W under powerd's 600 W when the controller goes: judged by
    # the limit in force (350 W, under the 500 W failsafe) it was left at 600 W, to which
    # it went back, uncounted, the moment the BMC let go.
    h = await start_agent(failsafe_w=None)
    h.fleet.override(2, 350.0)
    await h.apply(1, [250.0, 600.0, 600.0, 600.0], failsafe=500.0)
    await h.step(LEASE_S)
    await eventually(lambda: h.agent.state is NodeState.FAILSAFE, what="failsafe")
    assert h.caps() == [250.0, 500.0, 350.0, 500.0]
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[2]
    assert (g.cap_w, g.set_w) == (350.0, 500.0)  # the failsafe set under the BMC's limit
    # The retained status (what a restarted controller counts) names the limit in force
    # and the one it may lift to.
    await eventually(lambda: h.statuses[-1].state is NodeState.FAILSAFE)
    status = h.statuses[-1]
    assert (status.caps_w[h.uuids[2]], status.set_w[h.uuids[2]]) == (350.0, 500.0)
    h.fleet.override(2, None)  # the BMC lets go: back to the failsafe cap, not above it
    assert h.caps() == [250.0, 500.0, 500.0, 500.0]
    await h.step(PERIOD_S)
    assert (await h.latest_telemetry()).gpus[2].restores == 0  # nothing to set back


@pytest.mark.parametrize("how", ["reset", "tamper"])
async def test_a_limit_raised_under_an_out_of_band_one_is_set_back(
    start_agent: StartAgent, how: str
) -> None:
    # Steered at 400 W; a BMC holds GPU 0 at 300 W. Under it the driver's requested limit
    # goes up (a reset's 700 W default, `nvidia-smi -pl 700`): the enforced limit still
    # reads 300 W, and the GPU would go to 700 W, uncounted, the moment the BMC let go.
    # The agent reads the requested limit and sets its own back at the next sample.
    h = await start_agent()
    await h.apply(1, [400.0] * 4, lease_s=60.0)
    h.fleet.override(0, 300.0)
    if how == "reset":
        h.fleet.reset(0)
    else:
        h.fleet.tamper(0, 700.0)
    await h.step(PERIOD_S)
    assert float(h.fleet.requested_cap_w[0]) == 400.0
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.set_w, g.restores, g.found_w) == (300.0, 400.0, 1, 700.0)
    h.fleet.override(0, None)
    assert h.caps()[0] == 400.0


async def test_a_limit_raised_under_an_out_of_band_one_and_stuck_is_reported(
    start_agent: StartAgent,
) -> None:
    # The same, but the agent cannot set it back (a permission lost): its telemetry's
    # `set_w` names the 700 W requested, so that the controller counts the GPU there
    # (docs/protocol.md), not at the 400 W it last set.
    h = await start_agent()
    await h.apply(1, [400.0] * 4, lease_s=60.0)
    h.fleet.override(0, 300.0)
    h.fleet.fail_set(0, NoPermission)
    h.fleet.tamper(0, 700.0)
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.set_w) == (300.0, 700.0)
    assert h.agent.set_w[h.uuids[0]] == 400.0  # what it set is unchanged


async def test_a_set_whose_read_back_failed_under_an_out_of_band_limit_is_not_lost(
    start_agent: StartAgent,
) -> None:
    # NVML took the 650 W set, then the read-back of the enforced limit failed: the agent
    # keeps 400 W as its set (the ack says the set failed), while the driver requests
    # 650 W under the BMC's 300 W. At its next sample the agent finds it and sets its own
    # back, so what the GPU goes to when the BMC lets go is what the telemetry names.
    h = await start_agent()
    await h.apply(1, [400.0] * 4, lease_s=60.0)
    h.fleet.override(0, 300.0)
    u0 = h.uuids[0]
    original = h.backend.set_power_limit_w

    def read_back_fails(uuid: str, watts: float) -> float:
        enforced = original(uuid, watts)
        if uuid == u0:
            raise BackendError("read back failed (injected)", uuid)
        return enforced

    h.backend.set_power_limit_w = read_back_fails  # type: ignore[method-assign]
    ack = await h.apply(2, [650.0, 400.0, 400.0, 400.0], lease_s=60.0)
    h.backend.set_power_limit_w = original  # type: ignore[method-assign]
    assert ack.gpus[u0].error is not None
    await h.step(PERIOD_S)
    g = (await h.latest_telemetry()).gpus[0]
    h.fleet.override(0, None)
    assert g.set_w is not None and h.caps()[0] <= max(g.cap_w, g.set_w)


async def test_a_requested_limit_read_beyond_the_gpus_maximum_is_no_reading(
    start_agent: StartAgent,
) -> None:
    # A driver answering 5 kW for a 700 W GPU's requested limit: ignored (the GPU cannot go
    # there), so the agent neither sets its limit again every period nor reports it.
    h = await start_agent()
    u0 = h.uuids[0]
    read = h.backend.read

    def garbage(uuid: str) -> GpuReading:
        r = read(uuid)
        return replace(r, requested_w=5000.0) if uuid == u0 else r

    h.backend.read = garbage  # type: ignore[method-assign]
    sets, statuses = len(h.backend.set_log), len(h.statuses)
    await h.step(3 * PERIOD_S)
    assert (len(h.backend.set_log), len(h.statuses)) == (sets, statuses)
    assert u0 not in h.agent.requested_w


async def test_a_gpu_back_from_a_reset_gets_its_cap_again_at_once(
    start_agent: StartAgent,
) -> None:
    h = await start_agent()
    await h.apply(1, [450.0, 450.0, 450.0, 450.0], failsafe=300.0)
    # A driver reload: the GPU is unreachable, then back at its default limit.
    h.fleet.lose(3)
    await h.step(PERIOD_S)
    assert (await h.latest_telemetry()).gpus[3].error == "gpu_lost"
    h.fleet.reset(3)
    h.fleet.lose(3, False)
    assert h.caps()[3] == 700.0
    with capture_logs() as logs:
        await h.step(PERIOD_S)
    assert h.caps()[3] == 450.0
    g = (await h.latest_telemetry()).gpus[3]
    assert (g.error, g.cap_w, g.restores, g.found_w) == (None, 450.0, 1, 700.0)
    assert [e["cause"] for e in logs if e["event"] == "cap_restored"] == ["default_limit"]

    # Unsteered (the lease ran out), a GPU reset goes to its failsafe cap, never above.
    await h.step(LEASE_S)
    assert h.agent.state is NodeState.FAILSAFE
    assert h.caps() == [300.0] * 4
    h.fleet.reset(0)
    await h.step(PERIOD_S)
    assert h.caps()[0] == 300.0
    g = (await h.latest_telemetry()).gpus[0]
    assert (g.cap_w, g.set_w, g.restores) == (300.0, 300.0, 1)
    # The agent never raises on its own: one lowered while unsteered stays lowered.
    h.fleet.tamper(1, 250.0)
    await h.step(PERIOD_S)
    assert h.caps()[1] == 250.0


# -- bad input ---------------------------------------------------------------------------------


def _raw(**fields: Any) -> bytes:
    base: dict[str, Any] = {
        "v": 1,
        "node_id": NODE,
        "tick": 10,
        "lease_s": LEASE_S,
        "caps": {"GPU-t-0-000000": 250.0},
        "failsafe_w": {},
    }
    return json.dumps({**base, **fields}).encode()


BAD_INPUT: list[tuple[str, Callable[[Harness], bytes | CapCommand], str]] = [
    ("not_json", lambda h: b"{caps: 250 W please", "not_json"),
    ("empty", lambda h: b"", "not_json"),
    ("wrong_type", lambda h: _raw(tick="ten"), "invalid"),
    ("caps_not_a_map", lambda h: _raw(caps=[250.0]), "invalid"),
    ("negative_watts", lambda h: _raw(caps={h.uuids[0]: -250.0}), "invalid"),
    ("nan_watts", lambda h: _raw().replace(b"250.0", b"NaN"), "invalid"),
    ("huge_watts", lambda h: _raw(caps={h.uuids[0]: 1e9}), "invalid"),
    ("negative_epoch", lambda h: _raw(epoch=-1), "invalid"),
    ("huge_epoch", lambda h: _raw(epoch=2**53), "invalid"),
    ("wrong_node", lambda h: _raw(node_id="node-2"), "node_mismatch"),
    ("wrong_version", lambda h: _raw(v=2), "bad_version"),
    ("oversized", lambda h: _raw(pad="x" * MAX_PAYLOAD_BYTES), "oversized"),
    ("replayed_tick", lambda h: h.command(5, [250.0]), "stale_tick"),
    ("older_tick", lambda h: h.command(4, [250.0]), "stale_tick"),
]


@pytest.mark.parametrize(
    ("make", "reason"), [(m, r) for _, m, r in BAD_INPUT], ids=[n for n, _, _ in BAD_INPUT]
)
async def test_bad_input_is_counted_and_changes_nothing(
    start_agent: StartAgent,
    eventually: Any,
    make: Callable[[Harness], bytes | CapCommand],
    reason: str,
) -> None:
    h = await start_agent()
    await h.apply(5, [450.0, 450.0, 450.0, 450.0])
    before = h.caps()
    await h.send(make(h))
    await eventually(lambda: h.agent.rejected[reason] == 1, what=f"rejected[{reason}]")
    assert h.caps() == before
    assert h.agent.state is NodeState.STEERED
    # No ack for the bad message: the next ack is the next valid command's.
    assert (await h.apply(6, [460.0])).gpus[h.uuids[0]].enforced_w == 460.0
    assert sum(h.agent.rejected.values()) == 1


async def test_a_lower_epoch_is_fenced_a_higher_one_wins_over_ticks(
    start_agent: StartAgent, eventually: Any
) -> None:
    h = await start_agent()
    # A command without an epoch (a controller of an earlier release) is epoch 0.
    await h.send(_raw(tick=3, caps={h.uuids[0]: 420.0}))
    assert (await h.next_ack()).epoch == 0
    # A new leader (epoch 2) numbers its ticks as it likes: a lower tick still applies.
    ack = await h.apply(1, [450.0, 450.0, 450.0, 450.0], epoch=2)
    assert ack.epoch == 2 and h.agent.epoch == 2
    before = h.caps()
    # The deposed leader's commands, however late and however high their tick, move nothing.
    await h.send(h.command(10**6, [700.0, 700.0, 700.0, 700.0], epoch=1))
    await h.send(h.command(10**6 + 1, [200.0, 200.0, 200.0, 200.0], epoch=0))
    await eventually(lambda: h.agent.rejected["stale_epoch"] == 2, what="two fenced commands")
    assert h.agent.fenced == 2
    assert h.caps() == before
    # Within the leader's epoch ticks still order commands; its next one applies and the
    # status reports the epoch and the fenced count.
    await h.send(h.command(1, [460.0], epoch=2))
    await eventually(lambda: h.agent.rejected["stale_tick"] == 1, what="a replay of tick 1")
    assert (await h.apply(2, [460.0], epoch=2)).gpus[h.uuids[0]].enforced_w == 460.0
    await eventually(
        lambda: bool(h.statuses) and h.statuses[-1].last_tick == 2, what="the status of tick 2"
    )
    assert (h.statuses[-1].epoch, h.statuses[-1].fenced) == (2, 2)


async def test_the_epoch_survives_a_restart_of_the_agent(
    start_agent: StartAgent, eventually: Any, tmp_path: Path
) -> None:
    h = await start_agent(state_dir=tmp_path)
    await h.apply(1, [450.0, 450.0, 450.0, 450.0], epoch=3)
    # Written before the command of the new epoch was applied.
    kept = tmp_path / "authority.json"
    assert json.loads(kept.read_text())["epoch"] == 3
    written = kept.stat().st_mtime_ns
    await h.apply(2, [460.0], epoch=3)  # the same epoch: not written again
    assert kept.stat().st_mtime_ns == written
    # A new agent process on the node: it refuses the deposed leader's late command.
    again = await start_agent(state_dir=tmp_path)
    assert again.agent.epoch == 3
    await again.send(again.command(10**6, [700.0, 700.0, 700.0, 700.0], epoch=2))
    await eventually(lambda: again.agent.rejected["stale_epoch"] == 1, what="a fenced command")
    assert again.agent.fenced == 1
    # A file that holds no epoch is logged and ignored, as if none were kept.
    kept.write_text("garbage")
    third = await start_agent(state_dir=tmp_path)
    assert third.agent.epoch == 0
    # The file of earlier releases (the epoch alone) is still read.
    kept.unlink()
    (tmp_path / "epoch").write_text("5\n")
    assert (await start_agent(state_dir=tmp_path)).agent.epoch == 5
    # A state directory that cannot be written: logged, and the command applied all the
    # same (it is safe now; only a later restart would forget the epoch).
    lost = await start_agent(state_dir=tmp_path / "missing")
    with capture_logs() as logs:
        await lost.apply(10**6 + 5, [380.0], epoch=4)
    assert lost.agent.epoch == 4 and lost.caps()[0] == 380.0
    assert any(e["event"] == "authority_not_saved" for e in logs)


async def test_retained_command_is_ignored(
    start_agent: StartAgent, mosquitto: LocalMosquitto, eventually: Any
) -> None:
    # A command left retained on the broker, of unknown age, met by an agent (re)starting.
    stale = MqttTransport(MqttConfig.from_url(mosquitto.url))
    await stale.connect()
    await asyncio.wait_for(stale.wait_connected(), 10)
    await stale.publish(TOPICS.caps(NODE), _raw(caps={"GPU-t-0-000000": 650.0}), 1, retain=True)
    await stale.disconnect()

    h = await start_agent()
    await eventually(lambda: h.agent.rejected["retained"] == 1, what="retained rejected")
    assert h.caps() == [400.0] * 4
    assert h.agent.state is NodeState.STARTING


# -- settings ----------------------------------------------------------------------------------


def test_settings_precedence_file_env_overrides(tmp_path: Path, monkeypatch: Any) -> None:
    toml = tmp_path / "agent.toml"
    toml.write_text('node_id = "from-file"\nperiod_s = 2.0\nfailsafe_w = 300\n')
    monkeypatch.setenv("POWERD_PERIOD_S", "3")
    s = AgentSettings.load(toml, failsafe_w=350.0, broker=None)
    assert (s.node_id, s.period_s, s.failsafe_w) == ("from-file", 3.0, 350.0)
    assert s.broker == "mqtt://127.0.0.1:1883"

    yaml_file = tmp_path / "agent.yaml"
    yaml_file.write_text("node_id: y1\nbackend: mock\nmock_workload: inference\n")
    s = AgentSettings.load(yaml_file)
    assert (s.node_id, s.backend, s.mock_workload) == ("y1", "mock", Pattern.INFERENCE)


def test_settings_errors_name_the_file_and_key(tmp_path: Path) -> None:
    bad = tmp_path / "agent.yaml"
    bad.write_text("node_id: n1\nperiod_s: -1\nperoid_s: 2\n")
    with pytest.raises(SettingsError) as err:
        AgentSettings.load(bad)
    text = str(err.value)
    assert str(bad) in text
    assert "period_s" in text
    assert "peroid_s: unknown key" in text


def test_settings_build_the_mqtt_config() -> None:
    s = AgentSettings(
        node_id="n1", broker="mqtts://u:p@127.0.0.1", password="secret", tls_insecure=True
    )
    c = s.mqtt_config()
    assert (c.host, c.port, c.tls, c.username, c.password) == (
        "127.0.0.1",
        8883,
        True,
        "u",
        "secret",
    )
    assert c.client_id is not None
    assert c.client_id.startswith("powerd-agent-n1-")
