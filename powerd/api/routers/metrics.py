"""`/metrics` in Prometheus' text format, rendered in the thread pool (a scrape of a large
fleet takes a while). `create_app` includes one of the two routers, or neither without a
registry."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, Response
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from powerd.api.deps import Viewer
from powerd.api.errors import AUTH_ERRORS
from powerd.metrics import exposition

_TEXT_PLAIN: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
}
_SUMMARY = "Prometheus text format"

router = APIRouter(tags=["metrics"])
"""`/metrics` for a viewer token."""
public_router = APIRouter(tags=["metrics"])
"""`/metrics` for anyone (Prometheus on a trusted network)."""


def _render(request: Request) -> Response:
    registry: CollectorRegistry = request.app.state.registry
    return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)


@public_router.get("/metrics", response_class=Response, responses=_TEXT_PLAIN, summary=_SUMMARY)
def metrics_public_route(request: Request) -> Response:
    return _render(request)


@router.get(
    "/metrics",
    response_class=Response,
    responses={**_TEXT_PLAIN, **AUTH_ERRORS},
    summary=_SUMMARY,
)
def metrics_route(request: Request, _: Viewer) -> Response:
    return _render(request)
