"""The baselines a site would choose without powerd, and a breaker's view of every run.

- `uncapped`: as many GPUs as powerd runs, no caps at all: every GPU draws its demand up to
  its TDP. Its draw is held against every budget (time over, worst overshoot) and against
  a breaker per budgeted group (`Breaker`): a trip takes the group's GPUs down (no work, no
  draw) until it is restored `restore_s` later.
- `oracle`: perfect foresight, the upper bound: every GPU's demand known exactly at every
  sub-step (`oracle_step_s`), caps set there by the shipped allocator (`allocate_arrays`,
  the `fast` solver) for that exact demand and the workloads' true throughput curves, under
  every budget in force (Σ caps + overhead ≤ budget at every instant), applied at once with
  no lag, headroom, slew or ramp. It drives no TickEngine: it is a bound, not a controller.

Both walk the scenario in sub-steps over the same GPU model (`SimulatedGpus.demand_at`, the
same workloads and idle windows as `simulate`) and return a `RunResult`, so every report
shows them beside the steered policies. See docs/simulator.md, "Baselines".
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerd.allocator import ClassTable, GpuArrays, Tree, allocate_arrays
from powerd.allocator.problem import Allocation
from powerd.backends.mock import MockGpuSpec, Pattern, SimulatedGpus
from powerd.policy import LEVELS, Policy
from powerd.profile import Profile
from powerd.sim import ORACLE, UNCAPPED
from powerd.sim.run import (
    EXCESS_TOL_W,
    Progress,
    RunResult,
    Series,
    _rates,
    _windows,
    grid_budget_at,
)
from powerd.sim.scenario import Scenario
from powerd.sim.site import Mix, Site
from powerd.topology import Topology

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

ORACLE_MAX_STEP_S = 1.0  # the oracle re-solves at least this often (docs/simulator.md)
OBJECTIVES = ("weighted", "total")


# -- the breaker ---------------------------------------------------------------------------

# The default curve (docs/simulator.md, "What a breaker does"): a thermal image of the
# conductor (IEC 60255-149's thermal model: heat θ in units of the rating², dθ/dt =
# (r² − θ)/τ, trip at θ ≥ pickup²) plus an instantaneous trip. Calibrated to UL 489's
# calibration points for a 226-400 A molded-case breaker: carry 100 % indefinitely, trip at
# 135 % within 2 h, at 200 % within 12 min (set here to take exactly 12 min from cold: the
# slowest breaker the standard allows at 200 %); the pickup is IEC 60898-1's conventional
# non-tripping current (1.13 In), which also meets IEC 60947-2's (1.05 In must not trip,
# 1.30 In must trip within 2 h).
PICKUP = 1.13
T_200_S = 720.0
INSTANT = 10.0  # × rating: instantaneous (magnetic) trip, the top of a C curve (IEC 60898-1)
# Time from a trip until the group's GPUs work again: an operator finds the cause and resets
# the breaker (10 min), nodes boot and pass health checks (10 min), jobs restart from their
# last checkpoint and reload (10 min). Deliberately short (it favours `uncapped`).
RESTORE_S = 1800.0


def tau_for(pickup: float, ratio: float, trip_s: float) -> float:
    """The time constant that trips at `ratio` × rating after `trip_s` from cold."""
    if ratio <= pickup:
        raise ValueError(f"{ratio} × rating never trips a breaker with pickup {pickup}")
    return trip_s / math.log(ratio**2 / (ratio**2 - pickup**2))


@dataclass(frozen=True)
class Breaker:
    """A breaker per budgeted group, rated at `rating` × the group's budget (the policy's
    budget, not a scheduled window's: windows are promises to the grid, not hardware)."""

    rating: float = 1.0
    pickup: float = PICKUP
    tau_s: float = field(default_factory=lambda: tau_for(PICKUP, 2.0, T_200_S))
    instant: float = INSTANT
    restore_s: float = RESTORE_S

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rating) and self.rating >= 1.0):
            raise ValueError(
                f"breaker rating {self.rating:g} × the budget: must be at least 1 (a breaker "
                "rated below its budget trips under it)"
            )
        if not (self.pickup > 0 and self.tau_s > 0):
            raise ValueError("breaker pickup and tau_s must be positive")
        if self.instant <= self.pickup or self.restore_s < 0:
            raise ValueError("breaker instant must exceed its pickup, restore_s be >= 0")

    def trip_s(self, ratio: float, heat: float = 0.0) -> float:
        """Time to trip at a constant `ratio` × rating, from heat `heat` (0: cold); inf when it
        never trips, 0 in the instantaneous region."""
        if ratio >= self.instant:
            return 0.0
        p2, r2 = self.pickup**2, ratio**2
        if heat >= p2:
            return 0.0
        if r2 <= p2:
            return math.inf
        return self.tau_s * math.log((r2 - heat) / (r2 - p2))

    def heat(self, heat: FloatArray, ratio: FloatArray, dt: float) -> FloatArray:
        """The thermal image after `dt` at a constant `ratio` (exact for a held load)."""
        r2 = ratio * ratio
        return np.asarray(r2 + (heat - r2) * math.exp(-dt / self.tau_s))

    def start_heat(self, ratio: FloatArray) -> FloatArray:
        """The thermal image after carrying `ratio` for ever: r²; rows (a stretch of
        sub-steps, one per row) give the mean r² of the stretch."""
        r2 = np.asarray(ratio * ratio, dtype=np.float64)
        return np.asarray(r2.mean(axis=0) if r2.ndim > 1 else r2)

    def tripped(self, heat: FloatArray, ratio: FloatArray) -> BoolArray:
        return np.asarray((heat >= self.pickup**2) | (ratio >= self.instant), dtype=np.bool_)

    def safe_below(self) -> float:
        """Draw/budget below which no breaker of this kind ever trips, whatever the history:
        the thermal image is an average of past ratio², so it stays under pickup²."""
        return self.rating * min(self.pickup, self.instant)

    def describe(self) -> dict[str, float]:
        return {
            "rating_of_budget": self.rating,
            "pickup": self.pickup,
            "tau_s": self.tau_s,
            "instant": self.instant,
            "restore_s": self.restore_s,
            "trip_s_at_135pct": self.trip_s(1.35),
            "trip_s_at_200pct": self.trip_s(2.0),
        }


