"""Operators' overrides of the policy: temporary budgets, class assignments, pins and
drains, and the read of those in force.

The eight writes are rows of one table, `OVERRIDE_WRITES`; `add_override_routes` makes each
row an endpoint. A row says what the endpoint reads (its path's one parameter, then a JSON
body or a `reason` query parameter) and what it does with it (the controller call); what
every write does after that (the ledger, refusals, the answer) is powerd.api.writes.
"""

from __future__ import annotations

import inspect
import math
import re
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypedDict

from fastapi import APIRouter
from pydantic import BaseModel

from powerd.api.deps import V1, Admin, ControllerDep, Operator, ReasonQuery, Viewer
from powerd.api.errors import AUTH_ERRORS, WRITE_ERRORS
from powerd.api.models import (
    BudgetIn,
    BudgetOut,
    ClassAssignIn,
    ClassClearIn,
    HandoverIn,
    OverridesOut,
    PinIn,
    ReasonIn,
    ScheduleIn,
    ScheduleOut,
    WriteOut,
)
from powerd.api.writes import Attempt, write
from powerd.auth import Principal
from powerd.controller.controller import Controller
from powerd.numeric import finite_or_none
from powerd.ramp import lead_s, ramp_down_from

router = APIRouter(prefix=V1, tags=["overrides"])


@router.get("/overrides", response_model=OverridesOut, responses=AUTH_ERRORS)
async def overrides(_: Viewer, controller: ControllerDep) -> OverridesOut:
    """Temporary budgets, pins, drained nodes and class assignments in force."""
    o = controller.overrides
    policy_budgets = {g.name: g.budget_w for g in controller.policy.groups}
    return OverridesOut(
        budgets=[
            BudgetOut(
                group=b.group,
                budget_w=b.budget_w,
                policy_budget_w=finite_or_none(policy_budgets.get(b.group, math.inf)),
                expires_at=b.expires_at,
                reason=b.reason,
                actor=b.actor,
                created_at=b.created_at,
            )
            for b in o.budgets.values()
        ],
        schedules=_schedules(controller),
        pins_w=dict(o.pins),
        drained=sorted(o.drained),
        gpu_classes=dict(o.gpu_classes),
        node_classes=dict(o.node_classes),
        handover=list(o.handover),
    )


@router.get("/schedules", response_model=list[ScheduleOut], responses=AUTH_ERRORS)
async def schedules(_: Viewer, controller: ControllerDep) -> list[ScheduleOut]:
    """Scheduled budgets, by start: pending, ramping toward their target, active, or ended
    and ramping back up."""
    return _schedules(controller)


def _schedules(controller: Controller) -> list[ScheduleOut]:
    policy = controller.policy
    policy_budgets = {g.name: g.budget_w for g in policy.groups}
    rates, lead = policy.control.ramp_w_per_s, lead_s(policy.control.tick_s)
    wall = controller.clock.wall()
    out = []
    for e in sorted(controller.overrides.schedules.values(), key=lambda e: (e.start, e.id)):
        in_force = controller.budget_in_force_w(e.group)
        ramp_from = ramp_down_from(
            min(in_force, policy_budgets.get(e.group, math.inf)), e.budget_w, e.start, rates, lead
        )
        state = (
            "ended"
            if e.end is not None and wall >= e.end
            else "active"
            if wall >= e.start
            else "ramping"
            if wall >= ramp_from
            else "pending"
        )
        out.append(
            ScheduleOut(
                id=e.id,
                group=e.group,
                budget_w=e.budget_w,
                policy_budget_w=finite_or_none(policy_budgets.get(e.group, math.inf)),
                start=e.start,
                end=e.end,
                ramp_from=ramp_from,
                state=state,
                reason=e.reason,
                actor=e.actor,
                created_at=e.created_at,
            )
        )
    return out


# ---- the writes ----


class Who(TypedDict):
    """Who asks and why: the controller's keyword arguments for the audit row."""

    actor: str
    reason: str
    role: str


@dataclass(frozen=True)
class WriteRequest:
    """One override write as its endpoint received it."""

    key: str
    """The path's parameter ({group}, {uuid} or {node}); "" when the path has none."""
    body: Any
    """The row's body model, validated; None when the reason is a query parameter."""
    who: Who
    token: str = field(default_factory=lambda: "s-" + uuid.uuid4().hex[:12])
    """A fresh id for what this request creates (a scheduled budget's)."""


Change = Callable[[], object]


