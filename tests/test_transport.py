"""Transports: topic matching, the in-process broker, and MQTT against a real Mosquitto."""

from __future__ import annotations

import asyncio
import random
import signal
import socket
import ssl
import sys
from typing import Any

import pytest

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
from powerd.transport.mosquitto import LocalMosquitto, free_port
from powerd.transport.mqtt import MAX_SEGMENT_BYTES, _ReadBuffer, backoff_delay, connect_tcp


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


def test_read_buffer_serves_small_reads_from_one_read_and_reports_what_it_holds() -> None:
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        buf = _ReadBuffer(b)
        a.sendall(b"\x30\x05hello\x40")
        assert buf.recv(1) == b"\x30"  # one system call read all eight bytes
        assert buf.pending() == 7
        assert buf.recv(1) == b"\x05"
        assert buf.recv(5) == b"hello"
        assert buf.recv(10) == b"\x40"  # what is buffered, not a wait for more, like a socket
        assert buf.pending() == 0
        with pytest.raises(BlockingIOError):  # nothing buffered, nothing on the socket
            buf.recv(1)
        assert buf.fileno() == b.fileno()  # everything else is the socket's
        a.shutdown(socket.SHUT_WR)
        assert buf.recv(1) == b""  # the peer closed


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
