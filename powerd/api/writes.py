"""What every write does after its endpoint has read the request: applied through the
controller's ledger (validated and applied on the loop, effective next tick, then made
durable and audited in worker threads: controller/admin.py), and answered with what
happened. A refusal is audited too."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NoReturn

import structlog
from fastapi import HTTPException

from powerd.api.models import Problem, WriteOut, WriteRefused
from powerd.auth import Principal
from powerd.controller.admin import WriteFailed, WriteOutcome
from powerd.controller.controller import Controller
from powerd.controller.overrides import NotFound, OverrideError

log = structlog.get_logger(__name__)


async def refuse(
    controller: Controller,
    p: Principal,
    action: str,
    target: str,
    reason: str,
    status: int,
    detail: str,
    problems: Sequence[tuple[str, str]] = (),
) -> NoReturn:
    """Answer `status` and audit the refusal: who tried what is as telling as what was
    done. (Requests that fail authentication or schema validation are only logged.)"""
    log.info("admin_action_refused", actor=p.name, action=action, target=target, why=detail)
    audited = await controller.ledger.refused(p.name, p.role.label, action, target, reason, detail)
    body = WriteRefused(
        detail=detail,
        problems=[Problem(path=path, message=m) for path, m in problems],
        audited=audited,
    )
    raise HTTPException(status, body.model_dump())


def failed(exc: WriteFailed) -> NoReturn:
    """A 503: the state file could not be written, so the change was rolled back."""
    detail = f"not applied: {exc.outcome.detail}"
    body = WriteRefused(detail=detail, audited=exc.outcome.audited)
    raise HTTPException(503, body.model_dump())


def done(controller: Controller, action: str, target: str, outcome: WriteOutcome) -> WriteOut:
    return WriteOut(
        action=action,
        target=target,
        after_tick=controller.tick_no or None,
        applied=outcome.applied,
        durable=outcome.durable,
        audited=outcome.audited,
        detail=outcome.detail,
    )


async def write(
    controller: Controller,
    p: Principal,
    action: str,
    target: str,
    reason: str,
    change: Callable[[], object],
    field: str | None = None,
    *,
    lowers_power: bool = False,
) -> WriteOut:
    """Apply one change through the controller, which validates it: what it does not know
    is a 404, what it refuses a 422 (naming `field`), and either is audited. Then the
    ledger makes it durable; the answer says what happened (`WriteOut`)."""
    try:
        outcome = await controller.ledger.commit(change, lowers_power=lowers_power)
    except NotFound as exc:
        await refuse(controller, p, action, target, reason, 404, str(exc))
    except OverrideError as exc:
        problems = [(field, str(exc))] if field else []
        await refuse(controller, p, action, target, reason, 422, str(exc), problems)
    except WriteFailed as exc:
        failed(exc)
    return done(controller, action, target, outcome)
