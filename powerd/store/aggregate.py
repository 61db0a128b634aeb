"""In-memory reductions done before anything reaches the database.

- `MinuteAggregator` folds per-GPU samples into per-minute rows (raw samples are never
  stored: 10k GPUs at 1 Hz would be 864M rows a day).
- `CapChanges` turns the caps sent each tick into rows only where a cap moved.

Both run on the writer's thread, not on the tick, and are vectorised or O(changes) so the
thread holds the GIL briefly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]
Floats = Sequence[float] | FloatArray

MINUTE_S = 60


class _Bucket:
    """Accumulators for one minute, one slot per GPU the aggregator knows."""

    def __init__(self, size: int) -> None:
        self.n = np.zeros(size, dtype=np.int64)
        self.sum_power = np.zeros(size)
        self.max_power = np.full(size, -math.inf)
        self.sum_committed = np.zeros(size)
        self.energy = np.zeros(size)
        self.n_perf = np.zeros(size, dtype=np.int64)
        self.sum_perf = np.zeros(size)

    def grow(self, size: int) -> None:
        extra = size - self.n.size
        if extra <= 0:
            return
        self.n = np.concatenate([self.n, np.zeros(extra, dtype=np.int64)])
        self.sum_power = np.concatenate([self.sum_power, np.zeros(extra)])
        self.max_power = np.concatenate([self.max_power, np.full(extra, -math.inf)])
        self.sum_committed = np.concatenate([self.sum_committed, np.zeros(extra)])
        self.energy = np.concatenate([self.energy, np.zeros(extra)])
        self.n_perf = np.concatenate([self.n_perf, np.zeros(extra, dtype=np.int64)])
        self.sum_perf = np.concatenate([self.sum_perf, np.zeros(extra)])


class MinuteAggregator:
    """Per-GPU per-minute mean/max draw, energy, mean committed cap (`mean_cap_w`) and
    the mean of the workload's reported throughput where it reports one (`mean_perf`).

    A sample belongs to the minute its own `ts` falls in. A minute closes once a sample at
    least `grace_s` past its end has been seen (samples from different nodes arrive with
    some skew). Rules that make the numbers right for real telemetry:
    - a sample whose ts is not newer than the GPU's last one is a repeat (the controller
      resubmits a node's latest sample until the node sends a new one) and is ignored;
    - energy is the rise of the GPU's energy counter since its previous sample, put in the
      minute of the later sample; a counter that went down (agent or driver restart) counts
      power × elapsed time instead; a GPU's very first sample has no energy.
    A sample arriving for a minute already closed opens that minute again; its row then
    merges into the stored one (the store upserts minute rows).
    """

    def __init__(self, grace_s: float = 10.0) -> None:
        self.grace_s = grace_s
        self._slot: dict[str, int] = {}
        self._uuids: list[str] = []
        self._last_ts = np.zeros(0)
        self._last_energy = np.zeros(0)
        self._seen = np.zeros(0, dtype=bool)
        self._open: dict[int, _Bucket] = {}
        self._newest_ts = -math.inf
        # Controllers send the same uuid list every tick: map it to slots once.
        self._cached_uuids: tuple[str, ...] = ()
        self._cached_slots = np.zeros(0, dtype=np.int64)

    def add(
        self,
        uuids: Sequence[str],
        ts: Floats | float,
        power_w: Floats,
        committed_w: Floats,
        energy_j: Floats,
        *,
        perf: Floats | None = None,
    ) -> None:
        """`perf`: each GPU's reported throughput, NaN where none (None: none at all)."""
        slots = self._slots_for(uuids)
        n = slots.size
        ts_a = np.broadcast_to(np.asarray(ts, dtype=np.float64), (n,))
        power = np.asarray(power_w, dtype=np.float64)
        committed = np.asarray(committed_w, dtype=np.float64)
        energy = np.asarray(energy_j, dtype=np.float64)
        rate = np.full(n, np.nan) if perf is None else np.asarray(perf, dtype=np.float64)
        if not (power.shape == committed.shape == energy.shape == rate.shape == (n,)):
            raise ValueError(
                "uuids, power_w, committed_w, energy_j and perf must have the same length"
            )

        seen = self._seen[slots]
        fresh = ~seen | (ts_a > self._last_ts[slots])
        if not fresh.all():
            slots, seen = slots[fresh], seen[fresh]
            ts_a, power, energy = ts_a[fresh], power[fresh], energy[fresh]
            committed, rate = committed[fresh], rate[fresh]
        if slots.size == 0:
            return

        delta = energy - self._last_energy[slots]
        reset = delta < 0
        delta[reset] = power[reset] * (ts_a[reset] - self._last_ts[slots][reset])
        delta[~seen] = 0.0
        self._last_ts[slots] = ts_a
        self._last_energy[slots] = energy
        self._seen[slots] = True
        self._newest_ts = max(self._newest_ts, float(ts_a.max()))

        minutes = (np.floor(ts_a / MINUTE_S) * MINUTE_S).astype(np.int64)
        for minute in np.unique(minutes):
            sel = minutes == minute
            bucket = self._bucket(int(minute))
            s = slots[sel]  # unique within one call, so plain fancy indexing accumulates
            bucket.n[s] += 1
            bucket.sum_power[s] += power[sel]
            bucket.max_power[s] = np.maximum(bucket.max_power[s], power[sel])
            bucket.sum_committed[s] += committed[sel]
            bucket.energy[s] += delta[sel]
            r = rate[sel]
            has = np.isfinite(r)
            bucket.n_perf[s[has]] += 1
            bucket.sum_perf[s[has]] += r[has]

    def close(self, *, final: bool = False) -> list[dict[str, Any]]:
        """Rows of the minutes that are over (every open minute when `final`)."""
        rows: list[dict[str, Any]] = []
        for minute in sorted(self._open):
            if not final and minute + MINUTE_S + self.grace_s > self._newest_ts:
                continue
            bucket = self._open.pop(minute)
            for i in np.flatnonzero(bucket.n):
                count = int(bucket.n[i])
                n_perf = int(bucket.n_perf[i])
                rows.append(
                    {
                        "uuid": self._uuids[i],
                        "minute": minute,
                        "mean_power_w": float(bucket.sum_power[i]) / count,
                        "max_power_w": float(bucket.max_power[i]),
                        "energy_j": float(bucket.energy[i]),
                        "mean_cap_w": float(bucket.sum_committed[i]) / count,
                        "samples": count,
                        "mean_perf": float(bucket.sum_perf[i]) / n_perf if n_perf else None,
                        "perf_samples": n_perf,
                    }
                )
        return rows

    @property
    def open_minutes(self) -> int:
        return len(self._open)

    def _bucket(self, minute: int) -> _Bucket:
        bucket = self._open.get(minute)
        if bucket is None:
            bucket = self._open[minute] = _Bucket(len(self._uuids))
        else:
            bucket.grow(len(self._uuids))
        return bucket

    def _slots_for(self, uuids: Sequence[str]) -> npt.NDArray[np.int64]:
        key = tuple(uuids)
        if key == self._cached_uuids:
            return self._cached_slots
        if len(set(key)) != len(key):
            raise ValueError("duplicate uuid in one batch of samples")
        slots = []
        for uuid in key:
            slot = self._slot.get(uuid)
            if slot is None:
                slot = self._slot[uuid] = len(self._uuids)
                self._uuids.append(uuid)
            slots.append(slot)
        extra = len(self._uuids) - self._last_ts.size
        if extra > 0:
            self._last_ts = np.concatenate([self._last_ts, np.zeros(extra)])
            self._last_energy = np.concatenate([self._last_energy, np.zeros(extra)])
            self._seen = np.concatenate([self._seen, np.zeros(extra, dtype=bool)])
        self._cached_uuids = key
        self._cached_slots = np.asarray(slots, dtype=np.int64)
        return self._cached_slots


