"""Small numeric conversions shared by the outputs (JSON reports, the API, the demo)."""

from __future__ import annotations

import math


def finite_or_none(x: float) -> float | None:
    """`x` as a plain float, or None where it is infinite or NaN (JSON has neither: an
    unlimited budget or an unknown value is written as null)."""
    return float(x) if math.isfinite(x) else None
