"""`powerd agent --record FILE`: the telemetry the agent reads, written as nvidia-smi writes
`--query-gpu=timestamp,index,uuid,power.draw,power.limit,temperature.gpu,clocks.sm
--format=csv`, so that `powerd sim` replays it like any recording (docs/simulator.md,
"Recorded traces").

Lines are handed to a writer thread: a slow disk never delays a sample or a command. A GPU
whose reading failed is left out of that sample, as nvidia-smi's `[N/A]` would not replay.
"""

from __future__ import annotations

import queue
import threading
from datetime import UTC, datetime
from pathlib import Path

import structlog

from powerd.wire import NodeTelemetry

log = structlog.get_logger(__name__)

HEADER = (
    "timestamp, index, uuid, power.draw [W], power.limit [W], temperature.gpu, "
    "clocks.current.sm [MHz]"
)
# Lines waiting for the disk; beyond this the newest are dropped (and counted), not the loop.
MAX_QUEUED = 100_000


class TraceRecorder:
    """Append each telemetry sample to `path` (created with its header if new or empty)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.dropped = 0
        self._lines: queue.Queue[str | None] = queue.Queue(MAX_QUEUED)
        self._thread = threading.Thread(target=self._write, name="trace-recorder", daemon=True)
        self._thread.start()

    def __call__(self, msg: NodeTelemetry) -> None:
        stamp = datetime.fromtimestamp(msg.ts, tz=UTC).strftime("%Y/%m/%d %H:%M:%S.%f")[:-3]
        for g in msg.gpus:
            if g.error is not None:
                continue
            line = (
                f"{stamp}, {g.index}, {g.uuid}, {g.power_w:.2f} W, {g.cap_w:.2f} W, "
                f"{g.temp_c:.0f}, {g.sm_clock_mhz:.0f} MHz"
            )
            try:
                self._lines.put_nowait(line)
            except queue.Full:
                self.dropped += 1

    def close(self) -> None:
        """Write what is queued, then stop the thread."""
        self._lines.put(None)
        self._thread.join(timeout=10)

    def _write(self) -> None:
        try:
            new = not self.path.exists() or self.path.stat().st_size == 0
            with self.path.open("a", encoding="utf-8") as out:
                if new:
                    out.write(HEADER + "\n")
                while (line := self._lines.get()) is not None:
                    out.write(line + "\n")
                    if self._lines.empty():
                        out.flush()
        except OSError as exc:
            log.error("trace_not_recorded", path=str(self.path), error=str(exc))
