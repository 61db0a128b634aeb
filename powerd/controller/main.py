"""Assemble and run a controller process: settings → policy, store, broker, loop."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry
from pydantic import ValidationError

from powerd.allocator import kernel
from powerd.api.app import create_app
from powerd.api.server import ApiServer
from powerd.auth import TokenStore, check_secret
from powerd.clock import Clock, SystemClock
from powerd.controller.admin import WriteFailed
from powerd.controller.build import ControllerOptions, StartState, build_controller
from powerd.controller.controller import Controller
from powerd.controller.hooks import (
    RoundHook,
    leadership_hook,
    metrics_hook,
    standby_watchdog_hook,
    watchdog_hook,
)
from powerd.controller.leadership import Leadership, for_daemon
from powerd.controller.meter_reader import MeterConfigError, check_meters
from powerd.controller.opstate import (
    ApiPolicy,
    OperatorState,
    StateFile,
    StateFileError,
    file_sha256,
)
from powerd.controller.settings import ControllerSettings
from powerd.metrics import ControllerMetrics
from powerd.policy import (
    Policy,
    PolicyError,
    ScopeError,
    load_policy,
    load_policy_text,
    overlapping_domains,
)
from powerd.sdnotify import Notifier
from powerd.settings import SettingsError
from powerd.store import Store, StoreWriter, WriterLimits, upgrade
from powerd.store.db import normalize_url
from powerd.transport import MqttTransport
from powerd.wire import Authority, Topics

log = structlog.get_logger(__name__)


async def run_controller(settings: ControllerSettings, clock: Clock | None = None) -> None:
    """Run until SIGTERM/SIGINT. PolicyError for a bad policy; SIGHUP reloads the policy.
    `clock`: the system's unless given (the chaos harness steps a standby's wall clock,
    powerd/chaos/controller.py); the lease's clock check reads the same wall clock.

    The database may be down: the controller then starts from its policy file and state
    file, steers, raises an alarm and catches up (migrations, policy version, queued audit
    rows) when the database returns."""
    file_policy = await _load_policy_file(settings.policy)
    # The allocator's compiled kernels: loaded (or compiled) before the first tick.
    await asyncio.to_thread(kernel.warm_up)
    file_sha, file_text = await asyncio.to_thread(_policy_file, settings.policy)
    if settings.password is not None:
        check_secret(settings.password.get_secret_value(), "broker password", dev=settings.dev)
    tokens = None
    if settings.api_port is not None:
        tokens = (
            _no_tokens(settings.dev)
            if settings.tokens_file is None
            else TokenStore.from_file(settings.tokens_file, dev=settings.dev)
        )
    # A shadow steers nothing, so it records nothing as if it did: its database (often the
    # leader's) is opened read-only, enforced by the database itself, and it gets no writer,
    # no state file to save and no ledger store. What it decides lives in memory (the API's
    # allocation, /metrics, logs). Reads (operator state, caps, history) work as ever.
    shadow = settings.shadow
    _check_record_db(settings)
    store = Store(settings.db, read_only=shadow)
    # Migrations first: a controller never writes to a schema it does not know. Without
    # the database it steers anyway and the ledger migrates when the database returns.
    db = await asyncio.to_thread(_open_db, store, settings.db, migrate=not shadow)
    state_file = StateFile(settings.state_path())
    from_file = await asyncio.to_thread(_load_state_file, state_file, move_aside=not shadow)
    state = _newer(from_file, db.state)
    policy, api_policy = _choose_policy(file_policy, file_sha, state)
    writer = _writer(settings, store, db.caps)
    if writer is None and settings.record_db is not None:
        writer = await asyncio.to_thread(_recorder, settings)
    transport = MqttTransport(settings.mqtt_config())
    clock = clock or SystemClock()
    authority = await _authority(settings, policy, db)
    # A shadow commands nothing: it takes no lease (it must not keep a real controller
    # from leading) and steers under none.
    leadership = None if shadow else _leadership(settings, policy, clock)
    try:
        controller = build_controller(
            policy,
            transport,
            clock,
            ControllerOptions(
                controller_id=settings.controller_id,
                solver=settings.solver,
                topics=Topics(settings.topic_prefix),
                policy_path=str(settings.policy),
                shadow=shadow,
                scope=settings.scope,
            ),
            store=store,
            writer=writer,
            state_file=state_file,
            authority=authority,
            leadership=leadership,
            start=StartState(
                state,
                api_policy,
                db_revision=db.revision,
                file_revision=0 if from_file is None else from_file.revision,
                schema_ready=db.ok,
                file_policy=file_policy,
            ),
        )
    except ScopeError as exc:
        raise SettingsError("controller settings", [("scope", str(exc))]) from exc
    ledger = controller.ledger
    await ledger.store_start_version(
        api_policy.text if api_policy is not None else file_text,
        "api" if api_policy is not None else policy.source,
        db_ok=db.ok,
        of_record=leadership is not None and leadership.mode == "lease",
    )
    if leadership is not None and leadership.mode == "alone":
        await leadership.claim_alone()  # StartRefused: another controller holds the store
    notifier = Notifier()
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    controller.on_tick += [metrics_hook(controller, metrics), watchdog_hook(notifier)]
    controller.on_round += [
        leadership_hook(controller, metrics),
        standby_watchdog_hook(notifier, controller),
        _ready_once(notifier, controller),
    ]
    api = None
    if tokens is not None:
        assert settings.api_port is not None
        # Bound now, so a taken port fails the start-up rather than a running loop.
        api = ApiServer(
            create_app(controller, tokens, registry=registry),
            settings.api_host,
            settings.api_port,
            tls=settings.api_tls(),
        )
    if writer is not None:
        writer.start()  # last: nothing after it may fail before the finally that stops it
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()
    loop.add_signal_handler(signal.SIGHUP, lambda: _reload(controller, reloads))
    try:
        async with asyncio.TaskGroup() as tg:
            tg.create_task(ledger.run(stop), name="ledger")
            if leadership is not None:
                tg.create_task(
                    leadership.run(stop, controller.epoch_to_overtake), name="leadership"
                )
            if api is not None:
                tg.create_task(api.serve(stop), name="api")
            tg.create_task(controller.run(stop, learn_s=settings.learn_s), name="controller")
    finally:
        notifier.stopping()
        await asyncio.to_thread(_close, writer, store)


def _writer(
    settings: ControllerSettings, store: Store, caps: dict[str, float]
) -> StoreWriter | None:
    """The writer of what the controller steers (ticks, caps, reasons, events, samples);
    None for a shadow, which steers nothing and so records nothing as if it did."""
    if settings.shadow:
        return None
    writer = StoreWriter(
        store,
        retention=settings.retention(),
        limits=WriterLimits(
            cap_epsilon_w=settings.cap_epsilon_w, cap_interval_s=settings.cap_interval_s
        ),
    )
    writer.seed_caps(caps)
    return writer


def _check_record_db(settings: ControllerSettings) -> None:
    """`record_db` is a shadow's, and never the database it reads."""
    url = settings.record_db
    if url is None:
        return
    if not settings.shadow:
        raise SettingsError(
            "controller settings",
            [("record_db", "only with shadow: a steering controller records into its db")],
        )
    if normalize_url(url) == normalize_url(settings.db):
        raise SettingsError(
            "controller settings",
            [("record_db", "must be a database of the shadow's own, not its db (read only)")],
        )


