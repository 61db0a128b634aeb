"""Policy files: the power tree, workload classes, profiles and control settings.

A policy is YAML validated by pydantic. Errors never surface as tracebacks: `load_policy`
raises `PolicyError`, whose message names the file, the path inside it and what would be
valid. See docs/policy.md for the schema.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from powerd.input_errors import InputError, parse_yaml, read_text, validation_problems
from powerd.profile import Profile, ProfileError

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]*$")
RANGE_RE = re.compile(r"\{(\d+)\.\.(\d+)\}")
PARENT_RE = re.compile(r"\{(row|rack)\}")
MAX_EXPANSION = 1_000_000

Watts = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegWatts = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class PolicyError(InputError):
    """A policy that cannot be used, with where and why."""

    kind = "policy"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Overload(_Strict):
    """The short-time rating of what a budget protects (a breaker, a contract): draw may
    exceed the budget by `pct` % for less than `for_s` seconds at a time. Committed caps may
    then exceed the budget by up to `pct` %, while measured draw is steered to `target_pct`
    % below the budget (docs/policy.md, "Overload")."""

    pct: float = Field(gt=0, le=100, allow_inf_nan=False)
    for_s: float = Field(gt=0, le=86400, allow_inf_nan=False)
    target_pct: float = Field(default=3.0, ge=0, le=50, allow_inf_nan=False)
    # Lend only the reservation the GPUs left unused all the last `rise_s` seconds (0: the
    # reservation unused now): work that swings together (synchronous training) then does
    # not draw on the rating in its next high phase, nor move caps with every swing.
    rise_s: float = Field(default=30.0, ge=0, le=120, allow_inf_nan=False)


MAX_METER_W = 1e9  # a reading above a gigawatt is no reading of any group powerd steers


def _usable_url(url: str) -> str:
    """A meter's URL with a host and, if any, a port in 1..65535: the patterns below let
    through what an HTTP client refuses when it is built ("pdu:port", "h:1:2")."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"not a usable URL ({exc})") from None
    if not parts.hostname:
        raise ValueError("not a usable URL (no host)")
    if port == 0:
        raise ValueError("not a usable URL (port 0)")
    return url


class RedfishMeter(_Strict):
    """A Redfish PDU or power shelf: `resource` is the path of a `PowerDistribution` (its
    `Metrics` are read), of its `Metrics`, or of an outlet or any resource with
    `PowerWatts.Reading`; or `pdu`, the Id of a rack PDU under
    /redfish/v1/PowerEquipment/RackPDUs. Credentials from `password_file` only."""

    url: str = Field(pattern=r"^https://[A-Za-z0-9.\-\[\]:]+/?$", max_length=300)
    resource: str | None = Field(
        default=None, pattern=r"^/redfish/v1/[A-Za-z0-9_./#-]*$", max_length=500
    )
    pdu: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=100)
    username: str = Field(min_length=1, max_length=200)
    password_file: Path
    ca_file: Path | None = None
    pinned_cert_file: Path | None = None
    auth: Literal["session", "basic"] = "session"

    _url = field_validator("url")(_usable_url)

    @model_validator(mode="after")
    def _one_each(self) -> RedfishMeter:
        if (self.resource is None) == (self.pdu is None):
            raise ValueError("give resource (a path) or pdu (a rack PDU's Id), one of them")
        if self.ca_file is not None and self.pinned_cert_file is not None:
            raise ValueError("give ca_file or pinned_cert_file, not both")
        if ".." in (self.resource or ""):
            raise ValueError("resource must not hold '..'")
        return self

    @property
    def path(self) -> str:
        """The path first read."""
        if self.resource is not None:
            return self.resource.rstrip("/") or "/"
        return f"/redfish/v1/PowerEquipment/RackPDUs/{self.pdu}"


class PrometheusMeter(_Strict):
    """A Prometheus server (`url`: scheme, host, port and an optional path prefix) and an
    instant query whose answer is one sample: the group's draw in W."""

    url: str = Field(pattern=r"^https?://[A-Za-z0-9.\-\[\]:]+(/[A-Za-z0-9_./-]*)?$", max_length=300)
    query: str = Field(min_length=1, max_length=4000)
    ca_file: Path | None = None

    _url = field_validator("url")(_usable_url)


