"""Operators' overrides of the policy: temporary and scheduled budgets, class assignments,
pins, drains and hand-overs, and the read of those in force.

Each write is a plain endpoint, like every other in the API: its path, body and role read
off its signature, its controller call type-checked. They were once rows of a table that
generated the endpoints; that saved about three lines an endpoint, and cost a synthesized
signature, bodies typed `Any` and a second way to read an endpoint. What every write does
once its request is read (the ledger, audited refusals, the answer) is powerd.api.writes.
"""

from __future__ import annotations

import math
import uuid
from functools import partial
from typing import Any, TypedDict

from fastapi import APIRouter

from powerd.api.bodies import (
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
from powerd.api.deps import V1, Admin, ControllerDep, Operator, ReasonQuery, Viewer
from powerd.api.errors import AUTH_ERRORS, WRITE_ERRORS
from powerd.api.writes import Attempt, write
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

# What every write answers, and the errors it documents.
_WRITE_ROUTE: dict[str, Any] = {"response_model": WriteOut, "responses": WRITE_ERRORS}


class Who(TypedDict):
    """Who asks and why: the controller's keyword arguments for the audit row."""

    actor: str
    reason: str
    role: str


def _who(attempt: Attempt) -> Who:
    p = attempt.principal
    return Who(actor=p.name, reason=attempt.reason, role=p.role.label)


@router.put("/budgets/{group}", **_WRITE_ROUTE)
async def set_budget(
    group: str, body: BudgetIn, p: Operator, controller: ControllerDep
) -> WriteOut:
    """Lower a group's budget for a while (a grid demand-response event). A temporary
    budget can only lower: the policy's budget is the breaker or contract rating."""
    attempt = Attempt(controller, p, "budget.set", group, body.reason)
    # A ttl counts from the request, not from when the ledger gets to the change.
    expires_at = body.expires_at if body.ttl_s is None else controller.clock.wall() + body.ttl_s
    change = partial(
        controller.set_budget, group, body.budget_w, expires_at=expires_at, **_who(attempt)
    )
    # Applied even when the state file fails, if it lowers what is in force now.
    lowers = body.budget_w <= controller.budget_in_force_w(group)
    return await write(attempt, change, "budget_w", lowers_power=lowers)


@router.delete("/budgets/{group}", **_WRITE_ROUTE)
async def clear_budget(
    group: str, reason: ReasonQuery, p: Operator, controller: ControllerDep
) -> WriteOut:
    """End a temporary budget now (the policy's applies from the next tick)."""
    attempt = Attempt(controller, p, "budget.clear", group, reason)
    return await write(attempt, partial(controller.clear_budget, group, **_who(attempt)))


@router.post("/budgets/{group}/schedule", **_WRITE_ROUTE)
async def schedule_budget(
    group: str, body: ScheduleIn, p: Operator, controller: ControllerDep
) -> WriteOut:
    """Lower a group's budget over a future window (a grid operator's load target).
    The budget in force ramps down early enough to reach it by `start` and back up from
    `end`, no faster than the policy's `control.ramp_w_per_s`. The answer's `target` is
    the schedule's id, to cancel it. A refusal's `detail` says which field is wrong."""
    schedule_id = "s-" + uuid.uuid4().hex[:12]
    attempt = Attempt(controller, p, "budget.schedule", schedule_id, body.reason)
    change = partial(
        controller.schedule_budget,
        schedule_id,
        group,
        body.budget_w,
        start=body.start,
        end=body.end,
        **_who(attempt),
    )
    return await write(attempt, change)


@router.delete(
    "/schedules/{schedule_id}",
    # One line in the API's document, longer than a docstring's line may be.
    description="Cancel a scheduled budget (its window, or the rest of it): the budget in "
    "force ramps back up.",
    **_WRITE_ROUTE,
)
async def cancel_schedule(
    schedule_id: str, reason: ReasonQuery, p: Operator, controller: ControllerDep
) -> WriteOut:
    attempt = Attempt(controller, p, "budget.unschedule", schedule_id, reason)
    return await write(attempt, partial(controller.cancel_schedule, schedule_id, **_who(attempt)))


@router.post("/classes/assign", **_WRITE_ROUTE)
async def assign_class(body: ClassAssignIn, p: Operator, controller: ControllerDep) -> WriteOut:
    """Steer GPUs or whole nodes as a workload class (a scheduler's job prolog)."""
    listed = ",".join(body.uuids + body.nodes)
    attempt = Attempt(controller, p, "class.assign", listed, body.reason)
    change = partial(
        controller.assign_class, body.class_, uuids=body.uuids, nodes=body.nodes, **_who(attempt)
    )
    return await write(attempt, change)


@router.post("/classes/clear", **_WRITE_ROUTE)
async def clear_class(body: ClassClearIn, p: Operator, controller: ControllerDep) -> WriteOut:
    """Drop class assignments (the job epilog): the workload's own report applies again."""
    listed = ",".join(body.uuids + body.nodes)
    attempt = Attempt(controller, p, "class.clear", listed, body.reason)
    change = partial(controller.clear_class, uuids=body.uuids, nodes=body.nodes, **_who(attempt))
    return await write(attempt, change)


@router.put("/gpus/{uuid}/pin", **_WRITE_ROUTE)
async def pin(uuid: str, body: PinIn, p: Operator, controller: ControllerDep) -> WriteOut:
    """Hold one GPU at a fixed cap (within its limits) until unpinned."""
    attempt = Attempt(controller, p, "gpu.pin", uuid, body.reason)
    return await write(attempt, partial(controller.pin, uuid, body.watts, **_who(attempt)), "watts")


@router.delete("/gpus/{uuid}/pin", **_WRITE_ROUTE)
async def unpin(uuid: str, reason: ReasonQuery, p: Operator, controller: ControllerDep) -> WriteOut:
    attempt = Attempt(controller, p, "gpu.unpin", uuid, reason)
    return await write(attempt, partial(controller.unpin, uuid, **_who(attempt)))


@router.put("/nodes/{node}/drain", **_WRITE_ROUTE)
async def drain(node: str, body: ReasonIn, p: Operator, controller: ControllerDep) -> WriteOut:
    """Hold every GPU of a node at its minimum (maintenance, a suspect PSU)."""
    attempt = Attempt(controller, p, "node.drain", node, body.reason)
    change = partial(controller.drain, node, **_who(attempt))
    return await write(attempt, change, lowers_power=True)


@router.put("/handover", **_WRITE_ROUTE)
async def hand_over(body: HandoverIn, p: Admin, controller: ControllerDep) -> WriteOut:
    """Hand this controller's nodes to other authorities of the site (a row
    re-scoped into racks, a move to a new database): every command names them, so each
    agent obeys their first command at once, without a failsafe gap; meanwhile every
    GPU counts at its maximum here (this controller only holds or cuts). Stop this
    controller once the nodes obey the successors (`foreign_authority` lists them)."""
    successors = ",".join(f"{a.store}/{a.domain}" for a in body.to)
    attempt = Attempt(controller, p, "authority.handover", successors, body.reason)
    return await write(attempt, partial(controller.hand_over, body.to, **_who(attempt)), "to")


@router.delete("/handover", **_WRITE_ROUTE)
async def cancel_handover(reason: ReasonQuery, p: Admin, controller: ControllerDep) -> WriteOut:
    """Stop naming successors (nodes that already obey one stay with it)."""
    attempt = Attempt(controller, p, "authority.handover_cancel", "", reason)
    return await write(attempt, partial(controller.cancel_handover, **_who(attempt)))


@router.delete("/nodes/{node}/drain", **_WRITE_ROUTE)
async def undrain(
    node: str, reason: ReasonQuery, p: Operator, controller: ControllerDep
) -> WriteOut:
    attempt = Attempt(controller, p, "node.undrain", node, reason)
    return await write(attempt, partial(controller.undrain, node, **_who(attempt)))
