"""argparse types shared by the command lines."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
    if not value > 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return value


def loss_share(text: str) -> float:
    """A share of throughput, strictly between 0 and 1: 0.03 is 3 %, so `5` is refused
    rather than read as 500 % (every size would pass)."""
    value = positive_float(text)
    if not value < 1:
        raise argparse.ArgumentTypeError(
            f"must be a share between 0 and 1 (0.03 = 3 %), not {text}"
        )
    return value


def float_at_least(lo: float, why: str = "") -> Callable[[str], float]:
    """A finite number of at least `lo`; `why` says where the bound comes from."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a number") from None
        if not (math.isfinite(value) and value >= lo):
            raise argparse.ArgumentTypeError(
                f"must be a number of at least {lo:g}{f' ({why})' if why else ''}, not {text}"
            )
        return value

    parse.__name__ = f"float >= {lo:g}"
    return parse


def int_range(lo: int, hi: int, why: str = "") -> Callable[[str], int]:
    """An integer from `lo` to `hi`, both included; `why` says where the bounds come from."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"'{text}' is not a whole number") from None
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(
                f"must be from {lo:,} to {hi:,}{f' ({why})' if why else ''}, not {text}"
            )
        return value

    parse.__name__ = f"int in [{lo}, {hi}]"
    return parse


PORT = int_range(0, 65_535, "a TCP port")
SEED = int_range(0, 2**32 - 1, "a 32-bit seed")
# A breaker rated under its budget trips under load the budget allows: the
# budget would not be the limit, the breaker would.
BREAKER_RATING = float_at_least(1.0, "a breaker rated below its budget trips under it")
