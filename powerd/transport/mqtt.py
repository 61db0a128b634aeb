"""MQTT transport: powerd speaks MQTT 3.1.1 itself (codec.py) over an asyncio connection.

One connection kept up with capped, jittered backoff; a clean session each time, so the
broker keeps nothing for us across a drop. Subscriptions are made again on every connection.

A QoS 1 message whose PUBACK does not come (within `timeout_s`, or before its connection
drops) is given up, never sent again: `publish` raises `PublishUnconfirmed` (a
`PublishTimeout` on time), whose `sent` says whether it had left and so may still be
delivered. Giving it up frees its place in the window at once, but its packet id only when
its PUBACK comes or the connection ends, so a late PUBACK never confirms another message
(docs/decisions/0001-mqtt-qos1-timeouts.md). powerd sends state, not events: the controller
sends every command again each tick, an agent its status on every connection.

Why our own client and not a library: powerd needs its socket options set before the
handshake (TCP_MAXSEG, see MAX_SEGMENT_BYTES), QoS 1 batches written without waiting for
each acknowledgement, and incoming messages handed over without a task or an object graph
each. paho's and aiomqtt's public APIs give none of these, and reaching into their private
parts broke on upgrades; the protocol part a client needs is small
(docs/decisions/0002-own-mqtt-client.md).
"""

from __future__ import annotations

import asyncio
import ipaddress
import random
import socket
import ssl
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

import structlog

from powerd.transport.base import (
    ConnectionState,
    LastWill,
    Message,
    OnConnect,
    PublishTimeout,
    PublishUnconfirmed,
    Transport,
    TransportError,
    cancel_and_wait,
    check_filter,
    check_topic,
)
from powerd.transport.codec import (
    DEFAULT_MAX_PACKET_BYTES,
    DISCONNECT,
    PINGREQ,
    SUBACK_FAILURE,
    Connack,
    Decoder,
    Packet,
    ProtocolError,
    Puback,
    Publish,
    Pubrel,
    Suback,
    encode_connect,
    encode_puback,
    encode_pubcomp,
    encode_publish,
    encode_pubrec,
    encode_subscribe,
)

log = structlog.get_logger(__name__)

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}


# The largest TCP segment a connection sends or takes (TCP_MAXSEG, set before connecting).
# Over loopback the MSS is much larger, and Linux sizes a receive window from the packets
# that arrive: a broker that has only had small packets from us advertises less than one
# such segment. Once a burst leaves a backlog, the kernel queues it in full-size segments
# that never fit that window, and the connection crawls on zero-window probes (the
# controller's commands stalled for seconds, Mosquitto on the same host:
# docs/decisions/0002-own-mqtt-client.md).
# Real networks' MSS (1,448 bytes; 8,948 with jumbo frames) is about this or below.
MAX_SEGMENT_BYTES = 8192

# Packet ids of messages given up without a PUBACK stay taken until it comes (MQTT 3.1.1,
# 2.3.1). A broker that has left this many unanswered on one live connection has stopped
# acknowledging; only a new (clean) session frees them, so the connection is dropped
# before the ids run out and every QoS 1 publish is refused.
MAX_ABANDONED_IDS = 0x8000


