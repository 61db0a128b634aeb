"""The allocation problem as arrays: fleet in, bounds and utilities in kW, caps out.

Everything a solver needs is built here once per call, so every solver (exact or baseline)
sees the same bounds, the same budgets and the same infeasibility handling, and every result
is verified and scored by the same code. Solvers work in kW: in watts the generic solvers
lose accuracy (docs/allocator.md, "Measurements behind the design").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerd.policy import DemandSpec, Policy
from powerd.profile import Profile
from powerd.topology import N_LEVELS, Topology

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

OPTIMAL = "optimal"
FLOORS_DROPPED = "floors_dropped"
INFEASIBLE_MIN = "infeasible_min"

# A GPU drawing this share of its cap is held back by the cap and wants its maximum; with
# the demand estimate, `control.demand.held_share` (above it: hysteresis) decides that.
CAP_LIMITED_SHARE = 0.95
# `margin: least`: a GPU's demand is this much above the least cap it would not read as
# held back by (its draw / CAP_LIMITED_SHARE).
LEAST_MARGIN_W = 1.0
# Damping 0 would leave ties between equal marginal utilities to floating-point accident; a
# floor this small costs at most ~1e-5 of one GPU's utility and keeps the optimum unique.
MIN_DAMPING = 1e-4
# δ = 2ε·(largest hi − prev + margin): with the margin every GPU strictly wants its hi.
DELTA_MARGIN_KW = 1.0
# Budget feasibility checks and the final repair work to this (1e-6 W).
TOL_KW = 1e-9


class SolverFailed(RuntimeError):
    """A solver could not produce caps (after its fallback); the controller keeps safe caps."""


@dataclass(frozen=True, eq=False)
class GpuArrays:
    """Per-GPU arrays for one allocation: the hot-loop input (no pydantic objects).

    `class_index` indexes `class_names(policy)`; `pinned_w` is NaN where a GPU is not pinned.
    GPU i sits at `topology.gpu_groups[i]`. `job_index` indexes `job_names` (-1: no job); all
    GPUs of one job get one cap (None: no GPU is in a job).
    """

    uuids: tuple[str, ...]
    topology: Topology
    min_cap_w: FloatArray
    max_cap_w: FloatArray
    power_w: FloatArray
    cap_w: FloatArray
    class_index: IntArray
    stale: BoolArray
    pinned_w: FloatArray
    job_index: IntArray | None = None
    job_names: tuple[str, ...] = ()
    # What each GPU has drawn recently at most, its swing included (controller/demand.py);
    # None: the last sample (`power_w`) alone.
    recent_w: FloatArray | None = None
    # The cap in force when `power_w` was sampled, as the GPU's agent reported it (NaN: not
    # reported); None: `cap_w`. A tick that comes before the next sample (on acks,
    # control.ack_ticks) must not read a GPU it has just raised as no longer held back.
    sampled_cap_w: FloatArray | None = None
    # Per GPU whether its draw swings all window (`control.demand.swing_keep_w`,
    # controller/demand.py's `swinging`); None: none does.
    swinging: BoolArray | None = None

    @property
    def n(self) -> int:
        return len(self.uuids)


def class_names(policy: Policy) -> tuple[str, ...]:
    return tuple(policy.classes)


@dataclass(frozen=True, eq=False)
class ClassTable:
    """Per-class weights, bounds and profiles, profiles as padded knot/slope rows (per kW)."""

    names: tuple[str, ...]
    weight: FloatArray
    floor_w: FloatArray  # 0 where a class has no floor
    ceiling_w: FloatArray  # inf where a class has no ceiling
    profiles: tuple[Profile, ...]
    knots_kw: FloatArray  # (classes, R): where the slope changes, last = peak; +inf padding
    slopes_kw: FloatArray  # (classes, R): slope before each knot, per kW; 0 padding
    peak_kw: FloatArray  # (classes,): past this the profile is flat

    # Class c's curve sits at [c·offset, (c+1)·offset) W in `value_table`.
    TABLE_OFFSET_W = 1e7

    @cached_property
    def weights(self) -> FloatArray:
        """The classes' distinct weights, lowest first (floors drop in that order): kept,
        each allocation reads them."""
        return np.unique(self.weight)

    @cached_property
    def value_table(self) -> tuple[FloatArray, FloatArray]:
        """All profiles as one interpolation table, equal to Profile.value on [0, offset/2]:
        the linear extension below the first point (clamped at 0) and flat past the peak.
        Built once per table (each tick's objective reads it): do not write to it (it stays
        writable: the numba kernels are compiled for writable arrays)."""
        xs: list[float] = []
        ys: list[float] = []
        half = 0.5 * self.TABLE_OFFSET_W
        for c, prof in enumerate(self.profiles):
            base = c * self.TABLE_OFFSET_W
            slope, x0, y0 = prof.first_slope_per_w, float(prof.power_w[0]), prof.throughput[0]
            at_zero = y0 - slope * x0
            if at_zero >= 0.0:
                xs.append(base)
                ys.append(at_zero)
            else:
                xs += [base, base + x0 - y0 / slope]
                ys += [0.0, 0.0]
            xs += (base + prof.power_w).tolist()
            ys += prof.throughput.tolist()
            xs.append(base + half)
            ys.append(prof.peak_throughput)
        return np.asarray(xs), np.asarray(ys)

    @classmethod
    def from_policy(
        cls, policy: Policy, learned: Mapping[str, Profile] | None = None
    ) -> ClassTable:
        """The policy's classes; `learned` replaces named classes' profiles (curves learned
        online, powerd/allocator/learn.py): every solver then steers by them alike."""
        names = class_names(policy)
        specs = [policy.classes[c] for c in names]
        learned = learned or {}
        profiles = tuple(learned.get(c) or policy.class_profile(c) for c in names)
        # Below its first knot a profile continues its first slope (Profile.value does too),
        # so knots are power_w[1:] (power_w[0] itself for a one-point profile).
        rows = []
        for prof in profiles:
            if prof.power_w.size >= 2:
                rows.append((prof.power_w[1:], prof.slopes_per_w))
            else:
                rows.append((prof.power_w, np.array([prof.first_slope_per_w])))
        width = max(k.size for k, _ in rows)
        knots = np.full((len(names), width), np.inf)
        slopes = np.zeros((len(names), width))
        for c, (k, s) in enumerate(rows):
            knots[c, : k.size] = k / 1000.0
            slopes[c, : s.size] = s * 1000.0
        return cls(
            names=names,
            weight=np.array([s.weight for s in specs], dtype=np.float64),
            floor_w=np.array([s.floor_w or 0.0 for s in specs], dtype=np.float64),
            ceiling_w=np.array(
                [np.inf if s.ceiling_w is None else s.ceiling_w for s in specs], dtype=np.float64
            ),
            profiles=profiles,
            knots_kw=knots,
            slopes_kw=slopes,
            peak_kw=np.array([p.peak_w / 1000.0 for p in profiles], dtype=np.float64),
        )


class Workspace:
    """Scratch arrays for the compiled tree solver (kernel.prepare, solve_groups), kept
    between calls: fresh arrays of this size cost more in page faults than the solve's own
    work. One caller at a time (`take`); a concurrent caller gets fresh arrays."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._i = np.zeros(0, dtype=np.int64)
        self._f = np.zeros((WORK_F, 0))
        self._k = np.zeros((2, 0, 0))

    @contextmanager
    def take(
        self, n: int, n_groups: int, n_k: int
    ) -> Iterator[tuple[IntArray, FloatArray, FloatArray]]:
        if not self._lock.acquire(blocking=False):
            yield work_arrays(n, n_groups, n_k)
            return
        try:
            small = self._k.shape[1] < n or self._k.shape[2] < n_k
            if small or self._i.size < _work_ints(n, n_groups):
                self._i, self._f, self._k = work_arrays(n, n_groups, n_k)
            yield self._i, self._f, self._k
        finally:
            self._lock.release()


