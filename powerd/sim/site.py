"""The site a simulation runs on: the policy's tree, reshaped, and what every GPU runs.

Growing a site keeps its design: new nodes copy the policy's first node (budget, overhead,
failsafe), fill racks of the first rack's size (with its budget), and racks fill rows of the
first row's size (with its budget). The facility budget, the feed, is set apart: growing a
site under the same feed is the oversubscription question. See docs/simulator.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, replace
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from powerd.allocator.problem import JobMap
from powerd.backends.mock import Pattern as MockPattern
from powerd.backends.mock import Workload
from powerd.policy import GroupDef, Policy, subtree_totals
from powerd.profile import Profile
from powerd.sim.recorded import replay
from powerd.sim.scenario import HOUR_S, Scenario, ScenarioError, WorkloadSpec
from powerd.sim.traces import GpuTrace
from powerd.topology import Topology

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
FACILITY, ROW, RACK, NODE = 0, 1, 2, 3


@dataclass(frozen=True)
class Site:
    """A policy whose tree is this site's, with every GPU placed (GPUs contiguous per node)."""

    policy: Policy
    gpu_nodes: tuple[str, ...]
    topology: Topology
    tdp_w: float
    min_cap_w: float

    @property
    def n_gpus(self) -> int:
        return len(self.gpu_nodes)

    @property
    def n_nodes(self) -> int:
        return sum(1 for g in self.policy.groups if g.level == NODE)

    @property
    def feed_w(self) -> float:
        return float(self.topology.budget_w[0])

    @property
    def nameplate_w(self) -> float:
        """What static provisioning reserves: every GPU at TDP plus every node's overhead."""
        return self.n_gpus * self.tdp_w + float(self.topology.overhead_w[0])

    def node_nameplate_w(self) -> float:
        """Nameplate of one node of this site's design (its first node)."""
        node = next(g for g in self.policy.groups if g.level == NODE)
        return node.gpus * self.tdp_w + node.overhead_w

    def node_min_w(self) -> float:
        """One node of this site's design with every GPU at its device minimum."""
        node = next(g for g in self.policy.groups if g.level == NODE)
        return node.gpus * self.min_cap_w + node.overhead_w

    def with_budgets(self, budget_w: FloatArray, note: str) -> Site:
        groups = tuple(
            replace(g, budget_w=float(b)) for g, b in zip(self.policy.groups, budget_w, strict=True)
        )
        return _site(replace(self.policy, groups=groups, source=f"{self.policy.source} ({note})"))

    def inner_at_nameplate(self) -> Site:
        """Rows, racks and nodes budgeted at the nameplate of what they hold (breakers sized
        for TDP, as static provisioning sizes them), so the feed is the only shared limit."""
        topo = self.topology
        budgets = topo.group_sums(np.full(self.n_gpus, self.tdp_w)) + topo.overhead_w
        budgets[0] = topo.budget_w[0]
        return self.with_budgets(budgets, "inner budgets at nameplate")

    def scaled(self, facility_budget_w: float) -> Site:
        """Every budget of the tree scaled by one factor so the feed is `facility_budget_w`:
        the same design at another feed. An unbudgeted facility gets the feed alone."""
        budgets = self.topology.budget_w.copy()
        if math.isfinite(budgets[0]):
            budgets *= facility_budget_w / budgets[0]
        budgets[0] = facility_budget_w
        return self.with_budgets(budgets, f"budgets scaled to a {facility_budget_w:,.0f} W feed")

    def with_feed(self, facility_budget_w: float) -> Site:
        budgets = self.topology.budget_w.copy()
        budgets[0] = facility_budget_w
        return self.with_budgets(budgets, f"feed {facility_budget_w:,.0f} W")


def _site(policy: Policy) -> Site:
    nodes = [name for g in policy.groups if g.level == NODE for name in [g.name] * g.gpus]
    gpu = policy.defaults.gpu
    return Site(
        policy=policy,
        gpu_nodes=tuple(nodes),
        topology=Topology.build(policy, nodes),
        tdp_w=gpu.max_cap_w,
        min_cap_w=gpu.min_cap_w,
    )


