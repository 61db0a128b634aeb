"""Transports: topic matching, the in-process broker, and MQTT against real brokers (Mosquitto,
and amqtt as a second, independent implementation), through a proxy that loses PUBACKs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import signal
import socket
import ssl
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.amqttbroker import Broker
from support.mqttproxy import MqttProxy, Pubacks
from support.pki import ConfiguredMosquitto, Pki, plain_tls_config

from powerd.testing.mosquitto import MOSQUITTO, LocalMosquitto, free_port
from powerd.transport import (
    ConnectionState,
    LastWill,
    MemoryBroker,
    Message,
    MqttConfig,
    MqttTransport,
    PublishTimeout,
    PublishUnconfirmed,
    Transport,
    TransportError,
    topic_matches,
)
from powerd.transport.base import cancel_and_wait, check_filter
from powerd.transport.codec import Decoder, Publish, encode_publish
from powerd.transport.mqtt import (
    MAX_ABANDONED_IDS,
    MAX_SEGMENT_BYTES,
    _Connection,
    backoff_delay,
    open_tcp,
)


@pytest.mark.parametrize(
    ("topic_filter", "topic", "matches"),
    [
        ("a/b/c", "a/b/c", True),
        ("a/b/c", "a/b", False),
        ("a/+/c", "a/x/c", True),
        ("a/+/c", "a/x/y/c", False),
        ("a/+", "a/", True),
        ("a/#", "a", True),
        ("a/#", "a/b/c", True),
        ("#", "a/b", True),
        ("+/+", "a/b", True),
        ("+", "a/b", False),
        ("powerd/v1/nodes/+/ack", "powerd/v1/nodes/n1/ack", True),
        ("powerd/v1/nodes/+/ack", "powerd/v1/nodes/n1/caps", False),
        ("#", "$SYS/broker/load", False),
        ("+/broker", "$SYS/broker", False),
        ("$SYS/#", "$SYS/broker", True),
    ],
)
def test_topic_matching(topic_filter: str, topic: str, matches: bool) -> None:
    assert topic_matches(topic_filter, topic) is matches


@pytest.mark.parametrize("bad", ["", "a/#/b", "a/b#", "a/b+/c", "#/a"])
def test_invalid_filters_are_refused(bad: str) -> None:
    with pytest.raises(ValueError, match="filter"):
        check_filter(bad)


def test_backoff_grows_is_capped_and_jittered() -> None:
    rng = random.Random(1)
    delays = [backoff_delay(a, 0.5, 30.0, rng) for a in range(12)]
    for attempt, d in enumerate(delays):
        ceiling = min(30.0, 0.5 * 2**attempt)
        assert ceiling / 2 <= d <= ceiling
    assert len(set(delays)) == len(delays)
    assert backoff_delay(10_000, 0.5, 30.0, rng) <= 30.0


def test_broker_urls() -> None:
    plain = MqttConfig.from_url("mqtt://127.0.0.1")
    assert (plain.host, plain.port, plain.tls, plain.username) == ("127.0.0.1", 1883, False, None)
    assert plain.ssl_context() is None
    secure = MqttConfig.from_url("mqtts://agent%40n1:p%3Ass@127.0.0.1:9883/", tls_insecure=True)
    assert (secure.port, secure.tls, secure.username, secure.password) == (
        9883,
        True,
        "agent@n1",
        "p:ss",
    )
    ctx = secure.ssl_context()
    assert ctx is not None
    assert ctx.verify_mode is ssl.CERT_NONE
    verified = MqttConfig.from_url("mqtts://127.0.0.1").ssl_context()
    assert verified is not None
    assert verified.verify_mode is ssl.CERT_REQUIRED
    assert verified.check_hostname
    for bad in ("http://127.0.0.1", "mqtt://", "mqtt://127.0.0.1/topic", "mqtt://127.0.0.1:99999"):
        with pytest.raises(ValueError, match="broker URL"):
            MqttConfig.from_url(bad)


# -- the in-process broker ---------------------------------------------------------------------


async def next_message(t: Transport) -> Message:
    return await asyncio.wait_for(anext(t.messages()), 5)


async def test_memory_broker_routes_by_filter_and_keeps_retained() -> None:
    broker = MemoryBroker()
    pub, sub = broker.client(), broker.client()
    await pub.connect()
    await sub.connect()
    await pub.publish("p/nodes/n1/status", b"up", retain=True)
    await pub.publish("p/nodes/n1/telemetry", b"t0")  # nobody listens yet: gone
    await sub.subscribe("p/nodes/+/status")
    assert await next_message(sub) == Message("p/nodes/n1/status", b"up", retain=True)
    await sub.subscribe("p/#")  # a new subscription gets the retained message again
    assert await next_message(sub) == Message("p/nodes/n1/status", b"up", retain=True)
    await pub.publish("p/nodes/n2/telemetry", b"t1")
    assert await next_message(sub) == Message("p/nodes/n2/telemetry", b"t1")

    await pub.publish("p/nodes/n1/status", b"", retain=True)  # clears the retained message
    assert (await next_message(sub)).payload == b""
    late = broker.client()
    await late.connect()
    await late.subscribe("p/#")
    await pub.publish("p/x", b"live")
    assert await next_message(late) == Message("p/x", b"live")


async def test_memory_broker_sends_the_will_only_when_a_client_vanishes() -> None:
    broker = MemoryBroker()
    watcher = broker.client()
    await watcher.connect()
    await watcher.subscribe("status/#")
    clean, crashed = broker.client(), broker.client()
    await clean.connect(will=LastWill("status/clean", b"offline"))
    await crashed.connect(will=LastWill("status/crashed", b"offline"))
    await clean.disconnect()
    crashed.crash()
    assert await next_message(watcher) == Message("status/crashed", b"offline")
    with pytest.raises(TransportError):
        await crashed.publish("status/crashed", b"still here?")


async def test_memory_broker_restart_reconnects_clients() -> None:
    broker = MemoryBroker()
    reconnected = 0

    async def on_connect() -> None:
        nonlocal reconnected
        reconnected += 1

    client = broker.client()
    await client.connect(on_connect=on_connect)
    await client.subscribe("a/#")
    await client.publish("a/state", b"kept?", retain=True)
    assert (await next_message(client)).payload == b"kept?"
    broker.stop()
    assert client.state is ConnectionState.DISCONNECTED
    with pytest.raises(TransportError):
        await client.publish("a/b", b"x")
    await broker.start()
    assert client.state is ConnectionState.CONNECTED
    assert reconnected == 2
    assert broker.retained("a/#") == []  # like Mosquitto without persistence
    await client.publish("a/b", b"after")
    assert await next_message(client) == Message("a/b", b"after")


# -- MQTT against a real broker ----------------------------------------------------------------


def mqtt(broker: Broker | MqttProxy, **options: Any) -> MqttTransport:
    return MqttTransport(MqttConfig.from_url(broker.url, reconnect_max_s=0.3, **options))


async def connected(t: MqttTransport, **kw: Any) -> MqttTransport:
    await t.connect(**kw)
    await asyncio.wait_for(t.wait_connected(), 10)
    return t


async def test_mqtt_publish_subscribe_and_retained(broker: Broker) -> None:
    async with await connected(mqtt(broker)) as a, await connected(mqtt(broker)) as b:
        await a.publish("powerd/v1/nodes/n1/status", b"steered", qos=1, retain=True)
        await b.subscribe("powerd/v1/nodes/+/status")
        assert await next_message(b) == Message("powerd/v1/nodes/n1/status", b"steered", True)
        await b.subscribe("powerd/v1/nodes/+/ack")
        await a.publish("powerd/v1/nodes/n1/ack", b"ack", qos=1)
        assert await next_message(b) == Message("powerd/v1/nodes/n1/ack", b"ack")
    assert a.state is ConnectionState.CLOSED


WILL_CLIENT = """
import asyncio, sys
from powerd.transport import LastWill, MqttConfig, MqttTransport

