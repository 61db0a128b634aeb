"""Assemble and run an agent process: settings → backend, broker, loop; SIGTERM stops it."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable

from prometheus_client import CollectorRegistry

from powerd.agent.agent import Agent, build_backend, build_transport
from powerd.agent.kubelet import PodSource, build_pod_source
from powerd.agent.perf import PerfSource
from powerd.agent.record import TraceRecorder
from powerd.agent.restore import hold_agent_lock
from powerd.agent.settings import AgentSettings
from powerd.backends.base import GpuBackend
from powerd.clock import Clock, SystemClock
from powerd.node_metrics import AgentMetrics, MetricsServer, start_metrics_server
from powerd.sdnotify import Notifier
from powerd.transport import Transport
from powerd.transport.base import cancel_and_wait
from powerd.wire import NodeState, NodeTelemetry


async def run_agent_process(
    settings: AgentSettings,
    clock: Clock | None = None,
    with_backend: Callable[[GpuBackend], None] | None = None,
) -> None:
    """Run until SIGTERM/SIGINT. `clock`: the system's unless given (the chaos harness
    steps the wall clock of an agent; powerd/chaos/agent.py). `with_backend`: called with
    the backend once built, on the event loop (the chaos harness holds out-of-band limits
    on a mock's GPUs). AgentRunning if another agent holds this state directory's lock (it
    is held for the whole run: powerd/agent/restore.py)."""
    lock = hold_agent_lock(settings)
    try:
        await _run(settings, clock or SystemClock(), with_backend)
    finally:
        if lock is not None:
            lock.release()


async def _run(
    settings: AgentSettings, clock: Clock, with_backend: Callable[[GpuBackend], None] | None
) -> None:
    backend = build_backend(settings, clock)  # BackendError (no driver, ...) propagates
    if with_backend is not None:
        with_backend(backend)
    try:
        transport = build_transport(settings)
        agent = Agent(settings, backend, transport, clock)
        pods = _pod_source(agent, settings)  # first: a SettingsError leaves no thread behind
        perf = _perf_source(agent, settings)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        server = _serve_metrics(agent, settings) if settings.metrics_port is not None else None
        recorder = None
        if settings.record is not None:
            recorder = TraceRecorder(settings.record)
            agent.on_telemetry.append(recorder)
        notifier = Notifier()
        systemd = asyncio.create_task(_tell_systemd(notifier, transport, clock, settings))
        try:
            await agent.run(stop)
        finally:
            await cancel_and_wait([systemd])
            notifier.stopping()
            if server is not None:
                server.close()
            if recorder is not None:
                await asyncio.to_thread(recorder.close)
            if perf is not None:
                await asyncio.to_thread(perf.stop)
            if pods is not None:
                await asyncio.to_thread(pods.stop)
    finally:
        backend.close()


def _perf_source(agent: Agent, settings: AgentSettings) -> PerfSource | None:
    """The configured perf source, polling in its own thread (never the agent's loop)."""
    config = settings.perf_config()
    if config is None:
        return None
    source = PerfSource(config, {u: g.index for u, g in agent.gpus.items()})
    agent.perf_source = source
    source.start()
    return source


def _pod_source(agent: Agent, settings: AgentSettings) -> PodSource | None:
    """Jobs from Kubernetes when configured, polling in its own thread."""
    config = settings.kube_config()
    if config is None:
        return None
    source = build_pod_source(config, {u: g.index for u, g in agent.gpus.items()})
    agent.pod_source = source
    source.start()
    return source


async def _tell_systemd(
    notifier: Notifier, transport: Transport, clock: Clock, settings: AgentSettings
) -> None:
    """READY once the broker answers; then a watchdog ping per period while the loop runs
    (a hung event loop, e.g. a blocked NVML call, stops the pings and systemd restarts us)."""
    if not notifier.enabled:
        return
    await transport.wait_connected()
    notifier.ready(f"agent {settings.node_id} connected")
    while True:
        notifier.watchdog()
        await clock.sleep(min(settings.period_s, notifier.watchdog_s or settings.period_s))


def _serve_metrics(agent: Agent, settings: AgentSettings) -> MetricsServer:
    """The node's own /metrics (GPUs and command handling), refreshed with each sample."""
    registry = CollectorRegistry()
    metrics = AgentMetrics(registry, agent.node_id)

    def update(msg: NodeTelemetry) -> None:
        metrics.update_gpus(msg.gpus)
        metrics.update_counters(
            commands=agent.commands,
            rejected=agent.rejected,
            caps_applied=agent.caps_applied,
            failsafe=agent.state is NodeState.FAILSAFE,
        )

    agent.on_telemetry.append(update)
    assert settings.metrics_port is not None
    return start_metrics_server(registry, settings.metrics_host, settings.metrics_port)
