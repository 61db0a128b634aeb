"""Synthetic power domains and fleets for tests and benchmarks.

`policy_dict` writes a policy for R rows × K racks × N nodes × G GPUs whose budgets are
fractions of what the level below could draw, so every level binds; `random_fleet` draws a
mixed fleet (classes, draws, caps in force) from a seed; `Drift` moves draws tick by tick
for steady-state loops; `scope_fleet` cuts one scope out of a fleet. Deterministic for a
given seed; no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from powerd.allocator.problem import FloatArray, GpuArrays, IntArray, class_names
from powerd.policy import Policy, parse_policy
from powerd.snapshot import GpuState, Snapshot
from powerd.topology import Topology

# The example policy's profiles (policies/example.yaml): H100/H200-class, 200–700 W.
PROFILES: dict[str, list[list[float]]] = {
    "llm-training": [[200, 0.35], [300, 0.58], [400, 0.76], [500, 0.89], [600, 0.97], [700, 1.0]],
    "llm-inference": [[200, 0.55], [300, 0.78], [400, 0.92], [500, 0.98], [600, 1.0], [700, 1.0]],
    "batch": [[200, 0.40], [300, 0.62], [400, 0.79], [500, 0.90], [600, 0.97], [700, 1.0]],
}
CLASSES: dict[str, dict[str, Any]] = {
    "inference": {"weight": 4.0, "floor_w": 350.0, "profile": "llm-inference"},
    "training": {"weight": 1.0, "profile": "llm-training"},
    "batch": {"weight": 0.5, "ceiling_w": 600.0, "profile": "batch"},
}
# Two classes for small hand-made sites (the controller, end-to-end and chaos tests):
# training, and inference at four times its weight with a 350 W floor.
TRAIN_AND_INFER: dict[str, Any] = {
    "profiles": {
        "train": {"points": [[200, 0.35], [400, 0.76], [600, 0.97], [700, 1.0]]},
        "infer": {"points": [[200, 0.55], [400, 0.92], [600, 1.0]]},
    },
    "classes": {
        "training": {"weight": 1, "profile": "train"},
        "inference": {"weight": 4, "floor_w": 350, "profile": "infer"},
    },
}
# Share of each class in a random fleet, in CLASSES order.
CLASS_MIX = (0.25, 0.55, 0.20)


def policy_dict(
    rows: int,
    racks: int,
    nodes: int,
    gpus: int,
    *,
    fractions: tuple[float, float, float, float] = (0.92, 0.92, 0.92, 0.85),
    overhead_w: float = 800.0,
    gpu_w: tuple[float, float] = (200.0, 700.0),
    damping: float = 0.01,
    slew_w: float | None = None,
    headroom_w: float = 50.0,
) -> dict[str, Any]:
    """A policy as parsed YAML. `fractions` (facility, row, rack, node): the room each budget
    leaves for GPU caps is that share of its children's (a node's: of G × max_cap_w);
    budgets add the nodes' overhead on top. `gpu_w`: every GPU's (min, max) cap. The
    failsafe cap is chosen to fit."""
    min_cap_w, max_cap_w = gpu_w
    f_fac, f_row, f_rack, f_node = fractions
    node_room = f_node * gpus * max_cap_w
    rack_room = f_rack * nodes * node_room
    row_room = f_row * racks * rack_room
    fac_room = f_fac * rows * row_room
    node_b = node_room + overhead_w
    rack_b = rack_room + nodes * overhead_w
    row_b = row_room + racks * nodes * overhead_w
    fac_b = fac_room + rows * racks * nodes * overhead_w
    # Agents fall back to the failsafe cap on their own, so its sum must fit every budget.
    failsafe_w = min(min_cap_w, 0.99 * f_fac * f_row * f_rack * f_node * max_cap_w)
    control: dict[str, Any] = {"damping": damping}
    if slew_w is not None:
        control["slew_w"] = slew_w
    return {
        "version": 1,
        "facility": {
            "name": "site",
            "budget_w": fac_b,
            "rows": [
                {
                    "name": f"row-{{1..{rows}}}",
                    "budget_w": row_b,
                    "racks": [
                        {
                            "name": f"{{row}}-rack-{{1..{racks}}}",
                            "budget_w": rack_b,
                            "nodes": [
                                {
                                    "name": f"{{rack}}-node-{{1..{nodes}}}",
                                    "budget_w": node_b,
                                    "overhead_w": overhead_w,
                                    "gpus": gpus,
                                }
                            ],
                        }
                    ],
                }
            ],
        },
        "profiles": {name: {"points": pts} for name, pts in PROFILES.items()},
        "classes": CLASSES,
        "defaults": {
            "class": "training",
            "failsafe_w": round(failsafe_w, 3),
            "headroom_w": headroom_w,
            "gpus_per_node": gpus,
            "gpu": {"min_cap_w": min_cap_w, "max_cap_w": max_cap_w},
        },
        "control": control,
    }


def make_policy(rows: int, racks: int, nodes: int, gpus: int, **options: Any) -> Policy:
    return parse_policy(policy_dict(rows, racks, nodes, gpus, **options), "<synthetic>")


def random_fleet(
    policy: Policy,
    seed: int,
    *,
    stale_share: float = 0.0,
    pinned_share: float = 0.0,
    limited_share: float = 0.5,
) -> GpuArrays:
    """Every GPU the policy's nodes declare, with random classes, limits, caps and draws.

    About `limited_share` of the GPUs draw at their cap (they want more); the rest draw less,
    a few sit idle.
    """
    rng = np.random.default_rng(seed)
    node_names = [name for g in policy.groups if g.level == 3 for name in [g.name] * g.gpus]
    topology = Topology.build(policy, node_names)
    n = len(node_names)
    gpu = policy.defaults.gpu
    names = class_names(policy)
    mix = np.array([CLASS_MIX[i] if i < len(CLASS_MIX) else 0.0 for i in range(len(names))])
    mix = mix / mix.sum() if mix.sum() > 0 else np.full(len(names), 1.0 / len(names))
    min_cap = np.where(rng.random(n) < 0.1, 0.75 * gpu.min_cap_w, gpu.min_cap_w)
    max_cap = np.where(rng.random(n) < 0.1, 0.85 * gpu.max_cap_w, gpu.max_cap_w)
    max_cap = np.maximum(max_cap, min_cap)
    cap = rng.uniform(min_cap, max_cap)
    limited = rng.random(n) < limited_share
    idle = rng.random(n) < 0.05
    power = np.where(limited, cap * rng.uniform(0.96, 1.0, n), cap * rng.uniform(0.3, 0.93, n))
    power = np.where(idle & ~limited, rng.uniform(60.0, 100.0, n), power)
    pinned = rng.random(n) < pinned_share
    return GpuArrays(
        uuids=tuple(f"GPU-{seed:x}-{i:06d}" for i in range(n)),
        topology=topology,
        min_cap_w=min_cap,
        max_cap_w=max_cap,
        power_w=power,
        cap_w=cap,
        class_index=rng.choice(len(names), size=n, p=mix).astype(np.int64),
        stale=rng.random(n) < stale_share,
        pinned_w=np.where(pinned, rng.uniform(min_cap, max_cap), np.nan),
    )


JOB_SIZES = (8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)


def with_jobs(
    fleet: GpuArrays,
    seed: int,
    *,
    share: float = 0.7,
    sizes: tuple[int, ...] = JOB_SIZES,
    scattered: float = 0.2,
) -> GpuArrays:
    """The fleet with about `share` of its GPUs in jobs of the given sizes, as a scheduler
    places them: most jobs on consecutive nodes (so large ones span racks and rows), a
    `scattered` share on GPUs picked anywhere. Members take their job's class."""
    rng = np.random.default_rng(seed)
    n = fleet.n
    free = np.ones(n, dtype=np.bool_)
    job = np.full(n, -1, dtype=np.int64)
    cls = fleet.class_index.copy()
    n_classes = int(cls.max(initial=0)) + 1
    target = int(share * n)
    taken, j, cursor = 0, 0, 0
    order = np.arange(n)
    while taken < target:
        size = int(rng.choice([s for s in sizes if s <= max(target - taken, sizes[0])]))
        if rng.random() < scattered:
            pool = np.flatnonzero(free)
            if pool.size < size:
                break
            members = rng.choice(pool, size=size, replace=False)
        else:
            while cursor < n and not free[order[cursor]]:
                cursor += 1
            members = order[cursor : cursor + size]
            members = members[free[members]]
            cursor += size
            if members.size == 0:
                break
        free[members] = False
        job[members] = j
        cls[members] = rng.integers(0, n_classes)
        taken += members.size
        j += 1
    return replace(
        fleet,
        job_index=job,
        job_names=tuple(f"job-{k}" for k in range(j)),
        class_index=cls,
    )


