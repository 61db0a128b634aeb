"""`powerd coordinator`: the site service that splits the budgets above the scopes.

Each scope (a row or rack of the policy) is steered by its own `powerd controller --scope`
(with its standbys); the coordinator hears their reports, splits the facility's budget
(and the rows', when the scopes are racks) from their demand curves every tick, and sends
each scope its budget (BudgetSplitter: coordinator/split.py). It leads under the same
kind of lease as a controller (scope `<facility>/coordinator` in its database): run two
for a pair. Its admin API (powerd.api.routers.coordinator) shows the split and sets
temporary budgets on the groups above the scopes.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import ClassVar, Literal

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from pydantic import Field, ValidationError

from powerd.api.server import ApiServer
from powerd.auth import TokenStore
from powerd.clock import SystemClock
from powerd.controller.admin import store_operator_state
from powerd.controller.leadership import Leadership, for_daemon, mode_for
from powerd.controller.opstate import (
    BudgetState,
    OperatorState,
    StateFile,
    StateFileError,
    restore,
)
from powerd.controller.overrides import BudgetOverride
from powerd.coordinator.split import BudgetSplitter, CoordinatorReport
from powerd.policy import load_policy, overlapping_domains
from powerd.sdnotify import Notifier
from powerd.settings import ApiSettings, SettingsError
from powerd.store import Store, upgrade
from powerd.transport import MqttTransport, TransportError
from powerd.wire import ScopeBudget, ScopeReport, Topics, WireError, decode, encode

log = structlog.get_logger(__name__)


class CoordinatorSettings(ApiSettings):
    kind: ClassVar[str] = "coordinator settings"

    policy: Path = Path("/etc/powerd/policy.yaml")
    db: str = "postgresql://powerd@localhost/powerd_coordinator"
    # Distinct for each coordinator of a pair (the default is per host).
    coordinator_id: str = Field(
        default_factory=lambda: f"powerd-coordinator-{socket.gethostname()}"[:119],
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,118}$",
    )
    # The level whose groups are the scopes (each steered by `powerd controller --scope`).
    scope_level: Literal["row", "rack"] = "row"
    leadership: Literal["auto", "lease", "alone"] = "auto"
    leader_lease_s: float | None = Field(default=None, gt=0, le=3600)
    # Temporary budgets set through the API, kept across restarts.
    state_file: Path = Path("powerd-coordinator-state.json")
    api_host: str = "127.0.0.1"
    api_port: int | None = Field(default=None, ge=0, le=65535)
    tokens_file: Path | None = None
    dev: bool = False

    def client_name(self) -> str:
        return self.coordinator_id


class Coordinator:
    """The daemon around BudgetSplitter: reports in, budgets out, under a lease."""

    def __init__(
        self,
        splitter: BudgetSplitter,
        transport: MqttTransport,
        leadership: Leadership,
        *,
        coordinator_id: str,
        topics: Topics,
        state_file: Path,
        store: Store,
    ) -> None:
        self.splitter = splitter
        self.transport = transport
        self.leadership = leadership
        self.coordinator_id = coordinator_id
        self.topics = topics
        self.state_file = state_file
        self.store = store
        self.revision = 0  # of the temporary budgets, as stored
        self.clock = SystemClock()
        self.last: CoordinatorReport | None = None
        self.last_at = -math.inf
        self.epoch = 0
        self.sent = 0
        self.dropped: dict[str, int] = {}
        # Scope controllers that report a scope overlapping ours (a leftover --scope r1
        # beside k1 and k2): scope → its controller, shown in the status and logged. The
        # agents keep each node with one authority; this names the misconfiguration.
        self.overlapping: dict[str, str] = {}

    def handle(self, topic: str, payload: bytes) -> None:
        try:
            parsed = self.topics.parse_scope_topic(topic)
            if parsed is None or parsed[1] != "report":
                raise WireError("bad_topic", topic[:200])
            msg = decode(payload, ScopeReport)
            if msg.scope != parsed[0]:
                raise WireError("scope_mismatch", f"{msg.scope!r} on {topic[:200]!r}")
            if not self.splitter.on_report(msg, self.clock.monotonic(), self.epoch):
                self._unknown_scope(msg)
        except WireError as exc:
            self.dropped[exc.reason] = self.dropped.get(exc.reason, 0) + 1
            log.warning("report_dropped", topic=topic[:200], reason=exc.reason)
        except Exception:
            self.dropped["internal_error"] = self.dropped.get("internal_error", 0) + 1
            log.exception("report_failed", topic=topic[:200])

    def _unknown_scope(self, msg: ScopeReport) -> None:
        """A report of a scope we do not divide: overlapping one of ours is a
        misconfiguration, named (`scope_overlap`); otherwise it is dropped as unknown."""
        ours = set(self.splitter.scopes)
        hit = sorted(ours & set(overlapping_domains(self.splitter.policy, msg.scope)))
        if not hit:
            raise WireError("unknown_scope", msg.scope)
        if self.overlapping.get(msg.scope) != msg.controller_id:
            log.error(
                "scope_overlap",
                scope=msg.scope,
                controller=msg.controller_id,
                overlaps=hit,
                why="a controller steers a scope that overlaps this coordinator's scopes; "
                "its nodes obey one authority each, but stop the one that should not run",
            )
        self.overlapping[msg.scope] = msg.controller_id
        raise WireError("overlapping_scope", msg.scope)

    async def run(self, stop: asyncio.Event, learn_s: float) -> None:
        await self.transport.connect()
        await self.transport.subscribe(self.topics.all_scope_reports(), qos=1)
        log.info(
            "coordinator_started",
            coordinator=self.coordinator_id,
            scopes=sorted(self.splitter.scopes),
            scope_level=self.splitter.scope_level,
        )
        async with asyncio.TaskGroup() as tg:
            listen = tg.create_task(self._listen())
            ticks = tg.create_task(self._ticks(stop, learn_s))
            await stop.wait()
            listen.cancel()
            ticks.cancel()
        await self.transport.disconnect()

    async def _listen(self) -> None:
        async for m in self.transport.messages():
            self.handle(m.topic, m.payload)

    async def _ticks(self, stop: asyncio.Event, learn_s: float) -> None:
        await self.transport.wait_connected()
        await asyncio.sleep(learn_s)
        tick_s = self.splitter.policy.control.tick_s
        next_at = time.monotonic()
        while not stop.is_set():
            lead = self.leadership
            lead.changed.clear()
            lead.check_deadline()
            if lead.may_command():
                if lead.epoch != self.epoch:
                    self.epoch = lead.epoch  # a new epoch: earlier confirmations are void
                    self.splitter.forget_confirmations()
                try:
                    await self.tick_once()
                except Exception:
                    # Nothing of this tick is sent; the scopes hold their budgets until
                    # their leases lapse to min(budget, failsafe). The next tick tries again.
                    log.exception("tick_lost", tick=self.splitter.tick_no)
            next_at += tick_s
            now = time.monotonic()
            next_at = max(next_at, now)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lead.changed.wait(), next_at - now)

    async def tick_once(self) -> CoordinatorReport:
        report = self.splitter.step(self.clock.monotonic(), self.clock.wall(), self._tick_s())
        self.last, self.last_at = report, self.clock.monotonic()
        if not self.leadership.may_command():
            log.warning("budgets_withheld", tick=report.tick)
            return report
        batch = [
            (
                self.topics.scope_budget(p.scope),
                encode(
                    ScopeBudget(
                        scope=p.scope,
                        budget_w=p.budget_w,
                        tick=report.tick,
                        epoch=self.epoch,
                        lease_s=self.splitter.policy.control.lease_s,
                        ts=self.clock.wall(),
                        coordinator_id=self.coordinator_id,
                    )
                ),
            )
            for p in report.budgets
            if p.budget_w is not None and math.isfinite(p.budget_w)
        ]
        try:
            failed = await self.transport.publish_many(batch, qos=1)
        except TransportError as exc:
            failed = len(batch)
            log.warning("budgets_publish_failed", error=str(exc))
        self.sent += len(batch) - failed
        return report

    def epoch_to_overtake(self) -> int:
        """The highest coordinator epoch a scope reports enforcing, if above ours: a new
        lease's epoch goes above it (a recreated database must not leave every scope
        refusing us)."""
        seen = max(
            (s.report.budget_epoch or 0 for s in self.splitter.scopes.values() if s.report),
            default=0,
        )
        ours = self.leadership.epoch if self.leadership.leading else 0
        return seen if seen > ours else 0

    def _tick_s(self) -> float:
        return self.splitter.policy.control.tick_s

    # -- operators' budgets: in the database (both coordinators of a pair read it) and a
    # state file (the database may be down), before the API answers --------------------

    async def set_budget(
        self, group: str, budget_w: float, ttl_s: float | None, who: str, reason: str
    ) -> bool:
        now = self.clock.wall()
        self.splitter.overrides.set_budget(
            self.splitter.policy,
            BudgetOverride(
                group=group,
                budget_w=budget_w,
                expires_at=None if ttl_s is None else now + ttl_s,
                reason=reason,
                actor=who,
                created_at=now,
            ),
        )
        return await self._save()

    async def clear_budget(self, group: str) -> bool:
        self.splitter.overrides.clear_budget(group)
        return await self._save()

    def _state(self) -> OperatorState:
        return OperatorState(
            revision=self.revision,
            ts=self.clock.wall(),
            budgets=[BudgetState.of(b) for b in self.splitter.overrides.budgets.values()],
        )

    async def _save(self) -> bool:
        """The state file, then the database; True if the database has it (a standby that
        takes over reads it there)."""
        self.revision += 1
        state = self._state()
        await asyncio.to_thread(StateFile(self.state_file).save, state)
        try:
            self.revision = await asyncio.to_thread(store_operator_state, self.store, state)
        except Exception as exc:
            log.error("budgets_not_in_database", error=f"{type(exc).__name__}: {exc}"[:300])
            return False
        return True

    async def follow(self) -> None:
        """Adopt the budgets the database holds when newer than ours (a takeover, or a
        standby keeping up). Raises if the database cannot be read: a new leader must not
        split from budgets it could not check."""
        row = await asyncio.to_thread(self.store.latest_operator_state)
        if row is None or row.revision <= self.revision:
            return
        try:
            state = OperatorState.model_validate(row.state | {"revision": row.revision})
        except ValidationError as exc:
            # Not a state this release understands: keep ours and coordinate (waiting
            # would hold the lease with nothing sent); the log says why.
            log.error(
                "coordinator_state_unreadable",
                revision=row.revision,
                error=str(exc).splitlines()[0][:200],
            )
            self.revision = row.revision  # do not trip on it every round
            return
        self._adopt(state)

    def _adopt(self, state: OperatorState) -> None:
        self.splitter.overrides = restore(state, self.splitter.policy, self.clock.wall())
        self.revision = state.revision
        log.info(
            "budgets_restored",
            revision=state.revision,
            groups=sorted(self.splitter.overrides.budgets),
        )

    def load(self) -> None:
        """(worker thread, at start) The state file or the database, the newer."""
        try:
            from_file = StateFile(self.state_file).load()
        except StateFileError as exc:
            log.error("coordinator_state_unreadable", error=str(exc)[:300])
            from_file = None
        from_db = None
        try:
            row = self.store.latest_operator_state()
            if row is not None:
                from_db = OperatorState.model_validate(row.state | {"revision": row.revision})
        except Exception as exc:
            log.error("store_unreachable_at_start", error=f"{type(exc).__name__}: {exc}"[:300])
        newest = max(
            (s for s in (from_file, from_db) if s is not None),
            key=lambda s: s.revision,
            default=None,
        )
        if newest is not None:
            self._adopt(newest)


# -- its metrics, served by its API (powerd.api.routers.coordinator) --------------------


class _Metrics(Collector):
    """The coordinator's series, built at scrape time from its last tick."""

    def __init__(self, coord: Coordinator) -> None:
        self.coord = coord

    def collect(self) -> Iterator[Metric]:
        c = self.coord
        v = c.leadership.view()
        lead = GaugeMetricFamily(
            "powerd_coordinator_leader", "1 while this coordinator leads.", labels=["coordinator"]
        )
        lead.add_metric([c.coordinator_id], float(v.role == "leader"))
        yield lead
        epoch = GaugeMetricFamily(
            "powerd_coordinator_epoch", "The leading coordinator's epoch.", labels=["leader"]
        )
        epoch.add_metric([v.leader or ""], float(v.epoch))
        yield epoch
        r = c.last
        if r is None:
            return
        budget = GaugeMetricFamily(
            "powerd_scope_budget_watts", "Budget sent to each scope (W).", labels=["scope"]
        )
        committed = GaugeMetricFamily(
            "powerd_scope_committed_watts",
            "The most each scope may draw under the budgets sent (W).",
            labels=["scope"],
        )
        epochs = GaugeMetricFamily(
            "powerd_scope_leader_epoch",
            "Each scope's leader and epoch, from its latest report.",
            labels=["scope", "leader"],
        )
        for p in r.budgets:
            if p.budget_w is not None:
                budget.add_metric([p.scope], p.budget_w)
            committed.add_metric([p.scope], p.committed_w)
            rep = c.splitter.scopes[p.scope].report
            if rep is not None:
                epochs.add_metric([p.scope, rep.controller_id], float(rep.epoch))
        yield budget
        yield committed
        yield epochs
        yield GaugeMetricFamily(
            "powerd_coordinator_solve_seconds", "The last split's time.", value=r.solve_ms / 1e3
        )