@dataclass
class Trips:
    """What the breakers did over one run."""

    breaker: Breaker
    trips: int
    by_level: dict[str, int]
    first_trip_s: float | None
    events: list[tuple[float, str, float]]  # (time s, group, draw / rating when it tripped)
    down_gpu_s: float  # GPU-seconds spent down
    lost_work_gpu_s: float  # work the down GPUs would have delivered
    exact: bool = True  # False: bounded from the run's highest draw/budget, not simulated

    def summary(self) -> dict[str, Any]:
        return {
            "trips": self.trips,
            "by_level": self.by_level,
            "first_trip_s": self.first_trip_s,
            "events": [
                {"t_s": t, "group": g, "draw_over_rating": r} for t, g, r in self.events[:20]
            ],
            "down_gpu_h": self.down_gpu_s / 3600.0,
            "lost_work_gpu_h": self.lost_work_gpu_s / 3600.0,
            "method": "simulated" if self.exact else "bound from the highest draw/budget",
        }


def trips_of(result: RunResult, breaker: Breaker) -> Trips | None:
    """A steered run's trips, from its highest measured draw/budget of any group: 0 when
    that stays below `breaker.safe_below()` (no thermal image can reach the pickup then),
    else None (the run's per-group draw would be needed)."""
    if result.max_excess_ratio >= breaker.safe_below():
        return None
    return Trips(breaker, 0, dict.fromkeys(LEVELS, 0), None, [], 0.0, 0.0, exact=False)


@dataclass
class BaselineResult(RunResult):
    """A baseline's run, with what only baselines have: the work of the same GPUs free of
    every budget at the same sub-steps (its loss is measured against that), and for
    `uncapped` what the breakers did."""

    unconstrained_gpu_s: float = 0.0
    unconstrained_weighted_gpu_s: float = 0.0
    step_s: float = 0.0
    trips: Trips | None = None

    def loss(self, metric: str = "total") -> float:
        """1 − work / the same GPUs' unconstrained work (`weighted`: by class weight)."""
        if metric == "weighted":
            ref, got = self.unconstrained_weighted_gpu_s, self.weighted_work_gpu_s
        else:
            ref, got = self.unconstrained_gpu_s, self.work_gpu_s
        # (Never below 0 but by summation order: the same sums taken two ways.)
        return max(0.0, 1.0 - got / ref) if ref > 0 else 0.0

    def summary(self) -> dict[str, object]:
        out = super().summary()
        out["unconstrained_work_gpu_h"] = self.unconstrained_gpu_s / 3600.0
        out["loss"] = self.loss("total")
        out["weighted_loss"] = self.loss("weighted")
        out["step_s"] = self.step_s
        if self.trips is not None:
            out["breaker"] = self.trips.breaker.describe()
            out["trips"] = self.trips.summary()
        return out