def to_snapshot(fleet: GpuArrays, policy: Policy) -> Snapshot:
    """The fleet as the Snapshot the controller would freeze (for the Snapshot API)."""
    names = class_names(policy)
    topo = fleet.topology
    gpus = [
        GpuState(
            uuid=fleet.uuids[i],
            node=topo.names[int(topo.gpu_groups[i, 3])],
            min_cap_w=float(fleet.min_cap_w[i]),
            max_cap_w=float(fleet.max_cap_w[i]),
            power_w=float(fleet.power_w[i]),
            cap_w=float(fleet.cap_w[i]),
            workload=names[int(fleet.class_index[i])],
            stale=bool(fleet.stale[i]),
            pinned_w=None if np.isnan(fleet.pinned_w[i]) else float(fleet.pinned_w[i]),
        )
        for i in range(fleet.n)
    ]
    return Snapshot(gpus=gpus)


@dataclass
class Drift:
    """Successive ticks: each GPU's wanted power wanders; it draws min(want, cap)."""

    fleet: GpuArrays
    want_w: FloatArray
    rng: np.random.Generator
    step_share: float = 0.03

    @classmethod
    def start(cls, fleet: GpuArrays, seed: int) -> Drift:
        rng = np.random.default_rng(seed)
        limited = fleet.power_w >= 0.95 * fleet.cap_w
        want = np.where(limited, fleet.max_cap_w * rng.uniform(0.9, 1.1, fleet.n), fleet.power_w)
        return cls(fleet=fleet, want_w=want, rng=rng)

    def tick(self, caps_w: FloatArray) -> GpuArrays:
        """The fleet one tick later, with `caps_w` in force."""
        n = self.fleet.n
        self.want_w = np.clip(
            self.want_w * np.exp(self.rng.normal(0.0, self.step_share, n)),
            50.0,
            1.2 * self.fleet.max_cap_w,
        )
        power = np.minimum(self.want_w, caps_w) * self.rng.uniform(0.97, 1.0, n)
        self.fleet = replace(self.fleet, cap_w=np.asarray(caps_w, dtype=np.float64), power_w=power)
        return self.fleet