# A GPU's cap is stored at most once per this many seconds by default. At 1 s ticks the
# allocator may move most caps a little every tick: a row per move would grow the table, and
# its index, with the fleet times the tick rate (docs/performance.md has the figures). One
# row a GPU a minute is what docs/storage.md sizes; the per-minute rows keep each GPU's mean
# cap in between.
CAP_INTERVAL_S = 60.0
CAP_EPSILON_W = 0.5  # a smaller cap move is a repeat (float noise from the solver)


class CapChanges:
    """Keeps the last stored cap per GPU and emits a row only when a cap moves.

    A move smaller than `epsilon_w` is a repeat (float noise from the solver); since the
    comparison is against the last *stored* cap, slow drift is still recorded once it adds
    up to `epsilon_w`. A GPU's cap is stored at most once per `interval_s` (sample time):
    a move within that time of the GPU's last stored one is stored at the first tick after
    it, with the cap then sent, if that still differs from the stored one (moves that came
    and went in between are not stored). 0: every move.
    """

    def __init__(
        self, epsilon_w: float = CAP_EPSILON_W, interval_s: float = CAP_INTERVAL_S
    ) -> None:
        if interval_s < 0 or epsilon_w < 0:
            raise ValueError("epsilon_w and interval_s must be >= 0")
        self.epsilon_w = epsilon_w
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._stored_at: dict[str, float] = {}

    def seed(self, caps: Mapping[str, float]) -> None:
        """Start from caps already stored (after a restart), so they are not stored again."""
        self._last.update(caps)

    def forget(self, uuid: str) -> None:
        """A row for `uuid` was lost: let its next cap be stored whatever it is."""
        self._last.pop(uuid, None)
        self._stored_at.pop(uuid, None)

    def changes(
        self, tick: int, ts: float, caps_by_node: Mapping[str, Mapping[str, float]]
    ) -> list[dict[str, Any]]:
        rows: list[dict[str, Any]] = []
        last, stored_at = self._last, self._stored_at
        eps = self.epsilon_w
        not_before = ts - self.interval_s
        for node, caps in caps_by_node.items():
            for uuid, new_w in caps.items():
                old_w = last.get(uuid)
                if old_w is not None and (
                    abs(new_w - old_w) < eps or stored_at.get(uuid, -math.inf) > not_before
                ):
                    continue
                last[uuid] = new_w
                stored_at[uuid] = ts
                rows.append(
                    {
                        "ts": ts,
                        "tick": tick,
                        "gpu_uuid": uuid,
                        "node": node,
                        "old_w": old_w,
                        "new_w": float(new_w),
                    }
                )
        return rows


