"""MQTT transport over aiomqtt: one connection kept up with capped, jittered backoff."""

from __future__ import annotations

import asyncio
import random
import socket
import ssl
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

import aiomqtt
import paho.mqtt.client as mqtt
import structlog

from powerd.transport.base import (
    ConnectionState,
    LastWill,
    Message,
    OnConnect,
    Transport,
    TransportError,
    cancel_and_wait,
    check_filter,
    check_topic,
)
from powerd.transport.reader import PacketReader

log = structlog.get_logger(__name__)

DEFAULT_PORTS = {"mqtt": 1883, "mqtts": 8883}

# The largest TCP segment a connection sends or takes (TCP_MAXSEG, set before connecting).
# Over loopback the MSS is ~64 KiB, and Linux sizes a receive window from the packets that
# arrive: a broker that has only had small packets from us advertises less than that
# (58 KiB seen). Once a burst leaves a backlog, the kernel queues it in full-size segments
# that never fit that window, and the connection crawls on zero-window probes (seen: the
# controller's 4 MB of commands stuck for tens of seconds, Mosquitto on the same host).
# Real networks' MSS (1,448 bytes; 8,948 with jumbo frames) is about this or below.
MAX_SEGMENT_BYTES = 8192


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
    # QoS 1 messages sent ahead of the broker's acknowledgements (paho's default; 0: no limit).
    max_inflight_messages: int = 20

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
        if not self.tls:
            return None
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if self.cert_file is not None:
            ctx.load_cert_chain(self.cert_file, self.key_file)
        if self.tls_insecure:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        return ctx


def backoff_delay(attempt: int, min_s: float, max_s: float, rng: random.Random) -> float:
    """Delay before reconnection attempt `attempt` (0-based): exponential, capped, jittered.

    The jitter (a uniform draw over the upper half) keeps a fleet of agents that lost the
    same broker from reconnecting in lockstep.
    """
    ceiling = min(max_s, min_s * 2.0 ** min(attempt, 62))
    return rng.uniform(ceiling / 2, ceiling)


def connect_tcp(
    host: str, port: int, timeout_s: float, source: tuple[str, int] | None = None
) -> socket.socket:
    """A connected TCP socket (each address of `host` in turn, as socket.create_connection),
    set up before the handshake: no Nagle delay (commands and acks are small and urgent:
    ~40 ms with delayed ACKs) and segments of at most MAX_SEGMENT_BYTES."""
    error: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, MAX_SEGMENT_BYTES)
            sock.settimeout(timeout_s)
            if source is not None and (source[0] or source[1]):
                sock.bind(source)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            error = exc
            continue
        return sock
    raise error or OSError(f"no address for {host}")


