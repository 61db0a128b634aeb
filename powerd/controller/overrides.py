"""Operators' changes to the power picture that live beside the policy file.

Temporary budgets (grid demand-response events), class assignments (a scheduler's prolog),
jobs (GPUs that share one cap), pinned caps and drained nodes. All of them take effect on
the next tick. A temporary budget
can only lower a group's budget: the policy's budget is the breaker or contract rating, and
no API call may lift the tree above it.

Scheduled budgets (a grid operator's load target for a future window) are kept apart: many
per group, each with an id, lowering the group's budget over `[start, end)` and ramped in and
out at the policy's `control.ramp_w_per_s` (powerd.ramp). The operator gives wall times;
they are converted once, when the entry is accepted or restored, to this process's monotonic
clock, and a window binds on either timeline (docs/safety.md, "Ramps"): a step of the wall
clock can bring a cut early or make it last longer, never end it early or lift a budget.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace

import structlog

from powerd.policy import Policy, RampRates
from powerd.profile import Profile, ProfileError
from powerd.ramp import window_ceiling_w, window_done
from powerd.wire import Authority

# Scheduled budgets: at most this many at once, starting at most this far back (a request's
# own transit; a start further in the past is refused) or this far ahead, lasting at most this.
MAX_SCHEDULES = 64
MAX_HANDOVER = 4  # authorities a handover names (the wire's bound)
START_GRACE_S = 60.0
MAX_AHEAD_S = 366 * 86400.0
MAX_WINDOW_S = 31 * 86400.0

log = structlog.get_logger(__name__)


class OverrideError(ValueError):
    """An override that cannot apply (unknown class, value out of range, ...)."""


class NotFound(OverrideError):
    """The override names a group, node or GPU that does not exist, or nothing to undo."""


class Conflict(OverrideError):
    """The override would take what another one holds (a GPU of another job)."""


# Jobs (docs/operations.md, "Jobs"). A name is a Slurm job id or the like: no ':', which
# marks the classes the engine makes for jobs with their own profile (`job:<name>`).
JOB_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
MAX_JOBS = 20_000
MAX_JOB_GPUS = 16_384  # GPUs named by uuid
MAX_JOB_NODES = 2_048
# GPUs named by uuid across all jobs (and, apart, GPUs given a class by uuid). Every one is
# held in memory, indexed again on the loop at each job change and written to the state
# file and the database at every operator write, so the state file, the controller's
# memory and the time of every write grow with this total (docs/performance.md, "Jobs at
# their bounds"). 131,072 is more than every GPU of the largest site measured (100,000)
# named one by one; a job that takes whole nodes names the nodes, which count none.
MAX_JOBS_UUIDS = 131_072
MAX_CLASS_UUIDS = 131_072
MAX_PROFILE_POINTS = 64
_JOB_NAME_RE = re.compile(JOB_NAME_PATTERN)


@dataclass(frozen=True)
class BudgetOverride:
    group: str
    budget_w: float
    expires_at: float | None  # wall-clock seconds; None: until cleared
    reason: str
    actor: str
    created_at: float
    # The expiry on this process's monotonic clock (`anchored`); None: the wall clock alone.
    expires_mono: float | None = None

    def anchored(self, now_wall: float, now_mono: float) -> BudgetOverride:
        """The expiry also on the monotonic clock, converted once by the wall clock read now:
        the cut then ends only once both clocks say so (a wall-clock step forward cannot end
        it early: docs/safety.md, "Ramps")."""
        if self.expires_at is None:
            return self
        mono = now_mono + (self.expires_at - now_wall)
        return replace(self, expires_mono=mono)

    def expired(self, now_wall: float, now_mono: float | None) -> bool:
        if self.expires_at is None or self.expires_at > now_wall:
            return False
        return self.expires_mono is None or now_mono is None or self.expires_mono <= now_mono


@dataclass(frozen=True)
class ScheduledBudget:
    id: str
    group: str
    budget_w: float
    start: float  # wall-clock seconds, as the operator gave them
    end: float | None  # None: until cancelled
    reason: str
    actor: str
    created_at: float
    # The same window on this process's monotonic clock, converted once (`on_monotonic`).
    start_mono: float = math.nan
    end_mono: float | None = None

    def on_monotonic(self, now_wall: float, now_mono: float) -> ScheduledBudget:
        """The window anchored to the monotonic clock by the wall clock read now: the one
        conversion, at acceptance or at a restore (a new process, a standby following)."""
        shift = now_mono - now_wall
        return ScheduledBudget(
            self.id,
            self.group,
            self.budget_w,
            self.start,
            self.end,
            self.reason,
            self.actor,
            self.created_at,
            self.start + shift,
            None if self.end is None else self.end + shift,
        )

    def ceiling_w(self, mono: float, wall: float, rates: RampRates | None, lead_s: float) -> float:
        """The most this window lets its group's budget be now: the lower of its two readings
        (monotonic and wall), so a wall-clock step cannot shorten or lift it."""
        on_wall = window_ceiling_w(self.budget_w, self.start, self.end, wall, rates, lead_s=lead_s)
        if math.isnan(self.start_mono):  # never anchored (`on_monotonic`): the wall reading
            return on_wall
        return min(
            window_ceiling_w(
                self.budget_w, self.start_mono, self.end_mono, mono, rates, lead_s=lead_s
            ),
            on_wall,
        )

    def done(self, mono: float, wall: float, policy_w: float, rates: RampRates | None) -> bool:
        """Ended, and ramped back up to the policy's budget, on both clocks."""
        on_wall = window_done(self.budget_w, self.end, wall, policy_w, rates)
        if math.isnan(self.start_mono):
            return on_wall
        return on_wall and window_done(self.budget_w, self.end_mono, mono, policy_w, rates)


