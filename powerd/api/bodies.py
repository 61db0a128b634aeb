"""The admin API's request and response bodies (kept apart from the wire and SQL models).

Power in W, times in seconds since the epoch (UTC) unless named `_age_s`. JSON has no
infinity: an unlimited budget is `null`.
"""

from __future__ import annotations

from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, model_validator

from powerd.controller.overrides import (
    MAX_JOB_GPUS,
    MAX_JOB_NODES,
    MAX_PROFILE_POINTS,
)
from powerd.wire import MAX_SANE_WATTS, NODE_ID_PATTERN, UUID_PATTERN, Authority

T = TypeVar("T")

Reason = Annotated[
    str,
    Field(
        min_length=1,
        max_length=500,
        pattern=r"\S",
        description="Why: written to the audit log (a ticket, a grid event id, a job id).",
    ),
]
NodeName = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
GpuUuid = Annotated[str, Field(pattern=UUID_PATTERN)]
Watts = Annotated[float, Field(gt=0, le=1e9, allow_inf_nan=False)]
GpuWatts = Annotated[float, Field(gt=0, le=MAX_SANE_WATTS, allow_inf_nan=False)]
NodeStateName = Literal["unseen", "starting", "steered", "failsafe", "offline"]
GpuStateName = Literal["ok", "stale"]


class _Out(BaseModel):
    model_config = ConfigDict(populate_by_name=True)


class Problem(_Out):
    path: str = Field(description="Where in the input, e.g. `facility.rows[0].budget_w`.")
    message: str


class ErrorOut(_Out):
    detail: str
    problems: list[Problem] = Field(default_factory=list)


class Page(_Out, Generic[T]):
    items: list[T]
    total: int
    limit: int
    offset: int


# ---- health ----


class Liveness(_Out):
    status: Literal["ok"] = "ok"


class Readiness(_Out):
    ready: bool
    broker_connected: bool
    store_connected: bool | None = Field(description="null: the controller runs without a store")
    store_backlog: int | None
    store_error: str | None
    last_tick_age_s: float | None


# ---- fleet ----


class GroupMeterOut(_Out):
    """A metered group's meter (docs/operations.md, "Metered groups")."""

    state: Literal["fresh", "stale", "frozen", "none"] = Field(
        description="fresh: the overload rule uses the reading; stale, frozen (unchanged for "
        "the meter's frozen_s) or none (never read): a rated group steers on its strict budget."
    )
    reading_w: float | None = Field(description="The last reading.")
    age_s: float | None = Field(description="Its age on the controller's clock.")
    nodes_w: float = Field(description="The nodes' draw plus overhead, as the rule counts it.")
    gap_w: float | None = Field(description="Meter minus nodes' figure (fresh readings only).")
    bound_w: float | None = Field(description="The gap beyond which it alarms.")
    overhead_w: float = Field(description="The policy's overhead_w below the group.")
    overhead_learned_w: float | None = Field(
        description="Meter minus the GPUs' reported draw, smoothed."
    )
    overhead_error_w: float | None = Field(description="The spread (RMS) of that estimate.")
    overhead_unseen_w: float = Field(
        description="Learned overhead beyond the policy's (less its error, in steps): the "
        "group's limit is that much below its budget."
    )
    readings: int = Field(description="Readings the learned overhead has taken.")
    error: str | None = Field(description="The last poll's failure, if it failed.")


class GroupUse(_Out):
    name: str
    level: str
    budget_w: float | None = Field(description="In force (policy or temporary, the lower).")
    committed_w: float = Field(description="Committed caps + overhead: the most it may draw.")
    draw_w: float
    over: bool = Field(description="Committed above budget: a cut not yet acknowledged.")
    limit_w: float | None = Field(
        default=None,
        description="What committed caps may reach this tick: the budget, or up to its "
        "overload rating where the policy declares one and the GPUs do not draw their caps.",
    )
    price_per_kw: float | None = Field(
        default=None,
        description="The budget's shadow price this tick (weighted throughput per kW; 0: not "
        "binding); null: the solver gives none, or the tick fell back.",
    )
    meter: GroupMeterOut | None = Field(
        default=None, description="The group's meter, where the policy names one."
    )


class MemberOut(_Out):
    controller: str
    role: Literal["leader", "standby"]
    epoch: int
    age_s: float = Field(description="Since it last renewed or tried to take the lease.")


