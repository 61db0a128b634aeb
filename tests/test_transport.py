"""Transports: topic matching, the in-process broker, and MQTT against a real Mosquitto."""

from __future__ import annotations

import asyncio
import itertools
import random
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import paho.mqtt.client as paho_mqtt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerd.transport import (
    ConnectionState,
    LastWill,
    MemoryBroker,
    Message,
    MqttConfig,
    MqttTransport,
    Transport,
    TransportError,
    topic_matches,
)
from powerd.transport.base import check_filter
from powerd.transport.mosquitto import MOSQUITTO, LocalMosquitto, free_port
from powerd.transport.mqtt import MAX_SEGMENT_BYTES, backoff_delay, connect_tcp
from powerd.transport.reader import PacketReader


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


def mqtt(broker: LocalMosquitto, **options: Any) -> MqttTransport:
    return MqttTransport(MqttConfig.from_url(broker.url, reconnect_max_s=0.3, **options))


async def connected(t: MqttTransport, **kw: Any) -> MqttTransport:
    await t.connect(**kw)
    await asyncio.wait_for(t.wait_connected(), 10)
    return t


async def test_mqtt_publish_subscribe_and_retained(mosquitto: LocalMosquitto) -> None:
    async with await connected(mqtt(mosquitto)) as a, await connected(mqtt(mosquitto)) as b:
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


async def test_mqtt_last_will_when_the_process_dies(mosquitto: LocalMosquitto) -> None:
    async with await connected(mqtt(mosquitto)) as watcher:
        await watcher.subscribe("powerd/v1/nodes/n9/status")
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", WILL_CLIENT, mosquitto.url
        )
        try:
            assert await next_message(watcher) == Message("powerd/v1/nodes/n9/status", b"steered")
        finally:
            proc.send_signal(signal.SIGKILL)
            await proc.wait()
        will = await next_message(watcher)
        assert will == Message("powerd/v1/nodes/n9/status", b"offline")


async def test_mqtt_clean_disconnect_sends_no_will(mosquitto: LocalMosquitto) -> None:
    async with await connected(mqtt(mosquitto)) as watcher:
        await watcher.subscribe("status/#")
        leaving = await connected(mqtt(mosquitto), will=LastWill("status/leaving", b"offline"))
        await leaving.disconnect()
        await watcher.publish("status/marker", b"after", qos=1)
        # The next message is our marker: no will came before it.
        assert await next_message(watcher) == Message("status/marker", b"after")


async def test_mqtt_reconnects_and_resubscribes_after_broker_restart(
    mosquitto: LocalMosquitto, eventually: Any
) -> None:
    reconnections = 0

    async def on_connect() -> None:
        nonlocal reconnections
        reconnections += 1

    async with await connected(mqtt(mosquitto), on_connect=on_connect) as t:
        await t.subscribe("a/#")
        mosquitto.kill()
        await eventually(lambda: t.state is not ConnectionState.CONNECTED, what="disconnect")
        with pytest.raises(TransportError):
            await t.publish("a/b", b"lost")
        mosquitto.start()
        await asyncio.wait_for(t.wait_connected(), 10)
        assert reconnections == 2
        await t.publish("a/b", b"back", qos=1)
        assert await next_message(t) == Message("a/b", b"back")


async def test_mqtt_starts_without_a_broker_and_connects_when_it_comes(
    mosquitto: LocalMosquitto,
) -> None:
    mosquitto.kill()
    t = mqtt(mosquitto)
    await t.connect()
    await t.subscribe("a/#")
    assert t.state is not ConnectionState.CONNECTED
    mosquitto.start()
    async with t:
        await asyncio.wait_for(t.wait_connected(), 10)
        await t.publish("a/b", b"hello", qos=1)
        assert await next_message(t) == Message("a/b", b"hello")


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        n, low = divmod(n, 128)
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def publish_packet(
    topic: bytes, payload: bytes, qos: int = 0, mid: int = 0, retain: bool = False
) -> bytes:
    body = (
        len(topic).to_bytes(2, "big") + topic + (mid.to_bytes(2, "big") if qos else b"") + payload
    )
    return bytes([0x30 | qos << 1 | int(retain)]) + _varint(len(body)) + body


class ReaderRig:
    """A paho client whose socket is one end of a socketpair, read by a PacketReader."""

    def __init__(self) -> None:
        self.peer, sock = socket.socketpair()
        sock.setblocking(False)
        self.paho = paho_mqtt.Client(paho_mqtt.CallbackAPIVersion.VERSION2)
        self.paho._sock = sock
        self.got: list[tuple[bytes, bytes, bool]] = []
        self.paho_got: list[paho_mqtt.MQTTMessage] = []
        self.paho.on_message = lambda _c, _u, m: self.paho_got.append(m)
        # As under the event loop: what paho would write stays queued for a writer callback.
        self.paho.on_socket_register_write = lambda _c, _u, _s: None
        self.reader = PacketReader(self.paho, lambda t, p, r: self.got.append((t, p, r)))
        self.reader.install()

    def feed(self, data: bytes) -> paho_mqtt.MQTTErrorCode:
        self.peer.sendall(data)
        return self.paho.loop_read()

    def pubacks(self) -> bytes:
        return b"".join(bytes(p["packet"]) for p in self.paho._out_packet)

    def close(self) -> None:
        self.peer.close()
        if self.paho._sock is not None:
            self.paho._sock.close()