async def main():
    t = MqttTransport(MqttConfig.from_url(sys.argv[1]))
    await t.connect(will=LastWill("powerd/v1/nodes/n9/status", b"offline"))
    await t.wait_connected()
    await t.publish("powerd/v1/nodes/n9/status", b"steered", qos=1, retain=True)
    await asyncio.Event().wait()

asyncio.run(main())
"""


@pytest.mark.process
async def test_mqtt_last_will_when_the_process_dies(broker: Broker) -> None:
    async with await connected(mqtt(broker)) as watcher:
        await watcher.subscribe("powerd/v1/nodes/n9/status")
        proc = await asyncio.create_subprocess_exec(sys.executable, "-c", WILL_CLIENT, broker.url)
        try:
            assert await next_message(watcher) == Message("powerd/v1/nodes/n9/status", b"steered")
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        will = await next_message(watcher)
        assert will == Message("powerd/v1/nodes/n9/status", b"offline")


async def test_mqtt_clean_disconnect_sends_no_will(broker: Broker) -> None:
    async with await connected(mqtt(broker)) as watcher:
        await watcher.subscribe("status/#")
        leaving = await connected(mqtt(broker), will=LastWill("status/leaving", b"offline"))
        await leaving.disconnect()
        await watcher.publish("status/marker", b"after", qos=1)
        # The next message is our marker: no will came before it.
        assert await next_message(watcher) == Message("status/marker", b"after")


async def test_mqtt_reconnects_and_resubscribes_after_broker_restart(
    broker: Broker, eventually: Any
) -> None:
    reconnections = 0

    async def on_connect() -> None:
        nonlocal reconnections
        reconnections += 1

    async with await connected(mqtt(broker), on_connect=on_connect) as t:
        await t.subscribe("a/#")
        broker.kill()
        await eventually(lambda: t.state is not ConnectionState.CONNECTED, what="disconnect")
        with pytest.raises(TransportError):
            await t.publish("a/b", b"lost")
        broker.start()
        await asyncio.wait_for(t.wait_connected(), 10)
        assert reconnections == 2
        await t.publish("a/b", b"back", qos=1)
        assert await next_message(t) == Message("a/b", b"back")


async def test_mqtt_starts_without_a_broker_and_connects_when_it_comes(
    broker: Broker,
) -> None:
    broker.kill()
    t = mqtt(broker)
    await t.connect()
    await t.subscribe("a/#")
    assert t.state is not ConnectionState.CONNECTED
    broker.start()
    async with t:
        await asyncio.wait_for(t.wait_connected(), 10)
        await t.publish("a/b", b"hello", qos=1)
        assert await next_message(t) == Message("a/b", b"hello")


def publish_packet(
    topic: bytes, payload: bytes, qos: int = 0, mid: int = 0, retain: bool = False
) -> bytes:
    """A PUBLISH as a broker sends it (QoS 2 too, which our encoder does not write)."""
    if qos < 2:
        return encode_publish(topic, payload, qos, retain, mid)
    body = len(topic).to_bytes(2, "big") + topic + mid.to_bytes(2, "big") + payload
    return bytes([0x30 | qos << 1 | int(retain)]) + bytes([len(body)]) + body


class FakeSocket(asyncio.Transport):
    """The asyncio transport under a `_Connection`: records what it writes, nothing sent."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[bytes] = []
        self.aborted = False
        self.closed = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.writes.append(bytes(data))

    def is_closing(self) -> bool:
        return self.aborted or self.closed

    def abort(self) -> None:
        self.aborted = True

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 0

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass


class ConnRig:
    """A `_Connection` over a FakeSocket: the hot path without a broker."""

    def __init__(self, window: int = 0, max_packet_bytes: int = 1 << 20) -> None:
        self.got: list[tuple[bytes, bytes, bool]] = []
        self.conn = _Connection(
            lambda t, p, r: self.got.append((t, p, r)),
            window,
            max_packet_bytes,
            [],
            puback_timeout_s=60.0,
        )
        self.sock = FakeSocket()
        self.conn.connection_made(self.sock)

    def feed(self, data: bytes) -> None:
        self.conn.data_received(data)

    def written(self) -> bytes:
        return b"".join(self.sock.writes)


def pubacks(*mids: int) -> bytes:
    return b"".join(b"\x40\x02" + m.to_bytes(2, "big") for m in mids)


async def test_connection_delivers_every_publish_of_a_read_and_acks_qos1_in_one_write() -> None:
    rig = ConnRig()
    big = bytes(range(256)) * 80  # a length of three bytes
    data = (
        publish_packet(b"a/b", b"zero")
        + publish_packet(b"a/c", big, qos=1, mid=7)
        + publish_packet(b"s/n1", b"retained", qos=1, mid=0x1234, retain=True)
        + publish_packet(b"a/empty", b"", qos=1, mid=9)
    )
    before = rig.conn.last_received
    await asyncio.sleep(0.01)
    rig.feed(data)
    assert rig.got == [
        (b"a/b", b"zero", False),
        (b"a/c", big, False),
        (b"s/n1", b"retained", True),
        (b"a/empty", b"", False),
    ]
    # The PUBACKs, in the order of their messages, as one write: one send.
    assert rig.sock.writes == [pubacks(7, 0x1234, 9)]
    assert rig.conn.last_received > before  # the keepalive sees the traffic


async def test_connection_waits_for_the_rest_of_a_packet_cut_anywhere() -> None:
    rig = ConnRig()
    packet = publish_packet(b"a/b", b"x" * 300, qos=1, mid=3)
    for cut in (1, 2, 3, 10, len(packet) - 1):
        rig.got.clear()
        rig.sock.writes.clear()
        rig.feed(packet[:cut])
        assert rig.got == []
        assert rig.sock.writes == []
        rig.feed(packet[cut:] + publish_packet(b"n", b"next"))
        assert rig.got == [(b"a/b", b"x" * 300, False), (b"n", b"next", False)]
        assert rig.sock.writes == [pubacks(3)]
        assert rig.conn._decoder.buffered == 0


async def test_connection_answers_incoming_qos2_and_delivers_it_once() -> None:
    # We never subscribe at QoS 2, but a broker may still send it.
    rig = ConnRig()
    qos2 = publish_packet(b"q/2", b"two", qos=2, mid=5)
    rig.feed(b"\xd0\x00" + qos2 + publish_packet(b"q/0", b"zero"))  # PINGRESP first
    assert rig.got == [(b"q/2", b"two", False), (b"q/0", b"zero", False)]
    assert rig.written() == b"\x50\x02\x00\x05"  # PUBREC
    dup = bytes([qos2[0] | 0x08]) + qos2[1:]  # sent again before our PUBREC arrived
    rig.feed(dup)
    assert len(rig.got) == 2  # not delivered twice
    rig.sock.writes.clear()
    rig.feed(b"\x62\x02\x00\x05")  # PUBREL
    assert rig.written() == b"\x70\x02\x00\x05"  # PUBCOMP
    assert rig.conn.qos2_in == set()
    assert not rig.sock.aborted


@pytest.mark.parametrize(
    "data",
    [
        b"\x30\xff\xff\xff\xff\x01",  # a remaining length of five bytes
        b"\x30\x80\x80\x80\x01",  # 2 MiB: larger than the connection takes
        b"\x10\x00",  # CONNECT: nothing a broker sends
        b"\x40\x03\x00\x01\x00",  # a PUBACK of three bytes
    ],
)
async def test_connection_closes_on_a_malformed_or_oversized_packet(data: bytes) -> None:
    rig = ConnRig()
    rig.feed(publish_packet(b"ok", b"before", qos=1, mid=1) + data)
    assert rig.sock.aborted
    assert "protocol error" in rig.conn.error
    assert rig.got == []  # the read was broken: nothing of it is taken