def _recorder(settings: ControllerSettings) -> StoreWriter:
    """(worker thread) A shadow's writer into a database of its own (`record_db`), migrated
    first: what the fleet did, for a pilot's baseline (Controller._record_fleet)."""
    url = settings.record_db
    assert url is not None
    try:
        upgrade(url)
    except Exception as exc:  # unreachable, refused, not a database: the shadow does not start
        why = f"cannot migrate {url}: {type(exc).__name__}: {exc}".splitlines()[0][:300]
        raise SettingsError("controller settings", [("record_db", why)]) from None
    return StoreWriter(Store(url), retention=settings.retention())


def _close(writer: StoreWriter | None, store: Store) -> None:
    """(worker thread) Flush what is queued, then let the database go."""
    if writer is not None:
        writer.stop()
        if writer.store is not store:  # a shadow's recording (record_db)
            writer.store.close()
    store.close()


async def _load_policy_file(path: Path) -> Policy:
    """The policy file, checked; a meter's credentials or trust that cannot work is said at
    start, by its field (PolicyError)."""
    policy = load_policy(path)
    try:
        await asyncio.to_thread(check_meters, policy)
    except MeterConfigError as exc:
        raise PolicyError(policy.source, [(exc.field, exc.detail)]) from None
    return policy


def _policy_file(path: Path) -> tuple[str | None, str]:
    """(worker thread) The policy file's sha256 and text."""
    return file_sha256(path), path.read_text(encoding="utf-8")


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