@pytest.fixture
def rig() -> Iterator[ReaderRig]:
    r = ReaderRig()
    yield r
    r.close()


def test_reader_delivers_every_publish_of_a_read_and_acks_qos1_in_one_write(
    rig: ReaderRig,
) -> None:
    big = bytes(range(256)) * 80  # a length of three bytes
    data = (
        publish_packet(b"a/b", b"zero")
        + publish_packet(b"a/c", big, qos=1, mid=7)
        + publish_packet(b"s/n1", b"retained", qos=1, mid=0x1234, retain=True)
        + publish_packet(b"a/empty", b"", qos=1, mid=9)
    )
    assert rig.feed(data) == paho_mqtt.MQTT_ERR_SUCCESS
    assert rig.got == [
        (b"a/b", b"zero", False),
        (b"a/c", big, False),
        (b"s/n1", b"retained", True),
        (b"a/empty", b"", False),
    ]
    # The PUBACKs, in the order of their messages, queued as one packet: one send.
    assert len(rig.paho._out_packet) == 1
    assert rig.pubacks() == b"\x40\x02\x00\x07" + b"\x40\x02\x12\x34" + b"\x40\x02\x00\x09"
    assert rig.paho._last_bytes_received > 0  # paho's keepalive sees the traffic


def test_reader_waits_for_the_rest_of_a_packet_cut_anywhere(rig: ReaderRig) -> None:
    packet = publish_packet(b"a/b", b"x" * 300, qos=1, mid=3)
    for cut in (1, 2, 3, 10, len(packet) - 1):
        rig.got.clear()
        assert rig.feed(packet[:cut]) == paho_mqtt.MQTT_ERR_SUCCESS
        assert rig.got == []
        rig.feed(packet[cut:] + publish_packet(b"n", b"next"))
        assert rig.got == [(b"a/b", b"x" * 300, False), (b"n", b"next", False)]
        assert rig.reader.buffered == 0


def test_reader_hands_other_packets_to_paho(rig: ReaderRig) -> None:
    rig.paho._ping_t = 123.0  # a PINGREQ is out
    qos2 = publish_packet(b"q/2", b"two", qos=2, mid=5)
    assert rig.feed(b"\xd0\x00" + qos2 + publish_packet(b"q/0", b"zero")) == 0
    assert rig.paho._ping_t == 0  # paho took the PINGRESP
    assert rig.got == [(b"q/0", b"zero", False)]
    # QoS 2 stays paho's: it answers PUBREC and delivers on PUBREL.
    assert rig.pubacks() == b"\x50\x02\x00\x05"
    assert rig.feed(b"\x62\x02\x00\x05") == 0
    assert [(m.topic, m.payload) for m in rig.paho_got] == [("q/2", b"two")]


def test_reader_takes_over_only_a_paho_it_knows(rig: ReaderRig) -> None:
    assert PacketReader.fits(rig.paho)  # the installed paho-mqtt 2.x

    class OtherPaho:  # a paho whose internals moved: it keeps its own reader
        _in_packet = None

    assert not PacketReader.fits(OtherPaho())  # type: ignore[arg-type]


def test_reader_closes_the_connection_on_a_broken_length(rig: ReaderRig) -> None:
    assert rig.feed(b"\x30\xff\xff\xff\xff\x01") == paho_mqtt.MQTT_ERR_PROTOCOL
    assert rig.paho._sock is None


def test_reader_reports_the_peer_closing(rig: ReaderRig) -> None:
    rig.peer.shutdown(socket.SHUT_WR)
    assert rig.paho.loop_read() == paho_mqtt.MQTT_ERR_CONN_LOST
    assert rig.paho._sock is None


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
def test_reader_gives_the_same_messages_however_the_stream_is_cut(
    messages: list[tuple[bytes, bytes, int, bool]], cuts: list[int]
) -> None:
    stream = b"".join(
        publish_packet(t, p, qos=q, mid=i + 1, retain=r) for i, (t, p, q, r) in enumerate(messages)
    )
    rig = ReaderRig()
    try:
        bounds = sorted({0, len(stream), *(c for c in cuts if c < len(stream))})
        for lo, hi in itertools.pairwise(bounds):
            assert rig.feed(stream[lo:hi]) == paho_mqtt.MQTT_ERR_SUCCESS
        assert rig.got == [(t, p, r) for t, p, _, r in messages]
        mids = [(i + 1).to_bytes(2, "big") for i, (_, _, q, _) in enumerate(messages) if q]
        assert rig.pubacks() == b"".join(b"\x40\x02" + m for m in mids)
        assert rig.reader.buffered == 0
    finally:
        rig.close()


