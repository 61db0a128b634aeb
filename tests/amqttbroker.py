"""amqtt (a Python asyncio broker, an implementation independent of Mosquitto) as a process
of the test's own on a free loopback port, with LocalMosquitto's interface: `url`, `port`,
`start()`, `kill()`. powerd's client must speak MQTT 3.1.1, not one broker's habits.

amqtt is a test dependency (pyproject.toml's `test` extra): its `amqtt` command lies beside
the Python that runs the tests. POWERD_TEST_AMQTT names another one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from powerd.testing.mosquitto import LocalMosquitto, free_port


def amqtt_command() -> Path:
    return Path(os.environ.get("POWERD_TEST_AMQTT") or Path(sys.executable).parent / "amqtt")


class LocalAmqtt:
    def __init__(self, workdir: Path, port: int | None = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.config_file = workdir / "amqtt.yaml"
        self.log_file = workdir / "amqtt.log"
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 30.0) -> None:
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        # Its $SYS and logging plugins are left out: nothing here reads them.
        self.config_file.write_text(
            "listeners:\n"
            "  default:\n"
            "    type: tcp\n"
            f"    bind: 127.0.0.1:{self.port}\n"
            "plugins:\n"
            "  amqtt.plugins.authentication.AnonymousAuthPlugin:\n"
            "    allow_anonymous: true\n"
        )
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(amqtt_command()), "-c", str(self.config_file)], stdout=log, stderr=log
            )
        deadline = time.monotonic() + timeout_s
        while not self._accepts_connections():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"amqtt did not start on port {self.port}: "
                    + self.log_file.read_text(errors="replace")[-2000:]
                )
            time.sleep(0.05)

    def _accepts_connections(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                return True
        except OSError:
            return False

    def kill(self) -> None:
        """Die at once, like a crashed broker: no clean goodbye to any client."""
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.kill()


Broker = LocalMosquitto | LocalAmqtt  # what the `broker` fixture gives