# -- sub-steps over the GPU model -----------------------------------------------------------


def oracle_step_s(scenario: Scenario, mix: Mix) -> float:
    """The sub-step baselines walk: at most ORACLE_MAX_STEP_S and the tick; where every GPU
    replays a recorded trace, that trace's sample period instead of 1 s (between samples
    the replay interpolates linearly, so the samples carry all it knows)."""
    tick = scenario.spec.tick_s
    period = _replayed_period(mix)
    if period is not None:
        return min(tick, max(ORACLE_MAX_STEP_S, period))
    return min(tick, ORACLE_MAX_STEP_S)


def _replayed_period(mix: Mix) -> float | None:
    """The shortest sample period of the recorded traces when every GPU replays one (their
    samples then carry all the demand knows), else None."""
    periods = [
        float(getattr(w.trace, "interval_s", 0.0))
        for w in mix.workloads
        if w.pattern == Pattern.TRACE and w.trace is not None
    ]
    if periods and len(periods) == len(mix.workloads) and min(periods) > 0:
        return min(periods)
    return None


# Where in its sub-step the demand is read (a fraction of it), sub-step after sub-step: the
# golden ratio's multiples (a Weyl sequence), spread evenly over the sub-step in any run of
# them. A read at each sub-step's start would alias a swing whose period is a few sub-steps
# (a job swinging every 3 s read every second sees the same three points of its cycle).
GOLDEN = (math.sqrt(5.0) - 1.0) / 2.0


@dataclass(frozen=True)
class _Block:
    """Consecutive sub-steps: their ticks, times and every GPU's demand (rows)."""

    ks: IntArray
    ts: FloatArray
    demand: FloatArray
    changed: bool  # a workload changed at its first step