def grown_groups(policy: Policy, nodes: int, gpus_per_node: int | None) -> tuple[GroupDef, ...]:
    """The policy's design with `nodes` nodes: racks of the first rack's size, rows of the
    first row's size, every new group with its template's budget (the facility's unchanged)."""
    groups = policy.groups
    row_t = next(g for g in groups if g.level == ROW)
    rack_t = next(g for g in groups if g.level == RACK)
    node_t = next(g for g in groups if g.level == NODE)
    first_row = groups.index(row_t)
    first_rack = groups.index(rack_t)
    racks_per_row = max(1, sum(1 for g in groups if g.level == RACK and g.parent == first_row))
    nodes_per_rack = max(1, sum(1 for g in groups if g.level == NODE and g.parent == first_rack))
    gpus = node_t.gpus if gpus_per_node is None else gpus_per_node
    out = [replace(groups[0], path="facility")]
    made = 0
    row_no = 0
    while made < nodes:
        row_no += 1
        row_name = f"row-{row_no}"
        row_idx = len(out)
        out.append(replace(row_t, name=row_name, parent=0, path=f"grown {row_name}"))
        for k in range(1, racks_per_row + 1):
            if made >= nodes:
                break
            rack_name = f"{row_name}-rack-{k}"
            rack_idx = len(out)
            out.append(replace(rack_t, name=rack_name, parent=row_idx, path=f"grown {rack_name}"))
            for j in range(1, nodes_per_rack + 1):
                if made >= nodes:
                    break
                name = f"{rack_name}-node-{j:02d}"
                out.append(
                    replace(node_t, name=name, parent=rack_idx, gpus=gpus, path=f"grown {name}")
                )
                made += 1
    return tuple(out)


def build_site(
    policy: Policy,
    *,
    nodes: int | None = None,
    gpus_per_node: int | None = None,
    facility_budget_w: float | None = None,
    feed_fraction: float | None = None,
) -> Site:
    """The policy's site as declared, or grown/shrunk to `nodes`, with the feed overridden."""
    if nodes is not None:
        groups = grown_groups(policy, nodes, gpus_per_node)
        policy = replace(policy, groups=groups, source=f"{policy.source} (grown to {nodes} nodes)")
    elif gpus_per_node is not None:
        groups = tuple(
            replace(g, gpus=gpus_per_node) if g.level == NODE else g for g in policy.groups
        )
        policy = replace(policy, groups=groups)
    site = _site(policy)
    if feed_fraction is not None:
        facility_budget_w = feed_fraction * site.nameplate_w
    if facility_budget_w is not None:
        site = site.with_feed(facility_budget_w)
    return site


def site_for(scenario: Scenario, policy: Policy) -> Site:
    s = scenario.spec.site
    return build_site(
        policy,
        nodes=s.nodes,
        gpus_per_node=s.gpus_per_node,
        facility_budget_w=s.facility_budget_w,
        feed_fraction=s.feed_fraction,
    )


# -- what every GPU runs -------------------------------------------------------------------


@dataclass(frozen=True)
class Mix:
    """Per GPU: the mock workload at the start, its class, and the scheduled changes."""

    workloads: tuple[Workload, ...]
    class_index: IntArray  # into the policy's classes (allocator order)
    workload_index: IntArray  # into the scenario's workloads
    # (time_s, GPUs, workload) in time order: idle windows starting and ending.
    events: tuple[tuple[float, IntArray, Workload], ...]
    # Synchronous training jobs (`pattern: training`): each job's GPUs, and per GPU the job
    # its node reports (`<workload>/<job>`, None outside one), as a scheduler would name it.
    sync_jobs: tuple[IntArray, ...] = ()
    gpu_jobs: tuple[str | None, ...] = ()

    def sync_throughput(self, tput: FloatArray) -> FloatArray:
        """Per GPU throughput with every synchronous job at the pace of its slowest GPU: its
        ranks meet at every step, so a GPU with more power than the slowest waits for it
        (docs/simulator.md, "Synchronous training"). GPUs on the last axis (a block of
        sub-steps before it); `tput` itself when there are none."""
        jobs = self._sync_map
        if jobs is None:
            return tput
        # (A block: GPUs on the columns, reduced as rows; back in its own C order.)
        return jobs.min(tput) if tput.ndim == 1 else np.ascontiguousarray(jobs.min(tput.T).T)

    @cached_property
    def _sync_map(self) -> JobMap | None:
        """`sync_jobs` as the allocator's per-job reductions (None: no job)."""
        if not self.sync_jobs:
            return None
        job = np.full(len(self.workloads), -1, dtype=np.int64)
        for j, gpus in enumerate(self.sync_jobs):
            job[gpus] = j
        return JobMap(job, tuple(str(j) for j in range(len(self.sync_jobs))))


