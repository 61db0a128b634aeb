"""Certificates for tests, made by the very scripts an operator runs (deploy/pki/), and a
Mosquitto that runs a configuration file as given (deploy/pki/mosquitto-tls.conf).

Making a certificate starts openssl: a test that uses `Pki` is marked `process`.
"""

from __future__ import annotations

import getpass
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

from powerd.testing.mosquitto import MOSQUITTO, BrokerProcess

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "deploy" / "pki"
ACL = REPO / "systemd" / "mosquitto" / "acl"


def run_script(name: str, *args: str | Path) -> subprocess.CompletedProcess[str]:
    """One of deploy/pki's scripts, as an operator runs it (its exit status unchecked)."""
    return subprocess.run(
        [str(SCRIPTS / name), *map(str, args)], capture_output=True, text=True, check=False
    )


def _made(result: subprocess.CompletedProcess[str]) -> tuple[Path, Path]:
    if result.returncode != 0:
        raise RuntimeError(f"{result.args[0]} failed: {result.stderr}")
    cert, key = result.stdout.split()
    return Path(cert), Path(key)


class Pki:
    """A certificate authority in `root` (made now) and the certificates it signs."""

    def __init__(self, root: Path, name: str = "powerd test CA") -> None:
        self.root = root
        self.ca, self.ca_key = _made(run_script("make-ca.sh", "--dir", root, "--name", name))

    def client(self, name: str) -> tuple[Path, Path]:
        """A client certificate and key whose common name (the broker's username) is `name`."""
        return _made(run_script("make-node-cert.sh", "--dir", self.root, name))

    def server(self, name: str, *hosts: str) -> tuple[Path, Path]:
        """A server certificate and key for `hosts` (default: 127.0.0.1)."""
        return _made(
            run_script("make-server-cert.sh", "--dir", self.root, name, *(hosts or ("127.0.0.1",)))
        )


class ConfiguredMosquitto(BrokerProcess):
    """Mosquitto on a free loopback port, configured by `config(port)`. Started as root (CI
    containers), it stays root: Mosquitto would otherwise switch to its own user, who cannot
    read a test's private files (keys are 0600)."""

    name = "mosquitto"

    def __init__(self, workdir: Path, config: Callable[[int], str]) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        super().__init__(workdir, None, workdir / "mosquitto.conf", workdir / "mosquitto.log")
        self.text = config(self.port)

    @property
    def url(self) -> str:
        return f"mqtts://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running:
            return
        self.config_file.write_text(
            self.text
            + "\npersistence false\nlog_dest stderr\n"
            + "log_type error\nlog_type warning\nlog_type notice\nlog_type information\n"
            + (f"user {getpass.getuser()}\n" if os.geteuid() == 0 else "")
        )
        self._launch([MOSQUITTO, "-c", str(self.config_file)], timeout_s, 0.02)


def plain_tls_config(port: int, cert: Path, key: str | Path) -> str:
    """A TLS listener that takes any client (no client certificate, no password)."""
    return f"listener {port} 127.0.0.1\nallow_anonymous true\ncertfile {cert}\nkeyfile {key}\n"


def deployed_tls_config(port: int, ca: Path, cert: Path, key: Path, acl: Path = ACL) -> str:
    """deploy/pki/mosquitto-tls.conf as shipped, its port and files swapped for the test's."""
    text = (SCRIPTS / "mosquitto-tls.conf").read_text()
    swaps = {
        "listener 8883": f"listener {port} 127.0.0.1",
        "/etc/mosquitto/certs/ca.crt": str(ca),
        "/etc/mosquitto/certs/broker.crt": str(cert),
        "/etc/mosquitto/certs/broker.key": str(key),
        "/etc/mosquitto/powerd.acl": str(acl),
    }
    for old, new in swaps.items():
        if old not in text:
            raise AssertionError(f"deploy/pki/mosquitto-tls.conf no longer has {old!r}")
        text = text.replace(old, new)
    return text
