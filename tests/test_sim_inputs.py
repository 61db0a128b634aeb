"""`powerd sim` fed bad input: one clear line naming the flag or key, exit 2, no traceback,
nothing written half-way."""

from __future__ import annotations

import pytest

from powerd.cli import build_parser


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's refusal of `argv` (exit 2): its message."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["5", "1", "0", "-0.1", "nan", "inf"])
def test_threshold_is_a_share_of_throughput(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # `--threshold 5` meant as 5 % would let every size pass: the fit would be the largest.
    err = parse_error(["sim", "s.yaml", "--oversubscribe", "--threshold", value], capsys)
    assert "--threshold" in err
    assert "between 0 and 1" in err or "positive" in err


def test_a_threshold_below_one_is_taken() -> None:
    args = build_parser().parse_args(["sim", "s.yaml", "--threshold", "0.05"])
    assert args.threshold == 0.05