async def test_connection_reports_the_peer_closing_and_fails_waiters() -> None:
    rig = ConnRig(window=1)
    loop = asyncio.get_running_loop()
    first, second = loop.create_future(), loop.create_future()
    rig.conn.send_qos1([(b"a", b"1")], False, first)
    rig.conn.send_qos1([(b"a", b"2")], False, second)  # held back by the window
    rig.conn.connection_lost(ConnectionResetError("reset by peer"))
    assert rig.conn.closed.done()
    for waiter, sent in ((first, True), (second, False)):
        with pytest.raises(PublishUnconfirmed, match="reset by peer") as lost:
            waiter.result()
        assert lost.value.sent is sent
    assert not rig.conn.held
    assert not rig.conn.unacked


async def test_connection_window_holds_qos1_messages_until_pubacks_come() -> None:
    rig = ConnRig(window=20)
    batch = [(f"c/{i}".encode(), b"x") for i in range(50)]
    rig.conn.send_qos1(batch, False, None)
    decoded = Decoder().feed(rig.written())
    assert [p.packet_id for p in decoded if isinstance(p, Publish)] == list(range(1, 21))
    assert len(rig.sock.writes) == 1  # the window's worth in one write
    assert len(rig.conn.held) == 30
    rig.sock.writes.clear()
    rig.feed(pubacks(1, 2, 3))  # three acknowledged: three more leave, in one write
    decoded = Decoder().feed(rig.written())
    assert [(p.topic, p.packet_id) for p in decoded if isinstance(p, Publish)] == [
        (b"c/20", 21),
        (b"c/21", 22),
        (b"c/22", 23),
    ]
    assert len(rig.sock.writes) == 1
    unlimited = ConnRig(window=0)
    unlimited.conn.send_qos1(batch, False, None)
    assert len(Decoder().feed(unlimited.written())) == 50
    assert not unlimited.conn.held


async def test_packet_ids_wrap_and_skip_those_in_use() -> None:
    rig = ConnRig()
    rig.conn._last_id = 65533
    rig.conn.unacked[65535] = (None, 0.0)
    rig.conn.unacked[1] = (None, 0.0)
    assert [rig.conn.next_id() for _ in range(3)] == [65534, 2, 3]


async def test_mqtt_drops_bad_topics_and_the_oldest_of_a_full_queue() -> None:
    t = MqttTransport(MqttConfig("127.0.0.1", max_queued_messages=3))
    conn = _Connection(t._deliver, 0, 1 << 20, [], puback_timeout_s=60.0)
    sock = FakeSocket()
    conn.connection_made(sock)
    with capture_logs() as logs:
        conn.data_received(
            publish_packet(b"bad/\xff", b"x", qos=1, mid=1)
            + b"".join(publish_packet(f"n/{i}".encode(), b"%d" % i) for i in range(5))
        )
    assert [e["event"] for e in logs] == ["mqtt_bad_topic"]
    assert sock.writes == [pubacks(1)]  # acknowledged all the same
    # One bad topic, and the two oldest of five when the queue holds three.
    assert t.dropped_messages == 3
    assert [t._queue.get_nowait() for _ in range(3)] == [
        Message(f"n/{i}", b"%d" % i) for i in (2, 3, 4)
    ]


async def test_connection_refuses_what_no_packet_id_is_left_for() -> None:
    rig = ConnRig()
    rig.conn.unacked.update(dict.fromkeys(range(1, 65535), (None, 0.0)))  # 65,534 ids in use
    assert rig.conn.send_qos1([(b"a", b"1"), (b"b", b"2"), (b"c", b"3")], False, None) == 2
    assert Decoder().feed(rig.written()) == [Publish(b"a", b"1", 1, False, False, 65535)]


@given(
    messages=st.lists(
        st.tuples(
            st.binary(min_size=1, max_size=40).filter(lambda t: b"\x00" not in t),
            st.binary(max_size=3000),
            st.sampled_from([0, 1]),
            st.booleans(),
        ),
        max_size=12,
    ),
    cuts=st.lists(st.integers(min_value=0, max_value=40_000), max_size=8),
)
@settings(max_examples=60, deadline=None)
def test_connection_gives_the_same_messages_however_the_stream_is_cut(
    messages: list[tuple[bytes, bytes, int, bool]], cuts: list[int]
) -> None:
    stream = b"".join(
        publish_packet(t, p, qos=q, mid=i + 1, retain=r) for i, (t, p, q, r) in enumerate(messages)
    )

    async def run() -> None:
        rig = ConnRig()
        bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
        for lo, hi in itertools.pairwise(bounds):
            rig.feed(stream[lo:hi])
        assert rig.got == [(t, p, r) for t, p, _, r in messages]
        assert rig.written() == pubacks(*(i + 1 for i, m in enumerate(messages) if m[2]))
        assert rig.conn._decoder.buffered == 0
        assert not rig.sock.aborted

    asyncio.run(run())


# -- a fake broker: what Mosquitto would never send --------------------------------------------


class FakeBroker:
    """A TCP server that plays a broker badly: `answer(conn_index, reader, writer)` decides."""

    def __init__(self) -> None:
        self.connections = 0
        self.received: list[bytes] = []
        self.port = 0
        self._server: asyncio.Server | None = None
        self._handlers: set[asyncio.Task[None]] = set()

    async def start(self, answer: Any) -> None:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            try:
                await answer(self.connections, reader, writer)
                while data := await reader.read(65536):
                    self.received.append(data)
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    def client(self, **options: Any) -> MqttTransport:
        return MqttTransport(
            MqttConfig.from_url(
                f"mqtt://127.0.0.1:{self.port}",
                reconnect_min_s=0.05,
                reconnect_max_s=0.1,
                **options,
            )
        )


