"""The safety planner: which caps the controller may send *now* so no budget is ever exceeded.

The allocator proposes target caps that fit the budgets once in force. Getting there is the
dangerous part: messages are delayed or lost, agents and the controller die. The planner keeps,
per GPU, an upper bound on the cap that may be in force now or later because of anything
already sent (the *committed* cap), and only sends what keeps every group's committed sum
within its budget. Pure: no I/O, no clock; the controller feeds it messages and times.
The rules, exactly as implemented, are in docs/safety.md ("Safety planner").
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import NamedTuple

import numpy as np
from numpy.typing import NDArray

from powerd.policy import Policy
from powerd.topology import FloatArray, IntArray, Topology
from powerd.wire import LEGACY_AUTHORITY, Authority, CapCommand, GpuAck

BoolArray = NDArray[np.bool_]

# Slots of unacknowledged commands kept per GPU. A node that stops acknowledging has its older
# commands folded into newer slots (max/min kept), which only makes the bounds looser.
PENDING_SLOTS = 8
# Watts of float noise tolerated in budget comparisons and in "reading above committed".
TOL_W = 1e-6
ALARM_TOL_W = 0.5
# A node that has left our commands unacknowledged for longer than this many regular ticks
# (`control.tick_s` each: ticks on acks come faster) is planned as if it kept the caps it
# may have: the others make room for it.
UNRESPONSIVE_TICKS = 2
# When the last plans were made (tick, controller time), to tell how long a command has
# waited for its ack; a command older than these counts as unacknowledged for long.
PLAN_TIMES_KEPT = 64
# A reading's key when it names no tick (an agent that has applied no command since it started).
NO_TICK = -1
# `_prior_tick` of a GPU this planner has not yet sent a command to.
_UNSENT = np.iinfo(np.int64).max
_STATUS, _TELEMETRY, _ACK = 0, 1, 2
_SOURCES = ("status", "telemetry", "ack")


@dataclass(frozen=True)
class GpuLayout:
    """The GPUs the planner steers, in the topology's GPU order."""

    topology: Topology
    uuids: tuple[str, ...]
    nodes: tuple[str, ...]  # per GPU
    min_cap_w: FloatArray
    max_cap_w: FloatArray
    failsafe_w: FloatArray  # per GPU: the node's failsafe cap clamped to the GPU's limits
    keeps_limits: BoolArray  # per GPU: its node's actuators keep their limits (policy)
    lowest_w: FloatArray  # per group: the policy's lowest_budget_w (NaN: not declared)

    @classmethod
    def build(
        cls,
        policy: Policy,
        uuids: Sequence[str],
        nodes: Sequence[str],
        min_cap_w: Sequence[float] | FloatArray,
        max_cap_w: Sequence[float] | FloatArray,
    ) -> GpuLayout:
        n = len(uuids)
        lo = np.asarray(min_cap_w, dtype=np.float64)
        hi = np.asarray(max_cap_w, dtype=np.float64)
        if len(nodes) != n or lo.shape != (n,) or hi.shape != (n,):
            raise ValueError("uuids, nodes, min_cap_w and max_cap_w must have one entry per GPU")
        if len(set(uuids)) != n:
            raise ValueError("duplicate GPU uuid in the fleet")
        if np.any(lo > hi):
            raise ValueError("min_cap_w must not exceed max_cap_w")
        topology = Topology.build(policy, nodes)
        node_failsafe = np.array([g.failsafe_w for g in policy.groups], dtype=np.float64)
        failsafe = np.clip(node_failsafe[topology.gpu_groups[:, -1]], lo, hi)
        # The topology's groups are the policy's, in its order.
        node_keeps = np.array([g.keeps_limits for g in policy.groups], dtype=np.bool_)
        keeps = node_keeps[topology.gpu_groups[:, -1]]
        lowest = np.array(
            [math.nan if g.lowest_budget_w is None else g.lowest_budget_w for g in policy.groups]
        )
        return cls(topology, tuple(uuids), tuple(nodes), lo, hi, failsafe, keeps, lowest)

    @property
    def n_gpus(self) -> int:
        return len(self.uuids)


@dataclass(frozen=True)
class SafetyEvent:
    """Something the controller logs, and alarms on (kinds: see docs/safety.md)."""

    kind: str
    node: str = ""
    uuid: str = ""
    group: str = ""
    value_w: float = math.nan
    committed_w: float = math.nan


@dataclass(slots=True)
class AckedCaps:
    """An ack's GPUs as columns, in the order acknowledged (`CapAck.gpus`): what
    `SafetyPlanner.on_ack` folds in, from a wire message (`from_acks`) or built directly by
    the simulator's agents (sim/agents.py) from values checked as the wire checks them."""

    uuids: list[str]
    requested_w: list[float]
    enforced_w: list[float | None]  # None: the agent could not read the limit back
    error: list[object]  # None, or the wire's AckError
    obeyed: bool  # every GPU has an enforced value and no error

    @classmethod
    def from_acks(cls, gpus: Mapping[str, GpuAck]) -> AckedCaps:
        acks = list(gpus.values())
        enforced = [a.enforced_w for a in acks]
        error: list[object] = [a.error for a in acks]
        return cls(
            uuids=list(gpus),
            requested_w=[a.requested_w for a in acks],
            enforced_w=enforced,
            error=error,
            obeyed=None not in enforced and all(e is None for e in error),
        )

    def by_uuid(self) -> dict[str, tuple[float, float | None, object]]:
        return {
            u: (r, e, err)
            for u, r, e, err in zip(
                self.uuids, self.requested_w, self.enforced_w, self.error, strict=True
            )
        }


class NodeCommand(NamedTuple):
    """The caps one node gets this tick: a full map of its GPUs, which also renews its lease.

    A tuple because a tick builds one per node (over a thousand at 10k GPUs). `failsafe_w` is
    shared between ticks: do not mutate it.
    """

    node: str
    tick: int
    lease_s: float
    caps_w: dict[str, float]
    failsafe_w: dict[str, float]

    def to_wire(
        self,
        ts: float = 0.0,
        controller_id: str = "",
        epoch: int = 0,
        authority: Authority | None = None,
        handover: Sequence[Authority] = (),
    ) -> CapCommand:
        return CapCommand(
            node_id=self.node,
            tick=self.tick,
            epoch=epoch,
            authority=authority or LEGACY_AUTHORITY,
            handover=list(handover),
            lease_s=self.lease_s,
            caps=self.caps_w,
            failsafe_w=self.failsafe_w,
            ts=ts,
            controller_id=controller_id,
        )


@dataclass(frozen=True)
class SafePlan:
    """What to send this tick, and where every GPU and group stands after sending it."""

    tick: int
    # The nodes that get a command (`commands`, in its order) and how many GPUs those name.
    sent_nodes: tuple[str, ...]
    sent_gpus: int
    sent_w: FloatArray  # per GPU; NaN where its node gets no command
    committed_w: FloatArray  # per GPU, after this tick's sends
    raised: BoolArray  # sent above the committed cap (admitted by the budget check)
    withheld: BoolArray  # target above what was sent, for want of slack or knowledge
    stale: BoolArray
    group_caps_w: FloatArray  # per group: Σ committed caps
    group_committed_w: FloatArray  # per group: Σ committed caps + overhead + reserve
    group_budget_w: FloatArray
    group_over: BoolArray  # committed above budget: a cut not yet obeyed, or knowledge missing
    # over only because GPUs count at their maximum until a first ack of ours (after a start)
    group_settling: BoolArray
    waiting_nodes: tuple[str, ...]  # live nodes not sent to: a GPU's cap in force is unknown
    events: tuple[SafetyEvent, ...] = field(default=())
    # The GPUs `sent_w` and the per-GPU arrays are indexed by (the planner's at planning).
    layout: GpuLayout | None = None
    # Builds `commands` (one map of caps per node: the simulator, which applies `sent_w`,
    # never reads them).
    build_commands: Callable[[], list[NodeCommand]] = field(default=list, repr=False, compare=False)

    @cached_property
    def commands(self) -> list[NodeCommand]:
        """One command per node in `sent_nodes`: its GPUs' caps, its lease renewed."""
        return self.build_commands()

    def cuts_awaited(self, defiant: BoolArray) -> set[str]:
        """The nodes whose acks may let another tick make a raise this one held back: none
        unless a raise is held on a GPU this tick commands with fresh readings; then those
        with a cut in flight (sent below the cap that may be in force) not refused
        (`defiant`, per GPU). A raise held for room an offline node's or a stale GPU's cap
        takes, or a refused cap, no ack releases (docs/allocator.md, "Raises on acks")."""
        layout = self.layout
        if layout is None:
            return set()
        sent = np.isfinite(self.sent_w)
        if not (self.withheld & sent & ~self.stale).any():
            return set()
        cuts = sent & (self.sent_w < self.committed_w - ALARM_TOL_W) & ~defiant
        nodes = layout.nodes
        return {nodes[i] for i in np.flatnonzero(cuts).tolist()}

    def acks(self, enforced_w: FloatArray) -> list[tuple[str, int, AckedCaps]]:
        """Every command obeyed, as the acks of each (node, tick, its GPUs) would say:
        `enforced_w` per GPU of `layout`, the limit read back where a command went."""
        layout = self.layout
        assert layout is not None
        index = {u: i for i, u in enumerate(layout.uuids)}
        out = []
        for cmd in self.commands:
            uuids = list(cmd.caps_w)
            enforced: list[float | None] = [float(enforced_w[index[u]]) for u in uuids]
            requested = list(cmd.caps_w.values())
            acked = AckedCaps(uuids, requested, enforced, [None] * len(uuids), True)
            out.append((cmd.node, cmd.tick, acked))
        return out


