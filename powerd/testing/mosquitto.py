"""A private Mosquitto on a free loopback port, for tests, benches and local demos.

It can be killed (SIGKILL, like a crashed broker) and started again on the same port.
"""

from __future__ import annotations

import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

MOSQUITTO = "/usr/sbin/mosquitto"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class BrokerProcess:
    """A broker as a process of its own on a loopback port: started (waiting until it
    accepts connections), killed like a crashed broker, started again on the same port."""

    name = "broker"

    def __init__(self, workdir: Path, port: int | None, config_file: Path, log_file: Path):
        self.workdir = workdir
        self.port = port or free_port()
        self.config_file = config_file
        self.log_file = log_file
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"mqtt://127.0.0.1:{self.port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> None:
        raise NotImplementedError  # each broker writes its own configuration

    def _launch(self, argv: list[str], timeout_s: float, poll_s: float) -> None:
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(argv, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout_s
        while not self._accepts_connections():
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"{self.name} did not start on port {self.port}: "
                    + self.log_file.read_text(errors="replace")[-2000:]
                )
            time.sleep(poll_s)

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


class LocalMosquitto(BrokerProcess):
    name = "mosquitto"

    def __init__(
        self,
        workdir: Path,
        port: int | None = None,
        binary: str = MOSQUITTO,
        extra_config: str = "",
    ) -> None:
        super().__init__(workdir, port, workdir / "mosquitto.conf", workdir / "mosquitto.log")
        self.extra_config = extra_config  # more mosquitto.conf lines (limits, ...)
        self.binary = binary

    def start(self, timeout_s: float = 10.0) -> None:
        if self.running:
            return
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_file.write_text(
            f"listener {self.port} 127.0.0.1\n"
            "allow_anonymous true\n"
            "persistence false\n"
            "set_tcp_nodelay true\n"
            "log_dest stderr\n" + self.extra_config
        )
        self._launch([self.binary, "-c", str(self.config_file)], timeout_s, 0.02)