class MeterSpec(_Strict):
    """What measures a group's draw at its breaker (docs/policy.md, "Meters"): a Redfish
    PDU or power shelf, or a Prometheus query. Its reading, while younger than `fresh_s`,
    is the group's measured draw for the overload rule (never below the nodes' figure); a
    group whose meter is stale steers on its strict budget. `disagree_w`/`disagree_pct`: the
    bound (the larger of the two) on |meter − (nodes + overhead)| before an alarm, after
    `disagree_for_s` beyond it; the same bound alarms a learned overhead above
    `overhead_w`."""

    redfish: RedfishMeter | None = None
    prometheus: PrometheusMeter | None = None
    poll_s: float = Field(default=2.0, gt=0, le=3600, allow_inf_nan=False)
    timeout_s: float = Field(default=1.0, gt=0, le=60, allow_inf_nan=False)
    fresh_s: float = Field(default=10.0, gt=0, le=3600, allow_inf_nan=False)
    disagree_w: NonNegWatts = 500.0
    disagree_pct: float = Field(default=5.0, ge=0, le=100, allow_inf_nan=False)
    disagree_for_s: float = Field(default=15.0, ge=0, le=86400, allow_inf_nan=False)
    # The largest reading believed; above it an answer is rejected (counted) as absurd.
    max_w: float = Field(default=MAX_METER_W, gt=0, le=MAX_METER_W, allow_inf_nan=False)
    # A reading unchanged this long is not fresh (a meter that answers but stopped
    # measuring); None: max(60 s, 5 × poll_s); 0: never.
    frozen_s: float | None = Field(default=None, ge=0, le=86400, allow_inf_nan=False)

    @model_validator(mode="after")
    def _one_source(self) -> MeterSpec:
        if (self.redfish is None) == (self.prometheus is None):
            raise ValueError("a meter is redfish or prometheus, one of them")
        if self.timeout_s >= self.poll_s:
            raise ValueError(
                f"timeout_s ({self.timeout_s:g}) must be shorter than poll_s ({self.poll_s:g})"
            )
        if self.poll_s >= self.fresh_s:
            raise ValueError(
                f"poll_s ({self.poll_s:g}) must be shorter than fresh_s ({self.fresh_s:g}), "
                "or every reading is stale before the next"
            )
        if self.frozen_s and self.frozen_s < 3 * self.poll_s:
            raise ValueError(
                f"frozen_s ({self.frozen_s:g}) must be at least 3 × poll_s ({self.poll_s:g}), "
                "or a meter that reads anew each poll looks frozen; 0 turns the check off"
            )
        return self

    @property
    def frozen_after_s(self) -> float:
        """How long a reading may stay unchanged and still be fresh (inf: no limit)."""
        if self.frozen_s is None:
            return max(60.0, 5.0 * self.poll_s)
        return self.frozen_s or math.inf

    @property
    def source(self) -> tuple[object, ...]:
        """What it reads and believes: a change here is another meter (its readings and
        learned overhead are not this one's); poll, freshness and alarm settings are not."""
        return (self.redfish, self.prometheus, self.max_w)

    def bound_w(self, reading_w: float) -> float:
        """How far meter and nodes may disagree at this reading."""
        return max(self.disagree_w, self.disagree_pct / 100.0 * abs(reading_w))


class NodeSpec(_Strict):
    """One node, or many identical ones when `name` holds a range like `n{01..08}`."""

    name: str
    budget_w: Watts | None = None
    overload: Overload | None = None
    meter: MeterSpec | None = None
    overhead_w: NonNegWatts = 0.0
    gpus: int | None = Field(default=None, ge=0, le=64)
    failsafe_w: Watts | None = None
    # Its GPUs' limits stay where they were last set when the agent that set them dies (a
    # BMC steered by `powerd bmc-agent`): docs/safety.md, "BMC-managed nodes".
    keeps_limits: bool = False
    lowest_budget_w: Watts | None = None


class RackSpec(_Strict):
    name: str
    budget_w: Watts | None = None
    overload: Overload | None = None
    meter: MeterSpec | None = None
    # The lowest budget a cut may give it (temporary, scheduled, a coordinator's share).
    lowest_budget_w: Watts | None = None
    nodes: list[NodeSpec] = Field(default_factory=list)


class RowSpec(_Strict):
    name: str
    budget_w: Watts | None = None
    overload: Overload | None = None
    meter: MeterSpec | None = None
    # The lowest budget a cut may give it (temporary, scheduled, a coordinator's share).
    lowest_budget_w: Watts | None = None
    racks: list[RackSpec] = Field(default_factory=list)


class FacilitySpec(_Strict):
    name: str
    budget_w: Watts | None = None
    overload: Overload | None = None
    meter: MeterSpec | None = None
    # The lowest budget a cut may give it (temporary, scheduled, a coordinator's share).
    lowest_budget_w: Watts | None = None
    rows: list[RowSpec] = Field(min_length=1)


class ProfileSpec(_Strict):
    points: list[tuple[NonNegWatts, NonNegWatts]] = Field(min_length=1)
    description: str = ""

    @field_validator("points")
    @classmethod
    def _envelope_exists(cls, v: list[tuple[float, float]]) -> list[tuple[float, float]]:
        try:
            Profile.from_points("check", v)
        except ProfileError as exc:
            raise ValueError(str(exc)) from exc
        return v


class ClassSpec(_Strict):
    weight: float = Field(gt=0, allow_inf_nan=False)
    floor_w: Watts | None = None
    ceiling_w: Watts | None = None
    profile: str
    # Learn this class's curve from reported perf (None: as control.learn.enabled says).
    learn: bool | None = None
    description: str = ""

    @model_validator(mode="after")
    def _floor_below_ceiling(self) -> ClassSpec:
        floor, ceiling = self.floor_w, self.ceiling_w
        if floor is not None and ceiling is not None and floor > ceiling:
            raise ValueError(
                f"floor_w ({self.floor_w:g}) must not exceed ceiling_w ({self.ceiling_w:g})"
            )
        return self


