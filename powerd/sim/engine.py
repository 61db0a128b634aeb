"""One simulated run: the real allocator and safety planner steering mock GPUs in virtual time.

Each tick (virtual time, nothing sleeps, no broker):
1. scheduled workload changes take effect (idle windows);
2. telemetry: the planner hears every node's enforced caps, the allocator sees the model's
   draws and the caps that may be in force (as the controller builds its Fleet);
3. the allocator computes targets; the planner turns them into commands; the agents' part is
   played here: clamp to the device limits, apply, acknowledge with the enforced value. Cuts
   are admitted at once but raises only once the cuts paying for them are acknowledged, so
   the planner runs a second round at the same instant (a real controller, ticking every
   second, does this within the first seconds of a simulated minute);
4. the GPU model advances by the tick, and measured draw is checked against every budget.

`static` does no steering at all: every GPU keeps its TDP as its cap, as provisioned today.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator import Allocation, ClassTable, Fleet, Tree, allocate_arrays
from powerd.allocator.learn import ProfileLearner, learner_for
from powerd.backends.mock import GpuFleetModel, MockGpuSpec
from powerd.policy import LEVELS, Policy, RampRates
from powerd.profile import Profile
from powerd.ramp import lead_s, window_ceiling_w
from powerd.safety import FleetLayout, NodeCommand, OverloadRule, SafetyPlanner
from powerd.sim.scenario import HOUR_S, Scenario, ScenarioError
from powerd.sim.site import Mix, Site
from powerd.wire import GpuAck

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
STATIC = "static"
STEERED = ("fast", "uniform", "priority-bands")
POLICIES = (*STEERED, STATIC)
# Planner rounds per tick: cuts, then the raises they pay for (acks are instant here).
ROUNDS = 2
# Measured draw above a budget by more than this counts as an excess (float noise below).
EXCESS_TOL_W = 1e-3
# A GPU counts as held below its floor when its cap is this far under it and it wants more.
FLOOR_TOL_W = 0.5

Progress = Callable[[int], None]


@dataclass
class Series:
    """Per tick, for plots: facility draw and budget, each level's hottest group."""

    t_h: FloatArray
    facility_draw_w: FloatArray
    facility_budget_w: float
    peak_ratio: FloatArray  # (ticks, levels): max over the level's groups of draw / budget
    throughput: FloatArray  # GPU-equivalents at full speed
    # The facility's committed caps + overhead after each tick's steer (static: its TDP caps).
    facility_committed_w: FloatArray
    # Throughput weighted by class weight (what powerd maximises); empty when not kept.
    weighted_throughput: FloatArray = field(default_factory=lambda: np.zeros(0))


