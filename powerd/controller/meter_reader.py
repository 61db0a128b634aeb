"""The meters' reader: polls every metered group's meter from a thread of its own, with
its own event loop, so no meter (slow, hanging, streaming without end) ever touches the
controller's loop or delays a tick (docs/operations.md, "Metered groups").

Each meter is polled every `poll_s`, each poll bounded by `timeout_s` as a whole. A
Redfish meter goes through powerd's Redfish client (powerd/bmc/redfish.py: sessions, TLS
trust, bounded answers, credentials from a file); a Prometheus meter through one instant
query (`GET /api/v1/query`), its answer read up to `MAX_PROM_BYTES`. Every answer is
untrusted: controller/meters.py turns it into watts or a rejection (counted). A reading
is stamped with the controller's own monotonic clock when it arrives, never with a time
the meter gives; a failure keeps the last reading, which goes stale on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import httpx
import structlog

from powerd.bmc.redfish import BmcTrust, RedfishClient, RedfishError
from powerd.clock import Clock
from powerd.controller.meters import (
    MAX_ERROR_CHARS,
    MeterBook,
    MeterRejected,
    prometheus_watts,
    redfish_watts,
)
from powerd.policy import MeterSpec, Policy, PrometheusMeter, RedfishMeter

log = structlog.get_logger(__name__)

MAX_PROM_BYTES = 1 << 20  # an instant query of one series answers in well under a kB
MAX_PASSWORD_BYTES = 4096


class MeterConfigError(Exception):
    """A meter that cannot be set up: `field` names it in the policy."""

    def __init__(self, field: str, message: str) -> None:
        self.field = field
        self.detail = message
        super().__init__(f"{field}: {message}")


def read_password(path: Path, field: str) -> str:
    """The password alone from its file (a trailing newline ignored), MeterConfigError
    naming the field if unreadable, empty or too long."""
    try:
        with path.open("rb") as f:  # a wrong path (/dev/zero) read whole would never end
            raw = f.read(MAX_PASSWORD_BYTES + 1)
    except OSError as exc:
        raise MeterConfigError(field, f"cannot read {path}: {exc.strerror}") from None
    if len(raw) > MAX_PASSWORD_BYTES:
        raise MeterConfigError(field, f"{path} is over {MAX_PASSWORD_BYTES} bytes")
    try:
        password = raw.decode("utf-8").rstrip("\r\n")
    except UnicodeDecodeError:
        raise MeterConfigError(field, f"{path} is not UTF-8 text") from None
    if not password:
        raise MeterConfigError(field, f"{path} is empty")
    return password


class Source(Protocol):
    async def read(self) -> float: ...

    async def close(self) -> None: ...


def meter_files(spec: MeterSpec) -> tuple[Path, ...]:
    """The files a meter's source is built from (password, trust)."""
    if spec.redfish is not None:
        r = spec.redfish
        return tuple(p for p in (r.password_file, r.ca_file, r.pinned_cert_file) if p)
    assert spec.prometheus is not None
    return () if spec.prometheus.ca_file is None else (spec.prometheus.ca_file,)


FileStamp = tuple[tuple[int, int, int] | None, ...]


def file_stamp(paths: tuple[Path, ...]) -> FileStamp:
    """(blocking: stat) What tells a changed file: inode, size, mtime; None if missing."""
    stamps: list[tuple[int, int, int] | None] = []
    for path in paths:
        try:
            st = path.stat()
        except OSError:
            stamps.append(None)
        else:
            stamps.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(stamps)


class TlsContexts:
    """(one reader's thread) One SSL context per trust file and that file's state, shared by
    the meters that name it: building one loads a CA bundle (10-65 ms of this thread's
    CPU), and a context per meter kept a thousand meters from reading for over a minute.
    A file that changes (a rotation) gets a new context."""

    def __init__(self) -> None:
        self._made: dict[tuple[str, Path | None], tuple[FileStamp, ssl.SSLContext]] = {}

    def get(self, kind: str, path: Path | None) -> ssl.SSLContext:
        """`kind` "ca" (`path` None: the system's, as httpx trusts) or "pinned"; OSError,
        ValueError if the file is unusable."""
        stamp = () if path is None else file_stamp((path,))
        made = self._made.get((kind, path))
        if made is not None and made[0] == stamp:
            return made[1]
        if kind == "pinned":
            ctx = BmcTrust(pinned_cert_file=path).ssl_context()
        elif path is None:
            ctx = httpx.create_ssl_context()
        else:
            ctx = ssl.create_default_context(cafile=str(path))
        self._made[(kind, path)] = (stamp, ctx)
        return ctx