class GpuDefaults(_Strict):
    """Device limits assumed before a GPU reports its own (planning, unknown GPUs)."""

    min_cap_w: Watts = 200.0
    max_cap_w: Watts = 700.0

    @model_validator(mode="after")
    def _ordered(self) -> GpuDefaults:
        if self.min_cap_w > self.max_cap_w:
            raise ValueError("min_cap_w must not exceed max_cap_w")
        return self


class Defaults(_Strict):
    class_: str = Field(alias="class")
    failsafe_w: Watts
    headroom_w: NonNegWatts = 50.0
    gpus_per_node: int = Field(default=8, ge=0, le=64)
    gpu: GpuDefaults = Field(default_factory=GpuDefaults)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class Learn(_Strict):
    """Online profiles from reported perf (docs/allocator.md, "Profiles learned online")."""

    enabled: bool = False
    # Samples kept per class (a ring: the oldest goes first) and taken per class per tick.
    buffer: int = Field(default=4096, ge=64, le=1_000_000)
    per_tick: int = Field(default=64, ge=1, le=100_000)
    # Older samples are dropped: the curve follows the workload as it changes.
    window_s: float = Field(default=6 * 3600.0, gt=0, le=30 * 86400)
    refit_ticks: int = Field(default=30, ge=1, le=100_000)
    # What a fit needs before it steers: samples, distinct power bins, watts spanned, and
    # its error (RMS gap between the bins' points and the envelope, share of its peak).
    min_samples: int = Field(default=200, ge=1, le=1_000_000)
    bin_w: float = Field(default=25.0, gt=0, le=1000, allow_inf_nan=False)
    min_bins: int = Field(default=4, ge=2, le=1000)
    min_span_w: float = Field(default=150.0, ge=0, le=10_000, allow_inf_nan=False)
    max_error: float = Field(default=0.1, gt=0, le=1, allow_inf_nan=False)
    # A bin's point: this quantile of its perf (underloaded samples sit below the curve).
    quantile: float = Field(default=0.9, gt=0, le=1, allow_inf_nan=False)


class RampRates(_Strict):
    """How fast the facility may move between budgets that were planned (grid schedules,
    the end of a temporary cut): W/s down and up (docs/policy.md, "Ramps")."""

    up: Watts
    down: Watts


class DemandSpec(_Strict):
    """How the allocator sees each GPU's demand (docs/allocator.md, "Demand"). Its recent
    draw: the largest over the last `window_s` plus `swing` times the largest rise between
    two successive samples in it; `window_s: 0` keeps no history and turns the settings
    below off (demand from the last sample alone, as before). `spare`: power left after
    demand goes first around each GPU's recent draw (`recent`) or its cap in force (`caps`).
    `margin`: a GPU not held back by its cap wants the least cap it would not read as held
    back by, at most its draw + headroom (`least`; the rest of the headroom is spare power),
    or its draw + headroom (`headroom`). `held`: a GPU held back by its cap wants its recent
    draw (at least its cap) + headroom (`probe`) or its maximum (`max`). `held_share`: a GPU
    reads as held back by its cap when it draws at least this share of it; above the least
    margin's 95 %, so a GPU whose cap was just set to its draw / 0.95 is neither cut nor
    probed while its draw wobbles between the two (hysteresis). `floors`: a class floor
    holds up to the GPU's recent draw (`follow`) or whole (`fixed`). `held_spare_w`: with
    `spare: recent`, spare power goes around a held-back GPU's demand + this (its probe,
    not claimed: the power is still anyone's demand first), so it reaches the GPUs known
    to want more than their cap before the margins of those that may rise; 0: off.
    `swing_keep_w`: a GPU whose draw climbed by at least this much above its lowest sample
    in every time slice of the window but the newest (it swings all window: synchronous
    training's compute and communication phases) is judged by its recent peak, not its
    last sample (held back, demand), so its cap does not follow the swing down and back
    up every period; 0: off."""

    window_s: float = Field(default=60.0, ge=0, le=3600, allow_inf_nan=False)
    swing: float = Field(default=0.0, ge=0, le=10, allow_inf_nan=False)
    spare: Literal["recent", "caps"] = "recent"
    margin: Literal["least", "headroom"] = "least"
    held: Literal["probe", "max"] = "probe"
    held_share: float = Field(default=0.98, ge=0.95, le=1.0, allow_inf_nan=False)
    floors: Literal["follow", "fixed"] = "fixed"
    held_spare_w: NonNegWatts = 100.0
    swing_keep_w: NonNegWatts = 100.0


