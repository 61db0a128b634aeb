"""The allocator: a fleet snapshot and a policy in, one power cap per GPU out.

`allocate` takes a Snapshot; `allocate_arrays` takes per-GPU arrays (`GpuArrays`) for hot loops.
Solvers: `fast` (exact, exploits the tree of budgets), `cvxpy` (the reference formulation),
and the baselines `uniform` and `priority-bands`. See docs/allocator.md.
"""

from powerd.allocator.problem import (
    FLOORS_DROPPED,
    INFEASIBLE_MIN,
    OPTIMAL,
    Allocation,
    ClassTable,
    GpuArrays,
    Problem,
    SolverFailed,
    Tree,
    build_problem,
    class_names,
    objective,
)
from powerd.allocator.solve import (
    SOLVERS,
    allocate,
    allocate_arrays,
    fleet_from_snapshot,
    group_values,
)

__all__ = [
    "FLOORS_DROPPED",
    "INFEASIBLE_MIN",
    "OPTIMAL",
    "SOLVERS",
    "Allocation",
    "ClassTable",
    "GpuArrays",
    "Problem",
    "SolverFailed",
    "Tree",
    "allocate",
    "allocate_arrays",
    "build_problem",
    "class_names",
    "fleet_from_snapshot",
    "group_values",
    "objective",
]
