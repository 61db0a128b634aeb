"""The command line as a user runs it: `python -m powerd.cli` in a process of its own, from
the root of this checkout (test_cli, test_profilefit)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: tests/support/cli.py


EXAMPLE = ROOT / "policies" / "example.yaml"


def powerd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "powerd.cli", "--log-format", "json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        check=False,
    )
