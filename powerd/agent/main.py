"""Assemble and run an agent process: settings → backend, broker, loop; SIGTERM stops it."""

from __future__ import annotations

import asyncio
import signal

from powerd.agent.agent import Agent, build_backend, build_transport
from powerd.agent.settings import AgentSettings
from powerd.clock import Clock, SystemClock
from powerd.sdnotify import Notifier
from powerd.transport import Transport
from powerd.transport.base import cancel_and_wait


async def run_agent_process(settings: AgentSettings) -> None:
    clock = SystemClock()
    backend = build_backend(settings, clock)  # BackendError (no driver, ...) propagates
    try:
        transport = build_transport(settings)
        agent = Agent(settings, backend, transport, clock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        notifier = Notifier()
        systemd = asyncio.create_task(_tell_systemd(notifier, transport, clock, settings))
        try:
            await agent.run(stop)
        finally:
            await cancel_and_wait([systemd])
            notifier.stopping()
    finally:
        backend.close()


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
