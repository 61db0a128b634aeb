"""What every write does after its endpoint has read the request: applied through the
controller's ledger (validated and applied on the loop, effective next tick, then made
durable and audited in worker threads: controller/admin.py), and answered with what
happened. A refusal is audited too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NoReturn

import structlog
from fastapi import HTTPException

from powerd.api.bodies import Problem, WriteOut, WriteRefused
from powerd.api.errors import rejected
from powerd.auth import Principal
from powerd.controller.admin import WriteFailed, WriteOutcome
from powerd.controller.controller import Controller
from powerd.controller.overrides import Conflict, NotFound, OverrideError

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class Attempt:
    """Who tries which write on what, and why: what a write's audit row and answer name."""

    controller: Controller
    principal: Principal
    action: str  # e.g. "budget.set"
    target: str  # the group, node or GPU; "api" for the policy
    reason: str


async def refuse(
    attempt: Attempt, status: int, detail: str, problems: Sequence[tuple[str, str]] = ()
) -> NoReturn:
    """Answer `status` and audit the refusal: who tried what is as telling as what was
    done. (Requests that fail authentication or schema validation are only logged.)"""
    a, p = attempt, attempt.principal
    log.info("admin_action_refused", actor=p.name, action=a.action, target=a.target, why=detail)
    audited = await a.controller.ledger.refused(
        a.action, a.target, detail, actor=p.name, role=p.role.label, reason=a.reason
    )
    body = WriteRefused(
        detail=detail,
        problems=[Problem(path=path, message=m) for path, m in problems],
        audited=audited,
    )
    raise HTTPException(status, body.model_dump())


def leader_only(controller: Controller) -> None:
    """A 409 on a standby: only the leader's writes are in force and stored (a standby
    follows them from the database). Not audited: the standby stores nothing."""
    if controller.leading():
        return
    lead = controller.leadership
    leader = lead.view().leader if lead is not None else None
    rejected(
        409,
        f"controller {controller.controller_id!r} stands by; send writes to the leader ({leader!r})"
        if leader
        else f"controller {controller.controller_id!r} stands by and no controller leads "
        "now; try again in a few seconds",
    )


def failed(exc: WriteFailed) -> NoReturn:
    """A 503: the state file could not be written, so the change was rolled back."""
    detail = f"not applied: {exc.outcome.detail}"
    body = WriteRefused(detail=detail, audited=exc.outcome.audited)
    raise HTTPException(503, body.model_dump())


def done(attempt: Attempt, outcome: WriteOutcome) -> WriteOut:
    return WriteOut(
        action=attempt.action,
        target=attempt.target,
        after_tick=attempt.controller.tick_no or None,
        applied=outcome.applied,
        durable=outcome.durable,
        audited=outcome.audited,
        detail=outcome.detail,
    )


async def write(
    attempt: Attempt,
    change: Callable[[], object],
    field: str | None = None,
    *,
    lowers_power: bool = False,
) -> WriteOut:
    """Apply one change through the controller, which validates it: what it does not know
    is a 404, what another override holds a 409, what it refuses a 422 (naming `field`),
    and each is audited. Then the
    ledger makes it durable; the answer says what happened (`WriteOut`)."""
    leader_only(attempt.controller)
    try:
        outcome = await attempt.controller.ledger.commit(change, lowers_power=lowers_power)
    except NotFound as exc:
        await refuse(attempt, 404, str(exc))
    except Conflict as exc:
        await refuse(attempt, 409, str(exc))
    except OverrideError as exc:
        problems = [(field, str(exc))] if field else []
        await refuse(attempt, 422, str(exc), problems)
    except WriteFailed as exc:
        failed(exc)
    return done(attempt, outcome)