@dataclass(frozen=True)
class OverrideWrite:
    """One row of the table: an endpoint that changes an override."""

    name: str
    """The endpoint's name, from which FastAPI derives its operationId and summary."""
    method: Literal["PUT", "POST", "DELETE"]
    path: str
    """Under /api/v1; at most one {parameter}, which becomes `WriteRequest.key`."""
    body: type[BaseModel] | None
    """The JSON body, which carries the reason; None: `reason` is a query parameter."""
    action: str
    """The audit log's name for it."""
    target: Callable[[WriteRequest], str]
    """What the audit log and the answer name as changed."""
    change: Callable[[Controller, WriteRequest], Change]
    """The controller call, bound when the request comes; the ledger runs it."""
    doc: str | None = None
    """The endpoint's description in the OpenAPI document."""
    field: str | None = None
    """The body field a refused value (422) is blamed on."""
    lowers_power: bool | Callable[[Controller, WriteRequest], bool] = False
    """Applied even when the state file cannot be written (safety wins the tie)."""
    admin: bool = False
    """Only an admin token may (an operator's otherwise)."""


def _key(w: WriteRequest) -> str:
    return w.key


def _listed(w: WriteRequest) -> str:
    return ",".join(w.body.uuids + w.body.nodes)


def _set_budget(c: Controller, w: WriteRequest) -> Change:
    body: BudgetIn = w.body
    # A ttl counts from the request, not from when the ledger gets to the change.
    expires_at = body.expires_at if body.ttl_s is None else c.clock.wall() + body.ttl_s
    return partial(c.set_budget, w.key, body.budget_w, expires_at=expires_at, **w.who)


def _schedule(c: Controller, w: WriteRequest) -> Change:
    body: ScheduleIn = w.body
    return partial(
        c.schedule_budget, w.token, w.key, body.budget_w, start=body.start, end=body.end, **w.who
    )


def _token(w: WriteRequest) -> str:
    return w.token


def _lowers_budget(c: Controller, w: WriteRequest) -> bool:
    # Applied even when the state file fails, if it lowers what is in force now.
    return bool(w.body.budget_w <= c.budget_in_force_w(w.key))


