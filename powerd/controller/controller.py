"""The daemon around the tick engine: messages in, the plan out, the records kept.

`TickEngine` (tick.py) decides; this shell does the I/O around it: it subscribes and
routes each message to the engine (decoded; bad ones counted and dropped), runs the tick
timer, publishes each tick's plan, hands the report to the store writer, metrics and the
live view off the tick's path, keeps the controller's status and last will, and hosts the
operators' writes (`AdminWrites`, `Ledger`: controller/admin.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any

import numpy as np
import structlog
from pydantic import ValidationError

from powerd.allocator import ClassTable
from powerd.clock import Clock
from powerd.controller.admin import AdminWrites, Ledger
from powerd.controller.fleet import FleetState
from powerd.controller.leadership import Leadership
from powerd.controller.meter_reader import MeterReader, meter_specs
from powerd.controller.opstate import ApiPolicy, OperatorState, StateFile
from powerd.controller.overrides import Overrides
from powerd.controller.report import TickReport, TickSummary
from powerd.controller.scope import ScopeLink
from powerd.controller.tick import AckHeard, TickEngine
from powerd.numeric import finite_or_none
from powerd.policy import Policy
from powerd.safety import SafePlan, SafetyPlanner
from powerd.store import (
    EventRecord,
    GpuRecord,
    Severity,
    Store,
    StoreHealth,
    StoreWriter,
    TickRecord,
)
from powerd.transport import ConnectionState, LastWill, Message, Transport, TransportError
from powerd.transport.base import cancel_and_wait
from powerd.wire import (
    Authority,
    CapAck,
    ControllerState,
    ControllerStatus,
    NodeStatus,
    NodeTelemetry,
    ScopeBudget,
    ScopeReport,
    Topics,
    WireError,
    decode,
    encode,
)

log = structlog.get_logger(__name__)
# A meter reader whose thread ended (it should not: each meter's failures stay its own) is
# started again, at most this often: its groups steer on their strict budgets meanwhile.
METER_RESTART_S = 5.0

# What the store keeps of each GPU, read off the fleet's record of it.
_INVENTORY_FIELDS = tuple(f.name for f in fields(GpuRecord))


@dataclass
class Counters:
    received: Counter[str] = field(default_factory=Counter)  # by message kind
    dropped: Counter[str] = field(default_factory=Counter)  # by reason
    caps_sent: int = 0  # commands published
    publish_failed: int = 0
    withheld: int = 0  # commands planned but not sent: the lease ran out first
    shadowed: int = 0  # commands a shadow controller would have sent
    ticks: int = 0
    ack_ticks: int = 0  # of them, extra ticks run on the acks of a tick that held raises


@dataclass(frozen=True)
class ControllerHealth:
    broker_connected: bool
    store: StoreHealth | None
    last_tick_age_s: float | None
    ready: bool


@dataclass(frozen=True)
class ControllerOptions:
    """What a controller's settings say of it (main.py reads them from ControllerSettings);
    the defaults are a test's, the demo's."""

    controller_id: str = "powerd-controller"
    solver: str = "fast"  # the allocator's (powerd.allocator)
    topics: Topics = field(default_factory=Topics)
    policy_path: str | None = None  # the policy file (SIGHUP reloads it); None: none
    # Decide every tick as if commanding and send nothing (docs/operations.md, "Shadow mode").
    shadow: bool = False
    scope: str | None = None  # steer this group's subtree under a coordinator
    history: int = 600  # ticks kept in memory for the API


@dataclass(frozen=True)
class StartState:
    """What a controller finds at start (main.py reads it: the policy file, the state file,
    the database); the defaults are a fresh start's, with nothing stored."""

    state: OperatorState | None = None  # the operators' state to restore
    api_policy: ApiPolicy | None = None  # a policy replaced through the API, still in force
    db_revision: int = 0  # of the operators' state in the database
    file_revision: int = 0  # in the state file
    schema_ready: bool = True  # False: the database was not migrated (down at start)
    file_policy: Policy | None = None  # the policy file's, when the API's is in force
    policy_version: int | None = None  # the policy in force as stored, when known