# Per unit: lo, multiplicity, floor, cap, prev (kernel._views).
WORK_F = 5


def _work_ints(n: int, n_groups: int) -> int:
    """Counting-sort counts, the units' order, each group's run start and end."""
    return (n_groups + 1) + n + 2 * n_groups


def work_arrays(n: int, n_groups: int, n_k: int) -> tuple[IntArray, FloatArray, FloatArray]:
    return (
        np.zeros(_work_ints(n, n_groups), dtype=np.int64),
        np.zeros((WORK_F, n)),
        np.zeros((2, n, n_k)),
    )


# No GPU in a job (Tree.check's typed stand-in for None).
_NO_JOBS = np.zeros(0, dtype=np.int64)


class Tree:
    """The topology's levels prepared for fast bottom-up sums (one bincount per level)."""

    def __init__(self, topology: Topology) -> None:
        self.topology = topology
        self.n_groups = topology.n_groups
        self.gpu_groups = topology.gpu_groups
        self.node_of_gpu = np.ascontiguousarray(topology.gpu_groups[:, N_LEVELS - 1])
        self.levels = [topology.groups_at(level) for level in range(N_LEVELS)]
        self.level_of = np.zeros(self.n_groups, dtype=np.int64)
        for level, g in enumerate(self.levels):
            self.level_of[g] = level
        self.parents = [topology.parent[g] for g in self.levels]
        self.counts = topology.group_counts()
        self.parent = np.ascontiguousarray(topology.parent, dtype=np.int64)
        # Depth-first order (a group before its subtree, every subtree contiguous) and the
        # groups deepest level first: what the compiled tree solver walks (kernel.py).
        chain = np.full((self.n_groups, N_LEVELS), -1, dtype=np.int64)
        for level in range(N_LEVELS):
            g = self.levels[level]
            chain[g, level] = g
            for up in range(level - 1, -1, -1):
                chain[g, up] = topology.parent[chain[g, up + 1]]
        order = np.lexsort(tuple(chain[:, lv] for lv in range(N_LEVELS - 1, -1, -1)))
        self.dfs_rank = np.empty(self.n_groups, dtype=np.int64)
        self.dfs_rank[order] = np.arange(self.n_groups)
        self.deepest_first = np.concatenate(self.levels[::-1]).astype(np.int64)
        self.workspace = Workspace()
        # What the fleet's jobs imply for this tree, kept from tick to tick while they do
        # not change (_fleet_jobs).
        self.jobs_memo: tuple[IntArray, tuple[str, ...], JobMap | None, BoolArray | None] | None
        self.jobs_memo = None
        # The last capacities and upper bounds `implied_by_children` answered, with its
        # answer: the same from tick to tick while budgets and bounds hold still.
        self.implied_memo: tuple[FloatArray, FloatArray, BoolArray] | None = None
        # The last device bounds `_bounds_kept` answered, with what they were built from.
        self.bounds_memo: tuple[tuple[object, ...], _Bounds] | None = None

    @cached_property
    def first_gpu(self) -> IntArray:
        """A GPU of each group (the lowest-numbered), -1 for a group without GPUs."""
        n = self.gpu_groups.shape[0]
        first = np.full(self.n_groups, n, dtype=np.int64)
        first[self.node_of_gpu[::-1]] = np.arange(n)[::-1]  # (the last write is the lowest)
        for level in range(N_LEVELS - 1, 0, -1):  # a group's: the least of its children's
            np.minimum.at(first, self.parents[level], first[self.levels[level]])
        first[first == n] = -1
        return first

    @cached_property
    def node_paths(self) -> tuple[IntArray, IntArray]:
        """Each node's path of groups once, in node order, and each GPU's row there
        (coupled_newton.py's compiled passes)."""
        # (np.unique's answer, without its sort: nodes in id order, each one's first GPU.)
        has = np.bincount(self.node_of_gpu, minlength=self.n_groups) > 0
        row = (np.cumsum(has) - 1)[self.node_of_gpu]
        first = self.first_gpu[np.flatnonzero(has)]
        return (
            np.ascontiguousarray(self.gpu_groups[first]),
            np.ascontiguousarray(row, dtype=np.int64),
        )

    def sums(self, per_gpu: FloatArray) -> FloatArray:
        """Sum over every group, like Topology.group_sums but one n-long pass only: a
        bincount of the GPUs by node, then one of each level's groups by parent, compiled
        into one call (kernel.tree_sums, the same additions in the same order)."""
        from powerd.allocator import kernel  # numba: loaded by the first call

        return np.asarray(
            kernel.tree_sums(
                self._node_of_gpu64,
                np.ascontiguousarray(per_gpu, dtype=np.float64),
                self.n_groups,
                *self._sum_order,
            )
        )

    @cached_property
    def _node_of_gpu64(self) -> IntArray:
        return np.ascontiguousarray(self.node_of_gpu, dtype=np.int64)

    @cached_property
    def _sum_order(self) -> tuple[IntArray, IntArray, IntArray]:
        """The groups of every level but the root's, deepest first, their parents, and
        where each level starts among them (kernel.tree_sums)."""
        deep = range(N_LEVELS - 1, 0, -1)
        groups = np.concatenate([self.levels[lv] for lv in deep]).astype(np.int64)
        parents = np.concatenate([self.parents[lv] for lv in deep]).astype(np.int64)
        sizes = [0] + [self.levels[lv].size for lv in deep]
        return groups, parents, np.cumsum(sizes).astype(np.int64)

    def check(
        self,
        p: FloatArray,
        lo: FloatArray,
        hi: FloatArray,
        capacity: FloatArray,
        jobs: JobMap | None,
    ) -> tuple[int, int]:
        """Whether caps p (kW) are finite, within [lo, hi] and every group's sum within its
        capacity (to TOL_KW), and a job's GPUs equal: kernel.verify_caps' answer."""
        from powerd.allocator import kernel  # numba: loaded by the first call

        code, group = kernel.verify_caps(
            np.ascontiguousarray(p, dtype=np.float64),
            lo,
            hi,
            TOL_KW,
            _NO_JOBS if jobs is None else jobs.job,
            0 if jobs is None else jobs.n_jobs,
            self._node_of_gpu64,
            capacity,
            *self._sum_order,
        )
        return int(code), int(group)

    def under(self, groups: BoolArray) -> BoolArray:
        """GPUs below any of the marked groups."""
        return self.topology.under_any(np.asarray(groups, dtype=np.bool_))


