"""`python -m powerd.chaos.agent OFFSET_FILE [LIMITS_FILE]`: `powerd agent`, with a wall clock
to step and out-of-band limits to hold.

Settings come from the environment (`POWERD_*`), as for `powerd agent`. The differences:

- the clock: its wall time is the system's plus the seconds written in OFFSET_FILE (a
  missing or empty file: 0), so a harness can jump an agent's wall clock by ±600 s while
  the process runs. Monotonic time is the system's, untouched (it never jumps);
- with LIMITS_FILE and the mock backend: the limits another holds on the node's GPUs (a
  BMC's out-of-band caps), as JSON `{"<gpu index>": watts}` (a missing or empty file:
  none), followed every 0.1 s: a GPU's enforced limit is the lower of it and the agent's,
  and goes back to the agent's the moment its entry goes (`MockBackend.hold_out_of_band`).

Test only: a real node's wall clock is stepped by NTP or an operator, not by powerd.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from powerd.agent.main import run_agent_process
from powerd.agent.settings import AgentSettings
from powerd.backends.base import GpuBackend
from powerd.backends.mock import MockBackend
from powerd.clock import SystemClock
from powerd.logs import configure_logging

LIMITS_POLL_S = 0.1


class SteppableWallClock(SystemClock):
    """The system clock, with the wall clock offset by the number in a file."""

    def __init__(self, offset_file: Path) -> None:
        self.offset_file = offset_file
        self._seen: tuple[float, float] = (-1.0, 0.0)  # (file mtime, offset)

    def offset_s(self) -> float:
        try:
            mtime = os.stat(self.offset_file).st_mtime
        except FileNotFoundError:
            return 0.0
        if mtime != self._seen[0]:
            text = self.offset_file.read_text().strip()
            self._seen = (mtime, float(text) if text else 0.0)
        return self._seen[1]

    def wall(self) -> float:
        return time.time() + self.offset_s()


def write_offset(offset_file: Path, offset_s: float) -> None:
    """Step the agent's wall clock to system time + offset_s (atomically)."""
    tmp = offset_file.with_suffix(".tmp")
    tmp.write_text(f"{offset_s}\n")
    tmp.replace(offset_file)


def write_limits(limits_file: Path, limits_w: dict[int, float]) -> None:
    """Hold out-of-band limits on the node's GPUs, by index (atomically; {}: none)."""
    tmp = limits_file.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(i): w for i, w in limits_w.items()}))
    tmp.replace(limits_file)


def read_limits(limits_file: Path) -> dict[int, float]:
    """The limits a file holds ({} where there is no file, or it is empty)."""
    try:
        text = limits_file.read_text().strip()
    except FileNotFoundError:
        return {}
    return {int(i): float(w) for i, w in json.loads(text).items()} if text else {}


async def follow_limits(backend: MockBackend, limits_file: Path) -> None:
    """Hold on the backend's GPUs the limits the file names, as it changes."""
    uuids = {g.index: g.uuid for g in backend.gpus()}
    held: dict[int, float] = {}
    seen: float | None = -1.0  # the file's mtime when last read (None: no file)
    while True:
        try:
            mtime: float | None = os.stat(limits_file).st_mtime
        except FileNotFoundError:
            mtime = None
        if mtime != seen:  # read only when it changed (as the clock's offset file)
            seen = mtime
            wanted = {i: w for i, w in read_limits(limits_file).items() if i in uuids}
            for i in held.keys() - wanted.keys():
                backend.hold_out_of_band(uuids[i], None)
            for i, w in wanted.items():
                if held.get(i) != w:
                    backend.hold_out_of_band(uuids[i], w)
            held = wanted
        await asyncio.sleep(LIMITS_POLL_S)


def main() -> None:
    if len(sys.argv) not in (2, 3):
        sys.exit(
            "usage: python -m powerd.chaos.agent OFFSET_FILE [LIMITS_FILE]  (settings: $POWERD_*)"
        )
    configure_logging("json")
    settings = AgentSettings.load()
    limits_file = Path(sys.argv[2]) if len(sys.argv) == 3 else None
    tasks: list[asyncio.Task[None]] = []

    def with_backend(backend: GpuBackend) -> None:
        if limits_file is not None and isinstance(backend, MockBackend):
            tasks.append(asyncio.create_task(follow_limits(backend, limits_file)))

    clock = SteppableWallClock(Path(sys.argv[1]))
    asyncio.run(run_agent_process(settings, clock, with_backend))


if __name__ == "__main__":
    main()
