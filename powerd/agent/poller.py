"""A source the agent reads beside NVML (a serving engine's perf counters, the kubelet's
pods) polled in a thread of its own, never on the agent's event loop."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Poller:
    """Calls `poll` every `period_s` until `stop`; `stop` waits up to `join_s` for a poll
    in progress (its own timeouts bound it)."""

    def __init__(self, name: str, poll: Callable[[], None], period_s: float, join_s: float):
        self.name = name
        self._poll = poll
        self.period_s = period_s
        self.join_s = join_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._poll()
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.join_s)