CONNACK = b"\x20\x02\x00\x00"


async def read_connect(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readexactly(2)
    assert head[0] == 0x10
    return head + await reader.readexactly(head[1])


@pytest.mark.parametrize(
    "garbage",
    [b"\x30\xff\xff\xff\xff\x01", b"\x30\x80\x80\x80\x01" + b"x" * 100],
    ids=["length-of-five-bytes", "oversized"],
)
async def test_mqtt_drops_a_broken_connection_and_reconnects(
    garbage: bytes, eventually: Any
) -> None:
    broker = FakeBroker()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_connect(reader)
        writer.write(CONNACK)
        if n == 1:
            writer.write(garbage)

    await broker.start(answer)
    t = broker.client()
    try:
        await t.connect()
        await eventually(lambda: broker.connections >= 2, what="a second connection")
        await asyncio.wait_for(t.wait_connected(), 5)
        await t.publish("after/reconnect", b"ok")
    finally:
        await t.disconnect()
        await broker.stop()


async def test_mqtt_keepalive_gives_up_on_a_silent_broker(eventually: Any) -> None:
    broker = FakeBroker()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_connect(reader)
        writer.write(CONNACK)  # and never another byte: not even PINGRESP

    await broker.start(answer)
    t = broker.client(keepalive_s=1)
    try:
        await t.connect()
        await asyncio.wait_for(t.wait_connected(), 5)
        t0 = asyncio.get_running_loop().time()
        await eventually(lambda: t.state is not ConnectionState.CONNECTED, what="a dead link")
        waited = asyncio.get_running_loop().time() - t0
        assert 1.0 <= waited <= 4.0
        assert b"\xc0\x00" in b"".join(broker.received)  # it asked: PINGREQ
    finally:
        await t.disconnect()
        await broker.stop()


@pytest.mark.slow  # seconds of real time: keepalives
async def test_mqtt_keepalive_keeps_a_quiet_connection_up(eventually: Any) -> None:
    broker = FakeBroker()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_connect(reader)
        writer.write(CONNACK)
        while (await reader.readexactly(2)) == b"\xc0\x00":
            broker.received.append(b"\xc0\x00")
            writer.write(b"\xd0\x00")  # PINGRESP

    await broker.start(answer)
    t = broker.client(keepalive_s=1)
    try:
        await t.connect()
        await asyncio.wait_for(t.wait_connected(), 5)
        await asyncio.sleep(3.5)
        assert t.state is ConnectionState.CONNECTED
        assert broker.connections == 1
        assert broker.received.count(b"\xc0\x00") >= 2
    finally:
        await t.disconnect()
        await broker.stop()


@pytest.mark.parametrize("connack", [None, b"\x20\x02\x00\x05"], ids=["silent", "refused"])
async def test_mqtt_retries_a_broker_that_does_not_accept(
    connack: bytes | None, eventually: Any
) -> None:
    broker = FakeBroker()

    async def answer(n: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_connect(reader)
        if connack is not None:
            writer.write(connack)
            await writer.drain()
            await asyncio.sleep(5)

    await broker.start(answer)
    t = broker.client(timeout_s=0.3)
    try:
        await t.connect()
        await eventually(lambda: broker.connections >= 3, what="retries")
        assert t.state is not ConnectionState.CONNECTED
        with pytest.raises(TransportError):
            await t.publish("a/b", b"x")
    finally:
        await t.disconnect()
        await broker.stop()
    assert t.state is ConnectionState.CLOSED


async def stream_at_qos1(
    sender: MqttTransport, receiver: MqttTransport, batch: list[tuple[str, bytes]]
) -> None:
    """`batch` (topics under powerd/v1/nodes/+/ack) from sender to receiver at QoS 1: all of
    it arrives, whole and in order."""
    await receiver.subscribe("powerd/v1/nodes/+/ack", qos=1)
    assert await sender.publish_many(batch, qos=1) == 0
    got = [await next_message(receiver) for _ in batch]
    assert [(m.topic, m.payload) for m in got] == batch


async def test_mqtt_takes_a_stream_of_qos1_messages(
    broker: Broker,
) -> None:
    # The broker sends at most 20 QoS 1 messages ahead of our PUBACKs: the 600 only all
    # arrive if our batched acknowledgements reach it.
    batch = [(f"powerd/v1/nodes/n{i}/ack", bytes([i % 251]) * (i * 7 % 5000)) for i in range(600)]
    async with (
        await connected(mqtt(broker, max_inflight_messages=0)) as sender,
        await connected(mqtt(broker)) as receiver,
    ):
        await stream_at_qos1(sender, receiver, batch)
        await receiver.publish("powerd/v1/nodes/n1/status", b"still talking", qos=1)


def raw_socket(t: MqttTransport) -> Any:
    assert t._conn is not None
    assert t._conn._transport is not None
    return t._conn._transport.get_extra_info("socket")


async def test_mqtt_sockets_are_set_up_before_the_handshake(mosquitto: LocalMosquitto) -> None:
    # Loopback's ~64 KiB segments against a broker window sized from small packets stalled
    # the controller's connection; no Nagle delay on small commands and acks.
    async with await connected(mqtt(mosquitto)) as t:
        sock = raw_socket(t)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert 0 < sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) <= MAX_SEGMENT_BYTES


async def test_open_tcp_sets_its_options_before_connecting() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        sock = await open_tcp("127.0.0.1", server.getsockname()[1], timeout_s=1.0)
        with sock:
            assert not sock.getblocking()
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
            # Set after the handshake, it would not lower the MSS already agreed on.
            assert 0 < sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) <= MAX_SEGMENT_BYTES