def assign_nodes(shares: list[float], n_nodes: int, placement: str) -> IntArray:
    """Which workload each node runs. `spread` deals nodes out so every stretch of the site
    holds the mix (each node to the workload furthest below its share so far); `packed` gives
    each workload one contiguous block. Counts are the same either way."""
    share = np.asarray(shares, dtype=np.float64)
    # Largest remainder: exact counts that add up to n_nodes.
    raw = share * n_nodes
    counts = np.floor(raw).astype(np.int64)
    for k in np.argsort(-(raw - counts), kind="stable")[: n_nodes - int(counts.sum())]:
        counts[k] += 1
    if placement == "packed":
        return np.repeat(np.arange(share.size), counts).astype(np.int64)
    out = np.empty(n_nodes, dtype=np.int64)
    given = np.zeros(share.size, dtype=np.int64)
    for k in range(n_nodes):
        deficit = np.where(given < counts, counts * (k + 1) / n_nodes - given, -np.inf)
        w = int(np.argmax(deficit))
        out[k] = w
        given[w] += 1
    return out


def check_minimums_fit(scenario: Scenario, site: Site) -> None:
    """Every budget of the scenario's site holds its GPUs at their device minimums plus
    overhead: below that no policy keeps it (every run would end as a steered policy over a
    budget, exit 1, the code for a bug), so it is the scenario's feed that is wrong."""
    groups = site.policy.groups
    mins = subtree_totals(
        groups, [g.gpus * site.min_cap_w + g.overhead_w if g.level == NODE else 0.0 for g in groups]
    )
    first_per_level: dict[int, tuple[str, str]] = {}
    for g, total in zip(groups, mins, strict=True):
        if total <= g.budget_w + 1e-9 or g.level in first_per_level:
            continue
        first_per_level[g.level] = (
            "site" if g.level == FACILITY else f"site (group '{g.name}')",
            f"{g.name}'s budget ({g.budget_w:,.0f} W) is below its GPUs at their device minimums "
            f"plus overhead ({total:,.0f} W): no policy can keep it; "
            + (
                "raise the feed (site.facility_budget_w or site.feed_fraction) or give the "
                "site fewer nodes"
                if g.level == FACILITY
                else "give the site fewer nodes or GPUs per node, or this group a larger "
                "budget in the policy"
            ),
        )
    if first_per_level:  # the first group of each level: the others are alike
        raise ScenarioError(scenario.source, list(first_per_level.values()))


def check_mix_fits(scenario: Scenario, site: Site) -> None:
    """Every workload gets at least one node of the scenario's own site, and a training
    workload a node per job (a job holds whole nodes): otherwise a workload, or some of its
    jobs, would silently run on no GPU and the mix simulated would not be the one asked for.
    (A search's smaller sites may leave a small share out: those are sizes, not the mix.)"""
    specs = scenario.spec.workloads
    n_nodes = site.n_nodes
    counts = np.bincount(
        assign_nodes([w.share for w in specs], n_nodes, scenario.spec.site.placement),
        minlength=len(specs),
    )
    problems = []
    for i, (w, n) in enumerate(zip(specs, counts.tolist(), strict=True)):
        if n == 0:
            problems.append(
                (
                    f"workloads[{i}].share",
                    f"a share of {w.share:g} of the site's {n_nodes} node(s) is no node: "
                    "workloads hold whole nodes; give the site more nodes (site.nodes) or "
                    "this workload a larger share",
                )
            )
        elif w.kind == "training" and w.jobs > n:
            problems.append(
                (
                    f"workloads[{i}].jobs",
                    f"{w.jobs} jobs on the workload's {n} node(s): a job holds whole nodes; "
                    f"at most {n} jobs, or more nodes",
                )
            )
    if problems:
        raise ScenarioError(scenario.source, problems)


