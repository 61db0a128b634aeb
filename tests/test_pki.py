"""The site's certificates, made by deploy/pki's scripts, on a real Mosquitto running
deploy/pki/mosquitto-tls.conf: each client is known by its certificate, a certificate of
another CA gets nowhere, and a controller that trusts only the site's CA does not steer
through a broker that another CA vouches for (docs/safety.md, "Which broker")."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs
from support.daemons import popen, stop
from support.live_api import POLICY
from support.pki import (
    ConfiguredMosquitto,
    Pki,
    deployed_tls_config,
    plain_tls_config,
    run_script,
)

from powerd.agent.settings import AgentSettings
from powerd.settings import SettingsError
from powerd.testing.mosquitto import MOSQUITTO
from powerd.transport import ConnectionState, Message, MqttConfig, MqttTransport
from powerd.wire import Topics

T = Topics()


def openssl(*args: str | Path) -> str:
    return subprocess.run(
        ["openssl", *map(str, args)], capture_output=True, text=True, check=True
    ).stdout


def subject(cert: Path) -> str:
    out = openssl("x509", "-in", cert, "-noout", "-subject", "-nameopt", "RFC2253")
    return out.strip().removeprefix("subject=")


def verifies(ca: Path, cert: Path, purpose: str) -> bool:
    result = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), "-purpose", purpose, str(cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    return result.returncode == 0


@pytest.mark.process
def test_the_scripts_make_a_ca_and_the_certificates_it_signs(tmp_path: Path) -> None:
    pki = Pki(tmp_path / "pki", "site-a CA")
    node_cert, node_key = pki.client("row-1-rack-1-node-01")
    broker_cert, broker_key = pki.server("broker", "broker.example.net", "10.0.0.5")
    other = Pki(tmp_path / "other")

    assert subject(pki.ca) == "CN=site-a CA"
    assert subject(node_cert) == "CN=row-1-rack-1-node-01"  # the broker's username
    assert verifies(pki.ca, node_cert, "sslclient")
    assert not verifies(pki.ca, node_cert, "sslserver")  # a node cannot pose as the broker
    assert verifies(pki.ca, broker_cert, "sslserver")
    assert not verifies(other.ca, broker_cert, "sslserver")
    text = openssl("x509", "-in", broker_cert, "-noout", "-ext", "subjectAltName")
    assert "DNS:broker.example.net" in text and "IP Address:10.0.0.5" in text
    # Keys are the owner's alone; certificates are public.
    for key in (pki.ca_key, node_key, broker_key):
        assert key.stat().st_mode & 0o777 == 0o600
    for cert in (pki.ca, node_cert, broker_cert):
        assert cert.stat().st_mode & 0o777 == 0o644

    # Nothing is overwritten, and bad names are refused before anything is made.
    before = pki.ca.read_bytes()
    again = run_script("make-ca.sh", "--dir", pki.root)
    assert again.returncode == 2 and "not overwritten" in again.stderr
    assert pki.ca.read_bytes() == before
    twice = run_script("make-node-cert.sh", "--dir", pki.root, "row-1-rack-1-node-01")
    assert twice.returncode == 2 and "not overwritten" in twice.stderr
    bad = run_script("make-node-cert.sh", "--dir", pki.root, "node/../../etc")
    assert bad.returncode == 2 and "not a node id" in bad.stderr
    no_ca = run_script("make-node-cert.sh", "--dir", tmp_path / "empty", "n1")
    assert no_ca.returncode == 2 and "run make-ca.sh first" in no_ca.stderr


@pytest.fixture
def site(tmp_path: Path) -> Iterator[tuple[Pki, ConfiguredMosquitto]]:
    """The site's CA and its broker, running deploy/pki/mosquitto-tls.conf."""
    if not Path(MOSQUITTO).exists():
        pytest.skip(f"{MOSQUITTO} is not installed")
    pki = Pki(tmp_path / "site-pki", "site-a CA")
    cert, key = pki.server("broker", "127.0.0.1")
    with ConfiguredMosquitto(
        tmp_path / "site-broker", lambda port: deployed_tls_config(port, pki.ca, cert, key)
    ) as broker:
        yield pki, broker


