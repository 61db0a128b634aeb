"""The admin API over HTTPS, with certificates made by deploy/pki's scripts: the site's CA
verifies it, plain HTTP gets nothing on its port, and with a client CA only clients with a
certificate of that CA get a connection. The CLI client (`--ca`, `--cert`, `--key`) and a
`powerd controller` process configured by its settings file talk to it."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from support.daemons import popen, stop
from support.live_api import POLICY, LiveApi, run, wait_until
from support.pki import Pki

from powerd.api.client import Client, tls_context
from powerd.api.server import ApiServer
from powerd.auth import new_token_entry
from powerd.controller.settings import ControllerSettings
from powerd.coordinator.main import CoordinatorSettings
from powerd.settings import ApiTls, SettingsError
from powerd.testing.mosquitto import free_port


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    return Pki(tmp_path / "pki", "site-a CA")


@pytest.fixture
def https_api(tmp_path: Path, pki: Pki) -> Iterator[LiveApi]:
    cert, key = pki.server("api", "127.0.0.1")
    live = LiveApi(tmp_path, tls=ApiTls(cert, key)).start()
    try:
        yield live
    finally:
        live.close()


@pytest.mark.process
def test_the_api_answers_https_verified_by_the_sites_ca(
    https_api: LiveApi, pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    live = https_api
    assert live.url.startswith("https://127.0.0.1:")
    token = live.tokens["admin"]
    client = Client(live.url, token, ca_file=pki.ca)
    try:
        assert client.fleet()["gpus"] == 8
    finally:
        client.close()
    code, out = run(["status", "--url", live.url, "--token", token, "--ca", str(pki.ca)])
    assert code == 0 and "policy test-policy.yaml" in out, out
    monkeypatch.setenv("POWERD_CA", str(pki.ca))  # what a shell profile would set
    code, out = run(["status", "--url", live.url, "--token", token])
    assert code == 0 and "policy test-policy.yaml" in out, out


@pytest.mark.process
def test_plain_http_gets_nothing_on_the_https_port(https_api: LiveApi) -> None:
    plain = https_api.url.replace("https://", "http://")
    with pytest.raises(httpx.TransportError):
        httpx.get(f"{plain}/healthz", timeout=5)
    # Byte for byte: a plain request gets no HTTP answer, only a TLS alert (or a close).
    host, port = plain.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=5) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        answer = s.recv(1024)
    assert not answer.startswith(b"HTTP/"), answer


@pytest.mark.process
def test_a_certificate_of_another_ca_is_not_trusted(
    https_api: LiveApi, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    other = Pki(tmp_path / "other", "another CA")
    client = Client(https_api.url, https_api.tokens["admin"], ca_file=other.ca)
    with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
        client.fleet()
    client.close()
    # Without --ca the system's trust store decides, and it does not know the site's CA.
    code, _ = run(["status", "--url", https_api.url, "--token", https_api.tokens["admin"]])
    assert code == 1
    assert "certificate verify failed" in capsys.readouterr().err
    with pytest.raises(ValueError, match="for https:// URLs"):
        Client(https_api.url.replace("https", "http"), None, ca_file=other.ca)
    with pytest.raises(ValueError, match="cannot load the TLS files"):
        Client(https_api.url, None, ca_file=tmp_path / "missing.crt")


@pytest.mark.process
def test_mutual_tls_lets_in_only_clients_with_a_certificate_of_the_client_ca(
    tmp_path: Path, pki: Pki
) -> None:
    cert, key = pki.server("api", "127.0.0.1")
    live = LiveApi(tmp_path, tls=ApiTls(cert, key, client_ca_file=pki.ca)).start()
    other = Pki(tmp_path / "other", "another CA")
    alice_cert, alice_key = pki.client("alice")
    mallory_cert, mallory_key = other.client("mallory")
    token = live.tokens["viewer"]
    try:
        for who, files in {
            "no certificate": {},
            "another CA's": {"cert_file": mallory_cert, "key_file": mallory_key},
        }.items():
            c = Client(live.url, token, ca_file=pki.ca, **files)
            with pytest.raises(httpx.TransportError):
                c.fleet()
                pytest.fail(f"{who} got an answer")
            c.close()
        c = Client(live.url, token, ca_file=pki.ca, cert_file=alice_cert, key_file=alice_key)
        assert c.fleet()["gpus"] == 8
        c.close()
        tls = ["--ca", str(pki.ca), "--cert", str(alice_cert), "--key", str(alice_key)]
        code, _ = run(["status", "--url", live.url, "--token", token, *tls])
        assert code == 0
    finally:
        live.close()


@pytest.mark.process
def test_api_tls_files_that_cannot_be_loaded_are_named_at_start(tmp_path: Path, pki: Pki) -> None:
    cert, _ = pki.server("api", "127.0.0.1")
    missing = tmp_path / "api.key"
    port = free_port()
    with pytest.raises(ValueError, match=r"api_tls_key_file '.*api\.key'"):
        ApiServer(FastAPI(), "127.0.0.1", port, tls=ApiTls(cert, missing))
    # The port was let go: a corrected start binds it.
    ApiServer(FastAPI(), "127.0.0.1", port)._sock.close()


def test_the_settings_of_both_apis_give_their_tls(tmp_path: Path) -> None:
    cert, key, ca = (tmp_path / n for n in ("api.crt", "api.key", "ca.crt"))
    for cls in (ControllerSettings, CoordinatorSettings):
        settings = cls.load(
            None, api_tls_cert_file=cert, api_tls_key_file=key, api_tls_client_ca_file=ca
        )
        assert settings.api_tls() == ApiTls(cert, key, ca)
        assert cls.load(None).api_tls() is None
        with pytest.raises(SettingsError, match="need api_tls_cert_file"):
            cls.load(None, api_tls_client_ca_file=ca)


@pytest.mark.process
def test_a_controller_process_serves_https_from_its_settings(tmp_path: Path, pki: Pki) -> None:
    cert, key = pki.server("api", "127.0.0.1", "localhost")
    (tmp_path / "policy.yaml").write_text(POLICY)
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(new_token_entry("alice", "viewer")[1])
    port = free_port()
    (tmp_path / "controller.toml").write_text(
        f'policy = "{tmp_path / "policy.yaml"}"\ndb = "sqlite:///{tmp_path / "powerd.db"}"\n'
        f'broker = "mqtt://127.0.0.1:{free_port()}"\napi_port = {port}\n'
        f'tokens_file = "{tokens}"\napi_tls_cert_file = "{cert}"\napi_tls_key_file = "{key}"\n'
    )
    proc = popen(["controller", "--config", str(tmp_path / "controller.toml")], tmp_path, "ctl")
    try:
        ctx = tls_context(pki.ca)

        def healthy() -> bool:
            if proc.poll() is not None:
                pytest.fail((tmp_path / "ctl.log").read_text()[-2000:])
            try:
                return httpx.get(f"https://localhost:{port}/healthz", verify=ctx).is_success
            except httpx.TransportError:
                return False

        wait_until(healthy, "the controller's API over HTTPS")
    finally:
        assert stop(proc) == 0
    listening = [
        json.loads(line)
        for line in (tmp_path / "ctl.log").read_text().splitlines()
        if '"api_listening"' in line
    ]
    assert listening[0]["url"] == f"https://127.0.0.1:{port}"
