"""Alarms as data: which are active, and the changes not yet handed to the store.

The tick engine raises and clears alarms as it decides; the daemon around it drains the
changes after each call and records them (store events and clears). Nothing here does I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import structlog

log = structlog.get_logger(__name__)


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ALARM = "alarm"


@dataclass(frozen=True, slots=True)
class AlarmChange:
    """An alarm raised (`message` set) or cleared (`message` None), at wall time `ts`; or,
    with a severity below ALARM, an event (`once`) that nothing clears. `data`: details
    for the store (e.g. the GPUs an alarm names)."""

    ts: float
    kind: str
    message: str | None
    severity: Severity = Severity.ALARM
    data: dict[str, Any] | None = None


class Alarms:
    """Active alarms by kind, and the changes since the owner last took them."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}  # kind → message
        self._subjects: dict[str, tuple[str, ...]] = {}  # kind → what it names, if given
        self._changes: list[AlarmChange] = []

    def set(
        self,
        kind: str,
        message: str | None,
        ts: float,
        *,
        subjects: tuple[str, ...] | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        """Raise (message) or clear (None) an alarm; a change only when it was not already so.

        An active alarm's message follows the latest. With `subjects` (what the alarm names,
        e.g. GPUs), a change of them clears it and raises it anew, so the store keeps each
        set of them with its own times (`data` goes with each raise)."""
        active = kind in self.active
        if message is not None and active and subjects is not None:
            self.active[kind] = message
            if subjects != self._subjects.get(kind):
                self._subjects[kind] = subjects
                log.warning("alarm_changed", alarm=kind, message=message)
                self._changes.append(AlarmChange(ts, kind, None))
                # Just after the clear: the store clears only what was raised at or before it.
                again = math.nextafter(ts, math.inf)
                self._changes.append(AlarmChange(again, kind, message, data=data))
        elif message is not None and active:
            # No subjects: the active alarm says what is true now (`powerd status`, the
            # API), while the store keeps the raise as it was; give `subjects` where a
            # change of what it names must be logged and stored.
            self.active[kind] = message
        elif message is not None and not active:
            self.active[kind] = message
            if subjects is not None:
                self._subjects[kind] = subjects
            log.warning("alarm_raised", alarm=kind, message=message)
            self._changes.append(AlarmChange(ts, kind, message, data=data))
        elif message is None and active:
            del self.active[kind]
            self._subjects.pop(kind, None)
            log.info("alarm_cleared", alarm=kind)
            self._changes.append(AlarmChange(ts, kind, None))

    def subjects(self, kind: str) -> tuple[str, ...] | None:
        """What an active alarm names (None: not active, or raised without subjects)."""
        return self._subjects.get(kind) if kind in self.active else None

    def once(
        self,
        kind: str,
        message: str,
        ts: float,
        *,
        severity: Severity = Severity.ALARM,
        data: dict[str, Any] | None = None,
    ) -> None:
        """An event that holds no state. An ALARM nothing will clear; a lower severity is
        recorded as an event closed at once (it never shows as active)."""
        if severity is not Severity.ALARM:
            log.warning("event", kind=kind, message=message)
        self._changes.append(AlarmChange(ts, kind, message, severity, data))

    def take(self) -> list[AlarmChange]:
        """The changes in order since the last call; the owner must call it (the list grows
        until it does)."""
        changes, self._changes = self._changes, []
        return changes
