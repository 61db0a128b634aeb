"""amqtt (a Python asyncio broker, an implementation independent of Mosquitto) as a process
of the test's own on a free loopback port, with LocalMosquitto's interface: `url`, `port`,
`start()`, `kill()`. powerd's client must speak MQTT 3.1.1, not one broker's habits.

amqtt is a test dependency (pyproject.toml's `test` extra): its `amqtt` command lies beside
the Python that runs the tests. POWERD_TEST_AMQTT names another one.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from powerd.testing.mosquitto import BrokerProcess, LocalMosquitto


def amqtt_command() -> Path:
    return Path(os.environ.get("POWERD_TEST_AMQTT") or Path(sys.executable).parent / "amqtt")


class LocalAmqtt(BrokerProcess):
    name = "amqtt"

    def __init__(self, workdir: Path, port: int | None = None) -> None:
        super().__init__(workdir, port, workdir / "amqtt.yaml", workdir / "amqtt.log")

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
        self._launch([str(amqtt_command()), "-c", str(self.config_file)], timeout_s, 0.05)


Broker = LocalMosquitto | LocalAmqtt  # what the `broker` fixture gives
