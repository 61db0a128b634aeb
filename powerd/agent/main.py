"""Assemble and run an agent process: settings → backend, broker, loop; SIGTERM stops it."""

from __future__ import annotations

import asyncio
import signal

from powerd.agent.agent import Agent, build_backend, build_transport
from powerd.agent.settings import AgentSettings
from powerd.clock import SystemClock


async def run_agent_process(settings: AgentSettings) -> None:
    clock = SystemClock()
    backend = build_backend(settings, clock)  # BackendError (no driver, ...) propagates
    try:
        agent = Agent(settings, backend, build_transport(settings), clock)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await agent.run(stop)
    finally:
        backend.close()