class LeadershipOut(_Out):
    scope: str = Field(description="What the lease covers: the policy's root, or --scope.")
    mode: Literal["lease", "alone"] = Field(
        description="lease: commands only while holding the lease (PostgreSQL); alone: the "
        "only controller of an SQLite store, which commands through database outages."
    )
    controller: str = Field(description="The controller that answers.")
    role: Literal["leader", "standby"]
    leader: str | None = Field(description="Who holds the lease, as last read.")
    epoch: int = Field(description="The leader's epoch: agents refuse commands of lower ones.")
    lease_left_s: float | None = Field(
        description="Leading: seconds before this controller stops commanding unless renewed."
    )
    standbys: list[str]
    members: list[MemberOut]
    takeovers: int = Field(description="Times this controller began to lead.")
    stepped_down: int = Field(description="Times it stopped leading.")
    fenced: int = Field(description="Commands the agents refused for a lower epoch.")
    withheld: int = Field(description="Commands not sent: the lease ran out first.")
    db_failures: int = Field(description="Lease attempts failed in a row.")
    last_error: str | None
    authority: Authority | None = Field(
        default=None, description="Whom it commands for: the site, the store's id, the domain."
    )
    policy_version: int | None = Field(
        default=None, description="The stored policy version in force (the policy of record)."
    )
    policy_differs: str | None = Field(
        default=None, description="Set when the policy file differs from the policy of record."
    )
    clock_skew_s: float | None = Field(
        default=None, description="This host's wall clock minus its database's, as measured."
    )
    outage_s: float | None = Field(
        default=None,
        description="Leading through a database outage for this long (None: not in one).",
    )


class FleetSummary(_Out):
    leadership: LeadershipOut | None = Field(
        default=None, description="Which controller leads this scope (none in tests)."
    )
    tick: int | None
    ts: float | None
    status: str | None
    solver: str | None
    solve_ms: float | None
    duration_ms: float | None
    policy_version: int | None
    policy_source: str
    tick_s: float | None = Field(default=None, description="The policy's tick interval.")
    facility: GroupUse | None
    rows: list[GroupUse]
    nodes: int = Field(description="Nodes in the policy's inventory.")
    nodes_by_state: dict[str, int]
    gpus: int
    gpus_stale: int
    throughput: float | None
    throughput_by_class: dict[str, float]
    alarms: list[str]


class NodeOut(_Out):
    name: str
    row: str | None
    rack: str | None
    state: NodeStateName
    drained: bool
    assigned_class: str | None = Field(description="Class assigned to the whole node, if any.")
    classes: list[str] = Field(description="Classes its GPUs were steered as on the last tick.")
    gpus: int
    last_seen_age_s: float | None
    budget_w: float | None
    committed_w: float | None
    draw_w: float | None


class GpuOut(_Out):
    uuid: str
    node: str
    row: str | None
    rack: str | None
    index: int
    name: str
    class_: str | None = Field(alias="class", description="As steered on the last tick.")
    state: GpuStateName
    pinned_w: float | None
    drained: bool
    job: str | None = Field(
        default=None,
        description="The operators' job it belongs to now (by uuid, else by its node); else "
        "the job its node reports, as the last tick coupled it (`control.reported_jobs`: "
        "`<job>@<node>` with scope node).",
    )
    power_w: float
    cap_w: float = Field(description="Enforced limit, read back by the agent.")
    set_w: float | None = Field(
        default=None,
        description="The limit its agent last set (a command's cap or its failsafe cap);"
        " cap_w away from it is a limit powerd did not set (alarm cap_overridden).",
    )
    cap_restores: int = Field(
        default=0,
        description="Limits its agent found above set_w (a GPU reset, a driver reload, another"
        " tool) and set back, since the agent started.",
    )
    target_w: float | None = Field(description="Last tick's allocation.")
    sent_w: float | None = Field(description="Cap sent on the last tick (null: none sent).")
    committed_w: float | None
    min_cap_w: float
    max_cap_w: float
    temp_c: float
    util_pct: float
    throttle: list[str]
    age_s: float


class GpuCap(_Out):
    uuid: str
    node: str
    class_: str = Field(alias="class")
    target_w: float
    sent_w: float | None
    committed_w: float


class AllocationOut(_Out):
    tick: int
    ts: float
    status: str
    solver: str
    objective: float | None
    solve_ms: float
    caps: Page[GpuCap]


