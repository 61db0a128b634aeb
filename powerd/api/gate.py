"""The door of an HTTP API: who is asking, and how much they may send, before a byte of the
body is read.

FastAPI reads and parses a request's body before it resolves the endpoint's dependencies,
so a token checked as a dependency comes after the body: anyone who can reach the port
could make the controller read (and hold) a body of any size, on the loop that ticks.
`RequestGate` is ASGI middleware in front of the whole app instead:

1. a path that needs a token (all but the app's open ones) without a valid one is answered
   401 at once, and the body is never read;
2. a body whose `Content-Length` is over the endpoint's limit is answered 413 at once;
3. a body without one (chunked) is counted as the app reads it, and cut off with a 413 as
   soon as it passes the limit: at most the limit plus one chunk is ever held.

A refusal whose body was not read in full says `Connection: close`, so the server drops the
connection instead of reading the rest to keep it alive. Roles (403) stay with the
endpoints: a token of any role may send at most the endpoint's limit.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import structlog
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from powerd.auth import Principal, TokenStore

log = structlog.get_logger(__name__)

PRINCIPAL = "principal"  # where the gate leaves the caller in the request's state
KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class BodyRule:
    """Bodies of `method` requests whose path matches `path` (a regex, whole path) may be
    at most `max_bytes`."""

    method: str
    path: str
    max_bytes: int

    def matches(self, method: str, path: str) -> bool:
        return method == self.method and re.fullmatch(self.path, path) is not None


@dataclass(frozen=True)
class BodyLimits:
    """The body limit of each request: the first rule that matches, else `default_bytes`."""

    rules: tuple[BodyRule, ...] = ()
    default_bytes: int = 16 * KIB

    def for_request(self, method: str, path: str) -> int:
        return next(
            (r.max_bytes for r in self.rules if r.matches(method, path)), self.default_bytes
        )


class _BodyTooLarge(Exception):
    """Raised from the app's `receive` once the body passed its limit."""


class RequestGate:
    """ASGI middleware: authenticate, then bound the body (see the module's doc).

    `is_open(path)`: paths that need no token (probes, the live page's files, the API's own
    description). Other paths need a token that `tokens` knows, of any role.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        tokens: TokenStore,
        is_open: Callable[[str], bool],
        limits: BodyLimits,
    ) -> None:
        self.app = app
        self.tokens = tokens
        self.is_open = is_open
        self.limits = limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        method: str = scope["method"]
        headers = _headers(scope)
        declared = _content_length(headers)
        has_body = bool(declared) or (declared is None and "transfer-encoding" in headers)
        if not self.is_open(path):
            principal, why = self._authenticate(headers.get("authorization"))
            if principal is None:
                log.warning("api_unauthorized", path=path[:200], method=method, body_bytes=declared)
                await _refuse(send, 401, why, close=has_body, bearer=True)
                return
            # The endpoints check the role of the caller found here (`authenticated`).
            scope.setdefault("state", {})[PRINCIPAL] = principal
        limit = self.limits.for_request(method, path)
        if declared is not None and declared > limit:
            log.warning(
                "api_body_too_large",
                path=path[:200],
                method=method,
                body_bytes=declared,
                limit=limit,
            )
            await _refuse(send, 413, _too_large(limit), close=True)
            return
        await _Limited(self.app, limit, path, method)(scope, receive, send)

    def _authenticate(self, authorization: str | None) -> tuple[Principal | None, str]:
        """The caller its bearer token names, or None and why not."""
        if authorization is None:
            return None, "missing bearer token"
        scheme, _, token = authorization.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            return None, "missing bearer token"
        principal = self.tokens.authenticate(token.strip())
        return principal, "unknown or revoked token"


def authenticated(request: Request) -> Principal | None:
    """The caller the gate authenticated for this request (None on an open path)."""
    return getattr(request.state, PRINCIPAL, None)


class _Limited:
    """One request passed to the app with its body counted as the app reads it."""

    def __init__(self, app: ASGIApp, limit: int, path: str, method: str) -> None:
        self.app = app
        self.limit = limit
        self.path = path
        self.method = method
        self.read = 0
        self.over = False
        self.answered = False  # the 413 is out
        self.started = False  # the app's own answer began

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def counted() -> Message:
            if self.over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                self.read += len(message.get("body", b""))
                if self.read > self.limit:
                    self.over = True
                    log.warning(
                        "api_body_too_large",
                        path=self.path[:200],
                        method=self.method,
                        body_bytes_read=self.read,
                        limit=self.limit,
                    )
                    raise _BodyTooLarge
            return message

        async def guarded(message: Message) -> None:
            # Once the body is over, the answer is the 413, whatever the app makes of the
            # error (FastAPI turns an error while reading a body into a 400).
            if self.over:
                if message["type"] == "http.response.start" and not self.answered:
                    await self._answer(send)
                return
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except _BodyTooLarge:
            if not self.started and not self.answered:
                await self._answer(send)

    async def _answer(self, send: Send) -> None:
        self.answered = True
        await _refuse(send, 413, _too_large(self.limit), close=True)


def _too_large(limit: int) -> str:
    return f"request body over {_size(limit)} ({limit} bytes), the limit of this endpoint"


def _size(n: int) -> str:
    return f"{n // MIB} MiB" if n % MIB == 0 else f"{n // KIB} KiB" if n % KIB == 0 else f"{n} B"


def _headers(scope: Scope) -> dict[str, str]:
    # The last of a repeated header wins: only authorization, content-length and
    # transfer-encoding are read, and the server refuses conflicting lengths itself.
    return {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}


def _content_length(headers: dict[str, str]) -> int | None:
    value = headers.get("content-length")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        return None


async def _refuse(
    send: Send, status: int, detail: str, *, close: bool, bearer: bool = False
) -> None:
    """An error with the API's one body shape, `{"detail", "problems"}`."""
    body = json.dumps({"detail": detail, "problems": []}).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    if bearer:
        headers.append((b"www-authenticate", b"Bearer"))
    if close:
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def open_paths(exact: Iterable[str], prefixes: Iterable[str] = ()) -> Callable[[str], bool]:
    """`is_open` for a gate: these paths, and every path under these prefixes."""
    names = frozenset(exact)
    starts = tuple(prefixes)
    return lambda path: path in names or (bool(starts) and path.startswith(starts))
