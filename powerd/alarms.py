"""Alarms as data: which are active, and the changes not yet handed to the store.

The tick engine raises and clears alarms as it decides; the daemon around it drains the
changes after each call and records them (store events and clears). Nothing here does I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import structlog

log = structlog.get_logger(__name__)


class Severity(StrEnum):
    INFO = "info"
    WARNING = "warning"
    ALARM = "alarm"


@dataclass(frozen=True, slots=True)
class AlarmChange:
    """An alarm raised (`message` set) or cleared (`message` None), at wall time `ts`."""

    ts: float
    kind: str
    message: str | None


class Alarms:
    """Active alarms by kind, and the changes since the owner last took them."""

    def __init__(self) -> None:
        self.active: dict[str, str] = {}  # kind → message
        self._changes: list[AlarmChange] = []

    def set(self, kind: str, message: str | None, ts: float) -> None:
        """Raise (message) or clear (None) an alarm; a change only when it was not already so."""
        active = kind in self.active
        if message is not None and not active:
            self.active[kind] = message
            log.warning("alarm_raised", alarm=kind, message=message)
            self._changes.append(AlarmChange(ts, kind, message))
        elif message is None and active:
            del self.active[kind]
            log.info("alarm_cleared", alarm=kind)
            self._changes.append(AlarmChange(ts, kind, None))

    def once(self, kind: str, message: str, ts: float) -> None:
        """An alarm event that holds no state (nothing will clear it)."""
        self._changes.append(AlarmChange(ts, kind, message))

    def take(self) -> list[AlarmChange]:
        """The changes in order since the last call; the owner must call it (the list grows
        until it does)."""
        changes, self._changes = self._changes, []
        return changes
