"""The power tree as arrays: every GPU's group at each level, budgets net of overhead.

The policy's tree is strict: facility → rows → racks → nodes → GPUs, so each level is a
partition of the GPUs and group sums are one `bincount` over a (n_gpus × 4) index matrix.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from powerd.policy import LEVELS, Policy

IntArray = NDArray[np.int64]
FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
N_LEVELS = len(LEVELS)


class TopologyError(ValueError):
    """GPUs that cannot be placed in the policy's tree."""


@dataclass(frozen=True)
class Topology:
    names: tuple[str, ...]  # per group, parents before children
    level: IntArray  # per group: 0 facility, 1 row, 2 rack, 3 node
    parent: IntArray  # per group, -1 for the facility
    budget_w: FloatArray  # per group, inf when unconstrained
    overhead_w: FloatArray  # per group: overhead of all nodes below (nodes: their own)
    gpu_groups: IntArray  # (n_gpus, 4): the GPU's group at each level

    @property
    def n_groups(self) -> int:
        return len(self.names)

    @property
    def n_gpus(self) -> int:
        return int(self.gpu_groups.shape[0])

    @property
    def capacity_w(self) -> FloatArray:
        """What each group's GPUs may draw in caps: budget minus the overhead below it."""
        return self.budget_w - self.overhead_w

    def group_sums(self, per_gpu: FloatArray) -> FloatArray:
        """Sum a per-GPU value over every group (each group: all GPUs below it)."""
        weights = np.asarray(per_gpu, dtype=np.float64).repeat(N_LEVELS)
        sums = np.bincount(self.gpu_groups.ravel(), weights=weights, minlength=self.n_groups)
        return sums.astype(np.float64, copy=False)

    def under_any(self, marked: BoolArray) -> BoolArray:
        """Per GPU whether any of its groups is `marked` (per group):
        `marked[gpu_groups].any(axis=1)`, level by level from the kept columns."""
        levels = self.gpu_group_columns
        out: BoolArray = marked[levels[0]]
        for col in levels[1:]:
            out = out | marked[col]
        return out

    def group_counts(self) -> IntArray:
        return np.bincount(self.gpu_groups.ravel(), minlength=self.n_groups).astype(np.int64)

    def groups_at(self, level: int) -> IntArray:
        return np.flatnonzero(self.level == level)

    @cached_property
    def gpu_group_columns(self) -> tuple[IntArray, ...]:
        """`gpu_groups[:, level]` of every level as a contiguous array (each tick's deadband
        sums by them), kept: do not write."""
        return tuple(np.ascontiguousarray(self.gpu_groups[:, lv]) for lv in range(N_LEVELS))

    @cached_property
    def level_groups(self) -> tuple[IntArray, ...]:
        """`groups_at` of every level, kept (each allocation reads them): do not write."""
        return tuple(self.groups_at(level) for level in range(N_LEVELS))

    def subtree_gpus(self, group: int) -> IntArray:
        """Indices of the GPUs under one group."""
        return np.flatnonzero(self.gpu_groups[:, int(self.level[group])] == group)

    def violations(self, per_gpu: FloatArray, tol_w: float = 1e-6) -> list[tuple[int, float]]:
        """Groups whose per-GPU total plus overhead exceeds the budget: (group, excess W)."""
        excess = self.group_sums(per_gpu) + self.overhead_w - self.budget_w
        bad = np.flatnonzero(excess > tol_w)
        return [(int(g), float(excess[g])) for g in bad]

    @classmethod
    def build(cls, policy: Policy, gpu_nodes: Sequence[str]) -> Topology:
        """Place GPUs (given by their node's name) in the policy's tree."""
        groups = policy.groups
        n = len(groups)
        names = tuple(g.name for g in groups)
        level = np.fromiter((g.level for g in groups), dtype=np.int64, count=n)
        parent = np.fromiter((g.parent for g in groups), dtype=np.int64, count=n)
        budget = np.fromiter((g.budget_w for g in groups), dtype=np.float64, count=n)
        overhead = np.fromiter((g.overhead_w for g in groups), dtype=np.float64, count=n)
        # Children come after parents, so one reverse pass pushes overhead up the tree.
        for i in range(n - 1, 0, -1):
            overhead[parent[i]] += overhead[i]
        # Ancestors of every node group, per level.
        ancestors = np.full((n, N_LEVELS), -1, dtype=np.int64)
        for i in range(n):
            if parent[i] >= 0:
                ancestors[i] = ancestors[parent[i]]
            ancestors[i, level[i]] = i
        node_index = {names[i]: i for i in np.flatnonzero(level == N_LEVELS - 1)}
        missing = sorted({name for name in gpu_nodes if name not in node_index})
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise TopologyError(f"{len(missing)} node(s) not in the policy: {shown}")
        node_of_gpu = np.fromiter(
            (node_index[name] for name in gpu_nodes), dtype=np.int64, count=len(gpu_nodes)
        )
        return cls(
            names=names,
            level=level,
            parent=parent,
            budget_w=budget,
            overhead_w=overhead,
            gpu_groups=ancestors[node_of_gpu].reshape(len(gpu_nodes), N_LEVELS),
        )