def _leadership(settings: ControllerSettings, policy: Policy, clock: Clock) -> Leadership:
    """The lease this controller leads under: its scope's, or the policy root's; its clock
    check compares the wall clock the controller judges windows by with the database's.
    `build_controller` wires what it follows (the ledger) and hands over (the overrides)."""
    leadership = for_daemon(
        settings.db,
        scope=settings.scope or policy.groups[0].name,
        holder=settings.controller_id,
        control=policy.control,
        lease_s=settings.leader_lease_s,
        mode=settings.leadership_mode(),
        wall=clock.wall,
    )
    leadership.through_outage = settings.through_outage
    leadership.overlaps = overlapping_domains(policy, leadership.scope)
    return leadership


def _ready_once(notifier: Notifier, controller: Controller) -> RoundHook:
    """READY=1 after the first round (a tick, or a standby's round): start-up
    (migrations, broker, learning) is done."""
    done = False

    def hook(leading: bool) -> None:
        nonlocal done
        if not done:
            done = True
            notifier.ready(
                f"steering {len(controller.fleet.gpus)} GPUs" if leading else "standing by"
            )

    return hook


def _reload(controller: Controller, tasks: set[asyncio.Task[None]]) -> None:
    task = asyncio.get_running_loop().create_task(_reload_policy(controller), name="reload")
    tasks.add(task)  # a reference until it ends; it logs its own failures
    task.add_done_callback(tasks.discard)


async def _reload_policy(controller: Controller) -> None:
    """SIGHUP: the policy file replaces the policy in force (an API one included). What was
    applied and what was stored are logged apart: a database outage does not undo it."""
    try:
        outcome = await controller.ledger.reload_policy_file()
    except WriteFailed as exc:
        log.error("policy_reload_failed", error=exc.outcome.detail, applied=False)
        return
    except Exception as exc:  # a bad file keeps the running policy
        log.error("policy_reload_failed", error=str(exc), applied=False)
        return
    log.info(
        "policy_reloaded",
        source=controller.policy.source,
        version=outcome.policy_version,
        durable=outcome.durable,
    )
    if outcome.policy_version is None:
        log.warning("policy_version_not_stored", detail=outcome.detail)


@dataclass(frozen=True)
class _DbAtStart:
    ok: bool  # migrated and reachable
    state: OperatorState | None
    revision: int
    caps: dict[str, float]
    store_id: str | None = None


async def _authority(
    settings: ControllerSettings, policy: Policy, db: _DbAtStart
) -> Authority | None:
    """Whom this controller commands for: the policy's site, the store, the lease's domain.
    None for a shadow, which commands nothing."""
    if settings.shadow:
        return None
    store_id = await asyncio.to_thread(_store_id, db, settings.state_path())
    authority = Authority(
        site=policy.site, store=store_id, domain=settings.scope or policy.groups[0].name
    )
    log.info("authority", authority=authority.label(), store=store_id)
    return authority


