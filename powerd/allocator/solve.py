"""Entry points: a Snapshot (or per-GPU arrays) and a Policy in, an Allocation out."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np

from powerd.allocator import baselines, coupled_newton, tree_solver
from powerd.allocator.problem import (
    Allocation,
    ClassTable,
    FloatArray,
    GpuArrays,
    Problem,
    SolverFailed,
    Tree,
    build_problem,
    class_names,
    objective,
    repair,
    unused_w,
)
from powerd.policy import Policy
from powerd.snapshot import Snapshot
from powerd.topology import Topology

Solver = Callable[[Problem, FloatArray | None], tuple[FloatArray, FloatArray | None]]


def _reference(problem: Problem, warm: FloatArray | None) -> tuple[FloatArray, None]:
    # cvxpy takes over a second to import: only those who ask for the reference pay for it.
    from powerd.allocator import reference

    return reference.solve(problem, warm)


_SOLVERS: dict[str, Solver] = {
    "fast": tree_solver.solve,
    "cvxpy": _reference,
    "uniform": baselines.uniform,
    "priority-bands": baselines.priority_bands,
}
SOLVERS = ("fast", "cvxpy", "uniform", "priority-bands")


def fleet_from_snapshot(
    snapshot: Snapshot, policy: Policy, topology: Topology | None = None
) -> GpuArrays:
    """Per-GPU arrays of a validated snapshot (see snapshot.check_snapshot)."""
    gpus = snapshot.gpus
    if topology is None:
        topology = Topology.build(policy, [g.node for g in gpus])
    elif topology.n_gpus != len(gpus):
        raise ValueError(f"topology places {topology.n_gpus} GPUs but the snapshot has {len(gpus)}")
    index = {name: i for i, name in enumerate(class_names(policy))}
    default = policy.defaults.class_
    n = len(gpus)

    def column(get: Callable[[int], float]) -> FloatArray:
        return np.fromiter((get(i) for i in range(n)), dtype=np.float64, count=n)

    # Jobs in the order they first appear; -1: no job (None when no GPU names one).
    jobs: dict[str, int] = {}
    job_index = np.fromiter(
        (-1 if g.job is None else jobs.setdefault(g.job, len(jobs)) for g in gpus),
        dtype=np.int64,
        count=n,
    )

    return GpuArrays(
        uuids=tuple(g.uuid for g in gpus),
        topology=topology,
        min_cap_w=column(lambda i: gpus[i].min_cap_w),
        max_cap_w=column(lambda i: gpus[i].max_cap_w),
        power_w=column(lambda i: gpus[i].power_w),
        cap_w=column(lambda i: gpus[i].cap_w),
        class_index=np.fromiter(
            (index[g.workload or default] for g in gpus), dtype=np.int64, count=n
        ),
        stale=np.fromiter((g.stale for g in gpus), dtype=np.bool_, count=n),
        pinned_w=np.array(
            [np.nan if g.pinned_w is None else g.pinned_w for g in gpus], dtype=np.float64
        ),
        job_index=job_index if jobs else None,
        job_names=tuple(jobs),
    )


def group_values(topology: Topology, values: Mapping[str, float], base: FloatArray) -> FloatArray:
    """`base` with the named groups' entries replaced (names unique across levels)."""
    out = np.array(base, dtype=np.float64, copy=True)
    where: dict[str, list[int]] = {}
    for i, name in enumerate(topology.names):
        where.setdefault(name, []).append(i)
    for name, value in values.items():
        found = where.get(name, [])
        if len(found) != 1:
            why = "is not in the policy's tree" if not found else "names groups at two levels"
            raise ValueError(f"group '{name}' {why}")
        out[found[0]] = value
    return out


def allocate(
    snapshot: Snapshot,
    policy: Policy,
    solver: str = "fast",
    *,
    topology: Topology | None = None,
    reserved_w: Mapping[str, float] | None = None,
    budget_overrides: Mapping[str, float] | None = None,
) -> Allocation:
    """Caps for every GPU of the snapshot.

    `budget_overrides` replaces named groups' budgets (W), e.g. a grid event's temporary
    limit; `reserved_w` is power (W) committed at named groups outside the snapshot, taken
    from that group's and every ancestor's budget.
    """
    fleet = fleet_from_snapshot(snapshot, policy, topology)
    topo = fleet.topology
    budget = None
    if budget_overrides:
        budget = group_values(topo, budget_overrides, topo.budget_w)
    reserved = None
    if reserved_w:
        reserved = group_values(topo, reserved_w, np.zeros(topo.n_groups))
    return allocate_arrays(fleet, policy, solver, budget_w=budget, reserved_w=reserved)


def allocate_arrays(
    fleet: GpuArrays,
    policy: Policy,
    solver: str = "fast",
    *,
    budget_w: FloatArray | None = None,
    reserved_w: FloatArray | None = None,
    warm: Allocation | None = None,
    classes: ClassTable | None = None,
    tree: Tree | None = None,
) -> Allocation:
    """The array path for hot loops. `budget_w`/`reserved_w` are per group (topology order);
    `warm` is the previous tick's allocation (the fast solver starts from its prices);
    `classes` and `tree` may be built once and passed on every call."""
    if solver not in _SOLVERS:
        raise ValueError(f"unknown solver '{solver}'; valid: {', '.join(SOLVERS)}")
    t0 = time.perf_counter()
    problem = build_problem(
        fleet, policy, classes=classes, tree=tree, budget_w=budget_w, reserved_w=reserved_w
    )
    prices_in = None
    if warm is not None and warm.prices is not None and warm.prices.size == problem.tree.n_groups:
        prices_in = warm.prices
    raw, prices = _SOLVERS[solver](problem, prices_in)
    p = repair(problem, raw)
    _verify(problem, p)
    gap = 0.0
    if problem.jobs is not None and solver == "fast" and prices is not None:
        gap = coupled_newton.gap(problem, p, prices)
    elapsed_ms = (time.perf_counter() - t0) * 1000.0
    uuids = fleet.uuids
    names = fleet.topology.names
    return Allocation(
        status=problem.status,
        solver=solver,
        objective=objective(problem, p),
        solve_ms=elapsed_ms,
        uuids=uuids,
        caps_w=p * 1000.0,
        dropped_floors=tuple(uuids[i] for i in np.flatnonzero(problem.dropped_floor)),
        infeasible_groups=tuple(names[g] for g in problem.infeasible_groups),
        repair_w=float(np.max(np.abs(p - raw), initial=0.0)) * 1000.0,
        prices=prices,
        split_jobs=problem.split_jobs,
        gap=gap,
        unused_w=unused_w(problem, p),
        lo_w=problem.lo * 1000.0,
        hi_w=problem.hi * 1000.0,
        demand_w=problem.demand_w,
    )


def _verify(problem: Problem, p: FloatArray) -> None:
    """Never hand out caps that break a bound or a budget (a bug if this ever fires)."""
    if p.size == 0:
        return
    # Every check in one compiled pass (Tree.check), in this order.
    failed, g = problem.tree.check(p, problem.lo, problem.hi, problem.capacity, problem.jobs)
    if failed == 1:
        raise SolverFailed("caps are not finite numbers")
    if failed == 2:
        raise SolverFailed("caps outside their bounds after repair")
    if failed == 3:
        raise SolverFailed("the GPUs of a job got different caps after repair")
    if failed:
        excess = problem.tree.sums(p) - problem.capacity
        raise SolverFailed(
            f"group '{problem.tree.topology.names[g]}' over its budget by "
            f"{excess[g] * 1000:.6f} W after repair"
        )