async def run_coordinator(settings: CoordinatorSettings) -> None:
    policy = load_policy(settings.policy)
    splitter = BudgetSplitter(policy, settings.scope_level)
    url = settings.db
    await asyncio.to_thread(upgrade, url)
    mode = mode_for(settings.leadership, url)
    leadership = for_daemon(
        url,
        scope=f"{policy.groups[0].name}/coordinator",
        holder=settings.coordinator_id,
        control=policy.control,
        lease_s=settings.leader_lease_s,
        mode=mode,
    )
    if mode == "alone":
        await leadership.claim_alone()
    coord = Coordinator(
        splitter,
        MqttTransport(settings.mqtt_config()),
        leadership,
        coordinator_id=settings.coordinator_id,
        topics=Topics(settings.topic_prefix),
        state_file=settings.state_file,
        store=Store(url),
    )
    await asyncio.to_thread(coord.load)
    leadership.follow = coord.follow
    api = None
    if settings.api_port is not None:
        if settings.tokens_file is None:
            raise SettingsError(settings.kind, [("tokens_file", "the admin API needs one")])
        # Imported here: the API's routers import this module (its Coordinator).
        from powerd.api.app import create_coordinator_app

        tokens = TokenStore.from_file(settings.tokens_file, dev=settings.dev)
        registry = CollectorRegistry()
        registry.register(_Metrics(coord))
        app = create_coordinator_app(coord, tokens, registry)
        api = ApiServer(app, settings.api_host, settings.api_port, tls=settings.api_tls())
    notifier = Notifier()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    notifier.ready("coordinating")
    async with asyncio.TaskGroup() as tg:
        tg.create_task(leadership.run(stop, coord.epoch_to_overtake), name="leadership")
        if api is not None:
            tg.create_task(api.serve(stop), name="api")
        tg.create_task(coord.run(stop, learn_s=2 * policy.control.tick_s), name="coordinator")
