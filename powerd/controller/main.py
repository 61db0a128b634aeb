"""Assemble and run a controller process: settings → policy, store, broker, loop."""

from __future__ import annotations

import asyncio
import signal

import structlog

from powerd.clock import SystemClock
from powerd.controller.controller import Controller
from powerd.controller.settings import ControllerSettings
from powerd.policy import load_policy
from powerd.store import Store, StoreWriter, upgrade
from powerd.transport import MqttTransport
from powerd.wire import Topics

log = structlog.get_logger(__name__)


async def run_controller(settings: ControllerSettings) -> None:
    """Run until SIGTERM/SIGINT. PolicyError for a bad policy; SIGHUP reloads the policy."""
    policy = load_policy(settings.policy)
    # Migrations first: a controller never runs against a schema it does not know.
    await asyncio.to_thread(upgrade, settings.db)
    store = Store(settings.db)
    writer = StoreWriter(store)
    writer.seed_caps(await asyncio.to_thread(store.latest_caps))
    writer.start()
    text = settings.policy.read_text(encoding="utf-8")
    version = await asyncio.to_thread(
        store.record_policy_version,
        text,
        source=str(settings.policy),
        author="controller",
        reason="start-up",
    )
    transport = MqttTransport(settings.mqtt_config())
    controller = Controller(
        policy,
        transport,
        SystemClock(),
        store=store,
        writer=writer,
        solver=settings.solver,
        controller_id=settings.controller_id,
        topics=Topics(settings.topic_prefix),
        policy_path=str(settings.policy),
    )
    controller.policy_version = version
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller))
    try:
        await controller.run(stop, learn_s=settings.learn_s)
    finally:
        await asyncio.to_thread(writer.stop)


def _reload(controller: Controller) -> None:
    try:
        version = controller.reload_policy_file()
        log.info("policy_reloaded", version=version)
    except Exception as exc:  # a bad file keeps the running policy
        log.error("policy_reload_failed", error=str(exc))
