"""The documented Mosquitto ACL, on a real broker with per-node passwords.

The broker runs the example configuration (systemd/mosquitto/powerd.conf, with the TLS
listener swapped for a loopback one) and the example ACL file unchanged. MQTT 3.1.1 gives a
publisher no sign that the broker dropped its message, so every check observes delivery
through a subscriber, and each ends with a marker message that is allowed: messages between
one pair of clients arrive in order, so once the marker is in, anything denied before it
would already have arrived.
"""

from __future__ import annotations

import asyncio
import getpass
import os
import re
import shutil
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from powerd.testing.mosquitto import MOSQUITTO, free_port
from powerd.transport import LastWill, Message, MqttConfig, MqttTransport
from powerd.transport.codec import Connack, Decoder, encode_connect
from powerd.wire import Topics

REPO = Path(__file__).resolve().parent.parent
T = Topics()
PASSWORDS = {
    "powerd-controller": "controller-secret-0123456789abcdef",
    "node-a": "node-a-secret-0123456789abcdef",
    "node-b": "node-b-secret-0123456789abcdef",
}

pytestmark = pytest.mark.process  # the broker's password file is made by `mosquitto_passwd`


class SecuredBroker:
    def __init__(self, workdir: Path) -> None:
        self.port = free_port()
        passwd = workdir / "powerd.passwd"
        passwd.touch(mode=0o600)
        for user, password in PASSWORDS.items():
            subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password], check=True)
        conf = (REPO / "systemd" / "mosquitto" / "powerd.conf").read_text()
        # Keep every setting but the listeners and their certificates.
        kept = [
            line
            for line in conf.splitlines()
            if not re.match(r"^(listener|certfile|keyfile|cafile|tls_version)\b", line)
        ]
        text = "\n".join(kept)
        text = text.replace("/etc/mosquitto/powerd.passwd", str(passwd))
        text = text.replace(
            "/etc/mosquitto/powerd.acl", str(REPO / "systemd" / "mosquitto" / "acl")
        )
        self.config = workdir / "mosquitto.conf"
        self.config.write_text(
            f"{text}\nlistener {self.port} 127.0.0.1\npersistence false\nlog_dest stderr\n"
            # Started as root (CI containers), mosquitto would switch to its own user, who
            # cannot read this test's private temporary files.
            + (f"user {getpass.getuser()}\n" if os.geteuid() == 0 else "")
            + "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
        )
        self.log = workdir / "mosquitto.log"
        with self.log.open("wb") as log:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(self.config)], stderr=log)
        deadline = time.monotonic() + 10
        while not self._listening():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                pytest.fail("mosquitto did not start: " + self.log.read_text()[-2000:])
            time.sleep(0.02)

    def _listening(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def client(self, user: str, password: str | None = None) -> MqttTransport:
        return MqttTransport(
            MqttConfig(
                "127.0.0.1",
                self.port,
                username=user,
                password=PASSWORDS[user] if password is None else password,
                reconnect_max_s=0.5,
            )
        )


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[SecuredBroker]:
    if not Path(MOSQUITTO).exists() or shutil.which("mosquitto_passwd") is None:
        pytest.skip("mosquitto and mosquitto_passwd are needed (Debian package mosquitto)")
    b = SecuredBroker(tmp_path)
    try:
        yield b
    finally:
        b.stop()


async def connected(
    t: MqttTransport, subscribe: tuple[str, ...] = (), will: LastWill | None = None
) -> MqttTransport:
    await t.connect(will)
    for topic_filter in subscribe:
        await t.subscribe(topic_filter)
    await asyncio.wait_for(t.wait_connected(), 10)
    return t


async def received_until(t: MqttTransport, marker: str) -> list[Message]:
    """Messages up to and including the first one on `marker`'s topic with payload b'end'."""
    got: list[Message] = []

    async def read() -> None:
        async for m in t.messages():
            got.append(m)
            if m.topic == marker and m.payload == b"end":
                return

    await asyncio.wait_for(read(), 10)
    return got


@pytest.fixture
async def clients(
    broker: SecuredBroker,
) -> AsyncIterator[tuple[MqttTransport, MqttTransport, MqttTransport]]:
    controller = await connected(
        broker.client("powerd-controller"),
        (T.all_nodes("telemetry"), T.all_nodes("ack"), T.all_nodes("status")),
        LastWill(T.controller_status("ctl-a"), b"offline"),
    )
    node_a = await connected(
        broker.client("node-a"),
        (T.caps("node-a"), T.caps("node-b"), T.all_nodes("telemetry"), T.all_controllers()),
        LastWill(T.status("node-a"), b"offline"),
    )
    node_b = await connected(broker.client("node-b"), (), LastWill(T.status("node-b"), b"off"))
    try:
        yield controller, node_a, node_b
    finally:
        for t in (controller, node_a, node_b):
            await t.disconnect()


async def test_node_publishes_only_its_own_topics(
    clients: tuple[MqttTransport, MqttTransport, MqttTransport],
) -> None:
    controller, node_a, _ = clients
    await node_a.publish(T.telemetry("node-a"), b"a-own", qos=1)
    await node_a.publish(T.telemetry("node-b"), b"a-as-b", qos=1)  # spoofing B: denied
    await node_a.publish(T.ack("node-b"), b"a-as-b", qos=1)
    await node_a.publish(T.status("node-b"), b"a-as-b", qos=1)
    await node_a.publish(T.caps("node-a"), b"a-caps", qos=1)  # caps come from the controller
    await node_a.publish(T.caps("node-b"), b"a-caps", qos=1)
    await node_a.publish(T.controller_status("ctl-a"), b"a-as-controller", qos=1)
    await node_a.publish(T.ack("node-a"), b"a-ack", qos=1)
    await node_a.publish(T.status("node-a"), b"end", qos=1)

    got = await received_until(controller, T.status("node-a"))
    assert [(m.topic, m.payload) for m in got] == [
        (T.telemetry("node-a"), b"a-own"),
        (T.ack("node-a"), b"a-ack"),
        (T.status("node-a"), b"end"),
    ]


async def test_node_reads_only_its_own_caps_and_no_telemetry(
    clients: tuple[MqttTransport, MqttTransport, MqttTransport],
) -> None:
    controller, node_a, node_b = clients
    await node_b.publish(T.telemetry("node-b"), b"b-telemetry", qos=1)
    await controller.publish(T.caps("node-b"), b"b-caps", qos=1)
    await controller.publish(T.controller_status("ctl-a"), b"online", qos=1)
    await controller.publish(T.caps("node-a"), b"end", qos=1)

    got = await received_until(node_a, T.caps("node-a"))
    assert [(m.topic, m.payload) for m in got] == [
        (T.controller_status("ctl-a"), b"online"),
        (T.caps("node-a"), b"end"),
    ]


async def connack_for(port: int, username: str | None, password: str | None) -> Connack:
    """The broker's answer to a bare CONNECT with these credentials."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(encode_connect("acl-probe", 10, username=username, password=password))
        decoder = Decoder()
        while not (packets := decoder.feed(await asyncio.wait_for(reader.read(64), 5))):
            pass
    finally:
        writer.close()
    assert isinstance(packets[0], Connack)
    return packets[0]


async def test_wrong_or_missing_password_is_refused(broker: SecuredBroker, eventually: Any) -> None:
    for username, password in [("node-a", "node-b-secret-0123456789abcdef"), (None, None)]:
        connack = await connack_for(broker.port, username, password)
        assert connack.reason == "not authorised"
    # The transport keeps trying (the password may be fixed) and says why it is refused.
    t = broker.client("node-a", password="node-b-secret-0123456789abcdef")
    with capture_logs() as logs:
        await t.connect()
        await eventually(
            lambda: any(e["event"] == "mqtt_disconnected" for e in logs), what="a refusal"
        )
        await t.disconnect()
    refusal = next(e for e in logs if e["event"] == "mqtt_disconnected")
    assert refusal["error"] == "connection refused: not authorised"
