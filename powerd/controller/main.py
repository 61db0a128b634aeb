"""Assemble and run a controller process: settings → policy, store, broker, loop."""

from __future__ import annotations

import asyncio
import signal

import structlog
from prometheus_client import CollectorRegistry

from powerd.api.app import create_app
from powerd.api.hooks import TickHook, metrics_hook, watchdog_hook
from powerd.api.server import ApiServer
from powerd.auth import TokenStore, check_secret
from powerd.clock import SystemClock
from powerd.controller.controller import Controller, TickReport
from powerd.controller.settings import ControllerSettings
from powerd.metrics import ControllerMetrics
from powerd.policy import load_policy
from powerd.sdnotify import Notifier
from powerd.settings import SettingsError
from powerd.store import Store, StoreWriter, upgrade
from powerd.transport import MqttTransport
from powerd.wire import Topics

log = structlog.get_logger(__name__)


async def run_controller(settings: ControllerSettings) -> None:
    """Run until SIGTERM/SIGINT. PolicyError for a bad policy; SIGHUP reloads the policy."""
    policy = load_policy(settings.policy)
    if settings.password is not None:
        check_secret(settings.password.get_secret_value(), "broker password", dev=settings.dev)
    tokens = None
    if settings.api_port is not None:
        tokens = (
            _no_tokens(settings.dev)
            if settings.tokens_file is None
            else TokenStore.from_file(settings.tokens_file, dev=settings.dev)
        )
    # Migrations first: a controller never runs against a schema it does not know.
    await asyncio.to_thread(upgrade, settings.db)
    store = Store(settings.db)
    writer = StoreWriter(
        store,
        retention=settings.retention(),
        cap_epsilon_w=settings.cap_epsilon_w,
        cap_interval_s=settings.cap_interval_s,
    )
    writer.seed_caps(await asyncio.to_thread(store.latest_caps))
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
    notifier = Notifier()
    registry = CollectorRegistry()
    controller.on_tick += [
        metrics_hook(controller, ControllerMetrics(registry)),
        watchdog_hook(notifier),
        _ready_once(notifier),
    ]
    api = None
    if tokens is not None:
        assert settings.api_port is not None
        # Bound now, so a taken port fails the start-up rather than a running loop.
        api = ApiServer(
            create_app(controller, tokens, registry=registry), settings.api_host, settings.api_port
        )
    writer.start()  # last: nothing after it may fail before the finally that stops it
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller))
    try:
        async with asyncio.TaskGroup() as tg:
            if api is not None:
                tg.create_task(api.serve(stop), name="api")
            tg.create_task(controller.run(stop, learn_s=settings.learn_s), name="controller")
    finally:
        notifier.stopping()
        await asyncio.to_thread(writer.stop)


def _no_tokens(dev: bool) -> TokenStore:
    if not dev:
        raise SettingsError(
            "controller settings",
            [
                (
                    "tokens_file",
                    "the admin API needs a tokens file (see docs/api.md); "
                    "`powerd token new` makes an entry",
                )
            ],
        )
    log.warning("api_without_tokens", hint="--dev: every request is refused (no tokens)")
    return TokenStore([])


def _ready_once(notifier: Notifier) -> TickHook:
    """READY=1 after the first tick: start-up (migrations, broker, learning) is done."""
    done = False

    def hook(report: TickReport) -> None:
        nonlocal done
        if not done:
            done = True
            notifier.ready(f"steering {len(report.uuids)} GPUs")
        else:
            notifier.status(f"tick {report.tick}: {len(report.uuids)} GPUs, status {report.status}")

    return hook


def _reload(controller: Controller) -> None:
    try:
        version = controller.reload_policy_file()
        log.info("policy_reloaded", version=version)
    except Exception as exc:  # a bad file keeps the running policy
        log.error("policy_reload_failed", error=str(exc))
