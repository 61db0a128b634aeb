"""The policy in force: read it (viewer), replace it (admin)."""

from __future__ import annotations

import structlog
from fastapi import APIRouter, Request
from sqlalchemy.exc import SQLAlchemyError

from powerd.api.bodies import PolicyOut, PolicyReplaced
from powerd.api.deps import V1, Admin, ControllerDep, ReasonQuery, Viewer
from powerd.api.errors import AUTH_ERRORS, WRITE_ERRORS
from powerd.api.writes import Attempt, done, failed, leader_only, refuse
from powerd.controller.admin import WriteFailed
from powerd.input_errors import InputError

log = structlog.get_logger(__name__)

# The gate (powerd.api.gate) holds the body to this before the endpoint reads it.
MAX_POLICY_BYTES = 4 * 1024 * 1024

router = APIRouter(prefix=V1, tags=["policy"])


@router.get("/policy", response_model=PolicyOut, responses=AUTH_ERRORS)
def policy(_: Viewer, controller: ControllerDep) -> PolicyOut:
    """The policy in force, with its text when the store keeps it (or when the API
    replaced it and the database is down)."""
    active = None
    if controller.store is not None and controller.policy_version is not None:
        try:
            active = controller.store.active_policy()
        except SQLAlchemyError as exc:
            log.warning("api_store_unreachable", path="policy", error=type(exc).__name__)
    api = controller.ledger.api_policy
    if active is None and api is not None and controller.policy.source == "api":
        return PolicyOut(
            version=controller.policy_version,
            source="api",
            sha256=api.sha256,
            activated_at=api.ts,
            yaml=api.text,
        )
    return PolicyOut(
        version=controller.policy_version,
        source=controller.policy.source,
        sha256=None if active is None else active.sha256,
        activated_at=None if active is None else active.ts,
        yaml=None if active is None else active.yaml_text,
    )


@router.put(
    "/policy",
    response_model=PolicyReplaced,
    responses=WRITE_ERRORS,
    openapi_extra={
        "requestBody": {
            "required": True,
            "description": "The whole policy file (docs/policy.md).",
            "content": {"application/yaml": {"schema": {"type": "string"}}},
        }
    },
)
async def replace_policy(
    request: Request, reason: ReasonQuery, p: Admin, controller: ControllerDep
) -> PolicyReplaced:
    """Replace the policy. It is validated first: a bad one is refused with the same
    problems as `powerd policy check`, and the running policy stays."""
    attempt = Attempt(controller, p, "policy.replace", "api", reason)
    leader_only(controller)
    raw = await request.body()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        why = "the policy is not UTF-8 text"
        await refuse(attempt, 422, why, [("", why)])
    try:
        outcome = await controller.ledger.replace_policy(
            text, actor=p.name, reason=reason, role=p.role.label
        )
    except InputError as exc:
        why = str(exc).splitlines()[0]
        await refuse(attempt, 422, why, exc.problems)
    except WriteFailed as exc:
        failed(exc)
    return PolicyReplaced(
        **done(attempt, outcome).model_dump(),
        version=outcome.policy_version,
    )