async def test_open_tcp_tries_every_address_and_says_why_none_answered() -> None:
    with pytest.raises(OSError):
        await open_tcp("127.0.0.1", free_port(), timeout_s=1.0)


async def test_publish_many_writes_the_batch_before_it_returns(mosquitto: LocalMosquitto) -> None:
    batch = [(f"powerd/v1/nodes/n{i}/caps", b"x" * 400) for i in range(200)]
    async with (
        await connected(mqtt(mosquitto, max_inflight_messages=0)) as sender,
        await connected(mqtt(mosquitto)) as receiver,
    ):
        await receiver.subscribe("powerd/v1/nodes/+/caps", qos=1)
        written: list[int] = []
        sender.on_written.append(lambda: written.append(sender.unwritten))
        assert await sender.publish_many(batch, qos=1) == 0
        # Nothing left for the event loop to write: the tick's commands are on the wire.
        assert sender.unwritten == 0
        assert written == [0]
        got = [await next_message(receiver) for _ in batch]
        assert [m.topic for m in got] == [topic for topic, _ in batch]
        # Nothing to write, and the event loop idles: a writer callback left registered on
        # a writable socket (seen with aiomqtt) would spin it at a whole core.
        cpu = time.process_time()
        await asyncio.sleep(0.5)
        assert sender.unwritten == 0
        assert time.process_time() - cpu < 0.25


@pytest.mark.parametrize("window", [20, 0])
async def test_publish_many_keeps_to_the_window(mosquitto: LocalMosquitto, window: int) -> None:
    batch = [(f"powerd/v1/nodes/n{i}/caps", b"x" * 100) for i in range(300)]
    async with (
        await connected(mqtt(mosquitto, max_inflight_messages=window)) as sender,
        await connected(mqtt(mosquitto)) as receiver,
    ):
        await receiver.subscribe("powerd/v1/nodes/+/caps", qos=1)
        drained = asyncio.Event()
        sender.on_written.append(drained.set)
        assert await sender.publish_many(batch, qos=1) == 0
        assert sender._conn is not None
        if window:
            # 20 sent, the rest held back until the broker's PUBACKs come.
            assert len(sender._conn.unacked) == window
            assert len(sender._conn.held) == len(batch) - window
            assert not drained.is_set()
        else:
            assert not sender._conn.held
            assert drained.is_set()
        got = [await next_message(receiver) for _ in batch]
        assert [m.topic for m in got] == [topic for topic, _ in batch]
        await asyncio.wait_for(drained.wait(), 5)
        assert sender.unwritten == 0
        await asyncio.sleep(0.1)  # the last PUBACKs
        assert not sender._conn.unacked


async def test_mqtt_publish_waits_for_the_puback(broker: Broker) -> None:
    async with await connected(mqtt(broker, max_inflight_messages=1)) as t:
        await asyncio.gather(*(t.publish(f"a/{i}", b"x", qos=1) for i in range(10)))
        assert t._conn is not None
        assert not t._conn.unacked
        assert not t._conn.held
        with pytest.raises(ValueError, match="QoS"):
            await t.publish("a/b", b"x", qos=2)


@pytest.fixture
def tls_mosquitto(tmp_path: Path) -> Iterator[tuple[ConfiguredMosquitto, Path]]:
    """A Mosquitto of the test's own with a TLS listener; (broker, the CA that signed it)."""
    if not Path(MOSQUITTO).exists():
        pytest.skip(f"{MOSQUITTO} is not installed")
    pki = Pki(tmp_path / "pki")
    cert, key = pki.server("broker", "127.0.0.1")
    with ConfiguredMosquitto(
        tmp_path / "mosquitto", lambda port: plain_tls_config(port, cert, key)
    ) as broker:
        yield broker, pki.ca


@pytest.mark.broker
@pytest.mark.process
async def test_mqtt_over_tls_reads_every_message(
    tls_mosquitto: tuple[ConfiguredMosquitto, Path],
) -> None:
    # A TLS socket hands over at most one record (16 KiB) a recv and reports the rest as
    # `pending`: messages larger than that, and many of them, must still arrive whole.
    broker, cert = tls_mosquitto
    url = f"mqtts://127.0.0.1:{broker.port}"
    config = MqttConfig.from_url(url, ca_file=cert, reconnect_max_s=0.3)
    batch = [
        (f"powerd/v1/nodes/n{i}/ack", bytes([i % 251]) * (i * 997 % 60_000)) for i in range(150)
    ]
    async with (
        await connected(MqttTransport(config)) as sender,
        await connected(MqttTransport(config)) as receiver,
    ):
        await sender.publish("powerd/v1/nodes/n0/status", b"steered", qos=1, retain=True)
        await receiver.subscribe("powerd/v1/nodes/+/status", qos=1)
        assert await next_message(receiver) == Message(
            "powerd/v1/nodes/n0/status", b"steered", True
        )
        await stream_at_qos1(sender, receiver, batch)


