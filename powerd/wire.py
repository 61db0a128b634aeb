"""Wire protocol v1: the MQTT topics and the JSON payloads agents and controller exchange.

Every payload carries `"v": 1` and the `node_id` that must match its topic. Field names carry
units. Decoding never raises anything but `WireError`, with a short reason code that the
receiver counts and logs (see docs/protocol.md).
"""

from __future__ import annotations

from enum import StrEnum
from itertools import pairwise
from typing import Annotated, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

PROTOCOL_VERSION = 1
DEFAULT_PREFIX = "powerd/v1"
MAX_PAYLOAD_BYTES = 256 * 1024
NODE_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
UUID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$"
# A job as a node reports it (docs/protocol.md): Kubernetes' `namespace/name` forms fit.
REPORTED_JOB_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,127}$"
MAX_GPUS_PER_NODE = 64
# A cap no real GPU accepts; anything above is a corrupt or hostile message.
MAX_SANE_WATTS = 10_000.0
# NVML works in milliwatts and some drivers round the enforced limit: an enforced limit this
# close to the one set is that limit (agent and controller compare with the same tolerance).
CAP_TOLERANCE_W = 1.0
# Ticks and sequence numbers: exact in a JSON number read as a double, and far beyond any
# run (a tick a second for 285 million years). Larger is a corrupt or hostile message: an
# unbounded integer once overflowed the controller's int64 arrays and killed it.
MAX_TICK = 2**53 - 1
Tick = Annotated[int, Field(ge=0, le=MAX_TICK)]
# A leader's fencing token: taken anew at each election, only ever larger. A command from a
# lower epoch than one an agent has seen is refused, however late it arrives.
MAX_EPOCH = MAX_TICK
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
ShortText = Annotated[str, StringConstraints(max_length=64)]

NodeId = Annotated[str, Field(pattern=NODE_ID_PATTERN)]
GpuUuid = Annotated[str, Field(pattern=UUID_PATTERN)]
Watts = Annotated[float, Field(ge=0, le=MAX_SANE_WATTS, allow_inf_nan=False)]
PosWatts = Annotated[float, Field(gt=0, le=MAX_SANE_WATTS, allow_inf_nan=False)]


class WireError(ValueError):
    """A message that must be dropped; `reason` is a short code for counters and logs."""

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason = reason
        self.detail = detail
        super().__init__(f"{reason}: {detail}" if detail else reason)


