"""The tick as a plain object: decoded messages in, a safe plan and its report out.

A tick runs five stages, top to bottom (`TickEngine._decide`), each with its inputs and
outputs explicit:

1. **fleet** (`_see`): the fleet as heard (controller/fleet.py) frozen into arrays, its
   shape (controller/shape.py) and the caps that may be in force (the safety planner's);
2. **budgets** (controller/budgets.py): per group the budget in force and the limit
   committed caps may reach;
3. **allocation** (controller/targets.py): classes, jobs, pins, learned curves and the
   allocator's targets (a solver failure falls back to the failsafe caps, with an alarm);
4. **safe plan** (`_deadband`, `_plan`): cuts within `control.deadband_w` held at the cap
   in force where every limit still fits (controller/deadband.py), then the safety planner
   turns the targets into commands (cuts at once, raises only within committed budgets,
   lease renewals to every live node);
5. **report** (`_report`): what the tick saw and did (controller/report.py), with why
   each cap (controller/why.py).

A fault anywhere falls back to the failsafe caps through the planner: a tick never ends
without caps. Who each node obeys is kept by controller/obedience.py, the alarms about what
nodes sent by controller/input_alarms.py. No transport, no store and no clock: the daemon
(controller.py) and the simulator (sim/run.py) hand it decoded messages and the times,
publish or apply the plan and record the report, and a test drives it without a broker.
"""

from __future__ import annotations

import enum
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.alarms import Alarms
from powerd.allocator.problem import held_back, held_share
from powerd.allocator.scopes import DemandCurve
from powerd.controller.budgets import Budgets, BudgetsInForce, ScopeRoot
from powerd.controller.churn import MOVE_TOL_W, cap_moves
from powerd.controller.deadband import Bands, hold_small_cuts
from powerd.controller.fleet import (
    FleetArrays,
    FleetGpu,
    FleetState,
    NodeReadings,
    split_fleet,
)
from powerd.controller.input_alarms import InputAlarms
from powerd.controller.meters import MeterBook, MeteredDraw, MeterStage
from powerd.controller.obedience import Obedience
from powerd.controller.overrides import Overrides
from powerd.controller.report import TickReport
from powerd.controller.shape import Shape, build_shape
from powerd.controller.targets import Targets, TargetStage
from powerd.controller.why import Decided, WhyFrame, why_frame
from powerd.policy import Policy, scoped
from powerd.safety import AckedCaps, OverloadRule, SafePlan, SafetyPlanner
from powerd.wire import (
    Authority,
    CapAck,
    ControllerStatus,
    NodeState,
    NodeStatus,
    NodeTelemetry,
)

log = structlog.get_logger(__name__)

# The wall clock moved this much against the monotonic one between two ticks: a step.
WALL_STEP_S = 2.0

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


class AckHeard(enum.IntEnum):
    """What an ack was to the engine: false only for a node not ours to steer."""

    UNKNOWN = 0  # not a node of ours
    NOT_OURS = 1  # another authority's or an older or newer epoch's: resolves none of ours
    OURS = 2  # news of our commands: the planner has it


@dataclass(frozen=True)
class Seen:
    """The fleet stage's output: the fleet as heard now, its shape, per GPU the caps that
    may be in force (the planner's committed caps) and whether it refuses its cap, and the
    nodes whose last status is offline."""

    arrays: FleetArrays
    shape: Shape
    committed_w: FloatArray
    held: BoolArray
    offline: list[str]


# A raise the deadband has trimmed at every pass for this long is reported as starved
# (`TickReport.raises_starved`, `powerd_raises_starved`).
STARVED_S = 60.0


class Held(NamedTuple):
    """What the deadband held this tick: moves held at the cap in force, and GPUs whose
    raise it has trimmed at every pass for STARVED_S (`TickEngine._starved`)."""

    moves: int = 0
    starved: int = 0