class _Rows(NamedTuple):
    """Queued readings and acks as columns (`SafetyPlanner._absorb`'s input), one row each."""

    gpu: IntArray
    hi: FloatArray
    lo: FloatArray
    key: IntArray  # the tick the row reflects (NO_TICK: none)
    tick: IntArray  # the tick an ack acknowledges (-1: not an ack)
    guess: BoolArray  # an ack's bounds to widen with the earlier ones
    defiant: IntArray  # 1 refused, 0 obeyed, -1 not an ack
    src: IntArray  # _STATUS, _TELEMETRY, _ACK
    seen_at: FloatArray | None  # telemetry: when each GPU was named (None: not telemetry)


class SafetyPlanner:
    """Per-GPU knowledge of the caps in force, and the per-tick plan that respects it.

    Call `set_layout` when the GPU set changes, feed every ack, telemetry message and retained
    status as it arrives, and call `plan` once per tick with strictly increasing ticks.
    """

    def __init__(self, policy: Policy, layout: GpuLayout | None = None) -> None:
        self.policy = policy
        self._events: list[SafetyEvent] = []
        self._last_tick = -1
        self._plan_ticks: deque[int] = deque(maxlen=PLAN_TIMES_KEPT)
        self._plan_times: deque[float] = deque(maxlen=PLAN_TIMES_KEPT)
        # Nodes that said their actuators keep their limits (NodeStatus.keeps_limits): planned
        # so, whatever the policy says; a claim never loosens anything (docs/safety.md).
        self._claimed_keeps: frozenset[str] = frozenset()
        # keeps_limits() for the claims and the layout it was computed at (each plan asks).
        self._keeps_memo: tuple[frozenset[str], object, BoolArray] | None = None
        # `committed_w` while none of what it reads has changed (None: compute it again):
        # every write to _hi, _pend_hi, _prior_hi or the layout sets it to None.
        self._committed: FloatArray | None = None
        self._set_empty()
        if layout is not None:
            self.set_layout(layout)

    # ---- layout -------------------------------------------------------------------------

    def _set_empty(self) -> None:
        self.layout: GpuLayout | None = None
        self._index: dict[str, int] = {}
        self._node_names: list[str] = []
        self._node_index: dict[str, int] = {}
        self._node_gpus: list[IntArray] = []
        self._node_uuids: list[list[str]] = []
        self._node_of_gpu: IntArray = np.zeros(0, dtype=np.int64)
        self._uuid_rank: IntArray = np.zeros(0, dtype=np.int64)
        self._new_gpus(np.zeros(0))
        self._last_ack: dict[str, int] = {}
        self._node_gpu_list: list[list[int]] = []
        self._node_failsafe: list[dict[str, float]] = []
        self._node_order: IntArray = np.zeros(0, dtype=np.int64)
        self._node_bounds: list[int] = [0]
        # `_fleet_rows`' last answer: (nodes, their indices, their GPUs end to end, counts).
        self._fleet_idx: tuple[list[str], list[int], IntArray, list[int]] | None = None
        self._clear_queue()

    def set_layout(self, layout: GpuLayout) -> None:
        """Adopt a new GPU set; what is known about GPUs that stay (same uuid, same node) stays."""
        old = self.layout
        if old is not None:
            self._absorb()  # queued rows hold indices into the old layout
        old_index = self._index
        old_state = self._per_gpu()
        old_last_ack = self._last_ack
        n = layout.n_gpus
        self.layout = layout
        self._index = {u: i for i, u in enumerate(layout.uuids)}
        self._node_names = list(dict.fromkeys(layout.nodes))
        self._node_index = {name: k for k, name in enumerate(self._node_names)}
        self._node_of_gpu = np.fromiter(
            (self._node_index[name] for name in layout.nodes), dtype=np.int64, count=n
        )
        order = np.argsort(self._node_of_gpu, kind="stable")
        bounds = np.searchsorted(self._node_of_gpu[order], np.arange(len(self._node_names) + 1))
        self._node_gpus = [order[bounds[k] : bounds[k + 1]] for k in range(len(self._node_names))]
        self._node_gpu_list = [idx.tolist() for idx in self._node_gpus]
        self._node_uuids = [[layout.uuids[i] for i in idx] for idx in self._node_gpu_list]
        self._node_order = order
        self._node_bounds = bounds.tolist()
        self._fleet_idx = None
        # Failsafe caps change only with the layout: one dict per node, shared by every command.
        self._node_failsafe = [
            dict(zip(uuids, layout.failsafe_w[idx].tolist(), strict=True))
            for uuids, idx in zip(self._node_uuids, self._node_gpus, strict=True)
        ]
        rank = np.empty(n, dtype=np.int64)
        rank[np.argsort(np.array(layout.uuids, dtype=object), kind="stable")] = np.arange(n)
        self._uuid_rank = rank
        self._new_gpus(layout.max_cap_w)
        self._last_ack = {
            name: old_last_ack[name] for name in self._node_names if name in old_last_ack
        }
        if old is None:
            return
        # A GPU that moved to another node is a new GPU: its old commands went elsewhere.
        keep_new, keep_old = [], []
        for i, (u, node) in enumerate(zip(layout.uuids, layout.nodes, strict=True)):
            j = old_index.get(u)
            if j is not None and old.nodes[j] == node:
                keep_new.append(i)
                keep_old.append(j)
        if keep_new:
            new_i = np.array(keep_new)
            old_i = np.array(keep_old)
            for dst, src in zip(self._per_gpu(), old_state, strict=True):
                dst[new_i] = src[old_i]
            self._committed = None

    def _new_gpus(self, max_cap_w: FloatArray) -> None:
        """The per-GPU arrays (listed again in `_per_gpu`) for GPUs nothing is known of."""
        n = len(max_cap_w)
        self._committed = None
        self._hi = np.full(n, np.nan)  # reading, as an upper bound of the cap in force
        self._lo = np.full(n, np.nan)  # reading, as a lower bound (differs after failed sets)
        self._key = np.full(n, NO_TICK, dtype=np.int64)  # the tick the reading reflects
        self._seen = np.full(n, -np.inf)  # controller time of the last telemetry
        # Commands a predecessor (another controller, or this one before a restart) may
        # still have on their way: anything up to max_cap_w, until the GPU acknowledges a
        # command of ours (`_prior_tick`: the first tick we sent it).
        self._prior_hi = max_cap_w.copy()
        self._prior_tick = np.full(n, _UNSENT, dtype=np.int64)
        self._defiant = np.zeros(n, dtype=bool)  # its last ack refused (or missed) our cap
        # Slot by GPU (a GPU's slots are a column): a reduction over a GPU's slots then runs
        # along the long axis, ~15x faster than over 8 values per row (512 GPUs: 4 vs 58 us).
        self._pend_tick = np.full((PENDING_SLOTS, n), -1, dtype=np.int64)
        self._pend_hi = np.zeros((PENDING_SLOTS, n))
        self._pend_lo = np.full((PENDING_SLOTS, n), np.inf)

    def _per_gpu(self) -> tuple[NDArray[np.generic], ...]:
        """Every array indexed by GPU (first axis): what a GPU that stays keeps."""
        return (
            self._hi,
            self._lo,
            self._key,
            self._seen,
            self._prior_hi,
            self._prior_tick,
            self._defiant,
            self._pend_tick.T,
            self._pend_hi.T,
            self._pend_lo.T,
        )

    def _require_layout(self) -> GpuLayout:
        if self.layout is None:
            raise RuntimeError("SafetyPlanner.set_layout must be called before planning")
        return self.layout

    # ---- knowledge ----------------------------------------------------------------------
    #
    # Messages arrive one by one (over a thousand a second at 10k GPUs), so the handlers only
    # queue rows in Python lists; `_absorb` folds the queue into the arrays in one vectorised
    # pass before anything reads them.

    def committed_w(self) -> FloatArray:
        """Per GPU: the highest cap that may be in force now or later from anything sent."""
        layout = self._require_layout()
        self._absorb()
        kept = self._committed
        if kept is None:
            base = np.where(np.isnan(self._hi), layout.max_cap_w, self._hi)
            kept = np.maximum(np.maximum(base, self._pend_hi.max(axis=0)), self._prior_hi)
            self._committed = kept
        out: FloatArray = kept.copy()
        return out

    def _low_w(self) -> FloatArray:
        """Per GPU: a cap no higher than any that may be in force (inf: nothing known)."""
        base = np.where(np.isnan(self._lo), np.inf, self._lo)
        out: FloatArray = np.minimum(base, self._pend_lo.min(axis=0))
        return out

    def defiant(self) -> BoolArray:
        """Per GPU: its last ack refused our cap (or left it out); counted at what it reports."""
        self._require_layout()
        self._absorb()
        return self._defiant.copy()

    def pending_since(self, gpus: IntArray) -> IntArray:
        """Per GPU of `gpus`: the oldest tick of ours it has not acknowledged (-1: none)."""
        self._require_layout()
        never = np.iinfo(np.int64).max
        ticks = self._pend_tick[:, gpus]
        oldest = np.where(ticks >= 0, ticks, never).min(axis=0, initial=never)
        out: IntArray = np.where(oldest == never, -1, oldest)
        return out

    def settling(self) -> BoolArray:
        """Per GPU: still counted at its maximum for what a predecessor may have sent it."""
        self._require_layout()
        self._absorb()
        out: BoolArray = self._prior_hi > 0.0
        return out

    def assume_settled(self) -> None:
        """Declare that no earlier controller has commands on their way to these GPUs (a
        simulation, or a test, that starts the fleet itself): they count at their readings
        at once instead of at their maximum until their first ack."""
        self._require_layout()
        self._prior_hi[:] = 0.0
        self._committed = None

    def _queue_readings(
        self,
        node: str,
        caps_w: Mapping[str, float] | tuple[Sequence[str], Sequence[float]],
        as_of_tick: int | None,
        source: int,
        lifts_to_w: Mapping[str, float] | Sequence[float] | None = None,
    ) -> list[int]:
        k = self._node_index.get(node)
        if k is None:
            return []
        key = NO_TICK if as_of_tick is None else int(as_of_tick)
        uuids, gpus = self._node_uuids[k], self._node_gpu_list[k]
        lifts: Sequence[float | None] | None = None
        if isinstance(caps_w, tuple):
            # Columns: in the planner's order they are its values as they are.
            if caps_w[0] == uuids:
                values: list[float | None] = list(caps_w[1])
                if lifts_to_w is not None and not isinstance(lifts_to_w, Mapping):
                    lifts = lifts_to_w
            else:
                if lifts_to_w is not None and not isinstance(lifts_to_w, Mapping):
                    lifts_to_w = dict(zip(caps_w[0], lifts_to_w, strict=True))
                caps_w = dict(zip(*caps_w, strict=True))
        if not isinstance(caps_w, tuple):
            values = [caps_w.get(u) for u in uuids]
        if lifts is None and isinstance(lifts_to_w, Mapping):
            lifts = [lifts_to_w.get(u) for u in uuids]
        # The bound from above: the limit read, or the one it goes back to when a lower
        # limit another set lifts, where that is higher (`on_telemetry`).
        highs = values
        if lifts is not None and any(
            h is not None and v is not None and h > v for v, h in zip(values, lifts, strict=True)
        ):
            highs = [
                h if h is not None and v is not None and h > v else v
                for v, h in zip(values, lifts, strict=True)
            ]
        if None not in values and all(map(math.isfinite, values)):  # type: ignore[arg-type]
            # Every GPU read (the common case): whole rows at once.
            n = len(gpus)
            self._q_gpu += gpus
            self._q_hi += highs  # type: ignore[arg-type]
            self._q_lo += values  # type: ignore[arg-type]
            self._q_key += [key] * n
            self._q_tick += [-1] * n
            self._q_guess += [False] * n
            self._q_defiant += [-1] * n
            self._q_src += [source] * n
            return list(gpus)
        queued = []
        for i, v, h in zip(gpus, values, highs, strict=True):
            if v is not None and math.isfinite(v):
                self._q_gpu.append(i)
                self._q_hi.append(v if h is None else h)
                self._q_lo.append(v)
                self._q_key.append(key)
                self._q_tick.append(-1)
                self._q_guess.append(False)
                self._q_defiant.append(-1)
                self._q_src.append(source)
                queued.append(i)
        return queued

    def on_fleet_telemetry(
        self,
        nodes: Sequence[str],
        uuids: Sequence[Sequence[str]],
        caps_w: Sequence[float] | FloatArray,
        received_at: float,
        as_of_tick: Sequence[int | None],
        *,
        lifts_to_w: Sequence[float] | FloatArray | None = None,
    ) -> bool:
        """Many nodes' telemetry at once: the same as `on_telemetry(nodes[j], (uuids[j],
        caps_j), received_at, as_of_tick[j], lifts_j)` for each in turn, `caps_w` (and
        `lifts_to_w`) holding theirs end to end. Queued as one block where every node is
        known, names its GPUs in the planner's order and reads every cap (a whole fleet's
        sample, the common case); False, with nothing queued, where not: then call
        `on_telemetry` for each."""
        gpus = self._fleet_rows(nodes, uuids)
        if gpus is None:
            return False
        caps = np.asarray(caps_w, dtype=np.float64)
        if caps.shape != gpus[0].shape or not np.isfinite(caps).all():
            return False
        highs = caps
        if lifts_to_w is not None:
            lifts = np.asarray(lifts_to_w, dtype=np.float64)
            if lifts.shape != caps.shape:
                return False
            if (lifts > caps).any():  # (NaN: nothing set, never above)
                highs = np.fmax(caps, lifts)
        idx, counts = gpus
        key = np.repeat(
            np.array([NO_TICK if t is None else int(t) for t in as_of_tick], dtype=np.int64),
            counts,
        )
        n = len(idx)
        self._queue_block(
            _Rows(
                idx,
                highs,
                caps,
                key,
                np.full(n, -1, dtype=np.int64),
                np.zeros(n, dtype=np.bool_),
                np.full(n, -1, dtype=np.int64),
                np.full(n, _TELEMETRY, dtype=np.int64),
                np.full(n, received_at),
            )
        )
        return True

    def on_fleet_acks(self, acks: Sequence[tuple[str, int, AckedCaps]]) -> None:
        """Many acks at once, (node, tick, its GPUs) each: the same as `on_ack` of each in
        turn, the runs of acks in which every GPU obeyed queued as one block."""
        idx: list[IntArray] = []
        enforced: list[float | None] = []
        ticks: list[int] = []
        counts: list[int] = []
        for node, tick, acked in acks:
            k = self._node_index.get(node)
            if k is None or tick <= self._last_ack.get(node, -1):
                continue  # unknown node, or an ack older than what we know
            if not (acked.obeyed and acked.uuids == self._node_uuids[k]):
                self._queue_acks(idx, enforced, ticks, counts)
                self.on_ack(node, tick, acked)
                continue
            self._last_ack[node] = tick
            idx.append(self._node_gpus[k])
            enforced += acked.enforced_w
            ticks.append(tick)
            counts.append(len(acked.uuids))
        self._queue_acks(idx, enforced, ticks, counts)

    def _queue_acks(
        self, idx: list[IntArray], enforced: list[float | None], ticks: list[int], counts: list[int]
    ) -> None:
        """Obeyed acks' rows as one block (as `on_ack` queues each); the lists are emptied."""
        if not idx:
            return
        self._queue_obeyed(
            np.concatenate(idx),
            np.array(enforced, dtype=np.float64),
            np.repeat(np.array(ticks, dtype=np.int64), counts),
        )
        idx.clear()
        enforced.clear()
        ticks.clear()
        counts.clear()

    def on_plan_acked(self, plan: SafePlan, enforced_w: FloatArray) -> None:
        """Every command of `plan` obeyed, `enforced_w` per GPU of its layout the limit read
        back where a command went: the same as `on_fleet_acks(plan.acks(enforced_w))`, queued
        as one block without a list of values per node."""
        if plan.layout is None or plan.layout is not self.layout:
            self.on_fleet_acks(plan.acks(enforced_w))
            return
        tick = plan.tick
        last, index, node_gpus = self._last_ack, self._node_index, self._node_gpus
        idx = []
        for node in plan.sent_nodes:
            if tick <= last.get(node, -1):
                continue  # an ack older than what we know
            last[node] = tick
            idx.append(node_gpus[index[node]])
        if idx:
            gpu = np.concatenate(idx)
            self._queue_obeyed(gpu, enforced_w[gpu], np.full(len(gpu), tick, dtype=np.int64))

    def _queue_obeyed(self, gpu: IntArray, obeyed: FloatArray, tick: IntArray) -> None:
        """Obeyed acks' rows (per row its GPU, the limit enforced, the tick acknowledged)."""
        n = len(gpu)
        self._queue_block(
            _Rows(
                gpu,
                obeyed,
                obeyed,
                tick,
                tick,
                np.zeros(n, dtype=np.bool_),
                np.zeros(n, dtype=np.int64),
                np.full(n, _ACK, dtype=np.int64),
                None,
            )
        )

    def _fleet_rows(
        self, nodes: Sequence[str], uuids: Sequence[Sequence[str]]
    ) -> tuple[IntArray, list[int]] | None:
        """The planner's GPUs of these nodes end to end, and how many each (None where a
        node is unknown or names other GPUs than the planner's, in another order)."""
        cached = self._fleet_idx
        if cached is not None and cached[0] == nodes:
            ks = cached[1]
        else:
            found = [self._node_index.get(node) for node in nodes]
            if None in found:
                return None
            ks = [k for k in found if k is not None]
        node_uuids = self._node_uuids
        for k, names in zip(ks, uuids, strict=True):
            if node_uuids[k] != names:
                return None
        if cached is None or cached[0] != nodes:
            idx = (
                np.concatenate([self._node_gpus[k] for k in ks])
                if ks
                else np.zeros(0, dtype=np.int64)
            )
            counts = [len(node_uuids[k]) for k in ks]
            cached = self._fleet_idx = (list(nodes), ks, idx, counts)
        return cached[2], cached[3]

    def _queue_block(self, block: _Rows) -> None:
        if self._q_gpu:
            self._q_blocks.append(self._list_rows())
        self._q_blocks.append(block)

    def _list_rows(self) -> _Rows:
        """The rows queued in the lists, as a block (the lists emptied; sightings stay in
        theirs: they fold in by maximum, in any order)."""
        rows = _Rows(
            np.array(self._q_gpu, dtype=np.int64),
            np.array(self._q_hi, dtype=np.float64),
            np.array(self._q_lo, dtype=np.float64),
            np.array(self._q_key, dtype=np.int64),
            np.array(self._q_tick, dtype=np.int64),
            np.array(self._q_guess, dtype=np.bool_),
            np.array(self._q_defiant, dtype=np.int64),
            np.array(self._q_src, dtype=np.int64),
            None,
        )
        self._clear_rows()
        return rows

    def _queued(self) -> _Rows:
        """Every queued row, in arrival order."""
        if not self._q_blocks:
            return self._list_rows()
        if self._q_gpu:
            self._q_blocks.append(self._list_rows())
        blocks = self._q_blocks
        if len(blocks) == 1:
            return blocks[0]
        return _Rows(
            np.concatenate([b.gpu for b in blocks]),
            np.concatenate([b.hi for b in blocks]),
            np.concatenate([b.lo for b in blocks]),
            np.concatenate([b.key for b in blocks]),
            np.concatenate([b.tick for b in blocks]),
            np.concatenate([b.guess for b in blocks]),
            np.concatenate([b.defiant for b in blocks]),
            np.concatenate([b.src for b in blocks]),
            None,
        )

    def learn_status(
        self,
        node: str,
        caps_w: Mapping[str, float],
        as_of_tick: int | None = None,
        lifts_to_w: Mapping[str, float] | None = None,
    ) -> None:
        """Caps in force from a node's status; `as_of_tick`: its `last_tick`; `lifts_to_w`:
        its `set_w`, the limits the GPUs go back to should lower ones lift (as for
        `on_telemetry`: they bound a GPU from above, its cap in force from below)."""
        self._queue_readings(node, caps_w, as_of_tick, _STATUS, lifts_to_w)

    def on_telemetry(
        self,
        node: str,
        caps_w: Mapping[str, float] | tuple[Sequence[str], Sequence[float]],
        received_at: float,
        as_of_tick: int | None = None,
        lifts_to_w: Mapping[str, float] | Sequence[float] | None = None,
    ) -> None:
        """Enforced caps read back by the agent (by uuid, or as columns: uuids, caps);
        `received_at` (controller time) dates freshness, `as_of_tick` (the last command the
        agent had applied when it sampled) orders it.

        `lifts_to_w` (by uuid, or a column beside the caps; NaN or missing: none): per GPU
        the limit its agent set, to which it goes back should a lower limit that another
        holds lift (a BMC's out-of-band cap, `nvidia-smi` lowering it): with no command and
        no reading in between, so a reading below it bounds the cap in force from below
        only, and from above by that limit. (Read as the bound, the lower limit would let
        the difference go to other GPUs, and its lifting break their budget until the next
        sample.)"""
        queued = self._queue_readings(node, caps_w, as_of_tick, _TELEMETRY, lifts_to_w)
        self._q_seen_gpu += queued
        self._q_seen_at += [received_at] * len(queued)

    def on_ack(self, node: str, tick: int, gpus: Mapping[str, GpuAck] | AckedCaps) -> None:
        """An agent applied command `tick`: it resolves every command to the node up to `tick`.

        Agents apply only ticks newer than the last applied one, so no command at or below
        `tick` can still take effect. Where a GPU's set failed or it is missing from the ack,
        the cap in force is whichever of those commands (or the earlier cap) last succeeded,
        so the bound becomes the highest of them, the request and the read-back value.
        """
        k = self._node_index.get(node)
        if k is None or tick <= self._last_ack.get(node, -1):
            return  # unknown node, or an ack older than what we know
        acked = gpus if isinstance(gpus, AckedCaps) else AckedCaps.from_acks(gpus)
        self._last_ack[node] = tick
        uuids, idx = self._node_uuids[k], self._node_gpu_list[k]
        if acked.obeyed and acked.uuids == uuids:
            # Every GPU of the node obeyed, acknowledged in the planner's order (the common
            # case): whole rows at once.
            n = len(idx)
            obeyed = acked.enforced_w
            self._q_gpu += idx
            self._q_hi += obeyed  # type: ignore[arg-type]
            self._q_lo += obeyed  # type: ignore[arg-type]
            self._q_key += [tick] * n
            self._q_tick += [tick] * n
            self._q_guess += [False] * n
            self._q_defiant += [0] * n
            self._q_src += [_ACK] * n
            return
        by_uuid = acked.by_uuid()
        for u, i in zip(uuids, idx, strict=True):
            ack = by_uuid.get(u)
            defiant = 0
            hi: float
            lo: float
            if ack is not None and ack[2] is None and ack[1] is not None:
                hi = lo = ack[1]
                guess = False
            else:
                # Bounds to widen with the earlier ones and the resolved commands in `_absorb`.
                requested: float = math.nan if ack is None else ack[0]
                enforced: float = math.nan if ack is None or ack[1] is None else ack[1]
                hi = max(requested, enforced) if ack is not None else 0.0
                lo = min(requested, enforced) if ack is not None else math.inf
                hi, lo = (0.0 if math.isnan(hi) else hi), (math.inf if math.isnan(lo) else lo)
                guess = True
                # A GPU that may sit above what we asked refuses our cap: the plan counts it at
                # what it reports and cuts others. One held lower than asked does no harm.
                defiant = int(not enforced <= requested + ALARM_TOL_W)
                error = "missing" if ack is None else str(ack[2] or "no_enforced_value")
                self._events.append(
                    SafetyEvent("ack_error", node=node, uuid=u, group=error, value_w=requested)
                )
            self._q_gpu.append(i)
            self._q_hi.append(hi)
            self._q_lo.append(lo)
            self._q_key.append(tick)
            self._q_tick.append(tick)
            self._q_guess.append(guess)
            self._q_defiant.append(defiant)
            self._q_src.append(_ACK)

    def node_offline(self, node: str) -> None:
        """The node's last will: its agent is gone, and with it any knowledge of its caps (a
        rebooted GPU comes back at its default limit). Its GPUs count at their maximum until
        it reports again with a reading at least as new (by tick) as the last one we had.
        Before the first layout no node is known: nothing to forget (the caller replays what
        it heard once the GPUs are laid out, as with the other messages)."""
        idx = self._absorbed_gpus(node)
        if idx is None:
            return
        layout = self._require_layout()
        self._events.append(SafetyEvent("node_offline", node=node))
        # Actuators that keep their limits (a BMC) hold the caps in force when their agent
        # goes: what is committed still bounds them. This loosens what we count, so it takes
        # both words: the policy's, and the node's own (`claim_keeps_limits`).
        kept = node in self._claimed_keeps
        moves = idx[~layout.keeps_limits[idx]] if kept else idx
        self._hi[moves] = layout.max_cap_w[moves]
        self._lo[moves] = layout.min_cap_w[moves]
        self._committed = None

    def claim_keeps_limits(self, nodes: Collection[str]) -> None:
        """Nodes that say their actuators keep their limits: their GPUs are planned as the
        policy's `keeps_limits` nodes are; offline, only a node both say so of counts at its
        committed caps (`node_offline`)."""
        self._claimed_keeps = frozenset(nodes)

    def keeps_limits(self) -> BoolArray:
        """Per GPU: planned as keeping its limit when its agent dies (policy or claim)."""
        layout = self._require_layout()
        if not self._claimed_keeps:
            return layout.keeps_limits
        memo = self._keeps_memo
        if memo is not None and memo[1] is layout and memo[0] == self._claimed_keeps:
            return memo[2]
        claimed = np.array([n in self._claimed_keeps for n in self._node_names], dtype=np.bool_)
        out: BoolArray = layout.keeps_limits | claimed[self._node_of_gpu]
        self._keeps_memo = (self._claimed_keeps, layout, out)
        return out

    def count_at_max(self) -> None:
        """Count every GPU at its maximum from now until a command of ours sent after this
        call is acknowledged (a handover in progress: the successors may raise any of them
        any time). What is known of the caps in force stays: commands hold or cut."""
        layout = self._require_layout()
        self._absorb()
        self._count_at_max(np.arange(layout.n_gpus))

    def node_foreign(self, node: str) -> None:
        """The node obeys another authority (docs/safety.md, "Authority"): whatever is in
        force there is that authority's to change, so its GPUs count at their maximum, and
        only an ack of a command of ours that the node takes later (after a handover, or the
        other's silence) brings them back. What was known or sent before says nothing now:
        readings keyed by the other's ticks, our unacknowledged commands (a node that takes
        us over applies only a newer one). Call it every tick while the node is foreign."""
        idx = self._absorbed_gpus(node)
        if idx is None:
            return
        layout = self._require_layout()
        self._count_at_max(idx)
        self._hi[idx] = layout.max_cap_w[idx]
        self._lo[idx] = layout.min_cap_w[idx]
        self._key[idx] = NO_TICK
        self._pend_tick[:, idx] = -1
        self._pend_hi[:, idx] = 0.0
        self._pend_lo[:, idx] = np.inf
        self._last_ack.pop(node, None)
        self._committed = None

    def _absorbed_gpus(self, node: str) -> IntArray | None:
        """The node's GPUs (None: not in the layout, or no layout yet), with the queued
        messages folded in."""
        k = self._node_index.get(node)
        if k is None:
            return None
        self._absorb()
        return self._node_gpus[k]

    def _count_at_max(self, idx: IntArray) -> None:
        layout = self._require_layout()
        self._prior_hi[idx] = layout.max_cap_w[idx]
        self._prior_tick[idx] = _UNSENT
        self._committed = None

    def _clear_queue(self) -> None:
        self._clear_rows()
        self._q_seen_gpu: list[int] = []
        self._q_seen_at: list[float] = []
        # Whole fleets' rows at once (`on_fleet_telemetry`, `on_fleet_acks`), as arrays: the
        # rows queued in the lists below before each block are moved into a block first, so
        # the blocks hold every row in arrival order.
        self._q_blocks: list[_Rows] = []

    def _clear_rows(self) -> None:
        self._q_gpu: list[int] = []
        self._q_hi: list[float] = []
        self._q_lo: list[float] = []
        self._q_key: list[int] = []
        self._q_tick: list[int] = []
        self._q_guess: list[bool] = []
        self._q_defiant: list[int] = []  # 1 refused, 0 obeyed, -1 not an ack
        self._q_src: list[int] = []

    def _absorb(self) -> None:
        """Fold queued readings and acks into the per-GPU state.

        Readings are ordered by the tick they reflect, then by arrival: never by the sender's
        clock. A reading of a tick at least as new as the one held replaces it; an older one
        (sampled before a command we have seen acknowledged, or from an agent restarted
        since) may only widen the bounds. Within one tick a GPU's cap only falls (failsafe),
        so any reading of the newest tick bounds the cap in force from above.
        """
        self._absorb_seen()
        if not self._q_gpu and not self._q_blocks:
            if self._q_seen_gpu:  # (the rest of the queue is empty already)
                self._q_seen_gpu, self._q_seen_at = [], []
            return
        layout = self._require_layout()
        gpu, hi, lo, key, tick, guess, defiant, src, _ = self._queued()
        self._clear_queue()
        self._committed = None
        from powerd.allocator import kernel  # numba: loaded by the first solve

        gpu = np.asarray(gpu, dtype=np.int64)
        hi = np.asarray(hi, dtype=np.float64)  # (an ack that guesses widens its row here)
        # One compiled pass over the rows (a tick's telemetry or its acks were ~35 numpy
        # calls, a tenth of a millisecond at 512 GPUs): the same folds in the same order.
        above, before = kernel.absorb_rows(
            gpu,
            hi,
            np.asarray(lo, dtype=np.float64),
            np.asarray(key, dtype=np.int64),
            np.asarray(tick, dtype=np.int64),
            np.asarray(guess, dtype=np.bool_),
            np.asarray(defiant, dtype=np.int64),
            self._hi,
            self._lo,
            self._key,
            self._pend_tick,
            self._pend_hi,
            self._pend_lo,
            self._prior_hi,
            self._prior_tick,
            self._defiant,
            layout.max_cap_w,
            layout.min_cap_w,
            ALARM_TOL_W,
            kernel.sparse_rows(gpu.size, layout.n_gpus),
        )
        # A reading above the committed cap: something outside powerd raised the limit (or the
        # device clamped a request up). The bound follows the reading; the controller alarms.
        self._alarm_above(layout, np.flatnonzero(above), gpu=gpu, hi=hi, src=src, before=before)

    def _absorb_seen(self) -> None:
        """When each GPU was last named by its node (the queue's sightings)."""
        if self._q_seen_gpu:
            np.maximum.at(self._seen, np.array(self._q_seen_gpu), np.array(self._q_seen_at))
        for block in self._q_blocks:
            if block.seen_at is not None:
                np.maximum.at(self._seen, block.gpu, block.seen_at)

    def _alarm_above(
        self,
        layout: GpuLayout,
        rows: NDArray[np.int64],
        *,
        gpu: NDArray[np.int64],
        hi: FloatArray,
        src: NDArray[np.int64],
        before: FloatArray,
    ) -> None:
        """An event for each queued reading (`rows`) whose cap is above what was committed."""
        for r in rows.tolist():
            i = int(gpu[r])
            self._events.append(
                SafetyEvent(
                    f"{_SOURCES[int(src[r])]}_above_committed",
                    node=layout.nodes[i],
                    uuid=layout.uuids[i],
                    value_w=float(hi[r]),
                    committed_w=float(before[r]),
                )
            )

    # ---- planning -----------------------------------------------------------------------

    def plan(  # noqa: PLR0913 (keyword-only options past `targets_w`)
        self,
        tick: int,
        now: float,
        targets_w: FloatArray,
        *,
        budget_w: FloatArray | None = None,
        reserve_w: FloatArray | None = None,
        priority: FloatArray | None = None,
        offline: Collection[str] = (),
        record: bool = True,
        jobs: IntArray | None = None,
        strict_w: FloatArray | None = None,
        changes_only: bool = False,
    ) -> SafePlan:
        """The commands to send at `tick` (controller time `now`) toward `targets_w`.

        `changes_only`: command only the nodes where a cap moves (a tick on acks,
        `control.ack_ticks`: the regular ticks renew every node's lease; a node left out
        keeps the cap it may have, which is what it would have been sent).

        `record=False`: the commands will not be sent (shadow mode): they are planned from
        the caps in force as they are, and nothing is remembered of them.

        `budget_w` (per group) overrides the topology's budgets, e.g. after a cut; `reserve_w`
        (per group) is power held back on top of overhead; `priority` orders raises that do
        not all fit (higher first, then uuid). Nodes in `offline` get no command and no raise.
        `jobs` (per GPU, -1: none) names GPUs that are raised together or not at all: a job
        with a member that cannot be raised now (stale, offline, under a group over its
        budget, or short of room) waits whole. Cuts still go at once, member by member.
        `strict_w` (per group): the budgets where `budget_w` holds overload limits above them
        (an overload rating lends room): GPUs that keep their limits are not lent it.
        """
        layout = self._require_layout()
        if tick <= self._last_tick:
            raise ValueError(f"tick {tick} is not after the last planned tick {self._last_tick}")
        self._last_tick = tick
        topo = layout.topology
        targets = np.asarray(targets_w, dtype=np.float64)
        if targets.shape != (layout.n_gpus,):
            raise ValueError(f"targets_w has shape {targets.shape}, expected ({layout.n_gpus},)")
        budget = topo.budget_w if budget_w is None else np.asarray(budget_w, dtype=np.float64)
        reserve = np.zeros(topo.n_groups) if reserve_w is None else np.asarray(reserve_w)
        control = self.policy.control

        committed = self.committed_w()  # absorbs the queued messages first

        node_live = np.ones(len(self._node_names), dtype=bool)
        for name in offline:
            k = self._node_index.get(name)
            if k is not None:
                node_live[k] = False
        # A node is sent nothing until every one of its GPUs has a known cap in force: any
        # value sent to a GPU of unknown cap could be a raise.
        unknown_node = np.bincount(
            self._node_of_gpu, weights=np.isnan(self._hi), minlength=len(node_live)
        )
        waiting = node_live & (unknown_node > 0)
        node_send = node_live & ~waiting
        send = node_send[self._node_of_gpu]
        stale = (now - self._seen) > control.stale_after_s

        wanted = np.where(np.isnan(targets), committed, targets).clip(
            layout.min_cap_w, layout.max_cap_w
        )
        # A GPU that will not move keeps the cap it may have, and the others make room for it:
        # one that refused its cap (we keep asking), one whose node gets no command (offline,
        # waiting), one whose node has left our commands unacknowledged for over two ticks.
        defiant = self._defiant
        silent = self._silent(now)
        fixed = defiant | ~send | silent
        wanted, budget = self._keep_room(
            self.keeps_limits(),
            wanted,
            committed,
            fixed=fixed,
            budget=budget,
            strict=budget if strict_w is None else np.asarray(strict_w, dtype=np.float64),
            reserve=reserve,
        )
        capacity = budget - topo.overhead_w - reserve
        group_caps_before = topo.group_sums(committed)  # Σ committed caps, no overhead
        over_g = group_caps_before > capacity + TOL_W
        in_over = topo.under_any(over_g)
        caps = np.minimum(wanted, committed)
        shed = self._shed(np.where(fixed, committed, caps), capacity, fixed)
        caps = np.where(fixed, caps, shed)
        self._note_stuck(fixed, committed, capacity)
        for i in np.flatnonzero(defiant).tolist():
            self._events.append(
                SafetyEvent(
                    "cap_refused",
                    node=layout.nodes[i],
                    uuid=layout.uuids[i],
                    value_w=float(caps[i]),
                    committed_w=float(committed[i]),
                )
            )
        # Where a group is over, "≤ committed" proves nothing about the truth: send nothing
        # above the lowest cap that may be in force, so no GPU there rises even briefly.
        # (The lowest caps are read only where a group is over: nothing since the messages
        # were absorbed above has changed the bounds they come from.)
        if in_over.any():
            caps = np.where(in_over, np.minimum(caps, self._low_w()), caps)

        raise_mask, job = _raisable(send & ~in_over & ~stale, wanted > committed + TOL_W, jobs)
        admitted = self._admit(
            np.flatnonzero(raise_mask),
            wanted,
            committed,
            group_caps_before,
            capacity,
            priority=priority,
            jobs=job,
        )
        caps = np.where(raise_mask, committed + admitted, caps)
        raised = raise_mask & (admitted > TOL_W)

        # A tick on acks commands only the nodes whose caps move (the others keep theirs).
        node_send, send = _commanded(
            node_send,
            self._node_of_gpu,
            send & (np.abs(caps - committed) > TOL_W) if changes_only else None,
        )
        sent = np.where(send, caps, np.nan)
        if record:
            self._record_sent(tick, now, np.flatnonzero(send), caps)
        committed_after = np.where(send, np.maximum(committed, caps), committed)
        group_caps = topo.group_sums(committed_after)
        group_committed = group_caps + topo.overhead_w + reserve

        group_over = group_committed > budget + TOL_W
        settling = np.zeros_like(group_over)
        if group_over.any() and self._prior_hi.any():
            # Over only for what a predecessor may still send: expected after a start, and
            # gone with the first acks; no breach known.
            base = np.where(np.isnan(self._hi), layout.max_cap_w, self._hi)
            known_after = np.maximum(base, self._pend_hi.max(axis=0))  # this tick's included
            known_committed = topo.group_sums(known_after) + topo.overhead_w + reserve
            settling = group_over & (known_committed <= budget + TOL_W)
        sent_k = np.flatnonzero(node_send).tolist()
        events = tuple(self._events)
        self._events = []
        return SafePlan(
            tick=tick,
            sent_nodes=tuple([self._node_names[k] for k in sent_k]),
            sent_gpus=int(send.sum()),
            sent_w=sent,
            committed_w=committed_after,
            raised=raised,
            withheld=wanted > np.where(send, caps, committed) + ALARM_TOL_W,
            stale=stale,
            group_caps_w=group_caps,
            group_committed_w=group_committed,
            group_budget_w=budget,
            group_over=group_over,
            group_settling=settling,
            waiting_nodes=tuple(self._node_names[k] for k in np.flatnonzero(waiting)),
            events=events,
            layout=layout,
            build_commands=self._commands(tick, control.lease_s, sent_k, caps),
        )

    def _silent(self, now: float) -> BoolArray:
        """Per GPU: a command of ours to it has waited for its ack longer than
        UNRESPONSIVE_TICKS regular ticks (and half of one, for jitter), told by when the
        oldest one still pending was planned, not by how many ticks came since: ticks on
        acks (`control.ack_ticks`) would call a node silent in a fraction of a second."""
        pending = self._pend_tick >= 0
        if not pending.any():
            # Nothing pending (the common case at a tick: every command acknowledged): no
            # GPU is silent, as the lines below would find without their searches.
            return np.zeros(self._pend_tick.shape[1], dtype=np.bool_)
        none = np.iinfo(np.int64).max
        oldest = np.where(pending, self._pend_tick, none).min(axis=0, initial=none)
        if not self._plan_ticks:
            return np.asarray(oldest != none, dtype=np.bool_)
        ticks = np.fromiter(self._plan_ticks, dtype=np.int64, count=len(self._plan_ticks))
        times = np.fromiter(self._plan_times, dtype=np.float64, count=len(self._plan_times))
        pos = np.minimum(np.searchsorted(ticks, oldest), ticks.size - 1)
        # Pending since a plan no longer kept: long ago; nothing pending: never.
        at = np.where(ticks[pos] == oldest, times[pos], np.where(oldest == none, np.inf, -np.inf))
        limit = (UNRESPONSIVE_TICKS + 0.5) * self.policy.control.tick_s
        return np.asarray(at < now - limit, dtype=np.bool_)

    def _keep_room(
        self,
        keeps: BoolArray,
        wanted: FloatArray,
        committed: FloatArray,
        *,
        fixed: BoolArray,
        budget: FloatArray,
        strict: FloatArray,
        reserve: FloatArray,
    ) -> tuple[FloatArray, FloatArray]:
        """The targets, with those of GPUs whose actuators keep their limits (`keeps`) held
        within what such GPUs may hold (docs/safety.md, "BMC-managed nodes: the actuator
        keeps its limits"). Any of them may freeze at its cap in force for good, so per
        group that has some, with those GPUs (`held`) at their committed caps and the
        others (their agents live with them, or are started again and go to failsafe):

        - a cut to the group's lowest budget must be met by the others at their minimum:
          Σ held + Σ others' minimum + overhead + reserve ≤ lowest budget
          (`lowest_budget_w`; undeclared: the policy's budget);
        - where an overload rating lends room (limit above the strict budget), the others'
          leases must be able to take it back: Σ held + Σ others' min(cap, failsafe cap)
          + overhead + reserve ≤ strict budget (the others counted at their targets if
          those are higher: they may be raised in this plan).

        Above the room, the movable ones are cut (their watts above the minimum scaled, as
        `_shed` does); within it, their raises are admitted as far as it allows (in
        proportion where they do not all fit). A group
        where even that leaves the lent room unmet (GPUs that keep their limits frozen above
        it) lends nothing: its budget is returned as the strict one, so the others are cut
        to it and their leases cannot leave it above.

        Returns the targets and the budgets to plan with."""
        if not keeps.any():
            return wanted, budget
        layout = self._require_layout()
        topo = layout.topology
        held = keeps  # counted at their committed caps, or cut if movable
        movable = keeps & ~fixed
        others = ~keeps
        fill = topo.overhead_w + reserve
        # Undeclared, a group promises no cut below its policy budget (the budget itself is
        # kept by the budget rule); a cut below is met if the others can, else alarmed.
        lowest = np.where(np.isnan(layout.lowest_w), topo.budget_w, layout.lowest_w)
        room = lowest - fill - topo.group_sums(np.where(others, layout.min_cap_w, 0.0))
        has_keeps = topo.group_sums(keeps.astype(np.float64)) > 0
        lending = has_keeps & (budget > strict + TOL_W)
        floor_gpu = np.where(movable, layout.min_cap_w, committed)
        floor = topo.group_sums(np.where(held, floor_gpu, 0.0))
        if lending.any():
            back = np.minimum(np.maximum(committed, wanted), layout.failsafe_w)
            lent_room = strict - fill - topo.group_sums(np.where(others, back, 0.0))
            # Frozen above what the others' leases can take back: no lending there.
            unlent = lending & (floor > lent_room + TOL_W)
            budget = np.where(unlent, strict, budget)
            room = np.where(lending & ~unlent, np.minimum(room, lent_room), room)
        room = np.where(has_keeps, room, np.inf)
        planned = np.where(movable, np.minimum(wanted, committed), committed)
        held_planned = topo.group_sums(np.where(held, planned, 0.0))
        short = held_planned > room + TOL_W
        out = wanted.copy()
        if short.any():
            span = np.maximum(held_planned - floor, TOL_W)
            factor = np.where(short, np.clip((room - floor) / span, 0.0, 1.0), 1.0)
            per_gpu = factor[topo.gpu_groups].min(axis=1)
            cut = floor_gpu + (planned - floor_gpu) * per_gpu
            out = np.where(movable & (per_gpu < 1.0), np.minimum(out, cut), out)
            for g in np.flatnonzero(short):
                self._events.append(
                    SafetyEvent(
                        "kept_limits_unmet" if floor[g] > room[g] + TOL_W else "kept_limits_cut",
                        group=topo.names[g],
                        value_w=float(held_planned[g] - room[g]),  # watts above the room
                    )
                )
        # Raises: against the committed caps, so a raise waits for the cuts paying for it;
        # where they do not all fit, each group's slack is shared in proportion to them
        # (each GPU takes the smallest share of its groups: one vectorised pass, where a
        # greedy pass by priority cost 30 ms a tick at 10k GPUs; the budgets' own admission
        # that follows still goes by priority).
        delta = np.where(movable, np.maximum(out - committed, 0.0), 0.0)
        need = topo.group_sums(delta)
        if need.any():
            held_committed = topo.group_sums(np.where(held, committed, 0.0))
            slack = np.maximum(room - held_committed, 0.0)
            factor = np.where(need > slack + TOL_W, slack / np.maximum(need, TOL_W), 1.0)
            share = factor[topo.gpu_groups].min(axis=1)
            out = np.where(delta > 0.0, committed + delta * share, out)
        return out, budget

    def _note_stuck(self, fixed: BoolArray, committed: FloatArray, capacity: FloatArray) -> None:
        """Event `cut_unreachable` per group whose budget in force cannot be met even with
        every GPU that can move at its minimum, because GPUs that keep their limits and
        cannot move now (their agent gone, their BMC not answering) hold too much."""
        stuck = self.keeps_limits() & fixed
        if not stuck.any():
            return
        layout = self._require_layout()
        topo = layout.topology
        floor = topo.group_sums(np.where(fixed, committed, layout.min_cap_w))
        has_stuck = topo.group_sums(stuck.astype(np.float64)) > 0
        # The first groups only (topology order: the largest first): an alarm names five.
        for g in np.flatnonzero(has_stuck & (floor > capacity + TOL_W))[:16].tolist():
            in_g = stuck & (topo.gpu_groups == g).any(axis=1)
            self._events.append(
                SafetyEvent(
                    "cut_unreachable",
                    group=topo.names[g],
                    node=",".join(sorted({layout.nodes[i] for i in np.flatnonzero(in_g)})),
                    value_w=float(floor[g] - capacity[g]),
                    committed_w=float(committed[in_g].sum()),
                )
            )

    def _shed(self, caps: FloatArray, capacity: FloatArray, fixed: BoolArray) -> FloatArray:
        """Lower caps where even the planned decreases do not fit a budget (targets too high,
        or a GPU that refuses its cut: `fixed`, held at its value in `caps`).

        Every group over its capacity scales its GPUs' watts above their floor (minimum, or
        the fixed value) by one factor; each GPU takes the smallest factor of its groups, so
        every group then fits (the tree is laminar and the scaling only lowers).
        """
        layout = self._require_layout()
        topo = layout.topology
        sums = topo.group_sums(caps)
        short = sums > capacity + TOL_W
        if not short.any():
            return caps
        lowest = np.where(fixed, caps, layout.min_cap_w)
        floor = topo.group_sums(lowest)
        span = np.maximum(sums - floor, TOL_W)
        factor = np.where(short, np.clip((capacity - floor) / span, 0.0, 1.0), 1.0)
        for g in np.flatnonzero(short):
            kind = "min_caps_over_budget" if capacity[g] < floor[g] else "shed"
            self._events.append(SafetyEvent(kind, group=topo.names[g], value_w=float(sums[g])))
        per_gpu = factor[topo.gpu_groups].min(axis=1)
        shed = lowest + (caps - lowest) * per_gpu
        return np.where(per_gpu < 1.0, shed, caps)

    def _admit(
        self,
        cand: IntArray,
        wanted: FloatArray,
        committed: FloatArray,
        group_caps: FloatArray,
        capacity: FloatArray,
        *,
        priority: FloatArray | None,
        jobs: IntArray | None = None,
    ) -> FloatArray:
        """Watts of raise admitted per GPU: all of it where every group fits all raises at once;
        elsewhere greedily, highest priority first, as far as the tightest group's slack goes.
        The GPUs of one job are one item, admitted whole or not at all."""
        layout = self._require_layout()
        topo = layout.topology
        admitted = np.zeros(layout.n_gpus)
        if not len(cand):
            return admitted
        delta = np.zeros(layout.n_gpus)
        delta[cand] = wanted[cand] - committed[cand]
        overflow = group_caps + topo.group_sums(delta) > capacity + TOL_W
        crowded = overflow[topo.gpu_groups[cand]].any(axis=1)
        in_job = np.zeros(cand.size, dtype=np.bool_) if jobs is None else jobs[cand] >= 0
        if jobs is not None and in_job.any():
            # A job with any member under a crowded group is crowded as a whole.
            crowded_job = np.zeros(int(jobs.max()) + 1, dtype=np.bool_)
            crowded_job[jobs[cand[crowded & in_job]]] = True
            crowded = crowded | (in_job & crowded_job[np.maximum(jobs[cand], 0)])
        free = cand[~crowded]
        admitted[free] = delta[free]
        slack_g = np.where(overflow, np.maximum(capacity - group_caps, 0.0), np.inf)
        # Under a crowded group with no slack at all (the usual state of a busy site) nothing
        # can be admitted; dropping those first keeps the loop to where there is a choice.
        shut = slack_g[topo.gpu_groups[cand]].min(axis=1) <= TOL_W
        queue = cand[crowded & ~shut & ~in_job]
        job_items: list[IntArray] = []
        if jobs is not None:
            crowded_members = cand[crowded & in_job]
            for j in np.unique(jobs[crowded_members]).tolist():
                job_items.append(crowded_members[jobs[crowded_members] == j])
        if not len(queue) and not job_items:
            return admitted
        prio = np.zeros(layout.n_gpus) if priority is None else np.asarray(priority, np.float64)
        rank = self._uuid_rank
        # Items in order: a GPU (admitted in part if need be), or a job (whole or not at all),
        # by priority (a job's best), then uuid (a job's first).
        items: list[tuple[float, int, IntArray, bool]] = [
            (-float(prio[i]), int(rank[i]), np.array([i]), False) for i in queue.tolist()
        ]
        items += [(-float(prio[m].max()), int(rank[m].min()), m, True) for m in job_items]
        items.sort(key=lambda item: (item[0], item[1]))
        slack = slack_g.tolist()
        for _, _, members, whole in items:
            if not whole:
                # One GPU, as before jobs: as much of its raise as its tightest group allows,
                # without building per-item arrays (this loop runs every tick).
                i = int(members[0])
                groups_i = topo.gpu_groups[i].tolist()
                a = min(float(delta[i]), *(slack[g] for g in groups_i))
                if a > TOL_W:
                    for g in groups_i:
                        slack[g] -= a
                    admitted[i] = a
                continue
            if _take_whole(topo.gpu_groups[members], delta[members], slack):
                admitted[members] = delta[members]
            # else the job waits: raising part of it would split it
        return admitted

    def _record_sent(self, tick: int, now: float, gpus: IntArray, caps: FloatArray) -> None:
        self._plan_ticks.append(tick)  # when (for `_silent`)
        self._plan_times.append(now)
        self._committed = None
        # Every GPU (sorted, as `flatnonzero` gives them): the same slots as views.
        idx: IntArray | slice = slice(None) if len(gpus) == len(self._prior_tick) else gpus
        first = self._prior_tick[idx]
        self._prior_tick[idx] = np.where(first == _UNSENT, tick, first)
        slot = tick % PENDING_SLOTS
        old_tick = self._pend_tick[slot, idx]
        taken = old_tick >= 0
        # An unacknowledged command PENDING_SLOTS ticks old shares the slot: fold it into this
        # one. It is then resolved only by an ack of this tick: looser, never unsafe.
        self._pend_hi[slot, idx] = np.where(
            taken, np.maximum(self._pend_hi[slot, idx], caps[idx]), caps[idx]
        )
        self._pend_lo[slot, idx] = np.where(
            taken, np.minimum(self._pend_lo[slot, idx], caps[idx]), caps[idx]
        )
        self._pend_tick[slot, idx] = tick

    def _commands(
        self, tick: int, lease_s: float, sent: list[int], caps: FloatArray
    ) -> Callable[[], list[NodeCommand]]:
        """The commands to the nodes `sent` (by index) with `caps`, built when first read:
        from the layout of now (a later one does not change them; `caps` is not written)."""
        order, bounds, names, uuids, failsafe = (
            self._node_order,
            self._node_bounds,
            self._node_names,
            self._node_uuids,
            self._node_failsafe,
        )

        def build() -> list[NodeCommand]:
            by_node = caps[order].tolist()
            # Positional: (node, tick, lease_s, caps_w, failsafe_w); a node's uuids and its
            # slice of caps have the same length by construction.
            return [
                NodeCommand(
                    names[k],
                    tick,
                    lease_s,
                    dict(zip(uuids[k], by_node[bounds[k] : bounds[k + 1]])),  # noqa: B905
                    failsafe[k],
                )
                for k in sent
            ]

        return build


