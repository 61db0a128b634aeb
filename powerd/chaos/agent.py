"""`python -m powerd.chaos.agent OFFSET_FILE`: `powerd agent`, with a wall clock to step.

Settings come from the environment (`POWERD_*`), as for `powerd agent`. The only difference
is the clock: its wall time is the system's plus the seconds written in OFFSET_FILE (a
missing or empty file: 0), so a harness can jump an agent's wall clock by ±600 s while the
process runs. Monotonic time is the system's, untouched (it never jumps). Test only: a real
node's wall clock is stepped by NTP or an operator, not by powerd.
"""

from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path

from powerd.agent.main import run_agent_process
from powerd.agent.settings import AgentSettings
from powerd.clock import SystemClock
from powerd.logs import configure_logging


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


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m powerd.chaos.agent OFFSET_FILE  (settings: $POWERD_*)")
    configure_logging("json")
    settings = AgentSettings.load()
    asyncio.run(run_agent_process(settings, SteppableWallClock(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