def scope_fleet(fleet: GpuArrays, policy: Policy, name: str) -> tuple[Policy, GpuArrays, IntArray]:
    """One scope of a fleet: its policy (Policy.scope), its GPUs placed in that policy's
    tree, and their indices in `fleet` (to put the scope's caps back in place)."""
    topo = fleet.topology
    group = topo.names.index(name)
    gpus = topo.subtree_gpus(group)
    scope_policy = policy.scope(name)
    nodes = [topo.names[int(g)] for g in topo.gpu_groups[gpus, -1]]
    part = GpuArrays(
        uuids=tuple(fleet.uuids[int(i)] for i in gpus),
        topology=Topology.build(scope_policy, nodes),
        min_cap_w=fleet.min_cap_w[gpus],
        max_cap_w=fleet.max_cap_w[gpus],
        power_w=fleet.power_w[gpus],
        cap_w=fleet.cap_w[gpus],
        class_index=fleet.class_index[gpus],
        stale=fleet.stale[gpus],
        pinned_w=fleet.pinned_w[gpus],
    )
    return scope_policy, part, gpus


def random_job_site(seed: int) -> tuple[Policy, GpuArrays]:
    """A small random site with jobs (bench/jobs_sites.py's draw): 1-2 rows, 1-3 racks,
    1-3 nodes of 1-4 GPUs, budgets at 50-100 % of their GPUs' maximum, damping 0.01-1, jobs
    of 2-8 GPUs on 30-100 % of the GPUs, a random share of them scattered."""
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 3)), int(rng.integers(1, 4)), int(rng.integers(1, 4)))
    gpus = int(rng.integers(1, 5))
    fractions = tuple(float(x) for x in rng.uniform(0.5, 1.0, 4))
    damping = float(rng.choice([0.01, 0.1, 1.0]))
    policy = make_policy(*shape, gpus, fractions=fractions, damping=damping)
    fleet = random_fleet(policy, seed, limited_share=float(rng.uniform(0, 1)))
    share, scattered = float(rng.uniform(0.3, 1.0)), float(rng.uniform(0, 1))
    fleet = with_jobs(fleet, seed, share=share, sizes=(2, 3, 4, 8), scattered=scattered)
    return policy, fleet
