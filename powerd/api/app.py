"""The admin API: FastAPI app served from the controller's own event loop.

Handlers that read or change the controller's memory are `async` and run on that loop, so
they never interleave with a tick half-way (a tick is synchronous from snapshot to plan).
Handlers that only read the database are plain functions: FastAPI runs them in its thread
pool, where a slow database delays nobody else. `/metrics` renders in that pool too.

The endpoints live in `powerd.api.routers`, one module per resource; what they depend on
(the controller, the caller's role) in `powerd.api.deps`, read from `app.state`.

The coordinator's API (`create_coordinator_app`) is built the same way, from its own router
(`powerd.api.routers.coordinator`), behind the same gate.
"""

from __future__ import annotations

from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from powerd import __version__
from powerd.api.errors import install_error_handlers
from powerd.api.gate import KIB, MIB, BodyLimits, BodyRule, RequestGate, open_paths
from powerd.api.routers import (
    classes,
    coordinator,
    fleet,
    health,
    history,
    jobs,
    metrics,
    overrides,
    policy,
    ui,
    why,
)
from powerd.api.views import Views
from powerd.auth import TokenStore
from powerd.controller.controller import Controller
from powerd.coordinator.main import Coordinator

# What a request may send, by endpoint class (docs/api.md, "Request bodies"). Lists of GPUs
# and nodes: the largest valid job (16,384 uuids and 2,048 nodes) or class assignment
# (10,000 of each) with 128-character names is 2.6 MB of JSON. Every other write is a few
# numbers and a reason of at most 500 characters; reads send nothing.
POLICY_BODY_BYTES = policy.MAX_POLICY_BYTES
LIST_BODY_BYTES = 3 * MIB
BODY_LIMITS = BodyLimits(
    rules=(
        BodyRule("PUT", "/api/v1/policy", POLICY_BODY_BYTES),
        BodyRule("PUT", "/api/v1/jobs/[^/]+", LIST_BODY_BYTES),
        BodyRule("POST", "/api/v1/classes/(assign|clear)", LIST_BODY_BYTES),
    ),
    default_bytes=16 * KIB,
)
# The coordinator's one write is a budget and a reason (at most 500 characters).
COORDINATOR_BODY_LIMITS = BodyLimits(default_bytes=16 * KIB)


def create_app(
    controller: Controller,
    tokens: TokenStore,
    *,
    registry: CollectorRegistry | None = None,
    metrics_public: bool = False,
) -> FastAPI:
    """The admin API over `controller`. `registry`: what `/metrics` serves (none: 404).

    `/healthz`, `/readyz` are open (for load balancers and systemd-style probes);
    `/metrics` needs a viewer token unless `metrics_public` (Prometheus on a trusted net).
    `/ui` (the live page's files, no data) is open too: the page asks for a token.
    """
    app = FastAPI(
        title="powerd admin API",
        version=__version__,
        description="Look at the fleet and change the power picture. Every write takes "
        "effect on the next tick and is written to the audit log. Auth: `Authorization: "
        "Bearer <token>`; roles viewer < operator < admin.",
    )
    app.state.controller = controller
    app.state.tokens = tokens
    app.state.views = Views(controller)
    app.state.registry = registry
    install_error_handlers(app)
    # Probes, the live page's files (no data) and the API's own description need no token;
    # everything else is refused before its body is read (powerd.api.gate).
    public = ["/healthz", "/readyz", "/ui"]
    if registry is not None and metrics_public:
        public.append("/metrics")
    public += _docs_paths(app)
    app.add_middleware(
        RequestGate, tokens=tokens, is_open=open_paths(public, ["/ui/"]), limits=BODY_LIMITS
    )
    app.include_router(health.router)
    if registry is not None:
        app.include_router(metrics.public_router if metrics_public else metrics.router)
    app.include_router(fleet.router)
    app.include_router(history.router)
    app.include_router(overrides.router)
    app.include_router(jobs.router)
    app.include_router(policy.router)
    app.include_router(classes.router)
    app.include_router(ui.router)
    app.include_router(why.router)
    return app


def create_coordinator_app(
    coord: Coordinator, tokens: TokenStore, registry: CollectorRegistry
) -> FastAPI:
    """The coordinator's API over `coord`; `/metrics` serves `registry` to a viewer token.
    `/healthz`, `/readyz` and the API's own description are open."""
    app = FastAPI(title="powerd coordinator", version="1")
    app.state.coordinator = coord
    app.state.tokens = tokens
    app.state.registry = registry
    public = ["/healthz", "/readyz", *_docs_paths(app)]
    app.add_middleware(
        RequestGate, tokens=tokens, is_open=open_paths(public), limits=COORDINATOR_BODY_LIMITS
    )
    app.include_router(coordinator.router)
    return app


def _docs_paths(app: FastAPI) -> list[str]:
    """Where FastAPI serves the API's own description (the OpenAPI document, its pages)."""
    docs = [app.openapi_url, app.docs_url, app.redoc_url, app.swagger_ui_oauth2_redirect_url]
    return [u for u in docs if u is not None]
