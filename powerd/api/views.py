"""How the controller's state is shown: lookups cached between ticks, and numbers made
fit for JSON (which has no infinity and no NaN)."""

from __future__ import annotations

from dataclasses import dataclass

from powerd.controller.controller import Controller
from powerd.controller.report import TickReport
from powerd.policy import LEVELS, Policy


@dataclass(frozen=True)
class Places:
    """Row and rack of every node of one policy."""

    row: dict[str, str]
    rack: dict[str, str]

    @classmethod
    def of(cls, policy: Policy) -> Places:
        row: dict[str, str] = {}
        rack: dict[str, str] = {}
        groups = policy.groups
        for g in groups:
            if g.level != len(LEVELS) - 1:
                continue
            p = g.parent
            while p >= 0:
                parent = groups[p]
                if LEVELS[parent.level] == "rack":
                    rack[g.name] = parent.name
                elif LEVELS[parent.level] == "row":
                    row[g.name] = parent.name
                p = parent.parent
        return cls(row, rack)


class Views:
    """Lookups rebuilt only when the policy or the last tick changes, not per request."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._places: tuple[Policy, Places] | None = None
        self._tick: tuple[TickReport, dict[str, int], dict[str, int]] | None = None

    def places(self) -> Places:
        policy = self.c.policy
        if self._places is None or self._places[0] is not policy:
            self._places = (policy, Places.of(policy))
        return self._places[1]

    def tick_index(self) -> tuple[dict[str, int], dict[str, int]]:
        """(uuid → position in the last tick, group name → position) for the last tick."""
        report = self.c.last_tick
        if report is None:
            return {}, {}
        if self._tick is None or self._tick[0] is not report:
            gpus = {u: i for i, u in enumerate(report.uuids)}
            groups = {n: i for i, n in enumerate(report.group_names)}
            self._tick = (report, gpus, groups)
        return self._tick[1], self._tick[2]