class Control(_Strict):
    tick_s: float = Field(default=1.0, gt=0, le=3600)
    # Extra ticks between two regular ones, each at once when every node the last tick
    # cut has acknowledged while that tick held raises back for want of room its cuts
    # free (decreases before increases: a raise waits on the acks of its cuts). 0: a
    # held raise waits for the next regular tick (docs/allocator.md, "Raises on acks").
    ack_ticks: int = Field(default=2, ge=0, le=5)
    lease_s: float = Field(default=10.0, gt=0, le=86400)
    stale_after_s: float = Field(default=5.0, gt=0, le=86400)
    # A GPU no telemetry has named for this long is forgotten: its node's missing GPUs are
    # then reserved at the largest maximum the node has shown, as before it was first seen.
    forget_after_s: float = Field(default=600.0, gt=0, le=7 * 86400)
    slew_w: Watts | None = None
    # Weight of the damping term ε·Σ(p − p_prev)², p in kW: breaks ties toward the caps in
    # force and damps oscillation. Small against profile slopes (≈1 per kW).
    damping: float = Field(default=0.01, ge=0, le=10)
    # A GPU's cap moves only when its new target is more than this far from the cap in force
    # (docs/allocator.md, "Deadband"): under shared budgets, one GPU's swing otherwise moves
    # every neighbour a little each tick. Cuts a budget needs are never held; 0: off.
    deadband_w: NonNegWatts = 40.0
    # Raises of at most this much are held too, but only of GPUs whose draw does not press
    # on their cap (below 95 % of it): such a raise follows the demand estimate's recent
    # peak and no work waits on it. A pressed GPU's raise is never held (but by
    # dwell_s); 0: off.
    raise_deadband_w: NonNegWatts = 40.0
    # A cap that moved stays at least this long (s; 0: off): its later moves of at most
    # dwell_max_w, up or down, pressed or not, are held, except cuts a limit needs
    # (docs/allocator.md, "Deadband", "Dwell"). Off by default: it costs work where a
    # budget has room (docs/performance.md, "Cap churn").
    dwell_s: float = Field(default=0.0, ge=0, le=3600, allow_inf_nan=False)
    dwell_max_w: NonNegWatts = 80.0
    # Where held cuts leave a group too little room for the raises of GPUs whose draw
    # presses on their cap, held cuts of at least this much of GPUs not pressed go first
    # (the largest first), before those raises are trimmed: a pressed raise is work
    # waiting, a held cut only churn avoided (docs/allocator.md, "Deadband"). None: the
    # raises are trimmed first. Each release is a move: it costs churn (docs/performance.md).
    fund_pressed_w: NonNegWatts | None = None
    # ... but only under groups whose measured draw (their GPUs' telemetry + overhead) is at
    # least this share (%) below their budget: where the draw is near it (a feed that binds,
    # a rating steering the draw to its target), a released cut is soon wanted back and
    # only churns (docs/allocator.md, "Deadband"). 0: under every group.
    fund_room_pct: float = Field(default=4.0, ge=0, le=50, allow_inf_nan=False)
    # Power no GPU can turn into throughput: "peak" leaves it unallocated (no cap above its
    # profile's peak), "max" hands it out up to each GPU's maximum cap.
    leftover: Literal["peak", "max"] = "peak"
    # Per-GPU demand from the recent distribution of draw, not the last sample alone.
    demand: DemandSpec = Field(default_factory=DemandSpec)
    learn: Learn = Field(default_factory=Learn)
    # Budgets in force move no faster than this (scheduled cuts start early enough to reach
    # their target on time); None: budgets step. Immediate cuts always go at once.
    ramp_w_per_s: RampRates | None = None
    # Jobs the nodes report per GPU (telemetry's `job`, e.g. from Kubernetes): "node" couples
    # the GPUs of one node that report one job (a node's report reaches its own GPUs only);
    # "site" couples them across nodes, trusting every node as much as a scheduler (a node
    # that claims a job holds that job's cap); "off" ignores them. An operator's job wins.
    reported_jobs: Literal["off", "node", "site"] = "node"

    @model_validator(mode="after")
    def _lease_covers_ticks(self) -> Control:
        if self.lease_s < 2 * self.tick_s:
            raise ValueError(
                f"lease_s ({self.lease_s:g}) must be at least two ticks (2 × tick_s = "
                f"{2 * self.tick_s:g}) or agents fall into failsafe between ticks"
            )
        if self.forget_after_s < self.stale_after_s:
            raise ValueError(
                f"forget_after_s ({self.forget_after_s:g}) must be at least stale_after_s "
                f"({self.stale_after_s:g}): a GPU is stale before it is forgotten"
            )
        return self


class PolicySpec(_Strict):
    version: int = Field(default=1, ge=1, le=1)
    # The site's identity on the wire: agents enrolled in one site refuse commands for any
    # other (docs/safety.md, "Authority"). Default: the facility's name.
    site: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:/-]+$"
    )
    facility: FacilitySpec
    profiles: dict[str, ProfileSpec] = Field(min_length=1)
    classes: dict[str, ClassSpec] = Field(min_length=1)
    defaults: Defaults
    control: Control = Field(default_factory=Control)


LEVELS = ("facility", "row", "rack", "node")


