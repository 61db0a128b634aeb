"""Why a GPU has its cap: the tick's own numbers, frozen, and explained on demand.

Each tick the engine keeps a `WhyFrame`: references to the arrays it computed anyway (the
allocator's bounds, demand estimate, targets and group prices; the planner's caps sent and
committed) plus a few small extras (the nodes' sample numbers, the cuts still in flight).
Building it costs no per-GPU Python work. `explain(frame, i)` turns one GPU's row into the
explanation the API serves and the store keeps; it runs only for GPUs whose stored cap
changed (on the store writer's thread) or when someone asks (docs/api.md, "Why a cap").

Reasons are read off what the engine computed, never re-derived: the cap the allocator
wanted sits at a bound it was given (`lo_w`/`hi_w`, and which limit made that bound), at
the point past which the GPU gains nothing (its demand estimate or its profile's peak), or
where a budget's shadow price stopped it (the tightest group on its path: the highest
price, or the least slack when no price binds). The cap sent differs from the wanted one
only where the safety planner held a raise back, and then it says where (the group whose
committed caps have no room) and for whose acknowledgements (cuts sent, not yet acked).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerd.allocator import Allocation, ClassTable, GpuArrays
from powerd.allocator.problem import CAP_LIMITED_SHARE
from powerd.controller.fleet import FleetArrays
from powerd.policy import LEVELS
from powerd.safety import SafePlan, SafetyPlanner

FloatArray = NDArray[np.float64]
IntArray = NDArray[np.int64]
BoolArray = NDArray[np.bool_]

# Watts within which a cap counts as sitting at a bound (the stored caps' own resolution).
AT_BOUND_W = 0.5
# GPUs listed per explanation as awaited (cuts in flight); the rest are counted.
MAX_AWAITED = 10

# Reason codes, in the order an explanation lists them (docs/api.md, "Why a cap").
REASONS = (
    "fallback",  # the solver failed: failsafe caps
    "refused",  # the GPU refused its last cap: held at what it may have
    "drained",  # its node is drained: held at its minimum
    "pinned",  # an operator pinned it
    "min_over_budget",  # device minimums do not fit a group above it: held at its minimum
    "stale",  # its sample is stale: never raised
    "slew",  # the slew limit from its previous cap
    "ceiling",  # its class's ceiling
    "max",  # its device maximum
    "floor",  # its class's floor
    "min",  # its device minimum
    "demand",  # it gains nothing from more: its demand estimate or its profile's peak
    "budget",  # a budget's shadow price stopped it (the tightest group)
    "held_back",  # the planner holds part of a raise back (see `planner`)
    "not_sent",  # its node got no command (offline, or its caps in force are unknown)
)


@dataclass(frozen=True, eq=False)
class WhyFrame:
    """One tick's decision, by reference to the engine's own arrays (GPU order = topology
    order). Do not mutate any of them: the store writer and the API read them later."""

    tick: int
    ts: float
    status: str
    solver: str
    uuids: Sequence[str]
    nodes: Sequence[str]
    index: Mapping[str, int]  # uuid → position (built once per fleet shape)
    group_names: tuple[str, ...]
    group_levels: IntArray
    gpu_groups: IntArray  # (n, levels): each GPU's group at every level
    group_budget_w: FloatArray
    group_limit_w: FloatArray  # what committed caps may reach (budget, or an overload rating)
    group_committed_w: FloatArray  # after this tick's sends: Σ committed + overhead + reserve
    group_price: FloatArray | None  # multipliers per kW; None: the solver gives none
    infeasible_groups: frozenset[str]
    targets_w: FloatArray  # NaN: hold the committed cap (a GPU that refuses its cap)
    sent_w: FloatArray  # NaN: its node got no command
    committed_w: FloatArray  # after this tick's sends
    prev_w: FloatArray  # the caps that may have been in force before (the damping's anchor)
    lo_w: FloatArray | None  # the allocator's bounds (None: the solver failed)
    hi_w: FloatArray | None
    demand_w: FloatArray | None
    min_cap_w: FloatArray
    max_cap_w: FloatArray
    power_w: FloatArray
    cap_w: FloatArray  # the limit the GPU reported in force
    age_s: FloatArray
    stale: BoolArray
    node_seq: Mapping[str, int]  # the seq of each node's last telemetry
    class_index: IntArray
    classes: ClassTable
    dropped_floors: frozenset[str]
    pinned_w: FloatArray  # NaN: free
    refused: BoolArray
    drained: frozenset[str]
    slew_w: float | None
    job_index: IntArray | None
    job_names: tuple[str, ...]
    offline: frozenset[str]
    waiting: frozenset[str]
    cuts: IntArray  # GPUs with a cut sent and not yet acknowledged (committed above sent)
    cuts_since: IntArray  # per entry of `cuts`: its oldest unacknowledged tick
    # A GPU drawing this share of its cap reads as held back by it (problem.held_share).
    held_share: float = CAP_LIMITED_SHARE

    def explain_uuid(self, uuid: str) -> dict[str, Any] | None:
        i = self.index.get(uuid)
        return None if i is None else explain(self, i)

    def explain_uuids(
        self, uuids: Sequence[str], *, summaries: bool = True
    ) -> dict[str, dict[str, Any]]:
        """Explanations of the GPUs named (those of this tick), by uuid, made in one batch;
        `summaries=False` leaves out the one-line summary (the store makes it on reading)."""
        idx = [i for i in (self.index.get(u) for u in uuids) if i is not None]
        docs = explain_many(self, np.array(idx, dtype=np.int64), summaries=summaries)
        return {d["uuid"]: d for d in docs}


@dataclass(frozen=True, slots=True)
class Decided:
    """What the engine decided this tick, besides the allocation and the plan."""

    tick: int
    ts: float
    status: str
    solver: str
    targets_w: FloatArray  # NaN: hold the committed cap
    budget_w: FloatArray  # per group, in force
    limit_w: FloatArray  # per group, what committed caps may reach
    prev_w: FloatArray  # per GPU, the caps that may have been in force (the damping's anchor)
    refused: BoolArray
    offline: Collection[str]
    slew_w: float | None
    # A GPU drawing this share of its cap reads as held back by it (problem.held_share).
    held_share: float = CAP_LIMITED_SHARE


def why_frame(
    decided: Decided,
    *,
    fleet: GpuArrays,
    arrays: FleetArrays,
    index: Mapping[str, int],
    alloc: Allocation | None,
    plan: SafePlan,
    planner: SafetyPlanner,
    classes: ClassTable,
    drained: Collection[str],
    node_seq: Mapping[str, int],
) -> WhyFrame:
    """The frame of one tick: references and a few O(changes) extras, no per-GPU Python."""
    topo = fleet.topology
    sent = plan.sent_w
    # Cuts in flight matter only to a raise held back: none held back, none looked up.
    cuts = np.zeros(0, dtype=np.int64)
    if (plan.withheld & ~np.isnan(sent)).any():
        cuts = np.flatnonzero(plan.committed_w > sent + AT_BOUND_W)  # NaN compares False
    return WhyFrame(
        tick=decided.tick,
        ts=decided.ts,
        status=decided.status,
        solver=decided.solver,
        uuids=fleet.uuids,
        nodes=arrays.nodes,
        index=index,
        group_names=topo.names,
        group_levels=topo.level,
        gpu_groups=topo.gpu_groups,
        group_budget_w=decided.budget_w,
        group_limit_w=decided.limit_w,
        group_committed_w=plan.group_committed_w,
        group_price=None if alloc is None else alloc.prices,
        infeasible_groups=frozenset(() if alloc is None else alloc.infeasible_groups),
        targets_w=decided.targets_w,
        sent_w=sent,
        committed_w=plan.committed_w,
        prev_w=decided.prev_w,
        lo_w=None if alloc is None else alloc.lo_w,
        hi_w=None if alloc is None else alloc.hi_w,
        demand_w=None if alloc is None else alloc.demand_w,
        min_cap_w=fleet.min_cap_w,
        max_cap_w=fleet.max_cap_w,
        power_w=fleet.power_w,
        cap_w=arrays.cap_w,
        age_s=arrays.age_s,
        stale=fleet.stale,
        node_seq=node_seq,
        class_index=fleet.class_index,
        classes=classes,
        dropped_floors=frozenset(() if alloc is None else alloc.dropped_floors),
        pinned_w=fleet.pinned_w,
        refused=decided.refused,
        drained=frozenset(drained),
        slew_w=decided.slew_w,
        job_index=fleet.job_index,
        job_names=fleet.job_names,
        offline=frozenset(decided.offline),
        waiting=frozenset(plan.waiting_nodes),
        cuts=cuts,
        cuts_since=planner.pending_since(cuts),
        held_share=decided.held_share,
    )


def tightest_groups(frame: WhyFrame, gpus: IntArray | None = None) -> IntArray:
    """Per GPU (all, or those in `gpus`): the tightest group on its path. The one with the
    highest shadow price where a price binds (> 0), else the one with the least slack
    (limit − committed after this tick's sends)."""
    path = frame.gpu_groups if gpus is None else frame.gpu_groups[gpus]
    slack = frame.group_limit_w - frame.group_committed_w
    slack = np.where(np.isfinite(slack), slack, np.inf)
    pick = np.argmin(slack[path], axis=1)
    if frame.group_price is not None and frame.group_price.size == len(frame.group_names):
        prices = frame.group_price[path]
        by_price = np.argmax(prices, axis=1)
        pick = np.where(prices.max(axis=1) > 0.0, by_price, pick)
    out: IntArray = path[np.arange(path.shape[0]), pick]
    return out


def _num(x: float) -> float | None:
    return x if math.isfinite(x) else None


class _Rows:
    """The frame's per-GPU values for the GPUs being explained, as Python lists (one numpy
    gather per array: explaining thousands of GPUs costs microseconds each, not a numpy
    call per value)."""

    def __init__(self, frame: WhyFrame, idx: IntArray) -> None:
        nan = np.full(idx.size, np.nan)
        c = frame.class_index[idx]
        cls = frame.classes
        self.idx = idx.tolist()
        self.cls = c.tolist()
        self.target = frame.targets_w[idx].tolist()
        self.sent = frame.sent_w[idx].tolist()
        self.committed = frame.committed_w[idx].tolist()
        self.prev = frame.prev_w[idx].tolist()
        self.lo = (nan if frame.lo_w is None else frame.lo_w[idx]).tolist()
        self.hi = (nan if frame.hi_w is None else frame.hi_w[idx]).tolist()
        self.demand = (nan if frame.demand_w is None else frame.demand_w[idx]).tolist()
        self.min_cap = frame.min_cap_w[idx].tolist()
        self.max_cap = frame.max_cap_w[idx].tolist()
        self.power = frame.power_w[idx].tolist()
        self.cap = frame.cap_w[idx].tolist()
        self.age = frame.age_s[idx].tolist()
        self.stale = frame.stale[idx].tolist()
        self.pinned = frame.pinned_w[idx].tolist()
        self.refused = frame.refused[idx].tolist()
        self.floor = cls.floor_w[c].tolist()
        self.ceiling = cls.ceiling_w[c].tolist()
        self.peak = (cls.peak_kw[c] * 1000.0).tolist()
        self.job = (
            np.full(idx.size, -1) if frame.job_index is None else frame.job_index[idx]
        ).tolist()
        path = frame.gpu_groups[idx]
        self.tight = tightest_groups(frame, idx).tolist()
        price = frame.group_price
        binds = np.zeros(idx.size, dtype=np.bool_)
        if price is not None and price.size == len(frame.group_names):
            binds = np.asarray(price[path].max(axis=1) > 0.0, dtype=np.bool_)
        self.price_binds = binds.tolist()
        infeasible = np.zeros(idx.size, dtype=np.bool_)
        if frame.infeasible_groups:
            names = frame.group_names
            bad = np.array([n in frame.infeasible_groups for n in names], dtype=np.bool_)
            infeasible = np.asarray(bad[path].any(axis=1), dtype=np.bool_)
        self.infeasible: list[bool] = infeasible.tolist()


class _Cuts:
    """The frame's cuts in flight by group, per level, oldest first: built once per batch
    of explanations and only for the levels asked about."""

    def __init__(self, frame: WhyFrame) -> None:
        self.frame = frame
        self._levels: dict[int, tuple[IntArray, IntArray]] = {}

    def under(self, g: int) -> tuple[IntArray, IntArray, int]:
        """(GPUs, their oldest unacked ticks) of at most MAX_AWAITED cuts under group g,
        oldest first, and how many there are in all."""
        frame = self.frame
        level = int(frame.group_levels[g])
        if level not in self._levels:
            gid = frame.gpu_groups[frame.cuts, level]
            order = np.lexsort((frame.cuts_since, gid))
            self._levels[level] = (gid[order], order)
        gid, order = self._levels[level]
        lo, hi = np.searchsorted(gid, g, "left"), np.searchsorted(gid, g, "right")
        pick = order[lo : min(hi, lo + MAX_AWAITED)]
        return frame.cuts[pick], frame.cuts_since[pick], int(hi - lo)


def _group(frame: WhyFrame, g: int) -> dict[str, Any]:
    price = None if frame.group_price is None else _num(float(frame.group_price[g]))
    return {
        "group": frame.group_names[g],
        "level": LEVELS[int(frame.group_levels[g])],
        "budget_w": _num(float(frame.group_budget_w[g])),
        "limit_w": _num(float(frame.group_limit_w[g])),
        "committed_w": _num(float(frame.group_committed_w[g])),
        "slack_w": _num(float(frame.group_limit_w[g] - frame.group_committed_w[g])),
        "price_per_kw": price,
    }


def _upper(frame: WhyFrame, r: _Rows, k: int) -> str:
    """Which limit made the allocator's upper bound."""
    hi, prev = r.hi[k], r.prev[k]
    if frame.slew_w is not None and abs(hi - (prev + frame.slew_w)) <= AT_BOUND_W:
        return "slew"
    if r.stale[k] and abs(hi - r.cap[k]) <= AT_BOUND_W:
        return "stale"
    if abs(hi - r.ceiling[k]) <= AT_BOUND_W:
        return "ceiling"
    return "max"


def _lower(frame: WhyFrame, r: _Rows, k: int) -> str:
    """Which limit made the allocator's lower bound."""
    lo, prev = r.lo[k], r.prev[k]
    if frame.slew_w is not None and abs(lo - (prev - frame.slew_w)) <= AT_BOUND_W:
        return "slew"
    if abs(lo - r.floor[k]) <= AT_BOUND_W and lo > r.min_cap[k]:
        return "floor"
    return "min"


def _allocator_reasons(frame: WhyFrame, r: _Rows, k: int, node: str) -> list[str]:
    """What decided the cap the allocator wanted, main reason first."""
    lo, hi = r.lo[k], r.hi[k]
    if frame.status == "fallback" or math.isnan(lo) or math.isnan(hi):
        return ["fallback"]
    if r.refused[k]:
        return ["refused"]
    if node in frame.drained:
        return ["drained"]
    if math.isfinite(r.pinned[k]):
        return ["pinned"]
    if r.infeasible[k]:
        return ["min_over_budget"]
    reasons = []
    target = r.target[k]
    at_hi = target >= hi - AT_BOUND_W
    at_lo = target <= lo + AT_BOUND_W
    demand = r.demand[k]
    flat = min(demand if math.isfinite(demand) else math.inf, r.peak[k])
    if at_hi and not at_lo:
        reasons.append(_upper(frame, r, k))
    elif at_lo:  # (lo = hi too: a floor at the ceiling, a slew at rest)
        reasons.append(_lower(frame, r, k))
    if abs(target - flat) <= AT_BOUND_W and not at_hi and flat < hi - AT_BOUND_W:
        reasons.append("demand")
    elif r.price_binds[k] and not at_hi:
        reasons.append("budget")
    if not reasons:
        reasons.append("budget" if r.price_binds[k] else "demand")
    return reasons


def explain(frame: WhyFrame, i: int) -> dict[str, Any]:
    """GPU i's explanation: plain JSON values (None where a number is not finite)."""
    return explain_many(frame, np.array([i], dtype=np.int64))[0]


def explain_many(
    frame: WhyFrame, gpus: IntArray, *, summaries: bool = True
) -> list[dict[str, Any]]:
    """The explanations of the GPUs at positions `gpus`, in that order (`summaries`: with
    their one-line summary)."""
    r = _Rows(frame, np.asarray(gpus, dtype=np.int64))
    cuts = _Cuts(frame)
    groups: dict[int, dict[str, Any]] = {}
    classes = frame.classes
    out = []
    for k, i in enumerate(r.idx):
        uuid, node, c = frame.uuids[i], frame.nodes[i], r.cls[k]
        target, sent, prev = r.target[k], r.sent[k], r.prev[k]
        reasons = _allocator_reasons(frame, r, k, node)
        if math.isnan(sent):
            reasons.append("not_sent")
        elif math.isfinite(target) and sent < target - AT_BOUND_W:
            reasons.append("held_back")
        drained = node in frame.drained
        pinned = r.pinned[k]
        refused = bool(r.refused[k])
        g = r.tight[k]
        if g not in groups:
            groups[g] = _group(frame, g)
        slew = None
        if frame.slew_w is not None:
            limited = None
            if reasons[0] == "slew":
                limited = "up" if target >= prev else "down"
            slew = {"slew_w": frame.slew_w, "from_w": _num(prev), "limited": limited}
        j = r.job[k]
        doc: dict[str, Any] = {
            "uuid": uuid,
            "node": node,
            "tick": frame.tick,
            "ts": frame.ts,
            "status": frame.status,
            "solver": frame.solver,
            "target_w": _num(target),
            "sent_w": _num(sent),
            "committed_w": _num(r.committed[k]),
            "decided_by": reasons,
            "budget": dict(groups[g]),
            "demand": {
                "demand_w": _num(r.demand[k]),
                # The allocator's own rule (problem.demand_w): near its cap, it wants its max.
                "cap_limited": r.power[k] >= frame.held_share * prev,
                "peak_w": _num(r.peak[k]),
                "power_w": _num(r.power[k]),
                "reported_cap_w": _num(r.cap[k]),
                "sample_age_s": _num(r.age[k]),
                "sample_seq": frame.node_seq.get(node),
                "stale": bool(r.stale[k]),
            },
            "class": {
                "name": classes.names[c],
                "weight": float(classes.weight[c]),
                "floor_w": _num(r.floor[k]) or None,
                "ceiling_w": _num(r.ceiling[k]),
                "floor_dropped": uuid in frame.dropped_floors,
            },
            "job": frame.job_names[j] if 0 <= j < len(frame.job_names) else None,
            "pin_w": None if drained or refused or not math.isfinite(pinned) else pinned,
            "drained": drained,
            "refused": refused,
            "bounds": {
                "lo_w": _num(r.lo[k]),
                "hi_w": _num(r.hi[k]),
                "min_cap_w": r.min_cap[k],
                "max_cap_w": r.max_cap[k],
            },
            "slew": slew,
            "planner": _planner(frame, cuts, i, target, sent),
        }
        if summaries:
            doc["summary"] = summary(doc)
        out.append(doc)
    return out


def _planner(
    frame: WhyFrame, cuts: _Cuts, i: int, target: float, sent: float
) -> dict[str, Any] | None:
    """What the safety planner did with the wanted cap: None when it sent it as wanted."""
    node = frame.nodes[i]
    if math.isnan(sent):
        why = (
            "node_offline"
            if node in frame.offline
            else "node_waiting"
            if node in frame.waiting
            else "no_command"
        )
        return {
            "held_back_w": None,
            "reason": why,
            "group": None,
            "awaiting": [],
            "awaiting_more": 0,
        }
    if not math.isfinite(target) or sent >= target - AT_BOUND_W:
        return None
    held = target - sent
    if frame.stale[i]:
        return {
            "held_back_w": held,
            "reason": "stale",
            "group": None,
            "awaiting": [],
            "awaiting_more": 0,
        }
    path = frame.gpu_groups[i]
    slack = frame.group_limit_w[path] - frame.group_committed_w[path]
    k = int(np.argmin(np.where(np.isfinite(slack), slack, np.inf)))
    g = int(path[k])
    gpus, since, total = cuts.under(g)
    awaiting = [
        {
            "node": frame.nodes[j],
            "uuid": frame.uuids[j],
            "committed_w": float(frame.committed_w[j]),
            "sent_w": float(frame.sent_w[j]),
            "since_tick": t if t >= 0 else None,
        }
        for j, t in zip(gpus.tolist(), since.tolist(), strict=True)
    ]
    over = bool(frame.group_committed_w[g] > frame.group_limit_w[g] + AT_BOUND_W)
    reason = "group_over" if over else "awaiting_acks" if awaiting else "no_room"
    return {
        "held_back_w": held,
        "reason": reason,
        "group": frame.group_names[g],
        "awaiting": awaiting,
        "awaiting_more": total - len(awaiting),
    }


_SAYS = {
    "fallback": "the solver failed this tick: failsafe caps",
    "refused": "it refused its last cap: held at what it may have",
    "drained": "its node is drained: held at its minimum",
    "pinned": "pinned by an operator",
    "min_over_budget": "device minimums exceed a budget above it: held at its minimum",
    "stale": "its telemetry is stale: not raised",
    "slew": "the slew limit from its previous cap",
    "ceiling": "its class's ceiling",
    "max": "its device maximum",
    "floor": "its class's floor",
    "min": "its device minimum",
    "demand": "it gains nothing from more power (demand estimate or profile peak)",
    "budget": "the budget of {group}",
    "held_back": "the safety planner holds {held:.0f} W of the raise back ({why})",
    "not_sent": "its node got no command ({why})",
}


def summary(doc: Mapping[str, Any]) -> str:
    """One line an operator reads: the caps, then what decided them, main reason first."""

    def w(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f} W"

    planner = doc.get("planner") or {}
    why = planner.get("reason") or ""
    if planner.get("group"):
        why += f" in {planner['group']}"
    if planner.get("awaiting"):
        why += ": acks from " + ", ".join(sorted({a["node"] for a in planner["awaiting"]}))
    parts = [
        _SAYS[r].format(
            group=(doc.get("budget") or {}).get("group", "?"),
            held=planner.get("held_back_w") or 0.0,
            why=why,
        )
        for r in doc["decided_by"]
    ]
    return f"target {w(doc['target_w'])}, sent {w(doc['sent_w'])}: " + "; ".join(parts)
