"""What the routers' endpoints depend on, all read from `request.app.state` (set by
`create_app` and `create_coordinator_app`): the controller, its lookups, the coordinator,
the caller by role, and the query parameters several endpoints share."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated

import structlog
from fastapi import Depends, HTTPException, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from powerd.api.errors import rejected
from powerd.api.gate import authenticated
from powerd.api.views import Views
from powerd.auth import Principal, Role, TokenStore
from powerd.controller.controller import Controller
from powerd.coordinator.main import Coordinator
from powerd.store import Store

log = structlog.get_logger(__name__)

V1 = "/api/v1"


async def get_controller(request: Request) -> Controller:
    controller: Controller = request.app.state.controller
    return controller


async def get_views(request: Request) -> Views:
    views: Views = request.app.state.views
    return views


async def get_coordinator(request: Request) -> Coordinator:
    coordinator: Coordinator = request.app.state.coordinator
    return coordinator


# async: resolved on the loop, with no hop through the thread pool that sync ones take.
ControllerDep = Annotated[Controller, Depends(get_controller)]
ViewsDep = Annotated[Views, Depends(get_views)]
CoordinatorDep = Annotated[Coordinator, Depends(get_coordinator)]


def store_or_503(controller: Controller) -> Store:
    """The controller's store, or a 503 without one. Called in the handler, not declared as
    a dependency: dependencies run before the query is validated, and an invalid query is a
    422 whether or not there is a store."""
    if controller.store is None:
        rejected(503, "the controller runs without a store: no history, events or audit log")
    return controller.store


# ---- the caller: a bearer token of at least a role ----


@dataclass(frozen=True)
class BearerAuth:
    """How an API knows its callers: a bearer token from the token store in `app.state`, of
    at least the role an endpoint names (`auth.at_least(Role.OPERATOR)`), and what the API
    answers a caller it turns away. The controller's and the coordinator's APIs each have
    one; their words differ, and each keeps its own.

    The gate (powerd.api.gate) has authenticated the caller before the body was read and
    refused a missing or unknown token itself; the 401s here are for a path it leaves open.
    """

    scheme: HTTPBearer
    """The security scheme the OpenAPI document names."""
    missing: str
    """A 401's detail without a token."""
    unknown: str
    """A 401's detail for a token nobody holds."""
    challenge: bool
    """A 401 says `WWW-Authenticate: Bearer`."""
    names_caller: bool
    """A 403 says who the caller is, and its role."""

    def at_least(self, role: Role) -> Callable[..., Awaitable[Principal]]:
        """A dependency: the caller, if its token's role is `role` or above."""

        async def check(
            request: Request,
            # A default, not an annotation (FastAPI resolves those in the module's names):
            # the scheme is this API's.
            cred: HTTPAuthorizationCredentials | None = Depends(self.scheme),  # noqa: B008
        ) -> Principal:
            tokens: TokenStore = request.app.state.tokens
            principal = (
                None
                if cred is None
                else authenticated(request) or tokens.authenticate(cred.credentials)
            )
            if principal is None:
                if cred is not None:
                    log.warning("api_unauthorized", path=request.url.path)
                raise HTTPException(
                    401,
                    self.missing if cred is None else self.unknown,
                    headers={"WWW-Authenticate": "Bearer"} if self.challenge else None,
                )
            if principal.role < role:
                who = f"; '{principal.name}' is {principal.role.label}" if self.names_caller else ""
                raise HTTPException(403, f"the {role.label} role is required{who}")
            return principal

        return check


CONTROLLER_AUTH = BearerAuth(
    HTTPBearer(auto_error=False, description="A token from /etc/powerd/tokens.toml"),
    missing="missing bearer token",
    unknown="unknown or revoked token",
    challenge=True,
    names_caller=True,
)
Viewer = Annotated[Principal, Depends(CONTROLLER_AUTH.at_least(Role.VIEWER))]
Operator = Annotated[Principal, Depends(CONTROLLER_AUTH.at_least(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(CONTROLLER_AUTH.at_least(Role.ADMIN))]

# The coordinator's API (powerd.api.routers.coordinator) answers more tersely.
COORDINATOR_AUTH = BearerAuth(
    HTTPBearer(auto_error=False),
    missing="missing or unknown bearer token",
    unknown="missing or unknown bearer token",
    challenge=False,
    names_caller=False,
)
CoordinatorViewer = Annotated[Principal, Depends(COORDINATOR_AUTH.at_least(Role.VIEWER))]
CoordinatorOperator = Annotated[Principal, Depends(COORDINATOR_AUTH.at_least(Role.OPERATOR))]

# ---- query parameters several endpoints share ----

Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
ReasonQuery = Annotated[str, Query(min_length=1, max_length=500, pattern=r"\S")]
NameQuery = Annotated[str | None, Query(max_length=128)]