def _store_id(db: _DbAtStart, state_path: Path) -> str:
    """(worker thread) The store's id, kept beside the state file: a controller that starts
    while its database is down commands for the store it last knew (agents refuse another
    store's commands while this one's are alive). Never seen: an id of this host's own,
    which agents obeying the real store refuse, as they should."""
    cache = state_path.with_name(state_path.name + ".store-id")
    if db.store_id is not None:
        try:
            if not cache.exists() or cache.read_text(encoding="ascii").strip() != db.store_id:
                cache.write_text(db.store_id + "\n", encoding="ascii")
        except OSError as exc:
            log.warning("store_id_not_cached", path=str(cache), error=str(exc))
        return db.store_id
    try:
        known = cache.read_text(encoding="ascii").strip()
    except OSError:
        known = ""
    if known:
        log.warning("store_id_from_cache", store=known, why="the database did not answer")
        return known
    made = "unreached-" + secrets.token_hex(8)
    log.error("store_id_unknown", store=made, why="the database did not answer at start")
    return made


def _open_db(store: Store, url: str, *, migrate: bool = True) -> _DbAtStart:
    """(worker thread) Migrate, then read the operators' state and the caps last stored."""
    try:
        if migrate:
            upgrade(url)
        store_id = store.store_id()
        row = store.latest_operator_state()
        caps = store.latest_caps()
    except Exception as exc:
        log.error("store_unreachable_at_start", error=f"{type(exc).__name__}: {exc}"[:300])
        return _DbAtStart(False, None, 0, {})
    state = None
    if row is not None:
        try:
            state = OperatorState.model_validate(row.state | {"revision": row.revision})
        except ValidationError as exc:
            log.error("operator_state_unreadable", where="database", error=str(exc)[:300])
    return _DbAtStart(True, state, 0 if row is None else row.revision, caps, store_id)


def _load_state_file(state_file: StateFile, *, move_aside: bool = True) -> OperatorState | None:
    """(worker thread) The state file; an unreadable one is moved aside (and logged) so the
    next write does not destroy what an operator may want to read (a shadow, which writes
    none, leaves it where it is)."""
    try:
        return state_file.load()
    except StateFileError as exc:
        if not move_aside:
            log.error("operator_state_unreadable", where="file", error=str(exc)[:300])
            return None
        aside = state_file.path.with_name(f"{state_file.path.name}.bad-{int(time.time())}")
        with contextlib.suppress(OSError):
            state_file.path.rename(aside)
        log.error("operator_state_unreadable", where="file", error=str(exc)[:300], moved=str(aside))
        return None


def _newer(file: OperatorState | None, db: OperatorState | None) -> OperatorState | None:
    """The higher revision; the file on a tie (it also holds the queued audit rows)."""
    if file is None or (db is not None and db.revision > file.revision):
        if db is not None:
            log.info("operator_state_from_database", revision=db.revision)
        return db
    return file


def _choose_policy(
    file_policy: Policy, file_sha: str | None, state: OperatorState | None
) -> tuple[Policy, ApiPolicy | None]:
    """A policy replaced through the API stays in force while the policy file is unchanged
    since; a file edited since wins (the operator's later word)."""
    api = state.api_policy if state is not None else None
    if api is None:
        return file_policy, None
    if api.file_sha256 != file_sha:
        log.warning(
            "policy_from_file",
            why="the policy file changed since the API replaced the policy",
            api_policy_sha256=api.sha256[:12],
            api_policy_by=api.actor,
        )
        return file_policy, None
    try:
        policy = load_policy_text(api.text, "api")
    except PolicyError as exc:
        log.error("policy_from_file", why=f"the API's policy is no longer valid: {exc}"[:300])
        return file_policy, None
    log.info(
        "policy_from_api",
        why="replaced through the API; the policy file is unchanged since",
        sha256=api.sha256[:12],
        by=api.actor,
        at=api.ts,
    )
    return policy, api
