"""A thin Redfish client over httpx: sessions with basic auth as the fallback, timeouts and
retries per BMC, a connection cap per BMC, and TLS trust as configured (a CA bundle, or the
BMC's own certificate pinned). docs/decisions/0005-redfish-client.md says why not a library.

Every request is bounded: `timeout_s` per attempt, `retries` more attempts for a GET or a
`PATCH` (setting a `SetPoint` twice is harmless) after a timeout, a refused connection or a
5xx, with a short backoff between. A session token the BMC no longer knows (401) makes one
new log-in and one more try. Errors are `RedfishError`, with the HTTP status when there was
one.
"""

from __future__ import annotations

import asyncio
import bisect
import ssl
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import httpx
import structlog

log = structlog.get_logger(__name__)

Json = dict[str, Any]
SESSIONS = "/redfish/v1/SessionService/Sessions"
BACKOFF_S = 0.1  # before the first retry; doubled for each further one
MAX_BODY_BYTES = 4 << 20  # the largest answer read (a Redfish document: a few kB)


# Upper bounds of the request-latency histogram's buckets (BMCs answer in 100–500 ms).
LATENCY_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


@dataclass
class RequestStats:
    """Every attempt a client made: how many, how many failed (no answer, or an answer other
    than 2xx), and how long each took until its answer was read (or it gave up), as
    histogram counts over LATENCY_BUCKETS_S (the last count: beyond the last bound). Written
    by the client's loop only; read from any thread (plain numbers)."""

    attempts: int = 0
    failed: int = 0
    seconds_sum: float = 0.0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BUCKETS_S) + 1))

    def record(self, seconds: float, ok: bool) -> None:
        self.attempts += 1
        self.failed += 0 if ok else 1
        self.seconds_sum += seconds
        self.buckets[bisect.bisect_left(LATENCY_BUCKETS_S, seconds)] += 1


class RedfishError(Exception):
    """A request failed: `status` is the HTTP status, None when no answer came."""

    def __init__(self, message: str, status: int | None = None) -> None:
        self.status = status
        super().__init__(message)


@dataclass(frozen=True)
class BmcTrust:
    """How a BMC's certificate is checked: against `ca_file` (a PEM bundle, host name
    checked too), or equal to `pinned_cert_file` (the BMC's own certificate, PEM: the only
    one accepted, whatever names it carries), or the system's trust store (neither)."""

    ca_file: Path | None = None
    pinned_cert_file: Path | None = None

    def ssl_context(self) -> ssl.SSLContext:
        """The context the handshake checks; OSError/ssl.SSLError if a file is unusable."""
        if self.pinned_cert_file is not None:
            ctx = ssl.create_default_context(cafile=str(self.pinned_cert_file))
            # The certificate itself is the trust anchor: accepted even if it is not a CA's
            # (PARTIAL_CHAIN), and its names need not match the URL (BMC certificates name
            # whatever the factory set); any other certificate fails the handshake, before
            # a credential is sent.
            ctx.verify_flags |= ssl.VERIFY_X509_PARTIAL_CHAIN
            ctx.check_hostname = False
            return ctx
        if self.ca_file is not None:
            return ssl.create_default_context(cafile=str(self.ca_file))
        return ssl.create_default_context()