@dataclass
class _Account:
    """Per sub-step accounting shared by both baselines, folded into a RunResult."""

    scenario: Scenario
    site: Site
    mix: Mix
    step_s: float
    classes: ClassTable
    n_levels: int = len(LEVELS)

    def __post_init__(self) -> None:
        topo = self.site.topology
        sc = self.scenario
        self.ticks = sc.ticks
        self.tick_s = sc.spec.tick_s
        self.duration = self.ticks * self.tick_s
        self.steps_per_tick = max(1, round(self.tick_s / self.step_s))
        self.dt = self.tick_s / self.steps_per_tick
        # Demand read at a point spread over each sub-step (GOLDEN), not at its start, unless
        # every GPU replays a trace read at its own samples.
        self.spread = _replayed_period(self.mix) is None
        self.budget = topo.budget_w.copy()
        self.finite = np.isfinite(self.budget)
        self.windows = _windows(sc, self.site)
        self.rates = sc.spec.ramp_w_per_s or self.site.policy.control.ramp_w_per_s
        # Every node's overhead shared out over its GPUs: a subtree's draw is then one sum,
        # and a node that is down (a trip above it) draws nothing at all.
        node = topo.gpu_groups[:, 3]
        per_node = np.bincount(node, minlength=topo.n_groups).astype(np.float64)
        self.overhead_share = topo.overhead_w[node] / np.maximum(per_node[node], 1.0)
        self.level = topo.level
        self.level_masks = [topo.level == lv for lv in range(self.n_levels)]
        # GPU → group incidence: a block of per-GPU rows times this is every group's sum.
        self.incidence = np.zeros((site_n := self.site.n_gpus, topo.n_groups))
        for lv in range(topo.gpu_groups.shape[1]):
            self.incidence[np.arange(site_n), topo.gpu_groups[:, lv]] = 1.0
        self.cls = self.mix.class_index
        self.weight = self.classes.weight[self.cls]
        n_classes = len(self.classes.names)
        self.work = np.zeros(n_classes)
        self.weighted = 0.0
        self.unconstrained = 0.0
        self.unconstrained_weighted = 0.0
        self.gpu_energy = 0.0
        self.fac_energy = 0.0
        self.over_s = 0.0
        self.over_by_level = np.zeros(self.n_levels)
        self.over_run = np.zeros(topo.n_groups)
        self.longest_over = 0.0
        self.max_excess = 0.0
        self.max_ratio = 0.0
        self.committed_over = 0
        self.fac_draw = np.zeros(self.ticks)
        self.fac_committed = np.zeros(self.ticks)
        self.peak_ratio = np.zeros((self.ticks, self.n_levels))
        self.tput = np.zeros(self.ticks)
        self.wtput = np.zeros(self.ticks)

    def budget_at(self, t: float) -> FloatArray:
        return grid_budget_at(self.budget, self.windows, self.rates, t)

    def budgets_at(self, ts: FloatArray) -> FloatArray:
        """Every group's budget at each time (rows), scheduled windows applied."""
        if not self.windows:
            return np.broadcast_to(self.budget, (ts.size, self.budget.size))
        return np.array([self.budget_at(float(t)) for t in ts])

    def blocks(self, model: SimulatedGpus, size: int) -> Iterator[_Block]:
        """The sub-steps in blocks of at most `size`, each block's demand read from the model;
        a block ends where the scenario's idle windows change a workload (a new block starts
        with `changed`)."""
        events = self.mix.events
        nxt = 0
        ks: list[int] = []
        ts: list[float] = []
        rows: list[FloatArray] = []
        changed = False
        for k in range(self.ticks):
            for j in range(self.steps_per_tick):
                t = k * self.tick_s + j * self.dt
                moved = False
                while nxt < len(events) and events[nxt][0] <= t:
                    if not moved and ks:
                        yield _Block(np.array(ks), np.array(ts), np.array(rows), changed)
                        ks, ts, rows, changed = [], [], [], False
                    _, idx, workload = events[nxt]
                    model.set_workload(idx, workload)
                    nxt += 1
                    moved = changed = True
                ks.append(k)
                ts.append(t)
                at = t
                if self.spread:
                    at += self.dt * math.modf((k * self.steps_per_tick + j) * GOLDEN)[0]
                rows.append(model.demand_at(at))
                if len(ks) >= size:
                    yield _Block(np.array(ks), np.array(ts), np.array(rows), changed)
                    ks, ts, rows, changed = [], [], [], False
        if ks:
            yield _Block(np.array(ks), np.array(ts), np.array(rows), changed)

    def add(
        self,
        ks: IntArray,
        ts: FloatArray,
        *,
        draw: FloatArray,
        up: BoolArray | None,
        tput: FloatArray,
        best: FloatArray,
        committed: FloatArray,
        strict: bool = True,
    ) -> None:
        """Account a block of sub-steps (rows: per-GPU draw, throughput, caps, each held for
        dt). `strict`: the caps are committed against the budgets (the oracle's), so caps +
        overhead above one counts in `committed_over_ticks`."""
        dt = self.dt
        tput = self.mix.sync_throughput(tput)  # a synchronous job at its slowest GPU's pace
        ovh = self.overhead_share if up is None else np.where(up, self.overhead_share, 0.0)
        groups = self.group_draw(draw, up)
        budget = self.budgets_at(ts + dt)
        excess = np.where(self.finite, groups - budget, -np.inf)
        over = excess > EXCESS_TOL_W
        if over.any():
            for row in over:
                self.over_run = np.where(row, self.over_run + dt, 0.0)
                self.longest_over = max(self.longest_over, float(self.over_run.max()))
            self.over_s += dt * int(over.any(axis=1).sum())
            for lv, mask in enumerate(self.level_masks):
                self.over_by_level[lv] += dt * int(over[:, mask].any(axis=1).sum())
            self.max_excess = max(self.max_excess, float(excess[over].max()))
        else:
            self.over_run[:] = 0.0
        ratio = np.where(self.finite & (budget > 0), groups / np.where(budget > 0, budget, 1), 0)
        self.max_ratio = max(self.max_ratio, float(ratio.max()))
        for lv, mask in enumerate(self.level_masks):
            np.maximum.at(self.peak_ratio[:, lv], ks, ratio[:, mask].max(axis=1))
        held = (committed + ovh) @ self.incidence
        if strict:
            bad = (held - budget)[:, self.finite] > 1e-6
            self.committed_over += int(bad.any(axis=1).sum())
        self.work += np.bincount(self.cls, weights=tput.sum(axis=0), minlength=self.work.size) * dt
        w = tput @ self.weight
        self.weighted += float(w.sum()) * dt
        self.unconstrained += float(best.sum()) * dt
        self.unconstrained_weighted += float((best @ self.weight).sum()) * dt
        self.gpu_energy += float(draw.sum()) * dt
        self.fac_energy += float(groups[:, 0].sum()) * dt
        share = dt / self.tick_s
        np.add.at(self.fac_draw, ks, groups[:, 0] * share)
        self.fac_committed[ks] = held[:, 0]
        np.add.at(self.tput, ks, tput.sum(axis=1) * share)
        np.add.at(self.wtput, ks, w * share)

    def group_draw(self, draw: FloatArray, up: BoolArray | None) -> FloatArray:
        """Every group's draw (rows: sub-steps), overhead included for the nodes that are up."""
        ovh = self.overhead_share if up is None else np.where(up, self.overhead_share, 0.0)
        return np.asarray((draw + ovh) @ self.incidence)

    def result(
        self, name: str, wall_s: float, solve_ms: list[float], trips: Trips | None = None
    ) -> BaselineResult:
        names = self.classes.names
        per_class = np.bincount(self.cls, minlength=len(names))
        return BaselineResult(
            policy=name,
            n_gpus=self.site.n_gpus,
            duration_s=self.duration,
            feed_w=self.site.feed_w,
            work_gpu_s=float(self.work.sum()),
            weighted_work_gpu_s=self.weighted,
            work_by_class={c: float(self.work[i]) for i, c in enumerate(names) if per_class[i]},
            gpu_energy_j=self.gpu_energy,
            facility_energy_j=self.fac_energy,
            over_budget_s=self.over_s,
            beyond_rating_s=self.over_s,  # not steered: its ratings are not checked
            longest_over_s=self.longest_over,
            over_budget_s_by_level={
                LEVELS[lv]: float(self.over_by_level[lv]) for lv in range(self.n_levels)
            },
            max_excess_w=self.max_excess,
            max_excess_ratio=self.max_ratio,
            floors_fit=True,
            below_floor_share={},
            committed_over_ticks=self.committed_over,
            statuses={},
            ramp_w_per_s=dict(
                zip(
                    ("committed_up", "committed_down", "draw_up", "draw_down"),
                    (*_rates(self.fac_committed, self.tick_s), *_rates(self.fac_draw, self.tick_s)),
                    strict=True,
                )
            ),
            wall_s=wall_s,
            solve_ms_mean=float(np.mean(solve_ms)) if solve_ms else 0.0,
            series=Series(
                t_h=np.arange(1, self.ticks + 1, dtype=np.float64) * (self.tick_s / 3600.0),
                facility_draw_w=self.fac_draw,
                facility_budget_w=float(self.budget[0]),
                peak_ratio=self.peak_ratio,
                throughput=self.tput,
                facility_committed_w=self.fac_committed,
                weighted_throughput=self.wtput,
            ),
            unconstrained_gpu_s=self.unconstrained,
            unconstrained_weighted_gpu_s=self.unconstrained_weighted,
            step_s=self.dt,
            trips=trips,
        )