# -- QoS 1, path by path: a real broker behind a proxy that loses PUBACKs on purpose ----------
#
# What a caller is promised (docs/decisions/0001-mqtt-qos1-timeouts.md): a message whose
# PUBACK does not come is given up and never sent again; the error says whether it had left
# (`sent`); its place in the window is free at once, its packet id once its PUBACK comes or
# the connection ends.


@contextlib.asynccontextmanager
async def proxied(broker: Broker) -> Any:
    proxy = MqttProxy(broker.port)
    await proxy.start()
    try:
        yield proxy
    finally:
        await proxy.stop()


async def received(t: MqttTransport, n: int) -> list[bytes]:
    return [(await next_message(t)).payload for _ in range(n)]


async def test_qos1_puback_confirms_the_publish(broker: Broker) -> None:
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy)) as t,
        await connected(mqtt(broker)) as watcher,
    ):
        await watcher.subscribe("q/#", qos=1)
        await t.publish("q/a", b"one", qos=1)
        assert t.in_flight == 0
        assert [(p.topic, p.packet_id, p.dup) for p in proxy.published] == [("q/a", 1, False)]
        assert await received(watcher, 1) == [b"one"]


async def test_qos1_lost_pubacks_free_the_window(broker: Broker) -> None:
    # A full window (agents use 20) of lost PUBACKs: before, every later QoS 1 publish on
    # the connection was held back for good and reported as a timeout.
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, timeout_s=1.0)) as t,
        await connected(mqtt(broker)) as watcher,
    ):
        await watcher.subscribe("q/#", qos=1)
        proxy.pubacks = Pubacks.DROP
        lost = await asyncio.gather(
            *(t.publish(f"q/{i}", b"%d" % i, qos=1) for i in range(20)), return_exceptions=True
        )
        assert all(isinstance(e, PublishTimeout) and e.sent for e in lost)
        assert t.in_flight == 0
        assert sorted(proxy.dropped) == list(range(1, 21))
        # Sent means the broker may have it: here it delivered every one.
        assert sorted(await received(watcher, 20)) == sorted(b"%d" % i for i in range(20))

        proxy.pubacks = Pubacks.PASS
        await asyncio.gather(*(t.publish(f"q/{i}", b"again", qos=1) for i in range(20, 41)))
        assert t.in_flight == 0
        # Fresh ids: those of the lost PUBACKs stay taken, never reused on this connection.
        assert proxy.packet_ids()[20:] == list(range(21, 42))
        assert await received(watcher, 21) == [b"again"] * 21


async def test_qos1_window_holds_messages_until_pubacks_come(
    broker: Broker, eventually: Any
) -> None:
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=2)) as t,
    ):
        proxy.pubacks = Pubacks.HOLD
        sends = [asyncio.create_task(t.publish(f"q/{i}", b"x", qos=1)) for i in range(3)]
        await eventually(lambda: len(proxy.held_pubacks()) == 2, what="two PUBACKs held")
        assert (t.in_flight, t.unwritten) == (2, 1)  # the third waits for a place
        assert [p.topic for p in proxy.published] == ["q/0", "q/1"]
        proxy.pubacks = Pubacks.PASS
        await proxy.release_pubacks()
        await asyncio.wait_for(asyncio.gather(*sends), 5)
        assert [p.packet_id for p in proxy.published] == [1, 2, 3]
        assert (t.in_flight, t.unwritten) == (0, 0)


async def test_qos1_timed_out_while_held_back_is_never_sent(broker: Broker) -> None:
    # The window is taken by publish_many's messages (given up timeout_s after they leave):
    # the publish() behind them times out before a place frees, and is withdrawn.
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=1, timeout_s=1.0)) as t,
        await connected(mqtt(broker)) as watcher,
    ):
        await watcher.subscribe("q/#", qos=1)
        proxy.pubacks = Pubacks.HOLD
        assert await t.publish_many([("q/a", b"a"), ("q/b", b"b")], qos=1) == 0
        with pytest.raises(PublishTimeout, match="never sent") as timed_out:
            await t.publish("q/held", b"held", qos=1)
        assert not timed_out.value.sent
        assert t.unwritten == 0  # nothing of it left to go out later
        proxy.pubacks = Pubacks.PASS
        await proxy.release_pubacks()
        await t.publish("q/after", b"after", qos=1)
        assert [p.topic for p in proxy.published] == ["q/a", "q/b", "q/after"]
        assert await received(watcher, 3) == [b"a", b"b", b"after"]


async def test_qos1_late_puback_confirms_nothing_else(broker: Broker, eventually: Any) -> None:
    # The second message must not run out of time while the test releases PUBACKs: a
    # timeout of 2 s, to spare on a loaded machine.
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, timeout_s=2.0)) as t,
    ):
        proxy.pubacks = Pubacks.HOLD
        with pytest.raises(PublishTimeout) as timed_out:
            await t.publish("q/late", b"x", qos=1)
        assert timed_out.value.sent
        later = asyncio.create_task(t.publish("q/later", b"y", qos=1))
        await eventually(lambda: proxy.held_pubacks() == [1, 2], what="both PUBACKs held")
        with capture_logs() as logs:
            await proxy.release_pubacks(packet_ids={1})
            await eventually(lambda: any(e["event"] == "mqtt_late_puback" for e in logs))
        assert [e["packet_id"] for e in logs if e["event"] == "mqtt_late_puback"] == [1]
        assert not later.done()  # the late PUBACK of id 1 is not taken for message 2's
        assert t.in_flight == 1
        await proxy.release_pubacks()
        await asyncio.wait_for(later, 5)
        assert t.in_flight == 0


