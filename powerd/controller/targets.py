"""The tick's allocation stage: what each GPU should get this tick.

Each GPU's class (the operator's assignment, else its workload's; a job's GPUs steer as
the job's class), fixed caps (pins, drained nodes, GPUs that refuse their cap), the curves
to steer by (the policy's, or those learned online from reported perf), then the allocator
under the limits in force. A solver failure steers to the failsafe caps with an alarm, so a
tick never ends without targets. At a scope's root it also computes the demand curve the
coordinator splits the site's feed by.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator import Allocation, ClassTable, GpuArrays, allocate_arrays, class_names
from powerd.allocator.learn import ProfileLearner, learner_for
from powerd.allocator.problem import build_problem
from powerd.allocator.scopes import DemandCurve, demand_curve
from powerd.controller.demand import DemandEstimator
from powerd.controller.fleet import FleetArrays
from powerd.controller.jobs import GpuPlaces, JobView, ReportedJobs
from powerd.controller.overrides import Overrides
from powerd.controller.shape import Shape
from powerd.policy import Policy
from powerd.topology import N_LEVELS

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]
Alarm = Callable[[str, str | None], None]

# Above this relative duality gap an allocation is reported as not optimal.
INEXACT_GAP = 1e-4
# Points of a scope's demand curve on the wire (exact there, linear in between).
CURVE_POINTS = 256


def steer_from_w(arrays: FleetArrays, committed_w: FloatArray) -> FloatArray:
    """Per GPU the cap its next target moves from: where the damping term and the spare
    power's `caps` anchor centre it, the slew window around it, the deadband's cap in
    force. The planner's committed cap (what may be in force), but for a GPU reporting a
    limit its agent did not set (another tool's `nvidia-smi -pl`, an out-of-band cap, a
    reset's default: `FleetArrays.not_set_here`): from that limit, powerd would command
    another's choice as its own (the deadband holding a small cut at it, a raise trimmed
    back to it, a tie broken toward it), undo its agent's restore and clear the
    `cap_overridden` alarm while the other limit holds. Such a GPU moves from the cap
    powerd set. Only where the targets start: the planner counts every GPU at its
    committed cap, whatever this says (powerd/safety.py)."""
    in_force = np.minimum(committed_w, arrays.max_cap_w)
    foreign = arrays.not_set_here() & ~arrays.stale
    if arrays.set_w is None or not foreign.any():
        return in_force
    return np.asarray(
        np.where(foreign, np.minimum(arrays.set_w, arrays.max_cap_w), in_force), dtype=np.float64
    )


@dataclass(frozen=True)
class Targets:
    """The allocation stage's output: the allocator's input and what it decided."""

    fleet: GpuArrays  # as the allocator saw it
    targets_w: FloatArray  # per GPU; NaN: hold the committed cap (a GPU that refuses)
    status: str  # allocator status, or "fallback"
    objective: float
    solve_ms: float
    unused_w: float
    alloc: Allocation | None  # None when the solver failed
    class_index: IntArray  # per GPU, as steered (a job's class for its GPUs)
    jobs: JobView
    job_index: IntArray | None  # operators' jobs first (JobView.names), then reported ones


class TargetStage:
    """The allocation stage and what it keeps between ticks: the classes and their curves,
    the learner, the jobs compiled against the policy, the last allocation (a warm start)."""

    def __init__(self, policy: Policy, solver: str) -> None:
        self.solver = solver
        self.warm: Allocation | None = None
        # Per-GPU recent draw (docs/allocator.md, "Demand"): kept across policy changes.
        self.demand = DemandEstimator(policy.control.demand)
        self.adopt(policy)

    def adopt(self, policy: Policy) -> None:
        """Steer by this policy from the next tick: its classes, and learning afresh (its
        classes, profiles or settings changed)."""
        self.policy = policy
        self.demand.adopt(policy.control.demand)
        self.classes = ClassTable.from_policy(policy)
        # Curves learned from reported perf (docs/allocator.md, "Profiles learned online").
        self.learner: ProfileLearner | None = learner_for(policy)
        self._class_index = {name: i for i, name in enumerate(class_names(policy))}
        self.jobs: JobView | None = None  # compiled at the next tick
        self._job_index_key: tuple[JobView, Shape] | None = None
        self.job_index: IntArray | None = None
        self._places: tuple[Shape, GpuPlaces] | None = None
        # Jobs the nodes report, coupled (ReportedJobs) from the inputs kept beside them.
        self._reported: tuple[tuple[object, ...], IntArray, ReportedJobs] | None = None
        # The fleet's workloads list (kept while none changes) and the classes they give.
        self._classes_of: tuple[list[str | None], IntArray] | None = None
        self.warm = None

    def decide(
        self,
        tick: int,
        now: float,
        arrays: FleetArrays,
        shape: Shape,
        *,
        overrides: Overrides,
        committed_w: FloatArray,
        held: BoolArray,
        limit_w: FloatArray,
        alarm: Alarm,
    ) -> Targets:
        """The targets under `limit_w`, from the caps that may be in force (`committed_w`)."""
        jobs = self.job_view(overrides)
        job_idx = self.job_indices(jobs, arrays, shape)
        cls_idx = self.class_indices(arrays, overrides)
        if job_idx is not None:  # a job's GPUs steer as its class (or its own)
            cls_idx = np.where(job_idx >= 0, jobs.job_class[job_idx], cls_idx)
        job_idx, job_names = self.with_reported(jobs, job_idx, cls_idx, arrays, shape)
        pinned = self.pinned(arrays, overrides)
        if self.learner is not None:
            self.learn(now, arrays, cls_idx, shape.topology.gpu_groups[:, N_LEVELS - 1], tick)
        # GPUs we cannot steer keep the power they may have, and the allocator shares out
        # the rest: one that refused its last cap.
        if held.any():
            pinned = np.where(held, np.minimum(committed_w, arrays.max_cap_w), pinned)
        recent = self.demand.observe(
            now, arrays.uuids, arrays.power_w, arrays.max_cap_w, ~arrays.stale
        )
        fleet = GpuArrays(
            uuids=tuple(arrays.uuids),
            topology=shape.topology,
            min_cap_w=arrays.min_cap_w,
            max_cap_w=arrays.max_cap_w,
            power_w=arrays.power_w,
            cap_w=steer_from_w(arrays, committed_w),
            class_index=cls_idx,
            stale=arrays.stale,
            pinned_w=pinned,
            job_index=job_idx,
            job_names=job_names,
            recent_w=recent,
            sampled_cap_w=arrays.cap_w,
            swinging=self.demand.swinging(self.policy.control.demand.swing_keep_w),
        )
        targets, status, objective, solve_ms, unused_w = self.allocate(
            tick, fleet, limit_w, shape, alarm
        )
        if held.any():
            targets = np.where(held, np.nan, targets)  # NaN: hold the committed cap
        return Targets(
            fleet, targets, status, objective, solve_ms, unused_w, self.warm,
            cls_idx, jobs, job_idx,
        )  # fmt: skip

    def job_view(self, overrides: Overrides) -> JobView:
        """The jobs compiled against the policy; recompiled when either changed (jobs are
        replaced, never changed in place, so identity says). The allocator's classes are
        the view's: the policy's and those made for jobs with their own profile."""
        jobs = overrides.jobs
        view = self.jobs
        if view is None or view.jobs is not jobs:
            view = self.jobs = JobView.compile(self.policy, jobs)
            learned = None if self.learner is None else self.learner.profiles()
            # Jobs' own classes keep their own curves; learned ones replace the policy's.
            self.classes = ClassTable.from_policy(view.policy, learned) if learned else view.classes
            self._job_index_key = None
        return view

    def allocator_policy(self) -> Policy:
        """The policy with the classes made for jobs with their own profile."""
        return self.policy if self.jobs is None else self.jobs.policy

    def job_indices(self, view: JobView, arrays: FleetArrays, shape: Shape) -> IntArray | None:
        """Per GPU its job (-1: none), rebuilt only when the jobs or the GPU set change."""
        key = self._job_index_key
        if key is None or key[0] is not view or key[1] is not shape:
            if not view.names:
                self.job_index = None
            else:
                if self._places is None or self._places[0] is not shape:
                    self._places = (shape, GpuPlaces.build(arrays.uuids, shape.topology))
                self.job_index = view.index(self._places[1])
            self._job_index_key = (view, shape)
        return self.job_index

    def with_reported(
        self,
        view: JobView,
        job_idx: IntArray | None,
        cls_idx: IntArray,
        arrays: FleetArrays,
        shape: Shape,
    ) -> tuple[IntArray | None, tuple[str, ...]]:
        """Per GPU its job and the jobs' names: the operators' (`job_idx`, `view.names`),
        then the jobs nodes report on the other GPUs. Coupled again only when the reports,
        the operators' jobs, the GPU set or a class change; a fault leaves the operators'."""
        scope = self.policy.control.reported_jobs
        reported_by_gpu = arrays.jobs
        if scope == "off" or reported_by_gpu is None:
            return job_idx, view.names
        try:
            inputs = (reported_by_gpu, view, job_idx, scope, shape)
            kept = self._reported
            if (
                kept is None
                or len(kept[0]) != len(inputs)
                or any(a is not b for a, b in zip(kept[0], inputs, strict=True))
                or not np.array_equal(kept[1], cls_idx)
            ):
                free = np.ones(len(cls_idx), dtype=np.bool_) if job_idx is None else job_idx < 0
                reported = ReportedJobs.couple(
                    reported_by_gpu,
                    free=free,
                    class_index=cls_idx,
                    nodes=arrays.nodes,
                    node_index=shape.topology.gpu_groups[:, N_LEVELS - 1],
                    scope=scope,
                    taken=view.names,
                )
                if kept is None or kept[2].names != reported.names:
                    log.info("reported_jobs", scope=scope, jobs=len(reported.names))
                kept = self._reported = (inputs, cls_idx, reported)
            reported = kept[2]
        except Exception:
            # Coupling is an optimisation: a fault in it never costs a tick its caps.
            log.exception("reported_jobs_failed")
            return job_idx, view.names
        if not reported.names:
            return job_idx, view.names
        shifted = np.where(reported.index >= 0, reported.index + len(view.names), -1)
        combined = shifted if job_idx is None else np.where(job_idx >= 0, job_idx, shifted)
        return combined, view.names + reported.names

    def class_indices(self, arrays: FleetArrays, overrides: Overrides) -> IntArray:
        """Each GPU's class: the operator's assignment, else its workload's, else the default
        (a workload naming a class the policy lacks also gets the default)."""
        index = self._class_index
        default = index[self.policy.defaults.class_]
        if not (overrides.gpu_classes or overrides.node_classes):
            # Each GPU's reported workload decides: the same while the fleet's list is (it
            # is kept while no GPU's workload changes, controller/fleet.py).
            kept = self._classes_of
            if kept is None or kept[0] is not arrays.workloads:
                by_workload = np.fromiter(
                    (default if w is None else index.get(w, default) for w in arrays.workloads),
                    dtype=np.int64,
                    count=len(arrays.uuids),
                )
                kept = self._classes_of = (arrays.workloads, by_workload)
            return kept[1].copy()
        classes = (
            overrides.class_of(u, node, w)
            for u, node, w in zip(arrays.uuids, arrays.nodes, arrays.workloads, strict=True)
        )
        return np.fromiter(
            (default if c is None else index.get(c, default) for c in classes),
            dtype=np.int64,
            count=len(arrays.uuids),
        )

    @staticmethod
    def pinned(arrays: FleetArrays, overrides: Overrides) -> FloatArray:
        """Fixed caps (pinned GPUs, drained nodes); NaN where the allocator is free."""
        n = len(arrays.uuids)
        if not (overrides.pins or overrides.drained):
            return np.full(n, np.nan)
        rows = zip(
            arrays.uuids,
            arrays.nodes,
            arrays.min_cap_w.tolist(),
            arrays.max_cap_w.tolist(),
            strict=True,
        )
        fixed = (overrides.pinned_w(u, node, lo, hi) for u, node, lo, hi in rows)
        return np.fromiter((np.nan if f is None else f for f in fixed), dtype=np.float64, count=n)

    def learn(
        self, now: float, arrays: FleetArrays, cls_idx: IntArray, node_of: IntArray, tick: int
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
                self.classes = ClassTable.from_policy(self.allocator_policy(), learner.profiles())
                log.info("learned_profiles", in_use=sorted(learner.profiles()))
        except Exception:
            # Learning is an optimisation: a fault in it never costs a tick its caps.
            log.exception("learning_failed", tick=tick)

    def allocate(
        self, tick: int, fleet: GpuArrays, limit_w: FloatArray, shape: Shape, alarm: Alarm
    ) -> tuple[FloatArray, str, float, float, float]:
        """(targets, status, objective, solve_ms, unused_w); any solver failure steers to the
        failsafe caps with an alarm, so a tick never ends without caps."""
        try:
            alloc = allocate_arrays(
                fleet,
                self.allocator_policy(),
                self.solver,
                budget_w=limit_w,
                # Its own, not the sums: the allocator adds them up the tree (given the
                # sums, it counted a node's missing GPUs at every level twice or more, and
                # one node with unknown GPUs above its budget put the whole site at minimum).
                reserved_w=shape.reserve_own_w,
                warm=self.warm,
                classes=self.classes,
                tree=shape.tree,
            )
        except Exception as exc:
            log.exception("allocation_failed", tick=tick, solver=self.solver)
            alarm("solver_failed", f"{type(exc).__name__}: {exc}"[:300])
            self.warm = None
            return shape.layout.failsafe_w.copy(), "fallback", math.nan, 0.0, 0.0
        self.warm = alloc
        alarm("solver_failed", None)
        # With jobs the solver certifies how close it came (Allocation.gap); say so when it
        # stopped short, so nobody reads the caps as optimal.
        alarm(
            "allocation_inexact",
            f"caps within {alloc.gap:.2%} of the optimum (jobs: solver stopped short)"
            if alloc.gap > INEXACT_GAP
            else None,
        )
        return alloc.caps_w, alloc.status, alloc.objective, alloc.solve_ms, alloc.unused_w

    def curve(
        self,
        fleet: GpuArrays,
        budget_w: FloatArray,
        shape: Shape,
        group: int,
        given_w: float | None,
    ) -> tuple[DemandCurve, float] | None:
        """A scope's demand curve and its offset (what the root's budget holds besides its
        GPUs' caps: overhead, unknown GPUs' reserve): the allocation's problem with the
        root's own budget lifted (the coordinator decides it), seen from the root. Exact
        around the budget the coordinator gave last (`given_w`), where the split will land.
        None if it fails (the coordinator then holds this scope's budget)."""
        try:
            lifted = budget_w.copy()
            lifted[group] = math.inf
            problem = build_problem(
                fleet,
                self.allocator_policy(),
                classes=self.classes,
                tree=shape.tree,
                budget_w=lifted,
                reserved_w=shape.reserve_own_w,
            )
            off = float(shape.topology.overhead_w[group] + shape.reserve_w[group])
            around = None if given_w is None or not math.isfinite(given_w) else given_w - off
            return demand_curve(problem, group, points=CURVE_POINTS, around_w=around), off
        except Exception:
            log.exception("demand_curve_failed")
            return None

    def throughput(self, arrays: FleetArrays, cls_idx: IntArray) -> FloatArray:
        """Reported application throughput where the workload gives one, else the profile's."""
        out = arrays.perf.copy()
        missing = np.isnan(out)
        for c, profile in enumerate(self.classes.profiles):
            sel = missing & (cls_idx == c)
            if sel.any():
                out[sel] = profile.value(arrays.power_w[sel])
        return out