def _model(scenario: Scenario, site: Site, mix: Mix) -> SimulatedGpus:
    """The GPU model `simulate` runs (same workloads and seed): only its demand is read."""
    return SimulatedGpus(
        site.n_gpus,
        list(mix.workloads),
        compiled=True,
        spec=MockGpuSpec(min_cap_w=site.min_cap_w, max_cap_w=site.tdp_w, default_cap_w=site.tdp_w),
        seed=scenario.spec.seed,
        uuid_prefix="GPU-sim",
    )


@dataclass(frozen=True, eq=False)
class _Truth:
    """Every GPU's true throughput curve (its workload's) and whether it idles."""

    key: tuple[int, ...]  # the GPUs' workloads (identity): a change makes a new _Truth
    profiles: tuple[Profile, ...]
    profile_index: IntArray
    masks: tuple[BoolArray, ...]
    idle: BoolArray

    def value(self, power_w: FloatArray) -> FloatArray:
        """Throughput at `power_w` (the last axis: GPUs; a block of sub-steps before it)."""
        out = np.zeros(power_w.shape)
        for prof, mask in zip(self.profiles, self.masks, strict=True):
            out[..., mask] = prof.value(power_w[..., mask])
        out[..., self.idle] = 0.0
        return out


def truth_of(model: SimulatedGpus, prev: _Truth | None = None) -> _Truth:
    """The GPUs' curves as their workloads are now (`prev` itself when nothing changed)."""
    workloads = [model.workload(i) for i in range(model.n)]
    key = tuple(id(w) for w in workloads)
    if prev is not None and prev.key == key:
        return prev
    profiles: list[Profile] = []
    index = np.zeros(model.n, dtype=np.int64)
    for i, w in enumerate(workloads):
        for j, p in enumerate(profiles):
            if p is w.profile:
                index[i] = j
                break
        else:
            profiles.append(w.profile)
            index[i] = len(profiles) - 1
    return _Truth(
        key,
        tuple(profiles),
        index,
        tuple(index == j for j in range(len(profiles))),
        np.array([w.pattern == Pattern.IDLE for w in workloads], dtype=np.bool_),
    )