@dataclass
class RunResult:
    policy: str
    n_gpus: int
    duration_s: float
    feed_w: float
    work_gpu_s: float  # Σ throughput × dt: seconds of one GPU at full speed
    weighted_work_gpu_s: float  # the same weighted by class weight (what powerd maximises)
    work_by_class: dict[str, float]
    gpu_energy_j: float
    facility_energy_j: float  # GPUs plus node overhead
    over_budget_s: float  # time any budget was exceeded by measured draw
    longest_over_s: float  # the longest time one group's draw stayed above its budget
    over_budget_s_by_level: dict[str, float]
    max_excess_w: float
    max_excess_ratio: float  # highest measured draw / budget of any group (1 = at budget)
    floors_fit: bool  # class floors fit every budget (so the floor was owed)
    below_floor_share: dict[str, float]  # per floored class: GPU-time share held below it
    committed_over_ticks: int  # planner: committed caps above a budget (must stay 0)
    statuses: dict[str, int]
    # The facility's fastest moves from one tick to the next, W/s: of its committed caps
    # (what powerd allows) and of its measured draw (what the feed sees), up and down.
    ramp_w_per_s: dict[str, float]
    wall_s: float
    solve_ms_mean: float
    series: Series = field(repr=False)

    @property
    def mean_throughput(self) -> float:
        return self.work_gpu_s / self.duration_s

    @property
    def work_per_joule(self) -> float:
        """Full-speed GPU-seconds per joule of GPU energy."""
        return self.work_gpu_s / self.gpu_energy_j if self.gpu_energy_j > 0 else math.nan

    def summary(self) -> dict[str, object]:
        """The run's figures as JSON-ready values (no timing: those are not deterministic)."""
        return {
            "gpus": self.n_gpus,
            "feed_w": self.feed_w,
            "mean_throughput": self.mean_throughput,
            "work_gpu_h": self.work_gpu_s / 3600.0,
            "weighted_work_gpu_h": self.weighted_work_gpu_s / 3600.0,
            "work_gpu_h_by_class": {k: v / 3600.0 for k, v in self.work_by_class.items()},
            "gpu_energy_kwh": self.gpu_energy_j / 3.6e6,
            "facility_energy_kwh": self.facility_energy_j / 3.6e6,
            "gpu_h_per_mwh": self.work_gpu_s / 3600.0 / (self.gpu_energy_j / 3.6e9)
            if self.gpu_energy_j > 0
            else None,
            "work_per_joule": self.work_per_joule,
            "over_budget_s": self.over_budget_s,
            "longest_over_budget_s": self.longest_over_s,
            "over_budget_s_by_level": self.over_budget_s_by_level,
            "max_excess_w": self.max_excess_w,
            "max_draw_over_budget": self.max_excess_ratio,
            "floors_fit": self.floors_fit,
            "below_floor_share": self.below_floor_share,
            "committed_over_ticks": self.committed_over_ticks,
            "statuses": self.statuses,
            "ramp_w_per_s": self.ramp_w_per_s,
        }


class _Nodes:
    """GPU index ranges per node (GPUs are contiguous per node in a Site)."""

    def __init__(self, site: Site, uuids: list[str]) -> None:
        names: list[str] = []
        bounds = [0]
        for i, node in enumerate(site.gpu_nodes):
            if not names or names[-1] != node:
                if names:
                    bounds.append(i)
                names.append(node)
        bounds.append(site.n_gpus)
        self.names = names
        self.ranges = list(itertools.pairwise(bounds))
        self.uuids = [uuids[a:b] for a, b in self.ranges]
        self.index = {name: k for k, name in enumerate(names)}


