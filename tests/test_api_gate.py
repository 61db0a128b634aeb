"""The gate in front of the admin APIs (powerd.api.gate), over real HTTP: no token, no body
read; a body over its endpoint's limit is refused with a 413 before it is held, whether it
declares its length or streams it chunked. The controller's API runs in a live controller
(test_api.LiveApi), the coordinator's under uvicorn as `powerd coordinator` serves it.

The requests are written on raw sockets: an HTTP client sends the whole body before it
reads the answer, and the point here is the answer that comes while the upload has hardly
begun, and a server that then stops taking bytes.
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry
from structlog.testing import capture_logs
from support.live_api import LiveApi

from powerd.api.app import LIST_BODY_BYTES, POLICY_BODY_BYTES, create_coordinator_app
from powerd.api.bodies import ClassAssignIn, JobIn
from powerd.api.server import ApiServer
from powerd.auth import TokenStore, new_token_entry
from powerd.controller.overrides import MAX_JOB_GPUS, MAX_JOB_NODES, MAX_PROFILE_POINTS
from powerd.coordinator.main import Coordinator

HUGE = 180 * 1024 * 1024  # the size the attack sent
CHUNK = 64 * 1024


def _buffered_bytes() -> int:
    """The most a client can have written before its sends block while the server reads
    nothing: its socket's send buffer and the server's receive buffer, each at the most
    Linux autotunes them to (tcp_wmem, tcp_rmem), plus 1 MiB for the server's own buffer
    and the answer's round trip. A bound on bytes, not on time: how fast a loaded server
    answers moves `sent` anywhere below it (an 18 MB bound failed once under a parallel
    run, 2026-12-06, with tcp_rmem's maximum at 32 MiB)."""
    total = 1024 * 1024
    for name in ("tcp_wmem", "tcp_rmem"):
        try:
            total += int(Path(f"/proc/sys/net/ipv4/{name}").read_text().split()[2])
        except (OSError, IndexError, ValueError):
            total += 32 * 1024 * 1024
    return total


# A client blocked by full buffers has sent at most this; a server that read the body would
# have taken all of it (HUGE, or the 256 MiB budget of an endless chunked one).
UNREAD = _buffered_bytes()
assert UNREAD < HUGE // 2, "socket buffers this large cannot tell an unread body from a read one"


@dataclass
class Answer:
    status: int
    headers: dict[str, str]
    body: dict[str, Any]
    sent: int  # body bytes the client had written when the answer came
    closed: bool  # the server closed the connection after answering
    raw: bytes = field(repr=False, default=b"")


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def exchange(
    url: str, head: str, body: Iterator[bytes], *, budget: int = 256 * 1024 * 1024
) -> Answer:
    """Send `head` then `body` piece by piece until the server answers (or `budget` bytes
    went out), read the answer, then see whether the server closes the connection."""
    sock = socket.create_connection(_host_port(url), timeout=20)
    try:
        sock.sendall(head.encode("latin-1"))
        sent = 0
        for piece in body:
            readable, _, _ = select.select([sock], [], [], 0)
            if readable or sent >= budget:
                break
            try:
                sock.sendall(piece)
            except OSError:  # the server answered and closed meanwhile
                break
            sent += len(piece)
        raw = b""
        while b"\r\n\r\n" not in raw:
            got = sock.recv(65536)
            assert got, f"connection closed before an answer: {raw!r}"
            raw += got
        top, _, rest = raw.partition(b"\r\n\r\n")
        lines = top.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
        length = int(headers["content-length"])
        while len(rest) < length:
            got = sock.recv(65536)
            assert got, "connection closed in the answer's body"
            rest += got
        sock.settimeout(1)  # well inside the server's keep-alive timeout (5 s)
        try:
            closed = sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        except TimeoutError:
            closed = False
        return Answer(status, headers, json.loads(rest[:length]), sent, closed, raw)
    finally:
        sock.close()


def zeros(total: int | None = None) -> Iterator[bytes]:
    """A body of `total` bytes (None: without end), CHUNK at a time."""
    piece = b"0" * CHUNK
    left = total
    while left is None or left > 0:
        yield piece if left is None or left >= CHUNK else piece[:left]
        if left is not None:
            left -= CHUNK


def chunked(pieces: Iterator[bytes]) -> Iterator[bytes]:
    """The same body in HTTP/1.1 chunked transfer coding."""
    for p in pieces:
        yield f"{len(p):x}\r\n".encode() + p + b"\r\n"
    yield b"0\r\n\r\n"


def head(method: str, path: str, token: str | None, length: int | None) -> str:
    lines = [f"{method} {path} HTTP/1.1", "Host: api", "Content-Type: application/json"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines.append("Transfer-Encoding: chunked" if length is None else f"Content-Length: {length}")
    return "\r\n".join(lines) + "\r\n\r\n"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path_factory.mktemp("gate")).start()
    try:
        yield api
    finally:
        api.close()


# ---- the controller's API ----


@pytest.mark.parametrize(
    ("token", "detail"),
    [(None, "missing bearer token"), ("pwd_not-a-token", "unknown or revoked token")],
    ids=["no-token", "unknown-token"],
)
def test_a_huge_body_without_a_valid_token_is_refused_before_it_is_read(
    live: LiveApi, token: str | None, detail: str
) -> None:
    with capture_logs() as logs:
        a = exchange(live.url, head("PUT", "/api/v1/jobs/x", token, HUGE), zeros(HUGE))
    assert a.status == 401 and a.body == {"detail": detail, "problems": []}
    assert a.headers["www-authenticate"] == "Bearer"
    # Answered before more went out than the socket buffers hold (UNREAD), and the
    # connection dropped: the server does not read the rest to keep it open.
    assert a.sent < UNREAD, a.sent
    assert a.headers["connection"] == "close" and a.closed
    assert any(e["event"] == "api_unauthorized" and e["body_bytes"] == HUGE for e in logs)
    assert not any(e["event"] == "api_body_too_large" for e in logs)  # nothing was read


def test_a_chunked_body_without_a_token_is_refused_before_it_is_read(live: LiveApi) -> None:
    with capture_logs() as logs:
        a = exchange(live.url, head("PUT", "/api/v1/policy?reason=x", None, None), chunked(zeros()))
    assert a.status == 401 and a.body["detail"] == "missing bearer token"
    # The server read none of it (the gate counts what the app reads, and logs past a
    # limit) and the client was stopped by full buffers at most, not by the endless body.
    assert any(e["event"] == "api_unauthorized" for e in logs)
    assert not any(e["event"] == "api_body_too_large" for e in logs)
    assert a.sent < UNREAD, f"{a.sent:,} bytes went out before the answer"
    assert a.closed, "the server kept the connection open after refusing"


def test_a_declared_length_over_the_limit_is_a_413_before_the_body(live: LiveApi) -> None:
    token = live.tokens["operator"]
    with capture_logs() as logs:
        a = exchange(live.url, head("PUT", "/api/v1/jobs/x", token, HUGE), zeros(HUGE))
    assert a.status == 413
    assert a.body == {
        "detail": f"request body over 3 MiB ({LIST_BODY_BYTES} bytes), the limit of this endpoint",
        "problems": [],
    }
    assert a.sent < UNREAD and a.headers["connection"] == "close" and a.closed
    (event,) = [e for e in logs if e["event"] == "api_body_too_large"]
    assert event["body_bytes"] == HUGE and event["limit"] == LIST_BODY_BYTES
    # A pin's body is small: its limit is too.
    a = exchange(live.url, head("PUT", "/api/v1/gpus/GPU-x/pin", token, 20_000), zeros(20_000))
    assert a.status == 413 and "16 KiB" in a.body["detail"]


@pytest.mark.parametrize(
    ("role", "path", "limit"),
    [
        ("operator", "/api/v1/jobs/x", LIST_BODY_BYTES),
        ("admin", "/api/v1/policy?reason=x", POLICY_BODY_BYTES),
        ("operator", "/api/v1/budgets/site", 16 * 1024),
    ],
    ids=["job", "policy", "budget"],
)
def test_a_chunked_body_is_cut_off_once_past_the_limit(
    live: LiveApi, role: str, path: str, limit: int
) -> None:
    with capture_logs() as logs:
        a = exchange(live.url, head("PUT", path, live.tokens[role], None), chunked(zeros()))
    assert a.status == 413 and f"({limit} bytes)" in a.body["detail"]
    assert a.headers["connection"] == "close" and a.closed
    (event,) = [e for e in logs if e["event"] == "api_body_too_large"]
    # The server read past the limit by at most what it buffers of one read, not the rest.
    assert limit < event["body_bytes_read"] <= limit + 512 * 1024


def test_a_body_within_the_limit_still_reaches_the_endpoint(live: LiveApi) -> None:
    # Chunked, with a token, small: the endpoint gets it and answers on its merits.
    body = json.dumps({"budget_w": 3500, "ttl_s": 60, "reason": "gate"}).encode()
    a = exchange(
        live.url,
        head("PUT", "/api/v1/budgets/site", live.tokens["operator"], None),
        chunked(iter([body[:10], body[10:]])),
    )
    assert a.status == 200, a.raw
    assert a.body["applied"] is True and not a.closed
    with live.client(None) as c:
        assert c.get("/healthz").status_code == 200  # probes stay open
        assert c.get("/ui").status_code == 200
        assert c.get("/openapi.json").status_code == 200


def test_the_largest_valid_bodies_fit_their_limits() -> None:
    """The list limit is above the largest body the models accept (128-character names)."""
    name = "G" * 128
    job = JobIn.model_validate(
        {
            "class": "c" * 128,
            "uuids": [f"{name[:-6]}{i:06d}" for i in range(MAX_JOB_GPUS)],
            "nodes": [f"{name[:-6]}{i:06d}" for i in range(MAX_JOB_NODES)],
            "profile": [[9999.123456789 - i, 1e11 / (i + 1)] for i in range(MAX_PROFILE_POINTS)],
            "reason": "r" * 500,
        }
    )
    assert len(job.model_dump_json(by_alias=True)) < LIST_BODY_BYTES
    assign = ClassAssignIn.model_validate(
        {
            "class": "c" * 128,
            "uuids": [f"{name[:-6]}{i:06d}" for i in range(10_000)],
            "nodes": [f"{name[:-6]}{i:06d}" for i in range(10_000)],
            "reason": "r" * 500,
        }
    )
    assert len(assign.model_dump_json(by_alias=True)) < LIST_BODY_BYTES


# ---- the coordinator's API ----


class _Standby:
    """What the coordinator's write endpoint asks of the coordinator before anything else:
    whether it leads. Requests the gate refuses never get this far."""

    class leadership:  # the attribute the endpoint reads
        @staticmethod
        def may_command() -> bool:
            return False

        @staticmethod
        def view() -> Any:
            return type("View", (), {"leader": "coord-b"})()

    async def set_budget(self, *_: object) -> bool:
        raise AssertionError("a standby's endpoint changed a budget")


class Served:
    """An ASGI app under uvicorn (ApiServer) in a thread with its own event loop."""

    def __init__(self, server: ApiServer) -> None:
        self.server = server
        self.url = server.url
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self._started.set()
        await self.server.serve(self._stop)

    def __enter__(self) -> Served:
        self._thread.start()
        assert self._started.wait(10)
        return self

    def __exit__(self, *_: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)


@pytest.fixture
def coordinator_api(tmp_path: Path) -> Iterator[tuple[str, str]]:
    token, entry = new_token_entry("op", "operator")
    (tmp_path / "tokens.toml").write_text(entry)
    tokens = TokenStore.from_file(tmp_path / "tokens.toml")
    app = create_coordinator_app(cast(Coordinator, _Standby()), tokens, CollectorRegistry())
    with Served(ApiServer(app, "127.0.0.1", 0)) as served:
        yield served.url, token


def test_the_coordinators_api_has_the_same_gate(coordinator_api: tuple[str, str]) -> None:
    url, token = coordinator_api
    a = exchange(url, head("PUT", "/api/v1/budgets/site", None, HUGE), zeros(HUGE))
    assert a.status == 401 and a.sent < UNREAD and a.closed
    a = exchange(url, head("PUT", "/api/v1/budgets/site", token, HUGE), zeros(HUGE))
    assert a.status == 413 and "16 KiB" in a.body["detail"] and a.closed
    with capture_logs() as logs:
        a = exchange(url, head("PUT", "/api/v1/budgets/site", token, None), chunked(zeros()))
    assert a.status == 413 and a.closed
    (event,) = [e for e in logs if e["event"] == "api_body_too_large"]
    assert 16 * 1024 < event["body_bytes_read"] <= 16 * 1024 + 512 * 1024
    # A small body with a token passes the gate: the endpoint answers (a standby: 409).
    body = b'{"budget_w": 1000, "reason": "x"}'
    a = exchange(url, head("PUT", "/api/v1/budgets/site", token, len(body)), iter([body]))
    assert a.status == 409 and "coord-b" in a.body["detail"]
    a = exchange(url, "GET /healthz HTTP/1.1\r\nHost: api\r\n\r\n", iter(()))
    assert a.status == 200 and a.body == {"status": "ok"}