def _commanded(
    node_send: BoolArray, node_of_gpu: IntArray, moves: BoolArray | None
) -> tuple[BoolArray, BoolArray]:
    """The nodes to command and their GPUs: of `node_send`, those where a GPU's cap moves
    (`moves`), or all of them (None)."""
    if moves is not None:
        moved = np.bincount(node_of_gpu, weights=moves, minlength=node_send.size) > 0
        node_send = np.asarray(node_send & moved, dtype=np.bool_)
    return node_send, np.asarray(node_send[node_of_gpu], dtype=np.bool_)


def _take_whole(groups: IntArray, delta: FloatArray, slack: list[float]) -> bool:
    """Take a job's whole raise (`delta` per member, `groups` their paths) from `slack` if
    every group it touches has room for its share; else take nothing."""
    need: dict[int, float] = {}
    for g, d in zip(
        groups.ravel().tolist(), np.repeat(delta, groups.shape[1]).tolist(), strict=True
    ):
        need[g] = need.get(g, 0.0) + d
    if not all(d <= slack[g] + TOL_W for g, d in need.items()):
        return False
    for g, d in need.items():
        slack[g] -= d
    return True


def _raisable(
    may: BoolArray, wants: BoolArray, jobs: IntArray | None
) -> tuple[BoolArray, IntArray | None]:
    """GPUs to consider for a raise: those that want one and may have one now, less every
    member of a job with a member that wants one and may not (they all wait)."""
    mask = may & wants
    if jobs is None:
        return mask, None
    job = np.asarray(jobs, dtype=np.int64)
    if job.shape != mask.shape:
        raise ValueError(f"jobs has shape {job.shape}, expected {mask.shape}")
    member = job >= 0
    held = np.zeros(max(int(job.max(initial=0)), 0) + 1, dtype=np.bool_)
    held[job[member & wants & ~may]] = True
    return mask & ~(member & held[np.maximum(job, 0)]), job


