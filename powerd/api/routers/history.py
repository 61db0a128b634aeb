"""What happened: alarms active now (from memory), and recent ticks, events and the audit
log (from the store). Store reads are plain functions: FastAPI runs them in its thread pool,
where a slow database delays nobody else."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query

from powerd.api.deps import V1, ControllerDep, Limit, NameQuery, Offset, Viewer, store_or_503
from powerd.api.errors import AUTH_ERRORS, STORE_ERRORS
from powerd.api.models import AlarmOut, AuditOut, EventOut, Page, TickOut
from powerd.controller.engine import TickSummary
from powerd.numeric import finite_or_none
from powerd.store.models import Tick

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
