"""Operators' writes: validated and applied in memory on the loop, made durable off it.

`AdminWrites` (mixed into the Controller) validates a change and applies it to the
controller's memory: a dict update, cheap and synchronous, effective on the next tick. It
queues the audit row; it does no I/O.

`Ledger` makes the change durable and says what happened. Per write, in order:
1. the state file (`opstate.StateFile`, in a worker thread): the durability point, which
   works while the database is down. If it cannot be written, a change that only lowers
   power (a lower temporary budget, a drain) stays applied (safety wins) with an alarm;
   anything else is rolled back and the write answered as not applied;
2. the database (in a worker thread, one sync at a time): queued audit rows, policy
   versions and the operators' state by revision. The API waits for it at most `db_wait_s`;
   a database that is down or hangs leaves the rows queued (in the state file too) and
   `run()` retries with capped backoff until it returns, running the migrations first if
   the controller started without it. An alarm (`audit_queued`) says so meanwhile.
"""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import structlog
from pydantic import ValidationError

from powerd.clock import Clock
from powerd.controller.opstate import (
    ApiPolicy,
    AuditRow,
    OperatorState,
    StateFile,
    StateFileError,
    capture,
    file_sha256,
    restore,
    sha256_text,
)
from powerd.controller.overrides import (
    MAX_HANDOVER,
    BudgetOverride,
    Job,
    NotFound,
    OverrideError,
    Overrides,
    ScheduledBudget,
)
from powerd.policy import Policy, PolicyError, load_policy_text
from powerd.store import Store, upgrade
from powerd.wire import Authority

if TYPE_CHECKING:
    from powerd.controller.tick import TickEngine

log = structlog.get_logger(__name__)

DB_WAIT_S = 2.0  # how long an API answer waits for the audit row to reach the database
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 30.0
MAX_ERROR_LEN = 300


@dataclass(frozen=True)
class WriteOutcome:
    """What one admin write did, as the API answers it."""

    applied: bool  # in force from the next tick
    durable: bool  # in the state file: survives a restart
    audited: bool  # its audit row is in the database (else queued, or no store)
    detail: str | None = None  # why not durable / not audited, for a person
    policy_version: int | None = None  # a policy write: its stored version, when stored


@dataclass(frozen=True)
class JobPut:
    """What a job write did: the job in force, whether it replaced one of its name, and
    the uuids it names that no telemetry has named yet."""

    job: Job
    replaced: bool
    unseen: list[str]


class WriteFailed(Exception):
    """A write rolled back because the state file could not be written."""

    def __init__(self, outcome: WriteOutcome) -> None:
        super().__init__(outcome.detail)
        self.outcome = outcome


@dataclass
class PolicyVersionToStore:
    """A policy adopted while the database could not store it yet."""

    text: str
    source: str
    author: str
    reason: str
    ts: float
    # A controller's start-up under a lease: stored only if the store has no active
    # version yet (the policy of record is never replaced by a start).
    unless_active: bool = False


@dataclass
class _Before:
    overrides: Overrides
    policy: Policy
    api_policy: ApiPolicy | None
    versions: list[PolicyVersionToStore] = field(default_factory=list)