def workload_profile(spec: WorkloadSpec, policy: Policy) -> Profile:
    """The true curve of a workload's GPUs: its own `profile`, else its class's."""
    if spec.profile is None:
        return policy.class_profile(spec.class_)
    if isinstance(spec.profile, str):
        return policy.profiles[spec.profile]
    return Profile.from_points(spec.name, spec.profile.points)


def _mock_workloads(spec: WorkloadSpec, policy: Policy, rng: np.random.Generator) -> list[Workload]:
    """One mock Workload per job (training) or service (inference), or one for the whole
    workload; the workload's nodes are split evenly among them."""
    profile = workload_profile(spec, policy)
    name = spec.class_
    match spec.kind:
        case "training":
            # Jobs start at unrelated times: a seeded random phase each (and, drawn after,
            # so that scenarios without checkpoints keep their phases, a checkpoint phase).
            phases = rng.uniform(0.0, spec.period_s, spec.jobs)
            ckpt = spec.checkpoint
            every_s = 0.0 if ckpt is None else ckpt.every_min * 60.0
            ckpt_phases = rng.uniform(0.0, every_s, spec.jobs) if ckpt else np.zeros(spec.jobs)
            return [
                Workload(
                    MockPattern.TRAINING,
                    name,
                    profile,
                    high_w=spec.high_w,
                    low_w=spec.low_w,
                    period_s=spec.period_s,
                    duty=spec.duty,
                    phase_s=float(p),
                    ckpt_every_s=every_s,
                    ckpt_s=0.0 if ckpt is None else ckpt.duration_s,
                    ckpt_w=0.0 if ckpt is None else ckpt.level_w,
                    ckpt_phase_s=float(c),
                    runs=_job_runs(spec, j),
                )
                for j, (p, c) in enumerate(zip(phases, ckpt_phases, strict=True))
            ]
        case "inference":
            day_s = spec.day_h * HOUR_S
            b = spec.bursts
            s = spec.surges
            # Each service surges on its own seeded draws (drawn only with surges).
            keys = rng.integers(0, 2**62, spec.services) if s else np.zeros(spec.services)
            return [
                Workload(
                    MockPattern.INFERENCE,
                    name,
                    profile,
                    high_w=spec.high_w,
                    low_w=spec.low_w,
                    period_s=day_s,
                    # The curve peaks half a period after its phase point.
                    phase_s=day_s / 2 - spec.peak_hour * HOUR_S,
                    burst_w=0.0 if b is None else b.extra_w,
                    burst_prob=0.0 if b is None else b.probability,
                    burst_slot_s=60.0 if b is None else b.slot_s,
                    surge_w=0.0 if s is None else s.extra_w,
                    surge_prob=0.0 if s is None else s.probability,
                    surge_slot_s=60.0 if s is None else s.slot_s,
                    key=int(k),
                )
                for k in keys
            ]
        case "steady":
            return [
                Workload(MockPattern.STEADY, name, profile, high_w=spec.high_w, low_w=spec.high_w)
            ]
        case "idle":
            return [Workload.idle(name=name)]
        case "trace":
            raise AssertionError("trace workloads are built per GPU (_trace_workloads)")
    raise AssertionError(spec.kind)


def _job_runs(spec: WorkloadSpec, job: int) -> tuple[tuple[float, float], ...]:
    """Job `job`'s (0-based) run windows in seconds; none given: () (it always runs)."""
    mine = [r for r in spec.runs if r.job is None or r.job == job + 1]
    return tuple(
        (r.start_h * HOUR_S, math.inf if r.end_h is None else r.end_h * HOUR_S) for r in mine
    )