class TickOut(_Out):
    tick: int
    ts: float
    status: str
    solver: str
    solve_ms: float
    budget_w: float | None
    committed_w: float
    draw_w: float
    throughput: float
    gpus: int
    gpus_stale: int


class HistoryPoint(_Out):
    ts: float = Field(description="The end of the interval (its newest tick).")
    ticks: int = Field(description="Ticks in the interval.")
    budget_w: float | None = Field(description="The lowest budget in force (null: none).")
    committed_w: float | None = Field(description="The highest committed sum.")
    draw_w: float | None = Field(description="Mean measured draw.")
    draw_max_w: float | None = Field(description="Highest measured draw.")


class FacilityHistory(_Out):
    source: Literal["store", "memory"] = Field(
        description="store: the database (outlives restarts); memory: the last ticks this "
        "controller ran (no store)."
    )
    since: float = Field(description="The window's start (epoch seconds).")
    until: float = Field(description="The window's end: the controller's time of the answer.")
    step_s: float = Field(description="The width of one interval.")
    points: list[HistoryPoint] = Field(description="Oldest first; empty intervals left out.")


class AlarmOut(_Out):
    kind: str
    message: str


class EventOut(_Out):
    id: int
    ts: float
    kind: str
    severity: str
    message: str
    data: dict[str, Any]
    cleared_at: float | None


class AuditOut(_Out):
    id: int
    ts: float
    actor: str
    role: str
    action: str
    target: str
    reason: str
    payload: dict[str, Any]
    result: str


class PolicyOut(_Out):
    version: int | None
    source: str
    sha256: str | None
    activated_at: float | None
    yaml: str | None = Field(description="The text in force (null without a store).")


class LearningOut(_Out):
    enabled: bool
    in_use: bool = Field(description="The learned curve steers this class now.")
    reason: str = Field(description="Why it is or is not in use.")
    samples: int = Field(description="Samples within the learning window.")
    bins: int = Field(description="Power bins with enough samples.")
    span_w: float = Field(description="Watts between the lowest and highest bin.")
    fit_error: float | None = Field(description="RMS gap to the envelope, share of its peak.")
    learned_points: list[tuple[float, float]] = Field(
        description="The last fit, in the policy profile's units (even when not in use)."
    )
    fitted_at: float | None = Field(description="Controller monotonic time of the last fit.")


class ClassOut(_Out):
    name: str
    weight: float
    floor_w: float | None
    ceiling_w: float | None
    profile: str = Field(description="The policy's profile for the class.")
    profile_in_use: str = Field(description="'policy' or 'learned'.")
    points: list[tuple[float, float]] = Field(description="The curve the allocator steers by.")
    learning: LearningOut | None = Field(description="Null: the class does not learn.")


class BudgetOut(_Out):
    group: str
    budget_w: float
    policy_budget_w: float | None
    expires_at: float | None
    reason: str
    actor: str
    created_at: float


class ScheduleOut(_Out):
    """A scheduled budget: a group's budget lowered over a window, ramped in and out."""

    id: str
    group: str
    budget_w: float
    policy_budget_w: float | None
    start: float
    end: float | None = Field(description="Epoch seconds; null: until cancelled.")
    ramp_from: float = Field(
        description="When the budget in force begins to move toward this one (epoch seconds, "
        "from the budget in force now and the policy's ramp_w_per_s.down)."
    )
    state: Literal["pending", "ramping", "active", "ended"]
    reason: str
    actor: str
    created_at: float


class OverridesOut(_Out):
    budgets: list[BudgetOut]
    schedules: list[ScheduleOut] = Field(default_factory=list)
    pins_w: dict[str, float]
    drained: list[str]
    gpu_classes: dict[str, str]
    node_classes: dict[str, str]
    handover: list[Authority] = Field(default_factory=list)


# ---- writes ----


class WriteRefused(ErrorOut):
    """A write that was not applied: refused (404, 422) or rolled back (503)."""

    applied: Literal[False] = False
    audited: bool = Field(
        default=False,
        description="The refusal's audit row is in the database now (else queued until it "
        "answers; a request failing schema validation is only logged).",
    )