@dataclass(frozen=True)
class _SharedTrust(BmcTrust):
    """A trust whose context is already built (TlsContexts)."""

    context: ssl.SSLContext | None = None

    def ssl_context(self) -> ssl.SSLContext:
        return super().ssl_context() if self.context is None else self.context


def redfish_setup(
    spec: RedfishMeter, where: str, tls: TlsContexts | None = None
) -> tuple[str, BmcTrust]:
    """The password and TLS trust of a Redfish meter, MeterConfigError naming the field."""
    password = read_password(spec.password_file, where + ".redfish.password_file")
    tls = tls or TlsContexts()
    try:
        if spec.pinned_cert_file is not None:
            ctx = tls.get("pinned", spec.pinned_cert_file)
        else:
            ctx = tls.get("ca", spec.ca_file)
    except (OSError, ValueError) as exc:
        name = "ca_file" if spec.ca_file is not None else "pinned_cert_file"
        raise MeterConfigError(
            f"{where}.redfish.{name}", f"not a PEM certificate ({exc})"
        ) from None
    trust = _SharedTrust(spec.ca_file, spec.pinned_cert_file, context=ctx)
    return password, trust


def prometheus_verify(
    spec: PrometheusMeter, where: str, tls: TlsContexts | None = None
) -> ssl.SSLContext:
    """The TLS check of a Prometheus meter (its CA, or the system's), MeterConfigError
    naming the field if the CA file is unusable."""
    try:
        return (tls or TlsContexts()).get("ca", spec.ca_file)
    except (OSError, ValueError) as exc:
        raise MeterConfigError(
            f"{where}.prometheus.ca_file", f"not a PEM certificate ({exc})"
        ) from None


def check_meters(policy: Policy) -> None:
    """(blocking: reads files) Each meter's password and trust files usable, else
    MeterConfigError naming the first field that is not (at a daemon's start)."""
    for spec, where in meter_specs(policy).values():
        if spec.redfish is not None:
            redfish_setup(spec.redfish, where + ".meter")
        elif spec.prometheus is not None:
            prometheus_verify(spec.prometheus, where + ".meter")


class RedfishSource:
    """A Redfish PDU, outlet or power shelf: `PowerWatts.Reading` of the resource, or of
    its `Metrics` (the link followed once, then read directly)."""

    def __init__(
        self, spec: RedfishMeter, max_w: float, timeout_s: float, where: str, tls: TlsContexts
    ) -> None:
        password, trust = redfish_setup(spec, where, tls)
        self.max_w = max_w
        self.path = spec.path
        self.client = RedfishClient(
            spec.url,
            spec.username,
            password,
            trust=trust,
            auth=spec.auth,
            timeout_s=timeout_s,
            retries=0,  # the next poll is the retry
            concurrency=1,
        )

    async def read(self) -> float:
        got = redfish_watts(await self.client.get(self.path), self.max_w)
        if isinstance(got, str):
            self.path = got  # a PowerDistribution: its Metrics from now on
            got = redfish_watts(await self.client.get(got), self.max_w)
            if isinstance(got, str):
                raise MeterRejected("malformed", "Metrics without PowerWatts.Reading")
        return got

    async def close(self) -> None:
        await self.client.close()