async def test_qos1_publish_many_lost_pubacks_expire(broker: Broker, eventually: Any) -> None:
    # Nobody waits on publish_many's messages; a lost PUBACK must still give its place up.
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=2, timeout_s=1.0)) as t,
    ):
        proxy.pubacks = Pubacks.DROP
        with capture_logs() as logs:
            assert await t.publish_many([(f"q/{i}", b"x") for i in range(5)], qos=1) == 0
            await eventually(lambda: len(proxy.dropped) == 5, what="all five sent")
            await eventually(lambda: t.in_flight == 0, what="the last two given up")
        given_up = [e["messages"] for e in logs if e["event"] == "mqtt_puback_timeout"]
        assert sum(given_up) == 5
        assert [p.packet_id for p in proxy.published] == [1, 2, 3, 4, 5]
        proxy.pubacks = Pubacks.PASS
        await t.publish("q/after", b"x", qos=1)


async def test_qos1_in_flight_when_the_connection_drops_is_given_up(
    broker: Broker, eventually: Any
) -> None:
    # A clean session: the broker forgets our session, and we send nothing again.
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=2)) as t,
        await connected(mqtt(broker)) as watcher,
    ):
        await watcher.subscribe("q/#", qos=1)
        proxy.pubacks = Pubacks.HOLD
        sends = [asyncio.create_task(t.publish(f"q/{i}", b"%d" % i, qos=1)) for i in range(3)]
        await eventually(lambda: len(proxy.held_pubacks()) == 2, what="two in flight")
        proxy.cut()
        outcomes = await asyncio.gather(*sends, return_exceptions=True)
        assert all(
            isinstance(e, PublishUnconfirmed) and not isinstance(e, PublishTimeout)
            for e in outcomes
        )
        assert [e.sent for e in outcomes if isinstance(e, PublishUnconfirmed)] == [
            True,
            True,
            False,
        ]
        proxy.pubacks = Pubacks.PASS
        await asyncio.wait_for(t.wait_connected(), 10)
        assert (t.in_flight, t.unwritten) == (0, 0)
        await t.publish("q/3", b"3", qos=1)
        # Nothing again on the new connection: no DUP, no third message; ids start afresh.
        assert [(p.topic, p.packet_id, p.dup) for p in proxy.published if p.connection == 2] == [
            ("q/3", 1, False)
        ]
        assert await received(watcher, 3) == [b"0", b"1", b"3"]


async def test_qos1_packet_ids_wrap_and_skip_one_given_up(
    mosquitto: LocalMosquitto, eventually: Any
) -> None:
    # Id 1 is given up (its PUBACK held), 2..65535 go round; the next wraps past 1.
    # Mosquitto only: 65,536 messages take amqtt minutes.
    async with (
        proxied(mosquitto) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=500, timeout_s=2.0)) as t,
    ):
        proxy.pubacks = Pubacks.HOLD
        with pytest.raises(PublishTimeout):
            await t.publish("q/first", b"x", qos=1)
        proxy.pubacks = Pubacks.PASS
        batch = [("q/many", b"x")] * 65_534
        assert await t.publish_many(batch, qos=1) == 0
        await eventually(lambda: t.in_flight == t.unwritten == 0, what="the batch through")
        await t.publish("q/wrapped", b"x", qos=1)
        ids = proxy.packet_ids()
        assert ids[:2] == [1, 2]
        assert ids[-2:] == [65535, 2]
        assert len(ids) == 65_536


async def test_qos1_a_broker_that_stopped_acknowledging_gets_a_new_session(
    mosquitto: LocalMosquitto, eventually: Any
) -> None:
    # Ids of messages given up stay taken until their PUBACKs come; before they could run
    # out on a live connection, a new clean session frees them.
    async with (
        proxied(mosquitto) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=0, timeout_s=1.0)) as t,
    ):
        proxy.pubacks = Pubacks.DROP
        assert await t.publish_many([("q/lost", b"x")] * MAX_ABANDONED_IDS, qos=1) == 0
        await eventually(lambda: proxy.connections == 2, what="a new connection")
        proxy.pubacks = Pubacks.PASS
        await asyncio.wait_for(t.wait_connected(), 10)
        await t.publish("q/after", b"x", qos=1)
        assert proxy.packet_ids(connection=2) == [1]


async def test_qos1_cancelled_publish_withdraws_a_held_message(
    broker: Broker, eventually: Any
) -> None:
    async with (
        proxied(broker) as proxy,
        await connected(mqtt(proxy, max_inflight_messages=1)) as t,
    ):
        proxy.pubacks = Pubacks.HOLD
        first = asyncio.create_task(t.publish("q/first", b"x", qos=1))
        second = asyncio.create_task(t.publish("q/second", b"x", qos=1))
        await eventually(lambda: t.unwritten == 1, what="the second held back")
        second.cancel()
        await cancel_and_wait([second])
        assert t.unwritten == 0
        proxy.pubacks = Pubacks.PASS
        await proxy.release_pubacks()
        await asyncio.wait_for(first, 5)
        await t.publish("q/third", b"x", qos=1)
        assert [p.topic for p in proxy.published] == ["q/first", "q/third"]