async def stream_through_the_reader(
    sender: MqttTransport, receiver: MqttTransport, batch: list[tuple[str, bytes]]
) -> None:
    """`batch` (topics under powerd/v1/nodes/+/ack) from sender to receiver at QoS 1, read
    by the receiver's PacketReader: all of it arrives, whole and in order."""
    await receiver.subscribe("powerd/v1/nodes/+/ack", qos=1)
    assert receiver._client is not None
    assert isinstance(receiver._client._client.loop_read.__self__, PacketReader)
    assert await sender.publish_many(batch, qos=1) == 0
    got = [await next_message(receiver) for _ in batch]
    assert [(m.topic, m.payload) for m in got] == batch


async def test_mqtt_takes_a_stream_of_qos1_messages_through_the_reader(
    mosquitto: LocalMosquitto,
) -> None:
    # The broker sends at most 20 QoS 1 messages ahead of our PUBACKs: the 600 only all
    # arrive if the reader's batched acknowledgements reach it.
    batch = [(f"powerd/v1/nodes/n{i}/ack", bytes([i % 251]) * (i * 7 % 5000)) for i in range(600)]
    async with (
        await connected(mqtt(mosquitto, max_inflight_messages=0)) as sender,
        await connected(mqtt(mosquitto)) as receiver,
    ):
        await stream_through_the_reader(sender, receiver, batch)
        await receiver.publish("powerd/v1/nodes/n1/status", b"still talking", qos=1)


async def test_mqtt_sockets_are_set_up_before_the_handshake(mosquitto: LocalMosquitto) -> None:
    # Loopback's ~64 KiB segments against a broker window sized from small packets stalled
    # the controller's connection; no Nagle delay on small commands and acks.
    async with await connected(mqtt(mosquitto)) as t:
        assert t._client is not None
        sock = t._client._client.socket()
        assert sock is not None
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) == 1
        assert 0 < sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG) <= MAX_SEGMENT_BYTES


def test_connect_tcp_tries_every_address_and_says_why_none_answered() -> None:
    with pytest.raises(OSError):
        connect_tcp("127.0.0.1", free_port(), timeout_s=1.0)


async def test_publish_many_writes_the_batch_before_it_returns(mosquitto: LocalMosquitto) -> None:
    batch = [(f"powerd/v1/nodes/n{i}/caps", b"x" * 400) for i in range(200)]
    async with (
        await connected(mqtt(mosquitto, max_inflight_messages=0)) as sender,
        await connected(mqtt(mosquitto)) as receiver,
    ):
        await receiver.subscribe("powerd/v1/nodes/+/caps", qos=1)
        assert sender._client is not None
        paho = sender._client._client
        assert await sender.publish_many(batch, qos=1) == 0
        # Nothing left for the event loop to write: the tick's commands are on the wire.
        assert not paho.want_write()
        got = [await next_message(receiver) for _ in batch]
        assert [m.topic for m in got] == [topic for topic, _ in batch]
        # Once paho has nothing to write, no writer callback stays registered: a stale one
        # makes the event loop spin on a writable socket.
        await asyncio.sleep(0.1)
        sock = paho.socket()
        assert sock is not None
        assert not paho.want_write()
        assert asyncio.get_running_loop().remove_writer(sock.fileno()) is False


@pytest.fixture
def tls_mosquitto() -> Iterator[tuple[LocalMosquitto, Path]]:
    """A Mosquitto of the test's own with a TLS listener; (broker, its certificate)."""
    if not Path(MOSQUITTO).exists():
        pytest.skip(f"{MOSQUITTO} is not installed")
    # Mosquitto started as root reads its certificate as the user `mosquitto`: a directory
    # that user can enter, not pytest's private tmp_path.
    with tempfile.TemporaryDirectory(prefix="powerd-tls-") as name:
        workdir = Path(name)
        workdir.chmod(0o755)
        cert, key = workdir / "cert.pem", workdir / "key.pem"
        subprocess.run(
            [
                *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"),
                *("-keyout", str(key), "-out", str(cert), "-subj", "/CN=127.0.0.1"),
                *("-addext", "subjectAltName=IP:127.0.0.1"),
            ],
            check=True,
            capture_output=True,
        )
        key.chmod(0o644)  # a throwaway key, for the broker's user
        broker = LocalMosquitto(
            workdir / "mosquitto", extra_config=f"certfile {cert}\nkeyfile {key}\n"
        )
        broker.start()
        try:
            yield broker, cert
        finally:
            broker.kill()


async def test_mqtt_over_tls_reads_every_message_through_the_reader(
    tls_mosquitto: tuple[LocalMosquitto, Path],
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
        await stream_through_the_reader(sender, receiver, batch)
