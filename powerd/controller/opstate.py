"""Operators' state on disk: what they changed (temporary budgets, pins, drains, class
assignments, jobs, a policy replaced through the API) and the audit rows not yet in the database.

The state file is the durability point of an admin write: it is written (temp file, fsync,
rename, fsync of the directory) before the API answers, and it works while the database is
down. The database keeps the same document by revision (`operator_state`); a start takes the
higher revision of the two. Everything here does blocking I/O: call it from a worker thread
(`asyncio.to_thread`), never on the event loop.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Literal

import structlog
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from powerd.controller.overrides import (
    MAX_HANDOVER,
    MAX_SCHEDULES,
    BudgetOverride,
    Job,
    Jobs,
    Overrides,
    ScheduledBudget,
)
from powerd.policy import Policy
from powerd.wire import Authority

log = structlog.get_logger(__name__)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BudgetState(_Model):
    """A BudgetOverride as stored: its wall times only (its monotonic expiry means nothing to
    another process; a restore anchors it again)."""

    group: str
    budget_w: float
    expires_at: float | None  # wall-clock seconds; None: until cleared
    reason: str
    actor: str
    created_at: float

    @classmethod
    def of(cls, b: BudgetOverride) -> BudgetState:
        return cls(
            group=b.group,
            budget_w=b.budget_w,
            expires_at=b.expires_at,
            reason=b.reason,
            actor=b.actor,
            created_at=b.created_at,
        )


class JobState(_Model):
    """A Job as stored (the same fields; `class` for `class_`)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    name: str
    class_: str = Field(alias="class")
    uuids: list[str] = Field(default_factory=list)
    nodes: list[str] = Field(default_factory=list)
    profile: list[tuple[float, float]] | None = None
    reason: str
    actor: str
    created_at: float

    @classmethod
    def of(cls, job: Job) -> JobState:
        return cls(
            name=job.name,
            class_=job.class_,
            uuids=list(job.uuids),
            nodes=list(job.nodes),
            profile=None if job.profile is None else [tuple(p) for p in job.profile],
            reason=job.reason,
            actor=job.actor,
            created_at=job.created_at,
        )

    def job(self) -> Job:
        return Job(
            name=self.name,
            class_=self.class_,
            uuids=tuple(self.uuids),
            nodes=tuple(self.nodes),
            profile=None if self.profile is None else tuple(self.profile),
            reason=self.reason,
            actor=self.actor,
            created_at=self.created_at,
        )


class ScheduleState(_Model):
    """A ScheduledBudget as stored: its wall times only (a monotonic clock's readings mean
    nothing to another process; a restore converts them again)."""

    id: str = Field(min_length=1, max_length=64)
    group: str
    budget_w: float
    start: float  # wall-clock seconds
    end: float | None
    reason: str
    actor: str
    created_at: float


class ApiPolicy(_Model):
    """A policy replaced through the API, and the policy file as it was at that moment: at
    a start, a file edited since wins (an operator's later edit); an unchanged one does not."""

    text: str
    sha256: str  # of `text`
    file_sha256: str | None  # of the policy file then; None: no file or unreadable
    actor: str
    reason: str
    ts: float


class AuditRow(_Model):
    """An audit row not yet in the database (AuditEntry's columns, `key` making a re-send a
    no-op)."""

    key: str
    ts: float
    actor: str
    role: str
    action: str
    target: str
    reason: str
    payload: dict[str, Any] = Field(default_factory=dict)
    result: str


class OperatorState(_Model):
    v: Literal[1] = 1
    revision: int = Field(default=0, ge=0)
    ts: float = 0.0
    budgets: list[BudgetState] = Field(default_factory=list)
    schedules: list[ScheduleState] = Field(default_factory=list, max_length=MAX_SCHEDULES)
    pins_w: dict[str, float] = Field(default_factory=dict)
    drained: list[str] = Field(default_factory=list)
    gpu_classes: dict[str, str] = Field(default_factory=dict)
    node_classes: dict[str, str] = Field(default_factory=dict)
    jobs: list[JobState] = Field(default_factory=list)
    handover: list[Authority] = Field(default_factory=list, max_length=MAX_HANDOVER)
    api_policy: ApiPolicy | None = None
    # Only in the file: what the database has not acknowledged yet.
    pending_audit: list[AuditRow] = Field(default_factory=list)

    def for_db(self) -> dict[str, Any]:
        """The document the database keeps (the queue of audit rows is the file's alone)."""
        return self.model_dump(mode="json", exclude={"pending_audit"})


# Each job as stored, by the Job (immutable) it stores: a write stores every job, and most
# of them are those of the write before. Keyed by id, holding the Job so the id stays its.
_JOB_STATES: dict[int, tuple[Job, JobState]] = {}


