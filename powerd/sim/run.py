"""One simulated run: the shipped tick (TickEngine) steering mock GPUs in virtual time.

Each tick (virtual time, nothing sleeps, no broker):
1. scheduled workload changes take effect (idle windows);
2. the controller's tick: every node's telemetry (powerd.sim.agents plays the agents), then
   `TickEngine.step`, which decides as the controller does (budgets in force and their
   ramps, overload ratings, jobs, learning, the allocator, the safety planner); its commands
   are applied and acknowledged at once. Cuts are admitted at once but raises only once the
   cuts paying for them are acknowledged, so while raises wait the engine ticks again at
   the same instant, a few times at most (a real controller ticks again as soon as the
   acks are in, `control.ack_ticks`, and ticks every second);
3. the GPU model advances by the tick, and measured draw is checked against every budget.

The engine runs the policy with its tick set to the simulation's (a controller that ticks
that often: a scheduled cut is in force two of them ahead) and with telemetry never stale
(every steer hears every node). `static` does no steering at all: every GPU keeps its TDP
as its cap, as provisioned today.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator import ClassTable, Tree
from powerd.backends.mock import MockGpuSpec, SimulatedGpus
from powerd.controller.churn import Churn
from powerd.controller.overrides import OverrideError, ScheduledBudget
from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.policy import LEVELS, Policy, RampRates
from powerd.profile import Profile
from powerd.ramp import window_ceiling_w
from powerd.safety import SafePlan
from powerd.sim import POLICIES, STATIC
from powerd.sim.agents import SimAgents
from powerd.sim.scenario import HOUR_S, Scenario, ScenarioError
from powerd.sim.site import Mix, Site

log = structlog.get_logger(__name__)

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
# Controller ticks per steer at most: cuts, then the raises they pay for (acks are instant
# here), while raises wait; never more than the controller makes in a simulated tick.
MAX_ROUNDS = 6


def rounds_per_steer(policy: Policy, tick_s: float) -> int:
    """How many times the engine may tick in one steer: as often as the controller ticks
    (`control.tick_s`) within a simulated tick, or its first tick and the extra ones it
    makes on the acks of a tick that held raises back (`control.ack_ticks`: within a
    controller tick, acks being instant here), whichever is more; at most MAX_ROUNDS."""
    regular = math.floor(tick_s / policy.control.tick_s + 1e-9)
    return max(1, min(MAX_ROUNDS, max(regular, 1 + policy.control.ack_ticks)))


# Measured draw above a budget by more than this counts as an excess (float noise below).
EXCESS_TOL_W = 1e-3
# Cap moves are counted from this time on (the first steers set every cap: start-up).
CHURN_AFTER_S = 60.0
# A GPU counts as held below its floor when its cap is this far under it and it wants more.
FLOOR_TOL_W = 0.5

Progress = Callable[[int], None]
# Asked after every simulated tick with (tick index, work so far, weighted work so far, in
# GPU-seconds): True ends the run there, before its last tick (the oversubscription search's
# proof that a size fails, powerd/sim/study.py `StopRule`). The result covers the ticks run.
Stop = Callable[[int, float, float], bool]
# Called with every engine tick's report and plan as the controller would publish them.
Trace = Callable[["TickReport", "SafePlan"], None]


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
    # Time a group's draw was past what its overload rating allows (`beyond_rating`); with
    # no rating, every second over a budget. Must stay 0.
    beyond_rating_s: float
    statuses: dict[str, int]
    # The facility's fastest moves from one tick to the next, W/s: of its committed caps
    # (what powerd allows) and of its measured draw (what the feed sees), up and down.
    ramp_w_per_s: dict[str, float]
    wall_s: float
    solve_ms_mean: float
    series: Series = field(repr=False)
    # Cap moves per steer after the first minute (controller/churn.py; empty for static).
    churn: dict[str, float | int] = field(default_factory=dict)
    # Where a `stop` rule ended the run (s into the scenario); None: it ran to the end.
    stopped_s: float | None = None

    @property
    def within_rating(self) -> bool:
        """Over a budget at some moment, never past what its overload rating allows."""
        return self.over_budget_s > 0 and self.beyond_rating_s == 0

    @property
    def mean_throughput(self) -> float:
        return self.work_gpu_s / self.duration_s

    @property
    def work_per_joule(self) -> float:
        """Full-speed GPU-seconds per joule of GPU energy (the GPUs' efficiency)."""
        return self.work_gpu_s / self.gpu_energy_j if self.gpu_energy_j > 0 else math.nan

    @property
    def work_per_facility_joule(self) -> float:
        """Full-speed GPU-seconds per joule of facility energy (GPUs plus overhead): what
        the feed's energy buys, beside the facility energy a report shows."""
        e = self.facility_energy_j
        return self.work_gpu_s / e if e > 0 else math.nan

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
            "work_per_joule": self.work_per_joule,  # per joule of GPU energy
            "work_per_facility_joule": self.work_per_facility_joule,
            "over_budget_s": self.over_budget_s,
            "longest_over_budget_s": self.longest_over_s,
            "over_budget_s_by_level": self.over_budget_s_by_level,
            "max_excess_w": self.max_excess_w,
            "max_draw_over_budget": self.max_excess_ratio,
            "floors_fit": self.floors_fit,
            "below_floor_share": self.below_floor_share,
            "committed_over_ticks": self.committed_over_ticks,
            "beyond_rating_s": self.beyond_rating_s,
            "statuses": self.statuses,
            "ramp_w_per_s": self.ramp_w_per_s,
            "churn": self.churn,
        }


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
        trace: Trace | None = None,
    ) -> None:
        spec = scenario.spec
        self.trace = trace
        self.site = site
        self.mix = mix
        self.policy_name = policy_name
        policy = site.policy
        topo = site.topology
        n = site.n_gpus
        self.model = SimulatedGpus(
            n,
            list(mix.workloads),
            compiled=True,
            spec=MockGpuSpec(
                min_cap_w=site.min_cap_w,
                max_cap_w=site.tdp_w,
                default_cap_w=site.tdp_w if policy_name == STATIC else start_cap_w(site),
            ),
            seed=spec.seed,
            uuid_prefix="GPU-sim",
        )
        model = self.model
        # The classes as the policy has them (the accounting's weights and floors).
        self.classes = classes = ClassTable.from_policy(policy)
        self.tree = Tree(topo)
        self.budget = topo.budget_w.copy()
        self.windows = _windows(scenario, site)
        self.rates = spec.ramp_w_per_s or policy.control.ramp_w_per_s
        self.tick_s = spec.tick_s
        self.rounds = rounds_per_steer(policy, spec.tick_s)
        self.finite = np.isfinite(self.budget)
        self.ratio_budget = np.where(self.finite & (self.budget > 0), self.budget, np.inf)
        # Each group's overload rating (docs/policy.md, "overload"), in topology order.
        self.rated, self.rating_pct, self.rating_for_s = _ratings(policy)
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
        self.engine: TickEngine | None = None
        self.agents: SimAgents | None = None
        if policy_name != STATIC:
            self.agents = SimAgents(
                model,
                site.gpu_nodes,
                [classes.names[c] for c in cls.tolist()],
                period_s=spec.tick_s,
                jobs=mix.gpu_jobs,
            )
            self.engine = self._engine(scenario, learn=learn, profiles=profiles or {})
        self.level_masks = [topo.level == lv for lv in range(len(LEVELS))]
        # The accounting's compiled loops (numba loads on a run's start, not on an import).
        from powerd.sim import kernel

        self.kernel = kernel
        self.group_level = np.ascontiguousarray(topo.level, dtype=np.int64)
        self.class_index = np.ascontiguousarray(cls, dtype=np.int64)
        # The groups level by level, and where each level starts: every level's highest ratio
        # in one reduction (where every level has groups, as a site's tree does).
        self.by_level = np.argsort(topo.level, kind="stable")
        counts = np.array([int(m.sum()) for m in self.level_masks])
        self.level_starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        self.levels_full = bool((counts > 0).all())
        n_classes = len(classes.names)
        n_levels = len(LEVELS)
        # Accounting.
        self.over_s = 0.0
        self.over_by_level = np.zeros(n_levels)
        self.over_levels = np.zeros(n_levels, dtype=np.bool_)  # in the last step (scratch)
        self.over_run_s = np.zeros(topo.n_groups)  # per group: how long it has been over
        self.longest_over_s = 0.0
        self.max_excess = 0.0
        self.max_ratio = 0.0
        self.committed_over, self.beyond_s = 0, 0.0  # ticks, seconds (beyond_rating)
        self.statuses: dict[str, int] = {}
        self.solve_ms: list[float] = []
        self.work = np.zeros(n_classes)
        self.weighted_work = 0.0
        self.below_floor_s = np.zeros(n_classes)
        self.step_peak = np.zeros(n_levels)
        self.churn = Churn()

    def _engine(
        self, scenario: Scenario, *, learn: bool, profiles: Mapping[str, Profile]
    ) -> TickEngine:
        """The shipped tick, set up as a controller starting over this site: the policy as
        it runs here, the scenario's schedule as scheduled budgets, and the agents' first
        telemetry heard (no earlier controller has commands on their way)."""
        site, agents = self.site, self.agents
        assert agents is not None
        policy = engine_policy(
            site.policy, scenario, learn=learn, profiles=profiles, rates=self.rates
        )
        engine = TickEngine(policy, solver=self.policy_name)
        # Each cap's explanation only where a trace may read the reports.
        engine.explain = self.trace is not None
        for k, (g, budget_w, start, end) in enumerate(self.windows):
            entry = ScheduledBudget(
                f"sim-{k}", site.topology.names[g], budget_w, start, end, "scenario", "sim", 0.0
            )
            try:
                engine.overrides.add_schedule(policy, entry.on_monotonic(0.0, 0.0), 0.0)
            except OverrideError as exc:
                raise ScenarioError(scenario.source, [(f"schedule[{k}]", str(exc))]) from exc
        for msg in agents.telemetry(0.0):
            engine.on_telemetry(msg, 0.0)
        engine.observe(0.0)
        # The simulation starts the fleet: no earlier controller has commands on their way.
        engine.planner.assume_settled()
        return engine

    def steer(self, now: float) -> None:
        """One controller tick: every node's telemetry, the engine's decisions, the agents
        applying and acknowledging them; while raises wait on the cuts that pay for them,
        the engine ticks again at the same instant (acks are instant here), as many times
        as the controller ticks in a simulated tick (`rounds_per_steer`)."""
        engine, agents = self.engine, self.agents
        assert engine is not None and agents is not None
        engine.on_fleet_readings(*agents.fleet_readings(now), now)
        self._read_meters(engine, now)
        caps_before = self.model.cap_w.copy()
        for _ in range(self.rounds):
            report, plan = engine.step(now, now)
            if self.trace is not None:
                self.trace(report, plan)
            self.statuses[report.status] = self.statuses.get(report.status, 0) + 1
            self.solve_ms.append(report.solve_ms)
            # Another round only where acks can release a held raise, as the controller
            # waits (`SafePlan.cuts_awaited`: a cut in flight, not refused).
            again = bool(engine.cuts_awaited(plan))
            engine.on_plan_acked(plan, agents.apply_plan(plan))
            # Committed caps once the tick's commands are acknowledged: above a budget (or
            # a rated group's limit) would be a planner bug.
            layout = engine.planner.layout
            topo = layout.topology if layout is not None else self.site.topology
            limit = report.group_budget_w if report.group_limit_w is None else report.group_limit_w
            self.committed_over += int(
                self.kernel.any_over(
                    topo.gpu_groups, engine.planner.committed_w(), topo.overhead_w, limit, 1e-6
                )
            )
            if not again:
                break
        if now >= CHURN_AFTER_S:
            self.churn.add(caps_before, self.model.cap_w)

    def _read_meters(self, engine: TickEngine, now: float) -> None:
        """A metered group's meter reads what its GPUs truly draw now plus its overhead
        (docs/simulator.md): the overload rule steers on it as a controller would."""
        metered = engine.meters.specs
        if not metered:
            return
        topo = self.site.topology
        truth = self.tree.sums(self.model.power_w) + topo.overhead_w
        for g, name in enumerate(topo.names):
            if name in metered:
                engine.meter_book.put(name, float(truth[g]), now)

    def grid_budget(self, t: float) -> FloatArray:
        return grid_budget_at(self.budget, self.windows, self.rates, t)

    def committed_facility_w(self) -> float:
        engine = self.engine
        assert engine is not None
        topo = self.site.topology
        return float(engine.planner.committed_w().sum() + topo.overhead_w[0])

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
        cls = self.class_index
        # GPUs held below their floor: by the caps and demand in force over the interval.
        self.kernel.add_below_floor(
            self.floored_gpu, model.cap_w, self.floor_w, model.demand_w, FLOOR_TOL_W, cls, dt,
            self.below_floor_s,
        )  # fmt: skip
        mean_w = model.energy_j.copy()
        model.advance(dt)
        # Measured draw: the interval's mean (what a meter integrates) and the closing sample,
        # each group's GPUs' (its overhead added by check_groups).
        np.subtract(model.energy_j, mean_w, out=mean_w)
        mean_w /= dt
        mean_sum = self.tree.sums(mean_w)
        closing_sum = self.tree.sums(model.power_w)
        # (The policy's budgets themselves where no window moves them: none below them.)
        below = budget is not self.budget
        ratio_budget = (
            np.where(budget < self.budget, budget, self.ratio_budget)
            if below
            else self.ratio_budget
        )
        over_levels = self.over_levels
        peak = self.step_peak if self.levels_full else np.full(len(LEVELS), -np.inf)
        longest, excess, ratio = self.kernel.check_groups(
            mean_sum, closing_sum, topo.overhead_w, mean_budget, budget, self.finite,
            ratio_budget, self.group_level, EXCESS_TOL_W, dt, self.over_run_s, over_levels,
            peak,
        )  # fmt: skip
        if longest > -math.inf:  # a group over a budget
            self.longest_over_s = max(self.longest_over_s, longest)
            self.over_s += dt
            self.over_by_level[over_levels] += dt
            self.max_excess = max(self.max_excess, excess)
            if not self.rated or beyond_rating(
                self.over_run_s,
                np.maximum(mean_sum - mean_budget, closing_sum - budget) + topo.overhead_w,
                np.minimum(mean_budget, budget),
                self.rating_pct,
                self.rating_for_s,
            ):
                self.beyond_s += dt
        self.max_ratio = max(self.max_ratio, ratio)
        if not self.levels_full:
            overhead = topo.overhead_w
            level_ratio = np.maximum(mean_sum + overhead, closing_sum + overhead) / ratio_budget
            for lv, mask in enumerate(self.level_masks):
                self.step_peak[lv] = max(self.step_peak[lv], float(level_ratio[mask].max()))
        # The interval's mean (phases within it integrated), a synchronous job at the pace
        # of its slowest GPU.
        tput = self.mix.sync_throughput(model.step_throughput)
        self.kernel.add_work(cls, tput, dt, self.work)
        self.weighted_work += float(np.dot(self.weight, tput)) * dt


