"""The pilot's windows: `START..END`, each an ISO 8601 time with a time zone."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

FORMATS = (
    "START..END, each ISO 8601 with a time zone: 2026-11-02T00:00Z, 2026-11-02T00:00:00+01:00, "
    "2026-11-02 08:30+00:00"
)


class PilotError(Exception):
    """A pilot report cannot be made: one line saying why, and the exit status."""

    def __init__(self, message: str, *, bad_input: bool = False) -> None:
        super().__init__(message)
        self.bad_input = bad_input  # the user's arguments (2), else a failure (1)


@dataclass(frozen=True, slots=True)
class Window:
    name: str  # "baseline" or "managed"
    start: float  # epoch seconds, UTC
    end: float

    @property
    def hours(self) -> float:
        return (self.end - self.start) / 3600.0

    def label(self) -> str:
        return f"{_iso(self.start)}..{_iso(self.end)}"


def parse_window(name: str, text: str) -> Window:
    """`START..END` as a Window; PilotError (bad input) naming the flag otherwise."""
    start_text, sep, end_text = text.partition("..")
    if not sep or not start_text or not end_text:
        raise PilotError(f"--{name} {text!r}: expected {FORMATS}", bad_input=True)
    start = _parse_time(name, start_text)
    end = _parse_time(name, end_text)
    if end <= start:
        raise PilotError(
            f"--{name} {text!r}: the window ends before it starts (END must be after START)",
            bad_input=True,
        )
    return Window(name, start, end)


def check_windows(baseline: Window, managed: Window) -> None:
    """The two windows must not overlap: the same minutes cannot be both."""
    if baseline.start < managed.end and managed.start < baseline.end:
        raise PilotError(
            f"--baseline {baseline.label()} and --managed {managed.label()} overlap: "
            "a pilot compares two distinct periods",
            bad_input=True,
        )


def _parse_time(name: str, text: str) -> float:
    raw = text.strip()
    try:
        # Python 3.11's fromisoformat takes `Z`, `+01:00`, a space for `T`, seconds optional.
        when = datetime.fromisoformat(raw)
    except ValueError:
        raise PilotError(
            f"--{name}: {raw!r} is not an ISO 8601 time ({FORMATS})", bad_input=True
        ) from None
    if when.tzinfo is None or when.utcoffset() is None:
        raise PilotError(
            f"--{name}: {raw!r} has no time zone; add one (2026-11-02T00:00Z or +01:00), "
            "since the store keeps UTC",
            bad_input=True,
        )
    return when.timestamp()


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%MZ")