class TickEngine:
    """The tick's state and decisions: the fleet as heard, the operators' overrides, the
    safety planner's knowledge, alarms, and one `step` per tick."""

    def __init__(self, policy: Policy, *, solver: str = "fast", shadow: bool = False) -> None:
        # Shadow mode: decide every tick as if commanding, from the caps in force as the
        # agents report them (another controller's, or none), and send nothing.
        self.shadow = shadow
        # Whether each report carries each cap's explanation (`why`); a simulation that
        # reads no report's `why` turns it off (the decisions do not depend on it).
        self.explain = True
        self.overrides = Overrides()
        self.alarms = Alarms()
        self.tick_no = 0
        self._policy_epoch = 0
        self.shape: Shape | None = None
        self._safety_seen: dict[str, set[str]] = {}
        # Who each node obeys, at which tick and epoch (docs/safety.md, "Authority").
        self.obedience = Obedience()
        self.inputs = InputAlarms(self.alarms)
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
        self.budgets = BudgetsInForce()
        self.targets = TargetStage(policy, solver)
        self._wall_offset: float | None = None
        self._wall = 0.0  # the wall time of the tick in progress (alarm timestamps)
        # Telemetry messages heard of nodes that obey us: the overload's room is lent once
        # per reading (controller/budgets.py).
        self._heard = 0
        # The dwell (`control.dwell_s`): the shape's version, the caps in force last tick
        # and when each last moved.
        self._dwell_last: tuple[object, FloatArray, FloatArray] | None = None
        # (fleet shape, per GPU since when the deadband has trimmed its raise; inf: not).
        self._trimmed_since: tuple[object, FloatArray] | None = None
        # The report's class labels per GPU, kept while the labels and classes are the same.
        self._class_labels: tuple[Sequence[str], list[int], tuple[str, ...]] | None = None
        # Metered groups (controller/meters.py): the reader writes the book, off the tick.
        self.meter_book = MeterBook()
        self.meters = MeterStage()
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
        self.meters.adopt(policy)
        self.targets.adopt(policy)
        self.planner.policy = policy
        self.fleet.set_policy(policy)
        self.overrides.forget_policy_gaps(policy)
        self._policy_epoch += 1

    # -- messages (decoded; each returns False for a node the policy does not have) -----

    def on_telemetry(self, msg: NodeTelemetry, now: float) -> bool:
        return self.on_readings(NodeReadings.from_message(msg), now)

    def on_readings(self, r: NodeReadings, now: float) -> bool:
        """One node's telemetry as columns (a message's, or the simulator's agents')."""
        gpus = self.fleet.gpus
        # Restore counts before this message (a GPU with none reported needs no look-up).
        before = (
            {
                u: _restores(gpus.get(u), r.node_id)
                for u, n in zip(r.uuid, r.restores, strict=True)
                if n
            }
            if r.any_restores
            else None
        )
        if not self.fleet.ingest(r, now):
            return False
        if before:
            self.inputs.note_restores(r, before, self.fleet)
        self._caps_heard(r, now)
        return True

    def on_fleet_readings(
        self, samples: Sequence[NodeReadings], whole: NodeReadings, now: float
    ) -> None:
        """Every node's telemetry at once (the simulator's agents), `whole` holding the
        samples' columns end to end (the samples' own columns are not read: each carries its
        node's identity, times, tick, uuids and error flags): the same as `on_readings` of
        each node's part in turn, the fleet's columns written in one pass where its GPUs lie
        in that order."""
        if any(r.any_restores for r in samples) or not self.fleet.ingest_fleet(samples, whole, now):
            for r in split_fleet(samples, whole):
                self.on_readings(r, now)
            return
        if not self._fleet_caps_heard(samples, whole, now):
            for r in split_fleet(samples, whole):
                self._caps_heard(r, now)

    def _fleet_caps_heard(
        self, samples: Sequence[NodeReadings], whole: NodeReadings, now: float
    ) -> bool:
        """`_caps_heard` of every sample at once, where each is ours to read in full (no
        foreign node, no newer leader's epoch, no GPU's error): one block to the planner.
        False, with nothing done, where not."""
        ob = self.obedience
        if ob.foreign or not all(r.no_errors for r in samples):
            return False
        ours = ob.epoch
        ticks: list[int | None] = []
        for r in samples:
            epoch = r.epoch
            if epoch is None:
                ticks.append(r.tick)
            elif epoch > ours > 0:
                return False  # `telemetry_epoch` refuses it
            else:
                # A tick of an older leader's orders nothing of ours: the reading only widens.
                ticks.append(None if epoch < ours else r.tick)
        # The caps as the sender's array where it holds one (the same values as the list),
        # and the limits their agents set (a lower one another holds may lift to them).
        arrays = whole.arrays
        caps = whole.cap_w if arrays is None else arrays["cap_w"]
        lifts = whole.set_w if arrays is None else arrays.get("set_w", whole.set_w)
        if not self.planner.on_fleet_telemetry(
            [r.node_id for r in samples], [r.uuid for r in samples], caps, now, ticks,
            lifts_to_w=lifts,
        ):  # fmt: skip
            return False
        self._heard += len(samples)
        return True

    def _caps_heard(self, r: NodeReadings, now: float) -> None:
        """A recorded sample's caps in force, to the planner (where they are ours)."""
        if r.node_id in self.obedience.foreign:
            return  # its caps are another authority's: counted at their maximum
        if not self.obedience.telemetry_epoch(r.node_id, r.epoch):
            return
        self._heard += 1
        # A GPU reported with an error carries its last known cap, not a reading.
        caps: Mapping[str, float] | tuple[Sequence[str], Sequence[float]]
        lifts: Mapping[str, float] | Sequence[float] = r.set_w
        if r.no_errors:
            caps = (r.uuid, r.cap_w)
        else:
            caps = {u: w for u, w, e in zip(r.uuid, r.cap_w, r.error, strict=True) if e is None}
            lifts = dict(zip(r.uuid, r.set_w, strict=True))
        # A tick of an older leader's orders nothing of ours: the reading only widens.
        older = r.epoch is not None and r.epoch < self.obedience.epoch
        tick = None if older else r.tick
        # The limits the agent set: a lower one another holds may lift to them.
        self.planner.on_telemetry(
            r.node_id, caps, received_at=now, as_of_tick=tick, lifts_to_w=lifts
        )

    def on_ack(self, node: str, ack: CapAck) -> AckHeard:
        return self.on_acked(
            node, ack.tick, ack.epoch, ack.authority, AckedCaps.from_acks(ack.gpus)
        )

    def on_acked(
        self, node: str, tick: int, epoch: int, authority: Authority | None, gpus: AckedCaps
    ) -> AckHeard:
        """One ack as columns (a wire message's, or the simulator's agents')."""
        if node not in self.fleet.node_order:
            return AckHeard.UNKNOWN
        ob = self.obedience
        if not ob.obeys_us(node, authority) or not ob.our_epoch(node, epoch):
            return AckHeard.NOT_OURS
        # Even an ack of a tick we did not send resolves our commands up to it: the agent
        # applies only newer ticks, so none of them can still land.
        ob.seen(node, tick, epoch)
        self.fleet.ack_heard(node)
        self.planner.on_ack(node, tick, gpus)
        return AckHeard.OURS

    def on_fleet_acked(
        self,
        acks: Sequence[tuple[str, int, AckedCaps]],
        epoch: int = 0,
        authority: Authority | None = None,
    ) -> None:
        """Many nodes' acks (node, tick, its GPUs) of one epoch and authority at once (the
        simulator's agents): the same as `on_acked` of each in turn."""
        ob, order = self.obedience, self.fleet.node_order
        if (
            authority is not None
            or ob.foreign
            or ob.ahead
            or ob.epoch not in (0, epoch)
            or any(node not in order for node, _, _ in acks)
        ):
            for node, tick, gpus in acks:
                self.on_acked(node, tick, epoch, authority, gpus)
            return
        # Every node obeys us at our epoch (`obeys_us`, `our_epoch` would change nothing).
        ob.seen_acks(acks, epoch)
        self.fleet.acks_heard([node for node, _, _ in acks])
        self.planner.on_fleet_acks(acks)

    def on_plan_acked(self, plan: SafePlan, enforced_w: FloatArray) -> None:
        """Every command of `plan` obeyed (epoch 0, no authority, as the simulator's agents
        acknowledge), `enforced_w` per GPU of the plan's layout the limit read back where a
        command went: the same as `on_fleet_acked(plan.acks(enforced_w))`, without the
        per-node columns of each ack."""
        ob, order = self.obedience, self.fleet.node_order
        if ob.foreign or ob.ahead or ob.epoch != 0 or plan.layout is not self.planner.layout:
            self.on_fleet_acked(plan.acks(enforced_w))
            return
        if any(node not in order for node in plan.sent_nodes):
            self.on_fleet_acked(plan.acks(enforced_w))
            return
        ob.seen_tick(plan.sent_nodes, plan.tick, 0)
        self.fleet.acks_heard(plan.sent_nodes)
        self.planner.on_plan_acked(plan, enforced_w)

    def cuts_awaited(self, plan: SafePlan) -> set[str]:
        """The nodes whose acks of `plan` may let another tick make a raise it held back
        (`SafePlan.cuts_awaited`, with the planner's refused caps): what the controller's
        ticks on acks wait for, and what the simulator's rounds of a steer follow."""
        if not plan.withheld.any():
            return set()
        return plan.cuts_awaited(self.planner.defiant())

    def on_status(self, node: str, status: NodeStatus) -> bool:
        if node not in self.fleet.node_order:
            return False
        ob = self.obedience
        ob.note_refusals(node, status, self.inputs.now)
        ob.note_came_over(node, status, self.alarms, self._wall)
        if not ob.obeys_us(node, status.authority) or not ob.our_epoch(
            node, status.epoch, status=True
        ):
            self.fleet.ingest_status(status)
            return True
        if status.state is NodeState.STARTING and status.last_tick is None:
            ob.restarted(node)  # a new agent process applies any tick
        else:
            ob.seen(node, status.last_tick)
        ob.seen(node, None, status.epoch)
        ob.fenced(node, status.fenced)
        self.fleet.ingest_status(status)
        if status.state is NodeState.OFFLINE and not status.caps_w:
            self.planner.claim_keeps_limits(self.fleet.keeps_limits_claimed())
            self.planner.node_offline(node)
        elif status.caps_w:  # a clean stop's `offline` too: the caps it left in force
            # The ticks of an older leader's order nothing of ours: as readings, they widen.
            tick = None if status.epoch < self.obedience.epoch else status.last_tick
            self.planner.learn_status(node, status.caps_w, as_of_tick=tick, lifts_to_w=status.set_w)
        return True

    def on_controller_status(self, controller_id: str, status: ControllerStatus) -> None:
        """Another controller's retained status: one that leads (or would) for another
        authority over an overlapping domain is a rival, alarmed by name."""
        self.obedience.on_controller_status(controller_id, status, self.policy)

    def foreign_nodes(self) -> dict[str, Authority]:
        return dict(self.obedience.foreign)

    def message_failed(self, error: str) -> None:
        """A message hit a fault of ours: the next tick raises an event with the last such."""
        self.inputs.message_failed(error)

    def agents_epoch(self) -> int:
        """The epoch the agents have seen (the median over every node of the policy)."""
        return self.obedience.agents_epoch(self.fleet.node_order)

    def fenced_total(self) -> int:
        """Commands the agents say they refused for a lower epoch, summed over the nodes."""
        return self.obedience.fenced_total()

    # -- the tick ------------------------------------------------------------------------

    def observe(self, now: float) -> None:
        """A standby's tick: keep the view warm without deciding or sending anything. The
        fleet's shape is built and the planner folds in what it heard (caps in force from
        telemetry, statuses and the leader's acks), so a takeover's first tick commands at
        once from the caps in force. A standby commands nothing, so no epoch is ours."""
        self.obedience.standby()
        control = self.policy.control
        if self.fleet.forget(now, control.forget_after_s, dispute_s=control.stale_after_s):
            self.shape = None
        arrays = self.fleet.arrays(now, control.stale_after_s)
        if not arrays.uuids:
            return
        self._shape_for(arrays, now)
        self.planner.committed_w()  # folds the queued messages in

    def step(self, now: float, wall: float, *, early: bool = False) -> tuple[TickReport, SafePlan]:
        """One tick's decisions at monotonic time `now` and wall time `wall`; `early`: a
        tick on acks (`control.ack_ticks`), which commands only the nodes whose caps move.

        A tick never ends without caps: a fault anywhere in it falls back to the failsafe
        caps through the safety planner (cuts at once, raises only where they fit), alarms
        `tick_failed`, and the next tick tries again.
        """
        t0 = time.perf_counter()
        self._wall = self.inputs.wall = wall
        self.inputs.now = now
        # Agents apply only ticks above the last they applied: a restarted controller
        # continues above every tick it has seen acknowledged or reported, with room for
        # any its predecessor sent that nobody has reported yet.
        self.tick_no = self.obedience.next_tick(self.fleet.node_order, self.tick_no)
        tick = self.tick_no
        self.inputs.raise_inputs(self.fleet, self.obedience.outliers)
        self.obedience.alarm(self.alarms, now, wall, self.policy.control.lease_s)
        self.inputs.raise_events()
        self._watch_wall_clock(now, wall)
        planned: list[SafePlan] = []
        try:
            report, plan = self._decide(tick, now, wall, t0, planned, early=early)
        except Exception as exc:
            log.exception("tick_failed", tick=tick)
            self._alarm("tick_failed", f"tick {tick}: {type(exc).__name__}: {exc}"[:300])
            return self._fallback(tick, now, wall, t0, planned)
        self._alarm("tick_failed", None)
        return report, plan

    def _decide(
        self,
        tick: int,
        now: float,
        wall: float,
        t0: float,
        planned: list[SafePlan],
        *,
        early: bool = False,
    ) -> tuple[TickReport, SafePlan]:
        """The five stages (the module's docstring)."""
        seen = self._see(now)
        budgets = self._budgets(seen, now, wall)
        targets = self.targets.decide(
            tick,
            now,
            seen.arrays,
            seen.shape,
            overrides=self.overrides,
            committed_w=seen.committed_w,
            held=seen.held,
            limit_w=budgets.limit_w,
            alarm=self._alarm,
        )
        if self.scope_name is not None:
            self._curve(targets, budgets, seen.shape)
        self._alarm_targets(targets)
        t_plan = time.perf_counter()
        targets, held = self._deadband(seen, budgets, targets)
        plan = self._plan(tick, now, seen, budgets, targets, changes_only=early)
        planned.append(plan)
        plan_ms = (time.perf_counter() - t_plan) * 1000.0
        over = self._alarm_plan(seen, budgets, plan)
        report = self._report(
            seen,
            budgets,
            targets,
            plan,
            tick=tick,
            wall=wall,
            over=over,
            t0=t0,
            plan_ms=plan_ms,
            held=held,
        )
        return report, plan

    # 1. the fleet

    def _see(self, now: float) -> Seen:
        """The fleet as heard now, its shape, the caps that may be in force."""
        control = self.policy.control
        # A dispute ends once one node alone has named the uuid for a stale period: a single
        # spoofed message costs seconds of steering of those GPUs, not forget_after_s.
        if self.fleet.forget(now, control.forget_after_s, dispute_s=control.stale_after_s):
            self.shape = None
        arrays = self.fleet.arrays(now, control.stale_after_s)
        shape = self._shape_for(arrays, now)
        self.inputs.raise_overridden(arrays, self.fleet)
        return Seen(
            arrays,
            shape,
            self.planner.committed_w(),
            self.planner.defiant(),
            self.fleet.offline_nodes(),
        )

    def _shape_for(self, arrays: FleetArrays, now: float) -> Shape:
        version = (self.fleet.version, self._policy_epoch, self.fleet.stops)
        if self.shape is None or self.shape.version != version:
            self.shape = build_shape(
                self.policy, self.fleet, self.planner, arrays, version=version, now=now
            )
            self.targets.warm = None
        return self.shape

    # 2. budgets

    def _budgets(self, seen: Seen, now: float, wall: float) -> Budgets:
        """The budgets in force (a rise ramped), and what committed caps may reach: the
        budgets, or above them where a group is rated for an overload and its GPUs do not
        draw their reservation (docs/safety.md)."""
        topo = seen.shape.topology
        most_w = topo.group_sums(seen.arrays.max_cap_w) + topo.overhead_w + seen.shape.reserve_w
        budget_w = self.budgets.in_force(
            self.policy, self.overrides, topo, now, wall, most_w=most_w, scope=self._scope()
        )
        meter = self._metered(seen, now)
        draw_w = None
        if self.overload is not None or self.policy.control.fund_pressed_w is not None:
            draw_w = BudgetsInForce.measured_draw_w(
                seen.committed_w, seen.arrays, seen.shape, meter
            )
        limit_w = self.budgets.limits(
            self.overload,
            budget_w,
            seen.committed_w,
            seen.shape,
            draw_w=draw_w,
            heard=self._heard,
            meter=meter,
            now=now,
        )
        return Budgets(budget_w, limit_w, meter, draw_w)

    def _metered(self, seen: Seen, now: float) -> MeteredDraw | None:
        """The meters' latest readings against the nodes' figures, and their alarms."""
        if not self.meters.specs:
            if self.meters.views or any(k.startswith("meter_") for k in self.alarms.active):
                self.meters.views = ()
                self.meters.alarm(self.alarms, now, self._wall)  # a policy that dropped them
            return None
        arrays, topo = seen.arrays, seen.shape.topology
        fresh = ~arrays.stale & np.isfinite(arrays.power_w)
        complete = (topo.group_sums((~fresh).astype(np.float64)) == 0) & (seen.shape.reserve_w == 0)
        meter = self.meters.see(
            self.meter_book.latest(),
            topo,
            now,
            nodes_w=self.budgets.nodes_draw_w(seen.committed_w, arrays, seen.shape),
            gpus_w=topo.group_sums(np.where(fresh, arrays.power_w, 0.0)),
            complete=complete,
        )
        self.meters.alarm(self.alarms, now, self._wall)
        return meter

    def _scope(self) -> ScopeRoot | None:
        if self.scope_name is None:
            return None
        return ScopeRoot(self.scope_group, self.scope_budget_w)

    # 3. allocation: TargetStage.decide (controller/targets.py), and at a scope's root:

    def _curve(self, targets: Targets, budgets: Budgets, shape: Shape) -> None:
        """The scope's demand curve for the coordinator (None if it failed)."""
        got = self.targets.curve(
            targets.fleet, budgets.budget_w, shape, self.scope_group, self.scope_budget_w
        )
        self.last_curve = None if got is None else got[0]
        if got is not None:
            self.curve_offset_w = got[1]

    # 4. the safe plan

    def _deadband(self, seen: Seen, budgets: Budgets, targets: Targets) -> tuple[Targets, Held]:
        """Small cuts held at the cap in force (controller/deadband.py), how many, and how
        many GPUs pressing on their cap have had their raise trimmed at every pass for
        STARVED_S (`_starved`). Operators' pins and GPUs whose cap in force lies outside
        their class's bounds move. With `control.dwell_s`, moves of GPUs whose cap moved
        lately are held too."""
        band = self.policy.control.deadband_w
        raise_band = self.policy.control.raise_deadband_w
        dwell_s = self.policy.control.dwell_s
        if band <= 0 and raise_band <= 0 and dwell_s <= 0:
            self._trimmed_since = None
            return targets, Held()
        fleet, topo = targets.fleet, seen.shape.topology
        classes = self.targets.classes
        prev = fleet.cap_w
        dwelling = self._dwelling(seen, prev, dwell_s)
        lo = np.maximum(fleet.min_cap_w, classes.floor_w[targets.class_index])
        hi = np.minimum(fleet.max_cap_w, classes.ceiling_w[targets.class_index])
        holdable = np.isnan(fleet.pinned_w) & (prev >= lo) & (prev <= hi)
        control = self.policy.control
        pressed = held_back(fleet, control.demand)
        held_w, held = hold_small_cuts(
            targets.targets_w,
            prev,
            bands=Bands(band, raise_band, control.dwell_max_w, control.fund_pressed_w),
            topology=topo,
            capacity_w=np.asarray(budgets.limit_w, dtype=np.float64)
            - topo.overhead_w
            - seen.shape.reserve_w,
            holdable=holdable,
            pressed=pressed,
            dwelling=dwelling,
            fund_under=self._fund_under(budgets),
        )
        starved = self._starved(seen, targets.targets_w, held_w, prev, pressed)
        return replace(targets, targets_w=held_w), Held(int(held.sum()), starved)

    def _fund_under(self, budgets: Budgets) -> BoolArray | None:
        """Per group whether held cuts may fund pressed raises under it
        (`control.fund_pressed_w`): where its measured draw (`Budgets.draw_w`, as the
        overload rule reads it) is at least `control.fund_room_pct` below its budget. Near
        the budget (a feed that binds, a rating steering the draw to its target) a released
        cut is soon wanted back, and each release is a move (docs/allocator.md,
        "Deadband"). None: every group."""
        control = self.policy.control
        if control.fund_pressed_w is None or control.fund_room_pct <= 0:
            return None
        assert budgets.draw_w is not None  # read by `_budgets` wherever funding is on
        room = np.asarray(budgets.budget_w, dtype=np.float64) * (1.0 - control.fund_room_pct / 100)
        return np.asarray(budgets.draw_w <= room, dtype=np.bool_)

    def _starved(
        self,
        seen: Seen,
        targets_w: FloatArray,
        held_w: FloatArray,
        in_force_w: FloatArray,
        pressed: BoolArray,
    ) -> int:
        """How many GPUs pressing on their cap have had their raise trimmed by the deadband
        (its targets above the cap in force, the deadband's below the target: held cuts
        kept the room) at every pass for at least STARVED_S: work waiting on churn avoided
        (docs/allocator.md, "Deadband"). A new fleet shape starts every GPU afresh."""
        now = self.inputs.now
        key = seen.shape.version
        last = self._trimmed_since
        since = (
            last[1]
            if last is not None and last[0] == key and last[1].shape == in_force_w.shape
            else np.full(in_force_w.shape, np.inf)
        )
        trimmed = (targets_w > in_force_w + MOVE_TOL_W) & (held_w < targets_w - MOVE_TOL_W)
        since = np.where(trimmed, np.minimum(since, now), np.inf)
        self._trimmed_since = (key, since)
        return int(np.count_nonzero(trimmed & pressed & (now - since >= STARVED_S)))

    def _dwelling(self, seen: Seen, in_force_w: FloatArray, dwell_s: float) -> BoolArray | None:
        """Per GPU whether its cap in force moved less than `dwell_s` ago (None: off); a new
        fleet shape (GPUs joined or left) starts every GPU as not having moved."""
        if dwell_s <= 0:
            return None
        now = self.inputs.now
        key = seen.shape.version
        last = self._dwell_last
        if last is None or last[0] != key or last[1].shape != in_force_w.shape:
            moved_at = np.full(in_force_w.shape, -np.inf)
        else:
            moved_at = last[2]
            moved = np.abs(in_force_w - last[1]) > MOVE_TOL_W
            moved_at = np.where(moved, now, moved_at)
        self._dwell_last = (key, in_force_w.copy(), moved_at)
        return now - moved_at < dwell_s

    def _plan(
        self,
        tick: int,
        now: float,
        seen: Seen,
        budgets: Budgets,
        targets: Targets,
        *,
        changes_only: bool = False,
    ) -> SafePlan:
        """The commands: cuts at once, raises only within the limits in force."""
        if self.shadow:
            # Nothing is sent, so nothing of ours or a predecessor's is on its way: the caps
            # in force are what the agents report.
            self.planner.assume_settled()
        self._count_foreign()
        self.planner.claim_keeps_limits(self.fleet.keeps_limits_claimed())
        plan = self.planner.plan(
            tick,
            now,
            targets.targets_w,
            budget_w=budgets.limit_w,
            strict_w=budgets.budget_w,
            reserve_w=seen.shape.reserve_w,
            priority=self.targets.classes.weight[targets.class_index],
            offline=seen.offline,
            record=not self.shadow,
            jobs=targets.job_index,  # a job's GPUs rise together or wait
            changes_only=changes_only,
        )
        self._log_safety_events(plan)
        return plan

    def _alarm_kept_limits(self, plan: SafePlan) -> None:
        """Alarms of nodes whose actuators keep their limits (docs/safety.md, "BMC-managed
        nodes: the actuator keeps its limits")."""
        declared = self.policy.keeps_limits_nodes
        undeclared = [n for n in self.fleet.keeps_limits_claimed() if n not in declared]
        self._alarm(
            "keeps_limits_undeclared",
            None
            if not undeclared
            else "nodes say their GPUs keep their limits when their agent dies, the policy "
            "does not (planned as keeping them; declare keeps_limits: true): "
            + ", ".join(undeclared[:10]),
        )
        unsaid = [n for n in self.fleet.keeps_limits_unsaid() if n in declared]
        self._alarm(
            "keeps_limits_unconfirmed",
            None
            if not unsaid
            else "the policy says these nodes keep their limits, their agents do not (planned "
            "as keeping them, but counted at their maximum while offline): "
            + ", ".join(unsaid[:10]),
        )
        stuck = [e for e in plan.events if e.kind == "cut_unreachable"]
        self._alarm(
            "cut_unreachable",
            None
            if not stuck
            else "budgets that cannot be met with every movable GPU at its minimum, for GPUs "
            "that keep their limits and cannot move: "
            + "; ".join(
                f"{e.group} {e.value_w:,.0f} W over (nodes {e.node} hold {e.committed_w:,.0f} W)"
                for e in stuck[:5]
            ),
        )
        unmet = sorted({e.group for e in plan.events if e.kind == "kept_limits_unmet"})
        self._alarm(
            "kept_limits_unmet",
            None
            if not unmet
            else "GPUs that keep their limits and cannot move hold more than a cut to the "
            "lowest budget (or an overload's lease) allows: " + ", ".join(unmet[:10]),
        )

    def _count_foreign(self) -> None:
        self.obedience.count_foreign(self.planner, handing_over=bool(self.overrides.handover))

    def _alarm_targets(self, targets: Targets) -> None:
        status = targets.status
        self._alarm(
            "infeasible_min",
            "device minimums exceed a budget" if status == "infeasible_min" else None,
        )
        self._alarm(
            "floors_dropped",
            "class floors dropped to fit a budget" if status == "floors_dropped" else None,
        )

    def _alarm_plan(self, seen: Seen, budgets: Budgets, plan: SafePlan) -> BoolArray:
        """The plan's alarms; returns per group whether committed caps are over its budget.

        Over only while GPUs count at their maximum until a first ack (after a start) is
        no breach known: nothing rises there meanwhile. A rated group whose limit fell
        (its draw neared the budget) is cutting, not over, while within its rating."""
        topo, budget_w = seen.shape.topology, budgets.budget_w
        over = plan.group_over & ~plan.group_settling
        over &= plan.group_committed_w > self.budgets.ramp_grace(topo, budget_w) + 1e-6
        if self.overload is not None:
            rating = self.overload.ratings_w(budget_w)
            over &= ~((self.overload.pct > 0) & (plan.group_committed_w <= rating + 1e-6))
        self._alarm_kept_limits(plan)
        refusing = [seen.arrays.uuids[i] for i in np.flatnonzero(seen.held).tolist()]
        # With the GPUs as its subjects: a GPU that starts refusing later is named (the
        # alarm is raised anew, logged and stored), not left out of a message kept as it was.
        self.alarms.set(
            "caps_refused",
            None
            if not refusing
            else f"{len(refusing)} GPU(s) refuse their caps (others cut to make room): "
            + ", ".join(refusing[:5])
            + (", ..." if len(refusing) > 5 else ""),
            self._wall,
            subjects=tuple(refusing),
        )
        self._alarm(
            "budget_over",
            None
            if not over.any()
            else "committed caps above budget at "
            + ", ".join(topo.names[g] for g in np.flatnonzero(over)[:5]),
        )
        return over

    # 5. the report

    def _report(
        self,
        seen: Seen,
        budgets: Budgets,
        targets: Targets,
        plan: SafePlan,
        *,
        tick: int,
        wall: float,
        over: BoolArray,
        t0: float,
        plan_ms: float,
        held: Held,
    ) -> TickReport:
        """What the tick saw and did (`held`: the moves the deadband held, and the GPUs whose
        raise it has starved: `_starved`), and why each cap."""
        arrays, topo = seen.arrays, seen.shape.topology
        moves = cap_moves(seen.committed_w, plan.sent_w)
        labels = targets.jobs.labels
        cached = self._class_labels
        if cached is None or cached[0] != labels or cached[1] != targets.class_index.tolist():
            index = targets.class_index.tolist()
            cached = self._class_labels = (labels, index, tuple([labels[i] for i in index]))
        return TickReport(
            tick=tick,
            ts=wall,
            duration_ms=(time.perf_counter() - t0) * 1000.0,
            solve_ms=targets.solve_ms,
            plan_ms=plan_ms,
            status=targets.status,
            solver=self.targets.solver,
            objective=targets.objective,
            group_names=topo.names,
            group_levels=topo.level,
            group_budget_w=np.asarray(budgets.budget_w, dtype=np.float64),
            group_committed_w=plan.group_committed_w,
            group_draw_w=topo.group_sums(arrays.power_w) + topo.overhead_w,
            # The planner's: a group whose frozen limits leave nothing to lend is held strict.
            group_limit_w=np.minimum(
                np.asarray(budgets.limit_w, dtype=np.float64), plan.group_budget_w
            ),
            unused_w=targets.unused_w,
            group_over=over,
            group_settling=plan.group_settling,
            uuids=arrays.uuids,
            nodes=arrays.nodes,
            classes=cached[2],
            power_w=arrays.power_w,
            cap_w=arrays.cap_w,
            energy_j=arrays.energy_j,
            temp_c=arrays.temp_c,
            targets_w=targets.targets_w,
            sent_w=plan.sent_w,
            committed_w=plan.committed_w,
            throughput=self.targets.throughput(arrays, targets.class_index),
            stale=plan.stale,
            waiting_nodes=plan.waiting_nodes,
            alarms=tuple(sorted(self.alarms.active)),
            set_w=arrays.set_w,
            perf=arrays.perf,
            meters=self.meters.views,
            meter_rejected=self.meter_book.rejected_counts() if self.meters.specs else {},
            why=(
                self._explain(seen, budgets, targets, plan, tick=tick, wall=wall)
                if self.explain
                else None
            ),
            caps_moved=moves.size,
            moved_w=float(moves.sum()),
            caps_held=held.moves,
            raises_starved=held.starved,
        )

    def _explain(
        self,
        seen: Seen,
        budgets: Budgets,
        targets: Targets,
        plan: SafePlan,
        *,
        tick: int,
        wall: float,
    ) -> WhyFrame | None:
        """What decided each cap, to explain on request; None if that failed (an
        explanation never costs a tick its caps)."""
        try:
            decided = Decided(
                tick,
                wall,
                targets.status,
                self.targets.solver,
                targets.targets_w,
                budgets.budget_w,
                budgets.limit_w,
                targets.fleet.cap_w,
                seen.held,
                seen.offline,
                self.policy.control.slew_w,
                held_share(self.policy.control.demand),
            )
            return why_frame(
                decided,
                fleet=targets.fleet,
                arrays=seen.arrays,
                index=seen.shape.gpu_index,
                alloc=targets.alloc,
                plan=plan,
                planner=self.planner,
                classes=self.targets.classes,
                drained=self.overrides.drained,
                node_seq={n: rec.seq for n, rec in self.fleet.nodes.items()},
            )
        except Exception:
            log.exception("why_frame_failed", tick=tick)
            return None

    # -- when the decision failed --------------------------------------------------------

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
                budget_w = self.budgets.held(
                    topo,
                    self.budgets.in_force(
                        self.policy, self.overrides, topo, now, wall, scope=self._scope()
                    ),
                )
            except Exception:
                log.exception("fallback_budgets_failed", tick=tick)
                budget_w = np.zeros(topo.n_groups)  # nothing may rise
            self._count_foreign()
            self.planner.claim_keeps_limits(self.fleet.keeps_limits_claimed())
            plan = self.planner.plan(
                tick,
                now,
                layout.failsafe_w.copy(),
                budget_w=budget_w,
                offline=self.fleet.offline_nodes(),
            )
        return self._failed_report(tick, wall, t0, plan), plan

    def _failed_report(self, tick: int, wall: float, t0: float, plan: SafePlan) -> TickReport:
        layout = self.planner.layout
        assert layout is not None
        topo, n = layout.topology, layout.n_gpus
        nan = np.full(n, np.nan)
        return TickReport(
            tick=tick,
            ts=wall,
            duration_ms=(time.perf_counter() - t0) * 1000.0,
            solve_ms=0.0,
            plan_ms=0.0,
            status="tick_failed",
            solver=self.targets.solver,
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

    # -- small helpers -------------------------------------------------------------------

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

    def _alarm(self, kind: str, message: str | None) -> None:
        self.alarms.set(kind, message, self._wall)


def _restores(rec: FleetGpu | None, node: str) -> int | None:
    """The restore count last heard of a GPU on `node`; None if not heard there yet."""
    return None if rec is None or rec.node != node else rec.restores