class _Run:
    """The state of one run and its accounting; `simulate` drives it tick by tick."""

    def __init__(
        self,
        scenario: Scenario,
        site: Site,
        mix: Mix,
        policy_name: str,
        *,
        learn: bool = False,
        profiles: Mapping[str, Profile] | None = None,
    ) -> None:
        spec = scenario.spec
        self.site = site
        self.mix = mix
        self.policy_name = policy_name
        policy = site.policy
        topo = site.topology
        n = site.n_gpus
        self.model = GpuFleetModel(
            n,
            list(mix.workloads),
            spec=MockGpuSpec(
                min_cap_w=site.min_cap_w,
                max_cap_w=site.tdp_w,
                default_cap_w=site.tdp_w if policy_name == STATIC else _start_cap_w(site),
            ),
            seed=spec.seed,
            uuid_prefix="GPU-sim",
        )
        model = self.model
        self.nodes = _Nodes(site, model.uuids)
        # `profiles`: class curves to steer by instead of the policy's (an oracle's run).
        self.profiles = dict(profiles or {})
        self.classes = classes = ClassTable.from_policy(policy, self.profiles)
        # Online learning as the controller does it (TickEngine._learn): from every GPU's
        # (draw, perf) with perf from its true curve, the one the model delivers.
        self.learner = (
            _sim_learner(policy, spec.tick_s) if learn and policy_name in STEERED else None
        )
        self.tree = Tree(topo)
        self.budget = topo.budget_w.copy()
        self.windows = _windows(scenario, site)
        self.rates: RampRates | None = spec.ramp_w_per_s or policy.control.ramp_w_per_s
        self.lead_s = lead_s(policy.control.tick_s)
        self.tick_s = spec.tick_s
        # Groups rated for an overload: their caps may commit above the budget while their
        # draw is steered below it (OverloadRule, as the controller applies it).
        self.overload = OverloadRule.from_policy(policy) if policy_name != STATIC else None
        self.finite = np.isfinite(self.budget)
        self.ratio_budget = np.where(self.finite & (self.budget > 0), self.budget, np.inf)
        cls = mix.class_index
        self.weight = classes.weight[cls]
        self.floor_w = classes.floor_w[cls]
        self.floored_gpu = self.floor_w > 0
        floor_lo = np.where(self.floored_gpu, np.maximum(self.floor_w, model.min_cap_w), 0.0)
        floor_lo = np.maximum(floor_lo, model.min_cap_w)
        floor_lo = np.minimum(floor_lo, np.minimum(model.max_cap_w, classes.ceiling_w[cls]))
        f = self.finite
        self.floors_fit = bool(
            np.all(topo.group_sums(floor_lo)[f] + topo.overhead_w[f] <= self.budget[f])
        )
        self.planner = None if policy_name == STATIC else self._planner(scenario)
        self.no_pin = np.full(n, np.nan)
        self.not_stale = np.zeros(n, dtype=np.bool_)
        self.uuids = tuple(model.uuids)
        self.warm: Allocation | None = None
        # The last ack per GPU and what it said (NaN: none yet).
        # Placeholders: NaN in ack_req marks every GPU as changed on its first command.
        self.acks: list[GpuAck] = [GpuAck(requested_w=site.tdp_w)] * n
        self.ack_req = np.full(n, np.nan)
        self.ack_enf = np.full(n, np.nan)
        self.level_masks = [topo.level == lv for lv in range(len(LEVELS))]
        self.plan_tick = 0
        n_classes = len(classes.names)
        n_levels = len(LEVELS)
        # Accounting.
        self.over_s = 0.0
        self.over_by_level = np.zeros(n_levels)
        self.over_run_s = np.zeros(topo.n_groups)  # per group: how long it has been over
        self.longest_over_s = 0.0
        self.max_excess = 0.0
        self.max_ratio = 0.0
        self.committed_over = 0
        self.statuses: dict[str, int] = {}
        self.solve_ms: list[float] = []
        self.work = np.zeros(n_classes)
        self.weighted_work = 0.0
        self.below_floor_s = np.zeros(n_classes)
        self.step_peak = np.zeros(n_levels)

    def _planner(self, scenario: Scenario) -> SafetyPlanner:
        """The safety planner, taught the caps the fleet starts at."""
        site, model = self.site, self.model
        policy = site.policy
        planner = SafetyPlanner(
            _planner_policy(policy, scenario.duration_s),
            FleetLayout.build(
                policy, model.uuids, list(site.gpu_nodes), model.min_cap_w, model.max_cap_w
            ),
        )
        # The agents' first telemetry: from then on acks keep the planner's knowledge exact.
        caps_now = model.cap_w.tolist()
        for name, (a, b), ids in zip(
            self.nodes.names, self.nodes.ranges, self.nodes.uuids, strict=True
        ):
            planner.on_telemetry(name, dict(zip(ids, caps_now[a:b], strict=True)), received_at=0.0)
        # The simulation starts the fleet: no earlier controller has commands on their way.
        planner.assume_settled()
        return planner

    def steer(self, now: float) -> None:
        """One controller tick: allocate from fresh telemetry, plan, apply, acknowledge."""
        planner = self.planner
        assert planner is not None
        model = self.model
        if self.learner is not None:
            self._learn(now)
        committed = planner.committed_w()
        fleet = Fleet(
            uuids=self.uuids,
            topology=self.site.topology,
            min_cap_w=model.min_cap_w,
            max_cap_w=model.max_cap_w,
            power_w=model.power_w.copy(),
            # The damping term steers toward the caps that may be in force.
            cap_w=np.minimum(committed, model.max_cap_w),
            class_index=self.mix.class_index,
            stale=self.not_stale,
            pinned_w=self.no_pin,
        )
        limit = budget = self._budget_at(now)
        if self.overload is not None:
            topo = self.site.topology
            limit = self.overload.limits_w(
                budget,
                topo.group_sums(committed) + topo.overhead_w,
                topo.group_sums(model.power_w) + topo.overhead_w,
            )
        alloc = allocate_arrays(
            fleet,
            self.site.policy,
            self.policy_name,
            budget_w=limit,
            warm=self.warm,
            classes=self.classes,
            tree=self.tree,
        )
        self.warm = alloc
        self.statuses[alloc.status] = self.statuses.get(alloc.status, 0) + 1
        self.solve_ms.append(alloc.solve_ms)
        for round_no in range(ROUNDS):
            self.plan_tick += 1
            plan = planner.plan(
                self.plan_tick, now, alloc.caps_w, budget_w=limit, priority=self.weight
            )
            self._apply(plan.commands, plan.sent_w, now)
            if round_no == ROUNDS - 1 or not plan.withheld.any():
                break
        # Committed caps once the tick's commands are acknowledged: above a budget (or a
        # rated group's limit) would be a planner bug.
        topo = self.site.topology
        after = topo.group_sums(planner.committed_w()) + topo.overhead_w
        self.committed_over += int((after > limit + 1e-6).any())

    def _learn(self, now: float) -> None:
        learner = self.learner
        assert learner is not None
        model = self.model
        learner.observe(
            now,
            self.mix.class_index,
            model.power_w,
            model.throughput(),
            np.ones(model.power_w.size, dtype=np.bool_),
            min_w=model.min_cap_w,
        )
        if learner.due() and learner.refit_next(now):
            learned = {**learner.profiles(), **self.profiles}
            self.classes = ClassTable.from_policy(self.site.policy, learned)

    def _budget_at(self, now: float) -> FloatArray:
        """The budgets until the next steer (a tick on): the policy's, lowered by each
        scheduled window to the least its ramp reaches over the tick (a controller ticking
        every second follows the ramp within it)."""
        if not self.windows:
            return self.budget
        out = self.budget.copy()
        t1 = now + self.tick_s
        for g, budget_w, start, end in self.windows:
            if start - self.lead_s < t1 and now < end:
                least = budget_w  # the window (or its lead) falls within the tick
            else:
                least = min(
                    window_ceiling_w(budget_w, start, end, t, self.rates, lead_s=self.lead_s)
                    for t in (now, t1)
                )
            out[g] = min(out[g], least)
        return out

    def grid_budget(self, t: float) -> FloatArray:
        """The budgets the feeds hold the site to at `t`: the policy's, and each scheduled
        window's target from its start, ramped as the grid expects (no lead)."""
        if not self.windows:
            return self.budget
        out = self.budget.copy()
        for g, budget_w, start, end in self.windows:
            out[g] = min(out[g], window_ceiling_w(budget_w, start, end, t, self.rates))
        return out

    def committed_facility_w(self) -> float:
        planner = self.planner
        assert planner is not None
        topo = self.site.topology
        return float(topo.group_sums(planner.committed_w())[0] + topo.overhead_w[0])

    def _apply(self, commands: list[NodeCommand], sent_w: FloatArray, now: float) -> None:
        """The agents' part: clamp each command's caps to the device, apply, acknowledge.

        Agents apply decreases before increases; here every cap changes at the same instant
        of virtual time (the model's draw then moves with its lag), so order cannot show.
        """
        model = self.model
        idx = np.flatnonzero(~np.isnan(sent_w))
        target = np.clip(sent_w[idx], model.min_cap_w[idx], model.max_cap_w[idx])
        # GpuFleetModel.set_cap for many GPUs at once.
        model.requested_cap_w[idx] = target
        model.cap_w[idx] = np.minimum(target, model.override_w[idx])
        # Most GPUs are sent what they were sent last time: their ack is the same object.
        changed = idx[(sent_w[idx] != self.ack_req[idx]) | (model.cap_w[idx] != self.ack_enf[idx])]
        for i, r, e in zip(
            changed.tolist(), sent_w[changed].tolist(), model.cap_w[changed].tolist(), strict=True
        ):
            self.acks[i] = GpuAck(requested_w=r, enforced_w=e)
        self.ack_req[changed] = sent_w[changed]
        self.ack_enf[changed] = model.cap_w[changed]
        nodes = self.nodes
        assert self.planner is not None
        for cmd in commands:
            k = nodes.index[cmd.node]
            a, b = nodes.ranges[k]
            acks = dict(zip(nodes.uuids[k], self.acks[a:b], strict=True))
            self.planner.on_ack(cmd.node, self.plan_tick, acks)

    def advance(self, dt: float, t_end: float) -> None:
        """Move the GPUs on by dt (to `t_end`) with the caps in force, and account for the
        interval: its mean draw against the budgets' mean over it (a scheduled window's ramp
        moves them), its closing sample against the budgets at its end."""
        budget = self.grid_budget(t_end)
        mean_budget = budget
        if self.windows:
            points = np.linspace(t_end - dt, t_end, 9)
            mean_budget = np.mean([self.grid_budget(float(t)) for t in points], axis=0)
        model = self.model
        topo = self.site.topology
        cls = self.mix.class_index
        caps = model.cap_w.copy()
        demand = model.demand_w.copy()
        energy_before = model.energy_j.copy()
        model.advance(dt)
        # Measured draw: the interval's mean (what a meter integrates) and the closing sample.
        mean_w = (model.energy_j - energy_before) / dt
        mean_draw = self.tree.sums(mean_w) + topo.overhead_w
        closing = self.tree.sums(model.power_w) + topo.overhead_w
        draw = np.maximum(mean_draw, closing)
        excess = np.where(
            self.finite, np.maximum(mean_draw - mean_budget, closing - budget), -np.inf
        )
        over = excess > EXCESS_TOL_W
        self.over_run_s = np.where(over, self.over_run_s + dt, 0.0)
        if over.any():
            self.longest_over_s = max(self.longest_over_s, float(self.over_run_s.max()))
            self.over_s += dt
            self.over_by_level[np.unique(topo.level[over])] += dt
            self.max_excess = max(self.max_excess, float(excess[over].max()))
        ratio = draw / np.where(budget < self.budget, budget, self.ratio_budget)
        self.max_ratio = max(self.max_ratio, float(ratio.max()))
        for lv, mask in enumerate(self.level_masks):
            self.step_peak[lv] = max(self.step_peak[lv], float(ratio[mask].max()))
        tput = model.throughput()
        self.work += np.bincount(cls, weights=tput, minlength=self.work.size) * dt
        self.weighted_work += float(np.dot(self.weight, tput)) * dt
        held = (
            self.floored_gpu & (caps < self.floor_w - FLOOR_TOL_W) & (demand > caps + FLOOR_TOL_W)
        )
        if held.any():
            self.below_floor_s += np.bincount(cls[held], minlength=self.below_floor_s.size) * dt


