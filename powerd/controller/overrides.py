"""Operators' changes to the power picture that live beside the policy file.

Temporary budgets (grid demand-response events), class assignments (a scheduler's prolog),
pinned caps and drained nodes. All of them take effect on the next tick. A temporary budget
can only lower a group's budget: the policy's budget is the breaker or contract rating, and
no API call may lift the tree above it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import structlog

from powerd.policy import Policy

log = structlog.get_logger(__name__)


class OverrideError(ValueError):
    """An override that cannot apply (unknown class, value out of range, ...)."""


class NotFound(OverrideError):
    """The override names a group, node or GPU that does not exist, or nothing to undo."""


@dataclass(frozen=True)
class BudgetOverride:
    group: str
    budget_w: float
    expires_at: float | None  # wall-clock seconds; None: until cleared
    reason: str
    actor: str
    created_at: float


@dataclass
class Overrides:
    budgets: dict[str, BudgetOverride] = field(default_factory=dict)
    gpu_classes: dict[str, str] = field(default_factory=dict)  # uuid → class
    node_classes: dict[str, str] = field(default_factory=dict)  # node → class
    pins: dict[str, float] = field(default_factory=dict)  # uuid → W
    drained: set[str] = field(default_factory=set)  # nodes held at their GPUs' minimum

    def set_budget(self, policy: Policy, override: BudgetOverride) -> None:
        groups = {g.name: g for g in policy.groups}
        group = groups.get(override.group)
        if group is None:
            raise NotFound(f"unknown group '{override.group}'")
        if not override.budget_w > 0:
            raise OverrideError("budget_w must be greater than 0")
        if override.budget_w > group.budget_w:
            raise OverrideError(
                f"a temporary budget can only lower '{override.group}' "
                f"(policy budget {group.budget_w:,.0f} W)"
            )
        if override.expires_at is not None and override.expires_at <= override.created_at:
            raise OverrideError("expires_at must lie in the future")
        self.budgets[override.group] = override

    def clear_budget(self, group: str) -> BudgetOverride:
        try:
            return self.budgets.pop(group)
        except KeyError:
            raise NotFound(f"no temporary budget on '{group}'") from None

    def active_budgets(self, policy: Policy, now_wall: float) -> dict[str, float]:
        """Budgets in force by group name: the lower of the policy's and the override's.

        Expired overrides are dropped (and logged) here, so they end on the next tick.
        """
        for name in [
            n
            for n, o in self.budgets.items()
            if o.expires_at is not None and o.expires_at <= now_wall
        ]:
            expired = self.budgets.pop(name)
            log.info("budget_override_expired", group=name, budget_w=expired.budget_w)
        policy_budgets = {g.name: g.budget_w for g in policy.groups}
        return {
            name: min(o.budget_w, policy_budgets[name])
            for name, o in self.budgets.items()
            if name in policy_budgets
        }

    def assign_class(
        self,
        policy: Policy,
        cls: str,
        *,
        uuids: list[str] | None = None,
        nodes: list[str] | None = None,
    ) -> None:
        if cls not in policy.classes:
            valid = ", ".join(sorted(policy.classes))
            raise OverrideError(f"unknown class '{cls}'; valid: {valid}")
        known_nodes = set(policy.node_names())
        bad = [n for n in nodes or [] if n not in known_nodes]
        if bad:
            raise OverrideError(f"unknown node(s): {', '.join(bad[:5])}")
        for uuid in uuids or []:
            self.gpu_classes[uuid] = cls
        for node in nodes or []:
            self.node_classes[node] = cls

    def clear_class(
        self, *, uuids: list[str] | None = None, nodes: list[str] | None = None
    ) -> None:
        for uuid in uuids or []:
            self.gpu_classes.pop(uuid, None)
        for node in nodes or []:
            self.node_classes.pop(node, None)

    def class_of(self, uuid: str, node: str, reported: str | None) -> str | None:
        """Assignment by GPU, then by node, then what the workload itself reports."""
        return self.gpu_classes.get(uuid) or self.node_classes.get(node) or reported

    def pinned_w(self, uuid: str, node: str, min_cap_w: float, max_cap_w: float) -> float | None:
        """The fixed cap of a pinned GPU (clamped to its limits), a drained node's minimum."""
        if node in self.drained:
            return min_cap_w
        pin = self.pins.get(uuid)
        return None if pin is None else min(max(pin, min_cap_w), max_cap_w)

    def forget_policy_gaps(self, policy: Policy) -> None:
        """After a policy change, drop overrides that name groups, nodes or classes now gone."""
        names = {g.name for g in policy.groups}
        nodes = set(policy.node_names())
        for group in [g for g in self.budgets if g not in names]:
            del self.budgets[group]
        self.node_classes = {
            n: c for n, c in self.node_classes.items() if n in nodes and c in policy.classes
        }
        self.gpu_classes = {u: c for u, c in self.gpu_classes.items() if c in policy.classes}
        self.drained &= nodes