# -- uncapped ------------------------------------------------------------------------------


UNCAPPED_BLOCK = 256  # sub-steps accounted at once (a trip cuts a block short)


def uncapped(
    scenario: Scenario,
    site: Site,
    mix: Mix,
    *,
    breaker: Breaker | None = None,
    progress: Progress | None = None,
) -> tuple[BaselineResult, Trips]:
    """No caps at all: every GPU draws its demand up to its TDP, on as many GPUs as the site
    has. Budgets are only watched; a breaker per budgeted group trips on the overload curve
    and its GPUs (and nodes) draw and deliver nothing until restored."""
    t0 = time.perf_counter()
    breaker = breaker or Breaker()
    classes = ClassTable.from_policy(site.policy)
    acct = _Account(scenario, site, mix, oracle_step_s(scenario, mix), classes)
    topo = site.topology
    model = _model(scenario, site, mix)
    truth = truth_of(model)
    rated = acct.finite & (acct.budget > 0)
    rating = np.where(rated, acct.budget * breaker.rating, np.inf)
    heat: FloatArray | None = None  # warm from the first sub-step's draw (below)
    down_until = np.full(topo.n_groups, -np.inf)
    below = [under_groups(topo, g) for g in range(topo.n_groups)]
    events: list[tuple[float, str, float]] = []
    by_level = dict.fromkeys(LEVELS, 0)
    down_gpu_s = lost = 0.0
    tdp = site.tdp_w
    dt = acct.dt
    last_k = -1
    for blk in acct.blocks(model, UNCAPPED_BLOCK):
        if blk.changed:
            truth = truth_of(model, truth)
        want = np.minimum(blk.demand, tdp)
        best = truth.value(want)
        i = 0
        while i < blk.ts.size:
            ts = blk.ts[i:]
            down = down_until[None, :] > ts[:, None]
            up = np.asarray(~down[:, topo.gpu_groups].any(axis=2), dtype=np.bool_)
            draw = np.where(up, want[i:], 0.0)
            ratio = np.where(rated, acct.group_draw(draw, up) / rating, 0.0)
            end = ts.size
            if heat is None:
                # The window opens on a running site: every breaker has carried the draw of
                # the first block (its mean r²) for long; cold would forgive half an hour.
                heat = breaker.start_heat(ratio)
            for j in range(ts.size):  # the breakers, sub-step by sub-step
                heat = breaker.heat(heat, ratio[j], dt)
                new = breaker.tripped(heat, ratio[j]) & rated & ~down[j]
                if new.any():
                    for g in np.flatnonzero(new).tolist():
                        down_until[g] = ts[j] + dt + breaker.restore_s
                        events.append((float(ts[j] + dt), topo.names[g], float(ratio[j, g])))
                        by_level[LEVELS[int(topo.level[g])]] += 1
                        heat[below[g]] = 0.0  # de-energised: no current below it
                    end = j + 1  # the steps after it draw without the tripped groups
                    break
            b = best[i : i + end]
            u = up[:end]
            acct.add(
                blk.ks[i : i + end],
                ts[:end],
                draw=draw[:end],
                up=u,
                tput=np.where(u, b, 0.0),
                best=b,
                committed=np.where(u, tdp, 0.0),  # every GPU that is up may draw its TDP
                strict=False,
            )
            down_gpu_s += float((~u).sum()) * dt
            lost += float(b[~u].sum()) * dt
            i += end
        last_k = _progress(progress, blk.ks, last_k)
    trips = Trips(
        breaker,
        len(events),
        by_level,
        events[0][0] if events else None,
        events,
        down_gpu_s,
        lost,
    )
    return acct.result(UNCAPPED, time.perf_counter() - t0, [], trips), trips