class JobMap:
    """The GPUs of each job, for per-job reductions broadcast back to the members.

    `job[i]` is GPU i's job in 0..n_jobs-1 (compact: only jobs with GPUs here), -1 for none.
    """

    def __init__(self, job: IntArray, names: tuple[str, ...]) -> None:
        self.job = job
        self.names = names
        self.member = job >= 0
        idx = np.flatnonzero(self.member)
        keys = job[idx]
        if len(names) <= np.iinfo(np.int16).max:
            keys = keys.astype(np.int16)  # numpy sorts 16-bit keys by radix: O(n)
        order = np.argsort(keys, kind="stable")
        self._sorted = idx[order]  # member GPUs, grouped by job
        js = job[self._sorted]
        self._starts = np.flatnonzero(np.r_[True, js[1:] != js[:-1]]) if js.size else js
        # For each sorted member, the index of its run (its job's position in _starts).
        self._run = np.cumsum(np.r_[True, js[1:] != js[:-1]]) - 1 if js.size else js
        self.size = np.bincount(job[idx], minlength=len(names)).astype(np.float64)
        self._incidence: tuple[Tree, tuple[IntArray, IntArray, FloatArray]] | None = None
        self._parts: tuple[Tree, tuple[IntArray, FloatArray, IntArray]] | None = None

    @classmethod
    def of(cls, fleet: GpuArrays) -> JobMap | None:
        """The fleet's jobs (None when no GPU is in one); names outside job_names are none."""
        if fleet.job_index is None:
            return None
        raw = np.asarray(fleet.job_index, dtype=np.int64)
        valid = (raw >= 0) & (raw < len(fleet.job_names))
        if not valid.any():
            return None
        # Compact numbering of the jobs that have GPUs here (a count, not a sort).
        used = np.flatnonzero(np.bincount(raw[valid], minlength=len(fleet.job_names)))
        remap = np.full(len(fleet.job_names), -1, dtype=np.int64)
        remap[used] = np.arange(used.size)
        job = np.where(valid, remap[np.where(valid, raw, 0)], -1)
        return cls(job, tuple(fleet.job_names[int(j)] for j in used))

    @property
    def n_jobs(self) -> int:
        return len(self.names)

    def incidence(self, tree: Tree) -> tuple[IntArray, IntArray, FloatArray]:
        """Each job's groups and its GPUs under each, as (job_ptr, group, count): job j's
        pairs are [job_ptr[j], job_ptr[j + 1]). Built once per tree."""
        kept = self._incidence
        if kept is not None and kept[0] is tree:
            return kept[1]
        from powerd.allocator import kernel  # numba: loaded by the first solve

        ptr, grp, cnt = kernel.job_incidence(
            self.job, self._sorted, self._starts.astype(np.int64), tree.gpu_groups,
            tree.n_groups, self.n_jobs,
        )  # fmt: skip
        out = (np.asarray(ptr), np.asarray(grp), np.asarray(cnt))
        self._incidence = (tree, out)
        return out

    def parts(self, tree: Tree) -> tuple[IntArray, FloatArray, IntArray]:
        """Units for a relaxation of the jobs: each free GPU, and each job's GPUs on one
        node (a part: they share the node's path, so the tree solver prices a part as one
        GPU of multiplicity its size). Each GPU's unit, each unit's GPU count, and a GPU of
        each unit (its first). Built once per tree."""
        kept = self._parts
        if kept is not None and kept[0] is tree:
            return kept[1]
        from powerd.allocator import kernel  # numba: loaded by the first solve

        unit, size, rep = kernel.job_parts(
            self.job, self._sorted, self._starts.astype(np.int64), tree.node_of_gpu,
            tree.n_groups,
        )  # fmt: skip
        out = (np.asarray(unit), np.asarray(size), np.asarray(rep))
        self._parts = (tree, out)
        return out

    @cached_property
    def units(self) -> tuple[IntArray, FloatArray, IntArray]:
        """coupled_newton.py's units: free GPUs, then jobs. Each GPU's unit, each unit's GPU count,
        and a GPU of each unit (its first)."""
        from powerd.allocator import kernel  # numba: loaded by the first solve

        unit, size, rep = kernel.job_units(self.job, self.n_jobs)
        return np.asarray(unit), np.asarray(size), np.asarray(rep)

    def _reduce(self, op: np.ufunc, x: NDArray[Any]) -> NDArray[Any]:
        out = x.copy()
        if self._sorted.size:
            per_job = op.reduceat(x[self._sorted], self._starts)
            out[self._sorted] = per_job[self._run]
        return out

    def max(self, x: FloatArray) -> FloatArray:
        """Each member gets its job's maximum of x; other GPUs keep their own."""
        return self._reduce(np.maximum, x)

    def min(self, x: FloatArray) -> FloatArray:
        return self._reduce(np.minimum, x)

    def any(self, x: BoolArray) -> BoolArray:
        """True for every member of a job where any member is true."""
        return np.asarray(self._reduce(np.logical_or, x), dtype=np.bool_)

    def without(self, drop: BoolArray) -> JobMap | None:
        """The map with the jobs of the marked GPUs dissolved (their GPUs free)."""
        gone = self.any(drop) & self.member
        if not gone.any():
            return self
        job = np.where(gone, -1, self.job)
        keep = np.unique(job[job >= 0])
        if keep.size == 0:
            return None
        remap = np.full(self.n_jobs, -1, dtype=np.int64)
        remap[keep] = np.arange(keep.size)
        job = np.where(job >= 0, remap[np.maximum(job, 0)], -1)
        return JobMap(job, tuple(self.names[int(j)] for j in keep))