def grid_budget_at(
    budget: FloatArray,
    windows: list[tuple[int, float, float, float]],
    rates: RampRates | None,
    t: float,
) -> FloatArray:
    """The budgets the feeds hold the site to at `t`: the policy's (`budget`), and each
    scheduled window's target from its start, ramped as the grid expects (no lead)."""
    if not windows:
        return budget
    out = budget.copy()
    for g, budget_w, start, end in windows:
        out[g] = min(out[g], window_ceiling_w(budget_w, start, end, t, rates))
    return out


def engine_policy(
    policy: Policy,
    scenario: Scenario,
    *,
    learn: bool,
    profiles: Mapping[str, Profile],
    rates: RampRates | None,
) -> Policy:
    """The policy as the engine runs it here: ticking every simulated tick (a scheduled cut
    is then in force two of them ahead, and the learner is fed at that pace), the scenario's
    ramp rates, telemetry never stale or forgotten (every steer hears every node), learning
    on exactly when `learn` is (classes that say `learn: false` stay off), and `profiles`
    in place of the named classes' curves (those do not learn)."""
    spec = policy.spec
    ctl = spec.control
    duration_s = scenario.duration_s
    tick_s = scenario.spec.tick_s
    control = ctl.model_copy(
        update={
            "tick_s": tick_s,
            "lease_s": max(ctl.lease_s, 2 * tick_s),
            "stale_after_s": max(ctl.stale_after_s, 2 * duration_s + tick_s),
            "forget_after_s": max(ctl.forget_after_s, 4 * duration_s + tick_s),
            "ramp_w_per_s": rates,
            "learn": ctl.learn.model_copy(update={"enabled": learn}),
        }
    )
    classes = {}
    for name, cls in spec.classes.items():
        update: dict[str, object] = {}
        if not learn and cls.learn:
            update["learn"] = None
        if name in profiles:
            update |= {"profile": f"sim:{name}", "learn": False}
        classes[name] = cls.model_copy(update=update) if update else cls
    curves = {**policy.profiles, **{f"sim:{c}": prof for c, prof in profiles.items()}}
    return replace(
        policy,
        spec=spec.model_copy(update={"control": control, "classes": classes}),
        profiles=curves,
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


def start_cap_w(site: Site) -> float:
    """Agents start at their failsafe cap before the first command; where the failsafe caps
    do not fit the budgets (a site grown past its policy's failsafe), at the device minimum."""
    failsafe = min(max(site.policy.defaults.failsafe_w, site.min_cap_w), site.tdp_w)
    topo = site.topology
    finite = np.isfinite(topo.budget_w)
    committed = topo.group_sums(np.full(site.n_gpus, failsafe)) + topo.overhead_w
    return failsafe if bool(np.all(committed[finite] <= topo.budget_w[finite])) else site.min_cap_w


def warm_up(scenario: Scenario, site: Site, on_compiling: Callable[[], None]) -> float:
    """Compile (or load from numba's cache) the kernels a run of `scenario` on `site` uses:
    every allocator kernel, then the first two ticks of the run under `fast` (the GPU
    model's loops and the run's accounting, on arrays of the run's own types). Before a
    command's workers start, so that they find them compiled (a forked worker) or in the
    cache instead of each compiling them at once. `on_compiling` is called once if numba
    compiles anything (not when it only loads). Returns the seconds it took."""
    from powerd.allocator import kernel
    from powerd.sim.site import build_mix

    start = time.perf_counter()
    with kernel.watch_compiles(on_compiling, prefix="powerd"):
        kernel.warm_up()
        simulate(scenario, site, build_mix(scenario, site), "fast", stop=lambda k, _w, _x: k >= 1)
    return time.perf_counter() - start


def _ratings(policy: Policy) -> tuple[bool, NDArray[np.float64], NDArray[np.float64]]:
    """Whether any group is rated, and per group its rating's `pct` and `for_s` (0, 0 where
    it is not)."""
    ratings = [g.overload for g in policy.groups]
    return (
        any(o is not None for o in ratings),
        np.array([0.0 if o is None else o.pct for o in ratings]),
        np.array([0.0 if o is None else o.for_s for o in ratings]),
    )


def beyond_rating(
    over_run_s: NDArray[np.float64],
    excess_w: NDArray[np.float64],
    budget_w: NDArray[np.float64],
    pct: NDArray[np.float64],
    for_s: NDArray[np.float64],
) -> bool:
    """Whether a group over its budget is past what its overload rating allows (draw above
    the budget by `pct` % for less than `for_s` s at a time, docs/policy.md, "overload"):
    over by more than `pct` % of its budget (`excess_w`: its draw less its budget), or over
    for `for_s` or longer. An unrated group (`for_s` 0) is past it whenever it is over.
    `over_run_s`: per group, how long it has been over (0 where it is not)."""
    over = over_run_s > 0
    with np.errstate(invalid="ignore"):  # an unbudgeted group: inf × 0, never over
        past = (over_run_s >= for_s) | (excess_w > budget_w * (pct / 100.0) + EXCESS_TOL_W)
    return bool(np.any(over & past))


def simulate(
    scenario: Scenario,
    site: Site,
    mix: Mix,
    policy_name: str,
    *,
    progress: Progress | None = None,
    learn: bool = False,
    profiles: Mapping[str, Profile] | None = None,
    trace: Trace | None = None,
    stop: Stop | None = None,
    steered_steps: bool = False,
) -> RunResult:
    """Run the scenario on the site under one policy (a solver name, or `static`).

    `learn`: steer by curves learned online from the GPUs' perf (docs/simulator.md,
    "Learning profiles"); `profiles`: steer these classes by these curves instead of the
    policy's (e.g. the workloads' true curves: the best the allocator can do); `trace`: called
    with every engine tick's report and plan; `stop`: asked after every tick whether to end
    the run there; `steered_steps`: `static` advanced in a steered run's steps (the reaction,
    then the rest of the tick), so that its work bounds a steered run's tick by tick."""
    if policy_name not in POLICIES:
        raise ValueError(f"unknown policy '{policy_name}'; valid: {', '.join(POLICIES)}")
    t_start = time.perf_counter()
    tick_s = scenario.spec.tick_s
    n_ticks = scenario.ticks
    run = _Run(scenario, site, mix, policy_name, learn=learn, profiles=profiles, trace=trace)
    # The controller reacts to a change of demand within its own tick (1 s by default), far
    # inside a simulated tick: the first control tick of every step is simulated as such.
    react_s = min(site.policy.control.tick_s, tick_s / 2)
    events = mix.events
    next_event = 0
    n_levels = len(LEVELS)
    stopped_s: float | None = None
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
        if run.engine is not None:
            if k == 0:
                # The window opens on a site already under powerd: steer before time passes.
                run.steer(now)
            run.advance(react_s, now + react_s)
            run.steer(now + react_s)
            fac_committed[k] = run.committed_facility_w()
            run.advance(tick_s - react_s, now + tick_s)
        else:
            if steered_steps:
                run.advance(react_s, now + react_s)
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
        if (
            stop is not None
            and k < n_ticks - 1
            and stop(k, float(run.work.sum()), run.weighted_work)
        ):
            stopped_s = (k + 1) * tick_s
            n_ticks = k + 1
            fac_draw, fac_committed = fac_draw[:n_ticks], fac_committed[:n_ticks]
            peak_ratio, tput_series = peak_ratio[:n_ticks], tput_series[:n_ticks]
            weighted_series = weighted_series[:n_ticks]
            break

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
        beyond_rating_s=run.beyond_s,
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
        churn=run.churn.summary() if run.engine is not None else {},
        stopped_s=stopped_s,
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