@dataclass(frozen=True)
class GroupDef:
    """One budgeted group of the expanded tree, with where it came from in the file."""

    name: str
    level: int  # index into LEVELS
    parent: int  # index of the parent group, -1 for the facility
    budget_w: float  # math.inf when unconstrained
    overhead_w: float
    gpus: int  # nodes: expected GPU count; others: 0
    failsafe_w: float  # nodes: failsafe cap per GPU; others: 0
    path: str
    overload: Overload | None = None  # its short-time rating, if declared
    meter: MeterSpec | None = None  # what measures its draw, if declared
    # The lowest budget a cut may give it (None: its failsafe caps plus overhead), and, for
    # a node, whether its actuators keep their limits when its agent dies.
    lowest_budget_w: float | None = None
    keeps_limits: bool = False

    @property
    def rating_w(self) -> float:
        """The most its committed caps may reach: the budget, plus the overload allowance."""
        if self.overload is None:
            return self.budget_w
        return self.budget_w * (1.0 + self.overload.pct / 100.0)


@dataclass(frozen=True)
class Policy:
    """A validated policy with its tree expanded (groups parents-first) and profiles built."""

    spec: PolicySpec
    source: str
    groups: tuple[GroupDef, ...]
    profiles: Mapping[str, Profile]

    @property
    def control(self) -> Control:
        return self.spec.control

    @property
    def site(self) -> str:
        """The site's identity on the wire: the policy's `site`, else the facility's name."""
        return self.spec.site or self.groups[0].name

    @property
    def defaults(self) -> Defaults:
        return self.spec.defaults

    @property
    def classes(self) -> Mapping[str, ClassSpec]:
        return self.spec.classes

    def class_profile(self, class_name: str) -> Profile:
        return self.profiles[self.spec.classes[class_name].profile]

    def node_names(self) -> list[str]:
        return [g.name for g in self.groups if g.level == 3]

    @cached_property
    def keeps_limits_nodes(self) -> frozenset[str]:
        """The nodes the policy says keep their limits when their agent dies (each tick's
        alarms ask)."""
        return frozenset(g.name for g in self.groups if g.level == 3 and g.keeps_limits)

    def subset(self, nodes: Sequence[str]) -> Policy:
        """The same policy over only these nodes (and the groups above them), e.g. a demo or
        simulation of part of a site; budgets are unchanged."""
        wanted = set(nodes)
        keep = [False] * len(self.groups)
        for i in range(len(self.groups) - 1, -1, -1):
            g = self.groups[i]
            if g.level == len(LEVELS) - 1 and g.name in wanted:
                keep[i] = True
            if keep[i] and g.parent >= 0:
                keep[g.parent] = True
        keep[0] = True
        return self._keep(keep, unbudgeted=())

    def scope(self, name: str) -> Policy:
        """The policy of one scope: the subtree under group `name` and the groups above it,
        those at an unconstrained budget, because a coordinator hands the scope its share of
        their budgets (powerd.allocator.scopes). The scope's own budget stays."""
        found = [i for i, g in enumerate(self.groups) if g.name == name]
        if len(found) != 1:
            why = "is not in the policy's tree" if not found else "names groups at two levels"
            raise ValueError(f"group '{name}' {why}")
        top = found[0]
        keep = [False] * len(self.groups)
        keep[top] = True
        # Parents come before children: one forward pass marks the subtree.
        for i in range(top + 1, len(self.groups)):
            parent = self.groups[i].parent
            keep[i] = parent >= 0 and keep[parent]
        above = []
        parent = self.groups[top].parent
        while parent >= 0:
            keep[parent] = True
            above.append(parent)
            parent = self.groups[parent].parent
        # A scope reports its committed caps within its budget for the coordinator to split
        # the budgets above (docs/safety.md, "Scopes"): an overload rating at its root would
        # break that, so the root keeps the strict rule (ratings below it stay).
        return self._keep(keep, unbudgeted=above, unrated=(top,))

    def _keep(
        self, keep: Sequence[bool], unbudgeted: Sequence[int], unrated: Sequence[int] = ()
    ) -> Policy:
        """The kept groups, re-indexed; those in `unbudgeted` lose their budget and those in
        `unrated` their overload rating."""
        free = set(unbudgeted)
        strict = free | set(unrated)
        new_index: dict[int, int] = {}
        groups: list[GroupDef] = []
        for i, g in enumerate(self.groups):
            if keep[i]:
                new_index[i] = len(groups)
                budget = math.inf if i in free else g.budget_w
                groups.append(
                    replace(
                        g,
                        parent=new_index.get(g.parent, -1),
                        budget_w=budget,
                        overload=None if i in strict else g.overload,
                        # A meter above a scope measures other scopes' nodes too.
                        meter=None if i in free else g.meter,
                        # A group whose budget the coordinator splits is cut there too.
                        lowest_budget_w=None if i in free else g.lowest_budget_w,
                    )
                )
        return Policy(
            spec=self.spec, source=self.source, groups=tuple(groups), profiles=self.profiles
        )