def client(broker: ConfiguredMosquitto, ca: Path, cert: Path | None, key: Path | None) -> Any:
    return MqttTransport(
        MqttConfig(
            "127.0.0.1",
            broker.port,
            tls=True,
            ca_file=ca,
            cert_file=cert,
            key_file=key,
            reconnect_min_s=0.1,
            reconnect_max_s=0.3,
            timeout_s=3,
        )
    )


async def received_until(t: MqttTransport, topic: str) -> list[Message]:
    got: list[Message] = []

    async def read() -> None:
        async for m in t.messages():
            got.append(m)
            if m.topic == topic and m.payload == b"end":
                return

    await asyncio.wait_for(read(), 10)
    return got


@pytest.mark.process
@pytest.mark.broker
async def test_the_broker_knows_each_client_by_its_certificate(
    site: tuple[Pki, ConfiguredMosquitto],
) -> None:
    pki, broker = site
    controller = client(broker, pki.ca, *pki.client("powerd-controller"))
    node = client(broker, pki.ca, *pki.client("node-a"))
    await controller.connect()
    await controller.subscribe(T.all_nodes("telemetry"))
    await node.connect()
    try:
        await asyncio.wait_for(controller.wait_connected(), 10)
        await asyncio.wait_for(node.wait_connected(), 10)
        # The ACL sees the certificate's name: node-a publishes as node-a, never as node-b.
        await node.publish(T.telemetry("node-b"), b"a-as-b", qos=1)
        await node.publish(T.telemetry("node-a"), b"end", qos=1)
        got = await received_until(controller, T.telemetry("node-a"))
        assert [(m.topic, m.payload) for m in got] == [(T.telemetry("node-a"), b"end")]
    finally:
        await node.disconnect()
        await controller.disconnect()


@pytest.mark.process
@pytest.mark.broker
async def test_a_client_without_the_sites_certificate_is_refused(
    site: tuple[Pki, ConfiguredMosquitto], tmp_path: Path
) -> None:
    pki, broker = site
    other = Pki(tmp_path / "other-pki", "another CA")
    impostors = {
        "another CA's certificate": client(broker, pki.ca, *other.client("node-a")),
        "no certificate": client(broker, pki.ca, None, None),
    }
    with capture_logs() as logs:
        for t in impostors.values():
            await t.connect()
        await asyncio.sleep(1.5)  # several attempts each (reconnect_max_s 0.3)
        states = {name: t.state for name, t in impostors.items()}
        for t in impostors.values():
            await t.disconnect()
    assert all(s is not ConnectionState.CONNECTED for s in states.values()), states
    failures = [e for e in logs if e["event"] == "mqtt_disconnected"]
    assert len(failures) >= 4, logs


@pytest.mark.process
@pytest.mark.broker
async def test_an_agent_that_trusts_the_sites_ca_refuses_another_broker(
    site: tuple[Pki, ConfiguredMosquitto], tmp_path: Path
) -> None:
    pki, _ = site
    other = Pki(tmp_path / "other-pki", "another CA")
    cert, key = other.server("broker", "127.0.0.1")
    with ConfiguredMosquitto(
        tmp_path / "foreign", lambda port: plain_tls_config(port, cert, key)
    ) as foreign:
        settings = AgentSettings(
            node_id="node-a", broker=foreign.url, tls_ca_file=pki.ca, reconnect_max_s=0.3
        )
        t = MqttTransport(settings.mqtt_config())
        with capture_logs() as logs:
            await t.connect()
            await asyncio.sleep(1.0)
            state = t.state
            await t.disconnect()
    assert state is not ConnectionState.CONNECTED
    refused = [e for e in logs if e["event"] == "mqtt_broker_not_trusted"]
    assert refused and refused[0]["log_level"] == "error"
    assert refused[0]["ca_file"] == str(pki.ca)
    assert "unable to get local issuer certificate" in refused[0]["reason"]


