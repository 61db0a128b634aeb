"""The fleet's shape: what a tick rebuilds only when the GPU set, the policy or a clean stop
changes (the topology over the GPUs heard, the planner's layout, the reserve for GPUs the
policy promises but nobody reported).

Caps in force have one home, the safety planner. The fleet (controller/fleet.py) keeps the
latest reading of each GPU; when the planner learns a new layout, `build_shape` teaches it
what was heard of the GPUs it did not know yet (retained statuses arrive before telemetry
after a start), in arrival order, and from then on every message goes to the planner as it
comes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from powerd.allocator import Tree
from powerd.controller.fleet import FleetArrays, FleetState
from powerd.policy import LEVELS, Policy
from powerd.safety import GpuLayout, SafetyPlanner
from powerd.topology import Topology
from powerd.wire import NodeState

FloatArray = NDArray[np.float64]


@dataclass
class Shape:
    """What is rebuilt only when the GPU set, the policy or a clean stop changes."""

    version: tuple[int, int, int]  # fleet GPU set, policy, clean stops
    topology: Topology
    tree: Tree
    layout: GpuLayout
    reserve_w: FloatArray  # per group: unknown GPUs below it counted at their maximum
    # per group: the same, only those of the group itself (nodes): what the allocator
    # takes, adding them up the tree itself
    reserve_own_w: FloatArray
    gpu_index: dict[str, int]  # uuid → position, for explanations (controller/why.py)


def build_shape(
    policy: Policy,
    fleet: FleetState,
    planner: SafetyPlanner,
    arrays: FleetArrays,
    *,
    version: tuple[int, int, int],
    now: float,
) -> Shape:
    """The shape of the fleet heard now; the planner gets its layout and learns what was
    heard of the GPUs it did not know."""
    topology = Topology.build(policy, arrays.nodes)
    layout = GpuLayout.build(policy, arrays.uuids, arrays.nodes, arrays.min_cap_w, arrays.max_cap_w)
    planner.set_layout(layout)
    _teach(fleet, planner, now)
    reserve_node = _reserve_per_node(policy, fleet, topology, arrays)
    index = {u: i for i, u in enumerate(layout.uuids)}
    return Shape(
        version,
        topology,
        Tree(topology),
        layout,
        _push_up(topology, reserve_node),
        reserve_node,
        index,
    )


def _teach(fleet: FleetState, planner: SafetyPlanner, now: float) -> None:
    """What was heard before the planner knew these GPUs (retained statuses arrive first
    after a start, telemetry of new GPUs) teaches it their caps now, in arrival order."""
    by_node: dict[str, dict[str, float]] = {}
    lifts: dict[str, dict[str, float]] = {}
    for g in fleet.gpus.values():
        if g.error is None:
            by_node.setdefault(g.node, {})[g.uuid] = g.cap_w
            if g.set_w is not None:
                lifts.setdefault(g.node, {})[g.uuid] = g.set_w
    for node, caps in by_node.items():
        rec = fleet.nodes[node]
        status = rec.status_caps_w
        if status and not rec.status_newer:
            planner.learn_status(
                node, status, as_of_tick=rec.status_tick, lifts_to_w=rec.status_set_w
            )
        planner.on_telemetry(
            node,
            caps,
            received_at=rec.seen_at or now,
            as_of_tick=rec.tick,
            lifts_to_w=lifts.get(node),
        )
        if status and rec.status_newer:
            planner.learn_status(
                node, status, as_of_tick=rec.status_tick, lifts_to_w=rec.status_set_w
            )
        if rec.state is NodeState.OFFLINE and not rec.stopped:
            planner.node_offline(node)


def _reserve_per_node(
    policy: Policy, fleet: FleetState, topology: Topology, arrays: FleetArrays
) -> FloatArray:
    """Per node group: what its GPUs the policy promises but nobody reported may draw."""
    known = np.bincount(topology.gpu_groups[:, -1], minlength=topology.n_groups)
    expected = np.array([g.gpus for g in policy.groups], dtype=np.float64)
    missing = np.where(topology.level == len(LEVELS) - 1, np.maximum(expected - known, 0.0), 0.0)
    # A GPU not (or no longer) reported counts at the largest maximum its node has shown:
    # of its GPUs now, of those it no longer has, or the policy's default.
    node_max = np.full(topology.n_groups, policy.defaults.gpu.max_cap_w)
    np.maximum.at(node_max, topology.gpu_groups[:, -1], arrays.max_cap_w)
    for k, group in enumerate(policy.groups):
        node_rec = fleet.nodes.get(group.name)
        if node_rec is not None and node_rec.gone_max_cap_w > node_max[k]:
            node_max[k] = node_rec.gone_max_cap_w
    reserve_node = missing * node_max
    for k, caps_w in _stopped_unseen(fleet, topology, missing).items():
        reserve_node[k] -= len(caps_w) * node_max[k] - sum(caps_w)
    return np.asarray(reserve_node, dtype=np.float64)


def _stopped_unseen(
    fleet: FleetState, topology: Topology, missing: FloatArray
) -> dict[int, list[float]]:
    """Per node group: the caps a cleanly stopped node left on GPUs we have no telemetry
    of (retained statuses at a start), the highest `missing` of them. They count at those
    caps instead of the node's maximum: nothing sent can land on a stopped agent."""
    index = {name: k for k, name in enumerate(topology.names)}
    out: dict[int, list[float]] = {}
    for name, rec in fleet.nodes.items():
        k = index.get(name)
        if not rec.stopped or k is None or missing[k] <= 0:
            continue
        lifts = rec.status_set_w
        unseen = [
            max(w, lifts.get(u, w)) for u, w in rec.status_caps_w.items() if u not in fleet.gpus
        ]
        out[k] = sorted(unseen, reverse=True)[: int(missing[k])]
    return out


def _push_up(topology: Topology, per_group: FloatArray) -> FloatArray:
    """Sum a per-group value (set on nodes) up to every ancestor."""
    out = per_group.astype(np.float64, copy=True)
    for i in range(topology.n_groups - 1, 0, -1):
        out[topology.parent[i]] += out[i]
    return out
