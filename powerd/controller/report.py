"""What one tick saw and did (`TickReport`, for the live view, the API, metrics and the
store) and what the controller remembers of past ticks (`TickSummary`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
from numpy.typing import NDArray

from powerd.controller.meters import MeterView
from powerd.controller.why import WhyFrame

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]


@dataclass(frozen=True)
class TickReport:
    """What one tick saw and did, for the live view, the API, metrics and the store."""

    tick: int
    ts: float  # wall clock at the tick's start
    duration_ms: float  # tick start → last command published
    solve_ms: float
    plan_ms: float
    status: str  # allocator status, or "fallback"
    solver: str
    objective: float
    group_names: tuple[str, ...]
    group_levels: NDArray[np.int64]
    group_budget_w: FloatArray  # in force (policy ∩ temporary overrides)
    group_committed_w: FloatArray  # committed caps + overhead + reserve for unknown GPUs
    group_draw_w: FloatArray  # measured GPU draw + overhead
    group_over: BoolArray  # committed above budget (a cut not yet obeyed)
    # Above budget only while GPUs count at their maximum until their first ack after a
    # start (docs/safety.md, "Restart"): no breach known, nothing rises there.
    group_settling: BoolArray
    uuids: list[str]
    nodes: list[str]
    # Per GPU, as steered. A tuple: a tuple of strings leaves the garbage collector's view
    # where a list would be walked at every collection.
    classes: tuple[str, ...]
    power_w: FloatArray
    cap_w: FloatArray  # the limit each GPU reported in force (telemetry read-back)
    energy_j: FloatArray
    temp_c: FloatArray
    targets_w: FloatArray
    sent_w: FloatArray  # NaN where the node got no command
    committed_w: FloatArray
    throughput: FloatArray  # per GPU
    stale: BoolArray
    waiting_nodes: tuple[str, ...]
    alarms: tuple[str, ...]
    # What committed caps may reach: the budget, or above it where a group is rated for an
    # overload (OverloadRule); None: the budgets (a tick that fell back).
    group_limit_w: FloatArray | None = None
    # Per GPU: the limit its agent last set (NaN: none known). `cap_w` away from it is a
    # limit powerd did not set (`cap_overridden`); None: a tick that fell back.
    set_w: FloatArray | None = None
    # Room in the root's limit in force (group_limit_w) the allocation left to nobody (W):
    # power no GPU could use (control.leftover: peak leaves what lies past the profiles'
    # peaks); 0 if the root has no budget.
    unused_w: float = 0.0
    # What decided each cap, to explain on request (controller/why.py); None: a failed tick.
    why: WhyFrame | None = None
    # Per GPU: the throughput its workload reported (NaN: none; `throughput` fills those in
    # from the profiles); the store keeps its per-minute mean for `powerd pilot report`.
    # None: a tick that fell back.
    perf: FloatArray | None = None
    # Churn (controller/churn.py): GPUs whose cap this tick moves from the cap that may be in
    # force, the W those moves add up to, and moves the deadband held (control.deadband_w).
    caps_moved: int = 0
    moved_w: float = 0.0
    caps_held: int = 0
    # GPUs pressing on their cap whose raise the deadband has trimmed at every pass for at
    # least a minute (held cuts kept the room: controller/tick.py, STARVED_S).
    raises_starved: int = 0
    # Metered groups (controller/meters.py): each one's reading, gap and learned overhead,
    # and the meters' answers rejected, by (group, reason).
    meters: tuple[MeterView, ...] = ()
    meter_rejected: Mapping[tuple[str, str], int] = field(default_factory=dict)

    @cached_property
    def meter_of(self) -> Mapping[str, MeterView]:
        """The meters' views by group (the API looks each group up: a scan per group was
        quadratic with thousands of metered groups, on the event loop)."""
        return {v.group: v for v in self.meters}

    @property
    def throughput_total(self) -> float:
        return float(self.throughput.sum())

    def throughput_by_class(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for cls, t in zip(self.classes, self.throughput.tolist(), strict=True):
            out[cls] = out.get(cls, 0.0) + t
        return out

    def level_totals(self, level: int) -> list[tuple[str, float, float, float]]:
        """(name, budget, committed, draw) of every group at one level."""
        idx = np.flatnonzero(self.group_levels == level)
        return [
            (
                self.group_names[g],
                float(self.group_budget_w[g]),
                float(self.group_committed_w[g]),
                float(self.group_draw_w[g]),
            )
            for g in idx.tolist()
        ]


@dataclass(frozen=True, slots=True)
class TickSummary:
    """A past tick as the controller remembers it (the API's /ticks without a store): a few
    numbers, not a TickReport's per-GPU arrays, which would make the memory of the last
    ticks grow with the fleet (docs/performance.md, "Steering loop"). The one list of a
    tick's summary fields: the store's TickRecord extends it, the API's TickOut uses its names."""

    tick: int
    ts: float
    status: str
    solver: str
    solve_ms: float
    budget_w: float  # the facility's, in force
    committed_w: float  # the facility's: committed caps + overhead + reserve
    draw_w: float  # the facility's: measured GPU draw + overhead
    throughput: float
    gpus: int
    gpus_stale: int

    @classmethod
    def of(cls, r: TickReport) -> TickSummary:
        return cls(
            tick=r.tick,
            ts=r.ts,
            status=r.status,
            solver=r.solver,
            solve_ms=r.solve_ms,
            budget_w=float(r.group_budget_w[0]),
            committed_w=float(r.group_committed_w[0]),
            draw_w=float(r.group_draw_w[0]),
            throughput=r.throughput_total,
            gpus=len(r.uuids),
            gpus_stale=int(r.stale.sum()),
        )