def _sim_learner(policy: Policy, tick_s: float) -> ProfileLearner | None:
    """The policy's learner with learning on (classes that say `learn: false` stay off)."""
    ctl = policy.spec.control
    on = ctl.model_copy(update={"learn": ctl.learn.model_copy(update={"enabled": True})})
    return learner_for(
        replace(policy, spec=policy.spec.model_copy(update={"control": on})), tick_s=tick_s
    )


def _windows(scenario: Scenario, site: Site) -> list[tuple[int, float, float, float]]:
    """The scenario's schedule on this site: (group index, budget W, start s, end s)."""
    topo = site.topology
    index = {name: g for g, name in enumerate(topo.names)}
    out, problems = [], []
    for i, w in enumerate(scenario.spec.schedule):
        name = w.group or topo.names[0]
        g = index.get(name)
        if g is None:
            problems.append((f"schedule[{i}].group", f"no group '{name}' on this site"))
            continue
        policy_w = float(topo.budget_w[g])
        if w.fraction is not None and not math.isfinite(policy_w):
            problems.append((f"schedule[{i}].fraction", f"'{name}' has no budget; give budget_w"))
            continue
        budget_w = policy_w * w.fraction if w.fraction is not None else float(w.budget_w or 0.0)
        out.append((g, min(budget_w, policy_w), w.start_h * HOUR_S, w.end_h * HOUR_S))
    if problems:
        raise ScenarioError(scenario.source, problems)
    return out