class _Msg(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    node_id: NodeId


class GpuTelemetry(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    uuid: GpuUuid
    index: int = Field(ge=0, lt=MAX_GPUS_PER_NODE)
    name: str = Field(default="", max_length=128)
    power_w: Watts
    energy_j: float = Field(ge=0, allow_inf_nan=False)
    cap_w: Watts  # enforced limit, read back from the device
    min_cap_w: Watts
    max_cap_w: PosWatts
    default_cap_w: Watts
    temp_c: float = Field(ge=-50, le=200, allow_inf_nan=False)
    util_pct: float = Field(ge=0, le=100, allow_inf_nan=False)
    sm_clock_mhz: float = Field(ge=0, le=10_000, allow_inf_nan=False)
    throttle: list[ShortText] = Field(default_factory=list, max_length=32)
    workload: str | None = Field(default=None, max_length=128)
    # The job running on the GPU as its node knows it (a Kubernetes pod's job label, or the
    # pod itself); None: none known. Untrusted like the rest: the controller couples a
    # node's GPUs by it, and across nodes only where the policy says so (docs/policy.md,
    # `control.reported_jobs`).
    job: str | None = Field(default=None, pattern=REPORTED_JOB_PATTERN)
    perf: float | None = Field(default=None, ge=0, le=1e12, allow_inf_nan=False)
    error: str | None = Field(default=None, max_length=256)  # e.g. "gpu_lost"
    # The limit this agent last set on the GPU (a command's cap or its own failsafe cap), or
    # the driver's requested limit where a lower limit another holds keeps the GPU under it
    # and it is higher than the set (raised behind the agent's back, not set back yet);
    # None: none set since it started (or an agent older than these fields). `cap_w`
    # differing from it is a limit powerd did not set: the controller alarms
    # (`cap_overridden`), and counts the GPU at no less than it (the lower limit may lift).
    set_w: Watts | None = None
    # Times since the agent started that it found the limit above `set_w` (another tool, a
    # GPU reset, a driver reload) and set it back at once; `found_w`: the limit found the
    # latest time.
    restores: int = Field(default=0, ge=0, le=MAX_TICK)
    found_w: Watts | None = None

    @model_validator(mode="after")
    def _limits_ordered(self) -> GpuTelemetry:
        if self.min_cap_w > self.max_cap_w:
            raise ValueError(f"min_cap_w {self.min_cap_w:g} exceeds max_cap_w {self.max_cap_w:g}")
        return self


class NodeTelemetry(_Msg):
    ts: float = Field(allow_inf_nan=False)  # agent's wall clock: informational, never for safety
    seq: Tick
    period_s: float = Field(gt=0, le=86_400, allow_inf_nan=False)
    gpus: list[GpuTelemetry] = Field(max_length=MAX_GPUS_PER_NODE)
    state: Literal["steered", "failsafe", "starting"] = "steered"
    # The tick of the last command the agent applied when it sampled (None: none since it
    # started). The controller orders a node's readings by it, not by `ts`.
    tick: Tick | None = None
    # The epoch of that command (None: an older agent): a tick of an older leader's says
    # nothing of the order of a newer leader's.
    epoch: Epoch | None = None

    @field_validator("gpus")
    @classmethod
    def _unique(cls, gpus: list[GpuTelemetry]) -> list[GpuTelemetry]:
        if len({g.uuid for g in gpus}) != len(gpus):
            raise ValueError("a GPU uuid appears twice")
        return gpus


AuthorityName = Annotated[str, Field(max_length=128, pattern=r"^[A-Za-z0-9_.:/-]*$")]


class Authority(BaseModel):
    """Who commands a node: a site (the policy's `site`), a store (the id its database got
    when it was created) and a domain (the lease's key: the policy root or one scope). An
    agent obeys one authority at a time (docs/safety.md, "Authority"); epochs order the
    leaders *within* one authority only."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    site: AuthorityName = ""
    store: AuthorityName = ""
    domain: AuthorityName = ""

    def label(self) -> str:
        return f"site {self.site or '?'} store {self.store[:12] or '?'} domain {self.domain or '?'}"


# What the commands of a controller older than authorities carry: agents that obey it take
# the first command of a real authority at once (an upgrade costs no lease at failsafe),
# and controllers do not count its nodes as foreign.
LEGACY_AUTHORITY = Authority()


class CapCommand(_Msg):
    tick: Tick
    epoch: Epoch = 0  # the leader's; absent (an older controller): 0
    # The authority the leader commands for; absent (an older controller): the empty one.
    authority: Authority = Authority()
    # Authorities the sender hands the node over to (a re-scope, a move to a new database):
    # the agent obeys their first command at once instead of after the sender's silence.
    handover: list[Authority] = Field(default_factory=list, max_length=4)
    lease_s: float = Field(gt=0, le=86_400, allow_inf_nan=False)
    caps: dict[GpuUuid, PosWatts] = Field(max_length=MAX_GPUS_PER_NODE)
    failsafe_w: dict[GpuUuid, PosWatts] = Field(max_length=MAX_GPUS_PER_NODE)
    ts: float = Field(default=0.0, allow_inf_nan=False)  # controller's wall clock
    controller_id: str = Field(default="", max_length=128)


class AckError(StrEnum):
    UNKNOWN_GPU = "unknown_gpu"
    SET_FAILED = "set_failed"
    NO_PERMISSION = "no_permission"
    NOT_SUPPORTED = "not_supported"
    GPU_LOST = "gpu_lost"
    OVERRIDDEN = "overridden"  # enforced limit read back differs from the one requested


class GpuAck(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    requested_w: Watts
    enforced_w: Watts | None = None
    error: AckError | None = None


class CapAck(_Msg):
    tick: Tick
    epoch: Epoch = 0  # the command's
    authority: Authority | None = None  # the command's (None: an older agent)
    gpus: dict[GpuUuid, GpuAck] = Field(max_length=MAX_GPUS_PER_NODE)
    ts: float = Field(default=0.0, allow_inf_nan=False)


class NodeState(StrEnum):
    STARTING = "starting"
    STEERED = "steered"
    FAILSAFE = "failsafe"
    OFFLINE = "offline"


class NodeStatus(_Msg):
    state: NodeState
    ts: float = Field(default=0.0, allow_inf_nan=False)
    last_tick: Tick | None = None
    epoch: Epoch = 0  # the highest epoch the agent has seen (of the command it applied last)
    fenced: int = Field(default=0, ge=0, le=MAX_TICK)  # commands refused for a lower epoch
    gpus: int = Field(default=0, ge=0, le=MAX_GPUS_PER_NODE)
    agent_version: str = Field(default="", max_length=64)
    # Caps in force, so a restarted controller learns them from the retained status.
    caps_w: dict[GpuUuid, Watts] = Field(default_factory=dict, max_length=MAX_GPUS_PER_NODE)
    # Per GPU the limit it goes back to should a lower one another holds (an out-of-band
    # cap) lift: the one the agent set, or the driver's requested one where higher. Empty:
    # none known (or an older agent). Bounds the GPU from above where it exceeds `caps_w`.
    set_w: dict[GpuUuid, Watts] = Field(default_factory=dict, max_length=MAX_GPUS_PER_NODE)
    # The authority the agent obeys (None: none yet, or an older agent), the commands it
    # refused from any other, and the last of those (which controller, which authority).
    authority: Authority | None = None
    refused: int = Field(default=0, ge=0, le=MAX_TICK)
    refused_authority: Authority | None = None
    refused_controller: str = Field(default="", max_length=128)
    # The authority it obeyed before the current one, when it switched (an alarm).
    previous_authority: Authority | None = None
    # Its GPUs keep the last limit set if this agent dies (a BMC: `powerd bmc-agent`). A
    # controller only ever plans more strictly for it (docs/safety.md, "BMC-managed nodes").
    keeps_limits: bool = False


class ControllerState(StrEnum):
    ACTIVE = "active"  # leads: commands its scope
    STANDBY = "standby"  # runs with a warm view, ready to take over
    SHADOW = "shadow"  # decides as if it steered and sends nothing (controller --shadow)
    STARTING = "starting"
    OFFLINE = "offline"


class ControllerStatus(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    controller_id: str = Field(max_length=128)
    state: ControllerState
    ts: float = Field(default=0.0, allow_inf_nan=False)
    tick: Tick | None = None
    scope: str | None = Field(default=None, max_length=128)
    epoch: Epoch | None = None  # the leader's epoch (a standby: the last it read)
    authority: Authority | None = None  # the one it commands (or would) for

    @field_validator("controller_id")
    @classmethod
    def _nonempty(cls, v: str) -> str:
        if not v:
            raise ValueError("controller_id must not be empty")
        return v


class Topics:
    """Topic names under a configurable prefix."""

    def __init__(self, prefix: str = DEFAULT_PREFIX) -> None:
        self.prefix = prefix.rstrip("/")

    def telemetry(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/telemetry"

    def caps(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/caps"

    def ack(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/ack"

    def status(self, node: str) -> str:
        return f"{self.prefix}/nodes/{node}/status"

    def controller_status(self, controller_id: str) -> str:
        """Each controller's own retained status (leader or standby) and last will."""
        return f"{self.prefix}/controller/{controller_id}/status"

    def all_controllers(self) -> str:
        return f"{self.prefix}/controller/+/status"

    def parse_controller_topic(self, topic: str) -> str | None:
        """`prefix/controller/{id}/status` → id; None if it is not one."""
        head = self.prefix + "/controller/"
        if not topic.startswith(head):
            return None
        rest = topic[len(head) :].split("/")
        if len(rest) != 2 or not rest[0] or rest[1] != "status":
            raise WireError("bad_topic", topic[:200])
        return rest[0]

    def scope_budget(self, scope: str) -> str:
        return f"{self.prefix}/scopes/{scope}/budget"

    def scope_report(self, scope: str) -> str:
        return f"{self.prefix}/scopes/{scope}/report"

    def all_scope_reports(self) -> str:
        return f"{self.prefix}/scopes/+/report"

    def parse_scope_topic(self, topic: str) -> tuple[str, str] | None:
        """`prefix/scopes/{scope}/{kind}` → (scope, kind); None if it is not one."""
        head = self.prefix + "/scopes/"
        if not topic.startswith(head):
            return None
        rest = topic[len(head) :].split("/")
        if len(rest) != 2 or not rest[0]:
            raise WireError("bad_topic", topic[:200])
        return rest[0], rest[1]

    def all_nodes(self, kind: str) -> str:
        return f"{self.prefix}/nodes/+/{kind}"

    def parse_node_topic(self, topic: str) -> tuple[str, str]:
        """`prefix/nodes/{node}/{kind}` → (node, kind); WireError if it is not one."""
        head = self.prefix + "/nodes/"
        if not topic.startswith(head):
            raise WireError("bad_topic", topic[:200])
        rest = topic[len(head) :].split("/")
        if len(rest) != 2 or not rest[0]:
            raise WireError("bad_topic", topic[:200])
        return rest[0], rest[1]


# -- scopes: a coordinator splits the site's budget between scope controllers ----------------

# A whole scope's power: far above any hall (a 1 GW site is 1e9 W), below float trouble.
MAX_SCOPE_WATTS = 1e11
ScopeWatts = Annotated[float, Field(ge=0, le=MAX_SCOPE_WATTS, allow_inf_nan=False)]
MAX_CURVE_POINTS = 1024
# A marginal value per kW far beyond any profile's slope (priority-weighted throughput per
# kW is of order 1); larger ones are corrupt and would overflow the split's arithmetic.
MAX_PRICE = 1e9
Price = Annotated[float, Field(ge=-MAX_PRICE, le=MAX_PRICE, allow_inf_nan=False)]


class ScopeBudget(BaseModel):
    """Coordinator → a scope's controllers: the budget at the scope's root group, in force
    for `lease_s` from its arrival (then the scope falls back to min(this budget, its
    failsafe budget)). Ordered by (epoch, tick) as commands are."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    scope: NodeId
    budget_w: ScopeWatts
    tick: Tick
    epoch: Epoch = 0
    lease_s: float = Field(gt=0, le=86_400, allow_inf_nan=False)
    ts: float = Field(default=0.0, allow_inf_nan=False)
    coordinator_id: str = Field(default="", max_length=128)


class ScopeReport(BaseModel):
    """A scope's leader → the coordinator, every tick: the budget it enforces, what its
    caps commit, and its demand curve (at budget `curve_budget_w[j]` one more kW is worth
    `curve_price[j]`; docs/allocator.md, "Scopes")."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    v: Literal[1] = 1
    scope: NodeId
    controller_id: str = Field(default="", max_length=128)
    epoch: Epoch = 0  # the scope leader's
    tick: Tick
    ts: float = Field(default=0.0, allow_inf_nan=False)
    # The coordinator budget the scope enforces (None: none heard, or lapsed to failsafe).
    budget_epoch: Epoch | None = None
    budget_tick: Tick | None = None
    budget_w: ScopeWatts  # in force at the scope's root (assigned, failsafe, or policy)
    committed_w: ScopeWatts  # committed caps + overhead + reserve at the root
    draw_w: ScopeWatts | None = None
    failsafe_w: ScopeWatts  # the scope's failsafe budget (its failsafe caps + overhead)
    lo_w: ScopeWatts  # the least its GPUs can take (+ overhead)
    hi_w: ScopeWatts  # the most they would take (+ overhead)
    # What the root's budget holds besides GPU caps: overhead, and power reserved for GPUs
    # not reported yet (counted at their maximum).
    offset_w: ScopeWatts = 0.0
    # Where the curve is exact between its points (elsewhere exact at them only).
    curve_exact_lo_w: ScopeWatts | None = None
    curve_exact_hi_w: ScopeWatts | None = None
    curve_budget_w: list[ScopeWatts] = Field(default_factory=list, max_length=MAX_CURVE_POINTS)
    curve_price: list[Price] = Field(default_factory=list, max_length=MAX_CURVE_POINTS)

    @model_validator(mode="after")
    def _curve(self) -> ScopeReport:
        b = self.curve_budget_w
        if len(b) != len(self.curve_price):
            raise ValueError("curve_budget_w and curve_price differ in length")
        if any(x > y for x, y in pairwise(b)):
            raise ValueError("curve_budget_w must not decrease")
        if any(x < y for x, y in pairwise(self.curve_price)):
            raise ValueError("curve_price must not increase")
        if self.lo_w > self.hi_w:
            raise ValueError("lo_w above hi_w")
        return self


M = TypeVar("M", bound=BaseModel)


def encode(msg: BaseModel) -> bytes:
    return msg.model_dump_json(exclude_none=True).encode()


def decode(payload: bytes | bytearray | str, model: type[M], topic_node: str | None = None) -> M:
    """Parse and validate one payload; WireError (never anything else) when it is unusable."""
    if isinstance(payload, str):
        payload = payload.encode()
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise WireError("oversized", f"{len(payload)} bytes > {MAX_PAYLOAD_BYTES}")
    try:
        msg = model.model_validate_json(bytes(payload))
    except RecursionError:
        raise WireError("invalid", "nested too deeply") from None
    except ValidationError as exc:
        errs = exc.errors()
        if errs and errs[0]["type"] == "json_invalid":
            raise WireError("not_json", str(errs[0]["msg"])[:200]) from None
        if any(e["loc"] and e["loc"][0] == "v" for e in errs):
            raise WireError("bad_version", "only protocol v1 is understood") from None
        first = errs[0] if errs else {"loc": (), "msg": "invalid"}
        loc = ".".join(str(p) for p in first["loc"])
        raise WireError("invalid", f"{loc}: {first['msg']}"[:300]) from None
    node = getattr(msg, "node_id", None)
    if topic_node is not None and node is not None and node != topic_node:
        raise WireError("node_mismatch", f"payload node_id {node!r} on topic of {topic_node!r}")
    return msg