@dataclass(frozen=True, eq=False)
class Problem:
    """The instance every solver gets, in kW. Segments are (K, n), one row per segment.

    On [lo, hi] GPU i's weighted utility rises with slope `slopes[k, i]` (weight included)
    over [starts[k, i], starts[k, i] + lengths[k, i]]; the segments tile [lo, hi] in order,
    slopes non-increasing, empty (length 0) segments allowed anywhere.

    `jobs` (None: no jobs) groups GPUs that must get one cap: the members of a job have the
    same bounds, class and segments (build_problem sees to it), only `prev` differs.
    `split_jobs` are jobs that could not be held to one cap (mixed classes, or members whose
    device bounds do not overlap); their GPUs are allocated as free GPUs.
    """

    fleet: GpuArrays
    classes: ClassTable
    tree: Tree
    lo: FloatArray
    hi: FloatArray
    prev: FloatArray
    demand_w: FloatArray
    weight: FloatArray
    flat: FloatArray  # where gains stop: demand or the profile's peak, within [lo, hi]
    capacity: FloatArray  # per group; inf when unconstrained or already infeasible
    eps: float
    delta: float
    dropped_floor: BoolArray
    infeasible_groups: IntArray
    jobs: JobMap | None = None
    split_jobs: tuple[str, ...] = ()
    # Groups whose GPUs all belong to one job: their budget is a bound on that job's cap.
    single_job: BoolArray | None = None

    @property
    def n(self) -> int:
        return int(self.lo.size)

    def unit_prev(self, unit: IntArray, size: FloatArray) -> FloatArray:
        """Per unit (`unit`: each GPU's; `size`: each unit's GPUs), its GPUs' mean cap in
        force: where a unit's damping is centred."""
        return np.bincount(unit, weights=self.prev, minlength=size.size) / size

    @cached_property
    def solver_capacity(self) -> FloatArray:
        """`capacity` as the exact solvers hold it: +inf where a budget cannot bind on its
        own. That is a group holding one job's GPUs alone (a bound on that job's cap), and
        a group whose budget its children's budgets (a node's: its GPUs' upper bounds)
        already imply, such as a row breaker rated at the sum of its racks'. The feasible
        set is the same; the dual loses a degenerate direction (two budgets that bind only
        together, with one price between them to share). Repair and verification hold
        every budget."""
        implied = _implied_kept(self.tree, self.capacity, self.hi)
        capacity = np.where(implied, np.inf, self.capacity)
        if self.single_job is not None:
            capacity = np.where(self.single_job, np.inf, capacity)
        return np.asarray(capacity, dtype=np.float64)

    @cached_property
    def memo(self) -> dict[str, object]:
        """What solvers derive from this problem and share (coupled_newton.py's dual)."""
        return {}

    @cached_property
    def _segment_rows(self) -> tuple[FloatArray, FloatArray, FloatArray]:
        return _segments(
            self.classes,
            cls=self.fleet.class_index,
            weight=self.weight,
            lo=self.lo,
            hi=self.hi,
            flat=self.flat,
        )

    @property
    def starts(self) -> FloatArray:
        """(K, n): where each segment starts (built on first use: the tree solver does
        without them)."""
        return self._segment_rows[0]

    @property
    def lengths(self) -> FloatArray:
        return self._segment_rows[1]

    @property
    def slopes(self) -> FloatArray:
        return self._segment_rows[2]

    @property
    def status(self) -> str:
        if self.infeasible_groups.size:
            return INFEASIBLE_MIN
        if self.dropped_floor.any():
            return FLOORS_DROPPED
        return OPTIMAL


def held_share(spec: DemandSpec | None) -> float:
    """The share of its cap a GPU draws at least when its cap holds it back: the demand
    estimate's `held_share`, or CAP_LIMITED_SHARE without the estimate (no spec, or
    `window_s: 0`). Above the least margin's CAP_LIMITED_SHARE, a GPU drawing between the
    two shares of its cap is neither cut (its cap is at most its least cap + the deadband)
    nor probed: measured, a 1 W gap let draw noise of a few watts flip a GPU to held back,
    probe it by `headroom_w` and cut it back the next tick (docs/allocator.md, "Demand")."""
    if spec is None or spec.window_s <= 0:
        return CAP_LIMITED_SHARE
    return spec.held_share


