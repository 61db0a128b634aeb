"""The systemd notify protocol (sd_notify(3)) without libsystemd: a datagram per message.

Under `Type=notify` systemd passes a socket in `$NOTIFY_SOCKET` (a path, or `@name` for the
Linux abstract namespace) and waits for `READY=1`; with `WatchdogSec=` it also sets
`$WATCHDOG_USEC` and kills the service when `WATCHDOG=1` stops arriving. Outside systemd the
variable is absent and every call is a no-op, so the daemons call these unconditionally.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

import structlog

log = structlog.get_logger(__name__)


class Notifier:
    """One process's channel to its service manager; disabled when there is none."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        self.address = _address(env.get("NOTIFY_SOCKET", ""))
        self.watchdog_s = _watchdog_interval(env)
        self._sock: socket.socket | None = None

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *fields: str) -> bool:
        """Send `KEY=value` fields in one datagram; False when nobody listens or it failed.

        A failure is logged and swallowed: losing a status line must never stop the daemon.
        (A lost WATCHDOG=1 is what the watchdog itself is there to catch.)
        """
        if self.address is None:
            return False
        payload = "\n".join(fields).encode()
        try:
            if self._sock is None:
                self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("sd_notify_failed", socket=_shown(self.address), error=str(exc))
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """Start-up is done: systemd marks the unit active and starts its dependants."""
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []))

    def status(self, text: str) -> bool:
        """One line shown by `systemctl status`."""
        return self.notify(f"STATUS={text}")

    def watchdog(self) -> bool:
        """Proof of life; call at least every `watchdog_s` (the tick loop does, each tick)."""
        if self.watchdog_s is None:
            return False
        return self.notify("WATCHDOG=1")

    def stopping(self, status: str | None = None) -> bool:
        return self.notify("STOPPING=1", *([f"STATUS={status}"] if status else []))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _address(value: str) -> str | bytes | None:
    if not value:
        return None
    if value.startswith("@"):
        # Abstract namespace: a leading NUL byte instead of '@', no file on disk.
        return b"\0" + value[1:].encode()
    if value.startswith("/"):
        return value
    log.warning("sd_notify_socket_ignored", socket=value, why="neither a path nor @abstract")
    return None


def _watchdog_interval(env: Mapping[str, str]) -> float | None:
    """Seconds between pings: half of WatchdogSec, as sd_watchdog_enabled(3) advises.

    WATCHDOG_PID, when set, names the process meant to ping; another process (a child that
    inherited the environment) must not, or it would keep a hung parent alive.
    """
    usec = env.get("WATCHDOG_USEC", "")
    pid = env.get("WATCHDOG_PID", "")
    if not usec.isdigit() or int(usec) == 0:
        return None
    if pid and (not pid.isdigit() or int(pid) != os.getpid()):
        return None
    return int(usec) / 1e6 / 2


def _shown(address: str | bytes) -> str:
    return "@" + address[1:].decode(errors="replace") if isinstance(address, bytes) else address
