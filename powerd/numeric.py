"""Small numeric conversions shared by the outputs (JSON reports, the API, the demo)."""

from __future__ import annotations

import math


def finite_or_none(x: float) -> float | None:
    """`x` as a plain float, or None where it is infinite or NaN (JSON has neither: an
    unlimited budget or an unknown value is written as null)."""
    return float(x) if math.isfinite(x) else None


def kw_text(w: float | None) -> str:
    """Watts as kilowatts for people ("1,234.5 kW"); "unlimited" for None or a value that is
    not finite (a group without a budget)."""
    return "unlimited" if w is None or not math.isfinite(w) else f"{w / 1000:,.1f} kW"