def _rates(series: FloatArray, dt: float) -> tuple[float, float]:
    """The fastest rise and fall of a series sampled every dt, W/s (0 when it never moves)."""
    if series.size < 2:
        return 0.0, 0.0
    steps = np.diff(series) / dt
    return max(0.0, float(steps.max())), max(0.0, float(-steps.min()))


def _start_cap_w(site: Site) -> float:
    """Agents start at their failsafe cap before the first command; where the failsafe caps
    do not fit the budgets (a site grown past its policy's failsafe), at the device minimum."""
    failsafe = min(max(site.policy.defaults.failsafe_w, site.min_cap_w), site.tdp_w)
    topo = site.topology
    finite = np.isfinite(topo.budget_w)
    committed = topo.group_sums(np.full(site.n_gpus, failsafe)) + topo.overhead_w
    return failsafe if bool(np.all(committed[finite] <= topo.budget_w[finite])) else site.min_cap_w


def _planner_policy(policy: Policy, duration_s: float) -> Policy:
    """The policy as the planner sees it here: telemetry is never late in the simulation
    (acks carry every enforced cap), so GPUs never go stale."""
    control = policy.spec.control
    relaxed = control.model_copy(
        update={"stale_after_s": max(control.stale_after_s, 2 * duration_s)}
    )
    return replace(policy, spec=policy.spec.model_copy(update={"control": relaxed}))


