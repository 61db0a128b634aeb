"""The exit statuses of every `powerd` command."""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1  # a runtime failure
EXIT_BAD_INPUT = 2  # a bad policy, snapshot, scenario or argument
