"""The fleet as the controller sees it now: the summary, groups, nodes, GPUs and the last
tick's allocation, read from the controller's memory on its loop."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Query

from powerd.api.bodies import (
    AllocationOut,
    FleetSummary,
    GpuCap,
    GpuOut,
    GpuStateName,
    GroupMeterOut,
    GroupUse,
    LeadershipOut,
    MemberOut,
    NodeOut,
    NodeStateName,
    Page,
)
from powerd.api.deps import V1, ControllerDep, Limit, NameQuery, Offset, Viewer, ViewsDep
from powerd.api.errors import AUTH_ERRORS, error_doc, rejected
from powerd.controller.controller import Controller
from powerd.controller.fleet import is_stale
from powerd.controller.report import TickReport
from powerd.controller.why import WhyFrame
from powerd.numeric import finite_or_none
from powerd.policy import LEVELS

router = APIRouter(prefix=V1, tags=["fleet"])


def _group_use(r: TickReport, g: int) -> GroupUse:
    return GroupUse(
        name=r.group_names[g],
        level=LEVELS[int(r.group_levels[g])],
        budget_w=finite_or_none(float(r.group_budget_w[g])),
        committed_w=float(r.group_committed_w[g]),
        draw_w=float(r.group_draw_w[g]),
        over=bool(r.group_over[g]),
        limit_w=None if r.group_limit_w is None else finite_or_none(float(r.group_limit_w[g])),
        price_per_kw=_price(r, g),
        meter=_meter(r, r.group_names[g]),
    )


def _meter(r: TickReport, name: str) -> GroupMeterOut | None:
    view = r.meter_of.get(name)
    if view is None:
        return None
    return GroupMeterOut.model_validate({k: getattr(view, k) for k in GroupMeterOut.model_fields})


def _price(r: TickReport, g: int) -> float | None:
    prices = None if r.why is None else r.why.group_price
    return None if prices is None else finite_or_none(float(prices[g]))


def leadership_out(controller: Controller) -> LeadershipOut | None:
    lead = controller.leadership
    if lead is None:
        return None
    v = lead.view()
    members = [
        MemberOut(controller=m.holder, role=m.role, epoch=m.epoch, age_s=m.age_s) for m in v.members
    ]
    return LeadershipOut(
        scope=v.scope,
        mode=v.mode,
        controller=v.controller_id,
        role=v.role,
        leader=v.leader,
        epoch=v.epoch,
        lease_left_s=v.lease_left_s,
        standbys=[m.holder for m in v.members if m.role != "leader"],
        members=members,
        takeovers=v.takeovers,
        stepped_down=v.stepped_down,
        fenced=controller.engine.fenced_total(),
        withheld=controller.counters.withheld,
        db_failures=v.db_failures,
        last_error=v.last_error,
        authority=controller.authority,
        policy_version=controller.policy_version,
        policy_differs=controller.alarms.get("policy_differs"),
        clock_skew_s=None if lead.skew_s is None else round(lead.skew_s, 3),
        outage_s=None if lead.outage_since is None else round(lead.clock() - lead.outage_since, 3),
    )


@router.get(
    "/leadership",
    response_model=LeadershipOut,
    responses={**AUTH_ERRORS, 404: error_doc("No leadership: an embedded controller loop")},
)
async def leadership(_: Viewer, controller: ControllerDep) -> LeadershipOut:
    """Which controller leads this scope, its epoch, the standbys, takeovers and fenced
    commands (docs/operations.md, "A standby pair")."""
    out = leadership_out(controller)
    if out is None:
        rejected(404, "this controller runs without leadership (an embedded loop)")
    return out


def _page(items: Sequence[Any], limit: int, offset: int) -> dict[str, Any]:
    return {
        "items": list(items[offset : offset + limit]),
        "total": len(items),
        "limit": limit,
        "offset": offset,
    }


@router.get("/fleet", response_model=FleetSummary, responses=AUTH_ERRORS)
async def fleet(_: Viewer, controller: ControllerDep) -> FleetSummary:
    """Budgets, committed caps, draw and throughput, facility and per row."""
    r = controller.last_tick
    nodes = controller.policy.node_names()
    return FleetSummary(
        leadership=leadership_out(controller),
        tick=None if r is None else r.tick,
        ts=None if r is None else r.ts,
        status=None if r is None else r.status,
        solver=None if r is None else r.solver,
        solve_ms=None if r is None else r.solve_ms,
        duration_ms=None if r is None else r.duration_ms,
        policy_version=controller.policy_version,
        policy_source=controller.policy.source,
        tick_s=controller.policy.control.tick_s,
        facility=None if r is None or not r.group_names else _group_use(r, 0),
        rows=[]
        if r is None
        else [_group_use(r, int(g)) for g in np.flatnonzero(r.group_levels == 1)],
        nodes=len(nodes),
        nodes_by_state=controller.fleet.state_counts(),
        gpus=len(controller.fleet.gpus) if r is None else len(r.uuids),
        gpus_stale=0 if r is None else int(r.stale.sum()),
        throughput=None if r is None else finite_or_none(r.throughput_total),
        throughput_by_class={}
        if r is None
        else {k: v for k, v in r.throughput_by_class().items() if math.isfinite(v)},
        alarms=sorted(controller.alarms),
    )


@router.get("/groups", response_model=Page[GroupUse], responses=AUTH_ERRORS)
async def groups(
    _: Viewer,
    controller: ControllerDep,
    level: Literal["facility", "row", "rack", "node"] | None = None,
    over: bool | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """Every budgeted group of the last tick (facility, rows, racks, nodes)."""
    r = controller.last_tick
    if r is None:
        return _page([], limit, offset)
    idx = list(range(len(r.group_names)))
    if level is not None:
        idx = np.flatnonzero(r.group_levels == LEVELS.index(level)).tolist()
    if over is not None:
        idx = [g for g in idx if bool(r.group_over[g]) == over]
    items = [_group_use(r, g) for g in idx[offset : offset + limit]]
    return {"items": items, "total": len(idx), "limit": limit, "offset": offset}


@router.get("/nodes", response_model=Page[NodeOut], responses=AUTH_ERRORS)
async def nodes(
    _: Viewer,
    controller: ControllerDep,
    views: ViewsDep,
    row: NameQuery = None,
    rack: NameQuery = None,
    class_: Annotated[str | None, Query(alias="class", max_length=128)] = None,
    state: Literal[NodeStateName, "drained"] | None = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """The policy's nodes, in policy order, with last tick's use; filters combine."""
    places = views.places()
    r = controller.last_tick
    group_at = views.tick_index()[1]
    now = controller.clock.monotonic()
    by_node: dict[str, list[int]] = {}
    if r is not None:
        for i, n in enumerate(r.nodes):
            by_node.setdefault(n, []).append(i)
    out: list[NodeOut] = []
    for name in controller.policy.node_names():
        if row is not None and places.row.get(name) != row:
            continue
        if rack is not None and places.rack.get(name) != rack:
            continue
        rec = controller.fleet.nodes.get(name)
        node_state = controller.fleet.node_state(name)
        drained = name in controller.overrides.drained
        if state is not None and (not drained if state == "drained" else node_state != state):
            continue
        classes = sorted({r.classes[i] for i in by_node.get(name, [])}) if r else []
        if class_ is not None and class_ not in classes:
            continue
        g = group_at.get(name)
        out.append(
            NodeOut(
                name=name,
                row=places.row.get(name),
                rack=places.rack.get(name),
                state=node_state,
                drained=drained,
                assigned_class=controller.overrides.node_classes.get(name),
                classes=classes,
                gpus=len(by_node.get(name, [])),
                last_seen_age_s=None
                if rec is None or rec.seen_at is None
                else max(0.0, now - rec.seen_at),
                budget_w=None
                if r is None or g is None
                else finite_or_none(float(r.group_budget_w[g])),
                committed_w=None if r is None or g is None else float(r.group_committed_w[g]),
                draw_w=None if r is None or g is None else float(r.group_draw_w[g]),
            )
        )
    return _page(out, limit, offset)


def _tick_job(frame: WhyFrame, i: int) -> str | None:
    """The job GPU `i` was in at the last tick: for a GPU in no operator's job now, the job
    its node reports (as coupled by `control.reported_jobs`), as of that tick like its class."""
    if frame.job_index is None:
        return None
    j = int(frame.job_index[i])
    return frame.job_names[j] if 0 <= j < len(frame.job_names) else None


@router.get("/gpus", response_model=Page[GpuOut], responses=AUTH_ERRORS)
async def gpus(
    _: Viewer,
    controller: ControllerDep,
    views: ViewsDep,
    node: NameQuery = None,
    row: NameQuery = None,
    rack: NameQuery = None,
    class_: Annotated[str | None, Query(alias="class", max_length=128)] = None,
    state: Literal[GpuStateName, "pinned", "drained"] | None = None,
    job: NameQuery = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """Every known GPU in the fleet's order (node, then index); filters combine."""
    places = views.places()
    r = controller.last_tick
    gpu_at, _groups = views.tick_index()
    fleet = controller.fleet
    over = controller.overrides
    jobs = over.jobs
    stale_after = controller.policy.control.stale_after_s
    now = controller.clock.monotonic()
    selected = []
    for uuid in fleet.ordered_uuids():
        rec = fleet.gpus[uuid]
        if node is not None and rec.node != node:
            continue
        if row is not None and places.row.get(rec.node) != row:
            continue
        if rack is not None and places.rack.get(rec.node) != rack:
            continue
        i = gpu_at.get(uuid)
        cls = r.classes[i] if r is not None and i is not None else None
        if class_ is not None and cls != class_:
            continue
        job_of = jobs.job_of(uuid, rec.node) if jobs.by_name else None
        if job_of is None and i is not None and r is not None and r.why is not None:
            job_of = _tick_job(r.why, i)
            if job_of is not None and job_of in jobs.by_name:
                # An operator's job as of the last tick, left since (a replace): what is in
                # force now answered above, and a reported job never takes an operator's name.
                job_of = None
        if job is not None and job_of != job:
            continue
        age = max(0.0, now - rec.seen_at)
        stale = is_stale(age, rec.error is not None, stale_after)
        if (
            state is not None
            and not {
                "ok": not stale,
                "stale": stale,
                "pinned": uuid in over.pins,
                "drained": rec.node in over.drained,
            }[state]
        ):
            continue
        selected.append((rec, i, cls, stale, age, job_of))
    out = []
    for rec, i, cls, stale, age, job_of in selected[offset : offset + limit]:
        tick = r if r is not None and i is not None else None
        out.append(
            GpuOut(
                uuid=rec.uuid,
                node=rec.node,
                row=places.row.get(rec.node),
                rack=places.rack.get(rec.node),
                index=rec.index,
                name=rec.name,
                class_=cls,
                state="stale" if stale else "ok",
                pinned_w=over.pins.get(rec.uuid),
                drained=rec.node in over.drained,
                job=job_of,
                power_w=rec.power_w,
                cap_w=rec.cap_w,
                set_w=rec.set_w,
                cap_restores=rec.restores,
                target_w=None if tick is None else finite_or_none(float(tick.targets_w[i])),
                sent_w=None if tick is None else finite_or_none(float(tick.sent_w[i])),
                committed_w=None if tick is None else finite_or_none(float(tick.committed_w[i])),
                min_cap_w=rec.min_cap_w,
                max_cap_w=rec.max_cap_w,
                temp_c=rec.temp_c,
                util_pct=rec.util_pct,
                throttle=list(rec.throttle),
                age_s=age,
            )
        )
    return {"items": out, "total": len(selected), "limit": limit, "offset": offset}


@router.get(
    "/allocation",
    response_model=AllocationOut,
    responses={**AUTH_ERRORS, 404: error_doc("No tick yet")},
)
async def allocation(
    _: Viewer,
    controller: ControllerDep,
    node: NameQuery = None,
    limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
    offset: Offset = 0,
) -> AllocationOut:
    """The last tick's allocation: target, cap sent and committed cap of every GPU."""
    r = controller.last_tick
    if r is None:
        rejected(404, "no tick yet")
    idx = [i for i, n in enumerate(r.nodes) if node is None or n == node]
    caps = [
        GpuCap(
            uuid=r.uuids[i],
            node=r.nodes[i],
            class_=r.classes[i],
            target_w=float(r.targets_w[i]),
            sent_w=finite_or_none(float(r.sent_w[i])),
            committed_w=float(r.committed_w[i]),
        )
        for i in idx[offset : offset + limit]
    ]
    return AllocationOut(
        tick=r.tick,
        ts=r.ts,
        status=r.status,
        solver=r.solver,
        objective=finite_or_none(r.objective),
        solve_ms=r.solve_ms,
        caps=Page[GpuCap](items=caps, total=len(idx), limit=limit, offset=offset),
    )