def _progress(progress: Progress | None, ks: IntArray, last_k: int) -> int:
    """Report the ticks a block finished; returns the last tick reported."""
    if progress is not None:
        done = int(np.unique(ks[ks > last_k]).size)
        if done:
            progress(done)
    return max(last_k, int(ks[-1]))


def under_groups(topo: Topology, g: int) -> IntArray:
    """Group g and every group below it."""
    out = [g]
    k = 0
    while k < len(out):
        out += np.flatnonzero(topo.parent == out[k]).tolist()
        k += 1
    return np.array(out, dtype=np.int64)


# -- oracle --------------------------------------------------------------------------------


def oracle_policy(policy: Policy, objective: str = "weighted") -> Policy:
    """The policy as the oracle solves it: no slew (caps move at once); `total` gives every
    class weight 1 (the most GPU-work rather than the most weighted work)."""
    if objective not in OBJECTIVES:
        raise ValueError(f"unknown objective '{objective}'; valid: {', '.join(OBJECTIVES)}")
    spec = policy.spec
    control = spec.control.model_copy(update={"slew_w": None})
    classes = spec.classes
    if objective == "total":
        classes = {c: s.model_copy(update={"weight": 1.0}) for c, s in classes.items()}
    return replace(policy, spec=spec.model_copy(update={"control": control, "classes": classes}))


def _true_classes(
    policy: Policy, truth: _Truth, class_index: IntArray
) -> tuple[ClassTable, IntArray]:
    """A class table whose classes are (policy class, true curve) pairs: each copies its
    policy class (weight, floor, ceiling) and steers by that curve."""
    names = list(policy.classes)
    pairs: dict[tuple[int, int], int] = {}
    index = np.zeros(class_index.size, dtype=np.int64)
    for i, (c, p) in enumerate(
        zip(class_index.tolist(), truth.profile_index.tolist(), strict=True)
    ):
        index[i] = pairs.setdefault((c, p), len(pairs))
    specs = {}
    learned = {}
    for (c, p), j in pairs.items():
        name = f"{names[c]}~{j}"
        specs[name] = policy.classes[names[c]]
        learned[name] = truth.profiles[p]
    spec = policy.spec.model_copy(update={"classes": specs})
    return ClassTable.from_policy(replace(policy, spec=spec), learned), index


# Sub-steps solved together in one allocation (a tree of this many copies of the site, each
# under its own budgets: independent problems, so one solve answers each exactly).
ORACLE_BATCH = 64