def simulate(
    scenario: Scenario,
    site: Site,
    mix: Mix,
    policy_name: str,
    *,
    progress: Progress | None = None,
    learn: bool = False,
    profiles: Mapping[str, Profile] | None = None,
) -> RunResult:
    """Run the scenario on the site under one policy (a solver name, or `static`).

    `learn`: steer by curves learned online from the GPUs' perf (docs/simulator.md,
    "Learning profiles"); `profiles`: steer these classes by these curves instead of the
    policy's (e.g. the workloads' true curves: the best the allocator can do)."""
    if policy_name not in POLICIES:
        raise ValueError(f"unknown policy '{policy_name}'; valid: {', '.join(POLICIES)}")
    t_start = time.perf_counter()
    tick_s = scenario.spec.tick_s
    n_ticks = scenario.ticks
    run = _Run(scenario, site, mix, policy_name, learn=learn, profiles=profiles)
    # The controller reacts to a change of demand within its own tick (1 s by default), far
    # inside a simulated tick: the first control tick of every step is simulated as such.
    react_s = min(site.policy.control.tick_s, tick_s / 2)
    events = mix.events
    next_event = 0
    n_levels = len(LEVELS)
    fac_draw = np.zeros(n_ticks)
    fac_committed = np.zeros(n_ticks)
    peak_ratio = np.zeros((n_ticks, n_levels))
    tput_series = np.zeros(n_ticks)
    weighted_series = np.zeros(n_ticks)
    for k in range(n_ticks):
        now = k * tick_s
        while next_event < len(events) and events[next_event][0] <= now:
            _, idx, workload = events[next_event]
            run.model.set_workload(idx, workload)
            next_event += 1
        energy_before = float(run.model.energy_j.sum())
        work_before = float(run.work.sum())
        weighted_before = run.weighted_work
        run.step_peak[:] = -np.inf
        if run.planner is not None:
            if k == 0:
                # The window opens on a site already under powerd: steer before time passes.
                run.steer(now)
            run.advance(react_s, now + react_s)
            run.steer(now + react_s)
            fac_committed[k] = run.committed_facility_w()
            run.advance(tick_s - react_s, now + tick_s)
        else:
            run.advance(tick_s, now + tick_s)
            fac_committed[k] = float(site.topology.group_sums(run.model.cap_w)[0]) + float(
                site.topology.overhead_w[0]
            )
        fac_draw[k] = (float(run.model.energy_j.sum()) - energy_before) / tick_s + float(
            site.topology.overhead_w[0]
        )
        peak_ratio[k] = run.step_peak
        tput_series[k] = (float(run.work.sum()) - work_before) / tick_s
        weighted_series[k] = (run.weighted_work - weighted_before) / tick_s
        if progress is not None:
            progress(1)

    duration = n_ticks * tick_s
    gpu_energy = float(run.model.energy_j.sum())
    wall = time.perf_counter() - t_start
    classes = run.classes
    gpus_per_class = np.bincount(mix.class_index, minlength=len(classes.names))
    result = RunResult(
        policy=policy_name,
        n_gpus=site.n_gpus,
        duration_s=duration,
        feed_w=site.feed_w,
        work_gpu_s=float(run.work.sum()),
        weighted_work_gpu_s=run.weighted_work,
        work_by_class={
            c: float(run.work[i]) for i, c in enumerate(classes.names) if gpus_per_class[i] > 0
        },
        gpu_energy_j=gpu_energy,
        facility_energy_j=gpu_energy + float(site.topology.overhead_w[0]) * duration,
        over_budget_s=run.over_s,
        longest_over_s=run.longest_over_s,
        over_budget_s_by_level={LEVELS[lv]: float(run.over_by_level[lv]) for lv in range(n_levels)},
        max_excess_w=run.max_excess,
        max_excess_ratio=run.max_ratio,
        floors_fit=run.floors_fit,
        below_floor_share={
            classes.names[c]: float(run.below_floor_s[c] / (gpus_per_class[c] * duration))
            for c in range(len(classes.names))
            if classes.floor_w[c] > 0 and gpus_per_class[c] > 0
        },
        committed_over_ticks=run.committed_over,
        statuses=run.statuses,
        ramp_w_per_s=dict(
            zip(
                ("committed_up", "committed_down", "draw_up", "draw_down"),
                (*_rates(fac_committed, tick_s), *_rates(fac_draw, tick_s)),
                strict=True,
            )
        ),
        wall_s=wall,
        solve_ms_mean=float(np.mean(run.solve_ms)) if run.solve_ms else 0.0,
        series=Series(
            t_h=np.arange(1, n_ticks + 1, dtype=np.float64) * (tick_s / 3600.0),
            facility_draw_w=fac_draw,
            facility_budget_w=float(run.budget[0]),
            peak_ratio=peak_ratio,
            throughput=tput_series,
            facility_committed_w=fac_committed,
            weighted_throughput=weighted_series,
        ),
    )
    log.debug(
        "sim_run_finished",
        policy=policy_name,
        gpus=site.n_gpus,
        ticks=n_ticks,
        wall_s=round(wall, 3),
        over_budget_s=run.over_s,
        longest_over_s=run.longest_over_s,
    )
    return result