class MqttTransport(Transport):
    def __init__(self, config: MqttConfig, rng: random.Random | None = None) -> None:
        self.config = config
        self.client_id = config.client_id or f"powerd-{uuid.uuid4().hex[:12]}"
        self.dropped_messages = 0  # incoming messages dropped: nobody read them, or a bad topic
        self._rng = rng or random.Random()
        self._ssl = config.ssl_context()
        self._state = ConnectionState.CLOSED
        self._connected = asyncio.Event()
        self._client: aiomqtt.Client | None = None
        self._write: Callable[[], None] = lambda: None  # this connection's writer
        self._subscriptions: dict[str, int] = {}
        self._queue: asyncio.Queue[Message | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._warned_reader = False  # paho without the parts PacketReader uses: said once

    @property
    def state(self) -> ConnectionState:
        return self._state

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
        self._queue = asyncio.Queue()
        self._task = asyncio.create_task(
            self._keep_connected(will, on_connect), name=f"mqtt-{self.client_id}"
        )
        self._task.add_done_callback(self._log_task_end)

    def _log_task_end(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("mqtt_task_failed", client_id=self.client_id, exc_info=task.exception())
            self._set_state(ConnectionState.CLOSED)
            self._queue.put_nowait(None)

    async def wait_connected(self) -> None:
        await self._connected.wait()

    def _new_client(self, will: LastWill | None) -> aiomqtt.Client:
        c = self.config
        return aiomqtt.Client(
            c.host,
            c.port,
            username=c.username,
            password=c.password,
            identifier=self.client_id,
            will=None
            if will is None
            else aiomqtt.Will(will.topic, will.payload, will.qos, will.retain),
            keepalive=c.keepalive_s,
            timeout=c.timeout_s,
            tls_context=self._ssl,
            max_inflight_messages=c.max_inflight_messages,
        )

    async def _keep_connected(self, will: LastWill | None, on_connect: OnConnect | None) -> None:
        attempt = 0
        while True:
            self._set_state(ConnectionState.CONNECTING)
            error = "connection closed"
            client = self._new_client(will)
            self._open_socket(client)
            try:
                async with client:
                    self._take_messages(client)
                    self._write = self._write_in_step(client)
                    for topic_filter, qos in list(self._subscriptions.items()):
                        await client.subscribe(topic_filter, qos)
                    self._client = client
                    self._set_state(ConnectionState.CONNECTED)
                    log.info("mqtt_connected", broker=f"{self.config.host}:{self.config.port}")
                    attempt = 0
                    if on_connect is not None:
                        await self._run_on_connect(on_connect)
                    await self._receive_until_disconnected(client)
            except aiomqtt.MqttError as exc:
                error = str(exc)
            finally:
                self._client = None
                self._set_state(ConnectionState.DISCONNECTED)
            delay = backoff_delay(
                attempt, self.config.reconnect_min_s, self.config.reconnect_max_s, self._rng
            )
            log.warning(
                "mqtt_disconnected",
                broker=f"{self.config.host}:{self.config.port}",
                error=error,
                attempt=attempt,
                retry_in_s=round(delay, 2),
            )
            attempt += 1
            await asyncio.sleep(delay)

    async def _receive_until_disconnected(self, client: aiomqtt.Client) -> None:
        """Wait until the connection ends, then raise MqttError as aiomqtt's iterator does."""
        # Shielded: cancelling this task must not cancel aiomqtt's own future.
        await asyncio.shield(client._disconnected)
        raise aiomqtt.MqttError("Disconnected")

    def _take_messages(self, client: aiomqtt.Client) -> None:
        """Have every incoming message go straight to our queue.

        aiomqtt's own message iterator starts a task and an `asyncio.wait` per message and
        builds a validated Topic for each: at 10k GPUs (~3,750 messages a second) that was
        the controller's largest cost. A `PacketReader` reads for paho (see reader.py) and
        hands PUBLISH packets to `_deliver`; paho's callback takes those it still parses
        itself. Set once connected, before subscribing, so retained messages are not left
        in aiomqtt's queue.
        """
        paho = client._client

        def on_message(_client: object, _userdata: object, m: mqtt.MQTTMessage) -> None:
            self._deliver(m._topic, bytes(m.payload), bool(m.retain))

        paho.on_message = on_message  # aiomqtt has no per-message callback
        if paho._transport != "tcp":  # websockets: paho's own reader
            return
        if PacketReader.fits(paho):
            PacketReader(paho, self._deliver).install()
        elif not self._warned_reader:
            self._warned_reader = True
            log.warning("mqtt_reader_unsupported", paho=getattr(mqtt, "__version__", "?"))

    def _deliver(self, topic: bytes, payload: bytes, retain: bool) -> None:
        try:
            name = topic.decode()
        except UnicodeDecodeError:  # an exception here would end the connection
            self.dropped_messages += 1
            log.warning("mqtt_bad_topic", topic=repr(topic[:200]))
            return
        self._enqueue(Message(name, payload, retain))

    @staticmethod
    def _open_socket(client: aiomqtt.Client) -> None:
        """Have paho open its TCP connection with our options set before connecting (those
        aiomqtt sets come after the handshake, too late for the segment size)."""
        paho = client._client
        plain = paho._create_socket_connection

        def create_socket_connection() -> socket.socket:
            if paho._get_proxy():
                return plain()
            return connect_tcp(
                paho._host,
                paho._port,
                paho._connect_timeout,
                (paho._bind_address, paho._bind_port),
            )

        paho._create_socket_connection = create_socket_connection  # type: ignore[method-assign]

    @staticmethod
    def _write_in_step(client: aiomqtt.Client) -> Callable[[], None]:
        """Register and remove paho's writer callback at once, from here on; returns the
        writer, which publish_many also calls to write a batch without waiting.

        aiomqtt adds the writer through call_soon_threadsafe (paho may ask from the thread
        that connects) but removes it at once. A batch written before the loop's next turn
        (publish_many) is removed before it is added: the writer then stays registered while
        paho believes it gone, and the loop spins on a writable socket (a whole core, seen at
        10k GPUs). Once connected, paho asks only from the loop's own thread.
        """
        paho = client._client
        loop = asyncio.get_running_loop()

        def write() -> None:
            try:
                paho.loop_write()
            except Exception as exc:  # as aiomqtt's own writer: the connection is broken
                if not client._disconnected.done():
                    client._disconnected.set_exception(exc)

        def register(_client: object, _userdata: object, sock: Any) -> None:
            loop.add_writer(sock, write)

        def unregister(_client: object, _userdata: object, sock: Any) -> None:
            loop.remove_writer(sock)

        paho.on_socket_register_write = register
        paho.on_socket_unregister_write = unregister
        sock = paho.socket()
        if sock is not None and paho.want_write():
            loop.add_writer(sock, write)
        return write

    async def _run_on_connect(self, on_connect: OnConnect) -> None:
        try:
            await on_connect()
        except TransportError as exc:
            # The connection dropped again; the next connection runs the callback again.
            log.warning("mqtt_on_connect_failed", error=str(exc))

    def _enqueue(self, message: Message) -> None:
        if self._queue.qsize() >= self.config.max_queued_messages:
            # Drop the oldest: the newest command or sample is the one worth acting on.
            self._queue.get_nowait()
            self.dropped_messages += 1
        self._queue.put_nowait(message)

    async def publish(self, topic: str, payload: bytes, qos: int = 0, retain: bool = False) -> None:
        check_topic(topic)
        client = self._client
        if client is None:
            raise TransportError(f"not connected ({self._state}); dropped message to {topic}")
        try:
            await client.publish(
                topic, payload, qos=qos, retain=retain, timeout=self.config.timeout_s
            )
        except aiomqtt.MqttError as exc:
            raise TransportError(f"publish to {topic} failed: {exc}") from exc

    async def publish_many(
        self, messages: Sequence[tuple[str, bytes]], qos: int = 1, retain: bool = False
    ) -> int:
        # aiomqtt's publish waits for each PUBACK in turn: 1,250 commands a tick would take
        # 1,250 broker round trips. paho queues and sends them (QoS 1, retried) on its own;
        # a command's real confirmation is the agent's ack.
        client = self._client
        if client is None:
            raise TransportError(f"not connected ({self._state}); dropped {len(messages)} messages")
        paho = client._client  # aiomqtt has no publish that does not wait
        failed = 0
        for topic, payload in messages:
            check_topic(topic)
            if paho.publish(topic, payload, qos, retain).rc != mqtt.MQTT_ERR_SUCCESS:
                failed += 1
        # Write now, as far as the socket takes it, without yielding: given to the event
        # loop, the batch would wait behind every message read and handled first (at 10k
        # GPUs, the ~600 that arrived while the tick ran: tens of milliseconds).
        self._write()
        return failed

    async def subscribe(self, topic_filter: str, qos: int = 1) -> None:
        check_filter(topic_filter)
        self._subscriptions[topic_filter] = qos
        client = self._client
        if client is None:
            return  # subscribed on (re)connection
        try:
            await client.subscribe(topic_filter, qos, timeout=self.config.timeout_s)
        except aiomqtt.MqttError as exc:
            log.warning("mqtt_subscribe_deferred", topic=topic_filter, error=str(exc))

    async def messages(self) -> AsyncIterator[Message]:
        while (message := await self._queue.get()) is not None:
            yield message

    async def disconnect(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            # Leaving the client's context sends DISCONNECT, so the broker drops the will.
            await cancel_and_wait([task])
        self._set_state(ConnectionState.CLOSED)
        self._queue.put_nowait(None)