# -- overload: committed caps above a budget, measured draw within it -----------------------


@dataclass(frozen=True)
class OverloadRule:
    """Per group (topology order): the rating's allowance and the draw target, as shares
    of the budget (0 where a group declares no overload)."""

    pct: FloatArray  # committed caps may reach budget × (1 + pct/100)
    target_pct: FloatArray  # measured draw is steered to budget × (1 − target_pct/100)
    # Per group, the window of the draw's rises kept in reserve (`Overload.rise_s`; 0 where
    # none, None where no group keeps any).
    rise_s: FloatArray | None = None

    @classmethod
    def from_policy(cls, policy: Policy) -> OverloadRule | None:
        """Over the policy's groups (a Topology built from it has the same order); None
        when no group declares an overload rating."""
        rated = [g.overload for g in policy.groups]
        if all(o is None for o in rated):
            return None
        return cls(
            pct=np.array([0.0 if o is None else o.pct for o in rated]),
            target_pct=np.array([0.0 if o is None else o.target_pct for o in rated]),
            rise_s=np.array([0.0 if o is None else o.rise_s for o in rated])
            if any(o is not None and o.rise_s > 0 for o in rated)
            else None,
        )

    def ratings_w(self, budget_w: FloatArray) -> FloatArray:
        """Per group, the most its committed caps may ever reach (the budget if unrated)."""
        return np.asarray(budget_w, dtype=np.float64) * (1.0 + self.pct / 100.0)

    def limits_w(
        self, budget_w: FloatArray, committed_w: FloatArray, draw_w: FloatArray
    ) -> FloatArray:
        """What each group's committed caps may reach this tick (docs/safety.md, "Overload").

        `committed_w` and `draw_w` are per group and count the same things (overhead, and
        GPUs without fresh telemetry at their committed caps), so their difference is the
        reservation the GPUs do not draw. Where a group is rated, the limit is its
        committed caps plus the room between its draw and the target, within
        [budget, budget × (1 + pct)]; draw above the budget drops it to the budget at once,
        where no GPU can draw past it once the cut applies. Elsewhere, the budget."""
        budget = np.asarray(budget_w, dtype=np.float64)
        rated = (self.pct > 0) & np.isfinite(budget)
        if not rated.any():
            return budget
        rating = self.ratings_w(budget)
        target = budget * (1.0 - self.target_pct / 100.0)
        draw = np.where(np.isfinite(draw_w), draw_w, rating)  # unknown: as if at the rating
        follow = np.clip(committed_w + (target - draw), budget, rating)
        limit = np.where(draw > budget + TOL_W, budget, follow)
        return np.where(rated, limit, budget)