def test_tls_settings_that_would_leave_the_broker_unchecked_are_refused(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not a certificate")
    cases = {
        "for mqtts:// only": {"broker": "mqtt://broker:1883", "tls_ca_file": ca},
        "tls_insecure turns off": {
            "broker": "mqtts://broker",
            "tls_ca_file": ca,
            "tls_insecure": True,
        },
        "tls_key_file needs tls_cert_file": {"broker": "mqtts://b", "tls_key_file": ca},
    }
    for message, values in cases.items():
        with pytest.raises(SettingsError, match=message):
            AgentSettings.load(None, node_id="n1", **values)
    # A file that is not a certificate is named at start, not found out at the first connect.
    settings = AgentSettings.load(None, node_id="n1", broker="mqtts://b", tls_ca_file=ca)
    with pytest.raises(ValueError, match=r"ca_file '.*ca\.crt'"):
        MqttTransport(settings.mqtt_config())


def events(log: Path, name: str) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        if f'"{name}"' in line:
            out.append(json.loads(line))
    return out


def wait_for(cond: Any, what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.mark.process
@pytest.mark.broker
async def test_a_controller_pinned_to_the_sites_ca_does_not_steer_through_another_broker(
    site: tuple[Pki, ConfiguredMosquitto], tmp_path: Path
) -> None:
    pki, site_broker = site
    other = Pki(tmp_path / "other-pki", "another CA")
    cert, key = other.server("broker", "127.0.0.1")
    policy = tmp_path / "policy.yaml"
    policy.write_text(POLICY)
    ctl_cert, ctl_key = pki.client("powerd-controller")

    def start(name: str, broker: ConfiguredMosquitto) -> Any:
        config = tmp_path / f"{name}.toml"
        config.write_text(
            f'policy = "{policy}"\ndb = "sqlite:///{tmp_path / name}.db"\n'
            f'controller_id = "{name}"\nbroker = "{broker.url}"\nlearn_s = 0.2\n'
            f'tls_ca_file = "{pki.ca}"\ntls_cert_file = "{ctl_cert}"\n'
            f'tls_key_file = "{ctl_key}"\nreconnect_max_s = 0.5\n'
        )
        return popen(["controller", "--config", str(config)], tmp_path, name)

    with ConfiguredMosquitto(
        tmp_path / "foreign", lambda port: plain_tls_config(port, cert, key)
    ) as foreign:
        # Everything that reaches the foreign broker, as its owner would see it.
        watcher = client(foreign, other.ca, None, None)
        await watcher.connect()
        await watcher.subscribe("powerd/#")
        await asyncio.wait_for(watcher.wait_connected(), 10)
        proc = start("ctl-foreign", foreign)
        try:
            log = tmp_path / "ctl-foreign.log"
            refused = await asyncio.to_thread(
                wait_for,
                lambda: events(log, "mqtt_broker_not_trusted"),
                "the controller to refuse the broker",
            )
            await asyncio.sleep(2.0)  # ten ticks of the policy, had it connected
            seen = []
            while (m := await _next_or_none(watcher)) is not None:
                seen.append(m.topic)
        finally:
            code = await asyncio.to_thread(stop, proc)
            await watcher.disconnect()
    assert refused[0]["level"] == "error"
    assert refused[0]["ca_file"] == str(pki.ca)
    assert "broker" in refused[0]["hint"]
    assert seen == []  # no status, no caps: nothing ever reached the foreign broker
    assert events(log, "caps_sent") == [] and events(log, "mqtt_connected") == []
    assert code == 0

    # The same settings against the site's own broker: it connects and announces itself.
    watcher = client(site_broker, pki.ca, *pki.client("powerd-coordinator"))
    await watcher.connect()
    await watcher.subscribe(T.all_controllers())
    proc = start("ctl-site", site_broker)
    try:
        status = await asyncio.wait_for(watcher.messages().__anext__(), 30)
    finally:
        await asyncio.to_thread(stop, proc)
        await watcher.disconnect()
    assert status.topic == T.controller_status("ctl-site")


async def _next_or_none(t: MqttTransport) -> Message | None:
    try:
        return await asyncio.wait_for(t.messages().__anext__(), 0.2)
    except TimeoutError:
        return None