@dataclass(frozen=True)
class Job:
    """GPUs that must share one cap (a synchronous training job), steered as `class_`, or
    by its own profile (points as a policy profile's) with that class's weight and bounds."""

    name: str
    class_: str
    uuids: tuple[str, ...]
    nodes: tuple[str, ...]  # every GPU of these nodes
    profile: tuple[tuple[float, float], ...] | None
    reason: str
    actor: str
    created_at: float


@dataclass(frozen=True)
class Jobs:
    """Every job and who holds which GPU and node. Never changed in place: a change makes a
    new Jobs (the engine recompiles its per-GPU view when it sees a new one), and copies of
    the overrides share it."""

    by_name: Mapping[str, Job] = field(default_factory=dict)
    uuid_job: Mapping[str, str] = field(default_factory=dict)
    node_job: Mapping[str, str] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.by_name)

    @classmethod
    def build(cls, jobs: Iterable[Job]) -> tuple[Jobs, list[str]]:
        """Jobs from a list in one pass, and the names of those dropped: a job naming a GPU
        or node of one before it, or a name twice (only a hand-edited state has them)."""
        by_name: dict[str, Job] = {}
        uuid_job: dict[str, str] = {}
        node_job: dict[str, str] = {}
        dropped = []
        for job in jobs:
            if (
                job.name in by_name
                or any(u in uuid_job for u in job.uuids)
                or any(n in node_job for n in job.nodes)
            ):
                dropped.append(job.name)
                continue
            by_name[job.name] = job
            uuid_job.update(dict.fromkeys(job.uuids, job.name))
            node_job.update(dict.fromkeys(job.nodes, job.name))
        return cls(by_name, uuid_job, node_job), dropped

    def job_of(self, uuid: str, node: str) -> str | None:
        """The job a GPU belongs to: one naming its uuid, else one holding its node."""
        return self.uuid_job.get(uuid) or self.node_job.get(node)

    def with_job(self, job: Job) -> Jobs:
        """These jobs with `job` added, or replacing the job of its name."""
        base = self.without(job.name) if job.name in self.by_name else self
        uuid_job = dict(base.uuid_job)
        uuid_job.update(dict.fromkeys(job.uuids, job.name))
        node_job = dict(base.node_job)
        node_job.update(dict.fromkeys(job.nodes, job.name))
        return Jobs({**base.by_name, job.name: job}, uuid_job, node_job)

    def without(self, name: str) -> Jobs:
        job = self.by_name[name]
        by_name = {n: j for n, j in self.by_name.items() if n != name}
        uuid_job = dict(self.uuid_job)
        for u in job.uuids:
            uuid_job.pop(u, None)
        node_job = dict(self.node_job)
        for n in job.nodes:
            node_job.pop(n, None)
        return Jobs(by_name, uuid_job, node_job)

    def conflicts(
        self, job: Job, node_of: Callable[[str], str | None], gpus_of: Callable[[str], list[str]]
    ) -> list[str]:
        """What another job holds of `job`'s GPUs, one line each (at most 10): a uuid or a
        node it names, a GPU it names on a node `job` names, or the node of a GPU `job`
        names. `node_of`/`gpus_of`: the fleet as heard (a GPU not heard has no node yet)."""
        out: list[str] = []

        def other(owner: str | None) -> bool:
            return owner is not None and owner != job.name

        for u in job.uuids:
            node = node_of(u)
            owner = self.uuid_job.get(u)
            if other(owner):
                out.append(f"GPU {u} is in job '{owner}'")
            elif node is not None and other(self.node_job.get(node)) and owner is None:
                out.append(f"GPU {u} is on node {node} of job '{self.node_job[node]}'")
            if len(out) >= 10:
                return out
        for n in job.nodes:
            owner = self.node_job.get(n)
            if other(owner):
                out.append(f"node {n} is in job '{owner}'")
            for u in gpus_of(n):
                owner = self.uuid_job.get(u)
                if other(owner):
                    out.append(f"GPU {u} on node {n} is in job '{owner}'")
            if len(out) >= 10:
                return out
        return out