def _trace_workloads(
    spec: WorkloadSpec,
    traces: list[GpuTrace],
    *,
    policy: Policy,
    nodes: IntArray,
    gpus_of_node: IntArray,
    rng: np.random.Generator,
) -> list[Workload]:
    """One Workload per GPU of these nodes: GPU k replays recorded GPU k mod the number
    recorded, from an offset drawn once per node (`lockstep`: none), so a fleet of one
    recording is not in step unless the scenario asks."""
    profile = workload_profile(spec, policy)
    out: list[Workload] = []
    k = 0
    for node in nodes.tolist():
        offset = 0.0
        for _ in range(int(gpus_of_node[node])):
            trace = traces[k % len(traces)]
            if not spec.lockstep and offset == 0.0:
                offset = float(rng.uniform(0.0, trace.duration_s + trace.interval_s))
            out.append(
                Workload(
                    MockPattern.TRACE,
                    spec.class_,
                    profile,
                    high_w=float(trace.draw_w.max()),
                    low_w=float(trace.draw_w.min()),
                    phase_s=offset,
                    trace=trace,
                )
            )
            k += 1
    return out


def job_name(workload: str, job: int) -> str:
    """The name a node reports for job `job` (0-based) of a training workload: the wire's
    job pattern (`powerd.wire.REPORTED_JOB_PATTERN`), `<workload>/<n>`."""
    base = re.sub(r"[^A-Za-z0-9_.:-]", "-", workload).lstrip("_.:-")[:100] or "job"
    return f"{base}/{job + 1}"


def _gpus_of(nodes: IntArray, starts: IntArray) -> IntArray:
    return np.concatenate(
        [np.arange(starts[k], starts[k + 1]) for k in nodes.tolist()]
        or [np.zeros(0, dtype=np.int64)]
    ).astype(np.int64)


def build_mix(scenario: Scenario, site: Site) -> Mix:
    specs = scenario.spec.workloads
    policy = site.policy
    rng = np.random.default_rng(scenario.spec.seed)
    node_groups = [g for g in policy.groups if g.level == NODE]
    node_of = assign_nodes([w.share for w in specs], len(node_groups), scenario.spec.site.placement)
    gpus_of_node = np.array([g.gpus for g in node_groups], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum(gpus_of_node)])
    class_pos = {name: i for i, name in enumerate(policy.classes)}

    per_gpu: list[Workload | None] = [None] * site.n_gpus
    workload_index = np.repeat(node_of, gpus_of_node).astype(np.int64)
    class_index = np.array(
        [class_pos[specs[w].class_] for w in workload_index.tolist()], dtype=np.int64
    )
    events: list[tuple[float, IntArray, Workload]] = []
    sync_jobs: list[IntArray] = []
    gpu_jobs: list[str | None] = [None] * site.n_gpus
    for w, spec in enumerate(specs):
        nodes = np.flatnonzero(node_of == w)
        if spec.kind == "trace":
            replays = _trace_workloads(
                spec,
                scenario.traces[w],
                policy=policy,
                nodes=nodes,
                gpus_of_node=gpus_of_node,
                rng=rng,
            )
            gpus = _gpus_of(nodes, starts)
            for i, workload in zip(gpus.tolist(), replays, strict=True):
                per_gpu[i] = workload
            continue
        jobs = _mock_workloads(spec, policy, rng)
        # Whole nodes per job, in site order: a job's ranks sit together.
        for j, job_nodes in enumerate(np.array_split(nodes, len(jobs))):
            gpus = _gpus_of(job_nodes, starts)
            for i in gpus.tolist():
                per_gpu[i] = jobs[j]
            if spec.kind == "training" and gpus.size:
                sync_jobs.append(gpus)
                name = job_name(spec.name, j)
                for i in gpus.tolist():
                    gpu_jobs[i] = name
            idle = Workload.idle(name=spec.class_)
            for window in spec.idle:
                events.append((window.start_h * HOUR_S, gpus, idle))
                events.append((window.end_h * HOUR_S, gpus, jobs[j]))
    events.sort(key=lambda e: e[0])  # stable: a window's end and the next start keep order
    workloads = tuple(w for w in per_gpu if w is not None)
    assert len(workloads) == site.n_gpus
    if scenario.recording is not None:
        # The recording replaces the patterns (and their idle windows): it has its own.
        places = [(g.name, k) for g in node_groups for k in range(g.gpus)]
        workloads = replay(workloads, places, scenario.recording)
        events = []
        sync_jobs, gpu_jobs = [], [None] * site.n_gpus  # replayed GPUs: each its own
    return Mix(
        workloads, class_index, workload_index, tuple(events), tuple(sync_jobs), tuple(gpu_jobs)
    )
