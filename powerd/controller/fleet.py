"""What the controller knows of the fleet: the latest sample of every GPU and its age.

Telemetry arrives per node; the tick needs per-GPU arrays. FleetState keeps one row per known
GPU (ordered by the policy's node order, then GPU index, so allocations are deterministic)
and rebuilds the arrays only when the set of GPUs changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.policy import Policy
from powerd.wire import NodeState, NodeStatus, NodeTelemetry

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


@dataclass
class GpuRecord:
    uuid: str
    node: str
    index: int
    name: str = ""
    min_cap_w: float = 0.0
    max_cap_w: float = 0.0
    default_cap_w: float = 0.0
    power_w: float = 0.0
    cap_w: float = 0.0
    energy_j: float = 0.0
    temp_c: float = 0.0
    util_pct: float = 0.0
    sm_clock_mhz: float = 0.0
    throttle: list[str] = field(default_factory=list)
    workload: str | None = None
    perf: float | None = None
    error: str | None = None
    seen_at: float = 0.0  # monotonic time of the last sample


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


class FleetState:
    def __init__(self, policy: Policy) -> None:
        self.gpus: dict[str, GpuRecord] = {}
        self.nodes: dict[str, NodeRecord] = {}
        self.unknown_nodes: dict[str, float] = {}  # node → last seen, not in the policy
        self.version = 0  # bumps whenever the set of GPUs changes
        self._order: list[str] = []
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
        self.version += 1

    def node(self, name: str) -> NodeRecord:
        rec = self.nodes.get(name)
        if rec is None:
            rec = self.nodes[name] = NodeRecord(name)
        return rec

    def ingest_telemetry(self, msg: NodeTelemetry, now: float) -> bool:
        """Record one node's sample. False (and nothing recorded) for nodes not in the policy."""
        if msg.node_id not in self.node_order:
            if msg.node_id not in self.unknown_nodes:
                log.warning("telemetry_unknown_node", node=msg.node_id, gpus=len(msg.gpus))
            self.unknown_nodes[msg.node_id] = now
            return False
        node = self.node(msg.node_id)
        node.seen_at = now
        node.seq = msg.seq
        node.agent_ts = msg.ts
        node.state = NodeState(msg.state)
        for g in msg.gpus:
            rec = self.gpus.get(g.uuid)
            if rec is None or rec.node != msg.node_id:
                rec = self.gpus[g.uuid] = GpuRecord(uuid=g.uuid, node=msg.node_id, index=g.index)
                self.version += 1
                log.info("gpu_discovered", node=msg.node_id, uuid=g.uuid, index=g.index)
            rec.index = g.index
            rec.name = g.name
            rec.min_cap_w, rec.max_cap_w, rec.default_cap_w = (
                g.min_cap_w,
                g.max_cap_w,
                g.default_cap_w,
            )
            rec.power_w, rec.cap_w, rec.energy_j = g.power_w, g.cap_w, g.energy_j
            rec.temp_c, rec.util_pct, rec.sm_clock_mhz = g.temp_c, g.util_pct, g.sm_clock_mhz
            rec.throttle = list(g.throttle)
            rec.workload, rec.perf, rec.error = g.workload, g.perf, g.error
            rec.seen_at = now
        return True

    def ingest_status(self, msg: NodeStatus) -> None:
        if msg.node_id not in self.node_order:
            return
        node = self.node(msg.node_id)
        node.state = msg.state
        if msg.caps_w:
            node.status_caps_w = dict(msg.caps_w)

    def ordered_uuids(self) -> list[str]:
        if self._order_version != self.version:
            order = self.node_order
            gpus = self.gpus
            self._order = sorted(gpus, key=lambda u: (order[gpus[u].node], gpus[u].index, u))
            self._order_version = self.version
        return self._order

    def arrays(self, now: float, stale_after_s: float) -> FleetArrays:
        uuids = self.ordered_uuids()
        recs = [self.gpus[u] for u in uuids]

        def col(attr: str) -> FloatArray:
            return np.fromiter((getattr(r, attr) for r in recs), dtype=np.float64, count=len(recs))

        age = now - col("seen_at")
        lost = np.fromiter((r.error is not None for r in recs), dtype=np.bool_, count=len(recs))
        return FleetArrays(
            uuids=uuids,
            nodes=[r.node for r in recs],
            min_cap_w=col("min_cap_w"),
            max_cap_w=col("max_cap_w"),
            power_w=col("power_w"),
            cap_w=col("cap_w"),
            energy_j=col("energy_j"),
            temp_c=col("temp_c"),
            age_s=age,
            stale=(age > stale_after_s) | lost,
            workloads=[r.workload for r in recs],
            perf=np.fromiter(
                (np.nan if r.perf is None else r.perf for r in recs),
                dtype=np.float64,
                count=len(recs),
            ),
        )
