"""What the controller knows of the fleet: the latest sample of every GPU and its age.

Telemetry arrives per node (over a thousand messages a second at 10k GPUs); the tick needs
per-GPU arrays. Ingest writes the few values the tick reads into per-GPU columns (Python
lists, one slot per GPU, cheap to write one value at a time) and keeps each GPU's latest
sample for everything else; the tick turns the columns into arrays in the fleet's stable
order (the policy's node order, then GPU index, so allocations are deterministic) with one
numpy call each, instead of visiting ten thousand records.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.policy import Policy
from powerd.wire import GpuTelemetry, NodeState, NodeStatus, NodeTelemetry

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]


class GpuRecord:
    """One GPU: where it is, its latest sample (every field the agent reported) and when
    that arrived (controller time)."""

    __slots__ = ("index", "node", "sample", "seen_at", "slot", "uuid")

    def __init__(self, sample: GpuTelemetry, node: str, slot: int, seen_at: float) -> None:
        self.uuid = sample.uuid
        self.node = node
        self.index = sample.index
        self.slot = slot  # position in FleetState's columns
        self.sample = sample
        self.seen_at = seen_at  # monotonic time of the last sample


@dataclass
class NodeRecord:
    name: str
    state: NodeState = NodeState.STARTING
    seen_at: float | None = None  # monotonic time of the last telemetry
    seq: int = -1
    agent_ts: float = 0.0  # the agent's wall clock in its last telemetry
    status_caps_w: dict[str, float] = field(default_factory=dict)


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


class _Columns:
    """Per-slot values the tick reads, written by ingest one GPU at a time."""

    __slots__ = (
        "cap",
        "energy",
        "lost",
        "max_cap",
        "min_cap",
        "perf",
        "power",
        "seen",
        "temp",
        "workload",
    )

    def __init__(self) -> None:
        self.min_cap: list[float] = []
        self.max_cap: list[float] = []
        self.power: list[float] = []
        self.cap: list[float] = []
        self.energy: list[float] = []
        self.temp: list[float] = []
        self.seen: list[float] = []
        self.perf: list[float] = []  # NaN where the workload reports none
        self.lost: list[bool] = []  # the agent reported an error instead of a reading
        self.workload: list[str | None] = []

    def append(self) -> int:
        for col in (self.min_cap, self.max_cap, self.power, self.cap, self.energy, self.temp):
            col.append(0.0)
        self.seen.append(-math.inf)
        self.perf.append(math.nan)
        self.lost.append(False)
        self.workload.append(None)
        return len(self.seen) - 1

    def write(self, slot: int, g: GpuTelemetry, now: float) -> None:
        self.min_cap[slot] = g.min_cap_w
        self.max_cap[slot] = g.max_cap_w
        self.power[slot] = g.power_w
        self.cap[slot] = g.cap_w
        self.energy[slot] = g.energy_j
        self.temp[slot] = g.temp_c
        self.seen[slot] = now
        perf = g.perf
        self.perf[slot] = math.nan if perf is None else perf
        self.lost[slot] = g.error is not None
        self.workload[slot] = g.workload


class FleetState:
    def __init__(self, policy: Policy) -> None:
        self.gpus: dict[str, GpuRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.unknown_nodes: dict[str, float] = {}  # node → last seen, not in the policy
        self.version = 0  # bumps whenever the set of GPUs (or their order) changes
        self._cols = _Columns()
        self._order: list[str] = []
        self._order_nodes: list[str] = []
        self._perm: IntArray = np.zeros(0, dtype=np.int64)  # ordered position → slot
        self._order_version = -1
        self.set_policy(policy)

    def set_policy(self, policy: Policy) -> None:
        self.policy = policy
        self.node_order = {name: i for i, name in enumerate(policy.node_names())}
        # GPUs of nodes the new policy no longer has are forgotten (they get no commands).
        gone = [u for u, g in self.gpus.items() if g.node not in self.node_order]
        for uuid in gone:
            del self.gpus[uuid]
        for name in [n for n in self.nodes if n not in self.node_order]:
            del self.nodes[name]
        if gone:
            self._compact()
        self.version += 1

    def _compact(self) -> None:
        """New slots for the GPUs that remain, after some were forgotten."""
        self._cols = _Columns()
        for rec in self.gpus.values():
            rec.slot = self._cols.append()
            self._cols.write(rec.slot, rec.sample, rec.seen_at)

    def node(self, name: str) -> NodeRecord:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name)
        return rec

    def ingest_telemetry(self, msg: NodeTelemetry, now: float) -> bool:
        """Record one node's sample. False (and nothing recorded) for nodes not in the policy."""
        node_id = msg.node_id
        if node_id not in self.node_order:
            if node_id not in self.unknown_nodes:
                log.warning("telemetry_unknown_node", node=node_id, gpus=len(msg.gpus))
            self.unknown_nodes[node_id] = now
            return False
        node = self.node(node_id)
        node.seen_at = now
        node.seq = msg.seq
        node.agent_ts = msg.ts
        node.state = NodeState(msg.state)
        gpus, cols = self.gpus, self._cols
        for g in msg.gpus:
            rec = gpus.get(g.uuid)
            if rec is None or rec.node != node_id:
                slot = cols.append() if rec is None else rec.slot
                rec = gpus[g.uuid] = GpuRecord(g, node_id, slot, now)
                self.version += 1
                log.info("gpu_discovered", node=node_id, uuid=g.uuid, index=g.index)
            elif rec.index != g.index:
                rec.index = g.index
                self.version += 1  # the fleet's order follows GPU indices
            rec.sample = g
            rec.seen_at = now
            cols.write(rec.slot, g, now)
        return True

    def ingest_status(self, msg: NodeStatus) -> None:
        if msg.node_id not in self.node_order:
            return
        node = self.node(msg.node_id)
        node.state = msg.state
        if msg.caps_w:
            node.status_caps_w = dict(msg.caps_w)

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
        self._order_version = self.version

    def ordered_uuids(self) -> list[str]:
        self._refresh_order()
        return self._order

    def arrays(self, now: float, stale_after_s: float) -> FleetArrays:
        self._refresh_order()
        perm, cols = self._perm, self._cols

        def col(values: list[float]) -> FloatArray:
            return np.array(values, dtype=np.float64)[perm]

        age = now - col(cols.seen)
        lost = np.array(cols.lost, dtype=np.bool_)[perm]
        workload = cols.workload
        return FleetArrays(
            uuids=self._order,
            nodes=self._order_nodes,
            min_cap_w=col(cols.min_cap),
            max_cap_w=col(cols.max_cap),
            power_w=col(cols.power),
            cap_w=col(cols.cap),
            energy_j=col(cols.energy),
            temp_c=col(cols.temp),
            age_s=age,
            stale=(age > stale_after_s) | lost,
            workloads=[workload[i] for i in perm.tolist()],
            perf=col(cols.perf),
        )