def _job_states(jobs: Jobs) -> list[JobState]:
    out = []
    for job in jobs.by_name.values():
        held = _JOB_STATES.get(id(job))
        if held is None or held[0] is not job:
            held = _JOB_STATES[id(job)] = (job, JobState.of(job))
        out.append(held[1])
    if len(_JOB_STATES) > 2 * len(out) + 64:  # forget jobs gone
        live = {id(j) for j in jobs.by_name.values()}
        for key in [k for k in _JOB_STATES if k not in live]:
            del _JOB_STATES[key]
    return out


def capture(overrides: Overrides) -> dict[str, Any]:
    """The overrides' fields as plain data (a copy: cheap, on the loop)."""
    return {
        "budgets": [BudgetState.of(b) for b in overrides.budgets.values()],
        "schedules": [
            ScheduleState(
                id=e.id,
                group=e.group,
                budget_w=e.budget_w,
                start=e.start,
                end=e.end,
                reason=e.reason,
                actor=e.actor,
                created_at=e.created_at,
            )
            for e in overrides.schedules.values()
        ],
        "pins_w": dict(overrides.pins),
        "drained": sorted(overrides.drained),
        "gpu_classes": dict(overrides.gpu_classes),
        "node_classes": dict(overrides.node_classes),
        "jobs": _job_states(overrides.jobs),
        "handover": list(overrides.handover),
    }


def restore(
    state: OperatorState, policy: Policy, now_wall: float, now_mono: float | None = None
) -> Overrides:
    """Overrides from a stored state, checked against the policy in force now: an expired
    budget, or one that names a group gone, is dropped and logged. A cut the policy has
    made redundant for now is kept as stored: it binds again if the policy rises (the
    budget in force is always the lower of the two), as it would have without a restart.
    Scheduled budgets are converted to the monotonic clock (`now_mono`; default: the wall
    clock's own timeline) by the wall clock read now, as at their acceptance."""
    out = Overrides(
        pins=dict(state.pins_w),
        drained=set(state.drained),
        gpu_classes=dict(state.gpu_classes),
        node_classes=dict(state.node_classes),
        jobs=restore_jobs(state.jobs),
        handover=tuple(state.handover),
    )
    groups = {g.name for g in policy.groups}
    # Nothing is dropped here for having ended by this host's wall clock: a standby whose
    # clock runs ahead would drop a window still in force at the leader (and steer above it
    # after a takeover). The tick judges time, on a clock checked against the database's.
    for b in state.budgets:
        if b.group not in groups or not b.budget_w > 0:
            log.warning("operator_state_budget_dropped", group=b.group, budget_w=b.budget_w)
            continue
        mono = now_wall if now_mono is None else now_mono
        out.budgets[b.group] = BudgetOverride(**b.model_dump()).anchored(now_wall, mono)
    mono = now_wall if now_mono is None else now_mono
    budgets = {g.name: g.budget_w for g in policy.groups}
    for e in state.schedules:
        entry = ScheduledBudget(**e.model_dump()).on_monotonic(now_wall, mono)
        if e.group not in budgets or not e.budget_w > 0:
            log.warning("operator_state_schedule_dropped", id=e.id, group=e.group)
            continue
        out.schedules[e.id] = entry
    out.forget_policy_gaps(policy)
    return out


def restore_jobs(stored: list[JobState]) -> Jobs:
    """Jobs as stored. They were checked when set; a job that names a GPU or node of one
    stored before it (a hand edit) is dropped and logged, so none is in two jobs."""
    jobs, dropped = Jobs.build(s.job() for s in stored)
    if dropped:
        log.warning("operator_state_jobs_dropped", jobs=dropped[:20], count=len(dropped))
    return jobs


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path | None) -> str | None:
    """The sha256 of a file's bytes; None when there is no path or it cannot be read."""
    if path is None:
        return None
    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


class StateFileError(Exception):
    """The state file cannot be read (unparseable) or written."""


class StateFile:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def load(self) -> OperatorState | None:
        """The stored state; None if there is no file yet. StateFileError if it cannot be
        read or parsed (a start must not silently forget operators' changes)."""
        try:
            raw = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise StateFileError(f"{self.path}: {exc}") from exc
        try:
            return OperatorState.model_validate_json(raw)
        except ValidationError as exc:
            raise StateFileError(f"{self.path}: not a powerd state file: {exc}") from exc

    def save(self, state: OperatorState) -> None:
        """Replace the file atomically: a crash leaves the old file or the new one, whole."""
        # Compact: indented, every uuid of a job would take a line of its own (48 bytes, not 43).
        data = state.model_dump_json().encode()
        directory = self.path.parent
        try:
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=directory)
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
                raise
            dir_fd = os.open(directory, os.O_RDONLY)
            try:
                os.fsync(dir_fd)  # the rename itself survives a power cut
            finally:
                os.close(dir_fd)
        except OSError as exc:
            raise StateFileError(f"{self.path}: {exc}") from exc
