"""What happened: alarms active now (from memory), and recent ticks, events and the audit
log (from the store). Store reads are plain functions: FastAPI runs them in its thread pool,
where a slow database delays nobody else."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

import numpy as np
from fastapi import APIRouter, Query

from powerd.api.bodies import (
    AlarmOut,
    AuditOut,
    EventOut,
    FacilityHistory,
    HistoryPoint,
    Page,
    TickOut,
)
from powerd.api.deps import V1, ControllerDep, Limit, NameQuery, Offset, Viewer, store_or_503
from powerd.api.errors import AUTH_ERRORS, STORE_ERRORS
from powerd.controller.report import TickSummary
from powerd.numeric import finite_or_none
from powerd.store.tables import Tick

router = APIRouter(prefix=V1)


@router.get("/alarms", response_model=list[AlarmOut], tags=["events"], responses=AUTH_ERRORS)
async def alarms(_: Viewer, controller: ControllerDep) -> list[AlarmOut]:
    """Alarms active now (raised and not cleared)."""
    return [AlarmOut(kind=k, message=m) for k, m in sorted(controller.alarms.items())]


def _tick_out(t: TickSummary | Tick) -> TickOut:
    # A stored tick has the attributes of the TickSummary it was made from (powerd.store
    # TickRecord), and TickOut the same names: one copy for both sources.
    values = {name: getattr(t, name) for name in TickOut.model_fields}
    return TickOut(**(values | {"budget_w": finite_or_none(t.budget_w)}))


@router.get("/ticks", response_model=list[TickOut], tags=["history"], responses=AUTH_ERRORS)
def ticks(
    _: Viewer,
    controller: ControllerDep,
    limit: Limit = 100,
    since: Annotated[float | None, Query(ge=0, le=1e11)] = None,
) -> list[TickOut]:
    """Recent ticks, newest first: from the store when there is one (it outlives
    restarts; writes lag a second or so), else from memory."""
    if controller.store is not None:
        return [_tick_out(t) for t in controller.store.recent_ticks(limit=limit, since=since)]
    history = list(controller.history)  # a copy: the loop appends meanwhile
    return [_tick_out(r) for r in reversed(history) if since is None or r.ts >= since][:limit]


def _finite(v: float) -> float | None:
    return float(v) if np.isfinite(v) else None


def bucketed(
    rows: Sequence[tuple[float, float, float, float]], since: float, step_s: float
) -> list[HistoryPoint]:
    """(ts, budget, committed, draw) rows, oldest first, in intervals of `step_s` from
    `since`: per interval the lowest budget, the highest committed sum, the mean and the
    highest draw; so a chart of a few hundred points still shows every peak and every cut."""
    if not rows:
        return []
    a = np.array(rows, dtype=np.float64)
    k = np.floor((a[:, 0] - since) / step_s).astype(np.int64)
    starts = np.flatnonzero(np.r_[True, k[1:] != k[:-1]])
    counts = np.diff(np.r_[starts, len(k)])
    with np.errstate(invalid="ignore"):  # NaN readings stay NaN and are shown as null
        ts = a[starts + counts - 1, 0]
        budget = np.minimum.reduceat(a[:, 1], starts)
        committed = np.maximum.reduceat(a[:, 2], starts)
        draw = np.add.reduceat(a[:, 3], starts) / counts
        draw_max = np.maximum.reduceat(a[:, 3], starts)
    return [
        HistoryPoint(
            ts=float(ts[j]),
            ticks=int(counts[j]),
            budget_w=_finite(budget[j]),
            committed_w=_finite(committed[j]),
            draw_w=_finite(draw[j]),
            draw_max_w=_finite(draw_max[j]),
        )
        for j in range(len(starts))
    ]


@router.get(
    "/history/facility", response_model=FacilityHistory, tags=["history"], responses=STORE_ERRORS
)
def facility_history(
    _: Viewer,
    controller: ControllerDep,
    window_s: Annotated[float, Query(ge=60, le=7 * 86400)] = 3600,
    points: Annotated[int, Query(ge=10, le=2000)] = 360,
) -> FacilityHistory:
    """The facility's draw against its budget over the last `window_s`, in `points`
    intervals (the live page's chart): from the store when there is one, else from the
    ticks this controller remembers."""
    until = controller.clock.wall()
    since = until - window_s
    step_s = window_s / points
    if controller.store is not None:
        rows = controller.store.tick_series(since)
        source: Literal["store", "memory"] = "store"
    else:
        history = list(controller.history)  # a copy: the loop appends meanwhile
        rows = [(t.ts, t.budget_w, t.committed_w, t.draw_w) for t in history if t.ts >= since]
        source = "memory"
    return FacilityHistory(
        source=source,
        since=since,
        until=until,
        step_s=step_s,
        points=bucketed(rows, since, step_s),
    )


@router.get("/events", response_model=Page[EventOut], tags=["events"], responses=STORE_ERRORS)
def events(
    _: Viewer,
    controller: ControllerDep,
    severity: Literal["info", "warning", "alarm"] | None = None,
    active: bool = False,
    kind: NameQuery = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """Events and alarms, newest first; `active`: alarms not cleared yet."""
    page = store_or_503(controller).events(
        severity=severity, active_only=active, kind=kind, limit=limit, offset=offset
    )
    items = [
        EventOut(
            id=e.id,
            ts=e.ts,
            kind=e.kind,
            severity=e.severity,
            message=e.message,
            data=e.data,
            cleared_at=e.cleared_at,
        )
        for e in page.items
    ]
    return {"items": items, "total": page.total, "limit": limit, "offset": offset}


@router.get("/audit", response_model=Page[AuditOut], tags=["events"], responses=STORE_ERRORS)
def audit(
    _: Viewer,
    controller: ControllerDep,
    actor: NameQuery = None,
    action: Annotated[str | None, Query(max_length=64)] = None,
    limit: Limit = 100,
    offset: Offset = 0,
) -> dict[str, Any]:
    """The audit log of admin actions, newest first."""
    page = store_or_503(controller).audit_log(
        actor=actor, action=action, limit=limit, offset=offset
    )
    items = [
        AuditOut(
            id=a.id,
            ts=a.ts,
            actor=a.actor,
            role=a.role,
            action=a.action,
            target=a.target,
            reason=a.reason,
            payload=a.payload,
            result=a.result,
        )
        for a in page.items
    ]
    return {"items": items, "total": page.total, "limit": limit, "offset": offset}