def expand_name(pattern: str) -> list[str]:
    """`a-n{01..03}` → [a-n01, a-n02, a-n03]; several ranges multiply. No range: [pattern]."""
    names = [""]
    pos = 0
    for m in RANGE_RE.finditer(pattern):
        lo_s, hi_s = m.group(1), m.group(2)
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise ValueError(f"range {{{lo_s}..{hi_s}}} runs backwards; write {{{hi_s}..{lo_s}}}")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        prefix = pattern[pos : m.start()]
        if len(names) * (hi - lo + 1) > MAX_EXPANSION:
            raise ValueError(f"'{pattern}' expands to more than {MAX_EXPANSION} names")
        names = [n + prefix + str(k).zfill(width) for n in names for k in range(lo, hi + 1)]
        pos = m.end()
    return [n + pattern[pos:] for n in names]


class _Expander:
    def __init__(self, spec: PolicySpec) -> None:
        self.spec = spec
        self.groups: list[GroupDef] = []
        self.problems: list[tuple[str, str]] = []
        self.seen: dict[tuple[int, str], str] = {}
        self.metered: dict[str, str] = {}  # path of a group with a meter → its first name

    def add(
        self,
        name: str,
        level: int,
        parent: int,
        path: str,
        spec: FacilitySpec | RowSpec | RackSpec | NodeSpec,
        *,
        overhead: float = 0.0,
        gpus: int = 0,
        failsafe: float = 0.0,
    ) -> int:
        budget, overload = spec.budget_w, spec.overload
        meter = spec.meter
        if not NAME_RE.match(name):
            self.problems.append(
                (
                    path + ".name",
                    f"'{name}' is not a valid name: use letters, "
                    "digits and . _ : - (starting with a letter or digit)",
                )
            )
        key = (level, name)
        if key in self.seen:
            self.problems.append(
                (
                    path + ".name",
                    f"duplicate {LEVELS[level]} name '{name}' "
                    f"(first declared at {self.seen[key]}); names must be unique",
                )
            )
        else:
            self.seen[key] = path
        if overload is not None and budget is None:
            self.problems.append(
                (path + ".overload", "an overload rating needs the group's budget_w")
            )
            overload = None
        if meter is not None:
            first = self.metered.setdefault(path, name)
            if first != name and (path + ".meter") not in {where for where, _ in self.problems}:
                self.problems.append(
                    (
                        path + ".meter",
                        f"a meter measures one group, but this {LEVELS[level]} expands to "
                        f"several ('{first}', '{name}'...): declare each apart",
                    )
                )
            if first != name:
                meter = None
        self.groups.append(
            GroupDef(
                name,
                level,
                parent,
                math.inf if budget is None else budget,
                overhead,
                gpus,
                failsafe,
                path,
                overload,
                meter,
                spec.lowest_budget_w,
                isinstance(spec, NodeSpec) and spec.keeps_limits,
            )
        )
        return len(self.groups) - 1

    def names(self, pattern: str, path: str, context: Mapping[str, str]) -> list[str]:
        def sub(m: re.Match[str]) -> str:
            key = m.group(1)
            if key not in context:
                self.problems.append(
                    (
                        path + ".name",
                        f"'{{{key}}}' is not available at this "
                        "level (use {row} inside rows, {rack} inside racks)",
                    )
                )
                return key
            return context[key]

        try:
            return expand_name(PARENT_RE.sub(sub, pattern))
        except ValueError as exc:
            self.problems.append((path + ".name", str(exc)))
            return []

    def run(self) -> None:
        f = self.spec.facility
        d = self.spec.defaults
        root = self.add(f.name, 0, -1, "facility", f)
        for ri, row in enumerate(f.rows):
            rpath = f"facility.rows[{ri}]"
            for row_name in self.names(row.name, rpath, {}):
                row_idx = self.add(row_name, 1, root, rpath, row)
                for ki, rack in enumerate(row.racks):
                    kpath = f"{rpath}.racks[{ki}]"
                    for rack_name in self.names(rack.name, kpath, {"row": row_name}):
                        rack_idx = self.add(rack_name, 2, row_idx, kpath, rack)
                        for ni, node in enumerate(rack.nodes):
                            npath = f"{kpath}.nodes[{ni}]"
                            ctx = {"row": row_name, "rack": rack_name}
                            for node_name in self.names(node.name, npath, ctx):
                                self.add(
                                    node_name,
                                    3,
                                    rack_idx,
                                    npath,
                                    node,
                                    overhead=node.overhead_w,
                                    gpus=d.gpus_per_node if node.gpus is None else node.gpus,
                                    failsafe=d.failsafe_w
                                    if node.failsafe_w is None
                                    else node.failsafe_w,
                                )
            if len(self.groups) > MAX_EXPANSION:
                self.problems.append(
                    (rpath, f"the tree expands to more than {MAX_EXPANSION} groups")
                )
                return