class RedfishClient:
    """One BMC at `base_url` (`https://host[:port]`). Use from one event loop; `close` logs
    out. `auth`: "session" logs in through the SessionService and falls back to basic auth
    where the BMC has none (404, 405, 501); "basic" always sends basic auth."""

    def __init__(
        self,
        base_url: str,
        username: str,
        password: str,
        *,
        trust: BmcTrust,
        auth: Literal["session", "basic"] = "session",
        timeout_s: float = 0.8,
        retries: int = 1,
        concurrency: int = 4,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.username = username
        self._password = password
        self.auth = auth
        self.timeout_s = timeout_s
        self.retries = retries
        self.concurrency = concurrency
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            verify=trust.ssl_context(),
            timeout=httpx.Timeout(timeout_s, pool=timeout_s * (retries + 1)),
            limits=httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency),
            headers={"Accept": "application/json", "OData-Version": "4.0"},
            follow_redirects=False,
            transport=transport,
        )
        self._token: str | None = None
        self._session_uri: str | None = None
        self._basic = auth == "basic"
        self._login_lock = asyncio.Lock()
        self.requests = 0  # attempts made, for figures
        self.logins = 0
        self.stats = RequestStats()
        self.log = log.bind(bmc=self.base_url)

    # -- sessions ------------------------------------------------------------------------

    async def login(self) -> None:
        """Log in (or settle on basic auth); RedfishError when neither works."""
        if self._basic:
            return
        body = {"UserName": self.username, "Password": self._password}
        r = await self._send("POST", SESSIONS, json=body, retry=True, authed=False)
        if r.status_code in (404, 405, 501):
            self.log.info("bmc_basic_auth", reason=f"no session service ({r.status_code})")
            self._basic = True
            return
        if r.status_code not in (200, 201):
            raise RedfishError(f"log-in refused: {_reason(r)}", r.status_code)
        token = r.headers.get("X-Auth-Token")
        if not token:
            raise RedfishError("log-in answered without an X-Auth-Token", r.status_code)
        self._token = token
        self._session_uri = _path_of(r.headers.get("Location"), self.base_url)
        self.logins += 1

    async def close(self) -> None:
        """Log out (best effort: a BMC that does not answer times the session out itself)."""
        uri, token = self._session_uri, self._token
        self._token = self._session_uri = None
        try:
            if uri is not None and token is not None:
                await self._client.delete(uri, headers={"X-Auth-Token": token})
        except httpx.HTTPError as exc:
            self.log.info("bmc_logout_failed", error=str(exc) or type(exc).__name__)
        finally:
            await self._client.aclose()

    # -- requests ------------------------------------------------------------------------

    async def get(self, path: str) -> Json:
        return _json(await self._authed("GET", path), path)

    async def patch(self, path: str, doc: Json) -> Json | None:
        """The resource as the answer gives it after the change (200 with a body), or None
        (204, or a body that is no JSON object)."""
        r = await self._authed("PATCH", path, json=doc)
        if r.status_code != 200 or not r.content:
            return None
        try:
            return _json(r, path)
        except RedfishError:
            return None

    async def _authed(self, method: str, path: str, json: Json | None = None) -> httpx.Response:
        if not self._basic and self._token is None:
            await self._relogin(None)
        token = self._token
        r = await self._send(method, path, json=json, retry=True, authed=True)
        if r.status_code == 401 and not self._basic:
            # The BMC forgot the session (rebooted, timed out): one new log-in, one more try.
            await self._relogin(token)
            r = await self._send(method, path, json=json, retry=True, authed=True)
        # Redirects are not followed (to another host, they would carry our credentials);
        # a 3xx is no document, nor a limit applied.
        if r.status_code >= 300:
            raise RedfishError(f"{method} {path}: {_reason(r)}", r.status_code)
        return r

    async def _relogin(self, stale: str | None) -> None:
        async with self._login_lock:  # concurrent requests that all got 401 log in once
            if self._token == stale or self._token is None:
                self._token = None
                await self.login()

    async def _send(
        self, method: str, path: str, *, json: Json | None, retry: bool, authed: bool
    ) -> httpx.Response:
        if not path.startswith("/") or path.startswith("//") or not path.isprintable():
            # Paths come from the BMC's own documents (`@odata.id`); an absolute or
            # scheme-relative URL would be sent to its host with our credentials (and BMCs
            # often share a password). One with a control character is no URL at all
            # (httpx raises InvalidURL, no HTTPError, which would end the node's thread).
            raise RedfishError(f"{method} {path[:200]!r}: not a path on the BMC")
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            headers: dict[str, str] = {}
            auth: tuple[str, str] | None = None
            if authed and self._basic:
                auth = (self.username, self._password)
            elif authed and self._token is not None:
                headers["X-Auth-Token"] = self._token
            self.requests += 1
            started = time.monotonic()
            answered = False
            try:
                try:
                    request = self._client.build_request(method, path, json=json, headers=headers)
                except httpx.InvalidURL as exc:  # not an HTTPError: caught nowhere above
                    raise RedfishError(
                        f"{method} {path[:200]!r}: not a path on the BMC ({exc})"
                    ) from None
                r = await self._client.send(request, auth=auth, stream=True)
                try:
                    await _read_bounded(r, f"{method} {path}")
                finally:
                    await r.aclose()
                answered = r.status_code < 300
            except httpx.DecodingError as exc:
                raise RedfishError(f"{method} {path}: undecodable answer ({exc})") from None
            except (httpx.TimeoutException, httpx.TransportError) as exc:
                if isinstance(exc, httpx.ConnectError) and "CERTIFICATE" in str(exc):
                    raise RedfishError(f"{method} {path}: TLS: {exc}") from None
                if attempt + 1 < attempts:
                    await asyncio.sleep(BACKOFF_S * 2**attempt)
                    continue
                what = type(exc).__name__ if not str(exc) else f"{type(exc).__name__}: {exc}"
                raise RedfishError(f"{method} {path}: no answer ({what})") from None
            finally:
                self.stats.record(time.monotonic() - started, answered)
            if r.status_code >= 500 and attempt + 1 < attempts:
                await asyncio.sleep(BACKOFF_S * 2**attempt)
                continue
            return r
        raise AssertionError("unreachable")


async def _read_bounded(r: httpx.Response, what: str) -> None:
    """Read a streamed answer's body (decoded) into `r`, RedfishError past MAX_BODY_BYTES:
    a BMC's documents are kilobytes, and one streaming without end must not fill memory."""
    body = bytearray()
    async for chunk in r.aiter_bytes():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RedfishError(
                f"{what}: an answer larger than {MAX_BODY_BYTES} bytes", r.status_code
            )
    r._content = bytes(body)  # as httpx's own read() leaves it: .json() and .text work


def _json(r: httpx.Response, path: str) -> Json:
    try:
        doc = r.json()
    except (ValueError, RecursionError):  # RecursionError: nested deeper than json recurses
        raise RedfishError(f"GET {path}: not JSON", r.status_code) from None
    if not isinstance(doc, dict):
        raise RedfishError(f"GET {path}: not a JSON object", r.status_code)
    return doc


def _reason(r: httpx.Response) -> str:
    """The status and the Redfish error message, if the body has one."""
    message = ""
    try:
        doc = r.json()
        if isinstance(doc, dict) and isinstance(doc.get("error"), dict):
            message = str(doc["error"].get("message", ""))[:200]
    except (ValueError, RecursionError):
        pass
    return f"HTTP {r.status_code}" + (f" ({message})" if message else "")


def _path_of(location: str | None, base_url: str) -> str | None:
    """A session's URI as a path (Location may be absolute or relative)."""
    if not location:
        return None
    if location.startswith(base_url):
        return location[len(base_url) :] or "/"
    if location.startswith("/"):
        return location
    return "/" + location.split("://", 1)[-1].split("/", 1)[-1]