class AdminWrites:
    """The Controller's admin writes. Each validates (OverrideError, NotFound, PolicyError
    leave everything as it was), applies in memory and queues its audit row through
    `ledger.journal`; `Ledger.commit` makes it durable."""

    # What the Controller provides: the tick engine's state is what the writes change.
    engine: TickEngine
    clock: Clock
    ledger: Ledger

    def replace_policy(
        self,
        text: str,
        *,
        actor: str,
        reason: str,
        role: str = "admin",
        source: str = "api",
        file_sha256: str | None = None,
    ) -> Policy:
        """Validate and adopt a new policy (PolicyError leaves the running one in force).

        `source` "api": the policy outlives a restart unless the policy file (whose sha256
        was `file_sha256` then) is edited since; a file path: the file is in force."""
        policy = load_policy_text(text, source)
        self.engine.adopt(policy)
        sha = self.ledger.policy_replaced(
            text, source=source, actor=actor, reason=reason, file_sha256=file_sha256
        )
        self.ledger.journal(
            "policy.replace", source, {"sha256": sha}, actor=actor, role=role, reason=reason
        )
        log.info("policy_replaced", source=source, sha256=sha[:12], actor=actor)
        return policy

    def set_budget(
        self,
        group: str,
        budget_w: float,
        *,
        expires_at: float | None,
        actor: str,
        reason: str,
        role: str = "operator",
    ) -> None:
        wall = self.clock.wall()
        override = BudgetOverride(group, budget_w, expires_at, reason, actor, wall).anchored(
            wall, self.clock.monotonic()
        )
        self.engine.overrides.set_budget(self.engine.policy, override)
        payload = {"budget_w": budget_w, "expires_at": expires_at}
        self.ledger.journal("budget.set", group, payload, actor=actor, role=role, reason=reason)

    def budget_in_force_w(self, group: str) -> float:
        """A group's budget now: the policy's, or a lower temporary one (inf: unknown)."""
        policy, overrides = self.engine.policy, self.engine.overrides
        policy_w = next((g.budget_w for g in policy.groups if g.name == group), None)
        if policy_w is None:
            return float("inf")
        clock = self.clock
        return overrides.active_budgets(policy, clock.wall(), clock.monotonic()).get(
            group, policy_w
        )

    def schedule_budget(
        self,
        schedule_id: str,
        group: str,
        budget_w: float,
        *,
        start: float,
        end: float | None,
        actor: str,
        reason: str,
        role: str = "operator",
    ) -> None:
        """Lower a group's budget over a future window, ramped in and out (powerd.ramp)."""
        wall = self.clock.wall()
        entry = ScheduledBudget(
            schedule_id, group, budget_w, start, end, reason, actor, wall
        ).on_monotonic(wall, self.clock.monotonic())
        self.engine.overrides.add_schedule(self.engine.policy, entry, wall)
        payload = {"group": group, "budget_w": budget_w, "start": start, "end": end}
        self.ledger.journal(
            "budget.schedule", schedule_id, payload, actor=actor, role=role, reason=reason
        )

    def cancel_schedule(
        self, schedule_id: str, *, actor: str, reason: str, role: str = "operator"
    ) -> None:
        entry = self.engine.overrides.cancel_schedule(schedule_id)
        payload = {"group": entry.group, "budget_w": entry.budget_w}
        self.ledger.journal(
            "budget.unschedule", schedule_id, payload, actor=actor, role=role, reason=reason
        )

    def clear_budget(self, group: str, *, actor: str, reason: str, role: str = "operator") -> None:
        self.engine.overrides.clear_budget(group)
        self.ledger.journal("budget.clear", group, {}, actor=actor, role=role, reason=reason)

    def assign_class(
        self,
        cls: str,
        *,
        uuids: list[str],
        nodes: list[str],
        actor: str,
        reason: str,
        role: str = "operator",
    ) -> None:
        self.engine.overrides.assign_class(self.engine.policy, cls, uuids=uuids, nodes=nodes)
        payload = {"class": cls, "uuids": uuids, "nodes": nodes}
        self.ledger.journal(
            "class.assign", ",".join(uuids + nodes), payload, actor=actor, role=role, reason=reason
        )

    def clear_class(
        self, *, uuids: list[str], nodes: list[str], actor: str, reason: str, role: str = "operator"
    ) -> None:
        self.engine.overrides.clear_class(uuids=uuids, nodes=nodes)
        payload = {"uuids": uuids, "nodes": nodes}
        self.ledger.journal(
            "class.clear", ",".join(uuids + nodes), payload, actor=actor, role=role, reason=reason
        )

    def put_job(
        self,
        name: str,
        cls: str,
        *,
        uuids: list[str],
        nodes: list[str],
        profile: list[tuple[float, float]] | None,
        actor: str,
        reason: str,
        role: str = "operator",
    ) -> JobPut:
        """Add a job, or replace the job of that name (Conflict: another job holds one of
        its GPUs). GPUs not heard from yet are accepted: a scheduler may be ahead of the
        telemetry; they join the job when they report."""
        job = Job(
            name=name,
            class_=cls,
            uuids=tuple(dict.fromkeys(uuids)),
            nodes=tuple(dict.fromkeys(nodes)),
            profile=None if profile is None else tuple((float(p), float(t)) for p, t in profile),
            reason=reason,
            actor=actor,
            created_at=self.clock.wall(),
        )
        fleet = self.engine.fleet

        def node_of(uuid: str) -> str | None:
            rec = fleet.gpus.get(uuid)
            return None if rec is None else rec.node

        replaced = self.engine.overrides.put_job(self.engine.policy, job, node_of, fleet.gpus_of)
        unseen = [u for u in job.uuids if u not in fleet.gpus]
        payload = {
            "class": cls,
            "uuids": list(job.uuids),
            "nodes": list(job.nodes),
            "profile": None if profile is None else [list(p) for p in job.profile or ()],
            "replaced": replaced,
            "unseen_gpus": len(unseen),
        }
        self.ledger.journal("job.put", name, payload, actor=actor, role=role, reason=reason)
        return JobPut(job, replaced, unseen)

    def delete_job(self, name: str, *, actor: str, reason: str, role: str = "operator") -> Job:
        job = self.engine.overrides.delete_job(name)
        payload = {"gpus": len(job.uuids), "nodes": len(job.nodes)}
        self.ledger.journal("job.delete", name, payload, actor=actor, role=role, reason=reason)
        return job

    def pin(
        self, uuid: str, watts: float, *, actor: str, reason: str, role: str = "operator"
    ) -> None:
        rec = self.engine.fleet.gpus.get(uuid)
        if rec is None:
            raise NotFound(f"unknown GPU '{uuid}'")
        if not rec.min_cap_w <= watts <= rec.max_cap_w:
            raise OverrideError(
                f"{watts:g} W is outside the GPU's limits [{rec.min_cap_w:g}, {rec.max_cap_w:g}] W"
            )
        self.engine.overrides.pins[uuid] = watts
        self.ledger.journal(
            "gpu.pin", uuid, {"watts": watts}, actor=actor, role=role, reason=reason
        )

    def unpin(self, uuid: str, *, actor: str, reason: str, role: str = "operator") -> None:
        if self.engine.overrides.pins.pop(uuid, None) is None:
            raise NotFound(f"GPU '{uuid}' is not pinned")
        self.ledger.journal("gpu.unpin", uuid, {}, actor=actor, role=role, reason=reason)

    def drain(self, node: str, *, actor: str, reason: str, role: str = "operator") -> None:
        if node not in self.engine.fleet.node_order:
            raise NotFound(f"unknown node '{node}'")
        self.engine.overrides.drained.add(node)
        self.ledger.journal("node.drain", node, {}, actor=actor, role=role, reason=reason)

    def undrain(self, node: str, *, actor: str, reason: str, role: str = "operator") -> None:
        if node not in self.engine.overrides.drained:
            raise NotFound(f"node '{node}' is not drained")
        self.engine.overrides.drained.discard(node)
        self.ledger.journal("node.undrain", node, {}, actor=actor, role=role, reason=reason)

    def hand_over(
        self,
        to: Sequence[Authority],
        *,
        actor: str,
        reason: str,
        role: str = "admin",
    ) -> None:
        """Name the authorities this controller hands its nodes to: every command names
        them, so an agent obeys their first command at once (no failsafe gap), and every
        GPU counts at its maximum here meanwhile. An empty site or store is ours.
        OverrideError for a handover that leaves the site, names this authority, names no
        domain, or names more than MAX_HANDOVER."""
        ours = self.engine.obedience.authority
        if ours is None:
            raise OverrideError("this controller commands for no authority (a shadow)")
        if not 0 < len(to) <= MAX_HANDOVER:
            raise OverrideError(f"name 1 to {MAX_HANDOVER} authorities")
        named = [
            Authority(site=a.site or ours.site, store=a.store or ours.store, domain=a.domain)
            for a in to
        ]
        for a in named:
            if a.site != ours.site:
                raise OverrideError(f"a handover stays in site {ours.site!r}, not {a.site!r}")
            if not a.domain:
                raise OverrideError("name the domain of each authority")
            if a == ours:
                raise OverrideError("a handover names another authority than this one")
        self.engine.overrides.handover = tuple(named)
        payload = {"to": [a.model_dump() for a in named]}
        self.ledger.journal(
            "authority.handover", ours.domain, payload, actor=actor, role=role, reason=reason
        )

    def cancel_handover(self, *, actor: str, reason: str, role: str = "admin") -> None:
        if not self.engine.overrides.handover:
            raise NotFound("no handover in progress")
        self.engine.overrides.handover = ()
        domain = (
            ""
            if self.engine.obedience.authority is None
            else self.engine.obedience.authority.domain
        )
        self.ledger.journal(
            "authority.handover_cancel", domain, {}, actor=actor, role=role, reason=reason
        )