def pressing_cap_w(fleet: GpuArrays) -> FloatArray:
    """Per GPU the cap its draw is judged against: the lesser of the cap that may be in
    force (`cap_w`) and the one in force when the draw was sampled (`sampled_cap_w`, where
    reported). A raise made since the sample is not yet evidence that the GPU's demand fits
    (its draw under the new cap is unknown); a cut made since is (the draw will press it)."""
    sampled = fleet.sampled_cap_w
    if sampled is None:
        return fleet.cap_w
    return np.asarray(
        np.where(np.isfinite(sampled), np.minimum(sampled, fleet.cap_w), fleet.cap_w),
        dtype=np.float64,
    )


def held_back(fleet: GpuArrays, spec: DemandSpec | None) -> BoolArray:
    """Per GPU whether its cap holds it back: it draws at least `held_share(spec)` of it
    (`pressing_cap_w`). The one test the demand estimate, the spare power's anchors and the
    deadband's pressed GPUs share."""
    return np.asarray(judged_draw_w(fleet) >= held_share(spec) * pressing_cap_w(fleet))


def judged_draw_w(fleet: GpuArrays) -> FloatArray:
    """Per GPU the draw its demand is judged by: its last sample, or, where its draw swings
    all window (`swinging`, `control.demand.swing_keep_w`), its recent peak: in the low
    phase of a swing it wants what its high phase needs, and a GPU pressed in its high
    phase is still held back in its low one, so its cap does not follow the swing down and
    back up every period (docs/allocator.md, "Demand")."""
    if fleet.swinging is None or fleet.recent_w is None:
        return fleet.power_w
    return np.asarray(
        np.where(fleet.swinging, np.maximum(fleet.power_w, fleet.recent_w), fleet.power_w),
        dtype=np.float64,
    )


def demand_w(fleet: GpuArrays, headroom_w: float, spec: DemandSpec | None = None) -> FloatArray:
    """What each GPU could use (docs/allocator.md, "Demand").

    Without `recent_w` (or `spec`): its maximum when its cap holds it back (it draws ≥ 95 %
    of it), else its draw + headroom. With them, as `spec` says: a held-back GPU (it draws
    ≥ `held_share` of its cap, `held_share()`) wants its
    maximum (`held: max`) or what it has drawn recently, at least its cap, + headroom
    (`held: probe`: it climbs by headroom a tick until its draw no longer reaches its cap,
    instead of taking its maximum from GPUs that use what they have); any other wants its
    draw + headroom (`margin: headroom`) or the least cap it would not read as held back by,
    at most that (`margin: least`: the headroom is then spare power, spread by `anchor_kw`).
    """
    recent = fleet.recent_w
    if recent is None or spec is None:
        limited = fleet.power_w >= CAP_LIMITED_SHARE * pressing_cap_w(fleet)
        return np.where(limited, fleet.max_cap_w, fleet.power_w + headroom_w)
    limited = held_back(fleet, spec)
    held = fleet.max_cap_w
    if spec.held == "probe":
        # One step above the cap it pressed on, per sample: a tick before the next sample
        # (on acks) does not climb again on the same evidence.
        held = np.minimum(fleet.max_cap_w, np.maximum(recent, pressing_cap_w(fleet)) + headroom_w)
    draw = judged_draw_w(fleet)
    free = draw + headroom_w
    if spec.margin == "least":
        free = np.minimum(free, draw / CAP_LIMITED_SHARE + LEAST_MARGIN_W)
    return np.where(limited, held, free)


def floors_w(fleet: GpuArrays, classes: ClassTable, spec: DemandSpec) -> FloatArray:
    """Each GPU's class floor (0: none). With `floors: follow` and `recent_w`, a floor holds
    up to what the GPU has drawn recently at most: a serving GPU that has drawn less than
    its floor over the whole window is guaranteed what it drew, and the rest of its floor
    is spare power (spread by `anchor_kw`, so it comes back first when room is left)."""
    floor = classes.floor_w[fleet.class_index]
    if fleet.recent_w is None or spec.floors == "fixed":
        return floor
    return np.asarray(np.minimum(floor, np.maximum(fleet.recent_w, fleet.power_w)))


def anchor_kw(
    fleet: GpuArrays,
    spec: DemandSpec,
    *,
    demand: FloatArray,
    prev: FloatArray,
    lo: FloatArray,
    hi: FloatArray,
) -> FloatArray:
    """Where the damping term centres each GPU's cap (kW): power left after demand is
    spread around it (every GPU above its demand sits at its anchor less one common amount,
    or more where room is left). The cap in force (`spare: caps`, or without `recent_w`), or
    what the GPU has drawn recently at most, its swing included, or its demand, whichever is
    higher (`spare: recent`): spare power then goes where draw has recently been, not where
    caps happened to be. A GPU held back by its cap (`held_share`) has its anchor
    `held_spare_w` above its demand (its probe): it is the one GPU known to want more than
    its cap, so spare power reaches it before the margins of GPUs that may rise; measured,
    its probe claimed at its class's weight instead costs work (docs/performance.md,
    "Demand that follows the work")."""
    if fleet.recent_w is None or spec.spare == "caps":
        return prev
    anchor = np.maximum(fleet.recent_w, demand)
    if spec.held_spare_w > 0:
        anchor = np.where(held_back(fleet, spec), demand + spec.held_spare_w, anchor)
    return np.asarray((anchor / 1000.0).clip(lo, hi))


def capacities_kw(
    topology: Topology, budget_w: FloatArray | None, reserved_w: FloatArray | None
) -> FloatArray:
    """Per-group room for GPU caps: budget − overhead below − power reserved below."""
    budget = topology.budget_w if budget_w is None else budget_w
    cap = budget - topology.overhead_w
    if reserved_w is not None:
        # Power committed at a group also draws on every ancestor's budget.
        below = np.asarray(reserved_w, dtype=np.float64).copy()
        for level in range(N_LEVELS - 1, 0, -1):
            g = topology.level_groups[level]
            np.add.at(below, topology.parent[g], below[g])
        cap = cap - below
    return np.asarray(cap / 1000.0, dtype=np.float64)


