"""`powerd demo` fed bad flags: one line naming the flag and what is allowed, exit 2, before
it starts anything (no store, no threads, no half-printed header)."""

from __future__ import annotations

import socket

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