class _Oracle:
    """The oracle's state: the policy it solves, the true curves, batched topologies."""

    def __init__(self, site: Site, mix: Mix, acct: _Account, objective: str) -> None:
        self.site = site
        self.mix = mix
        self.acct = acct
        self.policy = oracle_policy(site.policy, objective)
        n = site.n_gpus
        self.lo = np.full(n, site.min_cap_w)
        # A class ceiling holds (the allocator's bound); device limits as the model's.
        self.ceiling = np.minimum(site.tdp_w, _ceilings(site.policy)[mix.class_index])
        self.trees: dict[int, Tree] = {}
        self.warm: dict[int, Allocation] = {}
        self.solve_ms: list[float] = []
        self.table: ClassTable | None = None
        self.table_index = np.zeros(n, dtype=np.int64)
        self.truth: _Truth | None = None

    def set_truth(self, truth: _Truth) -> None:
        if truth is not self.truth:
            self.truth = truth
            self.table, self.table_index = _true_classes(self.policy, truth, self.mix.class_index)
            self.warm.clear()

    def tree(self, copies: int) -> Tree:
        """The site's tree `copies` times over, each copy its own root."""
        if copies not in self.trees:
            topo = self.site.topology
            g = topo.n_groups
            self.trees[copies] = Tree(
                Topology(
                    names=tuple(f"{name}@{c}" for c in range(copies) for name in topo.names),
                    level=np.tile(topo.level, copies),
                    parent=np.concatenate(
                        [np.where(topo.parent >= 0, topo.parent + c * g, -1) for c in range(copies)]
                    ),
                    budget_w=np.tile(topo.budget_w, copies),
                    overhead_w=np.tile(topo.overhead_w, copies),
                    gpu_groups=np.concatenate([topo.gpu_groups + c * g for c in range(copies)]),
                )
            )
        return self.trees[copies]

    def caps(self, blk: _Block) -> FloatArray:
        """Each sub-step's caps (rows): what it wants where nothing binds, else the
        allocator's optimum, every binding sub-step of the block in one solve."""
        acct = self.acct
        topo = self.site.topology
        want = np.clip(blk.demand, self.lo, self.ceiling)
        budget = acct.budgets_at(blk.ts)
        if acct.windows:  # the lower end of the sub-step: the rule holds throughout
            budget = np.minimum(budget, acct.budgets_at(blk.ts + acct.dt))
        room = budget - topo.overhead_w
        binds = ((want @ acct.incidence) > room)[:, acct.finite].any(axis=1)
        solve = np.flatnonzero(binds)
        if solve.size == 0:
            return np.asarray(want)
        n = self.site.n_gpus
        m = int(solve.size)
        tree = self.tree(m)
        wanted = want[solve].ravel()
        fleet = GpuArrays(
            uuids=tuple(f"oracle-{i}" for i in range(n * m)),
            topology=tree.topology,
            min_cap_w=np.tile(self.lo, m),
            max_cap_w=wanted,
            power_w=wanted,
            cap_w=wanted,
            class_index=np.tile(self.table_index, m),
            stale=np.zeros(n * m, dtype=np.bool_),
            pinned_w=np.full(n * m, np.nan),
        )
        alloc = allocate_arrays(
            fleet,
            self.policy,
            "fast",
            budget_w=np.ascontiguousarray(budget[solve]).ravel(),
            warm=self.warm.get(m),
            classes=self.table,
            tree=tree,
        )
        self.warm[m] = alloc
        self.solve_ms.append(alloc.solve_ms / m)
        out = np.array(want)
        out[solve] = alloc.caps_w.reshape(m, n)
        return out


def oracle(
    scenario: Scenario,
    site: Site,
    mix: Mix,
    *,
    objective: str = "weighted",
    progress: Progress | None = None,
) -> tuple[BaselineResult, float]:
    """Perfect foresight: at every sub-step the allocator's optimum for the exact demand and
    the true curves, caps applied at once. Returns the run and the work (GPU-s) the same
    GPUs deliver unconstrained at the same sub-steps (every GPU at its demand up to TDP).

    Sub-steps are independent problems: up to ORACLE_BATCH of them (with the same curves)
    go to the allocator as one, a tree of that many copies of the site."""
    t0 = time.perf_counter()
    classes = ClassTable.from_policy(site.policy)
    acct = _Account(scenario, site, mix, oracle_step_s(scenario, mix), classes)
    model = _model(scenario, site, mix)
    orc = _Oracle(site, mix, acct, objective)
    truth = truth_of(model)
    orc.set_truth(truth)
    last_k = -1
    for blk in acct.blocks(model, ORACLE_BATCH):
        if blk.changed:
            truth = truth_of(model, truth)
            orc.set_truth(truth)
        caps = orc.caps(blk)
        draw = np.minimum(caps, blk.demand)
        best = truth.value(np.minimum(blk.demand, site.tdp_w))
        acct.add(
            blk.ks, blk.ts, draw=draw, up=None, tput=truth.value(draw), best=best, committed=caps
        )
        last_k = _progress(progress, blk.ks, last_k)
    result = acct.result(ORACLE, time.perf_counter() - t0, orc.solve_ms)
    return result, acct.unconstrained


def _ceilings(policy: Policy) -> FloatArray:
    return np.array(
        [np.inf if c.ceiling_w is None else c.ceiling_w for c in policy.classes.values()],
        dtype=np.float64,
    )


# -- as the studies run them ---------------------------------------------------------------


def run_baseline(
    name: str,
    scenario: Scenario,
    site: Site,
    mix: Mix,
    *,
    breaker: Breaker | None = None,
    objective: str = "weighted",
    progress: Progress | None = None,
) -> BaselineResult:
    """Run baseline `name` (`uncapped` or `oracle`)."""
    if name == UNCAPPED:
        return uncapped(scenario, site, mix, breaker=breaker, progress=progress)[0]
    if name == ORACLE:
        return oracle(scenario, site, mix, objective=objective, progress=progress)[0]
    raise ValueError(f"unknown baseline '{name}'; valid: {UNCAPPED}, {ORACLE}")
