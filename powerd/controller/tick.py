"""The tick as a plain object: decoded messages in, a safe plan and its report out.

Each tick: freeze the fleet's arrays (the snapshot), run the allocator (a solver failure
falls back to the failsafe caps, with an alarm: a tick never ends without caps), pass the
targets through the safety planner (cuts at once, raises only within committed budgets,
lease renewals to every live node), and report what it saw and did. Alarms are data
(`powerd.alarms`). No transport, no store and no clock: the daemon (controller.py) hands it
decoded messages and the times, publishes the plan and records the report, and a test
drives it without a broker.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.alarms import Alarms, Severity
from powerd.allocator import Allocation, ClassTable, Fleet, Tree, allocate_arrays, class_names
from powerd.allocator.api import group_values
from powerd.allocator.learn import learner_for
from powerd.allocator.model import build_problem
from powerd.allocator.scopes import DemandCurve, demand_curve
from powerd.controller.fleet import FleetArrays, FleetGpu, FleetState
from powerd.controller.jobs import GpuPlaces, JobView
from powerd.controller.overrides import Overrides
from powerd.controller.why import Decided, WhyFrame, why_frame
from powerd.policy import LEVELS, Policy, overlapping_domains, scoped
from powerd.ramp import BudgetRamp, lead_s
from powerd.safety import FleetLayout, OverloadRule, SafePlan, SafetyPlanner
from powerd.topology import N_LEVELS, Topology
from powerd.wire import (
    CAP_TOLERANCE_W,
    LEGACY_AUTHORITY,
    MAX_TICK,
    Authority,
    CapAck,
    ControllerState,
    ControllerStatus,
    NodeState,
    NodeStatus,
    NodeTelemetry,
)

log = structlog.get_logger(__name__)

# A restarted controller's first tick lies this far above the newest it has heard of: its
# predecessor may have sent ticks nobody reported yet, and agents apply only newer ticks, so
# ours must overtake all of them (ticks are plain numbers: 1,000 is minutes of a run at 1 s).
TAKEOVER_TICK_GAP = 1000
# Points of a scope's demand curve on the wire (exact there, linear in between).
CURVE_POINTS = 256
# GPUs an alarm's message names (the rest are counted), and its stored data lists.
ALARM_NAMES = 5
ALARM_DATA_GPUS = 64

# Above this relative duality gap an allocation is reported as not optimal.
INEXACT_GAP = 1e-4
# Alarms a node's own reports can flip (`cap_overridden`, `cap_restored`) change at most this
# often: a node flapping one GPU's limit every message would otherwise write a raise and a
# clear per tick. The per-GPU metrics and /gpus follow every reading.
ALARM_HOLD_S = 30.0

# The wall clock moved this much against the monotonic one between two ticks: a step.
WALL_STEP_S = 2.0

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True)
class TickReport:
    """What one tick saw and did, for the live view, the API, metrics and the store."""

    tick: int
    ts: float  # wall clock at the tick's start
    duration_ms: float  # tick start → last command published
    solve_ms: float
    plan_ms: float
    status: str  # allocator status, or "fallback"
    solver: str
    objective: float
    group_names: tuple[str, ...]
    group_levels: NDArray[np.int64]
    group_budget_w: FloatArray  # in force (policy ∩ temporary overrides)
    group_committed_w: FloatArray  # committed caps + overhead + reserve for unknown GPUs
    group_draw_w: FloatArray  # measured GPU draw + overhead
    group_over: BoolArray  # committed above budget (a cut not yet obeyed)
    # Above budget only while GPUs count at their maximum until their first ack after a
    # start (docs/safety.md, "Restart"): no breach known, nothing rises there.
    group_settling: BoolArray
    uuids: list[str]
    nodes: list[str]
    # Per GPU, as steered. A tuple: a tuple of strings leaves the garbage collector's view
    # where a list would be walked at every collection.
    classes: tuple[str, ...]
    power_w: FloatArray
    cap_w: FloatArray  # the limit each GPU reported in force (telemetry read-back)
    energy_j: FloatArray
    temp_c: FloatArray
    targets_w: FloatArray
    sent_w: FloatArray  # NaN where the node got no command
    committed_w: FloatArray
    throughput: FloatArray  # per GPU
    stale: BoolArray
    waiting_nodes: tuple[str, ...]
    alarms: tuple[str, ...]
    # What committed caps may reach: the budget, or above it where a group is rated for an
    # overload (OverloadRule); None: the budgets (a tick that fell back).
    group_limit_w: FloatArray | None = None
    # Per GPU: the limit its agent last set (NaN: none known). `cap_w` away from it is a
    # limit powerd did not set (`cap_overridden`); None: a tick that fell back.
    set_w: FloatArray | None = None
    # Room in the root's limit in force (group_limit_w) the allocation left to nobody (W):
    # power no GPU could use (control.leftover: peak leaves what lies past the profiles'
    # peaks); 0 if the root has no budget.
    unused_w: float = 0.0
    # What decided each cap, to explain on request (controller/why.py); None: a failed tick.
    why: WhyFrame | None = None

    @property
    def throughput_total(self) -> float:
        return float(self.throughput.sum())

    def throughput_by_class(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cls, t in zip(self.classes, self.throughput.tolist(), strict=True):
            out[cls] = out.get(cls, 0.0) + t
        return out

    def level_totals(self, level: int) -> list[tuple[str, float, float, float]]:
        """(name, budget, committed, draw) of every group at one level."""
        idx = np.flatnonzero(self.group_levels == level)
        return [
            (
                self.group_names[g],
                float(self.group_budget_w[g]),
                float(self.group_committed_w[g]),
                float(self.group_draw_w[g]),
            )
            for g in idx.tolist()
        ]


@dataclass(frozen=True, slots=True)
class TickSummary:
    """A past tick as the controller remembers it (the API's /ticks without a store): a few
    numbers, not a TickReport's per-GPU arrays, which would make the memory of the last
    ticks grow with the fleet (docs/performance.md, "Steering loop"). The one list of a
    tick's summary fields: the store's TickRecord extends it, the API's TickOut uses its names."""

    tick: int
    ts: float
    status: str
    solver: str
    solve_ms: float
    budget_w: float  # the facility's, in force
    committed_w: float  # the facility's: committed caps + overhead + reserve
    draw_w: float  # the facility's: measured GPU draw + overhead
    throughput: float
    gpus: int
    gpus_stale: int

    @classmethod
    def of(cls, r: TickReport) -> TickSummary:
        return cls(
            tick=r.tick,
            ts=r.ts,
            status=r.status,
            solver=r.solver,
            solve_ms=r.solve_ms,
            budget_w=float(r.group_budget_w[0]),
            committed_w=float(r.group_committed_w[0]),
            draw_w=float(r.group_draw_w[0]),
            throughput=r.throughput_total,
            gpus=len(r.uuids),
            gpus_stale=int(r.stale.sum()),
        )


@dataclass
class Shape:
    """What is rebuilt only when the GPU set, the policy or a clean stop changes."""

    version: tuple[int, int, int]  # fleet GPU set, policy, clean stops
    topology: Topology
    tree: Tree
    layout: FleetLayout
    reserve_w: FloatArray  # per group: unknown GPUs below it counted at their maximum
    # per group: the same, only those of the group itself (nodes): what the allocator
    # takes, adding them up the tree itself
    reserve_own_w: FloatArray
    gpu_index: dict[str, int]  # uuid → position, for explanations (controller/why.py)


class TickEngine:
    """The tick's state and decisions: the fleet as heard, the operators' overrides, the
    safety planner's knowledge, alarms, and one `step` per tick."""

    def __init__(self, policy: Policy, *, solver: str = "fast", shadow: bool = False) -> None:
        self.solver = solver
        # Shadow mode: decide every tick as if commanding, from the caps in force as the
        # agents report them (another controller's, or none), and send nothing.
        self.shadow = shadow
        self.overrides = Overrides()
        self.alarms = Alarms()
        self.tick_no = 0
        self._policy_epoch = 0
        self.shape: Shape | None = None
        self._warm: Allocation | None = None
        self._safety_seen: dict[str, set[str]] = {}
        # The newest tick each node says it applied (statuses, acks): ours must stay above
        # them, or its agent refuses our commands.
        self._node_ticks: dict[str, int] = {}
        # The epoch each node reports (acks, statuses) and the commands it refused for a
        # lower one (statuses): a new leader's epoch must overtake what the agents have seen.
        self._node_epochs: dict[str, int] = {}
        self._node_fenced: dict[str, int] = {}
        # The authority this engine commands for (docs/safety.md, "Authority"); None: none to
        # compare with (the simulator, a shadow). Nodes that obey another one count at their
        # GPUs' maximum (`_foreign`); another authority that our nodes refuse, or another
        # controller that says it leads an overlapping domain, is an alarm that names it.
        self.authority: Authority | None = None
        # The epoch our commands carry (the controller sets it each tick it leads). Within
        # our authority, a node that reports a higher one obeys a newer leader (`_ahead`:
        # counted at its maximum, like a foreign node); an ack of a lower one is an older
        # leader's and resolves none of ours; `superseded_by`: the highest epoch another
        # controller of our authority says it leads at (its retained status).
        self.epoch = 0
        self._ahead: dict[str, int] = {}
        self.superseded_by = 0
        self._foreign: dict[str, Authority] = {}
        self._intruders: dict[str, tuple[Authority, str, int, float]] = {}
        self._rivals: dict[str, ControllerStatus] = {}  # controller id → its status
        self._came_over: dict[str, Authority] = {}  # node → the authority it left (events)
        self._outliers: tuple[str, ...] = ()
        self._message_error: str | None = None
        # GPUs whose agents set their limits back since the last tick (`cap_restored`):
        # uuid → (node, index, found W, set W, times, found at its default limit). Bounded
        # by the fleet's GPUs.
        self._restored: dict[str, tuple[str, int, float, float, int, bool]] = {}
        self._wall = 0.0  # the wall time of the tick in progress (alarm timestamps)
        self._now = 0.0  # its controller time
        self.alarm_hold_s = ALARM_HOLD_S
        self._overridden_at = -math.inf  # when cap_overridden last changed
        self._restored_at = -math.inf  # when cap_restored was last reported
        self.fleet = FleetState(policy)
        # Steering one scope (controller/scope.py): its root group, the coordinator's budget
        # there (None: none), and each tick's demand curve for the coordinator.
        self.scope_name: str | None = None
        self.scope_group = 0
        self.scope_budget_w: float | None = None
        self.last_curve: DemandCurve | None = None
        # What the root's budget holds besides its GPUs' caps: overhead, unknown GPUs' reserve.
        self.curve_offset_w = 0.0
        # A controller may be taking over from one that just died, whose last commands may
        # still land: the planner counts every GPU at its maximum until it acknowledges a
        # command of ours, and our ticks start well above any the old one can have sent.
        self.planner = SafetyPlanner(policy)
        # Budgets in force rise no faster than the policy's ramp (powerd.ramp).
        self.ramp = BudgetRamp()
        self._wall_offset: float | None = None
        # Per group: the budgets of the last tick, and this tick's before any schedule (a
        # ramp's step down is not `budget_over` while the cut that follows it is on its way).
        self._last_budget: dict[str, float] = {}
        self._immediate_w: FloatArray | None = None
        # Telemetry messages heard (of nodes that obey us), and the overload limits of the
        # last tick with the count they were computed at (`_commit_limits`).
        self._heard = 0
        self._last_limit: tuple[int, Shape, FloatArray] | None = None
        self.adopt(policy)

    def set_scope(self, name: str) -> None:
        """Steer only the policy's subtree under `name` (`policy.scoped`), under the
        coordinator's budget there, and compute the scope's demand curve each tick. Every
        policy adopted later is cut to the same scope (ScopeError if it lacks it)."""
        self.scope_name = name
        self.adopt(self.policy)

    def adopt(self, policy: Policy) -> None:
        """Steer by this policy from the next tick."""
        if self.scope_name is not None:
            policy = scoped(policy, self.scope_name)
            self.scope_group = [g.name for g in policy.groups].index(self.scope_name)
        self.policy = policy
        self.overload = OverloadRule.from_policy(policy)
        self.classes = ClassTable.from_policy(policy)
        # Curves learned from reported perf (docs/allocator.md, "Profiles learned online"):
        # a new policy starts learning afresh (its classes, profiles or settings changed).
        self.learner = learner_for(policy)
        self._class_index = {name: i for i, name in enumerate(class_names(policy))}
        self._jobs: JobView | None = None  # compiled at the next tick
        self._job_index_key: tuple[JobView, Shape] | None = None
        self._job_index: NDArray[np.int64] | None = None
        self._places: tuple[Shape, GpuPlaces] | None = None
        self.planner.policy = policy
        self.fleet.set_policy(policy)
        self.overrides.forget_policy_gaps(policy)
        self._policy_epoch += 1
        self._warm = None

    # -- messages (decoded; each returns False for a node the policy does not have) -----

    def on_telemetry(self, msg: NodeTelemetry, now: float) -> bool:
        gpus = self.fleet.gpus
        # Restore counts before this message (a GPU with none reported needs no look-up).
        before = {g.uuid: _restores(gpus.get(g.uuid), msg.node_id) for g in msg.gpus if g.restores}
        if not self.fleet.ingest_telemetry(msg, now):
            return False
        if before:
            self._note_restores(msg, before)
        if msg.node_id in self._foreign:
            return True  # its caps are another authority's: counted at their maximum
        if msg.epoch is not None and msg.epoch > self.epoch > 0:
            self._ahead[msg.node_id] = msg.epoch
            return True
        self._heard += 1
        # A GPU reported with an error carries its last known cap, not a reading.
        caps = {g.uuid: g.cap_w for g in msg.gpus if g.error is None}
        # A tick of an older leader's orders nothing of ours: the reading only widens.
        older = msg.epoch is not None and msg.epoch < self.epoch
        tick = None if older else msg.tick
        self.planner.on_telemetry(msg.node_id, caps, received_at=now, as_of_tick=tick)
        return True

    def _note_restores(self, msg: NodeTelemetry, before: dict[str, int | None]) -> None:
        """GPUs whose agent set a limit found above its own back (its count grew, or began
        again after an agent restart): for this tick's `cap_restored` event. A GPU the
        controller had not heard of yet only sets the count it starts from."""
        node = msg.node_id
        for g in msg.gpus:
            old = before.get(g.uuid)
            rec = self.fleet.gpus.get(g.uuid)
            if old is None or rec is None or rec.node != node or g.restores == old:
                continue
            times = g.restores - old if g.restores > old else g.restores
            prev = self._restored.get(g.uuid)
            total = times + (prev[4] if prev is not None else 0)
            found = g.found_w if g.found_w is not None else g.cap_w
            set_w = g.set_w if g.set_w is not None else g.cap_w
            default = abs(found - g.default_cap_w) <= CAP_TOLERANCE_W
            self._restored[g.uuid] = (node, g.index, found, set_w, total, default)

    def on_ack(self, node: str, ack: CapAck) -> bool:
        if node not in self.fleet.node_order:
            return False
        if not self._obeys_us(node, ack.authority) or not self._our_epoch(node, ack.epoch):
            return True
        # Even an ack of a tick we did not send resolves our commands up to it: the agent
        # applies only newer ticks, so none of them can still land.
        self._tick_seen(node, ack.tick)
        self._epoch_seen(node, ack.epoch)
        self.fleet.ack_heard(node)
        self.planner.on_ack(node, ack.tick, ack.gpus)
        return True

    def on_status(self, node: str, status: NodeStatus) -> bool:
        if node not in self.fleet.node_order:
            return False
        self._note_refusals(node, status)
        self._note_came_over(node, status)
        if not self._obeys_us(node, status.authority) or not self._our_epoch(
            node, status.epoch, status=True
        ):
            self.fleet.ingest_status(status)
            return True
        if status.state is NodeState.STARTING and status.last_tick is None:
            self._node_ticks.pop(node, None)  # a new agent process applies any tick
        elif status.last_tick is not None:
            self._tick_seen(node, status.last_tick)
        self._epoch_seen(node, status.epoch)
        self._node_fenced[node] = status.fenced
        self.fleet.ingest_status(status)
        if status.state is NodeState.OFFLINE and not status.caps_w:
            self.planner.node_offline(node)
        elif status.caps_w:  # a clean stop's `offline` too: the caps it left in force
            # The ticks of an older leader's order nothing of ours: as readings, they widen.
            tick = None if status.epoch < self.epoch else status.last_tick
            self.planner.learn_status(node, status.caps_w, as_of_tick=tick)
        return True

    def _obeys_us(self, node: str, authority: Authority | None) -> bool:
        """Whether a node's message speaks for the authority we command for; a node that
        obeys another is foreign until it says otherwise. None: an agent that obeys nobody
        yet (or an older agent), which any command of ours may still take."""
        ours = self.authority
        if ours is None or authority is None or authority in (ours, LEGACY_AUTHORITY):
            if self._foreign.pop(node, None) is not None:
                log.warning("node_obeys_us_again", node=node)
            return True
        if self._foreign.get(node) != authority:
            log.warning("node_obeys_another_authority", node=node, authority=authority.label())
        self._foreign[node] = authority
        return False

    def _our_epoch(self, node: str, epoch: int, *, status: bool = False) -> bool:
        """Whether a node's ack (or status) of `epoch` is news of our commands. A higher
        epoch: the node obeys a newer leader of our authority (fenced away from us; counted
        at its maximum: one node's word moves nothing else). A lower one: an older leader's
        ack, which resolves none of ours (its ticks may even run above ours); a status of
        a lower epoch still tells the caps in force, as readings."""
        ours = self.epoch
        if ours in (0, epoch):
            self._ahead.pop(node, None)
            return True
        if epoch > ours:
            self._ahead[node] = epoch
            return False
        self._ahead.pop(node, None)
        return status

    def _note_came_over(self, node: str, status: NodeStatus) -> None:
        """A node that obeys us now and obeyed another authority before (after that one's
        silence, or a handover): an event naming the one it left, once per change."""
        prev = status.previous_authority
        ours = self.authority
        if ours is None or status.authority != ours or prev in (None, LEGACY_AUTHORITY, ours):
            return
        assert prev is not None
        if self._came_over.get(node) == prev:
            return
        self._came_over[node] = prev
        self.alarms.once(
            "authority_changed",
            f"node {node} now obeys this controller; it obeyed {prev.label()} before",
            self._wall,
            severity=Severity.WARNING,
            data={"node": node, "previous": prev.model_dump()},
        )

    def _note_refusals(self, node: str, status: NodeStatus) -> None:
        """Another authority that a node of ours refuses (its refusals grew): an intruder."""
        other = status.refused_authority
        if self.authority is None or other is None or other == self.authority:
            return
        seen = self._intruders.get(node)
        if seen is None or status.refused > seen[2]:
            self._intruders[node] = (other, status.refused_controller, status.refused, self._now)

    def on_controller_status(self, controller_id: str, status: ControllerStatus) -> None:
        """Another controller's retained status: one that leads (or would) for another
        authority over an overlapping domain is a rival, alarmed by name."""
        ours = self.authority
        other = status.authority
        if ours is not None and other == ours:
            self._rivals.pop(controller_id, None)
            if status.state is ControllerState.ACTIVE and status.epoch is not None:
                # A newer leader of our own authority: a leader steering through a
                # database outage stops here (docs/safety.md).
                self.superseded_by = max(self.superseded_by, status.epoch)
            return
        if ours is None or other is None:
            self._rivals.pop(controller_id, None)
            return
        domains = {ours.domain, *overlapping_domains(self.policy, ours.domain)}
        overlaps = other.site == ours.site and other.domain in domains
        if status.state is ControllerState.ACTIVE and overlaps:
            self._rivals[controller_id] = status
        else:
            self._rivals.pop(controller_id, None)

    def foreign_nodes(self) -> dict[str, Authority]:
        return dict(self._foreign)

    def _count_foreign(self) -> None:
        """Before planning: nodes that obey another authority, or a newer leader of ours,
        count at their maximum."""
        for node, epoch in list(self._ahead.items()):
            if epoch <= self.epoch:  # we lead at that epoch (or above) now
                del self._ahead[node]
        for node in (*self._foreign, *self._ahead):
            self.planner.node_foreign(node)
        if self.overrides.handover:
            # Handing over: the successor may command any node from its first command on.
            self.planner.count_at_max()

    def message_failed(self, error: str) -> None:
        """A message hit a fault of ours: the next tick raises an event with the last such."""
        self._message_error = error[:300]

    def _tick_seen(self, node: str, tick: int) -> None:
        self._node_ticks[node] = max(self._node_ticks.get(node, 0), tick)

    def _epoch_seen(self, node: str, epoch: int) -> None:
        self._node_epochs[node] = max(self._node_epochs.get(node, 0), epoch)

    def agents_epoch(self) -> int:
        """The epoch the agents have seen: the median over *every* node of the policy (one
        that reported none counts as 0), so no minority of nodes can push a leader's epoch
        where it likes (as with ticks, `_next_tick`)."""
        epochs = sorted(self._node_epochs.get(n, 0) for n in self.fleet.node_order)
        return epochs[len(epochs) // 2] if epochs else 0

    def fenced_total(self) -> int:
        """Commands the agents say they refused for a lower epoch, summed over the nodes."""
        return sum(self._node_fenced.values())

    def _next_tick(self) -> int:
        """Our next tick: above every tick the nodes say they applied, with room for any a
        predecessor sent that nobody reported (first tick, or when we fall behind: a
        controller that ticked before hearing its agents).

        A node cannot push our ticks where it likes: a tick more than TAKEOVER_TICK_GAP
        above the median over *every* node of the policy (a node that reported none counts
        as 0) is not followed. A predecessor sends all nodes the same ticks, so honest nodes
        agree; the outlier's agent refuses our commands and stays at its failsafe caps, and
        it is alarmed (`tick_outliers`)."""
        ticks = [self._node_ticks.get(n, 0) for n in self.fleet.node_order]
        ceiling = sorted(ticks)[len(ticks) // 2] + TAKEOVER_TICK_GAP if ticks else 0
        self._outliers = tuple(sorted(n for n, t in self._node_ticks.items() if t > ceiling))
        needed = max((t for t in ticks if t <= ceiling), default=0)
        tick = self.tick_no + 1
        if needed >= tick:
            if self.tick_no:
                log.warning("ticks_behind", ours=self.tick_no, theirs=needed)
            # A majority claiming absurd ticks still leaves half the tick space to run in.
            tick = max(tick, min(needed + TAKEOVER_TICK_GAP, MAX_TICK // 2))
        return tick

    # -- the tick ------------------------------------------------------------------------

    def _shape_for(self, arrays: FleetArrays, now: float) -> Shape:
        version = (self.fleet.version, self._policy_epoch, self.fleet.stops)
        if self.shape is not None and self.shape.version == version:
            return self.shape
        topology = Topology.build(self.policy, arrays.nodes)
        layout = FleetLayout.build(
            self.policy, arrays.uuids, arrays.nodes, arrays.min_cap_w, arrays.max_cap_w
        )
        self.planner.set_layout(layout)
        # What was heard before the planner knew these GPUs (retained statuses arrive first
        # after a start, telemetry of new GPUs) teaches it their caps now, in arrival order.
        by_node: dict[str, dict[str, float]] = {}
        for g in self.fleet.gpus.values():
            if g.error is None:
                by_node.setdefault(g.node, {})[g.uuid] = g.cap_w
        for node, caps in by_node.items():
            rec = self.fleet.nodes[node]
            status = rec.status_caps_w
            if status and not rec.status_newer:
                self.planner.learn_status(node, status, as_of_tick=rec.status_tick)
            self.planner.on_telemetry(
                node, caps, received_at=rec.seen_at or now, as_of_tick=rec.tick
            )
            if status and rec.status_newer:
                self.planner.learn_status(node, status, as_of_tick=rec.status_tick)
            if rec.state is NodeState.OFFLINE and not rec.stopped:
                self.planner.node_offline(node)
        known = np.bincount(topology.gpu_groups[:, -1], minlength=topology.n_groups)
        expected = np.array([g.gpus for g in self.policy.groups], dtype=np.float64)
        missing = np.where(
            topology.level == len(LEVELS) - 1, np.maximum(expected - known, 0.0), 0.0
        )
        # A GPU not (or no longer) reported counts at the largest maximum its node has shown:
        # of its GPUs now, of those it no longer has, or the policy's default.
        node_max = np.full(topology.n_groups, self.policy.defaults.gpu.max_cap_w)
        np.maximum.at(node_max, topology.gpu_groups[:, -1], arrays.max_cap_w)
        for k, group in enumerate(self.policy.groups):
            node_rec = self.fleet.nodes.get(group.name)
            if node_rec is not None and node_rec.gone_max_cap_w > node_max[k]:
                node_max[k] = node_rec.gone_max_cap_w
        reserve_node = missing * node_max
        for k, caps_w in self._stopped_unseen(topology, missing).items():
            reserve_node[k] -= len(caps_w) * node_max[k] - sum(caps_w)
        reserve = _push_up(topology, reserve_node)
        index = {u: i for i, u in enumerate(layout.uuids)}
        self.shape = Shape(version, topology, Tree(topology), layout, reserve, reserve_node, index)
        self._warm = None
        return self.shape

    def _stopped_unseen(self, topology: Topology, missing: FloatArray) -> dict[int, list[float]]:
        """Per node group: the caps a cleanly stopped node left on GPUs we have no telemetry
        of (retained statuses at a start), the highest `missing` of them. They count at those
        caps instead of the node's maximum: nothing sent can land on a stopped agent."""
        index = {name: k for k, name in enumerate(topology.names)}
        out: dict[int, list[float]] = {}
        for name, rec in self.fleet.nodes.items():
            k = index.get(name)
            if not rec.stopped or k is None or missing[k] <= 0:
                continue
            unseen = [w for u, w in rec.status_caps_w.items() if u not in self.fleet.gpus]
            out[k] = sorted(unseen, reverse=True)[: int(missing[k])]
        return out

    def observe(self, now: float) -> None:
        """A standby's tick: keep the view warm without deciding or sending anything. The
        fleet's shape is built and the planner folds in what it heard (caps in force from
        telemetry, statuses and the leader's acks), so a takeover's first tick commands at
        once from the caps in force.

        A standby commands nothing, so no epoch is ours: the leader's messages are news of
        the caps in force (a standby that led before must not take the epoch it led at for
        its own, or it would take the leader's nodes for a newer leader's and hear none
        of them)."""
        self.epoch = 0
        self._ahead.clear()
        control = self.policy.control
        if self.fleet.forget(now, control.forget_after_s, dispute_s=control.stale_after_s):
            self.shape = None
        arrays = self.fleet.arrays(now, control.stale_after_s)
        if not arrays.uuids:
            return
        self._shape_for(arrays, now)
        self.planner.committed_w()  # folds the queued messages in

    def step(self, now: float, wall: float) -> tuple[TickReport, SafePlan]:
        """One tick's decisions at monotonic time `now` and wall time `wall`.

        A tick never ends without caps: a fault anywhere in it falls back to the failsafe
        caps through the safety planner (cuts at once, raises only where they fit), alarms
        `tick_failed`, and the next tick tries again.
        """
        t0 = time.perf_counter()
        self._wall = wall
        self._now = now
        # Agents apply only ticks above the last they applied: a restarted controller
        # continues above every tick it has seen acknowledged or reported, with room for
        # any its predecessor sent that nobody has reported yet.
        self.tick_no = self._next_tick()
        tick = self.tick_no
        self._alarm_inputs()
        self._watch_wall_clock(now, wall)
        planned: list[SafePlan] = []
        try:
            report, plan = self._decide(tick, now, wall, t0, planned)
        except Exception as exc:
            log.exception("tick_failed", tick=tick)
            self._alarm("tick_failed", f"tick {tick}: {type(exc).__name__}: {exc}"[:300])
            return self._fallback(tick, now, wall, t0, planned)
        self._alarm("tick_failed", None)
        return report, plan

    def _watch_wall_clock(self, now: float, wall: float) -> None:
        """An event when the wall clock steps against the monotonic one: scheduled budgets
        then bind on both readings (docs/safety.md, "Ramps"), which an operator should know."""
        offset = wall - now
        last, self._wall_offset = self._wall_offset, offset
        if last is not None and abs(offset - last) > WALL_STEP_S:
            log.warning("wall_clock_step", step_s=round(offset - last, 3))
            self.alarms.once(
                "wall_clock_step",
                f"the wall clock stepped {offset - last:+.1f} s; scheduled budgets bind on "
                "both the wall and the monotonic reading of their windows",
                wall,
            )

    def _alarm_inputs(self) -> None:
        """Alarms about what nodes sent: faults of a node, not of a tick."""
        fleet = self.fleet
        refused = sorted(n for n, rec in fleet.nodes.items() if rec.refused)
        self._alarm(
            "gpus_beyond_inventory",
            None
            if not refused
            else "telemetry names more GPUs than the policy gives "
            + ", ".join(f"{n} ({fleet.nodes[n].refused} refused)" for n in refused[:5]),
        )
        disputes = sorted(fleet.disputes.values(), key=lambda d: d.uuid)
        self._alarm(
            "gpu_claimed_twice",
            None
            if not disputes
            else "GPU uuids named by more than one node (steered by none, counted at their "
            "maximum): "
            + ", ".join(f"{d.uuid} ({', '.join(sorted(d.seen))})" for d in disputes[:5]),
        )
        offline = fleet.offline_nodes()
        lost = [n for n in offline if not fleet.nodes[n].stopped]
        stopped = [n for n in offline if fleet.nodes[n].stopped]
        parts = []
        if lost:
            parts.append(
                "counted at their GPUs' maximum until they report: " + ", ".join(lost[:10])
            )
        if stopped:
            parts.append("stopped, counted at the caps they left: " + ", ".join(stopped[:10]))
        self._alarm("nodes_offline", "; ".join(parts) or None)
        self._alarm(
            "tick_outliers",
            None
            if not self._outliers
            else "nodes claiming ticks far above the others (not followed; their agents "
            "refuse our commands and stay at failsafe): " + ", ".join(self._outliers[:10]),
        )
        self._alarm_authority()
        error, self._message_error = self._message_error, None
        if error is not None:
            self.alarms.once("message_failed", error, self._wall)
        self._event_restores()

    def _alarm_authority(self) -> None:
        """Hosts that disagree about who commands (docs/safety.md, "Authority"), by name."""
        foreign = [(n, a.label()) for n, a in sorted(self._foreign.items())]
        foreign += [(n, f"a newer leader, epoch {e}") for n, e in sorted(self._ahead.items())]
        self._alarm(
            "foreign_authority",
            None
            if not foreign
            else f"{len(foreign)} nodes obey another authority and count at their GPUs' "
            "maximum: " + ", ".join(f"{n} ({a})" for n, a in foreign[:ALARM_NAMES]),
        )
        recent = self.policy.control.lease_s * 3
        others: dict[tuple[Authority, str], list[str]] = {}
        for node, (auth, ctl, _, at) in sorted(self._intruders.items()):
            if self._now - at <= recent:
                others.setdefault((auth, ctl), []).append(node)
        for cid, st in sorted(self._rivals.items()):
            if st.authority is not None:
                others.setdefault((st.authority, cid), [])
        self._alarm(
            "authority_conflict",
            None
            if not others
            else "another authority commands (or leads) over our domain: "
            + "; ".join(
                f"controller {ctl!r} ({a.label()})"
                + (f", refused by {len(nodes)} of our nodes" if nodes else ", says it leads")
                for (a, ctl), nodes in list(others.items())[:ALARM_NAMES]
            ),
        )

    def _event_restores(self) -> None:
        """One event for the limits agents found above their own and set back: each tick,
        or merged over `alarm_hold_s` after the last one (counts add up meanwhile)."""
        if not self._restored or self._now - self._restored_at < self.alarm_hold_s:
            return
        restored, self._restored = self._restored, {}
        self._restored_at = self._now
        rows = sorted(restored.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
        named = "; ".join(
            f"{node} GPU {index} ({uuid}): {found:g} W found"
            + (" (its default limit)" if default else "")
            + f", set back to {set_w:g} W"
            + (f" ({times} times)" if times > 1 else "")
            for uuid, (node, index, found, set_w, times, default) in rows[:ALARM_NAMES]
        )
        more = f"; and {len(rows) - ALARM_NAMES} more GPUs" if len(rows) > ALARM_NAMES else ""
        self.alarms.once(
            "cap_restored",
            "limits above the caps powerd set, set back by their agents (at a GPU's default "
            f"limit: a GPU reset, a driver reload or a reboot; else another tool): {named}{more}",
            self._wall,
            severity=Severity.WARNING,
            data={
                "gpus": [
                    {
                        "node": node,
                        "uuid": uuid,
                        "index": index,
                        "found_w": found,
                        "set_w": set_w,
                        "times": times,
                        "default_limit": default,
                    }
                    for uuid, (node, index, found, set_w, times, default) in rows[:ALARM_DATA_GPUS]
                ],
                "count": len(rows),
            },
        )

    def _alarm_overridden(self, arrays: FleetArrays) -> None:
        """`cap_overridden`: GPUs whose enforced limit, at their latest reading, differs
        from the one their agent set (another tool, an out-of-band limit, a set the device
        did not take), either way. Raised again when the set of GPUs changes, cleared when
        none is left; at most one change per `alarm_hold_s` (a change meanwhile waits)."""
        set_w = arrays.set_w
        if set_w is None:
            return
        with np.errstate(invalid="ignore"):
            differ = np.flatnonzero(np.abs(arrays.cap_w - set_w) > CAP_TOLERANCE_W)
        wanted = tuple(arrays.uuids[i] for i in differ.tolist())
        if self.alarms.subjects("cap_overridden") != (
            wanted or None
        ):  # a raise, a clear or another set of GPUs
            if self._now - self._overridden_at < self.alarm_hold_s:
                return  # changed too recently: this change waits
            self._overridden_at = self._now
        if not len(differ):
            self._alarm("cap_overridden", None)
            return
        rows = [
            (arrays.nodes[i], self.fleet.gpus[arrays.uuids[i]].index, arrays.uuids[i], i)
            for i in differ.tolist()
        ]
        cap, want = arrays.cap_w, set_w
        named = "; ".join(
            f"{node} GPU {index} ({uuid}): enforced {cap[i]:g} W, powerd set {want[i]:g} W"
            for node, index, uuid, i in rows[:ALARM_NAMES]
        )
        more = f"; and {len(rows) - ALARM_NAMES} more GPUs" if len(rows) > ALARM_NAMES else ""
        self.alarms.set(
            "cap_overridden",
            f"GPU limits differ from the caps powerd set: {named}{more}",
            self._wall,
            subjects=tuple(uuid for _, _, uuid, _ in rows),
            data={
                "gpus": [
                    {
                        "node": node,
                        "uuid": uuid,
                        "index": index,
                        "enforced_w": float(cap[i]),
                        "set_w": float(want[i]),
                    }
                    for node, index, uuid, i in rows[:ALARM_DATA_GPUS]
                ],
                "count": len(rows),
            },
        )

    def _fallback(
        self, tick: int, now: float, wall: float, t0: float, planned: list[SafePlan]
    ) -> tuple[TickReport, SafePlan]:
        """The tick's plan when its decision failed: the plan if it was made, else the
        failsafe caps through the planner, under the budgets in force."""
        layout = self.planner.layout
        if layout is None:
            raise RuntimeError("no fleet to steer yet")  # nothing was ever sent: nothing to hold
        topo = layout.topology
        if planned:
            plan = planned[0]
        else:
            try:
                budget_w = self.ramp.hold(topo.names, self._budgets_in_force(topo, now, wall))
            except Exception:
                log.exception("fallback_budgets_failed", tick=tick)
                budget_w = np.zeros(topo.n_groups)  # nothing may rise
            self._count_foreign()
            plan = self.planner.plan(
                tick,
                now,
                layout.failsafe_w.copy(),
                budget_w=budget_w,
                offline=self.fleet.offline_nodes(),
            )
        n = layout.n_gpus
        nan = np.full(n, np.nan)
        report = TickReport(
            tick=tick,
            ts=wall,
            duration_ms=(time.perf_counter() - t0) * 1000.0,
            solve_ms=0.0,
            plan_ms=0.0,
            status="tick_failed",
            solver=self.solver,
            objective=math.nan,
            group_names=topo.names,
            group_levels=topo.level,
            group_budget_w=plan.group_budget_w,
            group_committed_w=plan.group_committed_w,
            group_draw_w=np.full(topo.n_groups, np.nan),
            group_over=plan.group_over,
            group_settling=plan.group_settling,
            uuids=list(layout.uuids),
            nodes=list(layout.nodes),
            classes=tuple(self.policy.defaults.class_ for _ in range(n)),
            power_w=nan,
            cap_w=nan,
            energy_j=nan,
            temp_c=nan,
            targets_w=layout.failsafe_w.copy(),
            sent_w=plan.sent_w,
            committed_w=plan.committed_w,
            throughput=np.zeros(n),
            stale=plan.stale,
            waiting_nodes=plan.waiting_nodes,
            alarms=tuple(sorted(self.alarms.active)),
        )
        return report, plan

    def _commit_limits(
        self,
        topo: Topology,
        budget_w: FloatArray,
        committed: FloatArray,
        arrays: FleetArrays,
        shape: Shape,
    ) -> FloatArray:
        """Per group, what committed caps may reach (OverloadRule): the budget, unless the
        group is rated. Draw and committed count alike: overhead, the reserve for GPUs not
        heard, and GPUs without fresh telemetry at their committed caps."""
        rule = self.overload
        if rule is None:
            return budget_w
        fresh = ~arrays.stale & np.isfinite(arrays.power_w)
        power = np.where(fresh, arrays.power_w, committed)
        base = topo.overhead_w + shape.reserve_w
        limit = rule.limits_w(
            budget_w, topo.group_sums(committed) + base, topo.group_sums(power) + base
        )
        # The room between draw and target is granted once per reading: a tick that heard
        # no telemetry since the last one (ticks faster than the agents report) would
        # otherwise grant the same room again on top of what it already committed.
        last = self._last_limit
        if last is not None and last[0] == self._heard and last[1] is shape:
            limit = np.maximum(np.minimum(limit, last[2]), budget_w)
        self._last_limit = (self._heard, shape, limit)
        return limit

    def _budgets_in_force(
        self, topo: Topology, now: float, wall: float, most_w: FloatArray | None = None
    ) -> FloatArray:
        """Per group: the policy's budget, or a lower temporary one (expired ones end here),
        or a scheduled one's ramp, or at a scope's root the coordinator's if lower. Given
        `most_w` (what each group's committed caps could reach), a rise is ramped at the
        policy's rate (powerd.ramp): the ramp's state moves only then."""
        budgets = self.overrides.active_budgets(self.policy, wall, now)
        out = group_values(topo, budgets, topo.budget_w) if budgets else topo.budget_w
        self._immediate_w = out
        control = self.policy.control
        scheduled = self.overrides.scheduled_budgets(self.policy, now, wall, lead_s(control.tick_s))
        if scheduled:
            out = np.minimum(out, group_values(topo, scheduled, np.full(topo.n_groups, np.inf)))
        if most_w is not None:
            out = self.ramp.step(topo.names, out, now, control.ramp_w_per_s, most_w)
        if self.scope_name is not None and self.scope_budget_w is not None:
            g = self.scope_group
            if self.scope_budget_w < out[g]:
                out = out.copy()
                out[g] = self.scope_budget_w
                self._immediate_w = np.minimum(self._immediate_w, out)
        return out

    def _decide(
        self, tick: int, now: float, wall: float, t0: float, planned: list[SafePlan]
    ) -> tuple[TickReport, SafePlan]:
        control = self.policy.control
        # A dispute ends once one node alone has named the uuid for a stale period: a single
        # spoofed message costs seconds of steering of those GPUs, not forget_after_s.
        if self.fleet.forget(now, control.forget_after_s, dispute_s=control.stale_after_s):
            self.shape = None
        arrays = self.fleet.arrays(now, control.stale_after_s)
        shape = self._shape_for(arrays, now)
        topo = shape.topology
        self._alarm_overridden(arrays)

        most_w = topo.group_sums(arrays.max_cap_w) + topo.overhead_w + shape.reserve_w
        budget_w = self._budgets_in_force(topo, now, wall, most_w)
        jobs = self._job_view()
        job_idx = self._job_indices(jobs, arrays, shape)
        cls_idx = self._class_indices(arrays)
        if job_idx is not None:  # a job's GPUs steer as its class (or its own)
            cls_idx = np.where(job_idx >= 0, jobs.job_class[job_idx], cls_idx)
        pinned = self._pinned(arrays)
        if self.learner is not None:
            self._learn(now, arrays, cls_idx, shape.topology.gpu_groups[:, N_LEVELS - 1])
        committed_before = self.planner.committed_w()
        # What the caps may commit: the budgets, or above them where a group is rated for
        # an overload and its GPUs do not draw their reservation (docs/safety.md).
        limit_w = self._commit_limits(topo, budget_w, committed_before, arrays, shape)
        # GPUs we cannot steer keep the power they may have, and the allocator shares out
        # the rest: one that refused its last cap.
        held = self.planner.defiant()
        if held.any():
            pinned = np.where(held, np.minimum(committed_before, arrays.max_cap_w), pinned)
        fleet = Fleet(
            uuids=tuple(arrays.uuids),
            topology=topo,
            min_cap_w=arrays.min_cap_w,
            max_cap_w=arrays.max_cap_w,
            power_w=arrays.power_w,
            # The damping term steers toward the caps that may be in force.
            cap_w=np.minimum(committed_before, arrays.max_cap_w),
            class_index=cls_idx,
            stale=arrays.stale,
            pinned_w=pinned,
            job_index=job_idx,
            job_names=jobs.names,
        )
        targets, status, objective, solve_ms, unused_w = self._allocate(tick, fleet, limit_w, shape)
        alloc = self._warm  # this tick's allocation; None when the solver failed
        if self.scope_name is not None:
            self.last_curve = self._curve(fleet, budget_w, shape)
        if held.any():
            targets = np.where(held, np.nan, targets)  # NaN: hold the committed cap
        solver = self.solver
        self._alarm(
            "infeasible_min",
            "device minimums exceed a budget" if status == "infeasible_min" else None,
        )
        self._alarm(
            "floors_dropped",
            "class floors dropped to fit a budget" if status == "floors_dropped" else None,
        )

        t_plan = time.perf_counter()
        offline = self.fleet.offline_nodes()
        weights = self.classes.weight[cls_idx]
        if self.shadow:
            # Nothing is sent, so nothing of ours or a predecessor's is on its way: the caps
            # in force are what the agents report.
            self.planner.assume_settled()
        self._count_foreign()
        plan = self.planner.plan(
            tick,
            now,
            targets,
            budget_w=limit_w,
            reserve_w=shape.reserve_w,
            priority=weights,
            offline=offline,
            record=not self.shadow,
            jobs=job_idx,  # a job's GPUs rise together or wait
        )
        planned.append(plan)
        plan_ms = (time.perf_counter() - t_plan) * 1000.0
        self._log_safety_events(plan)
        # Over only while GPUs count at their maximum until a first ack (after a start) is
        # no breach known: nothing rises there meanwhile. A rated group whose limit fell
        # (its draw neared the budget) is cutting, not over, while within its rating.
        over = plan.group_over & ~plan.group_settling
        over &= plan.group_committed_w > self._ramp_grace_w(topo, budget_w) + 1e-6
        if self.overload is not None:
            rating = self.overload.ratings_w(budget_w)
            over &= ~((self.overload.pct > 0) & (plan.group_committed_w <= rating + 1e-6))
        refusing = np.flatnonzero(held)
        self._alarm(
            "caps_refused",
            None
            if not len(refusing)
            else "GPUs refuse their caps (others cut to make room): "
            + ", ".join(arrays.uuids[i] for i in refusing[:5].tolist()),
        )
        self._alarm(
            "budget_over",
            None
            if not over.any()
            else "committed caps above budget at "
            + ", ".join(topo.names[g] for g in np.flatnonzero(over)[:5]),
        )

        throughput = self._throughput(arrays, cls_idx)
        draw = topo.group_sums(arrays.power_w) + topo.overhead_w
        try:
            decided = Decided(
                tick,
                wall,
                status,
                solver,
                targets,
                budget_w,
                limit_w,
                fleet.cap_w,
                held,
                offline,
                control.slew_w,
            )
            why: WhyFrame | None = why_frame(
                decided,
                fleet=fleet,
                arrays=arrays,
                index=shape.gpu_index,
                alloc=alloc,
                plan=plan,
                planner=self.planner,
                classes=self.classes,
                drained=self.overrides.drained,
                node_seq={n: rec.seq for n, rec in self.fleet.nodes.items()},
            )
        except Exception:  # an explanation never costs a tick its caps
            log.exception("why_frame_failed", tick=tick)
            why = None
        report = TickReport(
            tick=tick,
            ts=wall,
            duration_ms=(time.perf_counter() - t0) * 1000.0,
            solve_ms=solve_ms,
            plan_ms=plan_ms,
            status=status,
            solver=solver,
            objective=objective,
            group_names=topo.names,
            group_levels=topo.level,
            group_budget_w=np.asarray(budget_w, dtype=np.float64),
            group_committed_w=plan.group_committed_w,
            group_draw_w=draw,
            group_limit_w=np.asarray(limit_w, dtype=np.float64),
            unused_w=unused_w,
            group_over=over,
            group_settling=plan.group_settling,
            uuids=arrays.uuids,
            nodes=arrays.nodes,
            classes=tuple([jobs.labels[i] for i in cls_idx.tolist()]),
            power_w=arrays.power_w,
            cap_w=arrays.cap_w,
            energy_j=arrays.energy_j,
            temp_c=arrays.temp_c,
            targets_w=targets,
            sent_w=plan.sent_w,
            committed_w=plan.committed_w,
            throughput=throughput,
            stale=plan.stale,
            waiting_nodes=plan.waiting_nodes,
            alarms=tuple(sorted(self.alarms.active)),
            set_w=arrays.set_w,
            why=why,
        )
        return report, plan

    def _job_view(self) -> JobView:
        """The jobs compiled against the policy; recompiled when either changed (jobs are
        replaced, never changed in place, so identity says). The allocator's classes are
        the view's: the policy's and those made for jobs with their own profile."""
        jobs = self.overrides.jobs
        view = self._jobs
        if view is None or view.jobs is not jobs:
            view = self._jobs = JobView.compile(self.policy, jobs)
            learned = None if self.learner is None else self.learner.profiles()
            # Jobs' own classes keep their own curves; learned ones replace the policy's.
            self.classes = ClassTable.from_policy(view.policy, learned) if learned else view.classes
            self._job_index_key = None
        return view

    def _allocator_policy(self) -> Policy:
        """The policy with the classes made for jobs with their own profile."""
        return self.policy if self._jobs is None else self._jobs.policy

    def _job_indices(
        self, view: JobView, arrays: FleetArrays, shape: Shape
    ) -> NDArray[np.int64] | None:
        """Per GPU its job (-1: none), rebuilt only when the jobs or the GPU set change."""
        key = self._job_index_key
        if key is None or key[0] is not view or key[1] is not shape:
            if not view.names:
                self._job_index = None
            else:
                if self._places is None or self._places[0] is not shape:
                    self._places = (shape, GpuPlaces.build(arrays.uuids, shape.topology))
                self._job_index = view.index(self._places[1])
            self._job_index_key = (view, shape)
        return self._job_index

    def _learn(
        self,
        now: float,
        arrays: FleetArrays,
        cls_idx: NDArray[np.int64],
        node_of: NDArray[np.int64],
    ) -> None:
        """Samples every tick, a refit every `refit_ticks`: the allocator steers by the
        learned curves that pass the rules, by the policy's profiles elsewhere. Each sample
        keeps its node (`node_of`, per GPU): one node's perf cannot bend a curve alone."""
        learner = self.learner
        assert learner is not None
        try:
            learner.observe(
                now,
                cls_idx,
                arrays.power_w,
                arrays.perf,
                ~arrays.stale,
                min_w=arrays.min_cap_w,
                source=node_of,
            )
            if learner.due() and learner.refit_next(now):
                self.classes = ClassTable.from_policy(self._allocator_policy(), learner.profiles())
                log.info("learned_profiles", in_use=sorted(learner.profiles()))
        except Exception:
            # Learning is an optimisation: a fault in it never costs a tick its caps.
            log.exception("learning_failed", tick=self.tick_no)

    def _ramp_grace_w(self, topo: Topology, budget_w: FloatArray) -> FloatArray:
        """Per group, what committed caps may still be while a ramp's step down is on its way:
        last tick's budget where only a schedule's ramp lowered it since (an immediate cut
        gets no grace: `budget_over` until its acks, as ever)."""
        last = np.fromiter(
            (self._last_budget.get(n, -np.inf) for n in topo.names),
            dtype=np.float64,
            count=topo.n_groups,
        )
        self._last_budget = dict(zip(topo.names, budget_w.tolist(), strict=True))
        immediate = budget_w if self._immediate_w is None else self._immediate_w
        return np.maximum(budget_w, np.minimum(last, immediate))

    def _class_indices(self, arrays: FleetArrays) -> NDArray[np.int64]:
        """Each GPU's class: the operator's assignment, else its workload's, else the default
        (a workload naming a class the policy lacks also gets the default)."""
        index = self._class_index
        default = index[self.policy.defaults.class_]
        classes = (
            self.overrides.class_of(u, node, w)
            for u, node, w in zip(arrays.uuids, arrays.nodes, arrays.workloads, strict=True)
        )
        return np.fromiter(
            (default if c is None else index.get(c, default) for c in classes),
            dtype=np.int64,
            count=len(arrays.uuids),
        )

    def _pinned(self, arrays: FleetArrays) -> FloatArray:
        """Fixed caps (pinned GPUs, drained nodes); NaN where the allocator is free."""
        n = len(arrays.uuids)
        if not (self.overrides.pins or self.overrides.drained):
            return np.full(n, np.nan)
        rows = zip(
            arrays.uuids,
            arrays.nodes,
            arrays.min_cap_w.tolist(),
            arrays.max_cap_w.tolist(),
            strict=True,
        )
        fixed = (self.overrides.pinned_w(u, node, lo, hi) for u, node, lo, hi in rows)
        return np.fromiter((np.nan if f is None else f for f in fixed), dtype=np.float64, count=n)

    def _allocate(
        self, tick: int, fleet: Fleet, budget_w: FloatArray, shape: Shape
    ) -> tuple[FloatArray, str, float, float, float]:
        """(targets, status, objective, solve_ms, unused_w); any solver failure steers to the
        failsafe caps with an alarm, so a tick never ends without caps."""
        try:
            alloc = allocate_arrays(
                fleet,
                self._allocator_policy(),
                self.solver,
                budget_w=budget_w,
                # Its own, not the sums: the allocator adds them up the tree (given the
                # sums, it counted a node's missing GPUs at every level twice or more, and
                # one node with unknown GPUs above its budget put the whole site at minimum).
                reserved_w=shape.reserve_own_w,
                warm=self._warm,
                classes=self.classes,
                tree=shape.tree,
            )
        except Exception as exc:
            log.exception("allocation_failed", tick=tick, solver=self.solver)
            self._alarm("solver_failed", f"{type(exc).__name__}: {exc}"[:300])
            self._warm = None
            return shape.layout.failsafe_w.copy(), "fallback", math.nan, 0.0, 0.0
        self._warm = alloc
        self._alarm("solver_failed", None)
        # With jobs the solver certifies how close it came (Allocation.gap); say so when it
        # stopped short, so nobody reads the caps as optimal.
        self._alarm(
            "allocation_inexact",
            f"caps within {alloc.gap:.2%} of the optimum (jobs: solver stopped short)"
            if alloc.gap > INEXACT_GAP
            else None,
        )
        return alloc.caps_w, alloc.status, alloc.objective, alloc.solve_ms, alloc.unused_w

    def _curve(self, fleet: Fleet, budget_w: FloatArray, shape: Shape) -> DemandCurve | None:
        """The scope's demand curve: the allocation's problem with the root's own budget
        lifted (the coordinator decides it), seen from the root. None if it fails (the
        coordinator then holds this scope's budget)."""
        try:
            lifted = budget_w.copy()
            lifted[self.scope_group] = math.inf
            problem = build_problem(
                fleet,
                self._allocator_policy(),
                classes=self.classes,
                tree=shape.tree,
                budget_w=lifted,
                reserved_w=shape.reserve_own_w,
            )
            g = self.scope_group
            off = float(shape.topology.overhead_w[g] + shape.reserve_w[g])
            self.curve_offset_w = off
            # Exact around the budget the coordinator gave last (where the split will land).
            given = self.scope_budget_w
            around = None if given is None or not math.isfinite(given) else given - off
            return demand_curve(problem, g, points=CURVE_POINTS, around_w=around)
        except Exception:
            log.exception("demand_curve_failed")
            return None

    def _log_safety_events(self, plan: SafePlan) -> None:
        """One line per kind of safety event, and only when what is affected changes: a
        condition that lasts (say, unknown GPUs reserving a rack's budget) logs once."""
        by_kind: dict[str, set[str]] = {}
        for ev in plan.events:
            by_kind.setdefault(ev.kind, set()).add(ev.group or ev.node or ev.uuid)
        for kind, where in by_kind.items():
            if self._safety_seen.get(kind) != where:
                log.warning("safety_event", kind=kind, count=len(where), where=sorted(where)[:10])
        self._safety_seen = by_kind

    def _throughput(self, arrays: FleetArrays, cls_idx: NDArray[np.int64]) -> FloatArray:
        """Reported application throughput where the workload gives one, else the profile's."""
        out = arrays.perf.copy()
        missing = np.isnan(out)
        for c, profile in enumerate(self.classes.profiles):
            sel = missing & (cls_idx == c)
            if sel.any():
                out[sel] = profile.value(arrays.power_w[sel])
        return out

    def _alarm(self, kind: str, message: str | None) -> None:
        self.alarms.set(kind, message, self._wall)


def _restores(rec: FleetGpu | None, node: str) -> int | None:
    """The restore count last heard of a GPU on `node`; None if not heard there yet."""
    return None if rec is None or rec.node != node else rec.restores


def _push_up(topology: Topology, per_group: FloatArray) -> FloatArray:
    """Sum a per-group value (set on nodes) up to every ancestor."""
    out = per_group.astype(np.float64, copy=True)
    for i in range(topology.n_groups - 1, 0, -1):
        out[topology.parent[i]] += out[i]
    return out
