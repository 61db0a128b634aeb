"""The coordinator's API (`powerd coordinator --api-port`): its probes and metrics, the split
between the scopes, and temporary budgets on the groups above them. One router;
`powerd.api.app.create_coordinator_app` includes it.

Its document is older than the controller's conventions and kept as it is: no tags, no
response models, FastAPI's own 422 body, and terser refusals (`COORDINATOR_AUTH`).
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from dataclasses import asdict
from functools import partial

import structlog
from fastapi import APIRouter, HTTPException, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, Field

from powerd.api.deps import CoordinatorDep, CoordinatorOperator, CoordinatorViewer
from powerd.controller.overrides import NotFound, OverrideError
from powerd.coordinator.main import Coordinator
from powerd.coordinator.split import ScopeBudgetPlan

log = structlog.get_logger(__name__)

router = APIRouter()


# A temporary budget on a group above the scopes. Not powerd.api.bodies.BudgetIn, though
# both documents name it so (no docstring: it would become the schema's description). This
# one takes no `expires_at`, ignores unknown fields, bounds neither the watts above nor a
# blank reason, and refuses an infinite `ttl_s` as too long rather than as not finite; a
# subclass of either would reorder the other's fields. Making them one model changes this
# API's document (pinned: tests/test_api_openapi.py).
class BudgetIn(BaseModel):
    budget_w: float = Field(gt=0, allow_inf_nan=False)
    ttl_s: float | None = Field(default=None, gt=0, le=30 * 86400)
    reason: str = Field(min_length=1, max_length=500)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/metrics")
async def metrics(request: Request, _: CoordinatorViewer) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/readyz")
async def readyz(response: Response, coord: CoordinatorDep) -> dict[str, bool]:
    ready = coord.leadership.may_command() and coord.last is not None
    if not ready:
        response.status_code = 503
    return {"ready": ready}


@router.get("/api/v1/scopes")
async def scopes(_: CoordinatorViewer, coord: CoordinatorDep) -> dict[str, object]:
    """The split: each scope's budget, target, what it may draw, who leads it."""
    r = coord.last
    v = coord.leadership.view()
    return {
        "leadership": {
            "role": v.role,
            "leader": v.leader,
            "epoch": v.epoch,
            "members": [m.holder for m in v.members],
        },
        "tick": None if r is None else r.tick,
        "solve_ms": None if r is None else r.solve_ms,
        "exact": None if r is None else r.exact,
        "groups": []
        if r is None
        else [
            {"name": n, "budget_w": b if math.isfinite(b) else None, "committed_w": c}
            for n, b, c in zip(r.group_names, r.group_budget_w, r.group_committed_w, strict=True)
        ],
        "scopes": [] if r is None else [_scope_row(coord, p) for p in r.budgets],
        "waiting": [] if r is None else list(r.waiting),
        "overlapping_scopes": [
            {"scope": s, "controller": c} for s, c in sorted(coord.overlapping.items())
        ],
    }


def _scope_row(coord: Coordinator, plan: ScopeBudgetPlan) -> dict[str, object]:
    """A scope's budget this tick, and who leads it (from its latest report)."""
    state = coord.splitter.scopes[plan.scope]
    r = state.report
    return asdict(plan) | {
        "leader": None if r is None else r.controller_id,
        "leader_epoch": None if r is None else r.epoch,
        "enforced_w": None if r is None else r.budget_w,
        "reported_committed_w": None if r is None else r.committed_w,
        "failsafe_w": state.failsafe_w,
    }


@router.put("/api/v1/budgets/{group}")
async def put_budget(
    group: str, body: BudgetIn, p: CoordinatorOperator, coord: CoordinatorDep
) -> dict[str, object]:
    """A temporary budget on a group above the scopes (only lowers; `ttl_s`: expiry)."""
    change = partial(coord.set_budget, group, body.budget_w, body.ttl_s, p.name, body.reason)
    return await _write(coord, change, p.name, "budget.set", group, body.reason)


@router.delete("/api/v1/budgets/{group}")
async def delete_budget(
    group: str, reason: str, p: CoordinatorOperator, coord: CoordinatorDep
) -> dict[str, object]:
    """End a temporary budget."""
    return await _write(
        coord, partial(coord.clear_budget, group), p.name, "budget.clear", group, reason
    )


async def _write(
    coord: Coordinator,
    change: Callable[[], Awaitable[bool]],
    actor: str,
    action: str,
    target: str,
    reason: str,
) -> dict[str, object]:
    """A write on the leader only (409 on a standby), in its state file before the answer."""
    if not coord.leadership.may_command():
        raise HTTPException(409, f"standing by; the leader is {coord.leadership.view().leader!r}")
    try:
        stored = await change()
    except NotFound as exc:
        raise HTTPException(404, str(exc)) from None
    except OverrideError as exc:
        raise HTTPException(422, str(exc)) from None
    log.info("admin_action", actor=actor, action=action, target=target, reason=reason)
    # durable: in the state file; shared: in the database, where a standby finds it.
    return {
        "applied": True,
        "durable": True,
        "shared": stored,
        "after_tick": coord.splitter.tick_no,
    }