def _over(tree: Tree, lo: FloatArray, capacity: FloatArray) -> BoolArray:
    # (As _verify compares: the sum less the capacity against TOL_KW, so that the two agree
    # at the boundary; sum > capacity + TOL_KW rounds the other way there.)
    return np.asarray(tree.sums(lo) - capacity > TOL_KW, dtype=np.bool_)


# A budget counts as implied by its children's where it is at least their sum less this
# share of it (budgets set to the sum of their children's differ from it by rounding); the
# caps' repair absorbs the difference (at most ~1e-12 of the budget).
IMPLIED_SHARE = 1e-12


def _implied_by_children(tree: Tree, capacity: FloatArray, hi: FloatArray) -> BoolArray:
    """The groups whose budget holds whenever their children's do: the sum of what their
    children can take (a node's children: its GPUs, up to hi; a group's: the lesser of its
    budget and its own children's) fits it."""
    most = np.bincount(tree.node_of_gpu, weights=hi, minlength=tree.n_groups)
    implied = np.zeros(tree.n_groups, dtype=np.bool_)
    for level in range(N_LEVELS - 1, -1, -1):
        g = tree.levels[level]
        cap = capacity[g]
        implied[g] = np.isfinite(cap) & (cap >= most[g] * (1.0 - IMPLIED_SHARE))
        most[g] = np.minimum(most[g], cap)
        if level > 0:
            most += np.bincount(tree.parents[level], weights=most[g], minlength=tree.n_groups)
    return implied


def _implied_kept(tree: Tree, capacity: FloatArray, hi: FloatArray) -> BoolArray:
    """`_implied_by_children`, kept on the tree while the capacities and upper bounds are
    the same as the last call's (most ticks: budgets and device bounds seldom move)."""
    memo = tree.implied_memo
    if memo is not None and np.array_equal(memo[0], capacity) and np.array_equal(memo[1], hi):
        return memo[2]
    implied = _implied_by_children(tree, capacity, hi)
    tree.implied_memo = (capacity.copy(), hi.copy(), implied)
    return implied


def _single_job_groups(tree: Tree, jobs: JobMap) -> BoolArray:
    """The groups whose GPUs all belong to one job."""
    from powerd.allocator import kernel  # numba: loaded by the first solve

    return np.asarray(
        kernel.single_job_groups(jobs.job, tree.gpu_groups, tree.n_groups), dtype=np.bool_
    )


def _single_job_room(
    tree: Tree, jobs: JobMap, single: BoolArray, capacity: FloatArray
) -> FloatArray:
    """Per GPU, the tightest capacity / GPU count over the groups that hold only its job's
    GPUs (`single`; +inf where there is none)."""
    groups = np.flatnonzero(single)
    per_job = np.full(jobs.n_jobs, np.inf)
    np.minimum.at(
        per_job,
        jobs.job[tree.first_gpu[groups]],
        capacity[groups] / np.maximum(tree.counts[groups], 1),
    )
    return np.where(jobs.member, per_job[np.maximum(jobs.job, 0)], np.inf)


def _fleet_jobs(tree: Tree, fleet: GpuArrays) -> tuple[JobMap | None, BoolArray | None]:
    """The fleet's jobs and the groups each holds alone: kept on the tree while the
    fleet's job of every GPU stays the same (a scheduler changes them seldom, a tick is
    every second)."""
    raw = fleet.job_index
    if raw is None:
        return None, None
    memo = tree.jobs_memo
    if memo is not None and memo[1] == fleet.job_names and np.array_equal(memo[0], raw):
        return memo[2], memo[3]
    jobs = JobMap.of(fleet)
    single = None if jobs is None else _single_job_groups(tree, jobs)
    tree.jobs_memo = (np.array(raw, dtype=np.int64, copy=True), fleet.job_names, jobs, single)
    return jobs, single


def _job_bounds(
    fleet: GpuArrays,
    tree: Tree,
    capacity: FloatArray,
    lo: FloatArray,
    hi: FloatArray,
    *,
    jobs: JobMap | None,
    single: BoolArray | None,
) -> tuple[JobMap | None, list[str], FloatArray, FloatArray, BoolArray | None]:
    """Jobs and each GPU's device bounds with its job's applied.

    A job's one cap must suit every member: the highest lower bound, the lowest upper one,
    so a pinned or stale member holds its whole job. A job whose members' ranges do not
    meet, or that mixes classes, is split: its GPUs are allocated as free GPUs, and it is
    reported. A group whose GPUs all belong to one job becomes a bound on that job's cap
    (room / count): the same feasible set, and the solver no longer has to price a group
    that only one job answers to (coupled_newton.py). Those groups are returned too.
    """
    if jobs is None or single is None:  # (the fleet's jobs: _fleet_jobs)
        return None, [], lo, hi, None
    cls = fleet.class_index.astype(np.float64)
    job_lo, job_hi = jobs.max(lo), jobs.min(hi)
    bad = jobs.member & ((job_lo > job_hi) | (jobs.max(cls) != jobs.min(cls)))
    split: list[str] = []
    if bad.any():
        split = sorted({jobs.names[int(j)] for j in np.unique(jobs.job[bad])})
        jobs = jobs.without(bad)
        if jobs is None:
            return None, split, lo, hi, None
        single = _single_job_groups(tree, jobs)
        job_lo, job_hi = jobs.max(lo), jobs.min(hi)
    lo, hi = job_lo, job_hi
    room = _single_job_room(tree, jobs, single, capacity)
    hi = np.where(jobs.member, np.maximum(np.minimum(hi, room), lo), hi)
    return jobs, split, lo, hi, single


_Bounds = tuple[
    JobMap | None, list[str], FloatArray, FloatArray, BoolArray | None, BoolArray, FloatArray
]


