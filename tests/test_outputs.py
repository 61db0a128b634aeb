"""`--out` folders written all or none (powerd/outputs.py): a run killed outright leaves
its staging folder behind; the next run into the folder removes it, never a live run's."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import structlog.testing

from powerd.outputs import STAGE_PREFIX, remove_stale_stages, staged

# A run that stages a file into `out`, says where, and waits to be killed.
WRITER = """
import sys, time
from pathlib import Path
from powerd.outputs import staged
with staged(Path(sys.argv[1])) as stage:
    (stage / "results.json").write_text("{}")
    print(stage.name, flush=True)
    time.sleep(600)
"""


def stages(out: Path) -> list[str]:
    return sorted(p.name for p in out.glob(STAGE_PREFIX + "*"))


def start_writer(out: Path) -> tuple[subprocess.Popen[str], str]:
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(out)], stdout=subprocess.PIPE, text=True, env=env
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


@pytest.mark.process
def test_a_run_killed_outright_leaves_a_stage_the_next_run_removes(tmp_path: Path) -> None:
    out = tmp_path / "out"
    live, live_stage = start_writer(out)
    killed, killed_stage = start_writer(out)
    try:
        assert stages(out) == sorted([live_stage, killed_stage])
        killed.send_signal(signal.SIGKILL)
        assert killed.wait(timeout=30) == -signal.SIGKILL
        assert stages(out) == sorted([live_stage, killed_stage])  # what SIGKILL left
        with structlog.testing.capture_logs() as logs, staged(out) as stage:
            (stage / "results.json").write_text('{"next": 1}')
            # The killed run's folder is gone; the live run's stays, its file with it.
            assert stages(out) == sorted([live_stage, stage.name])
        assert (out / live_stage / "results.json").read_text() == "{}"
        assert stages(out) == [live_stage]
        assert (out / "results.json").read_text() == '{"next": 1}'
        (event,) = logs
        assert event["event"] == "out_stale_staging_removed"
        assert event["log_level"] == "warning" and event["folders"] == [killed_stage]
    finally:
        live.kill()
        live.wait(timeout=30)
        killed.kill()
        killed.wait(timeout=30)


def test_a_reused_pid_or_another_boot_does_not_keep_a_dead_runs_stage(tmp_path: Path) -> None:
    with staged(tmp_path) as stage:  # named for this live process
        host, boot, pid, start, _rest = stage.name.removeprefix(STAGE_PREFIX).split("-", 4)
        assert int(pid) == os.getpid()
        made = {
            # This pid, but the process that had it started earlier: the pid was reused.
            "reused": f"{host}-{boot}-{pid}-{int(start) - 1}-x",
            "other-boot": f"{host}-{'0' * 12}-{pid}-{start}-x",
            # Unknown owners are left alone: another host or container, an old name.
            "other-host": f"{'0' * 8}-{boot}-999999999-1-x",
            "old-name": "k3j_x9zq",
        }
        for name in made.values():
            (tmp_path / (STAGE_PREFIX + name)).mkdir()
        with structlog.testing.capture_logs():
            gone = remove_stale_stages(tmp_path)
        prefixed = {k: STAGE_PREFIX + v for k, v in made.items()}
        assert sorted(gone) == sorted([prefixed["reused"], prefixed["other-boot"]])
        assert stages(tmp_path) == sorted(
            [stage.name, prefixed["other-host"], prefixed["old-name"]]
        )