class WriteOut(_Out):
    action: str
    target: str
    after_tick: int | None = Field(
        description="The last tick before the change: it takes effect on the next one."
    )
    applied: bool = Field(default=True, description="In force from the next tick.")
    durable: bool = Field(
        default=False,
        description="Written to the controller's state file: it outlives a restart.",
    )
    audited: bool = Field(
        default=False,
        description="Its audit row is in the database now; false: queued (written when the "
        "database answers again) or the controller runs without a store.",
    )
    detail: str | None = Field(
        default=None, description="Why not durable or not audited, for a person."
    )


class PolicyReplaced(WriteOut):
    version: int | None = Field(
        description="Its policy version; null until the database has stored it."
    )


class BudgetIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    budget_w: Watts
    expires_at: float | None = Field(
        default=None, allow_inf_nan=False, description="Epoch seconds; or give ttl_s."
    )
    ttl_s: float | None = Field(default=None, gt=0, le=30 * 86400, allow_inf_nan=False)
    reason: Reason

    @model_validator(mode="after")
    def _one_expiry(self) -> BudgetIn:
        if self.expires_at is not None and self.ttl_s is not None:
            raise ValueError("give expires_at or ttl_s, not both")
        return self


EpochSeconds = Annotated[float, Field(ge=0, le=1e11, allow_inf_nan=False)]


class ScheduleIn(BaseModel):
    """A group's budget over a future window: the budget in force ramps down to `budget_w`
    by `start` and back up from `end` at the policy's `control.ramp_w_per_s`."""

    model_config = ConfigDict(extra="forbid")

    budget_w: Watts
    start: EpochSeconds = Field(description="Epoch seconds (UTC): the target holds from here.")
    end: EpochSeconds | None = Field(
        default=None, description="Epoch seconds; null: until cancelled. After start."
    )
    reason: Reason

    @model_validator(mode="after")
    def _ordered(self) -> ScheduleIn:
        if self.end is not None and self.end <= self.start:
            raise ValueError("end must be after start")
        return self


class ClassAssignIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    class_: str = Field(alias="class", min_length=1, max_length=128)
    uuids: list[GpuUuid] = Field(default_factory=list, max_length=10_000)
    nodes: list[NodeName] = Field(default_factory=list, max_length=10_000)
    reason: Reason

    @model_validator(mode="after")
    def _something(self) -> ClassAssignIn:
        if not self.uuids and not self.nodes:
            raise ValueError("name at least one GPU (uuids) or node (nodes)")
        return self


class ClassClearIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    uuids: list[GpuUuid] = Field(default_factory=list, max_length=10_000)
    nodes: list[NodeName] = Field(default_factory=list, max_length=10_000)
    reason: Reason

    @model_validator(mode="after")
    def _something(self) -> ClassClearIn:
        if not self.uuids and not self.nodes:
            raise ValueError("name at least one GPU (uuids) or node (nodes)")
        return self


class PinIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    watts: GpuWatts
    reason: Reason


class ReasonIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: Reason


class HandoverIn(BaseModel):
    """The authorities to hand this controller's nodes to (docs/operations.md, "Handing
    nodes over"): in the same site; `store` from `powerd db id`, `domain` the successor's
    lease domain (the policy's root, or its --scope)."""

    model_config = ConfigDict(extra="forbid")

    to: list[Authority] = Field(min_length=1, max_length=4)
    reason: Reason


# ---- jobs ----

ProfileWatts = Annotated[float, Field(ge=0, le=MAX_SANE_WATTS, allow_inf_nan=False)]
Throughput = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]


class JobIn(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    class_: str = Field(alias="class", min_length=1, max_length=128)
    uuids: list[GpuUuid] = Field(
        default_factory=list,
        max_length=MAX_JOB_GPUS,
        description="GPUs by uuid; ones not heard from yet are accepted (named in the answer).",
    )
    nodes: list[NodeName] = Field(
        default_factory=list, max_length=MAX_JOB_NODES, description="Every GPU of these nodes."
    )
    profile: list[tuple[ProfileWatts, Throughput]] | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_PROFILE_POINTS,
        description="[power_w, throughput] points, as a policy profile's; the job then steers "
        "by this curve with its class's weight, floor and ceiling.",
    )
    reason: Reason

    @model_validator(mode="after")
    def _something(self) -> JobIn:
        if not self.uuids and not self.nodes:
            raise ValueError("name at least one GPU (uuids) or node (nodes)")
        return self