OVERRIDE_WRITES: tuple[OverrideWrite, ...] = (
    OverrideWrite(
        "set_budget",
        "PUT",
        "/budgets/{group}",
        body=BudgetIn,
        action="budget.set",
        target=_key,
        change=_set_budget,
        doc="""Lower a group's budget for a while (a grid demand-response event). A temporary
        budget can only lower: the policy's budget is the breaker or contract rating.""",
        field="budget_w",
        lowers_power=_lowers_budget,
    ),
    OverrideWrite(
        "clear_budget",
        "DELETE",
        "/budgets/{group}",
        body=None,
        action="budget.clear",
        target=_key,
        change=lambda c, w: partial(c.clear_budget, w.key, **w.who),
        doc="End a temporary budget now (the policy's applies from the next tick).",
    ),
    OverrideWrite(
        "schedule_budget",
        "POST",
        "/budgets/{group}/schedule",
        body=ScheduleIn,
        action="budget.schedule",
        target=_token,
        change=_schedule,
        doc="""Lower a group's budget over a future window (a grid operator's load target).
        The budget in force ramps down early enough to reach it by `start` and back up from
        `end`, no faster than the policy's `control.ramp_w_per_s`. The answer's `target` is
        the schedule's id, to cancel it. A refusal's `detail` says which field is wrong.""",
    ),
    OverrideWrite(
        "cancel_schedule",
        "DELETE",
        "/schedules/{schedule_id}",
        body=None,
        action="budget.unschedule",
        target=_key,
        change=lambda c, w: partial(c.cancel_schedule, w.key, **w.who),
        doc="Cancel a scheduled budget (its window, or the rest of it): the budget in force "
        "ramps back up.",
    ),
    OverrideWrite(
        "assign_class",
        "POST",
        "/classes/assign",
        body=ClassAssignIn,
        action="class.assign",
        target=_listed,
        change=lambda c, w: partial(
            c.assign_class, w.body.class_, uuids=w.body.uuids, nodes=w.body.nodes, **w.who
        ),
        doc="Steer GPUs or whole nodes as a workload class (a scheduler's job prolog).",
    ),
    OverrideWrite(
        "clear_class",
        "POST",
        "/classes/clear",
        body=ClassClearIn,
        action="class.clear",
        target=_listed,
        change=lambda c, w: partial(c.clear_class, uuids=w.body.uuids, nodes=w.body.nodes, **w.who),
        doc="Drop class assignments (the job epilog): the workload's own report applies again.",
    ),
    OverrideWrite(
        "pin",
        "PUT",
        "/gpus/{uuid}/pin",
        body=PinIn,
        action="gpu.pin",
        target=_key,
        change=lambda c, w: partial(c.pin, w.key, w.body.watts, **w.who),
        doc="Hold one GPU at a fixed cap (within its limits) until unpinned.",
        field="watts",
    ),
    OverrideWrite(
        "unpin",
        "DELETE",
        "/gpus/{uuid}/pin",
        body=None,
        action="gpu.unpin",
        target=_key,
        change=lambda c, w: partial(c.unpin, w.key, **w.who),
    ),
    OverrideWrite(
        "drain",
        "PUT",
        "/nodes/{node}/drain",
        body=ReasonIn,
        action="node.drain",
        target=_key,
        change=lambda c, w: partial(c.drain, w.key, **w.who),
        doc="Hold every GPU of a node at its minimum (maintenance, a suspect PSU).",
        lowers_power=True,
    ),
    OverrideWrite(
        "hand_over",
        "PUT",
        "/handover",
        body=HandoverIn,
        action="authority.handover",
        target=lambda w: ",".join(f"{a.store}/{a.domain}" for a in w.body.to),
        change=lambda c, w: partial(c.hand_over, w.body.to, **w.who),
        doc="""Hand this controller's nodes to other authorities of the site (a row
        re-scoped into racks, a move to a new database): every command names them, so each
        agent obeys their first command at once, without a failsafe gap; meanwhile every
        GPU counts at its maximum here (this controller only holds or cuts). Stop this
        controller once the nodes obey the successors (`foreign_authority` lists them).""",
        field="to",
        admin=True,
    ),
    OverrideWrite(
        "cancel_handover",
        "DELETE",
        "/handover",
        body=None,
        action="authority.handover_cancel",
        target=lambda w: "",
        change=lambda c, w: partial(c.cancel_handover, **w.who),
        doc="Stop naming successors (nodes that already obey one stay with it).",
        admin=True,
    ),
    OverrideWrite(
        "undrain",
        "DELETE",
        "/nodes/{node}/drain",
        body=None,
        action="node.undrain",
        target=_key,
        change=lambda c, w: partial(c.undrain, w.key, **w.who),
    ),
)


def _endpoint(row: OverrideWrite) -> Callable[..., Awaitable[WriteOut]]:
    """The endpoint of one row, with the signature FastAPI reads its inputs from."""
    keys = re.findall(r"{(\w+)}", row.path)
    if len(keys) > 1:
        raise ValueError(f"{row.path}: an override write takes at most one path parameter")
    key = keys[0] if keys else None

    async def endpoint(controller: Controller, p: Principal, **inputs: Any) -> WriteOut:
        body = inputs.get("body")
        reason: str = inputs["reason"] if body is None else body.reason
        w = WriteRequest(
            key=inputs[key] if key else "",
            body=body,
            who=Who(actor=p.name, reason=reason, role=p.role.label),
        )
        return await write(
            Attempt(controller, p, row.action, row.target(w), reason),
            row.change(controller, w),
            row.field,
            lowers_power=row.lowers_power(controller, w)
            if callable(row.lowers_power)
            else row.lowers_power,
        )

    param = partial(inspect.Parameter, kind=inspect.Parameter.KEYWORD_ONLY)
    inputs = [param(key, annotation=str)] if key else []
    inputs.append(
        param("reason", annotation=ReasonQuery)
        if row.body is None
        else param("body", annotation=row.body)
    )
    # FastAPI reads the inputs from the signature (inspect.signature honours __signature__).
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            *inputs,
            param("p", annotation=Admin if row.admin else Operator),
            param("controller", annotation=ControllerDep),
        ],
        return_annotation=WriteOut,
    )
    endpoint.__name__ = endpoint.__qualname__ = row.name
    endpoint.__doc__ = row.doc
    return endpoint


def add_override_routes(router: APIRouter, rows: tuple[OverrideWrite, ...]) -> None:
    for row in rows:
        router.add_api_route(
            row.path,
            _endpoint(row),
            methods=[row.method],
            name=row.name,
            response_model=WriteOut,
            responses=WRITE_ERRORS,
        )


add_override_routes(router, OVERRIDE_WRITES)
