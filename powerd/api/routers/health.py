"""Liveness and readiness: open, for load balancers and systemd-style probes."""

from __future__ import annotations

from fastapi import APIRouter, Response

from powerd.api.bodies import Liveness, Readiness
from powerd.api.deps import ControllerDep

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Liveness)
async def healthz() -> Liveness:
    """Liveness: the process and its event loop answer."""
    return Liveness()


@router.get(
    "/readyz",
    response_model=Readiness,
    responses={503: {"model": Readiness, "description": "Not ready"}},
)
async def readyz(response: Response, controller: ControllerDep) -> Readiness:
    """Readiness: broker connected, store reachable (if any), a recent tick."""
    h = controller.health()
    # The writer reports "connected" only after its first flush; until a write fails,
    # the store counts as reachable (last_error is kept until a write succeeds again).
    store_ok = None if h.store is None else h.store.last_error is None
    ready = h.ready and store_ok is not False
    if not ready:
        response.status_code = 503
    return Readiness(
        ready=ready,
        broker_connected=h.broker_connected,
        store_connected=store_ok,
        store_backlog=None if h.store is None else h.store.backlog,
        store_error=None if h.store is None else h.store.last_error,
        last_tick_age_s=h.last_tick_age_s,
    )