def _bounds_kept(
    fleet: GpuArrays, classes: ClassTable, tree: Tree, capacity: FloatArray, leftover: str
) -> _Bounds:
    """`_bounds`, kept on the tree while its inputs are the same, bit for bit, as the last
    call's (most ticks: device limits, pins, classes, jobs and budgets hold still; a stale
    GPU's cap counts only where one is stale). Its arrays are shared: not to be written."""
    jobs, single = _fleet_jobs(tree, fleet)
    stale = fleet.stale
    inputs = (
        capacity,
        fleet.pinned_w,
        fleet.min_cap_w,
        fleet.max_cap_w,
        fleet.class_index,
        stale,
        fleet.cap_w[stale],
    )
    key = (classes, leftover, jobs, *[(a.dtype.str, a.tobytes()) for a in inputs])
    memo = tree.bounds_memo
    if memo is not None and memo[0] == key:
        return memo[1]
    out = _bounds(fleet, classes, tree, capacity, leftover, jobs=jobs, single=single)
    tree.bounds_memo = (key, out)
    return out


def _bounds(
    fleet: GpuArrays,
    classes: ClassTable,
    tree: Tree,
    capacity: FloatArray,
    leftover: str,
    *,
    jobs: JobMap | None,
    single: BoolArray | None,
) -> _Bounds:
    """(jobs, split jobs, lo, hi, single-job groups, groups whose device minimums exceed
    their budget, capacities with those left out): each GPU's device bounds (kW) with its
    job's applied, and where even the minimums do not fit a group its GPUs fixed there."""
    cls = fleet.class_index
    pinned = ~np.isnan(fleet.pinned_w)
    lo_dev = np.where(pinned, fleet.pinned_w, fleet.min_cap_w) / 1000.0
    hi_w = np.minimum(fleet.max_cap_w, classes.ceiling_w[cls])
    if leftover == "peak":
        # Power past the profile's peak buys nothing: leave it unallocated. A class floor
        # above the peak still holds (as do device minimums and pins, below).
        hi_w = np.minimum(hi_w, np.maximum(classes.peak_kw[cls] * 1000.0, classes.floor_w[cls]))
    hi_w = np.where(fleet.stale, np.minimum(hi_w, fleet.cap_w), hi_w)  # stale: never raised
    hi_base = np.where(pinned, lo_dev, np.maximum(hi_w / 1000.0, lo_dev))

    jobs, split, lo_dev, hi_base, single = _job_bounds(
        fleet, tree, capacity, lo_dev, hi_base, jobs=jobs, single=single
    )

    bad = _over(tree, lo_dev, capacity)
    if bad.any():
        hi_base = np.where(_under(tree, jobs, bad), lo_dev, hi_base)
        capacity = np.where(bad, np.inf, capacity)
    return jobs, split, lo_dev, hi_base, single, bad, capacity


def _under(tree: Tree, jobs: JobMap | None, groups: BoolArray) -> BoolArray:
    """Per GPU whether it sits below any of the marked groups, or a GPU of its job does
    (a job's GPUs share one cap, so they move together)."""
    under = tree.under(groups)
    return under if jobs is None else jobs.any(under)


def _tree_for(fleet: GpuArrays, tree: Tree | None) -> Tree:
    """The tree given (checked against the fleet's topology: a tree kept from another one
    would mis-sum every budget), or one built for the fleet."""
    if tree is None:
        return Tree(fleet.topology)
    if tree.topology is not fleet.topology and (
        tree.n_groups != fleet.topology.n_groups
        or not np.array_equal(tree.gpu_groups, fleet.topology.gpu_groups)
    ):
        raise ValueError("the tree passed was built for another topology than the fleet's")
    return tree


def build_problem(
    fleet: GpuArrays,
    policy: Policy,
    *,
    classes: ClassTable | None = None,
    tree: Tree | None = None,
    budget_w: FloatArray | None = None,
    reserved_w: FloatArray | None = None,
) -> Problem:
    """Bounds, utilities and budgets for one allocation, with infeasibility resolved.

    Order of concessions when budgets are short: slew's lower bound first (a safety cut
    beats smoothing), then class floors (lowest weight first, only under violated groups),
    and when even device minimums do not fit a group, its GPUs are fixed at their minimum
    and the group is left out of the problem (status infeasible_min).
    """
    classes = classes or ClassTable.from_policy(policy)
    tree = _tree_for(fleet, tree)
    ctl = policy.control
    cls = fleet.class_index
    weight = classes.weight[cls]
    capacity = capacities_kw(fleet.topology, budget_w, reserved_w)
    jobs, split, lo_dev, hi_base, single, bad, capacity = _bounds_kept(
        fleet, classes, tree, capacity, ctl.leftover
    )

    lo_floor = np.minimum(
        np.maximum(lo_dev, floors_w(fleet, classes, ctl.demand) / 1000.0), hi_base
    )
    dropped = np.zeros(fleet.n, dtype=np.bool_)
    for w in classes.weights:
        over = _over(tree, lo_floor, capacity)
        if not over.any():
            break
        drop = tree.under(over) & (weight == w) & (lo_floor > lo_dev)
        if jobs is not None:
            drop = jobs.any(drop) & (lo_floor > lo_dev)
        lo_floor = np.where(drop, lo_dev, lo_floor)
        dropped |= drop

    prev = fleet.cap_w / 1000.0
    if ctl.slew_w is not None:
        slew = ctl.slew_w / 1000.0
        lo = (prev - slew).clip(lo_floor, hi_base)
        hi = (prev + slew).clip(lo_floor, hi_base)
        if jobs is not None:
            # Members that start apart move together: where their slew windows do not
            # meet, the job moves without slew (as a safety cut does).
            lo, hi = jobs.max(lo), jobs.min(hi)
            apart = lo > hi
            lo = np.where(apart, lo_floor, lo)
            hi = np.where(apart, hi_base, hi)
        over = _over(tree, lo, capacity)
        if over.any():
            lo = np.where(_under(tree, jobs, over), lo_floor, lo)
    else:
        lo, hi = lo_floor, hi_base

    demand = demand_w(fleet, policy.defaults.headroom_w, ctl.demand)
    if jobs is not None:
        demand = jobs.max(demand)  # one synchronous job: it wants what its hungriest GPU does
    flat = np.minimum(demand / 1000.0, classes.peak_kw[cls]).clip(lo, hi)
    prev = anchor_kw(fleet, ctl.demand, demand=demand, prev=prev, lo=lo, hi=hi)
    eps = max(ctl.damping, MIN_DAMPING)
    gap = float(np.max(hi - prev, initial=0.0))
    return Problem(
        fleet=fleet,
        classes=classes,
        tree=tree,
        lo=lo,
        hi=hi,
        prev=prev,
        demand_w=demand,
        weight=weight,
        flat=flat,
        capacity=capacity,
        eps=eps,
        delta=2.0 * eps * (max(gap, 0.0) + DELTA_MARGIN_KW),
        dropped_floor=dropped,
        infeasible_groups=np.flatnonzero(bad).astype(np.int64),
        jobs=jobs,
        split_jobs=tuple(split),
        single_job=single,
    )


