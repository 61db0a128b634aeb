"""What the controller knows of the fleet: the latest sample of every GPU and its age.

Telemetry arrives per node (over a thousand messages a second at 10k GPUs); the tick needs
per-GPU arrays. Ingest writes every GPU's latest values into per-field columns (Python
lists, one slot per GPU, cheap to write one value at a time); the tick turns the columns
it needs into arrays in the fleet's stable order (the policy's node order, then GPU index,
so allocations are deterministic) with one numpy call each, instead of visiting ten
thousand records. A FleetGpu reads its attributes from its slot, for the API and metrics.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any, Generic, TypeVar, overload

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.policy import Policy
from powerd.wire import CAP_TOLERANCE_W, NodeState, NodeStatus, NodeTelemetry

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]
T = TypeVar("T")
# A node state by its value (a sample's `state`), without the enum's lookup per node.
_STATES: dict[str, NodeState] = {s.value: s for s in NodeState}


@overload
def is_stale(age_s: float, lost: bool, stale_after_s: float) -> bool: ...
@overload
def is_stale(age_s: FloatArray, lost: BoolArray, stale_after_s: float) -> BoolArray: ...
def is_stale(age_s: Any, lost: Any, stale_after_s: float) -> Any:
    """The stale rule, for one GPU or for arrays of them: its last sample is older than
    `stale_after_s`, or it reported an error instead of a reading (`lost`). The allocator
    does not raise a stale GPU (docs/controller.md)."""
    return (age_s > stale_after_s) | lost


@dataclass
class FleetNode:
    name: str
    state: NodeState = NodeState.STARTING
    seen_at: float | None = None  # monotonic time of the last telemetry
    seq: int = -1
    agent_ts: float = 0.0  # the agent's wall clock in its last telemetry (informational)
    tick: int | None = None  # the last command applied, as of its last telemetry
    status_caps_w: dict[str, float] = field(default_factory=dict)
    # The status's `set_w`: per GPU the limit it goes back to should a lower one lift.
    status_set_w: dict[str, float] = field(default_factory=dict)
    status_tick: int | None = None  # `last_tick` of the status that gave status_caps_w
    status_newer: bool = False  # the status arrived after the last telemetry
    gone_max_cap_w: float = 0.0  # the highest device maximum of GPUs it no longer has
    refused: int = 0  # GPUs in its last telemetry beyond its inventory (not taken)
    # It said (a status, its last will) that its actuators keep their limits (a BMC): once
    # said, planned so for as long as we run (docs/safety.md, "BMC-managed nodes").
    keeps_limits: bool = False
    heard_status: bool = False  # it has published a status (its agent runs this release?)

    @property
    def stopped(self) -> bool:
        """Stopped cleanly: its last word is an `offline` status with the caps it left in
        force (a last will carries none). Its agent, gone with its MQTT session, applies
        nothing more, so those caps hold until it starts again (and lowers them to failsafe)."""
        return self.state is NodeState.OFFLINE and bool(self.status_caps_w)


@dataclass
class Dispute:
    """A GPU uuid that two or more nodes' telemetry named: it belongs to none of them while
    the dispute lasts (no node can take a neighbour's GPU by naming it first)."""

    uuid: str
    seen: dict[str, float]  # node → monotonic time it last named the uuid


@dataclass(frozen=True)
class FleetArrays:
    """Per-GPU arrays for one tick, in the fleet's stable order."""

    uuids: list[str]
    nodes: list[str]
    min_cap_w: FloatArray
    max_cap_w: FloatArray
    power_w: FloatArray
    cap_w: FloatArray
    energy_j: FloatArray
    temp_c: FloatArray
    age_s: FloatArray
    stale: BoolArray
    workloads: list[str | None]
    perf: FloatArray  # NaN where the workload reports none
    # The job each GPU's node reports it in (None: none), the same list while none changes;
    # None when no GPU reports one.
    jobs: list[str | None] | None = None
    # The limit the GPU's agent last set (NaN: none reported, or the GPU reported an error):
    # `cap_w` differing from it is a limit powerd did not set.
    set_w: FloatArray | None = None

    def not_set_here(self) -> BoolArray:
        """Per GPU whether the limit in force at its latest reading (`cap_w`) is not the one
        its agent set (`set_w`): another tool's, an out-of-band limit, a reset's default.
        False where no set is reported (the simulator's agents, an error)."""
        if self.set_w is None:
            return np.zeros(len(self.uuids), dtype=np.bool_)
        with np.errstate(invalid="ignore"):
            return np.asarray(np.abs(self.cap_w - self.set_w) > CAP_TOLERANCE_W)


@dataclass(slots=True)
class _Columns:
    """Every GPU's latest values, one list per field and one slot per GPU. Lists of plain
    values: cheap to write one at a time, one numpy call to turn into an array, and no
    new long-lived objects per sample for the garbage collector to walk (keeping each
    sample's pydantic object alive made full collections slow enough to pause ticks:
    docs/performance.md, "Steering loop"). The fields here are the one list of what the
    controller keeps per GPU."""

    min_cap_w: list[float] = field(default_factory=list)
    max_cap_w: list[float] = field(default_factory=list)
    default_cap_w: list[float] = field(default_factory=list)
    power_w: list[float] = field(default_factory=list)
    cap_w: list[float] = field(default_factory=list)
    energy_j: list[float] = field(default_factory=list)
    temp_c: list[float] = field(default_factory=list)
    util_pct: list[float] = field(default_factory=list)
    sm_clock_mhz: list[float] = field(default_factory=list)
    seen_at: list[float] = field(default_factory=list)  # monotonic time of the last sample
    perf: list[float] = field(default_factory=list)  # NaN where the workload reports none
    lost: list[bool] = field(default_factory=list)  # an error reported instead of a reading
    name: list[str] = field(default_factory=list)
    index: list[int] = field(default_factory=list)
    throttle: list[tuple[str, ...]] = field(default_factory=list)
    workload: list[str | None] = field(default_factory=list)
    job: list[str | None] = field(default_factory=list)  # as its node reports it
    error: list[str | None] = field(default_factory=list)
    set_w: list[float] = field(default_factory=list)  # NaN: none (wire's GpuTelemetry.set_w)
    restores: list[int] = field(default_factory=list)
    found_w: list[float] = field(default_factory=list)  # NaN: none

    def append(self, r: NodeReadings, k: int, now: float) -> int:
        for name in _FIELDS:
            getattr(self, name).append(None)
        slot = len(self.seen_at) - 1
        self.write(slot, r, k, now)
        return slot

    def write(self, slot: int, r: NodeReadings, k: int, now: float) -> None:
        """The `k`th GPU of a node's sample into `slot`."""
        for name in _SAMPLED:
            getattr(self, name)[slot] = getattr(r, name)[k]
        self.seen_at[slot] = now
        error = r.error[k]
        self.lost[slot] = error is not None
        # A GPU that could not be read carries its last known cap, not a reading.
        self.set_w[slot] = math.nan if error is not None else r.set_w[k]

    def write_run(self, a: int, b: int, r: NodeReadings, now: float) -> None:
        """A node's whole sample into slots a..b-1 (its GPUs, in the order sent)."""
        # One statement per column (`_SAMPLED`, then the derived ones): no getattr per name.
        self.min_cap_w[a:b] = r.min_cap_w
        self.max_cap_w[a:b] = r.max_cap_w
        self.default_cap_w[a:b] = r.default_cap_w
        self.power_w[a:b] = r.power_w
        self.cap_w[a:b] = r.cap_w
        self.energy_j[a:b] = r.energy_j
        self.temp_c[a:b] = r.temp_c
        self.util_pct[a:b] = r.util_pct
        self.sm_clock_mhz[a:b] = r.sm_clock_mhz
        self.perf[a:b] = r.perf
        self.name[a:b] = r.name
        self.index[a:b] = r.index
        self.throttle[a:b] = r.throttle
        self.workload[a:b] = r.workload
        self.job[a:b] = r.job
        self.error[a:b] = r.error
        self.restores[a:b] = r.restores
        self.found_w[a:b] = r.found_w
        self.seen_at[a:b] = [now] * (b - a)
        if r.no_errors:
            self.lost[a:b] = [False] * (b - a)
            self.set_w[a:b] = r.set_w
        else:
            self.lost[a:b] = [e is not None for e in r.error]
            self.set_w[a:b] = [
                math.nan if e is not None else v for e, v in zip(r.error, r.set_w, strict=True)
            ]

    def take(self, slots: list[int]) -> _Columns:
        """A copy holding only these slots, renumbered 0, 1, ..."""
        out = _Columns()
        for name in _FIELDS:
            values = getattr(self, name)
            setattr(out, name, [values[i] for i in slots])
        return out


_FIELDS = tuple(f.name for f in fields(_Columns))


def split_fleet(samples: Sequence[NodeReadings], whole: NodeReadings) -> list[NodeReadings]:
    """Each node's sample with its own columns: its part of `whole` (the samples' columns
    end to end, the samples carrying each node's identity, times, tick and uuids)."""
    out, a = [], 0
    for r in samples:
        b = a + len(r.uuid)
        out.append(replace(r, **{name: getattr(whole, name)[a:b] for name in _MESSAGE_COLUMNS}))
        a = b
    return out


# A wire GPU's values in NodeReadings' column order (uuid .. found_w).
_MESSAGE_COLUMNS = (
    "uuid", "index", "name", "min_cap_w", "max_cap_w", "default_cap_w", "power_w", "cap_w",
    "energy_j", "temp_c", "util_pct", "sm_clock_mhz", "perf", "throttle", "workload", "job",
    "error", "set_w", "restores", "found_w",
)  # fmt: skip
_message_row = operator.attrgetter(*_MESSAGE_COLUMNS)
# The columns written as sent (NodeReadings has each); the others are derived.
_SAMPLED = tuple(n for n in _FIELDS if n not in ("seen_at", "lost", "set_w"))
# `_Columns.write_run` writes each of these by name.
assert _SAMPLED == (
    "min_cap_w", "max_cap_w", "default_cap_w", "power_w", "cap_w", "energy_j", "temp_c",
    "util_pct", "sm_clock_mhz", "perf", "name", "index", "throttle", "workload", "job",
    "error", "restores", "found_w",
)  # fmt: skip


@dataclass(slots=True)
class NodeReadings:
    """One node's telemetry sample as columns, one entry per GPU in the order sent: what
    `FleetState.ingest` records. Built from a wire message (`from_message`), or directly by
    the simulator's agents (sim/agents.py) from values checked as the wire checks them."""

    node_id: str
    ts: float
    seq: int
    tick: int | None
    epoch: int | None
    state: str
    uuid: list[str]
    index: list[int]
    name: list[str]
    min_cap_w: list[float]
    max_cap_w: list[float]
    default_cap_w: list[float]
    power_w: list[float]
    cap_w: list[float]
    energy_j: list[float]
    temp_c: list[float]
    util_pct: list[float]
    sm_clock_mhz: list[float]
    perf: list[float]  # NaN: none reported
    throttle: list[tuple[str, ...]]
    workload: list[str | None]
    job: list[str | None]
    error: list[str | None]
    set_w: list[float]  # NaN: none
    restores: list[int]
    found_w: list[float]  # NaN: none
    no_errors: bool  # no GPU reported an error
    any_restores: bool  # some GPU reports restores
    # The same values as min_cap_w, max_cap_w, power_w, cap_w, energy_j, temp_c, perf and
    # set_w as float arrays by those names, where the sender holds them so (the simulator's
    # agents, a whole fleet's sample; never written after): the fleet's arrays are then
    # taken from them, not converted back from the lists. None: only the lists.
    arrays: dict[str, FloatArray] | None = None

    @classmethod
    def from_message(cls, msg: NodeTelemetry) -> NodeReadings:
        gpus = msg.gpus
        # One pass over the GPUs in C (attrgetter), turned into one list per column.
        cols: list[list[Any]] = (
            [list(c) for c in zip(*map(_message_row, gpus), strict=True)]
            if gpus
            else [[] for _ in _MESSAGE_COLUMNS]
        )
        (uuid, index, name, min_cap_w, max_cap_w, default_cap_w, power_w, cap_w, energy_j,
         temp_c, util_pct, sm_clock_mhz, perf, throttle, workload, job, error, set_w,
         restores, found_w) = cols  # fmt: skip
        nan = math.nan
        if None in perf:
            perf = [nan if v is None else v for v in perf]
        if None in set_w:
            set_w = [nan if v is None else v for v in set_w]
        if None in found_w:
            found_w = [nan if v is None else v for v in found_w]
        # A tuple of strings drops out of the collector's sight at its first collection.
        throttle = [tuple(t) if t else () for t in throttle]
        return cls(
            msg.node_id, msg.ts, msg.seq, msg.tick, msg.epoch, msg.state, uuid, index, name,
            min_cap_w, max_cap_w, default_cap_w, power_w, cap_w, energy_j, temp_c, util_pct,
            sm_clock_mhz, perf, throttle, workload, job, error, set_w, restores, found_w,
            error.count(None) == len(error), any(restores),
        )  # fmt: skip


class _Column(Generic[T]):
    """A FleetGpu attribute read from the GPU's slot of the column of the same name."""

    def __set_name__(self, owner: type[FleetGpu], name: str) -> None:
        if name not in _FIELDS:
            raise TypeError(f"{owner.__name__}.{name}: no column of that name")
        self.column = name

    def __get__(self, rec: FleetGpu, owner: type[FleetGpu] | None = None) -> T:
        values: list[T] = getattr(rec.columns, self.column)
        return values[rec.slot]


class FleetGpu:
    """One GPU: its identity, and its latest sample as attributes (read from FleetState's
    columns, for the admin API, metrics and the store)."""

    __slots__ = ("columns", "node", "slot", "uuid")

    def __init__(self, uuid: str, node: str, slot: int, columns: _Columns) -> None:
        self.uuid = uuid
        self.node = node
        self.slot = slot
        self.columns = columns

    index: _Column[int] = _Column()
    name: _Column[str] = _Column()
    min_cap_w: _Column[float] = _Column()
    max_cap_w: _Column[float] = _Column()
    default_cap_w: _Column[float] = _Column()
    power_w: _Column[float] = _Column()
    cap_w: _Column[float] = _Column()
    energy_j: _Column[float] = _Column()
    temp_c: _Column[float] = _Column()
    util_pct: _Column[float] = _Column()
    sm_clock_mhz: _Column[float] = _Column()
    throttle: _Column[tuple[str, ...]] = _Column()
    workload: _Column[str | None] = _Column()
    job: _Column[str | None] = _Column()  # as its node reports it
    error: _Column[str | None] = _Column()
    seen_at: _Column[float] = _Column()  # monotonic time of the last sample
    restores: _Column[int] = _Column()

    @property
    def set_w(self) -> float | None:
        value = self.columns.set_w[self.slot]
        return None if math.isnan(value) else value

    @property
    def found_w(self) -> float | None:
        value = self.columns.found_w[self.slot]
        return None if math.isnan(value) else value

    @property
    def perf(self) -> float | None:
        value = self.columns.perf[self.slot]
        return None if math.isnan(value) else value


class FleetState:
    def __init__(self, policy: Policy) -> None:
        self.gpus: dict[str, FleetGpu] = {}
        self.nodes: dict[str, FleetNode] = {}
        self.unknown_nodes: dict[str, float] = {}  # node → last seen, not in the policy
        # GPU uuids named by more than one node: steered by none while that lasts.
        self.disputes: dict[str, Dispute] = {}
        self.version = 0  # bumps whenever the set of GPUs (or their order) changes
        self.stops = 0  # bumps whenever a node stops cleanly, or reports again after a stop
        self.jobs_version = 0  # bumps whenever a GPU's reported job changes
        self._jobs: tuple[int, int, list[str | None] | None] = (-1, -1, None)
        self._cols = _Columns()
        self._order: list[str] = []
        self._order_nodes: list[str] = []
        self._perm: IntArray = np.zeros(0, dtype=np.int64)  # ordered position → slot
        self._perm_identity = True  # the fleet's order is the slots' order
        # Every slot's float columns as arrays (the columns' object, when they were written,
        # the arrays by name), while nothing else has written the columns since a whole
        # fleet's sample that carried them (`NodeReadings.arrays`); None: convert the lists.
        self._col_arrays: tuple[_Columns, float, dict[str, FloatArray]] | None = None
        self._order_version = -1
        self._node_gpus: dict[str, set[str]] = {}
        # Per node: the uuids it named last, the slots a..b they sit in, and the layout
        # key then (slots move only when `_compact` renumbers them).
        self._runs: dict[str, tuple[list[str], int, int, int]] = {}
        # The fleet version, the workload column and the workloads in fleet order then.
        self._workloads: tuple[int, list[str | None], list[str | None]] = (-1, [], [])
        self._layout_key = 0
        # Bumps whenever a node's `keeps_limits` or `heard_status` may change (a status, a
        # node forgotten): the nodes that claim or leave unsaid kept limits, kept meanwhile.
        self._status_version = 0
        self._keeps: tuple[int, list[str], list[str]] | None = None
        self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.node_order = {name: i for i, name in enumerate(policy.node_names())}
        # A node may report at most the GPUs its policy entry says it has.
        self.inventory = {g.name: g.gpus for g in policy.groups if g.name in self.node_order}
        # GPUs of nodes the new policy no longer has are forgotten (they get no commands).
        gone = [u for u, g in self.gpus.items() if g.node not in self.node_order]
        for uuid in gone:
            del self.gpus[uuid]
        for name in [n for n in self.nodes if n not in self.node_order]:
            del self.nodes[name]
        self._status_version += 1
        if gone:
            self._compact()
        self._node_gpus = {}
        for uuid, rec in self.gpus.items():
            self._node_gpus.setdefault(rec.node, set()).add(uuid)
        self.version += 1

    def forget(self, now: float, after_s: float, dispute_s: float | None = None) -> list[str]:
        """Forget GPUs no telemetry has named for `after_s`, and a node's claim on a disputed
        uuid it has not named for `dispute_s` (default `after_s`); return the uuids
        forgotten. Their node's missing GPUs are reserved at the maximum again."""
        dispute_s = after_s if dispute_s is None else dispute_s
        cols = self._cols
        # Every GPU named within after_s (the common case) needs no look at each; after a
        # whole fleet's sample every slot holds its time.
        given = self._col_arrays
        oldest = given[1] if given is not None and given[0] is cols and cols.seen_at else None
        if oldest is None and cols.seen_at:
            oldest = min(cols.seen_at)
        recent = oldest is None or now - oldest <= after_s
        gone = (
            []
            if recent
            else [u for u, g in self.gpus.items() if now - cols.seen_at[g.slot] > after_s]
        )
        for uuid in gone:
            node = self._unlink(uuid)
            log.warning("gpu_forgotten", node=node, uuid=uuid, after_s=after_s)
        for uuid, d in list(self.disputes.items()):
            d.seen = {n: t for n, t in d.seen.items() if now - t <= dispute_s}
            if len(d.seen) <= 1:  # one node still names it: its next telemetry may take it
                del self.disputes[uuid]
                log.info("gpu_dispute_ended", uuid=uuid, nodes=sorted(d.seen))
        if gone:
            self._compact()
            self.version += 1
        return gone

    def _unlink(self, uuid: str) -> str:
        """Take a GPU out of the fleet (its slot stays until `_compact`); its node."""
        rec = self.gpus.pop(uuid)
        self._node_gpus.get(rec.node, set()).discard(uuid)
        node = self.nodes.get(rec.node)
        if node is not None:  # its node now counts it missing, at the largest maximum seen
            node.gone_max_cap_w = max(node.gone_max_cap_w, self._cols.max_cap_w[rec.slot])
        return rec.node

    def _compact(self) -> None:
        """New slots for the GPUs that remain, after some were forgotten."""
        recs = list(self.gpus.values())
        self._layout_key += 1
        self._col_arrays = None
        self._cols = self._cols.take([rec.slot for rec in recs])
        for slot, rec in enumerate(recs):
            rec.slot, rec.columns = slot, self._cols

    def gpus_of(self, node: str) -> list[str]:
        """The uuids heard from a node (unordered)."""
        return list(self._node_gpus.get(node, ()))

    def node(self, name: str) -> FleetNode:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = FleetNode(name)
        return rec

    def node_state(self, name: str) -> str:
        """A node's state as the API and metrics show it: "unseen" until its first telemetry,
        then what its agent last reported (`starting`, `steered`, `failsafe`, `offline`)."""
        rec = self.nodes.get(name)
        return "unseen" if rec is None or rec.seen_at is None else str(rec.state)

    def state_counts(self) -> dict[str, int]:
        """How many of the policy's nodes are in each state (`node_state`)."""
        counts: dict[str, int] = {}
        for name in self.node_order:
            state = self.node_state(name)
            counts[state] = counts.get(state, 0) + 1
        return counts

    def ingest_telemetry(self, msg: NodeTelemetry, now: float) -> bool:
        """Record one node's sample. False (and nothing recorded) for nodes not in the policy."""
        return self.ingest(NodeReadings.from_message(msg), now)

    def ingest(self, r: NodeReadings, now: float) -> bool:
        """Record one node's sample as columns (a wire message's, or the simulator's
        agents'). False (and nothing recorded) for nodes not in the policy."""
        self._col_arrays = None
        node_id = r.node_id
        if node_id not in self.node_order:
            if node_id not in self.unknown_nodes:
                log.warning("telemetry_unknown_node", node=node_id, gpus=len(r.uuid))
            self.unknown_nodes[node_id] = now
            return False
        node = self._heard(r, now)
        # The common case: the node names the GPUs it named last time, none disputed, in
        # slots next to each other: every column is written with one slice assignment.
        run = self._runs.get(node_id)
        if (
            run is not None
            and run[0] == r.uuid
            and run[3] == self._layout_key
            and (not self.disputes or self.disputes.keys().isdisjoint(r.uuid))
        ):
            a, b = run[1], run[2]
            cols = self._cols
            if cols.index[a:b] != r.index:
                self.version += 1  # the fleet's order follows GPU indices
            if cols.job[a:b] != r.job:
                self.jobs_version += 1
            cols.write_run(a, b, r, now)
            node.refused = 0
            return True
        self._ingest_each(node, r, now)
        return True

    def _heard(self, r: NodeReadings, now: float) -> FleetNode:
        """The node's record of a sample: when, which, its state."""
        node = self.node(r.node_id)
        if node.stopped:
            self.stops += 1
        node.seen_at = now
        node.seq = r.seq
        node.agent_ts = r.ts
        node.tick = r.tick
        node.status_newer = False
        node.state = NodeState(r.state)
        return node

    def _heard_all(self, samples: Sequence[NodeReadings], now: float) -> None:
        """`_heard(r, now).refused = 0` of each sample in turn, without a call per node."""
        nodes, offline = self.nodes, NodeState.OFFLINE
        for r in samples:
            node = nodes.get(r.node_id)
            if node is None:
                node = self.node(r.node_id)
            if node.state is offline and node.status_caps_w:  # `stopped`
                self.stops += 1
            node.seen_at = now
            node.seq = r.seq
            node.agent_ts = r.ts
            node.tick = r.tick
            node.status_newer = False
            state = _STATES.get(r.state)
            node.state = NodeState(r.state) if state is None else state
            node.refused = 0

    def ingest_fleet(
        self, samples: Sequence[NodeReadings], whole: NodeReadings, now: float
    ) -> bool:
        """Every node's sample at once, `whole` holding their columns end to end (in the
        order of `samples`, whose own columns but `uuid` are not read: `split_fleet`): as
        `ingest` of each in turn, with every column written in one
        slice where the nodes' GPUs sit in consecutive slots in that order (as they stay
        while no GPU comes, goes or is disputed). False, with nothing recorded, where they
        do not: then `ingest` each sample."""
        self._col_arrays = None
        if self.disputes or not samples:
            return False
        runs, key, order = self._runs, self._layout_key, self.node_order
        a = b = -1
        for r in samples:
            run = runs.get(r.node_id)
            if run is None or run[3] != key or r.node_id not in order or run[0] != r.uuid:
                return False
            if b < 0:
                a = run[1]
            elif run[1] != b:
                return False
            b = run[2]
        if b - a != len(whole.uuid):
            return False
        cols = self._cols
        self._heard_all(samples, now)
        if cols.index[a:b] != whole.index or cols.job[a:b] != whole.job:
            # As `ingest` counts them: one change a node.
            for r in samples:
                run = runs[r.node_id]
                x, y = run[1] - a, run[2] - a  # the node's part of `whole`
                if cols.index[run[1] : run[2]] != whole.index[x:y]:
                    self.version += 1
                if cols.job[run[1] : run[2]] != whole.job[x:y]:
                    self.jobs_version += 1
        cols.write_run(a, b, whole, now)
        if whole.arrays is not None and whole.no_errors and a == 0 and b == len(cols.seen_at):
            self._col_arrays = (cols, now, whole.arrays)
        return True

    def _ingest_each(self, node: FleetNode, r: NodeReadings, now: float) -> None:
        """`ingest`, GPU by GPU: discoveries, disputes, GPUs beyond the inventory."""
        node_id = node.name
        gpus, cols = self.gpus, self._cols
        mine = self._node_gpus.setdefault(node_id, set())
        room = self.inventory.get(node_id, 0) - len(mine)
        refused = 0
        slots: list[int] = []
        for k, uuid in enumerate(r.uuid):
            dispute = self.disputes.get(uuid)
            if dispute is not None:
                dispute.seen[node_id] = now
                slots.append(-1)
                continue
            rec = gpus.get(uuid)
            if rec is None:
                if room <= 0:
                    refused += 1  # beyond the node's inventory: a phantom, or a wrong policy
                    slots.append(-1)
                    continue
                room -= 1
                slot = cols.append(r, k, now)
                gpus[uuid] = FleetGpu(uuid, node_id, slot, cols)
                mine.add(uuid)
                self.version += 1
                log.info("gpu_discovered", node=node_id, uuid=uuid, index=r.index[k])
            elif rec.node != node_id:
                # Named by a second node: which one has it cannot be told from what they
                # send (whoever spoke first after a start would win), so neither does. It
                # leaves the fleet: its node's missing GPUs are reserved at their maximum,
                # and no node gets commands for it until one node alone has named it for
                # stale_after_s (the claim stopped, or a real move).
                log.warning("gpu_claimed_twice", uuid=uuid, holder=rec.node, claimant=node_id)
                self.disputes[uuid] = Dispute(
                    uuid, {rec.node: self._cols.seen_at[rec.slot], node_id: now}
                )
                self._unlink(uuid)
                self._compact()
                cols = self._cols  # new columns: the GPUs after this one are written there
                self.version += 1
                slots.append(-1)
                continue
            else:
                slot = rec.slot
                if cols.index[slot] != r.index[k]:
                    self.version += 1  # the fleet's order follows GPU indices
                if cols.job[slot] != r.job[k]:
                    self.jobs_version += 1
                cols.write(slot, r, k, now)
            slots.append(slot)
        if refused and not node.refused:
            log.warning(
                "gpus_beyond_inventory",
                node=node_id,
                refused=refused,
                inventory=self.inventory.get(node_id, 0),
            )
        node.refused = refused
        # Where the node's GPUs sit, for the next sample's slice assignments.
        a = slots[0] if slots else -1
        if a >= 0 and slots == list(range(a, a + len(slots))):
            self._runs[node_id] = (list(r.uuid), a, a + len(slots), self._layout_key)
        else:
            self._runs.pop(node_id, None)

    def keeps_limits_claimed(self) -> list[str]:
        """Nodes that said their actuators keep their limits."""
        return list(self._keeps_lists()[1])

    def keeps_limits_unsaid(self) -> list[str]:
        """Nodes that have published a status without saying their limits are kept."""
        return list(self._keeps_lists()[2])

    def _keeps_lists(self) -> tuple[int, list[str], list[str]]:
        """(version, claimed, unsaid), computed again only after a status (each tick asks;
        a node's record made by its telemetry has neither)."""
        kept = self._keeps
        if kept is None or kept[0] != self._status_version:
            nodes = self.nodes.items()
            kept = self._keeps = (
                self._status_version,
                sorted(n for n, rec in nodes if rec.keeps_limits),
                sorted(n for n, rec in nodes if rec.heard_status and not rec.keeps_limits),
            )
        return kept

    def offline_nodes(self) -> list[str]:
        """Nodes whose last status is `offline` (their last will, or a clean stop)."""
        return sorted(n for n, rec in self.nodes.items() if rec.state is NodeState.OFFLINE)

    def ingest_status(self, msg: NodeStatus) -> None:
        if msg.node_id not in self.node_order:
            return
        node = self.node(msg.node_id)
        was = (node.stopped, node.status_caps_w)
        node.state = msg.state
        node.keeps_limits |= msg.keeps_limits
        node.heard_status = True
        self._status_version += 1
        if msg.caps_w:
            node.status_caps_w = dict(msg.caps_w)
            node.status_set_w = dict(msg.set_w)
            node.status_tick = msg.last_tick
            node.status_newer = True
        elif msg.state is NodeState.OFFLINE:
            # A last will: the caps the node had may not survive it (a rebooted GPU comes
            # back at its default limit), so what it said before no longer counts.
            node.status_caps_w = {}
            node.status_set_w = {}
            node.status_tick = None
        if (node.stopped or was[0]) and (node.stopped, node.status_caps_w) != was:
            self.stops += 1

    def ack_heard(self, node_id: str) -> None:
        """An ack from a node we believe stopped: an agent runs there again, so the caps it
        stopped at no longer hold. Until its telemetry its caps are unknown (as after a will)."""
        node = self.nodes.get(node_id)
        if node is not None and node.stopped:
            node.status_caps_w = {}
            node.status_set_w = {}
            node.status_tick = None
            self.stops += 1

    def acks_heard(self, node_ids: Sequence[str]) -> None:
        """`ack_heard` of each node."""
        offline = NodeState.OFFLINE
        # (`stopped` of any node, without a call per node.)
        if any(rec.state is offline and rec.status_caps_w for rec in self.nodes.values()):
            for node_id in node_ids:
                self.ack_heard(node_id)

    def _refresh_order(self) -> None:
        if self._order_version == self.version:
            return
        order = self.node_order
        gpus = self.gpus
        self._order = sorted(gpus, key=lambda u: (order[gpus[u].node], gpus[u].index, u))
        self._order_nodes = [gpus[u].node for u in self._order]
        self._perm = np.fromiter(
            (gpus[u].slot for u in self._order), dtype=np.int64, count=len(self._order)
        )
        self._perm_identity = bool((self._perm == np.arange(len(self._perm))).all())
        self._order_version = self.version

    def ordered_uuids(self) -> list[str]:
        self._refresh_order()
        return self._order

    def arrays(self, now: float, stale_after_s: float) -> FleetArrays:
        self._refresh_order()
        perm, cols = self._perm, self._cols
        identity = self._perm_identity
        given = self._col_arrays
        if given is not None and given[0] is not cols:
            given = None

        def col(values: list[float]) -> FloatArray:
            out = np.array(values, dtype=np.float64)
            return out if identity else out[perm]

        def column(name: str) -> FloatArray:
            """A float column in the fleet's order: from the sample's arrays if they hold
            the columns' values (the same numbers), else from the list."""
            if given is None:
                return col(getattr(cols, name))
            values = given[2][name]
            return values.copy() if identity else values[perm]

        if given is None:
            age = now - col(cols.seen_at)
            lost = np.array(cols.lost, dtype=np.bool_)
            if not identity:
                lost = lost[perm]
        else:  # one sample's time in every slot, no GPU's error
            age = now - np.full(len(perm), given[1])
            lost = np.zeros(len(perm), dtype=np.bool_)
        workload = cols.workload
        # The same list while no GPU's reported workload changes (TargetStage keys on it).
        kept = self._workloads
        if kept[0] != self.version or kept[1] != workload:
            kept = self._workloads = (
                self.version,
                list(workload),
                [workload[i] for i in perm.tolist()],
            )
        if self._jobs[:2] != (self.version, self.jobs_version):
            job = cols.job
            jobs = [job[i] for i in perm.tolist()] if any(j is not None for j in job) else None
            self._jobs = (self.version, self.jobs_version, jobs)
        return FleetArrays(
            uuids=self._order,
            nodes=self._order_nodes,
            min_cap_w=column("min_cap_w"),
            max_cap_w=column("max_cap_w"),
            power_w=column("power_w"),
            cap_w=column("cap_w"),
            energy_j=column("energy_j"),
            temp_c=column("temp_c"),
            age_s=age,
            stale=is_stale(age, lost, stale_after_s),
            workloads=kept[2],
            perf=column("perf"),
            jobs=self._jobs[2],
            set_w=column("set_w"),
        )