@dataclass(frozen=True)
class MqttConfig:
    host: str
    port: int = 1883
    tls: bool = False
    username: str | None = None
    password: str | None = None
    ca_file: Path | None = None  # None: the system's trust store
    cert_file: Path | None = None  # client certificate, for brokers that require one
    key_file: Path | None = None
    tls_insecure: bool = False  # skip certificate and host name checks (testing only)
    client_id: str | None = None  # None: a random one per transport
    keepalive_s: int = 15
    timeout_s: float = 5.0  # connect, subscribe and QoS 1 publish acknowledgements
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 30.0
    max_queued_messages: int = 10_000
    # QoS 1 messages sent ahead of the broker's acknowledgements (0: no limit); the rest wait
    # for PUBACKs. 20 is what MQTT clients commonly default to.
    max_inflight_messages: int = 20
    max_packet_bytes: int = DEFAULT_MAX_PACKET_BYTES  # larger incoming packets: disconnect

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        username: str | None = None,
        password: str | None = None,
        **options: object,
    ) -> MqttConfig:
        """`mqtt://[user[:password]@]host[:port]` or `mqtts://...`; explicit credentials win."""
        parts = urlsplit(url)
        if parts.scheme not in DEFAULT_PORTS:
            raise ValueError(f"broker URL {url!r} must start with mqtt:// or mqtts://")
        if not parts.hostname:
            raise ValueError(f"broker URL {url!r} has no host")
        if parts.path not in ("", "/") or parts.query or parts.fragment:
            raise ValueError(f"broker URL {url!r} must not have a path, query or fragment")
        try:
            port = parts.port or DEFAULT_PORTS[parts.scheme]
        except ValueError as exc:
            raise ValueError(f"broker URL {url!r}: {exc}") from None
        url_user = unquote(parts.username) if parts.username else None
        url_password = unquote(parts.password) if parts.password else None
        return cls(
            host=parts.hostname,
            port=port,
            tls=parts.scheme == "mqtts",
            username=username or url_user,
            password=password or url_password,
            **options,  # type: ignore[arg-type]
        )

    def ssl_context(self) -> ssl.SSLContext | None:
        """None for plain MQTT. ValueError, naming the files, if they cannot be loaded."""
        if not self.tls:
            return None
        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file is not None:
                ctx.load_cert_chain(self.cert_file, self.key_file)
        except (OSError, ssl.SSLError) as exc:  # FileNotFoundError does not name the file
            files = {
                "ca_file": self.ca_file,
                "cert_file": self.cert_file,
                "key_file": self.key_file,
            }
            named = ", ".join(f"{k} {str(v)!r}" for k, v in files.items() if v is not None)
            raise ValueError(f"cannot load the broker's TLS files ({named}): {exc}") from None
        if self.tls_insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def backoff_delay(attempt: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before reconnection attempt `attempt` (0-based): exponential, capped, jittered.

    The jitter (a uniform draw over the upper half) keeps a fleet of agents that lost the
    same broker from reconnecting in lockstep.
    """
    ceiling = min(max_s, min_s * 2.0 ** min(attempt, 62))
    return rng.uniform(ceiling / 2, ceiling)


def _tcp_socket(family: int, kind: int, proto: int) -> socket.socket:
    """A TCP socket set up for the handshake: no Nagle delay (commands and acks are small
    and urgent: ~40 ms with delayed ACKs) and segments of at most MAX_SEGMENT_BYTES."""
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MAX_SEGMENT_BYTES)
    except OSError:
        sock.close()
        raise
    return sock


async def open_tcp(host: str, port: int, timeout_s: float) -> socket.socket:
    """A connected, non-blocking TCP socket, trying each address of `host` in turn (as
    socket.create_connection does) without blocking the event loop; our options
    (`_tcp_socket`) are set before the handshake."""
    loop = asyncio.get_running_loop()
    error: OSError | None = None
    for family, kind, proto, _, address in await loop.getaddrinfo(
        host, port, type=socket.SOCK_STREAM
    ):
        sock = _tcp_socket(family, kind, proto)
        try:
            sock.setblocking(False)
            await asyncio.wait_for(loop.sock_connect(sock, address), timeout_s)
        except OSError as exc:  # TimeoutError included
            sock.close()
            error = exc
            continue
        except BaseException:
            sock.close()
            raise
        return sock
    raise error or OSError(f"no address for {host}")


Deliver = Callable[[bytes, bytes, bool], None]  # (topic, payload, retain)
Waiter = asyncio.Future[None] | None  # a publish() waiting for the PUBACK; None: publish_many


class _Connection(asyncio.Protocol):
    """One connection to the broker (TCP or TLS): the session's state and the hot path.

    `data_received` decodes every complete packet of a read, hands each PUBLISH straight to
    `deliver`, and writes what answers them (PUBACKs, and for QoS 2 PUBREC/PUBCOMP) as one
    write, in the order their messages came (MQTT 3.1.1, 4.6), together with the QoS 1
    messages the returned PUBACKs let out of the window.
    """

    def __init__(
        self,
        deliver: Deliver,
        window: int,
        max_packet_bytes: int,
        on_written: list[Callable[[], None]],
        *,
        puback_timeout_s: float,
    ) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._deliver = deliver
        self._decoder = Decoder(max_packet_bytes)
        self._window = window  # 0: no limit
        self._puback_timeout_s = puback_timeout_s
        self._on_written = on_written
        self._transport: asyncio.Transport | None = None
        self.connack: asyncio.Future[Connack] = loop.create_future()
        self.closed: asyncio.Future[None] = loop.create_future()
        self.error = "connection closed"
        self.last_received = self.last_sent = self.last_ping = loop.time()
        # Packet ids in use: QoS 1 messages sent and not yet acknowledged, oldest first (who
        # waits, when written), SUBSCRIBEs waiting for their SUBACK, and messages given up
        # whose PUBACK may still come (the module's docstring).
        self.unacked: dict[int, tuple[Waiter, float]] = {}
        self.subscribing: dict[int, asyncio.Future[tuple[int, ...]]] = {}
        self.abandoned: set[int] = set()
        self._expiry: asyncio.TimerHandle | None = None  # for the oldest in `unacked`
        # QoS 1 messages held back by the window: (topic, payload, retain, waiter).
        self.held: deque[tuple[bytes, bytes, bool, Waiter]] = deque()
        self.qos2_in: set[int] = set()  # incoming QoS 2 delivered, PUBREL not yet come
        self._last_id = 0

    # -- asyncio's side ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self._transport = transport
        # Told when the write buffer has run empty (resume_writing): see on_written.
        transport.set_write_buffer_limits(high=0)

    def data_received(self, data: bytes) -> None:
        self.last_received = self._loop.time()
        try:
            packets = self._decoder.feed(data)
        except ProtocolError as exc:
            self.fail(f"protocol error: {exc}")
            return
        deliver = self._deliver
        out: list[bytes] = []
        released = False
        for p in packets:
            if p.__class__ is Publish:
                assert isinstance(p, Publish)
                qos = p.qos
                if qos == 1:
                    out.append(encode_puback(p.packet_id))
                elif qos == 2:
                    out.append(encode_pubrec(p.packet_id))
                    if p.packet_id in self.qos2_in:
                        continue  # sent again before our PUBREC arrived: delivered once
                    self.qos2_in.add(p.packet_id)
                deliver(p.topic, p.payload, p.retain)
            elif p.__class__ is Puback:
                assert isinstance(p, Puback)
                self._acknowledged(p.packet_id)
                released = True
            else:
                self._control(p, out)
        if released and self.held:
            self._release(out)
        if out:
            self.write(b"".join(out))

    def _acknowledged(self, packet_id: int) -> None:
        if packet_id not in self.unacked:
            if packet_id in self.abandoned:
                # Too late for its sender, who was told; now its id may be used again.
                self.abandoned.discard(packet_id)
                log.info("mqtt_late_puback", packet_id=packet_id)
            else:
                log.debug("mqtt_unknown_puback", packet_id=packet_id)
            return
        waiter, _ = self.unacked.pop(packet_id)
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _control(self, p: Packet, out: list[bytes]) -> None:
        if isinstance(p, Pubrel):
            self.qos2_in.discard(p.packet_id)
            out.append(encode_pubcomp(p.packet_id))
        elif isinstance(p, Suback):
            waiter = self.subscribing.pop(p.packet_id, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(p.granted)
        elif isinstance(p, Connack):
            if self.connack.done():
                self.fail("protocol error: a second CONNACK")
            else:
                self.connack.set_result(p)
        # PINGRESP: its arrival (last_received) is all it says. PUBREC, PUBCOMP, UNSUBACK
        # answer what we never send (QoS 2 publishes, UNSUBSCRIBE): nothing to do.

    def resume_writing(self) -> None:
        if not self.held:
            for callback in self._on_written:
                callback()

    def pause_writing(self) -> None:
        pass  # nothing here writes without end: see publish_many's window

    def connection_lost(self, exc: Exception | None) -> None:
        if exc is not None and self.error == "connection closed":
            self.error = str(exc) or type(exc).__name__
        if self._expiry is not None:
            self._expiry.cancel()
            self._expiry = None
        # Given up, not sent again on the next connection: see the module's docstring.
        if self.unacked or self.held:
            log.info("mqtt_qos1_given_up", sent=len(self.unacked), unsent=len(self.held))
        for waiter, _ in self.unacked.values():
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    PublishUnconfirmed(f"{self.error} before its PUBACK", sent=True)
                )
        for *_, waiter in self.held:
            if waiter is not None and not waiter.done():
                waiter.set_exception(PublishUnconfirmed(f"{self.error}; never sent", sent=False))
        lost = TransportError(self.error)
        for sub in self.subscribing.values():
            if not sub.done():
                sub.set_exception(lost)
        if not self.connack.done():
            self.connack.set_exception(lost)
        self.unacked.clear()
        self.held.clear()
        self.subscribing.clear()
        self.abandoned.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    # -- our side ----------------------------------------------------------------------

    @property
    def closing(self) -> bool:
        return self._transport is None or self._transport.is_closing()

    @property
    def unwritten(self) -> int:
        """QoS 1 messages held back by the window plus bytes not yet given to the socket."""
        t = self._transport
        return len(self.held) + (t.get_write_buffer_size() if t is not None else 0)

    def write(self, data: bytes) -> None:
        t = self._transport
        if t is None or t.is_closing():
            return
        t.write(data)
        self.last_sent = self._loop.time()
        if self._on_written and not self.held and t.get_write_buffer_size() == 0:
            for callback in self._on_written:
                callback()

    def fail(self, reason: str) -> None:
        """Drop the connection at once (no DISCONNECT: the broker publishes our will)."""
        log.warning("mqtt_connection_failed", error=reason)
        self.error = reason
        if self._transport is not None:
            self._transport.abort()

    def disconnect(self) -> None:
        """DISCONNECT, then close once it is written: the broker drops our will."""
        if not self.closing:
            self.write(DISCONNECT)
        if self._transport is not None:
            self._transport.close()

    def next_id(self) -> int:
        """The next free packet id: 1..65535, wrapping, skipping those still in use."""
        for _ in range(0xFFFF):
            self._last_id = last = self._last_id % 0xFFFF + 1
            if not (last in self.unacked or last in self.subscribing or last in self.abandoned):
                return last
        raise TransportError("all 65,535 packet ids are in use")

    def send_qos1(self, messages: list[tuple[bytes, bytes]], retain: bool, waiter: Waiter) -> int:
        """Send QoS 1 messages as far as the window lets, in one write, and hold back the rest;
        returns how many could not be taken (every packet id in use: the broker stopped
        acknowledging)."""
        out: list[bytes] = []
        refused = 0
        now = self._loop.time()
        for i, (topic, payload) in enumerate(messages):
            if self.held or self._window_full():
                self.held.append((topic, payload, retain, waiter))
                continue
            try:
                self._publish_one(topic, payload, retain, waiter, out, now=now)
            except TransportError:
                refused = len(messages) - i
                break
        if out:
            self.write(b"".join(out))
            self._arm_expiry()
        return refused

    def _release(self, out: list[bytes]) -> None:
        now = self._loop.time()
        while self.held and not self._window_full():
            self._publish_one(*self.held.popleft(), out, now=now)
        self._arm_expiry()

    def _window_full(self) -> bool:
        return bool(self._window) and len(self.unacked) >= self._window

    def _publish_one(
        self,
        topic: bytes,
        payload: bytes,
        retain: bool,
        waiter: Waiter,
        out: list[bytes],
        *,
        now: float,
    ) -> None:
        """One QoS 1 PUBLISH under a fresh packet id, appended to `out`."""
        packet_id = self.next_id()
        self.unacked[packet_id] = (waiter, now)
        out.append(encode_publish(topic, payload, 1, retain, packet_id))

    # -- PUBACKs that do not come --------------------------------------------------------

    def _arm_expiry(self) -> None:
        if self._expiry is None and self.unacked:
            _, sent_at = next(iter(self.unacked.values()))
            self._expiry = self._loop.call_at(sent_at + self._puback_timeout_s, self._expire)

    def _expire(self) -> None:
        """Give up every message whose PUBACK is overdue: publish_many's too, which nobody
        waits for, or a lost PUBACK would hold its place in the window for good."""
        self._expiry = None
        cutoff = self._loop.time() - self._puback_timeout_s
        overdue: list[int] = []
        for packet_id, (_, sent_at) in self.unacked.items():
            if sent_at > cutoff:
                break  # oldest first: the rest are younger still
            overdue.append(packet_id)
        if overdue:
            log.warning(
                "mqtt_puback_timeout",
                messages=len(overdue),
                packet_ids=overdue[:10],
                timeout_s=self._puback_timeout_s,
            )
            self._give_up(overdue)
        self._arm_expiry()

    def _give_up(self, packet_ids: list[int]) -> None:
        """Give up sent messages: their places in the window go to held ones now, their ids
        stay taken until their PUBACKs come (a late one then confirms nothing else)."""
        for packet_id in packet_ids:
            waiter, _ = self.unacked.pop(packet_id)
            self.abandoned.add(packet_id)
            if waiter is not None and not waiter.done():
                waiter.set_exception(
                    PublishTimeout(f"no PUBACK within {self._puback_timeout_s} s", sent=True)
                )
        if len(self.abandoned) >= MAX_ABANDONED_IDS:
            self.fail(f"{len(self.abandoned)} PUBACKs never came")
            return
        out: list[bytes] = []
        self._release(out)
        if out:
            self.write(b"".join(out))

    def withdraw(self, waiter: asyncio.Future[None], *, sent_too: bool) -> bool:
        """Give up the message of one publish(): taken from the window's queue if it is still
        there (False: it never leaves), else given up in flight if `sent_too` (True: it
        left, and the broker may have it). Nobody reads `waiter` after this."""
        waiter.cancel()
        for i, (*_, w) in enumerate(self.held):
            if w is waiter:
                del self.held[i]
                return False
        if sent_too:
            found = [pid for pid, (w, _) in self.unacked.items() if w is waiter]
            self._give_up(found)
        return True


class MqttTransport(Transport):
    """`Transport` over MQTT 3.1.1 (see the module's docstring).

    Beyond `Transport`: `dropped_messages` (incoming messages dropped: nobody read them in
    time, or a topic that is not UTF-8), `unwritten` and `on_written` (callbacks run each
    time everything published so far has been given to the socket; bench/loop.py times its
    ticks with them).
    """

    def __init__(self, config: MqttConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.client_id = config.client_id or f"powerd-{uuid.uuid4().hex[:12]}"
        self.dropped_messages = 0
        self.on_written: list[Callable[[], None]] = []
        self._rng = rng or random.Random()
        self._ssl = config.ssl_context()
        self._state = ConnectionState.CLOSED
        self._connected = asyncio.Event()
        self._conn: _Connection | None = None  # while connected
        self._subscriptions: dict[str, int] = {}
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None

    @property
    def state(self) -> ConnectionState:
        return self._state

    @property
    def unwritten(self) -> int:
        """QoS 1 messages held back by the window plus bytes not yet given to the socket."""
        return self._conn.unwritten if self._conn is not None else 0

    @property
    def in_flight(self) -> int:
        """QoS 1 messages sent and waiting for their PUBACK: the places taken in the window."""
        return len(self._conn.unacked) if self._conn is not None else 0

    def _set_state(self, state: ConnectionState) -> None:
        self._state = state
        if state is ConnectionState.CONNECTED:
            self._connected.set()
        else:
            self._connected.clear()

    async def connect(
        self, will: LastWill | None = None, on_connect: OnConnect | None = None
    ) -> None:
        if self._task is not None:
            raise RuntimeError("already connected or connecting")
        self._set_state(ConnectionState.CONNECTING)
        self._warn_if_unverified()
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(
            self._keep_connected(will, on_connect), name=f"mqtt-{self.client_id}"
        )
        self._task.add_done_callback(self._log_task_end)

    def _warn_if_unverified(self) -> None:
        """Nothing checks that a broker reached without verified TLS is the site's
        (docs/safety.md, "Which broker"): say so once, unless it is on this host."""
        c = self.config
        if c.tls and not c.tls_insecure:
            return
        if not c.tls and _is_loopback(c.host):
            return
        log.warning(
            "mqtt_broker_not_verified",
            broker=f"{c.host}:{c.port}",
            why="tls_insecure: the certificate is not checked" if c.tls else "plain MQTT",
            hint="use mqtts:// with tls_ca_file set to the site's CA",
        )

    def _log_task_end(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("mqtt_task_failed", client_id=self.client_id, exc_info=task.exception())
            self._set_state(ConnectionState.CLOSED)
            self._queue.put_nowait(None)

    async def wait_connected(self) -> None:
        await self._connected.wait()

    async def _keep_connected(self, will: LastWill | None, on_connect: OnConnect | None) -> None:
        attempt = 0
        broker = f"{self.config.host}:{self.config.port}"
        while True:
            self._set_state(ConnectionState.CONNECTING)
            error = "connection closed"
            conn: _Connection | None = None
            try:
                conn = await self._open(will)
                for topic_filter, qos in list(self._subscriptions.items()):
                    await self._subscribe_on(conn, topic_filter, qos)
                self._conn = conn
                self._set_state(ConnectionState.CONNECTED)
                log.info("mqtt_connected", broker=broker)
                attempt = 0
                if on_connect is not None:
                    await self._run_on_connect(on_connect)
                await self._keep_alive(conn)
                error = conn.error
            except asyncio.CancelledError:
                if conn is not None:
                    conn.disconnect()
                raise
            except ssl.SSLCertVerificationError as exc:
                error = self._not_trusted(exc)
            except OSError as exc:  # TimeoutError and other ssl.SSLErrors included
                error = str(exc) or type(exc).__name__
            except TransportError as exc:
                error = str(exc)
            finally:
                self._conn = None
                if conn is not None and not conn.closing:
                    conn.fail(error)
                self._set_state(ConnectionState.DISCONNECTED)
            delay = backoff_delay(
                attempt, self.config.reconnect_min_s, self.config.reconnect_max_s, self._rng
            )
            log.warning(
                "mqtt_disconnected",
                broker=broker,
                error=error,
                attempt=attempt,
                retry_in_s=round(delay, 2),
            )
            attempt += 1
            await asyncio.sleep(delay)

    def _not_trusted(self, exc: ssl.SSLCertVerificationError) -> str:
        """The broker's certificate does not verify against the CA we trust (`ca_file`), or
        names another host: not our site's broker, or a broker in the middle. Nothing is
        sent to it, and we keep trying (the site's broker may come back at this address)."""
        reason = exc.verify_message or exc.reason or str(exc)
        log.error(
            "mqtt_broker_not_trusted",
            broker=f"{self.config.host}:{self.config.port}",
            ca_file=None if self.config.ca_file is None else str(self.config.ca_file),
            reason=reason,
            hint="the broker's certificate is not signed by the site's CA (tls_ca_file) "
            "or does not name this host: a foreign broker, or the wrong address",
        )
        return f"broker not trusted: {reason}"

    async def _open(self, will: LastWill | None) -> _Connection:
        """A connection on which the broker has accepted our CONNECT."""
        c = self.config
        loop = asyncio.get_running_loop()
        sock = await open_tcp(c.host, c.port, c.timeout_s)
        try:
            _, conn = await loop.create_connection(
                lambda: _Connection(
                    self._deliver,
                    c.max_inflight_messages,
                    c.max_packet_bytes,
                    self.on_written,
                    puback_timeout_s=c.timeout_s,
                ),
                sock=sock,
                ssl=self._ssl,
                server_hostname=c.host if self._ssl is not None else None,
                ssl_handshake_timeout=c.timeout_s if self._ssl is not None else None,
            )
        except BaseException:
            sock.close()
            raise
        try:
            conn.write(
                encode_connect(
                    self.client_id,
                    c.keepalive_s,
                    username=c.username,
                    password=c.password,
                    will_topic=None if will is None else will.topic,
                    will_payload=b"" if will is None else will.payload,
                    will_qos=0 if will is None else will.qos,
                    will_retain=False if will is None else will.retain,
                )
            )
            try:
                connack = await asyncio.wait_for(conn.connack, c.timeout_s)
            except TimeoutError:
                raise TransportError(f"no CONNACK within {c.timeout_s} s") from None
            if connack.return_code != 0:
                raise TransportError(f"connection refused: {connack.reason}")
        except BaseException:
            conn.fail("connection not accepted")
            raise
        return conn

    async def _keep_alive(self, conn: _Connection) -> None:
        """Return once the connection has ended. Meanwhile: a PINGREQ whenever we have sent
        nothing, or heard nothing, for `keepalive_s`; give up on a broker silent for 1.5
        times that (MQTT's own limit for the broker's side)."""
        keepalive = self.config.keepalive_s
        if keepalive <= 0:
            await asyncio.shield(conn.closed)
            return
        loop = asyncio.get_running_loop()
        while True:
            done, _ = await asyncio.wait([conn.closed], timeout=keepalive / 4)
            if done:
                return
            now = loop.time()
            silent_s = now - conn.last_received
            if silent_s >= 1.5 * keepalive:
                conn.fail(f"no packet from the broker for {silent_s:.1f} s")
                return
            if now - conn.last_sent >= keepalive or (
                silent_s >= keepalive and now - conn.last_ping >= keepalive / 2
            ):
                conn.last_ping = now
                conn.write(PINGREQ)

    async def _subscribe_on(self, conn: _Connection, topic_filter: str, qos: int) -> None:
        packet_id = conn.next_id()
        suback = asyncio.get_running_loop().create_future()
        conn.subscribing[packet_id] = suback
        conn.write(encode_subscribe(packet_id, [(topic_filter, qos)]))
        try:
            granted = await asyncio.wait_for(suback, self.config.timeout_s)
        except TimeoutError:
            conn.subscribing.pop(packet_id, None)
            raise TransportError(
                f"no SUBACK for {topic_filter} within {self.config.timeout_s} s"
            ) from None
        if granted[0] == SUBACK_FAILURE:
            log.warning("mqtt_subscribe_refused", topic=topic_filter)

    async def _run_on_connect(self, on_connect: OnConnect) -> None:
        try:
            await on_connect()
        except TransportError as exc:
            # The connection dropped again; the next connection runs the callback again.
            log.warning("mqtt_on_connect_failed", error=str(exc))

    def _deliver(self, topic: bytes, payload: bytes, retain: bool) -> None:
        try:
            name = topic.decode()
        except UnicodeDecodeError:
            self.dropped_messages += 1
            log.warning("mqtt_bad_topic", topic=repr(topic[:200]))
            return
        self._enqueue(Message(name, payload, retain))

    def _enqueue(self, message: Message) -> None:
        if self._queue.qsize() >= self.config.max_queued_messages:
            # Drop the oldest: the newest command or sample is the one worth acting on.
            self._queue.get_nowait()
            self.dropped_messages += 1
        self._queue.put_nowait(message)

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        """QoS 0: written at once. QoS 1: returns once the broker's PUBACK is in; if it is not in
        within `timeout_s`, or the connection drops first, the message is given up and
        `PublishUnconfirmed` says whether it had left (see its `sent`); any other
        TransportError means it was not taken at all. A cancelled call withdraws its message
        if it has not left yet. QoS 2 is not offered (nothing in powerd needs it)."""
        check_topic(topic)
        if qos not in (0, 1):
            raise ValueError(f"QoS {qos}: this transport publishes at QoS 0 or 1")
        conn = self._conn
        if conn is None:
            raise TransportError(f"not connected ({self._state}); dropped message to {topic}")
        if qos == 0:
            conn.write(encode_publish(topic, payload, 0, retain))
            return
        acked = asyncio.get_running_loop().create_future()
        if conn.send_qos1([(topic.encode(), payload)], retain, acked):
            raise TransportError(f"publish to {topic}: all 65,535 packet ids are in use")
        try:
            # asyncio.wait, not wait_for: on time it leaves `acked` alone, so what happened
            # to the message is still ours to settle.
            await asyncio.wait([acked], timeout=self.config.timeout_s)
        except asyncio.CancelledError:
            conn.withdraw(acked, sent_too=False)
            raise
        if not acked.done():
            sent = conn.withdraw(acked, sent_too=True)
            raise PublishTimeout(
                f"publish to {topic}: no PUBACK within {self.config.timeout_s} s"
                + ("" if sent else "; never sent"),
                sent=sent,
            )
        try:
            acked.result()
        except PublishUnconfirmed as exc:
            raise type(exc)(f"publish to {topic}: {exc}", sent=exc.sent) from None

    async def publish_many(
        self, messages: Sequence[tuple[str, bytes]], qos: int = 1, retain: bool = False
    ) -> int:
        """Write the batch now, without yielding to the event loop: given to the loop, it would
        wait until every message that arrived while the tick ran had been read and handled
        (telemetry, acks and statuses of the whole fleet: docs/performance.md, "Steering
        loop"). At QoS 1, up to `max_inflight_messages` unacknowledged (0: no limit); the rest
        leave as PUBACKs come back. A command's real confirmation is the agent's ack, so
        nothing here waits for the broker."""
        if qos not in (0, 1):
            raise ValueError(f"QoS {qos}: this transport publishes at QoS 0 or 1")
        conn = self._conn
        if conn is None:
            raise TransportError(f"not connected ({self._state}); dropped {len(messages)} messages")
        failed = 0
        batch: list[tuple[bytes, bytes]] = []
        for topic, payload in messages:
            check_topic(topic)
            name = topic.encode()
            if len(name) > 0xFFFF:
                failed += 1
                continue
            batch.append((name, payload))
        if qos == 0:
            conn.write(b"".join(encode_publish(t, p, 0, retain) for t, p in batch))
            return failed
        refused = conn.send_qos1(batch, retain, None)
        if refused:
            log.warning("mqtt_publish_failed", error="all packet ids in use", messages=refused)
        return failed + refused

    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        check_filter(topic_filter)
        self._subscriptions[topic_filter] = qos
        conn = self._conn
        if conn is None:
            return  # subscribed on (re)connection
        try:
            await self._subscribe_on(conn, topic_filter, qos)
        except TransportError as exc:
            log.warning("mqtt_subscribe_deferred", topic=topic_filter, error=str(exc))

    async def messages(self) -> AsyncIterator[Message]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def disconnect(self) -> None:
        task, self._task = self._task, None
        conn = self._conn
        if task is not None:
            # The task sends DISCONNECT as it ends, so the broker drops the will.
            await cancel_and_wait([task])
        if conn is not None:
            # Until the DISCONNECT has left: the caller may exit the process next.
            await asyncio.wait([conn.closed], timeout=self.config.timeout_s)
        self._set_state(ConnectionState.CLOSED)
        self._queue.put_nowait(None)