def _segments(
    classes: ClassTable,
    *,
    cls: IntArray,
    weight: FloatArray,
    lo: FloatArray,
    hi: FloatArray,
    flat: FloatArray,
) -> tuple[FloatArray, FloatArray, FloatArray]:
    """Each GPU's utility on [lo, hi] as K = R + 1 segments: the profile's R pieces cut to
    [lo, flat], then one flat piece [flat, hi], flat = where demand or the peak stops gains."""
    n = lo.size
    n_knots = classes.knots_kw.shape[1]
    starts = np.empty((n_knots + 1, n))
    starts[0] = lo
    slopes = np.empty_like(starts)
    slopes[-1] = 0.0
    for j in range(n_knots):
        # Row by row from 1-d tables; mode="clip" avoids the buffered copy of mode="raise".
        np.take(classes.knots_kw[:, j], cls, out=starts[j + 1], mode="clip")
        np.take(classes.slopes_kw[:, j], cls, out=slopes[j], mode="clip")
    # Segment j ends at knot j, clipped into [lo, flat]; padding knots (+inf) clip to flat.
    np.clip(starts[1:], lo, flat, out=starts[1:])
    slopes[:-1] *= weight
    lengths = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    np.subtract(hi, starts[-1], out=lengths[-1])
    return starts, lengths, slopes


def objective(problem: Problem, p_kw: FloatArray) -> float:
    """Σ w·profile(min(p, demand)) + δ·Σ p − ε·Σ (p − prev)², p in kW: the same for all solvers."""
    from powerd.allocator import kernel  # numba: loaded by the first solve

    table_w, table_y = problem.classes.value_table
    # One interpolation for all classes: class c's curve lives at c·offset (see value_table).
    return float(
        kernel.objective_value(
            np.ascontiguousarray(p_kw, dtype=np.float64),
            problem.demand_w,
            problem.fleet.class_index,
            problem.weight,
            problem.prev,
            table_w,
            table_y,
            ClassTable.TABLE_OFFSET_W,
            problem.delta,
            problem.eps,
        )
    )


def unused_w(problem: Problem, p_kw: FloatArray) -> float:
    """Room the caps leave in the root's budget (W); 0 where the root has no budget (or its
    device minimums alone exceed it)."""
    room = float(problem.capacity[0])
    if not np.isfinite(room) or p_kw.size == 0:
        return 0.0
    return max(room - float(p_kw.sum()), 0.0) * 1000.0


def repair(problem: Problem, p_kw: FloatArray) -> FloatArray:
    """Clip to bounds, then cut any group still over its capacity, bottom-up.

    Cuts are proportional to each GPU's room above its lower bound; cutting a group never
    raises a group below it, so one pass per level suffices. Groups are filled to just
    under capacity: a sum of m caps is only exact to about m·ulp, and the budget must hold
    whatever order the caps are later added in (≈1 mW at 100k GPUs under 70 MW).
    """
    from powerd.allocator import kernel  # numba: loaded by the first solve

    lo = problem.lo
    p = p_kw.clip(lo, problem.hi)
    tree = problem.tree
    cap = problem.capacity
    slack = 2.0 * np.finfo(np.float64).eps * tree.counts * np.where(np.isfinite(cap), cap, 0.0)
    kernel.cut_to_budgets(
        p, lo, tree.node_of_gpu, tree.parent, tree.deepest_first, cap - np.abs(slack)
    )
    if problem.jobs is not None:
        # Cuts differ between groups; a job takes its lowest member's cap, which fits every
        # budget the cut caps fit (members share lo, so it stays within bounds).
        p = problem.jobs.min(p)
    return p


@dataclass(frozen=True, eq=False)
class Allocation:
    """Caps for every GPU of a snapshot and how they were found.

    `objective` is the same formula for every solver (see `objective`). `repair_w` is the
    largest change the final verification had to make to the solver's caps (0 for the exact
    solvers up to rounding); `prices` are the group multipliers per kW (warm start, and
    each budget's shadow price). `lo_w`/`hi_w` are the bounds each cap was given and
    `demand_w` the demand estimate (build_problem's): what explains a cap (controller/why.py).
    `gap` bounds how far from the optimum the caps can be, relative (with jobs, from the
    dual bound: coupled_newton.gap; 0 without jobs, where `fast` is exact).
    """

    status: str
    solver: str
    objective: float
    solve_ms: float
    uuids: tuple[str, ...]
    caps_w: FloatArray
    dropped_floors: tuple[str, ...] = ()
    infeasible_groups: tuple[str, ...] = ()
    repair_w: float = 0.0
    prices: FloatArray | None = None
    split_jobs: tuple[str, ...] = ()
    gap: float = 0.0
    # Room in the root's budget the caps leave unallocated (W): power no GPU can use (past
    # its peak or its maximum, or behind a full budget below). 0 when the root is unbudgeted.
    unused_w: float = 0.0
    lo_w: FloatArray | None = None
    hi_w: FloatArray | None = None
    demand_w: FloatArray | None = None

    def caps(self) -> dict[str, float]:
        return dict(zip(self.uuids, self.caps_w.tolist(), strict=True))

    def to_json(self) -> dict[str, Any]:
        return {
            "status": self.status,
            "solver": self.solver,
            "objective": self.objective,
            "solve_ms": self.solve_ms,
            "caps": self.caps(),
            "dropped_floors": list(self.dropped_floors),
            "infeasible_groups": list(self.infeasible_groups),
            "repair_w": self.repair_w,
            "split_jobs": list(self.split_jobs),
            "gap": self.gap,
            "unused_w": self.unused_w,
        }