def check_job(policy: Policy, job: Job) -> None:
    """Raise OverrideError (NotFound for nodes the policy lacks) if the job cannot be."""
    if not _JOB_NAME_RE.match(job.name):
        raise OverrideError(
            f"job name '{job.name[:80]}' must be 1-64 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    if job.class_ not in policy.classes:
        valid = ", ".join(sorted(policy.classes))
        raise OverrideError(f"unknown class '{job.class_}'; valid: {valid}")
    if not job.uuids and not job.nodes:
        raise OverrideError("a job names at least one GPU (uuids) or node (nodes)")
    if len(job.uuids) > MAX_JOB_GPUS or len(job.nodes) > MAX_JOB_NODES:
        raise OverrideError(f"a job names at most {MAX_JOB_GPUS} GPUs and {MAX_JOB_NODES} nodes")
    known = set(policy.node_names())
    bad = [n for n in job.nodes if n not in known]
    if bad:
        raise NotFound(f"unknown node(s): {', '.join(bad[:5])}")
    if job.profile is not None:
        if len(job.profile) > MAX_PROFILE_POINTS:
            raise OverrideError(f"a profile has at most {MAX_PROFILE_POINTS} points")
        try:
            Profile.from_points(f"job {job.name}", job.profile)
        except ProfileError as exc:
            raise OverrideError(f"profile: {exc}") from None


@dataclass
class Overrides:
    budgets: dict[str, BudgetOverride] = field(default_factory=dict)
    schedules: dict[str, ScheduledBudget] = field(default_factory=dict)  # by id
    gpu_classes: dict[str, str] = field(default_factory=dict)  # uuid → class
    node_classes: dict[str, str] = field(default_factory=dict)  # node → class
    pins: dict[str, float] = field(default_factory=dict)  # uuid → W
    drained: set[str] = field(default_factory=set)  # nodes held at their GPUs' minimum
    jobs: Jobs = field(default_factory=Jobs)  # replaced on change, never changed in place
    # Authorities this controller hands its nodes over to (docs/operations.md, "Handing
    # nodes over"): named in every command; meanwhile every GPU counts at its maximum.
    handover: tuple[Authority, ...] = ()

    def put_job(
        self,
        policy: Policy,
        job: Job,
        node_of: Callable[[str], str | None],
        gpus_of: Callable[[str], list[str]],
    ) -> bool:
        """Add a job or replace the job of its name; True if it replaced one. Conflict if
        another job holds any of its GPUs (nothing changes)."""
        check_job(policy, job)
        replaced = job.name in self.jobs.by_name
        if not replaced and len(self.jobs) >= MAX_JOBS:
            raise OverrideError(f"at most {MAX_JOBS} jobs; delete jobs that ended")
        old = self.jobs.by_name.get(job.name)
        named = len(self.jobs.uuid_job) - (0 if old is None else len(set(old.uuids)))
        if named + len(set(job.uuids)) > MAX_JOBS_UUIDS:
            raise OverrideError(
                f"jobs name at most {MAX_JOBS_UUIDS} GPUs by uuid in all ({named} now); "
                "name nodes, or delete jobs that ended"
            )
        taken = self.jobs.conflicts(job, node_of, gpus_of)
        if taken:
            raise Conflict(f"job '{job.name}' not set: " + "; ".join(taken))
        self.jobs = self.jobs.with_job(job)
        return replaced

    def delete_job(self, name: str) -> Job:
        job = self.jobs.by_name.get(name)
        if job is None:
            raise NotFound(f"no job '{name}'")
        self.jobs = self.jobs.without(name)
        return job

    def set_budget(self, policy: Policy, override: BudgetOverride) -> None:
        groups = {g.name: g for g in policy.groups}
        group = groups.get(override.group)
        if group is None:
            raise NotFound(f"unknown group '{override.group}'")
        if not override.budget_w > 0:
            raise OverrideError("budget_w must be greater than 0")
        if override.budget_w > group.budget_w:
            raise OverrideError(
                f"a temporary budget can only lower '{override.group}' "
                f"(policy budget {group.budget_w:,.0f} W)"
            )
        if override.expires_at is not None and override.expires_at <= override.created_at:
            raise OverrideError("expires_at must lie in the future")
        self.budgets[override.group] = override

    def clear_budget(self, group: str) -> BudgetOverride:
        try:
            return self.budgets.pop(group)
        except KeyError:
            raise NotFound(f"no temporary budget on '{group}'") from None

    def active_budgets(
        self, policy: Policy, now_wall: float, now_mono: float | None = None
    ) -> dict[str, float]:
        """Budgets in force by group name: the lower of the policy's and the override's.

        Expired overrides (on both clocks, where anchored) are dropped (and logged) here, so
        they end on the next tick.
        """
        if not self.budgets:
            return {}  # (most ticks: no group's table of budgets to build)
        for name in [n for n, o in self.budgets.items() if o.expired(now_wall, now_mono)]:
            expired = self.budgets.pop(name)
            log.info("budget_override_expired", group=name, budget_w=expired.budget_w)
        policy_budgets = {g.name: g.budget_w for g in policy.groups}
        return {
            name: min(o.budget_w, policy_budgets[name])
            for name, o in self.budgets.items()
            if name in policy_budgets
        }

    def add_schedule(self, policy: Policy, entry: ScheduledBudget, now_wall: float) -> None:
        """Accept a scheduled budget (already on the monotonic clock): OverrideError if it
        does not fit, NotFound if its group does not exist."""
        group = next((g for g in policy.groups if g.name == entry.group), None)
        if group is None:
            raise NotFound(f"unknown group '{entry.group}'")
        if not 0 < entry.budget_w <= group.budget_w:
            raise OverrideError(
                f"a scheduled budget can only lower '{entry.group}' "
                f"(policy budget {group.budget_w:,.0f} W) and must be greater than 0"
            )
        if entry.start < now_wall - START_GRACE_S:
            raise OverrideError(
                f"start lies {now_wall - entry.start:,.0f} s in the past "
                f"(at most {START_GRACE_S:g} s is accepted); for a cut now, set no start"
            )
        if entry.start > now_wall + MAX_AHEAD_S:
            raise OverrideError(f"start lies more than {MAX_AHEAD_S / 86400:g} days ahead")
        if entry.end is not None:
            if entry.end <= entry.start:
                raise OverrideError("end must be after start")
            if entry.end - entry.start > MAX_WINDOW_S:
                raise OverrideError(f"a window lasts at most {MAX_WINDOW_S / 86400:g} days")
        if entry.id in self.schedules:
            raise OverrideError(f"schedule '{entry.id}' exists")
        if len(self.schedules) >= MAX_SCHEDULES:
            raise OverrideError(
                f"{MAX_SCHEDULES} scheduled budgets are pending already; cancel one first"
            )
        self.schedules[entry.id] = entry

    def cancel_schedule(self, schedule_id: str) -> ScheduledBudget:
        try:
            return self.schedules.pop(schedule_id)
        except KeyError:
            raise NotFound(f"no scheduled budget '{schedule_id}'") from None

    def scheduled_budgets(
        self, policy: Policy, mono: float, wall: float, lead_s: float
    ) -> dict[str, float]:
        """Per group, the most its scheduled windows let its budget be now (ramped at the
        policy's rates); windows that are over and ramped out are dropped (and logged)."""
        if not self.schedules:
            return {}  # (most ticks: no group's table of budgets to build)
        rates = policy.control.ramp_w_per_s
        policy_budgets = {g.name: g.budget_w for g in policy.groups}
        out: dict[str, float] = {}
        for sid, e in list(self.schedules.items()):
            policy_w = policy_budgets.get(e.group)
            if policy_w is None:
                continue
            if e.done(mono, wall, policy_w, rates):
                del self.schedules[sid]
                log.info("budget_schedule_ended", id=sid, group=e.group, budget_w=e.budget_w)
                continue
            ceiling = e.ceiling_w(mono, wall, rates, lead_s)
            if ceiling < out.get(e.group, math.inf):
                out[e.group] = ceiling
        return out

    def assign_class(
        self,
        policy: Policy,
        cls: str,
        *,
        uuids: list[str] | None = None,
        nodes: list[str] | None = None,
    ) -> None:
        if cls not in policy.classes:
            valid = ", ".join(sorted(policy.classes))
            raise OverrideError(f"unknown class '{cls}'; valid: {valid}")
        known_nodes = set(policy.node_names())
        bad = [n for n in nodes or [] if n not in known_nodes]
        if bad:
            raise OverrideError(f"unknown node(s): {', '.join(bad[:5])}")
        new = len(set(uuids or []).difference(self.gpu_classes))
        if len(self.gpu_classes) + new > MAX_CLASS_UUIDS:
            raise OverrideError(
                f"at most {MAX_CLASS_UUIDS} GPUs have a class by uuid "
                f"({len(self.gpu_classes)} now); assign nodes, or clear GPUs gone"
            )
        for uuid in uuids or []:
            self.gpu_classes[uuid] = cls
        for node in nodes or []:
            self.node_classes[node] = cls

    def clear_class(
        self, *, uuids: list[str] | None = None, nodes: list[str] | None = None
    ) -> None:
        for uuid in uuids or []:
            self.gpu_classes.pop(uuid, None)
        for node in nodes or []:
            self.node_classes.pop(node, None)

    def class_of(self, uuid: str, node: str, reported: str | None) -> str | None:
        """Assignment by GPU, then by node, then what the workload itself reports."""
        return self.gpu_classes.get(uuid) or self.node_classes.get(node) or reported

    def pinned_w(self, uuid: str, node: str, min_cap_w: float, max_cap_w: float) -> float | None:
        """The fixed cap of a pinned GPU (clamped to its limits), a drained node's minimum."""
        if node in self.drained:
            return min_cap_w
        pin = self.pins.get(uuid)
        return None if pin is None else min(max(pin, min_cap_w), max_cap_w)

    def forget_policy_gaps(self, policy: Policy) -> None:
        """After a policy change, drop overrides that name groups, nodes or classes now gone."""
        names = {g.name for g in policy.groups}
        nodes = set(policy.node_names())
        for group in [g for g in self.budgets if g not in names]:
            del self.budgets[group]
        self.schedules = {i: e for i, e in self.schedules.items() if e.group in names}
        self.node_classes = {
            n: c for n, c in self.node_classes.items() if n in nodes and c in policy.classes
        }
        self.gpu_classes = {u: c for u, c in self.gpu_classes.items() if c in policy.classes}
        self.drained &= nodes
