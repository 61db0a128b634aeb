"""`powerd demo` fed bad flags: one line naming the flag and what is allowed, exit 2, before
it starts anything (no store, no threads, no half-printed header)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from powerd.cli import build_parser, main
from powerd.cli.exits import EXIT_BAD_INPUT


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--ui", "99999"], "argument --ui: must be from 0 to 65,535 (a TCP port)"),
        (["--ui", "-1"], "argument --ui: must be from 0 to 65,535"),
        (["--seed", "-1"], "argument --seed: must be from 0 to 4,294,967,295"),
        (["--seed", "x"], "argument --seed: 'x' is not a whole number"),
    ],
)
def test_flags_out_of_range_are_refused_by_the_parser(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: --ui 99999 and --seed -1 were tracebacks (OverflowError) after the header.
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["demo", "--duration", "1", *argv])
    assert exc.value.code == EXIT_BAD_INPUT
    assert (
        capsys.readouterr().err.strip().splitlines()[-1].startswith(f"powerd demo: error: {said}")
    )


def test_a_ui_port_in_use_is_one_line_before_the_demo_starts(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        rc = main(["demo", "--duration", "1", "--nodes", "1", "--ui", str(port)])
    out, err = capsys.readouterr()
    assert rc == EXIT_BAD_INPUT
    assert err.strip().startswith(f"powerd demo: --ui {port}: cannot serve on 127.0.0.1:{port}")
    assert "\n" not in err.strip() and "Traceback" not in err
    assert out == ""  # nothing started, nothing printed


@pytest.mark.process
def test_sigterm_stops_the_demo_through_its_cleanup(tmp_path: Path) -> None:
    # Before: SIGTERM ended the process where it stood (exit -15), leaving its temporary
    # store (powerd-demo-*/powerd.db) behind.
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    argv = ["demo", "--duration", "120", "--nodes", "1", "--json"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # the first tick: the store is in use
        assert first.startswith(b"{")
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith("powerd-demo-")]
        proc.send_signal(signal.SIGTERM)
        rest = proc.communicate(timeout=30)[0]
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM
    assert b'"summary"' in rest.splitlines()[-1]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("powerd-demo-")]


def test_the_summary_points_at_no_store_it_has_removed(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # Before: "history in sqlite:////tmp/powerd-demo-…/powerd.db", a file removed at exit.
    assert main(["demo", "--duration", "1", "--nodes", "1"]) == 0
    out = capsys.readouterr().out
    assert "history not kept (a temporary store, removed at exit; --db URL keeps it)" in out
    assert "powerd-demo-" not in out
    kept = f"sqlite:///{tmp_path / 'demo.db'}"
    assert main(["demo", "--duration", "1", "--nodes", "1", "--db", kept]) == 0
    assert f"history in {kept}" in capsys.readouterr().out
    assert (tmp_path / "demo.db").is_file()
