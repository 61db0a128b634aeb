"""`python -m powerd.chaos.controller OFFSET_FILE`: `powerd controller`, with a wall clock
to step.

Settings come from the environment (`POWERD_*`), as for `powerd controller`. The only
difference is the clock, the same as the chaos agent's (powerd/chaos/agent.py): wall time
is the system's plus the seconds written in OFFSET_FILE, for everything the controller
judges by its wall clock (scheduled windows, temporary budgets' expiry) and for the lease's
check of that clock against the database's. Monotonic time is untouched. Test only: the
harness runs the members of a standby pair this way so that one of them can be a host
whose clock is an hour ahead (docs/safety.md, "Chaos harness").
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from powerd.chaos.agent import SteppableWallClock
from powerd.controller.main import run_controller
from powerd.controller.settings import ControllerSettings
from powerd.logs import configure_logging


def main() -> None:
    if len(sys.argv) != 2:
        sys.exit("usage: python -m powerd.chaos.controller OFFSET_FILE  (settings: $POWERD_*)")
    configure_logging("json")
    settings = ControllerSettings.load()
    asyncio.run(run_controller(settings, SteppableWallClock(Path(sys.argv[1]))))


if __name__ == "__main__":
    main()