def _check_references(spec: PolicySpec) -> list[tuple[str, str]]:
    problems = []
    profiles = sorted(spec.profiles)
    classes = sorted(spec.classes)
    for cname, cls in spec.classes.items():
        if cls.profile not in spec.profiles:
            problems.append(
                (
                    f"classes.{cname}.profile",
                    f"unknown profile '{cls.profile}'; valid: {', '.join(profiles)}",
                )
            )
        g = spec.defaults.gpu
        if cls.floor_w is not None and cls.floor_w > g.max_cap_w:
            problems.append(
                (
                    f"classes.{cname}.floor_w",
                    f"{cls.floor_w:g} W is above the GPU maximum {g.max_cap_w:g} W",
                )
            )
    if spec.defaults.class_ not in spec.classes:
        problems.append(
            (
                "defaults.class",
                f"unknown class '{spec.defaults.class_}'; valid: {', '.join(classes)}",
            )
        )
    return problems


def check_failsafe(groups: Sequence[GroupDef]) -> list[tuple[str, str]]:
    """Failsafe caps must fit every budget: an agent alone may drop to them at any time."""
    totals = [0.0] * len(groups)
    for i in range(len(groups) - 1, -1, -1):
        g = groups[i]
        if g.level == 3:
            totals[i] += g.gpus * g.failsafe_w + g.overhead_w
        if g.parent >= 0:
            totals[g.parent] += totals[i]
    problems = []
    reported: set[str] = set()
    for g, total in zip(groups, totals, strict=True):
        if total > g.budget_w + 1e-9 and g.path not in reported:
            reported.add(g.path)
            problems.append(
                (
                    g.path + ".budget_w",
                    f"{LEVELS[g.level]} '{g.name}': failsafe caps plus overhead "
                    f"({total:,.0f} W) exceed its budget ({g.budget_w:,.0f} W); lower "
                    "defaults.failsafe_w (or the node's failsafe_w) or raise the budget",
                )
            )
    return problems


def check_lowest(groups: Sequence[GroupDef]) -> list[tuple[str, str]]:
    """A group's `lowest_budget_w` lies within its budget and holds its failsafe caps plus
    overhead: a cut to it is met even if the controller dies (its agents fall to their
    failsafe caps), and what GPUs whose actuators keep their limits may hold is planned
    against it (docs/safety.md, "BMC-managed nodes")."""
    totals = subtree_totals(
        groups, [g.gpus * g.failsafe_w + g.overhead_w if g.level == 3 else 0.0 for g in groups]
    )
    problems = []
    reported: set[str] = set()
    for g, total in zip(groups, totals, strict=True):
        lowest = g.lowest_budget_w
        if lowest is None or g.path in reported:
            continue
        where = f"{LEVELS[g.level]} '{g.name}'"
        if lowest > g.budget_w:
            reported.add(g.path)
            problems.append(
                (
                    g.path + ".lowest_budget_w",
                    f"{where}: the lowest budget ({lowest:,.0f} W) is above its budget_w "
                    f"({g.budget_w:,.0f} W); it must lie between its failsafe caps plus "
                    f"overhead ({total:,.0f} W) and its budget",
                )
            )
        elif lowest < total - 1e-9:
            reported.add(g.path)
            problems.append(
                (
                    g.path + ".lowest_budget_w",
                    f"{where}: a cut to {lowest:,.0f} W is not met if the controller dies: "
                    f"its failsafe caps plus overhead take {total:,.0f} W; raise "
                    "lowest_budget_w to at least that or lower the failsafe caps",
                )
            )
    return problems


def overload_reaction_s(control: Control) -> float:
    """The longest measured draw can stay above a budget with an overload rating: the
    oldest telemetry the controller still steers on (`stale_after_s`), a tick to notice
    and a tick for the cut to reach the GPUs; and if the controller dies at the worst
    moment, the caps in force last one lease before the agents fall to their failsafe
    caps, which fit the budget (docs/safety.md, "Overload")."""
    return control.lease_s + control.stale_after_s + 2.0 * control.tick_s


def metered_reaction_s(control: Control, meter: MeterSpec) -> float:
    """The same with a meter, against nodes that under-report: the oldest reading still
    used (`fresh_s` from its arrival, which took up to `timeout_s`) replaces the oldest
    telemetry (docs/safety.md, "Overload")."""
    return control.lease_s + meter.fresh_s + meter.timeout_s + 2.0 * control.tick_s


def check_overload(groups: Sequence[GroupDef], control: Control) -> list[tuple[str, str]]:
    """A rating whose time is shorter than powerd can react in protects nothing."""
    need = overload_reaction_s(control)
    problems = []
    reported: set[str] = set()
    for g in groups:
        o = g.overload
        if o is None or g.path in reported:
            continue
        if o.for_s < need:
            reported.add(g.path)
            problems.append(
                (
                    g.path + ".overload.for_s",
                    f"{LEVELS[g.level]} '{g.name}': the rating's {o.for_s:g} s is shorter "
                    f"than powerd's worst-case reaction, {need:g} s (control.lease_s "
                    f"{control.lease_s:g} + stale_after_s {control.stale_after_s:g} + 2 × "
                    f"tick_s {control.tick_s:g}); shorten those or drop the overload",
                )
            )
        elif g.meter is not None and o.for_s < (metered := metered_reaction_s(control, g.meter)):
            reported.add(g.path)
            problems.append(
                (
                    g.path + ".overload.for_s",
                    f"{LEVELS[g.level]} '{g.name}': the rating's {o.for_s:g} s is shorter "
                    f"than powerd's worst-case reaction on its meter, {metered:g} s "
                    f"(control.lease_s {control.lease_s:g} + meter.fresh_s "
                    f"{g.meter.fresh_s:g} + meter.timeout_s {g.meter.timeout_s:g} + 2 × "
                    f"tick_s {control.tick_s:g}); shorten those or drop the overload",
                )
            )
    return problems