class PrometheusSource:
    """One instant query against a Prometheus server."""

    def __init__(
        self, spec: PrometheusMeter, max_w: float, timeout_s: float, where: str, tls: TlsContexts
    ) -> None:
        verify = prometheus_verify(spec, where, tls)
        self.max_w = max_w
        self.query = spec.query
        self.client = httpx.AsyncClient(
            base_url=spec.url.rstrip("/"),
            verify=verify,
            timeout=httpx.Timeout(timeout_s),
            follow_redirects=False,
            headers={"Accept": "application/json"},
        )

    async def read(self) -> float:
        async with self.client.stream("GET", "/api/v1/query", params={"query": self.query}) as r:
            body = bytearray()
            async for chunk in r.aiter_bytes():
                body += chunk
                if len(body) > MAX_PROM_BYTES:
                    raise MeterRejected("too_large", f"an answer over {MAX_PROM_BYTES} bytes")
        try:
            doc = json.loads(body)
        except (ValueError, RecursionError):
            raise MeterRejected("malformed", f"HTTP {r.status_code}: not JSON") from None
        if r.status_code != 200 and not (isinstance(doc, dict) and doc.get("status") == "error"):
            raise MeterRejected("query_failed", f"HTTP {r.status_code}")
        return prometheus_watts(doc, self.max_w)

    async def close(self) -> None:
        await self.client.aclose()


def make_source(spec: MeterSpec, where: str, tls: TlsContexts) -> Source:
    """The source a spec names; MeterConfigError naming the field if it cannot be set up."""
    if spec.redfish is not None:
        return RedfishSource(spec.redfish, spec.max_w, spec.timeout_s, where + ".meter", tls)
    assert spec.prometheus is not None
    return PrometheusSource(spec.prometheus, spec.max_w, spec.timeout_s, where + ".meter", tls)


class _Halt:
    """A stop signal from any thread to one reader thread's loop: `set` from anywhere;
    the loop's pollers wait on `event`. Either the setter sees the loop, or the loop,
    once it exists, sees the flag (it looks after storing itself)."""

    def __init__(self) -> None:
        self.flag = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.event: asyncio.Event | None = None

    def attach(self) -> asyncio.Event:
        """(in the reader's loop) The event its pollers wait on."""
        self.event = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        if self.flag.is_set():
            self.event.set()
        return self.event

    def set(self) -> None:
        self.flag.set()
        loop, event = self.loop, self.event
        if loop is not None and event is not None:
            with contextlib.suppress(RuntimeError):  # its loop has closed: nothing to stop
                loop.call_soon_threadsafe(event.set)

    def is_set(self) -> bool:
        return self.flag.is_set()


