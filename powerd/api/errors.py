"""The API's error bodies: what each kind of operation documents, and the handlers that
give every error the one shape `ErrorOut` (`WriteRefused` for writes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import structlog
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import SQLAlchemyError

from powerd.api.bodies import ErrorOut, Problem, WriteRefused

log = structlog.get_logger(__name__)


def error_doc(description: str, model: type[ErrorOut] = ErrorOut) -> dict[str, Any]:
    """One entry of an operation's `responses`."""
    return {"model": model, "description": description}


# Every operation declares its error bodies (ErrorOut), 422 included: FastAPI would
# otherwise document its own validation error shape, which the handler below replaces.
AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: error_doc("No bearer token, or an unknown one"),
    403: error_doc("The token's role may not do this"),
    422: error_doc("Invalid request; nothing changed"),
}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **AUTH_ERRORS,
    400: error_doc("The body is not valid JSON"),
    404: error_doc("Unknown group, node or GPU; not applied, audited", WriteRefused),
    413: error_doc(
        'The body is over this endpoint\'s limit (docs/api.md, "Request bodies"): not read '
        "further, nothing changed, not audited"
    ),
    409: error_doc(
        "This controller stands by (another leads its scope): not applied; send writes "
        "to the leader named in the detail"
    ),
    422: error_doc("Invalid request; nothing changed (a refused change is audited)", WriteRefused),
    503: error_doc(
        "The state file could not be written: the change (which does not only lower "
        "power) was rolled back, not applied",
        WriteRefused,
    ),
}
STORE_ERRORS: dict[int | str, dict[str, Any]] = {
    **AUTH_ERRORS,
    503: error_doc("The controller runs without a store, or the database is unreachable now"),
}


def rejected(status: int, detail: str, problems: Sequence[tuple[str, str]] = ()) -> NoReturn:
    """Answer `status` with an `ErrorOut` (not audited: for reads and oversized bodies)."""
    body = ErrorOut(detail=detail, problems=[Problem(path=p, message=m) for p, m in problems])
    raise HTTPException(status, body.model_dump())


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    body = exc.detail if isinstance(exc.detail, dict) else {"detail": str(exc.detail)}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


async def store_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
    # A read of history while the database is down: say so, not a 500.
    log.warning("api_store_unreachable", path=request.url.path, error=type(exc).__name__)
    body = ErrorOut(detail=f"the database is unreachable now ({type(exc).__name__})")
    return JSONResponse(body.model_dump(), status_code=503)


async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
    problems = [
        Problem(
            path=".".join(str(p) for p in e.get("loc", ()) if p != "body"),
            message=str(e.get("msg", "")),
        )
        for e in exc.errors()
    ]
    body = ErrorOut(detail="invalid request; nothing changed", problems=problems)
    return JSONResponse(body.model_dump(), status_code=422)


def install_error_handlers(app: FastAPI) -> None:
    app.exception_handler(HTTPException)(http_error)
    app.exception_handler(SQLAlchemyError)(store_error)
    app.exception_handler(RequestValidationError)(invalid_request)