def with_overload(policy: Policy, overload: Overload | None) -> Policy:
    """The policy with this overload rating on every budgeted group (None: on none), checked
    like one written in the file (PolicyError if its time is shorter than powerd's
    reaction): `powerd sim --overload` asks what a rating would buy."""
    groups = tuple(
        replace(g, overload=overload if math.isfinite(g.budget_w) else None) for g in policy.groups
    )
    problems = check_overload(groups, policy.control)
    if problems:
        raise PolicyError(policy.source, problems)
    return replace(policy, groups=groups)


def subtree_totals(groups: Sequence[GroupDef], per_node: Sequence[float]) -> list[float]:
    """Sum a per-group value of the nodes (0 elsewhere) up the tree."""
    totals = list(per_node)
    for i in range(len(groups) - 1, 0, -1):
        totals[groups[i].parent] += totals[i]
    return totals


class ScopeError(ValueError):
    """A scope name the policy does not have, or at a level that cannot be a scope."""


def scoped(policy: Policy, name: str) -> Policy:
    """The policy a scope's controller steers (`Policy.scope`), checked: `name` must be a
    row or a rack of the policy, with nodes (ScopeError otherwise)."""
    k = next((i for i, g in enumerate(policy.groups) if g.name == name), None)
    if k is None:
        raise ScopeError(f"scope {name!r} is not a group of the policy")
    level = policy.groups[k].level
    if level in (0, len(LEVELS) - 1):
        raise ScopeError(
            f"scope {name!r} is the {LEVELS[level]}: a scope is a row or a rack of the policy"
        )
    try:
        sub = policy.scope(name)
    except ValueError as exc:
        raise ScopeError(str(exc)) from None
    if not sub.node_names():
        raise ScopeError(f"scope {name!r} has no nodes")
    return sub


def overlapping_domains(policy: Policy, name: str) -> tuple[str, ...]:
    """The lease domains that overlap domain `name` (the policy's root, or a row or rack
    scope): the groups above it and the rows and racks below it, which a controller could
    steer too. The scope registry lets only one of them lead at a time."""
    groups = policy.groups
    k = next((i for i, g in enumerate(groups) if g.name == name), None)
    if k is None:
        return ()
    above = []
    parent = groups[k].parent
    while parent >= 0:
        above.append(groups[parent].name)
        parent = groups[parent].parent
    below: list[str] = []
    inside = {k}
    for i in range(k + 1, len(groups)):  # parents come before children
        if groups[i].parent in inside:
            inside.add(i)
            if groups[i].level not in (0, len(LEVELS) - 1):
                below.append(groups[i].name)
    return (*above, *below)


def failsafe_budget_w(policy: Policy, name: str) -> float:
    """What the failsafe caps of the scope's GPUs and its overhead take: its budget when
    the coordinator is silent (capped by the last budget it gave)."""
    groups = policy.groups
    per = [g.gpus * g.failsafe_w + g.overhead_w if g.level == 3 else g.overhead_w for g in groups]
    totals = subtree_totals(groups, per)
    return totals[next(i for i, g in enumerate(groups) if g.name == name)]


def parse_policy(data: Any, source: str = "<policy>") -> Policy:
    if not isinstance(data, dict):
        raise PolicyError(
            source,
            [
                (
                    "",
                    "a policy is a mapping with keys facility, profiles, "
                    "classes, defaults and control",
                )
            ],
        )
    try:
        spec = PolicySpec.model_validate(data)
    except ValidationError as exc:
        raise PolicyError(source, validation_problems(exc)) from None
    problems = _check_references(spec)
    expander = _Expander(spec)
    expander.run()
    problems += expander.problems
    if not problems:
        problems += check_failsafe(expander.groups)
        problems += check_lowest(expander.groups)
        problems += check_overload(expander.groups, spec.control)
    if problems:
        raise PolicyError(source, problems)
    profiles = {name: Profile.from_points(name, p.points) for name, p in spec.profiles.items()}
    return Policy(spec=spec, source=source, groups=tuple(expander.groups), profiles=profiles)


def load_policy_text(text: str, source: str = "<policy>") -> Policy:
    return parse_policy(parse_yaml(text, source, PolicyError), source)


def load_policy(path: str | Path) -> Policy:
    return load_policy_text(read_text(path, PolicyError), str(path))