class JobOut(_Out):
    name: str
    class_: str = Field(alias="class")
    uuids: list[str]
    nodes: list[str]
    profile: list[tuple[float, float]] | None
    gpus_seen: int = Field(description="Its GPUs heard from now (by uuid or on its nodes).")
    unseen_uuids: list[str] = Field(
        description="GPUs it names by uuid that no telemetry names now (at most 100)."
    )
    reason: str
    actor: str
    created_at: float


class JobWriteOut(WriteOut):
    job: JobOut
    replaced: bool = Field(description="It replaced a job of the same name.")


class JobDeleted(WriteOut):
    gpus: int = Field(description="GPUs it named by uuid.")
    nodes: int = Field(description="Nodes it named.")


# ---- why a cap (powerd/controller/why.py; docs/api.md, "Why a cap") ----

WhyReason = Literal[
    "fallback",
    "refused",
    "drained",
    "pinned",
    "min_over_budget",
    "stale",
    "slew",
    "ceiling",
    "max",
    "floor",
    "min",
    "demand",
    "budget",
    "held_back",
    "not_sent",
]


class WhyBudget(_Out):
    """The tightest budget on the GPU's path: the highest shadow price, or the least slack."""

    group: str
    level: Literal["facility", "row", "rack", "node"]
    budget_w: float | None = Field(description="In force (policy or temporary); null: none.")
    limit_w: float | None = Field(description="What committed caps may reach (overload rating).")
    committed_w: float | None = Field(description="Σ committed caps + overhead + reserve.")
    slack_w: float | None
    price_per_kw: float | None = Field(
        description="The budget's shadow price (weighted throughput per kW); 0: not binding; "
        "null: the solver gives none."
    )


class WhyDemand(_Out):
    demand_w: float | None = Field(description="The allocator's demand estimate.")
    cap_limited: bool = Field(description="Drawing near its cap: estimated at its maximum.")
    peak_w: float | None = Field(description="Its class profile's peak: no gain past it.")
    power_w: float | None = Field(description="The sample's draw.")
    reported_cap_w: float | None = Field(description="The limit the sample reported in force.")
    sample_age_s: float | None
    sample_seq: int | None = Field(description="The node's telemetry sequence number.")
    stale: bool


class WhyClass(_Out):
    name: str
    weight: float
    floor_w: float | None
    ceiling_w: float | None
    floor_dropped: bool = Field(description="Its floor was dropped to fit a budget.")


class WhyBounds(_Out):
    lo_w: float | None = Field(description="The allocator's lower bound; null: it failed.")
    hi_w: float | None
    min_cap_w: float
    max_cap_w: float


class WhySlew(_Out):
    slew_w: float
    from_w: float | None = Field(description="The cap that may have been in force before.")
    limited: Literal["up", "down"] | None


class WhyAwaited(_Out):
    """A cut sent and not acknowledged yet: its ack makes room for the raise."""

    node: str
    uuid: str
    committed_w: float
    sent_w: float
    since_tick: int | None


class WhyPlanner(_Out):
    """What the safety planner did with the wanted cap (null: sent as wanted)."""

    held_back_w: float | None
    reason: Literal[
        "node_offline",
        "node_waiting",
        "no_command",
        "stale",
        "group_over",
        "awaiting_acks",
        "no_room",
    ]
    group: str | None = Field(description="The group whose committed caps leave no room.")
    awaiting: list[WhyAwaited]
    awaiting_more: int = Field(description="Further cuts awaited, not listed.")


class WhyOut(_Out):
    uuid: str
    node: str
    source: Literal["live", "stored"] = Field(
        description="live: the last tick; stored: the explanation stored with the cap change "
        "in force at `at`."
    )
    tick: int
    ts: float
    status: str = Field(description="The allocator's status that tick.")
    solver: str
    target_w: float | None = Field(description="The cap the allocator wanted.")
    sent_w: float | None = Field(description="The cap sent; null: its node got no command.")
    committed_w: float | None
    decided_by: list[WhyReason] = Field(description="What decided the caps, main reason first.")
    summary: str
    budget: WhyBudget
    demand: WhyDemand
    class_: WhyClass = Field(alias="class")
    job: str | None
    pin_w: float | None
    drained: bool
    refused: bool = Field(description="It refused its last cap: held at what it may have.")
    bounds: WhyBounds
    slew: WhySlew | None
    planner: WhyPlanner | None