class MeterReader:
    """Polls each metered group's meter into `book`, from a thread with its own event loop.
    `start(specs)` (group → (spec, its path in the policy)) begins; `stop` ends; a new
    policy's meters: `stop(wait=False)` then `start`. Neither waits on the thread unless
    asked: both are safe to call from the controller's event loop."""

    def __init__(self, book: MeterBook, clock: Clock) -> None:
        self.book = book
        self.clock = clock
        self._thread: threading.Thread | None = None
        self._halt = _Halt()
        self._specs: dict[str, MeterSpec] = {}  # what the book's readings were read with
        self.polls = 0

    def start(self, specs: Mapping[str, tuple[MeterSpec, str]]) -> None:
        if self._thread is not None:
            raise RuntimeError("the meter reader is running")
        self._halt = halt = _Halt()
        # A group whose meter changed starts unread: the old meter's last reading is not
        # the new one's, and the old reader (its token refused) writes nothing more.
        changed = [
            g
            for g, (spec, _) in specs.items()
            if g not in self._specs or self._specs[g].source != spec.source
        ]
        self.book.claim(halt, specs, forget=changed)
        self._specs = {g: spec for g, (spec, _) in specs.items()}
        if not specs:
            return
        self._thread = threading.Thread(
            target=self._run, args=(dict(specs), halt), name="powerd-meters", daemon=True
        )
        self._thread.start()

    @property
    def running(self) -> bool:
        """Whether its thread polls (False before `start`, after `stop`, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def stop(self, *, wait: bool = True, forget: bool = False) -> None:
        """Stop polling; with `wait`, until the thread has closed its connections (up to a
        poll's timeout: call it off the event loop). Without, it ends on its own and writes
        nothing more. With `forget`, the next `start` begins with every meter unread."""
        thread, self._thread = self._thread, None
        self._halt.set()
        if forget:
            self._specs = {}
        if thread is not None and wait:
            thread.join(timeout=70)

    def _run(self, specs: dict[str, tuple[MeterSpec, str]], halt: _Halt) -> None:
        async def main() -> None:
            stop = halt.attach()
            tls = TlsContexts()
            async with asyncio.TaskGroup() as tg:
                for k, (group, (spec, where)) in enumerate(specs.items()):
                    # First polls spread over a poll period, not all in one burst.
                    first_s = spec.poll_s * k / len(specs)
                    tg.create_task(
                        self._poll(
                            group, spec, where, halt=halt, stop=stop, tls=tls, first_s=first_s
                        ),
                        name=f"meter-{group}",
                    )

        try:
            asyncio.run(main())
        except Exception:
            log.exception("meter_reader_failed")

    async def _poll(
        self,
        group: str,
        spec: MeterSpec,
        where: str,
        *,
        halt: _Halt,
        stop: asyncio.Event,
        tls: TlsContexts,
        first_s: float = 0.0,
    ) -> None:
        loop = asyncio.get_running_loop()
        source: Source | None = None
        last_error: str | None = None
        files = meter_files(spec)
        stamp: FileStamp = ()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), first_s)
        try:
            while not stop.is_set():
                started = loop.time()
                if source is None:
                    stamp = file_stamp(files)  # this thread's loop: no tick waits on it
                    try:
                        source = make_source(spec, where, tls)
                    except MeterConfigError as exc:
                        self.book.fail(group, str(exc), self.clock.monotonic(), token=halt)
                    except Exception as exc:  # one meter's fault must not end the others' polls
                        why = f"{where}.meter: cannot be set up ({type(exc).__name__}: {exc})"
                        self.book.fail(group, why, self.clock.monotonic(), token=halt)
                if source is not None:
                    error = await self._read_once(group, spec, source, halt)
                    if error is not None and file_stamp(files) != stamp:
                        # Rotated credentials or trust: the next poll builds from the files
                        # as they are now (a session that still works is kept until then).
                        await self._close(source, spec)
                        source = None
                    if error != last_error and error is not None:
                        log.warning("meter_failed", group=group, error=error[:MAX_ERROR_CHARS])
                    elif error is None and last_error is not None:
                        log.info("meter_reads", group=group)
                    last_error = error
                left = spec.poll_s - (loop.time() - started)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), max(left, 0.0))
        finally:
            if source is not None:
                await self._close(source, spec)

    @staticmethod
    async def _close(source: Source, spec: MeterSpec) -> None:
        with contextlib.suppress(TimeoutError, httpx.HTTPError, OSError):
            await asyncio.wait_for(source.close(), spec.timeout_s)

    async def _read_once(
        self, group: str, spec: MeterSpec, source: Source, halt: _Halt
    ) -> str | None:
        """One poll into the book (nothing once halted); the failure, None if it read."""
        self.polls += 1
        reason: str | None = None
        try:
            watts = await asyncio.wait_for(source.read(), spec.timeout_s)
        except MeterRejected as exc:
            reason, error = exc.reason, f"rejected: {exc}"
        except TimeoutError:
            error = f"no answer within {spec.timeout_s:g} s"
        except RedfishError as exc:
            error = str(exc)
            reason = _redfish_rejection(error)
        except (httpx.HTTPError, OSError) as exc:
            error = str(exc) or type(exc).__name__
        except Exception as exc:  # an answer is untrusted: nothing it holds stops the polls
            log.exception("meter_read_failed", group=group)
            error = f"{type(exc).__name__}: {exc}"
        else:
            if not halt.is_set():
                self.book.put(group, watts, self.clock.monotonic(), token=halt)
            return None
        if not halt.is_set():
            self.book.fail(group, error, self.clock.monotonic(), reason=reason, token=halt)
        return error


def _redfish_rejection(error: str) -> str | None:
    """The rejection a Redfish client's error is, if the answer itself was refused (too
    large, not JSON) rather than missing: counted as rejected answers are."""
    if "larger than" in error:
        return "too_large"
    if "not JSON" in error or "not a JSON object" in error or "undecodable" in error:
        return "malformed"
    return None


def meter_specs(policy: Policy) -> dict[str, tuple[MeterSpec, str]]:
    """Group name → (its meter, its path in the policy file)."""
    return {g.name: (g.meter, g.path) for g in policy.groups if g.meter is not None}
