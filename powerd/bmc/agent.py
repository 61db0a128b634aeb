"""`powerd bmc-agent`: the node agent of many BMC-managed nodes in one process.

Each node runs the node agent itself (`powerd.agent.agent.Agent`: telemetry, commands,
acks, leases, epochs, authority, failsafe, the read-back guard), unchanged, on its own
event loop in a thread of its own, with its own MQTT connection (its own last will) and a
`RedfishBackend` in place of NVML. The agent calls its backend synchronously, so a slow
BMC stalls only its own node's thread; the HTTP requests of every node run on one shared
loop (`IoLoop`). What differs from a node agent on the wire: docs/protocol.md, "BMC-managed
nodes"; what a lease means when the BMC keeps its limits: docs/safety.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import signal
import threading
from collections.abc import AsyncIterator

import structlog
from prometheus_client import CollectorRegistry

from powerd.agent.agent import Agent
from powerd.backends.base import BackendError, GpuInfo
from powerd.bmc.backend import IoLoop, RedfishBackend
from powerd.bmc.metrics import BmcMetrics
from powerd.bmc.redfish import RedfishClient, RequestStats
from powerd.bmc.settings import BmcAgentSettings
from powerd.clock import SystemClock
from powerd.node_metrics import MetricsServer, start_metrics_server
from powerd.sdnotify import Notifier
from powerd.settings import SettingsError
from powerd.transport.base import (
    ConnectionState,
    LastWill,
    Message,
    OnConnect,
    Transport,
    cancel_and_wait,
)
from powerd.transport.mqtt import MqttTransport

log = structlog.get_logger(__name__)
# Nodes discovering at once (each walk: ~20 requests on the shared Redfish loop).
DISCOVERY_SLOTS = 16


class NewestCommandOnly(Transport):
    """A node's transport, handing the agent only the newest of the messages that arrived
    while it was busy: a command a BMC takes seconds to apply must not queue behind
    commands a newer tick has replaced (each command carries every cap of its node, and the
    controller resolves the older ticks with the newer one's ack). `superseded` counts the
    messages dropped so."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.superseded = 0
        self._pending: list[Message] = []
        self._arrived = asyncio.Event()
        self._ended = False
        self._reader: asyncio.Task[None] | None = None

    @property
    def state(self) -> ConnectionState:
        return self.inner.state

    async def connect(
        self, will: LastWill | None = None, on_connect: OnConnect | None = None
    ) -> None:
        await self.inner.connect(will, on_connect)

    async def wait_connected(self) -> None:
        await self.inner.wait_connected()

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        await self.inner.publish(topic, payload, qos=qos, retain=retain)

    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        await self.inner.subscribe(topic_filter, qos)

    async def _read(self) -> None:
        try:
            async for message in self.inner.messages():
                # One per topic: the newest replaces an older one not yet handed over.
                kept = [m for m in self._pending if m.topic != message.topic]
                self.superseded += len(self._pending) - len(kept)
                self._pending = [*kept, message]
                self._arrived.set()
        finally:
            self._ended = True
            self._arrived.set()

    async def messages(self) -> AsyncIterator[Message]:
        if self._reader is None:
            self._reader = asyncio.create_task(self._read(), name="bmc-node-messages")
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            pending, self._pending = self._pending, []
            for message in pending:
                yield message
            if self._ended and not self._pending:
                return

    async def disconnect(self) -> None:
        await self.inner.disconnect()
        if self._reader is not None:
            await cancel_and_wait([self._reader])


class NodeRunner(threading.Thread):
    """One BMC-managed node: discovery (again every period until it works), then the node
    agent until `request_stop`."""

    def __init__(
        self,
        settings: BmcAgentSettings,
        index: int,
        io: IoLoop,
        discovery_slots: threading.BoundedSemaphore | None = None,
    ) -> None:
        node = settings.nodes[index]
        self.discovery_slots = discovery_slots or threading.BoundedSemaphore(DISCOVERY_SLOTS)
        super().__init__(name=f"bmc-{node.node_id}", daemon=True)
        self.settings = settings
        self.node = node
        self.agent_settings = settings.agent_settings(node)
        client = RedfishClient(
            node.url,
            node.username,
            settings.bmc_password(index),
            trust=node.trust(),
            auth=node.auth,
            timeout_s=node.timeout_s or settings.timeout_s,
            retries=settings.retries if node.retries is None else node.retries,
            concurrency=node.concurrency or settings.concurrency,
        )
        # A sample serves the reads of one telemetry period.
        self.backend = RedfishBackend(
            node.node_id,
            client,
            io,
            max_age_s=settings.period_s / 2,
            limits=node.limits or settings.limits,
        )
        self.agent: Agent | None = None
        self.transport: NewestCommandOnly | None = None
        self._node_loop: asyncio.AbstractEventLoop | None = None
        self._node_stop: asyncio.Event | None = None
        self._stop_requested = threading.Event()
        self.log = log.bind(node=node.node_id)

    def run(self) -> None:
        try:
            asyncio.run(self._main())
        except Exception:
            self.log.exception("bmc_node_failed")

    async def _main(self) -> None:
        self._node_loop = asyncio.get_running_loop()
        self._node_stop = asyncio.Event()
        if self._stop_requested.is_set():
            return
        try:
            if not await self._discover():
                return
            transport = NewestCommandOnly(MqttTransport(self.agent_settings.mqtt_config()))
            self.transport = transport
            self.agent = Agent(self.agent_settings, self.backend, transport, SystemClock())
            await self.agent.run(self._node_stop)
        finally:
            await asyncio.to_thread(self.backend.close)

    async def _discover(self) -> bool:
        """Until the BMC's GPUs are found (True) or a stop (False)."""
        assert self._node_stop is not None
        while not self._node_stop.is_set():
            try:
                gpus = await asyncio.to_thread(self._discover_in_turn)
            except BackendError as exc:
                self.log.warning("bmc_discovery_failed", bmc=self.node.url, error=str(exc))
            else:
                if gpus:
                    return True
                self.log.warning("bmc_has_no_gpus", bmc=self.node.url)
            # Jittered: BMCs that failed together (a network blip) do not retry together.
            again_s = self.settings.period_s * random.uniform(0.5, 1.5)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._node_stop.wait(), again_s)
        return False

    def _discover_in_turn(self) -> list[GpuInfo]:
        """Discovery once a slot is free: a walk is ~20 requests, and hundreds of nodes
        walking at once on the shared loop would each run past its bound and start again."""
        with self.discovery_slots:
            return self.backend.discover()

    # -- what the metrics read (powerd.bmc.metrics.BmcView) ---------------------------------

    @property
    def node_id(self) -> str:
        return self.node.node_id

    @property
    def stats(self) -> RequestStats:
        return self.backend.client.stats

    @property
    def gpus_found(self) -> int:
        return len(self.backend.found)

    @property
    def answering(self) -> bool:
        return self.backend.answering

    def request_stop(self) -> None:
        self._stop_requested.set()
        loop, stop = self._node_loop, self._node_stop
        if loop is not None and stop is not None:
            loop.call_soon_threadsafe(stop.set)


