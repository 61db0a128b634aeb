"""Measured power-limit sweeps: how close `fast` with fitted profiles gets to the best.

    .venv/bin/python bench/zeus.py --traces DIR        # DIR holds summary_power_*.csv
    .venv/bin/python bench/zeus.py --traces DIR --rows 4 --budgets 21

The traces are the Zeus NSDI'23 power-limit sweeps (github.com/ml-energy/zeus,
examples/research_reproducibility/zeus_nsdi23/trace/summary_power_<gpu>.csv: seconds per
epoch and average power of DNN training jobs at power limits 100 W, 125 W, …; Jie You,
Jae-Won Chung, Mosharaf Chowdhury, "Zeus: Understanding and Optimizing GPU Energy
Consumption of DNN Training", NSDI 2023). They are not part of powerd: fetch them and point
--traces at their folder. Any CSV of the same columns works.

For each file (one GPU model) every (dataset, network, batch_size, optimizer) is a workload,
fitted with `powerd profile fit`'s code (powerd.profilefit) into a policy profile, exactly
as the YAML it prints (rounded). A fleet of 8-GPU nodes (each node one workload, drawn with
a seed), 4 nodes a rack, 8 racks a row, under node, rack and row budgets, is steered by
`fast` at facility budgets from the sum of the device minimums to the sum of maximums, every
GPU wanting its maximum (training at full speed), ticks repeated until the caps settle.

Throughput is each GPU's MEASURED throughput at its cap (linear between the measured
points, relative to the workload's best), summed. The best achievable is the exact
optimum of the same budgets over the concave envelopes of the measured points (not the
rounded profiles), a linear program solved by cvxpy/Clarabel here, independently of
powerd's solvers: no allocation can do better on the measured curves (each lies on or below
its envelope), and the optimum is reachable (where it puts identical GPUs between two
measured points, giving some the lower and some the higher point reaches the chord). The
ratio is printed per budget for `control.leftover: peak` (the default) and `max`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import yaml

from powerd.allocator import ClassTable, GpuArrays, Tree, allocate_arrays
from powerd.policy import Policy, parse_policy
from powerd.profilefit import Fit, fit, read_sweeps, to_yaml
from powerd.testing.synthetic import policy_dict
from powerd.topology import N_LEVELS, Topology

GROUP = ("dataset", "network", "batch_size", "optimizer")
GPUS, NODES, RACKS = 8, 4, 8
OVERHEAD_W = 600.0
TICKS = 30


@dataclass(frozen=True)
class Site:
    name: str
    fits: list[Fit]
    policy: dict[str, Policy]  # by leftover setting
    fleet: GpuArrays
    measured: list[tuple[np.ndarray, np.ndarray]]  # per class: power, relative throughput


def build_site(path: Path, rows: int, seed: int) -> Site:
    sweeps = read_sweeps(path, power="power_limit", time="time_per_epoch", group=GROUP)
    fits = [fit(s) for s in sweeps]
    lo = min(float(s.power_w.min()) for s in sweeps)
    hi = max(float(s.power_w.max()) for s in sweeps)
    # Budgets bind below the facility too: racks at 90 % of their GPUs' maxima, rows at 95 %.
    data = policy_dict(
        rows, RACKS, NODES, GPUS, fractions=(1.0, 0.95, 0.9, 1.0), overhead_w=OVERHEAD_W,
        gpu_w=(lo, hi), damping=0.01,
    )  # fmt: skip
    fitted = yaml.safe_load(to_yaml(fits, str(path)))  # as pasted from `powerd profile fit`
    data["profiles"] = fitted["profiles"]
    data["classes"] = fitted["classes"]
    data["defaults"] = dict(data["defaults"]) | {"class": fits[0].name}
    policies = {}
    for leftover in ("peak", "max"):
        data["control"] = dict(data["control"]) | {"leftover": leftover}
        policies[leftover] = parse_policy(data, f"<{path.name}>")
    policy = policies["peak"]
    nodes = [g.name for g in policy.groups if g.level == N_LEVELS - 1]
    rng = np.random.default_rng(seed)
    node_class = rng.integers(0, len(fits), size=len(nodes))
    gpu_nodes = [n for n in nodes for _ in range(GPUS)]
    topology = Topology.build(policy, gpu_nodes)
    n = len(gpu_nodes)
    fleet = GpuArrays(
        uuids=tuple(f"GPU-{i:05d}" for i in range(n)),
        topology=topology,
        min_cap_w=np.full(n, lo),
        max_cap_w=np.full(n, hi),
        power_w=np.full(n, hi),
        cap_w=np.full(n, hi),
        class_index=np.repeat(node_class, GPUS).astype(np.int64),
        stale=np.zeros(n, dtype=np.bool_),
        pinned_w=np.full(n, np.nan),
    )
    measured = []
    for f in fits:
        order = np.argsort(f.sweep.power_w, kind="stable")
        measured.append((f.sweep.power_w[order], f.sweep.throughput[order] / f.best))
    return Site(path.stem.removeprefix("summary_power_"), fits, policies, fleet, measured)


def measured_throughput(site: Site, caps_w: np.ndarray) -> float:
    """Σ over GPUs of the measured throughput at the cap (linear between measured points)."""
    total = 0.0
    for c, (power, tput) in enumerate(site.measured):
        sel = site.fleet.class_index == c
        total += float(np.interp(caps_w[sel], power, tput).sum())
    return total


def envelope_throughput(site: Site, caps_w: np.ndarray) -> float:
    """Σ over GPUs of the fitted envelope (the model `fast` steers by) at the cap."""
    total = 0.0
    for c, f in enumerate(site.fits):
        sel = site.fleet.class_index == c
        total += float(f.profile.value(caps_w[sel]).sum())
    return total


def best_on_envelopes(site: Site, budget_w: np.ndarray) -> float:
    """The exact optimum of Σ envelope_i(p_i) under every budget (an LP, via cvxpy)."""
    import cvxpy as cp

    fleet, topo = site.fleet, site.fleet.topology
    n = fleet.n
    p = cp.Variable(n)
    t = cp.Variable(n)
    cons: list[Any] = [p >= fleet.min_cap_w, p <= fleet.max_cap_w, t <= 1.0]
    for c, f in enumerate(site.fits):
        idx = np.flatnonzero(fleet.class_index == c)
        if idx.size == 0:
            continue
        x = np.array([q for q, _ in f.points]) / 1000.0
        y = np.array([v for _, v in f.points])
        if x.size == 1:  # one point: proportional up to it (as powerd.profile extends it)
            slopes, xs, ys = np.array([y[0] / x[0]]), x, y
        else:
            slopes, xs, ys = np.diff(y) / np.diff(x), x[:-1], y[:-1]
        for s, x0, y0 in zip(slopes, xs, ys, strict=True):
            cons.append(t[idx] <= y0 + s * (p[idx] / 1000.0 - x0))
    room = budget_w - topo.overhead_w
    for level in range(N_LEVELS):
        groups = topo.groups_at(level)
        finite = groups[np.isfinite(room[groups])]
        if finite.size == 0:
            continue
        row = {g: r for r, g in enumerate(finite.tolist())}
        member = np.array([row.get(g, -1) for g in topo.gpu_groups[:, level].tolist()])
        keep = member >= 0
        a = sp.csr_matrix(
            (np.ones(int(keep.sum())), (member[keep], np.flatnonzero(keep))),
            shape=(finite.size, n),
        )
        cons.append(a @ (p / 1000.0) <= room[finite] / 1000.0)
    prob = cp.Problem(cp.Maximize(cp.sum(t)), cons)
    prob.solve(solver="CLARABEL")
    if prob.status != cp.OPTIMAL:
        raise RuntimeError(f"the envelope LP did not solve: {prob.status}")
    return float(prob.value)


def steer(site: Site, leftover: str, budget_w: np.ndarray) -> tuple[np.ndarray, float]:
    """Caps after the ticks settle (each tick from the last one's caps), and unused W."""
    policy = site.policy[leftover]
    classes, tree = ClassTable.from_policy(policy), Tree(site.fleet.topology)
    fleet, alloc = site.fleet, None
    for _ in range(TICKS):
        alloc = allocate_arrays(
            fleet, policy, "fast", budget_w=budget_w, classes=classes, tree=tree, warm=alloc
        )
        moved = float(np.max(np.abs(alloc.caps_w - fleet.cap_w)))
        # Training at full speed draws its cap: every GPU wants its maximum.
        fleet = GpuArrays(**{**fleet.__dict__, "cap_w": alloc.caps_w, "power_w": alloc.caps_w})
        if moved < 1e-3:
            break
    assert alloc is not None
    return alloc.caps_w, alloc.unused_w


def run(path: Path, rows: int, budgets: int, seed: int) -> float:
    site = build_site(path, rows, seed)
    fleet, topo = site.fleet, site.fleet.topology
    lo, hi = float(fleet.min_cap_w.sum()), float(fleet.max_cap_w.sum())
    peaks = sorted(f.peak_w for f in site.fits)
    print(
        f"\n{site.name}: {len(site.fits)} workloads, {fleet.n} GPUs on {fleet.n // GPUS} "
        f"nodes ({rows} rows x {RACKS} racks x {NODES} nodes x {GPUS}), limits "
        f"{fleet.min_cap_w[0]:.0f}-{fleet.max_cap_w[0]:.0f} W; profile peaks "
        f"{peaks[0]:.0f}-{peaks[-1]:.0f} W (median {np.median(peaks):.0f} W); worst fit: "
        f"measured {100 * max(f.max_below for f in site.fits):.1f} % below the envelope"
    )
    print(
        f"{'budget kW':>10} {'best':>9} {'peak: ratio':>12} {'(envelope)':>11} "
        f"{'unused kW':>10} {'max: ratio':>11} {'unused kW':>10}"
    )
    worst = 1.0
    for b in np.linspace(lo, hi, budgets):
        budget = topo.budget_w.copy()
        budget[0] = b + topo.overhead_w[0]
        best = best_on_envelopes(site, budget)
        cells = []
        for leftover in ("peak", "max"):
            caps, unused = steer(site, leftover, budget)
            ratio = measured_throughput(site, caps) / best
            if leftover == "peak":
                worst = min(worst, ratio)
            cells.append((ratio, unused, envelope_throughput(site, caps) / best))
        (rp, up, ep), (rm, um, _) = cells
        print(
            f"{b / 1000:>10.1f} {best:>9.2f} {rp:>12.4f} {ep:>11.4f} {up / 1000:>10.1f} "
            f"{rm:>11.4f} {um / 1000:>10.1f}"
        )
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--traces", required=True, help="folder with summary_power_*.csv")
    ap.add_argument("--rows", type=int, default=2, help="rows of 8 racks x 4 nodes x 8 GPUs")
    ap.add_argument("--budgets", type=int, default=11, help="facility budgets, min to max")
    ap.add_argument("--seed", type=int, default=0, help="which workload each node runs")
    args = ap.parse_args(argv)
    files = sorted(Path(args.traces).glob("summary_power_*.csv"))
    if not files:
        print(f"no summary_power_*.csv in {args.traces}", file=sys.stderr)
        return 2
    worst = min(run(f, args.rows, args.budgets, args.seed) for f in files)
    print(f"\nworst ratio with leftover: peak (the default): {worst:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