class LedgerHost(Protocol):
    """What the ledger needs of the controller whose operators' writes it keeps (the
    Controller is one): the policy and overrides in force, to snapshot, restore and roll
    back; the alarms it raises; the clock its rows are stamped with."""

    overrides: Overrides
    policy_version: int | None  # the policy in force as stored (None: not yet, or no store)

    @property
    def clock(self) -> Clock: ...

    @property
    def policy(self) -> Policy: ...

    @property
    def file_policy(self) -> Policy | None: ...

    @property
    def policy_path(self) -> str | None: ...

    def adopt_policy(self, policy: Policy) -> None: ...

    def set_alarm(self, kind: str, message: str | None) -> None: ...

    def replace_policy(
        self,
        text: str,
        *,
        actor: str,
        reason: str,
        role: str = "admin",
        source: str = "api",
        file_sha256: str | None = None,
    ) -> Policy: ...


class Ledger:
    """The durable side of operators' writes: state file, database, audit queue, alarms."""

    def __init__(
        self,
        controller: LedgerHost,
        *,
        store: Store | None = None,
        state_file: StateFile | None = None,
        schema_ready: bool = True,
        db_wait_s: float = DB_WAIT_S,
        retry_initial_s: float = RETRY_INITIAL_S,
        retry_max_s: float = RETRY_MAX_S,
    ) -> None:
        self._ctl = controller
        self.store = store
        self.state_file = state_file
        self.schema_ready = schema_ready  # False: run the migrations before the first write
        self.db_wait_s = db_wait_s
        self.retry_initial_s = retry_initial_s
        self.retry_max_s = retry_max_s
        self.revision = 0  # of the operators' state in memory
        self.file_revision = 0  # in the state file
        self.db_revision = 0  # in the database, as far as this process knows
        self.api_policy: ApiPolicy | None = None
        self.pending: list[AuditRow] = []  # audit rows the database has not acknowledged
        self.versions: list[PolicyVersionToStore] = []  # policy versions to store, oldest first
        self.failures = 0  # database syncs failed in a row
        self.last_error: str | None = None
        self._batch: list[AuditRow] = []  # rows journaled by the change being committed
        self._committing = False
        self._lock = asyncio.Lock()  # one write (change + state file) at a time
        self._file_lock = asyncio.Lock()  # snapshot + save, in order
        self._sync_task: asyncio.Task[bool] | None = None
        self._wake = asyncio.Event()

    # ---- journal (on the loop, no I/O) ----

    def journal(
        self,
        action: str,
        target: str,
        payload: Mapping[str, object],
        *,
        actor: str,
        role: str,
        reason: str,
        result: str = "ok",
    ) -> AuditRow:
        log.info(
            "admin_action",
            actor=actor,
            role=role,
            action=action,
            target=target,
            reason=reason,
            result=result,
        )
        row = AuditRow(
            key=uuid.uuid4().hex,
            ts=self._ctl.clock.wall(),
            actor=actor,
            role=role,
            action=action,
            target=target[:256],
            reason=reason,
            payload=dict(payload),
            result=result[:256],
        )
        if self._committing:
            self._batch.append(row)  # queued once the commit has decided its result
        elif self.store is not None:
            self.pending.append(row)
            self._wake.set()
        return row

    def policy_replaced(
        self, text: str, *, source: str, actor: str, reason: str, file_sha256: str | None
    ) -> str:
        """Note a policy adopted; returns its sha256."""
        sha = sha256_text(text)
        now = self._ctl.clock.wall()
        self.api_policy = (
            ApiPolicy(
                text=text,
                sha256=sha,
                file_sha256=file_sha256,
                actor=actor,
                reason=reason,
                ts=now,
            )
            if source == "api"
            else None
        )
        if self.store is not None:
            self.versions.append(PolicyVersionToStore(text, source, actor, reason, now))
            self._wake.set()
        return sha

    def _queue(self, rows: list[AuditRow]) -> None:
        self._committing, self._batch = False, []
        if self.store is not None and rows:
            self.pending.extend(rows)
            self._wake.set()

    # ---- writes (async: I/O in worker threads) ----

    async def commit(self, change: Callable[[], object], *, lowers_power: bool) -> WriteOutcome:
        """Apply `change` (validation errors propagate: nothing changed, nothing written),
        write the state file, then give the database up to `db_wait_s`.

        WriteFailed: the state file could not be written and the change, which does not
        only lower power, was rolled back (its audit row says so)."""
        async with self._lock:
            before = self._before()
            self._batch, self._committing = [], True
            try:
                change()
                mine = self._batch
                self.revision += 1
                if lowers_power:
                    # A cut is in force at once, durable or not: safety wins.
                    error = await self._save()
                    rolled_back = False
                else:
                    # Anything else is in force only once it is durable: the ticks that run
                    # while the file is written still see the state before it (a rolled-back
                    # write was never in force, as its answer says).
                    after = self._before()
                    state = self.state()
                    self._roll_back(before)
                    error = await self._save(state)
                    rolled_back = error is not None
                    if not rolled_back:
                        self._roll_forward(after)
                if rolled_back:
                    self.revision -= 1
                    for row in mine:
                        row.result = f"rolled back: state file not written: {error}"[:256]
                    log.error(
                        "admin_write_rolled_back", error=error, actions=[r.action for r in mine]
                    )
            finally:
                self._queue(self._batch)
        audited = await self._wait_audited(mine)
        detail = self._detail(error, audited)
        if rolled_back:
            raise WriteFailed(WriteOutcome(False, False, audited, detail))
        version = self._ctl.policy_version if audited and not self.versions else None
        return WriteOutcome(
            True, error is None and self.state_file is not None, audited, detail, version
        )

    async def refused(
        self, action: str, target: str, detail: str, *, actor: str, role: str, reason: str
    ) -> bool:
        """Audit a refused write (queued, and kept in the state file, if the database is
        down); True if its row is in the database now."""
        async with self._lock:
            self._batch, self._committing = [], True
            try:
                self.journal(
                    action,
                    target,
                    {},
                    actor=actor,
                    role=role,
                    reason=reason,
                    result=f"refused: {detail}",
                )
                mine = self._batch
                if self.store is not None:
                    await self._save()
            finally:
                self._queue(self._batch)
        return await self._wait_audited(mine)

    async def replace_policy(
        self, text: str, *, actor: str, reason: str, role: str = "admin"
    ) -> WriteOutcome:
        """A policy from the API, remembering the policy file's sha256 at this moment."""
        file_sha = await asyncio.to_thread(file_sha256, self._ctl.policy_path)
        return await self.commit(
            lambda: self._ctl.replace_policy(
                text, actor=actor, reason=reason, role=role, source="api", file_sha256=file_sha
            ),
            lowers_power=False,
        )

    async def reload_policy_file(self) -> WriteOutcome:
        """SIGHUP: the policy file wins (over a policy replaced through the API)."""
        path = self._ctl.policy_path
        if path is None:
            raise OverrideError("no policy file to reload")
        text = await asyncio.to_thread(Path(path).read_text, encoding="utf-8")
        return await self.commit(
            lambda: self._ctl.replace_policy(
                text, actor="sighup", role="system", reason="SIGHUP reload", source=str(path)
            ),
            lowers_power=False,
        )

    def state(self, revision: int | None = None) -> OperatorState:
        """The operators' state in memory (a copy: cheap, on the loop)."""
        return OperatorState(
            revision=self.revision if revision is None else revision,
            ts=self._ctl.clock.wall(),
            api_policy=self.api_policy,
            pending_audit=self.pending + (self._batch if self.store is not None else []),
            **capture(self._ctl.overrides),
        )

    def start_from(
        self,
        state: OperatorState | None,
        *,
        api_policy: ApiPolicy | None = None,
        db_revision: int,
        file_revision: int,
    ) -> None:
        """Take a stored state at start (before the first tick): its overrides, checked
        against the policy in force, its revision and its queued audit rows. `api_policy`:
        the stored API policy still in force; one the state has that is not (the file
        won) makes a new revision, which `run()` saves."""
        self.api_policy = api_policy
        self.db_revision = db_revision
        self.file_revision = file_revision
        self.revision = max(db_revision, file_revision)
        if state is None:
            return
        if state.api_policy is not None and self.api_policy is None:
            self.revision += 1
        clock = self._ctl.clock
        self._ctl.overrides = restore(state, self._ctl.policy, clock.wall(), clock.monotonic())
        self.pending = list(state.pending_audit) if self.store is not None else []
        o = self._ctl.overrides
        log.info(
            "operator_state_restored",
            revision=state.revision,
            budgets=sorted(o.budgets),
            pins=len(o.pins),
            drained=sorted(o.drained),
            gpu_classes=len(o.gpu_classes),
            node_classes=len(o.node_classes),
            jobs=len(o.jobs),
            api_policy=self.api_policy is not None,
            queued_audit=len(self.pending),
        )

    async def store_start_version(
        self, text: str, source: str, *, db_ok: bool, of_record: bool
    ) -> None:
        """The policy in force at start as a stored version (the same text: the same
        version), the controller's `policy_version`; queued for `run()` when the database
        is down. Nothing without a store (a shadow). `of_record` (controllers of a pair,
        under a lease): a store that already has an active version keeps it, also when the
        database answers only later, and the controller steers it (the first lease round
        adopts it, before any command); a file that differs is the alarm `policy_differs`
        (`follow_policy`), not a replacement: a standby started from a stale file must not
        overwrite the policy of record."""
        store = self.store
        if store is None:
            return
        if db_ok:
            try:
                self._ctl.policy_version = await asyncio.to_thread(
                    store.record_policy_version,
                    text,
                    source=source,
                    author="controller",
                    reason="start-up",
                    unless_active=of_record,
                )
                return
            except Exception as exc:
                log.error("policy_version_not_stored", error=f"{type(exc).__name__}: {exc}"[:300])
        self.versions.append(
            PolicyVersionToStore(
                text, source, "controller", "start-up", time.time(), unless_active=of_record
            )
        )

    # ---- a standby follows the leader's state ----

    async def follow(self) -> bool:
        """Standby (and at a takeover, before the first command): adopt the operators'
        state the database holds when it is newer than ours, or differs at the same
        revision (the leader's, written while we could not see it): temporary budgets,
        pins, drains, classes, jobs and a policy replaced through the API. True if adopted.
        Raises when the database cannot be read: a new leader must not command from a
        state it could not check."""
        store = self.store
        if store is None:
            return False
        row = await asyncio.to_thread(store.latest_operator_state)
        if row is None or row.revision < self.revision:
            return False
        try:
            state = OperatorState.model_validate(row.state | {"revision": row.revision})
            api_policy = (
                None if state.api_policy is None else load_policy_text(state.api_policy.text, "api")
            )
        except (ValidationError, PolicyError) as exc:
            # Read, but not a state this release understands (a newer powerd's, a hand
            # edit): waiting would leave the lease held and nothing commanding. Keep ours,
            # say so, and steer.
            self._ctl.set_alarm(
                "operator_state_unreadable",
                f"operator state revision {row.revision} in the database is not valid "
                f"here ({str(exc).splitlines()[0][:200]}); steering from the state "
                f"followed last (revision {self.revision})",
            )
            return False
        self._ctl.set_alarm("operator_state_unreadable", None)
        mine = self.state(row.revision)
        if row.revision == self.revision and state.for_db() | {"ts": 0} == mine.for_db() | {
            "ts": 0
        }:
            return False
        ctl = self._ctl
        api = state.api_policy
        if api_policy is not None and (
            self.api_policy is None or api is None or api.sha256 != self.api_policy.sha256
        ):
            ctl.adopt_policy(api_policy)
        elif api is None and self.api_policy is not None and ctl.file_policy is not None:
            ctl.adopt_policy(ctl.file_policy)
        self.api_policy = api
        ctl.overrides = restore(state, ctl.policy, ctl.clock.wall(), ctl.clock.monotonic())
        self.revision = self.db_revision = row.revision
        log.info(
            "operator_state_followed",
            revision=row.revision,
            budgets=sorted(ctl.overrides.budgets),
            api_policy=api is not None,
        )
        await self._save()
        self.file_revision = row.revision
        return True

    # ---- the policy of record: the store's active version ----

    async def follow_policy(self) -> None:
        """Every lease round, leader or standby: the store's active policy version is the
        policy of record for every controller on the store. One that differs from the policy
        in force (another member stored it: a SIGHUP there, or the API) is adopted; a policy
        file that differs from it is the alarm `policy_differs`, never a silent replacement
        (docs/operations.md, "Changing a pair's policy"). Raises when the database cannot
        be read (the caller logs it)."""
        store = self.store
        ctl = self._ctl
        if store is None or any(not v.unless_active for v in self.versions):
            return  # an operator's version is on its way to the store: the newer word
        path = ctl.policy_path
        # One read of both: the adoption and the alarm then happen together, no await
        # between (a reader never sees the one without the other).
        head, file_sha = await asyncio.to_thread(
            lambda: (store.active_policy_head(), file_sha256(path))
        )
        if head is None:
            return
        # A start-up version queued while the database was down never replaces the one
        # of record (it would be stored only into an empty store): it is moot now.
        self.versions = [v for v in self.versions if not v.unless_active]
        if head.version != ctl.policy_version and not self.versions:
            row = await asyncio.to_thread(store.policy_version, head.version)
            if row is None or self.versions:
                return  # replaced meanwhile, or an operator's write came: the next round
            try:
                policy = load_policy_text(row.yaml_text, row.source)
            except PolicyError as exc:
                ctl.set_alarm(
                    "policy_unreadable",
                    f"stored policy version {row.version} is not valid here "
                    f"({str(exc).splitlines()[0][:200]}); steering the policy in force",
                )
                return
            ctl.set_alarm("policy_unreadable", None)
            ctl.adopt_policy(policy)
            ctl.policy_version = row.version
            log.warning(
                "policy_followed",
                version=row.version,
                sha256=row.sha256[:12],
                source=row.source,
                author=row.author,
            )
        api = self.api_policy
        unchanged_under_api = api is not None and api.sha256 == head.sha256
        differs = file_sha is not None and file_sha != head.sha256 and not unchanged_under_api
        ctl.set_alarm(
            "policy_differs",
            f"policy file {ctl.policy_path} (sha256 {file_sha[:12]}) differs from the stored "
            f"policy of record, version {head.version} (sha256 {head.sha256[:12]}, "
            f"{head.source}, by {head.author}), which this controller steers; store the file "
            "with SIGHUP on any member (or replace the policy through the API)"
            if differs and file_sha is not None
            else None,
        )

    # ---- the database (background) ----

    async def run(self, stop: asyncio.Event) -> None:
        """Until `stop`: save a state changed at start, then catch the database up whenever
        there is something to store, retrying with capped backoff while it fails."""
        if self.revision != self.file_revision and self.state_file is not None:
            await self._save()
        while not stop.is_set():
            delay: float | None = None
            if self.has_db_work():
                ok = await asyncio.shield(self._kick())
                if not ok:
                    delay = min(self.retry_max_s, self.retry_initial_s * 2 ** (self.failures - 1))
                    delay *= random.uniform(0.5, 1.0)
            self._wake.clear()
            if delay is None and self.has_db_work():
                continue
            waiters = [asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())]
            try:
                await asyncio.wait(waiters, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waiters:
                    w.cancel()
        if self.has_db_work():  # a last try; what is left stays queued in the state file
            await self.flush(self.db_wait_s)

    def has_db_work(self) -> bool:
        if self.store is None:
            return False
        return (
            not self.schema_ready
            or bool(self.pending)
            or bool(self.versions)
            or self.revision > self.db_revision
        )

    async def _wait_audited(self, rows: list[AuditRow]) -> bool:
        if self.store is None or not rows:
            return False
        keys = {r.key for r in rows}
        await self.flush(self.db_wait_s)
        return not any(r.key in keys for r in self.pending)

    async def flush(self, wait_s: float) -> None:
        """Let the database catch up for at most `wait_s`: a sync already running started
        before the latest rows, so wait for it and then for one of our own."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        for _ in range(2):
            if not self.has_db_work():
                return
            task = self._kick()
            try:
                ok = await asyncio.wait_for(asyncio.shield(task), max(0.0, deadline - loop.time()))
            except TimeoutError:
                return
            if not ok:
                return

    def _kick(self) -> asyncio.Task[bool]:
        if self._sync_task is None or self._sync_task.done():
            self._sync_task = asyncio.create_task(self._sync(), name="operator-state-sync")
            self._sync_task.add_done_callback(_log_failure)
        return self._sync_task

    async def _sync(self) -> bool:
        """One write of everything queued to the database, in a worker thread (one at a
        time: only `_kick` starts it)."""
        store = self.store
        if store is None:
            return True
        # A commit in flight (applied, its state file being written) may still roll back:
        # take what to store once it has decided. The lock is held only for that moment.
        async with self._lock:
            rows = list(self.pending)
            versions = list(self.versions)
            state = self.state() if self.revision > self.db_revision else None
        try:
            stored, revision = await asyncio.to_thread(self._write_db, store, rows, versions, state)
        except Exception as exc:
            self.failures += 1
            self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:MAX_ERROR_LEN]
            log.warning(
                "operator_state_sync_failed",
                error=self.last_error,
                failures=self.failures,
                queued_audit=len(self.pending),
                queued_versions=len(self.versions),
            )
            self._alarm()
            return False
        written = {r.key for r in rows}
        self.pending = [r for r in self.pending if r.key not in written]
        # By identity: follow_policy may have dropped moot start-up versions meanwhile.
        self.versions = [v for v in self.versions if all(v is not w for w in versions)]
        if state is not None:
            self.db_revision = max(self.db_revision, revision)
            if revision > state.revision:  # renumbered above the database's: the file too
                # A write since the snapshot is newer still: it goes above, at the next sync.
                self.revision = revision + (self.revision > state.revision)
                await self._save()
        if stored is not None:
            self._ctl.policy_version = stored
        if self.failures:
            log.info(
                "operator_state_caught_up",
                failures=self.failures,
                audit_rows=len(rows),
                policy_versions=len(versions),
                revision=self.db_revision,
            )
        self.failures = 0
        self.last_error = None
        self._alarm()
        if rows and self.state_file is not None:
            await self._save()  # the file's queue need not list them any more
        return True

    def _write_db(
        self,
        store: Store,
        rows: list[AuditRow],
        versions: list[PolicyVersionToStore],
        state: OperatorState | None,
    ) -> tuple[int | None, int]:
        """(worker thread) Migrations if still owed, then versions, audit rows, state;
        (the last policy version stored, the revision the state was stored under)."""
        if not self.schema_ready:
            upgrade(store.engine.url)
            self.schema_ready = True
        version = None
        for v in versions:
            version = store.record_policy_version(
                v.text,
                source=v.source,
                author=v.author,
                reason=v.reason,
                ts=v.ts,
                unless_active=v.unless_active,
            )
        store.record_audit_rows([r.model_dump() for r in rows])
        revision = 0
        if state is not None:
            revision = store_operator_state(store, state)
        return version, revision

    def _alarm(self) -> None:
        message = None
        if self.failures:
            owed = [f"{len(self.pending)} audit rows"]
            if self.versions:
                owed.append(f"{len(self.versions)} policy versions")
            if not self.schema_ready:
                owed.append("the migrations")
            message = f"not yet in the database: {', '.join(owed)}; {self.last_error}"
        self._ctl.set_alarm("audit_queued", message)

    # ---- the state file ----

    async def _save(self, state: OperatorState | None = None) -> str | None:
        """Write the state file (in a worker thread): `state`, or the one in memory; the
        error, or None when written or when there is no state file."""
        if self.state_file is None:
            return None
        async with self._file_lock:
            if state is None:
                state = self.state()
            try:
                await asyncio.to_thread(self.state_file.save, state)
            except StateFileError as exc:
                error = str(exc)[:MAX_ERROR_LEN]
                log.error("state_file_write_failed", path=str(self.state_file.path), error=error)
                self._ctl.set_alarm("state_not_durable", f"operator state not saved: {error}")
                return error
            self.file_revision = state.revision
            self._ctl.set_alarm("state_not_durable", None)
            return None

    def _before(self) -> _Before:
        o = self._ctl.overrides
        copy = Overrides(
            budgets=dict(o.budgets),
            schedules=dict(o.schedules),
            gpu_classes=dict(o.gpu_classes),
            node_classes=dict(o.node_classes),
            pins=dict(o.pins),
            drained=set(o.drained),
            jobs=o.jobs,  # never changed in place: shared
        )
        return _Before(copy, self._ctl.policy, self.api_policy, list(self.versions))

    def _roll_forward(self, after: _Before) -> None:
        """Put a change taken back by `_roll_back` in force again (its snapshot)."""
        if self._ctl.policy is not after.policy:
            self._ctl.adopt_policy(after.policy)
        self._ctl.overrides = after.overrides
        self.api_policy = after.api_policy
        self.versions = list(after.versions)

    def _roll_back(self, before: _Before) -> None:
        if self._ctl.policy is not before.policy:
            self._ctl.adopt_policy(before.policy)
        self._ctl.overrides = before.overrides
        self.api_policy = before.api_policy
        kept = {id(v) for v in before.versions}
        self.versions = [v for v in self.versions if id(v) in kept]

    def _detail(self, file_error: str | None, audited: bool) -> str | None:
        parts = []
        if file_error is not None:
            parts.append(f"state file not written ({file_error})")
        elif self.state_file is None:
            parts.append("no state file: the change ends with this process")
        if self.store is None:
            parts.append("no store: audited in the log only")
        elif not audited:
            why = self.last_error or "the database did not answer in time"
            parts.append(f"audit row queued until the database answers ({why})")
        return "; ".join(parts) or None


def _log_failure(task: asyncio.Task[bool]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.error("operator_state_sync_crashed", error=repr(task.exception()))


def store_operator_state(store: Store, state: OperatorState) -> int:
    """Store the state as the database's newest revision; the revision used. Ours is
    the operators' latest intent: where the database holds the same or a higher
    revision with another state (written while we could not see it: a start without
    state file and database, another process), ours goes above it, never under."""
    body = state.for_db()
    revision = state.revision
    for _ in range(5):
        latest = store.latest_operator_state()
        if latest is not None and latest.revision >= revision:
            if latest.revision == revision and dict(latest.state) == body:
                return revision  # a re-send of what is stored
            revision = latest.revision + 1
        if store.save_operator_state(revision, state.ts, body):
            if revision != state.revision:
                log.warning("operator_state_renumbered", revision=state.revision, stored=revision)
            return revision
        revision += 1  # another writer took it between the two statements
    raise RuntimeError("operator state revision conflict persisted")