class BmcAgent:
    """Every node of the settings, each in its `NodeRunner`; `run` until `stop`."""

    def __init__(self, settings: BmcAgentSettings) -> None:
        settings.check_files()  # SettingsError before any thread starts
        self.settings = settings
        self.metrics_server: MetricsServer | None = None  # while it runs, if configured
        self.io = IoLoop()
        try:
            slots = threading.BoundedSemaphore(DISCOVERY_SLOTS)
            self.runners = [
                NodeRunner(settings, i, self.io, slots) for i in range(len(settings.nodes))
            ]
        except BaseException:
            self.io.close()
            raise

    async def run(self, stop: asyncio.Event, notifier: Notifier | None = None) -> None:
        notifier = notifier or Notifier({})
        try:
            server = self.metrics_server = self._serve_metrics()
        except BaseException:
            self.io.close()
            raise
        for runner in self.runners:
            runner.start()
        log.info("bmc_agent_started", nodes=len(self.runners), period_s=self.settings.period_s)
        notifier.ready(f"bmc-agent: {len(self.runners)} nodes")
        try:
            await self._watchdog(stop, notifier)
        finally:
            notifier.stopping()
            for runner in self.runners:
                runner.request_stop()
            await asyncio.to_thread(self._join)
            self.io.close()
            if server is not None:
                server.close()
            log.info("bmc_agent_stopped")

    async def _watchdog(self, stop: asyncio.Event, notifier: Notifier) -> None:
        """Until `stop`: a watchdog ping each time the shared Redfish loop answers (a hung
        one stalls every node: systemd restarts the process), about twice per WatchdogSec."""
        every_s = notifier.watchdog_s or self.settings.period_s
        while not stop.is_set():
            if notifier.watchdog_s is not None:
                try:
                    await asyncio.to_thread(self.io.run, asyncio.sleep(0), every_s)
                except TimeoutError:
                    log.error("bmc_io_loop_stalled", waited_s=every_s)
                else:
                    notifier.watchdog()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    def _serve_metrics(self) -> MetricsServer | None:
        if self.settings.metrics_port is None:
            return None
        registry = CollectorRegistry()
        registry.register(BmcMetrics(self.runners))
        host, port = self.settings.metrics_host, self.settings.metrics_port
        try:
            return start_metrics_server(registry, host, port)
        except OSError as exc:  # the port is taken, the address is not this host's
            raise SettingsError(
                self.settings.kind,
                [("metrics_port", f"cannot serve on {host}:{port}: {exc.strerror or exc}")],
            ) from None

    def _join(self) -> None:
        for runner in self.runners:
            runner.join(timeout=60)


async def run_bmc_agent_process(settings: BmcAgentSettings) -> None:
    """Run until SIGTERM/SIGINT; every node is left at its failsafe caps (as far as its BMC
    answers), and the BMCs keep them."""
    agent = BmcAgent(settings)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await agent.run(stop, Notifier())