# A gap between two ticks longer than this is time the controller did not watch (stopped,
# restarted, a paused host): it counts as at most this long above a budget.
MAX_TICK_GAP_S = 30.0


class _GroupBucket:
    """Accumulators for one minute, one slot per group the aggregator knows."""

    def __init__(self, size: int) -> None:
        self.n = np.zeros(size, dtype=np.int64)
        self.sum_committed = np.zeros(size)
        self.max_committed = np.full(size, -math.inf)
        self.sum_draw = np.zeros(size)
        self.max_draw = np.full(size, -math.inf)
        self.budget = np.full(size, math.inf)
        self.limit = np.full(size, -math.inf)
        self.over_s = np.zeros(size)

    def grow(self, size: int) -> None:
        extra = size - self.n.size
        if extra <= 0:
            return
        for name, fill in (
            ("n", 0),
            ("sum_committed", 0.0),
            ("max_committed", -math.inf),
            ("sum_draw", 0.0),
            ("max_draw", -math.inf),
            ("budget", math.inf),
            ("limit", -math.inf),
            ("over_s", 0.0),
        ):
            old = getattr(self, name)
            setattr(self, name, np.concatenate([old, np.full(extra, fill, dtype=old.dtype)]))


class GroupAggregator:
    """Per budget group and minute: budget, committed caps and measured draw (mean, max),
    seconds of draw above the budget; and every excursion, a run of ticks whose draw was
    above the budget, as one row once it ends (`budget_excursions`).

    A tick's draw stands until the next tick (at most MAX_TICK_GAP_S): a tick above its
    budget adds the time to the next tick to its own minute's `over_s`, and an excursion
    lasts from its first tick over to the first tick back within the budget. Ticks come
    from one controller in order, so a minute closes once a tick at or past its end is in.
    Groups kept: the facility and the rows, and every deeper group with a budget.
    """

    def __init__(self) -> None:
        self._slot: dict[str, int] = {}
        self._names: list[str] = []
        self._levels: list[int] = []
        self._prev_ts = np.zeros(0)
        self._prev_over = np.zeros(0, dtype=bool)
        self._run_start = np.zeros(0)  # NaN: no excursion under way
        self._run_peak = np.zeros(0)
        self._run_draw = np.zeros(0)
        self._run_budget = np.zeros(0)
        self._open: dict[int, _GroupBucket] = {}
        self._newest_ts = -math.inf
        self._cached: tuple[tuple[str, ...], npt.NDArray[np.int64], npt.NDArray[np.int64]] = (
            (),
            np.zeros(0, dtype=np.int64),
            np.zeros(0, dtype=np.int64),
        )
        self._excursions: list[dict[str, Any]] = []

    def add(
        self,
        ts: float,
        *,
        names: Sequence[str],
        levels: Sequence[int] | npt.NDArray[np.int64],
        budget_w: Floats,
        limit_w: Floats,
        committed_w: Floats,
        draw_w: Floats,
    ) -> None:
        budget_all = np.asarray(budget_w, dtype=np.float64)
        level_all = np.asarray(levels, dtype=np.int64)
        if not (
            len(names) == level_all.size == budget_all.size == len(limit_w)
            and len(committed_w) == len(draw_w) == len(names)
        ):
            raise ValueError("group names, levels, budgets, limits, committed and draw differ")
        pick, slots = self._slots_for(tuple(names), level_all, budget_all)
        if ts <= self._newest_ts or pick.size == 0:
            return  # a repeat, or out of order: one controller's ticks only move forward
        budget = budget_all[pick]
        limit = np.asarray(limit_w, dtype=np.float64)[pick]
        committed = np.asarray(committed_w, dtype=np.float64)[pick]
        draw = np.asarray(draw_w, dtype=np.float64)[pick]

        # The previous tick's state held until now.
        was = self._prev_over[slots]
        if was.any():
            held = np.clip(ts - self._prev_ts[slots][was], 0.0, MAX_TICK_GAP_S)
            for prev_minute in np.unique(_minute_of(self._prev_ts[slots][was])):
                bucket = self._open.get(int(prev_minute))
                if bucket is None:
                    continue
                sel = _minute_of(self._prev_ts[slots][was]) == prev_minute
                bucket.grow(len(self._names))
                bucket.over_s[slots[was][sel]] += held[sel]

        minute = int(_minute_of(np.asarray([ts]))[0])
        bucket = self._open.get(minute)
        if bucket is None:
            bucket = self._open[minute] = _GroupBucket(len(self._names))
        bucket.grow(len(self._names))
        bucket.n[slots] += 1
        bucket.sum_committed[slots] += committed
        bucket.max_committed[slots] = np.maximum(bucket.max_committed[slots], committed)
        bucket.sum_draw[slots] += draw
        bucket.max_draw[slots] = np.maximum(bucket.max_draw[slots], draw)
        bucket.budget[slots] = np.minimum(bucket.budget[slots], budget)
        bucket.limit[slots] = np.maximum(bucket.limit[slots], limit)

        excess = draw - budget
        over = np.isfinite(budget) & (excess > 0)
        running = ~np.isnan(self._run_start[slots])
        for i in np.flatnonzero(running & ~over):
            self._end_run(int(slots[i]), ts)
        start = over & ~running
        self._run_start[slots[start]] = ts
        self._run_peak[slots[start]] = -math.inf
        higher = over & (excess > self._run_peak[slots])
        s = slots[higher]
        self._run_peak[s] = excess[higher]
        self._run_draw[s] = draw[higher]
        self._run_budget[s] = budget[higher]

        self._prev_ts[slots] = ts
        self._prev_over[slots] = over
        self._newest_ts = ts

    def close(self, *, final: bool = False) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        """(group_minutes rows of the minutes that are over, every minute when `final`;
        excursions that ended, and when `final` those still under way, ended at their last
        tick)."""
        rows: list[dict[str, Any]] = []
        for minute in sorted(self._open):
            if not final and minute + MINUTE_S > self._newest_ts:
                continue
            bucket = self._open.pop(minute)
            for i in np.flatnonzero(bucket.n):
                count = int(bucket.n[i])
                rows.append(
                    {
                        "group": self._names[i],
                        "minute": minute,
                        "level": self._levels[i],
                        "budget_w": _finite(bucket.budget[i]),
                        "limit_w": _finite(bucket.limit[i]),
                        "mean_committed_w": float(bucket.sum_committed[i]) / count,
                        "max_committed_w": float(bucket.max_committed[i]),
                        "mean_draw_w": float(bucket.sum_draw[i]) / count,
                        "max_draw_w": float(bucket.max_draw[i]),
                        "over_s": float(bucket.over_s[i]),
                        "ticks": count,
                    }
                )
        if final:
            for slot in np.flatnonzero(~np.isnan(self._run_start)):
                self._end_run(int(slot), float(self._prev_ts[slot]))
        done, self._excursions = self._excursions, []
        return rows, done

    def _end_run(self, slot: int, end_ts: float) -> None:
        self._excursions.append(
            {
                "group": self._names[slot],
                "level": self._levels[slot],
                "start_ts": float(self._run_start[slot]),
                "end_ts": end_ts,
                "peak_draw_w": float(self._run_draw[slot]),
                "peak_excess_w": float(self._run_peak[slot]),
                "budget_w": float(self._run_budget[slot]),
            }
        )
        self._run_start[slot] = math.nan

    def _slots_for(
        self,
        names: tuple[str, ...],
        levels: npt.NDArray[np.int64],
        budget: FloatArray,
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """(the indices of the groups kept, their slots). The choice is made once per list
        of names: a budget removed by an operator keeps its group's rows (budget None)."""
        if names == self._cached[0]:
            return self._cached[1], self._cached[2]
        if len(set(names)) != len(names):
            raise ValueError("a group name appears twice in one tick")
        pick = np.flatnonzero((levels <= 1) | np.isfinite(budget))
        slots = []
        for i in pick.tolist():
            slot = self._slot.get(names[i])
            if slot is None:
                slot = self._slot[names[i]] = len(self._names)
                self._names.append(names[i])
                self._levels.append(int(levels[i]))
            slots.append(slot)
        extra = len(self._names) - self._prev_ts.size
        if extra > 0:
            self._prev_ts = np.concatenate([self._prev_ts, np.zeros(extra)])
            self._prev_over = np.concatenate([self._prev_over, np.zeros(extra, dtype=bool)])
            for name in ("_run_start", "_run_peak", "_run_draw", "_run_budget"):
                setattr(self, name, np.concatenate([getattr(self, name), np.full(extra, np.nan)]))
        # Groups gone from the policy: an excursion under way ends at their last tick.
        kept = set(slots)
        for slot in np.flatnonzero(~np.isnan(self._run_start)).tolist():
            if slot not in kept:
                self._end_run(slot, float(self._prev_ts[slot]))
                self._prev_over[slot] = False
        self._cached = (names, pick, np.asarray(slots, dtype=np.int64))
        return self._cached[1], self._cached[2]


def _minute_of(ts: FloatArray) -> npt.NDArray[np.int64]:
    return (np.floor(ts / MINUTE_S) * MINUTE_S).astype(np.int64)


def _finite(x: float) -> float | None:
    return float(x) if math.isfinite(x) else None
