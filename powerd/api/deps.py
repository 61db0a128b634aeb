"""What the routers' endpoints depend on, all read from `request.app.state` (set by
`create_app`): the controller, its lookups, the caller by role, and the query parameters
several endpoints share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Annotated

import structlog
from fastapi import Depends, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from powerd.api.errors import rejected
from powerd.api.gate import authenticated
from powerd.api.views import Views
from powerd.auth import Principal, Role, TokenStore
from powerd.controller.controller import Controller
from powerd.store import Store

log = structlog.get_logger(__name__)

V1 = "/api/v1"


async def get_controller(request: Request) -> Controller:
    controller: Controller = request.app.state.controller
    return controller


async def get_views(request: Request) -> Views:
    views: Views = request.app.state.views
    return views


# async: resolved on the loop, with no hop through the thread pool that sync ones take.
ControllerDep = Annotated[Controller, Depends(get_controller)]
ViewsDep = Annotated[Views, Depends(get_views)]


def store_or_503(controller: Controller) -> Store:
    """The controller's store, or a 503 without one. Called in the handler, not declared as
    a dependency: dependencies run before the query is validated, and an invalid query is a
    422 whether or not there is a store."""
    if controller.store is None:
        rejected(503, "the controller runs without a store: no history, events or audit log")
    return controller.store


# ---- the caller: a bearer token of at least a role ----

_bearer = HTTPBearer(auto_error=False, description="A token from /etc/powerd/tokens.toml")


def _require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def check(
        request: Request,
        cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        if cred is None:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        tokens: TokenStore = request.app.state.tokens
        # The gate authenticated the caller before the body was read (powerd.api.gate);
        # on a path it leaves open, the token is checked here.
        principal = authenticated(request) or tokens.authenticate(cred.credentials)
        if principal is None:
            log.warning("api_unauthorized", path=request.url.path)
            raise HTTPException(
                401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"}
            )
        if principal.role < role:
            raise HTTPException(
                403,
                f"the {role.label} role is required; '{principal.name}' is {principal.role.label}",
            )
        return principal

    return check


Viewer = Annotated[Principal, Depends(_require(Role.VIEWER))]
Operator = Annotated[Principal, Depends(_require(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(_require(Role.ADMIN))]

# ---- query parameters several endpoints share ----

Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
ReasonQuery = Annotated[str, Query(min_length=1, max_length=500, pattern=r"\S")]
NameQuery = Annotated[str | None, Query(max_length=128)]
