"""Alarms about what nodes sent, raised by the tick: faults of a node, not of a tick
(GPUs beyond a node's inventory, uuids claimed twice, nodes offline, ticks far above the
others, messages that hit a fault, limits set behind powerd's back and set back)."""

from __future__ import annotations

import math

import numpy as np

from powerd.alarms import Alarms, Severity
from powerd.controller.fleet import FleetArrays, FleetState, NodeReadings
from powerd.wire import CAP_TOLERANCE_W

# GPUs an alarm's message names (the rest are counted), and its stored data lists.
ALARM_NAMES = 5
ALARM_DATA_GPUS = 64
# Alarms a node's own reports can flip (`cap_overridden`, `cap_restored`) change at most this
# often: a node flapping one GPU's limit every message would otherwise write a raise and a
# clear per tick. The per-GPU metrics and /gpus follow every reading.
ALARM_HOLD_S = 30.0


class InputAlarms:
    """The alarms nodes' messages raise, and what they keep between ticks."""

    def __init__(self, alarms: Alarms) -> None:
        self.alarms = alarms
        self.hold_s = ALARM_HOLD_S
        self.now = 0.0  # the tick's controller time and wall time (alarm timestamps)
        self.wall = 0.0
        self._message_error: str | None = None
        # GPUs whose agents set their limits back since the last tick (`cap_restored`):
        # uuid → (node, index, found W, set W, times, found at its default limit). Bounded
        # by the fleet's GPUs.
        self._restored: dict[str, tuple[str, int, float, float, int, bool]] = {}
        self._overridden_at = -math.inf  # when cap_overridden last changed
        self._restored_at = -math.inf  # when cap_restored was last reported

    def message_failed(self, error: str) -> None:
        """A message hit a fault of ours: the next tick raises an event with the last such."""
        self._message_error = error[:300]

    def _alarm(self, kind: str, message: str | None) -> None:
        self.alarms.set(kind, message, self.wall)

    def note_restores(
        self, r: NodeReadings, before: dict[str, int | None], fleet: FleetState
    ) -> None:
        """GPUs whose agent set a limit found above its own back (its count grew, or began
        again after an agent restart): for this tick's `cap_restored` event. A GPU the
        controller had not heard of yet only sets the count it starts from."""
        node = r.node_id
        for k, uuid in enumerate(r.uuid):
            old = before.get(uuid)
            rec = fleet.gpus.get(uuid)
            restores = r.restores[k]
            if old is None or rec is None or rec.node != node or restores == old:
                continue
            times = restores - old if restores > old else restores
            prev = self._restored.get(uuid)
            total = times + (prev[4] if prev is not None else 0)
            cap_w = r.cap_w[k]
            found = r.found_w[k] if not math.isnan(r.found_w[k]) else cap_w
            set_w = r.set_w[k] if not math.isnan(r.set_w[k]) else cap_w
            default = abs(found - r.default_cap_w[k]) <= CAP_TOLERANCE_W
            self._restored[uuid] = (node, r.index[k], found, set_w, total, default)

    def raise_inputs(self, fleet: FleetState, outliers: tuple[str, ...]) -> None:
        """Alarms about what nodes sent: faults of a node, not of a tick."""
        refused = sorted(n for n, rec in fleet.nodes.items() if rec.refused)
        self._alarm(
            "gpus_beyond_inventory",
            None
            if not refused
            else "telemetry names more GPUs than the policy gives "
            + ", ".join(f"{n} ({fleet.nodes[n].refused} refused)" for n in refused[:5]),
        )
        disputes = sorted(fleet.disputes.values(), key=lambda d: d.uuid)
        self._alarm(
            "gpu_claimed_twice",
            None
            if not disputes
            else "GPU uuids named by more than one node (steered by none, counted at their "
            "maximum): "
            + ", ".join(f"{d.uuid} ({', '.join(sorted(d.seen))})" for d in disputes[:5]),
        )
        offline = fleet.offline_nodes()
        declared = fleet.policy.keeps_limits_nodes
        keeps = declared & set(fleet.keeps_limits_claimed())
        lost = [n for n in offline if not fleet.nodes[n].stopped and n not in keeps]
        kept = [n for n in offline if not fleet.nodes[n].stopped and n in keeps]
        stopped = [n for n in offline if fleet.nodes[n].stopped]
        parts = []
        if lost:
            parts.append(
                "counted at their GPUs' maximum until they report: " + ", ".join(lost[:10])
            )
        if kept:
            parts.append(
                "keep their limits, counted at their committed caps: " + ", ".join(kept[:10])
            )
        if stopped:
            parts.append("stopped, counted at the caps they left: " + ", ".join(stopped[:10]))
        self._alarm("nodes_offline", "; ".join(parts) or None)
        self._alarm(
            "tick_outliers",
            None
            if not outliers
            else "nodes claiming ticks far above the others (not followed; their agents "
            "refuse our commands and stay at failsafe): " + ", ".join(outliers[:10]),
        )

    def raise_events(self) -> None:
        """Events of the messages since the last tick: the last one that hit a fault of
        ours, and limits agents set back."""
        error, self._message_error = self._message_error, None
        if error is not None:
            self.alarms.once("message_failed", error, self.wall)
        self._event_restores()

    def _event_restores(self) -> None:
        """One event for the limits agents found above their own and set back: each tick,
        or merged over `hold_s` after the last one (counts add up meanwhile)."""
        if not self._restored or self.now - self._restored_at < self.hold_s:
            return
        restored, self._restored = self._restored, {}
        self._restored_at = self.now
        rows = sorted(restored.items(), key=lambda kv: (kv[1][0], kv[1][1], kv[0]))
        named = "; ".join(
            f"{node} GPU {index} ({uuid}): {found:g} W found"
            + (" (its default limit)" if default else "")
            + f", set back to {set_w:g} W"
            + (f" ({times} times)" if times > 1 else "")
            for uuid, (node, index, found, set_w, times, default) in rows[:ALARM_NAMES]
        )
        more = f"; and {len(rows) - ALARM_NAMES} more GPUs" if len(rows) > ALARM_NAMES else ""
        self.alarms.once(
            "cap_restored",
            "limits above the caps powerd set, set back by their agents (at a GPU's default "
            f"limit: a GPU reset, a driver reload or a reboot; else another tool): {named}{more}",
            self.wall,
            severity=Severity.WARNING,
            data={
                "gpus": [
                    {
                        "node": node,
                        "uuid": uuid,
                        "index": index,
                        "found_w": found,
                        "set_w": set_w,
                        "times": times,
                        "default_limit": default,
                    }
                    for uuid, (node, index, found, set_w, times, default) in rows[:ALARM_DATA_GPUS]
                ],
                "count": len(rows),
            },
        )

    def raise_overridden(self, arrays: FleetArrays, fleet: FleetState) -> None:
        """`cap_overridden`: GPUs whose enforced limit, at their latest reading, differs
        from the one their agent set (another tool, an out-of-band limit, a set the device
        did not take), either way. Raised again when the set of GPUs changes, cleared when
        none is left; at most one change per `hold_s` (a change meanwhile waits)."""
        set_w = arrays.set_w
        if set_w is None:
            return
        differ = np.flatnonzero(arrays.not_set_here())
        wanted = tuple(arrays.uuids[i] for i in differ.tolist())
        if self.alarms.subjects("cap_overridden") != (
            wanted or None
        ):  # a raise, a clear or another set of GPUs
            if self.now - self._overridden_at < self.hold_s:
                return  # changed too recently: this change waits
            self._overridden_at = self.now
        if not len(differ):
            self._alarm("cap_overridden", None)
            return
        rows = [
            (arrays.nodes[i], fleet.gpus[arrays.uuids[i]].index, arrays.uuids[i], i)
            for i in differ.tolist()
        ]
        cap, want = arrays.cap_w, set_w
        named = "; ".join(
            f"{node} GPU {index} ({uuid}): enforced {cap[i]:g} W, powerd set {want[i]:g} W"
            for node, index, uuid, i in rows[:ALARM_NAMES]
        )
        more = f"; and {len(rows) - ALARM_NAMES} more GPUs" if len(rows) > ALARM_NAMES else ""
        self.alarms.set(
            "cap_overridden",
            f"GPU limits differ from the caps powerd set: {named}{more}",
            self.wall,
            subjects=tuple(uuid for _, _, uuid, _ in rows),
            data={
                "gpus": [
                    {
                        "node": node,
                        "uuid": uuid,
                        "index": index,
                        "enforced_w": float(cap[i]),
                        "set_w": float(want[i]),
                    }
                    for node, index, uuid, i in rows[:ALARM_DATA_GPUS]
                ],
                "count": len(rows),
            },
        )