class Controller(AdminWrites):
    """The steering daemon: a `TickEngine` fed from the transport, its plans published.
    Operators' writes (`AdminWrites`) live in controller/admin.py, made durable by its
    `Ledger`. `build_controller` (controller/build.py) builds one, engine and lease with it."""

    def __init__(
        self,
        engine: TickEngine,
        transport: Transport,
        clock: Clock,
        options: ControllerOptions,
        *,
        store: Store | None,
        writer: StoreWriter | None,
        state_file: StateFile | None,
        scope: ScopeLink | None,
        leadership: Leadership | None,
        start: StartState,
    ) -> None:
        self.engine = engine
        self.transport = transport
        self.clock = clock
        self.store = store
        self.writer = writer
        self.controller_id = options.controller_id
        # The leader epoch every command carries: agents refuse commands of a lower epoch
        # than one they have seen. Set each tick from `leadership` (none: stays as set).
        self.epoch = 0
        # Whether this controller may command (a lease in the database); None: it always
        # may (tests, the simulator's loop). main.py gives one to every daemon but a shadow.
        self.leadership = leadership
        # Called once per round of the loop with whether this controller led in it: a
        # standby never ticks, but systemd's watchdog and the metrics still hear from it.
        self.on_round: list[Callable[[bool], None]] = []
        # The policy from the file (a standby that follows the leader back from an API
        # policy to the file's).
        self.file_policy = start.file_policy
        # Steering one scope under a coordinator (controller/scope.py); None: the whole
        # policy, on its own budgets.
        self.scope = scope
        self.topics = options.topics
        self.policy_path = options.policy_path
        self.counters = Counters()
        # Raises on acks (control.ack_ticks): the nodes the last tick commanded while it held
        # raises back, not yet heard acknowledging; the event is set when the last one has.
        self._ack_wait: set[str] = set()
        self._ack_tick = 0  # the tick whose acks those are
        self._acks_in = asyncio.Event()
        self.history: deque[TickSummary] = deque(maxlen=options.history)
        self.last_tick: TickReport | None = None
        self.on_tick: list[Callable[[TickReport], None]] = []  # metrics, live view, watchdog
        self.policy_version = start.policy_version
        # Metered groups' meters, polled off the loop into the engine's book while `run`
        # runs (controller/meter_reader.py); restarted when the policy in force changes.
        self.meter_reader = MeterReader(engine.meter_book, clock)
        self._metered_policy: Policy | None = None
        self._meters_started_at = -math.inf  # monotonic: a dead reader restarts at most so often
        self._stored_gpus: set[str] = set()
        self._inventoried: tuple[int, int, int] | None = None  # the shape whose GPUs are stored
        # Operators' writes made durable (state file, database), from the state found at
        # start. A shadow steers nothing, so it records nothing as if it did: no ledger
        # store, no state file to save.
        self.ledger = Ledger(
            self,
            store=None if engine.shadow else store,
            state_file=None if engine.shadow else state_file,
            schema_ready=start.schema_ready,
        )
        self.ledger.start_from(
            start.state,
            api_policy=start.api_policy,
            db_revision=start.db_revision,
            file_revision=start.file_revision,
        )

    # -- the engine's state, as the admin writes, the API and metrics see it -------------

    @property
    def policy(self) -> Policy:
        return self.engine.policy

    @property
    def authority(self) -> Authority | None:
        """The authority this controller commands for (main.py's: the policy's site, the
        store's id, the lease's domain); None: commands carry the empty one."""
        return self.engine.obedience.authority

    @authority.setter
    def authority(self, value: Authority | None) -> None:
        self.engine.obedience.authority = value

    @property
    def overrides(self) -> Overrides:
        return self.engine.overrides

    @overrides.setter
    def overrides(self, value: Overrides) -> None:
        self.engine.overrides = value

    @property
    def fleet(self) -> FleetState:
        return self.engine.fleet

    @property
    def planner(self) -> SafetyPlanner:
        return self.engine.planner

    @property
    def classes(self) -> ClassTable:
        return self.engine.targets.classes

    @property
    def solver(self) -> str:
        return self.engine.targets.solver

    @property
    def tick_no(self) -> int:
        return self.engine.tick_no

    @property
    def alarms(self) -> dict[str, str]:
        """Active alarms: kind → message."""
        return self.engine.alarms.active

    def adopt_policy(self, policy: Policy) -> None:
        """Steer by this policy from the next tick, with no audit row (the ledger's restores
        and roll-backs; an operator's replacement is `replace_policy`)."""
        self.engine.adopt(policy)

    def set_alarm(self, kind: str, message: str | None) -> None:
        """Raise (message) or clear (None) an alarm; recorded only on a change."""
        self.engine.alarms.set(kind, message, self.clock.wall())
        self._record_alarms()

    def _record_alarms(self) -> None:
        changes = self.engine.alarms.take()
        if self.writer is None:
            return
        for ch in changes:
            if ch.message is None:
                self.writer.submit_clear(ch.kind, ch.ts)
                continue
            self.writer.submit_event(
                EventRecord(
                    ts=ch.ts,
                    kind=ch.kind,
                    severity=ch.severity,
                    message=ch.message,
                    data=ch.data or {},
                )
            )
            if ch.severity is not Severity.ALARM:  # an event, not an alarm: closed at once
                self.writer.submit_clear(ch.kind, ch.ts)

    # -- messages ------------------------------------------------------------------------

    def handle(self, message: Message, now: float) -> None:
        """Route one message; bad ones are counted and dropped, never raised.

        Everything a node sends is untrusted: the wire models bound every field, a node's
        readings reach only its own GPUs (the planner looks up the node's uuids, not the
        message's), and any failure stays inside this message.
        """
        try:
            self._route(message, now)
        except WireError as exc:
            self.counters.dropped[exc.reason] += 1
            log.warning(
                "message_dropped", topic=message.topic[:200], reason=exc.reason, detail=exc.detail
            )
        except Exception as exc:
            # A fault of ours that this message found: the message is lost, not the controller.
            self.counters.dropped["internal_error"] += 1
            self.engine.message_failed(f"{type(exc).__name__}: {exc}")
            log.exception("message_failed", topic=message.topic[:200])

    def _route(self, message: Message, now: float) -> None:
        other = self.topics.parse_controller_topic(message.topic)
        if other is not None:
            if other != self.controller_id:
                self.counters.received["controller_status"] += 1
                self.engine.on_controller_status(other, decode(message.payload, ControllerStatus))
            return
        scoped = self.topics.parse_scope_topic(message.topic)
        if scoped is not None:
            self._route_scope(*scoped, message, now)
            return
        node, kind = self.topics.parse_node_topic(message.topic)
        self.counters.received[kind] += 1
        if kind == "telemetry":
            known = self.engine.on_telemetry(
                decode(message.payload, NodeTelemetry, topic_node=node), now
            )
        elif kind == "ack":
            ack = decode(message.payload, CapAck, topic_node=node)
            heard = self.engine.on_ack(node, ack)
            known = bool(heard)
            if heard is AckHeard.OURS:  # another epoch's or authority's answers no wait
                self._ack_heard(node, ack.tick)
        elif kind == "status":
            known = self.engine.on_status(
                node, decode(message.payload, NodeStatus, topic_node=node)
            )
        elif kind == "caps":  # our own commands come back only if subscribed broadly
            return
        else:
            raise WireError("bad_topic", message.topic[:200])
        if not known:
            self.counters.dropped["unknown_node"] += 1

    def _route_scope(self, scope: str, kind: str, message: Message, now: float) -> None:
        link = self.scope
        if link is None or scope != link.name or kind != "budget":
            raise WireError("bad_topic", message.topic[:200])
        self.counters.received["scope_budget"] += 1
        if not link.on_budget(decode(message.payload, ScopeBudget), now):
            self.counters.dropped["stale_budget"] += 1

    def _scope_budget(self) -> bool:
        """Hand the coordinator's budget in force to the engine; False while a scope that
        has heard no budget yet waits (docs in controller/scope.py)."""
        link = self.scope
        if link is None:
            return True
        now = self.clock.monotonic()
        force = link.in_force(now)
        self.engine.scope_budget_w = force.budget_w
        return force.budget_w is not None

    async def publish_scope_report(self, report: TickReport) -> None:
        """The scope's report to the coordinator: what it enforces, commits and wants."""
        link = self.scope
        curve = self.engine.last_curve
        if link is None or curve is None:
            return
        force = link.in_force(self.clock.monotonic())
        g = self.engine.scope_group
        off = self.engine.curve_offset_w
        try:
            msg = ScopeReport(
                scope=link.name,
                controller_id=self.controller_id,
                epoch=self.epoch,
                tick=report.tick,
                ts=report.ts,
                budget_epoch=force.epoch,
                budget_tick=force.tick,
                budget_w=finite_or_none(float(report.group_budget_w[g])) or 0.0,
                committed_w=float(report.group_committed_w[g]),
                draw_w=finite_or_none(float(report.group_draw_w[g])),
                failsafe_w=link.failsafe_w,
                # The curve is of the GPUs' caps; the budget at the root also holds overhead.
                lo_w=curve.lo_w + off,
                hi_w=curve.hi_w + off,
                offset_w=off,
                curve_budget_w=(curve.budget_w + off).tolist(),
                curve_price=curve.price.tolist(),
                curve_exact_lo_w=curve.exact_lo_w + off,
                curve_exact_hi_w=curve.exact_hi_w + off,
            )
        except ValidationError as exc:  # a curve out of the wire's bounds: say so, skip
            log.error("scope_report_invalid", error=str(exc).splitlines()[0][:200])
            return
        try:
            await self.transport.publish(self.topics.scope_report(link.name), encode(msg), qos=1)
        except TransportError as exc:
            log.warning("scope_report_not_published", error=str(exc))

    # -- the tick ------------------------------------------------------------------------

    def step(self, *, early: bool = False) -> tuple[TickReport, SafePlan]:
        """One tick's decisions, synchronously (publishing is `run`'s job); `early`: a tick
        on acks, commanding only the nodes whose caps move."""
        try:
            return self.engine.step(self.clock.monotonic(), self.clock.wall(), early=early)
        finally:
            self._record_alarms()
            self._store_inventory()

    def _store_inventory(self) -> None:
        """The GPUs of a new fleet shape that the store has not seen yet."""
        shape = self.engine.shape
        if self.writer is None or shape is None or shape.version == self._inventoried:
            return
        self._inventoried = shape.version
        new = [u for u in shape.layout.uuids if u not in self._stored_gpus]
        if not new:
            return
        gpus = self.fleet.gpus
        self.writer.submit_gpus(
            GpuRecord(**{f: getattr(gpus[u], f) for f in _INVENTORY_FIELDS}) for u in new
        )
        self._stored_gpus.update(new)

    def leading(self) -> bool:
        """Whether this controller may command now: not once another controller of our
        authority says it leads at a higher epoch (a leader steering through a database
        outage stops there)."""
        lead = self.leadership
        if lead is None:
            return True
        if self.engine.obedience.superseded_by > lead.epoch:
            lead.supersede(self.engine.obedience.superseded_by)
        return lead.may_command()

    def _sync_epoch(self) -> None:
        """The epoch this tick's commands carry: the lease's; alone, at least the one the
        agents have seen (nobody else commands, and a lease the database could not give at
        start must not leave every agent refusing us)."""
        lead = self.leadership
        if lead is None:
            return
        if lead.mode == "lease":
            self.epoch = lead.epoch
        else:
            self.epoch = max(lead.epoch, self.engine.agents_epoch())
        self.engine.obedience.epoch = self.epoch

    def _learn_store_id(self, lead: Leadership) -> None:
        """Under a lease, the store's id as its database says: one guessed (or cached) at a
        start during a database outage is replaced before this controller leads (no lease
        is taken before the id is read)."""
        authority = self.authority
        known = lead.store_id
        if lead.mode == "lease" and authority is not None and known and authority.store != known:
            log.warning("store_id_learned", was=authority.store, store=known)
            self.authority = authority.model_copy(update={"store": known})

    def epoch_to_overtake(self) -> int:
        """For the lease: an epoch the agents report above ours (0 if none), which the
        next lease's epoch must exceed (a database recreated, or restored from a backup)."""
        seen = self.engine.agents_epoch()
        lead = self.leadership
        ours = lead.epoch if lead is not None and lead.leading else 0
        return seen if seen > ours else 0

    def handing_to(self) -> tuple[str, ...]:
        """For the lease's scope registry: the domains of our store this controller hands
        its nodes to (`hand_over`), which may lead meanwhile though they overlap ours."""
        ours = self.authority
        return tuple(
            a.domain for a in self.overrides.handover if ours is not None and a.store == ours.store
        )

    async def publish_plan(self, plan: SafePlan) -> None:
        self._await_acks(plan)
        if self.engine.shadow:
            # Stored and shown as what would have been sent (the tick's record); never sent.
            self.counters.shadowed += len(plan.commands)
            return
        if not self.leading():
            # The lease ran out while the tick was decided: not one command leaves. The
            # planner counts them as sent (pending), which only holds raises back.
            self.counters.withheld += len(plan.commands)
            log.warning("commands_withheld", tick=plan.tick, commands=len(plan.commands))
            return
        ts = self.clock.wall()
        handover = self.overrides.handover
        batch = [
            (
                self.topics.caps(cmd.node),
                encode(cmd.to_wire(ts, self.controller_id, self.epoch, self.authority, handover)),
            )
            for cmd in plan.commands
        ]
        try:
            failed = await self.transport.publish_many(batch, qos=1)
        except TransportError as exc:
            failed = len(batch)
            log.warning("caps_publish_failed", tick=plan.tick, commands=failed, error=str(exc))
        else:
            if failed:
                log.warning("caps_publish_failed", tick=plan.tick, commands=failed)
        self.counters.caps_sent += len(batch) - failed
        self.counters.publish_failed += failed
        if failed:
            self._ack_wait = set()  # an ack that may never come: the next tick as usual

    def _await_acks(self, plan: SafePlan) -> None:
        """A tick that held raises back for want of room waits on the acks of its cuts (they
        free that room): once every node it cuts has acknowledged, the loop ticks again at
        once (`control.ack_ticks`), not a whole tick later. Armed before the commands leave,
        so that no ack can come before it.

        Only raises another tick could make count, and only cuts not refused
        (`SafePlan.cuts_awaited`): waiting on what no ack answers would buy an extra tick
        every period for nothing."""
        self._acks_in.clear()
        self._ack_wait = set()
        if self.engine.shadow or not self.leading():
            return
        awaited = self.engine.cuts_awaited(plan)
        if awaited:
            self._ack_wait, self._ack_tick = awaited, plan.tick

    def _ack_heard(self, node: str, tick: int) -> None:
        """An ack of `tick` from `node`: an older tick's (late) does not answer the wait."""
        if tick >= self._ack_tick and node in self._ack_wait:
            self._ack_wait.discard(node)
            if not self._ack_wait:
                self._acks_in.set()

    def _record(self, report: TickReport, plan: SafePlan) -> None:
        self.last_tick = report
        summary = TickSummary.of(report)
        self.history.append(summary)
        self.counters.ticks += 1
        if self.writer is not None:
            if self.engine.shadow:
                self._record_fleet(self.writer, report)
            else:
                self._record_steered(self.writer, report, plan, summary)
            health = self.writer.health()
            # Before its first flush the writer is not yet "connected", but nothing failed.
            failing = not health.connected and health.last_error is not None
            self.set_alarm(
                "store_unreachable",
                f"store unreachable: {health.last_error}; backlog {health.backlog}, "
                f"dropped {health.dropped}"
                if failing
                else None,
            )
        for hook in self.on_tick:
            try:
                hook(report)
            except Exception:
                log.exception("tick_hook_failed")

    @staticmethod
    def _record_steered(
        writer: StoreWriter, report: TickReport, plan: SafePlan, summary: TickSummary
    ) -> None:
        """What a steering controller stores of a tick: its summary, the caps it sent (with
        their reasons), each GPU's sample and each budget group's use."""
        writer.submit_tick(
            TickRecord.from_summary(
                summary,
                rows={
                    name: {
                        "budget_w": finite_or_none(b),
                        "load_w": committed,  # the stored key (docs/storage.md)
                        "draw_w": finite_or_none(d),
                    }
                    for name, b, committed, d in report.level_totals(1)
                },
            )
        )
        by_node: dict[str, dict[str, float]] = {}
        for cmd in plan.commands:
            by_node[cmd.node] = dict(cmd.caps_w)
        writer.submit_caps(report.tick, report.ts, by_node, report.why)
        if report.status != "tick_failed":  # a failed tick measured nothing
            writer.submit_samples(
                list(report.uuids),
                report.ts,
                report.power_w.copy(),
                report.committed_w.copy(),
                report.energy_j.copy(),
                perf=None if report.perf is None else report.perf.copy(),
            )
            # Copies of arrays with one value a budget group: a few µs.
            limit_w = report.group_limit_w
            if limit_w is None:  # a tick that fell back: the budgets
                limit_w = report.group_budget_w
            writer.submit_groups(
                report.ts,
                names=report.group_names,
                levels=report.group_levels,
                budget_w=report.group_budget_w.copy(),
                limit_w=limit_w.copy(),
                committed_w=report.group_committed_w.copy(),
                draw_w=report.group_draw_w.copy(),
            )

    def _record_fleet(self, writer: StoreWriter, report: TickReport) -> None:
        """A shadow given a database of its own (`record_db`) records what the fleet did,
        never what it decided: per GPU and minute the draw, energy, reported perf and the
        limit its agent reports in force (as `mean_cap_w`), and each budget group's draw
        against its budget with those limits summed as its committed watts. No ticks, cap
        changes or reasons: it sent nothing. The baseline of a pilot (docs/operations.md,
        "Pilot")."""
        if report.status == "tick_failed":
            return
        in_force = np.nan_to_num(report.cap_w, nan=0.0)  # not reported: counted as none
        writer.submit_samples(
            list(report.uuids),
            report.ts,
            report.power_w.copy(),
            in_force,
            report.energy_j.copy(),
            perf=None if report.perf is None else report.perf.copy(),
        )
        shape = self.engine.shape
        if shape is None or shape.topology.gpu_groups.shape[0] != in_force.size:
            return
        topo = shape.topology
        writer.submit_groups(
            report.ts,
            names=report.group_names,
            levels=report.group_levels,
            budget_w=report.group_budget_w.copy(),
            limit_w=report.group_budget_w.copy(),
            committed_w=topo.group_sums(in_force) + topo.overhead_w,
            draw_w=report.group_draw_w.copy(),
        )

    def _follow_meters(self) -> None:
        """Poll the meters of the policy in force (a new policy's: the old ones stop), and
        start the reader again if its thread has ended (its groups went stale meanwhile)."""
        policy = self.engine.policy
        if policy is self._metered_policy:
            if self.meter_reader.running or not self.engine.meters.specs:
                return
            now = self.clock.monotonic()
            if now - self._meters_started_at < METER_RESTART_S:
                return
            log.warning("meter_reader_restarted", meters=len(self.engine.meters.specs))
        else:
            specs = meter_specs(policy)
            old = self._metered_policy
            if old is not None and specs == meter_specs(old) and self.meter_reader.running:
                self._metered_policy = policy
                return
        self.meter_reader.stop(wait=False)
        self.meter_reader.start(meter_specs(policy))
        self._metered_policy = policy
        self._meters_started_at = self.clock.monotonic()

    async def tick_once(self, *, early: bool = False) -> TickReport:
        """One tick, published; `early`: a tick on acks (`control.ack_ticks`)."""
        t0 = time.perf_counter()
        self._follow_meters()
        report, plan = self.step(early=early)
        try:
            await self.publish_plan(plan)
            if self.scope is not None and self.leading():
                await self.publish_scope_report(report)
        finally:
            # A stop that cancels the publishing still records the tick: some of its
            # commands are out, and the store must know the caps that may be in force.
            report = replace(report, duration_ms=(time.perf_counter() - t0) * 1000.0)
            self._record(report, plan)
            # One line per tick at debug level (bench/scopes_loop.py reads it).
            log.debug(
                "tick_done",
                tick=report.tick,
                duration_ms=round(report.duration_ms, 3),
                solve_ms=round(report.solve_ms, 3),
                gpus=len(report.uuids),
            )
        return report

    # -- running -------------------------------------------------------------------------

    def health(self) -> ControllerHealth:
        connected = self.transport.state is ConnectionState.CONNECTED
        store = self.writer.health() if self.writer is not None else None
        age = None
        if self.last_tick is not None:
            age = max(0.0, self.clock.wall() - self.last_tick.ts)
        tick_s = self.policy.control.tick_s
        ready = connected and age is not None and age < 3 * tick_s + 1.0
        return ControllerHealth(connected, store, age, ready)

    def _status(self, state: ControllerState) -> bytes:
        lead = self.leadership
        return encode(
            ControllerStatus(
                controller_id=self.controller_id,
                state=state,
                ts=self.clock.wall(),
                tick=self.tick_no or None,
                scope=None if lead is None else lead.scope,
                epoch=self.epoch
                if lead is None or state is ControllerState.ACTIVE
                else lead.leader_epoch,
                authority=self.authority,
            )
        )

    def _state(self, leading: bool) -> ControllerState:
        if self.engine.shadow:
            return ControllerState.SHADOW
        return ControllerState.ACTIVE if leading else ControllerState.STANDBY

    async def _announce(self, leading: bool) -> None:
        """Our retained status says whether we lead, stand by, or only shadow."""
        state = self._state(leading)
        try:
            await self.transport.publish(
                self.topics.controller_status(self.controller_id),
                self._status(state),
                qos=1,
                retain=True,
            )
        except TransportError as exc:
            log.warning("controller_status_not_published", error=str(exc))

    async def run(self, stop: asyncio.Event, *, learn_s: float | None = None) -> None:
        """Steer until `stop` is set. Listens for `learn_s` (default: one stale period)
        before the first tick, so retained status and telemetry teach the caps in force."""
        status_topic = self.topics.controller_status(self.controller_id)
        will = LastWill(status_topic, self._status(ControllerState.OFFLINE))

        async def on_connect() -> None:
            await self.transport.publish(
                status_topic,
                self._status(self._state(self.leading())),
                qos=1,
                retain=True,
            )

        await self.transport.connect(will=will, on_connect=on_connect)
        await self._subscribe()
        log.info(
            "controller_started",
            controller=self.controller_id,
            solver=self.solver,
            nodes=len(self.fleet.node_order),
            tick_s=self.policy.control.tick_s,
            scope=None if self.leadership is None else self.leadership.scope,
            leadership=None if self.leadership is None else self.leadership.mode,
        )
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [
                    tg.create_task(self._listen(), name="controller-listen"),
                    tg.create_task(self._tick_loop(stop, learn_s), name="controller-ticks"),
                ]
                await stop.wait()
                await cancel_and_wait(loops)
        finally:
            with contextlib.suppress(TransportError):
                await self.transport.publish(
                    status_topic,
                    self._status(ControllerState.OFFLINE),
                    qos=1,
                    retain=True,
                )
            await self.transport.disconnect()
            await asyncio.to_thread(self.meter_reader.stop)
            self._metered_policy = None
            log.info("controller_stopped", ticks=self.counters.ticks)

    async def _subscribe(self) -> None:
        """Every node's messages; a scope's controller only its own nodes' (and the
        coordinator's budgets for it)."""
        kinds = (("telemetry", 0), ("ack", 1), ("status", 1))
        # Every controller's status: another that leads an overlapping domain is an alarm.
        await self.transport.subscribe(self.topics.all_controllers(), qos=1)
        if self.scope is None:
            for kind, qos in kinds:
                await self.transport.subscribe(self.topics.all_nodes(kind), qos=qos)
            return
        await self.transport.subscribe(self.topics.scope_budget(self.scope.name), qos=1)
        for node in self.fleet.node_order:
            for kind, qos in kinds:
                topic = getattr(self.topics, kind)(node)
                await self.transport.subscribe(topic, qos=qos)

    async def _listen(self) -> None:
        async for message in self.transport.messages():
            self.handle(message, self.clock.monotonic())

    async def _tick_loop(self, stop: asyncio.Event, learn_s: float | None) -> None:
        control = self.policy.control
        await self.transport.wait_connected()
        await self.clock.sleep(control.stale_after_s if learn_s is None else learn_s)
        next_at = self.clock.monotonic()
        frozen: tuple[int, int, int] | None = None
        announced: bool | None = None
        early, extra = False, 0  # a tick on acks (control.ack_ticks), and how many this period
        self._acks_in = asyncio.Event()  # of this loop (an Event binds to the first that waits)
        while not stop.is_set():
            lead = self.leadership
            if lead is not None:
                lead.changed.clear()  # a change from here on wakes the sleep below
                lead.check_deadline()
                self._learn_store_id(lead)
            leading = self.leading() and self._scope_budget()
            if leading:
                # Before the announcement: the retained status must carry the epoch we
                # lead at, which is what stops a leader steering through an outage.
                self._sync_epoch()
            if leading != announced:
                announced = leading
                await self._announce(leading)
            if leading:
                try:
                    await self.tick_once(early=early)
                except Exception:
                    # Only when not even the fallback could plan (no fleet yet): agents
                    # keep their leases' failsafe; the next tick tries again.
                    log.exception("tick_lost", tick=self.tick_no)
            else:
                self._rest_meters()
                self._observe()
            self._round_hooks(leading)
            shape = self.engine.shape
            if shape is not None and shape.version != frozen:
                frozen = shape.version
                _freeze_heap()
            next_at, early, extra = await self._until_next(next_at, early, extra, leading)

    async def _until_next(
        self, next_at: float, early: bool, extra: int, leading: bool
    ) -> tuple[float, bool, int]:
        """Wait for the next tick: the next regular one (`next_at` moves on by a tick after
        a regular one), one at once on a change of leadership, or an extra one on acks
        (`control.ack_ticks` of them at most between two regular ticks). Returns the next
        regular tick's time, whether the next tick is an extra one, and how many extra ones
        this period has had."""
        if not early:
            next_at += self.policy.control.tick_s
            extra = 0
        now = self.clock.monotonic()
        if now > next_at:  # overran: skip the missed ticks rather than bunching them
            if not early:
                log.warning("tick_overrun", late_s=round(now - next_at, 3))
            next_at = now
        # A regular tick that is due serves the acks as well: no extra tick just before it.
        acks = leading and extra < self.policy.control.ack_ticks and next_at > now
        woke = await self._sleep_or_change(next_at - now, acks=acks)
        if woke == "acks":
            self.counters.ack_ticks += 1
            return next_at, True, extra + 1
        if woke == "leadership":
            next_at = self.clock.monotonic()  # took over (or stepped down): at once
        return next_at, False, extra

    def _rest_meters(self) -> None:
        """A controller that does not lead reads no meter (the leader does; a PDU serves
        few sessions). Leading again, its first tick starts the reader, every meter unread
        (strict until it reads), as at a start."""
        if self._metered_policy is not None:
            self.meter_reader.stop(wait=False, forget=True)
            self._metered_policy = None
            log.info("meters_rested", why="not leading")

    def _observe(self) -> None:
        """A standby's round: the view kept warm, nothing decided or sent."""
        try:
            self.engine.observe(self.clock.monotonic())
        except Exception:
            log.exception("observe_failed")

    def _round_hooks(self, leading: bool) -> None:
        for hook in self.on_round:
            try:
                hook(leading)
            except Exception:
                log.exception("round_hook_failed")

    async def _sleep_or_change(self, delay: float, *, acks: bool = False) -> str:
        """Sleep `delay`: "time" when it has passed, "leadership" if the leadership changed
        meanwhile, "acks" (with `acks`) once every node the last tick cut while it
        held raises back has acknowledged (the sleep ends then)."""
        lead, acks_in = self.leadership, self._acks_in
        if acks and acks_in.is_set():
            acks_in.clear()
            return "acks"
        waiting = acks and bool(self._ack_wait)
        if lead is None and not waiting:
            await self.clock.sleep(delay)
            return "time"
        slept = asyncio.ensure_future(self.clock.sleep(delay))
        tasks: list[asyncio.Task[Any]] = [slept]
        if lead is not None:
            tasks.append(asyncio.ensure_future(lead.changed.wait()))
        if waiting:
            tasks.append(asyncio.ensure_future(acks_in.wait()))
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            timed = slept.done()
        finally:
            await cancel_and_wait(tasks)
        if lead is not None and lead.changed.is_set():
            return "leadership"
        # Acks in as the sleep ends: the regular tick (it serves them, and moves on).
        if waiting and not timed and acks_in.is_set():
            acks_in.clear()
            return "acks"
        return "time"


def _freeze_heap() -> None:
    """Move what the fleet's shape built (records, columns, topology, planner state) out of
    the garbage collector's sight, after the tick it was built for: it lives as long as the
    shape, and a full collection that walks it all pauses the tick for a time that grows
    with the fleet (docs/performance.md, "Steering loop")."""
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.debug("heap_frozen", objects=gc.get_freeze_count(), ms=(time.perf_counter() - t0) * 1e3)
