"""StoreWriter: takes records from the controller's tick and writes them off the tick path.

The tick only ever appends to a bounded queue (`submit_*`: O(1), never touches the
database, never waits on the writer beyond an O(1) lock). A background thread drains the
queue, reduces it (per-minute aggregates, cap changes only), keeps the resulting rows in a
bounded backlog and writes them in batches, one transaction each. When the database is
slow or down the backlog fills, the oldest rows are dropped and counted, writes are retried
with capped exponential backoff, and `health()` says so; the tick never notices.
"""

from __future__ import annotations

import random
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import Any

import numpy as np
import numpy.typing as npt
import structlog
from sqlalchemy import inspect as sa_inspect

from powerd.clock import Clock, SystemClock
from powerd.controller.why import WhyFrame
from powerd.store.aggregate import (
    CAP_EPSILON_W,
    CAP_INTERVAL_S,
    CapChanges,
    Floats,
    GroupAggregator,
    MinuteAggregator,
)
from powerd.store.reasons import reason_row
from powerd.store.records import EventRecord, GpuRecord, NodeRecord, StoreHealth, TickRecord
from powerd.store.store import Batch, Store, event_row
from powerd.store.tables import Tick

log = structlog.get_logger(__name__)

MAX_ERROR_LEN = 500


@dataclass(frozen=True, slots=True)
class Retention:
    keep_minutes_days: float = 30.0
    keep_ticks_days: float = 7.0
    keep_cap_changes_days: float | None = None  # None: same as ticks
    prune_interval_s: float = 3600.0


@dataclass(frozen=True, slots=True)
class _Samples:
    uuids: Sequence[str]
    ts: Floats | float
    power_w: Floats
    committed_w: Floats  # stored as gpu_minutes.mean_cap_w
    energy_j: Floats
    perf: Floats | None = None  # reported throughput, NaN where none


@dataclass(frozen=True, slots=True)
class _Groups:
    ts: float
    names: Sequence[str]
    levels: Sequence[int] | npt.NDArray[np.int64]
    budget_w: Floats
    limit_w: Floats
    committed_w: Floats
    draw_w: Floats


@dataclass(frozen=True, slots=True)
class _Caps:
    tick: int
    ts: float
    caps_by_node: Mapping[str, Mapping[str, float]]
    why: WhyFrame | None = None


@dataclass(frozen=True, slots=True)
class _Clear:
    kind: str
    ts: float


_Item = TickRecord | EventRecord | NodeRecord | GpuRecord | _Samples | _Groups | _Caps | _Clear


@dataclass(frozen=True, slots=True)
class WriterLimits:
    """How much a `StoreWriter` holds, how often it writes and retries, and which cap
    changes it keeps (docs/storage.md)."""

    max_queue: int = 100_000  # submitted items not yet taken by the writer thread
    max_backlog_rows: int = 200_000  # rows kept while the database is down
    batch_rows: int = 10_000  # rows per transaction
    flush_interval_s: float = 1.0
    probe_interval_s: float = 10.0  # while the database is down
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 30.0
    minute_grace_s: float = 10.0  # how late a sample may come for its minute
    cap_epsilon_w: float = CAP_EPSILON_W
    cap_interval_s: float = CAP_INTERVAL_S


DEFAULT_LIMITS = WriterLimits()


class StoreWriter:
    """Buffered, batched, non-blocking writes to a `Store`.

    `start()` runs the background thread; `stop()` closes every open minute, makes a last
    write attempt and joins. Without `start()`, `flush()` does one cycle on the caller's
    thread (tests, and tools that want synchronous writes).

    Submitted sequences and mappings are kept by reference, not copied (copying would cost
    the tick): pass fresh ones and do not change them afterwards.
    """

    def __init__(
        self,
        store: Store,
        *,
        retention: Retention | None = None,
        limits: WriterLimits = DEFAULT_LIMITS,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.retention = retention or Retention()
        self.limits = limits
        self._clock: Clock = clock or SystemClock()

        # Shared with the submitting thread(s); guarded by _lock, held only for O(1) work.
        self._lock = threading.Lock()
        self._queue: deque[_Item] = deque(maxlen=limits.max_queue)
        self._dropped_queued = 0

        # Owned by the writer thread (or the caller of flush() when not started).
        self._minutes = MinuteAggregator(grace_s=limits.minute_grace_s)
        self._groups = GroupAggregator()
        self._caps = CapChanges(epsilon_w=limits.cap_epsilon_w, interval_s=limits.cap_interval_s)
        self._rows: deque[tuple[str, Any]] = deque()  # (kind, row) in submission order
        self._nodes: dict[str, dict[str, Any]] = {}  # upserts: only the latest matters
        self._gpus: dict[str, dict[str, Any]] = {}
        self._dropped_rows = 0
        self._dropped_logged = 0
        self._failures = 0
        self._next_attempt = -float("inf")
        self._last_contact = -float("inf")
        self._next_prune = -float("inf")

        # Read by health() from any thread; each is replaced whole, never mutated.
        self._connected = False
        self._last_error: str | None = None
        self._last_flush_ts: float | None = None

        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # ---- the tick's side: append and return ----

    def submit_tick(self, rec: TickRecord) -> None:
        self._put(rec)

    def submit_caps(
        self,
        tick: int,
        ts: float,
        caps_by_node: Mapping[str, Mapping[str, float]],
        why: WhyFrame | None = None,
    ) -> None:
        """The caps sent this tick, {node: {uuid: watts}}; only changes are stored. With the
        tick's `why` frame, each stored change also stores its explanation (`cap_reasons`),
        made here on the writer's thread and only for those GPUs."""
        self._put(_Caps(tick, ts, caps_by_node, why))

    def submit_samples(
        self,
        uuids: Sequence[str],
        ts: Floats | float,
        power_w: Floats,
        committed_w: Floats,
        energy_j: Floats,
        *,
        perf: Floats | None = None,
    ) -> None:
        """This tick's latest sample per GPU, as parallel arrays (`ts` per GPU or one value),
        with each GPU's committed cap (its per-minute mean is stored as `mean_cap_w`) and
        the throughput its workload reported (`perf`, NaN where none; stored as
        `mean_perf`)."""
        self._put(_Samples(uuids, ts, power_w, committed_w, energy_j, perf))

    def submit_groups(
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
        """This tick's budget groups, as parallel arrays: budget and limit in force,
        committed caps and measured draw (`group_minutes`, `budget_excursions`)."""
        self._put(_Groups(ts, names, levels, budget_w, limit_w, committed_w, draw_w))

    def submit_event(self, rec: EventRecord) -> None:
        self._put(rec)

    def submit_clear(self, kind: str, ts: float) -> None:
        """Clear the active events of `kind` raised at or before `ts`."""
        self._put(_Clear(kind, ts))

    def submit_nodes(self, nodes: Iterable[NodeRecord]) -> None:
        for node in nodes:
            self._put(node)

    def submit_gpus(self, gpus: Iterable[GpuRecord]) -> None:
        for gpu in gpus:
            self._put(gpu)

    def seed_caps(self, caps: Mapping[str, float]) -> None:
        """Caps already stored (`Store.latest_caps()`), so a restart does not repeat them.

        Call before start()."""
        self._caps.seed(caps)

    def health(self) -> StoreHealth:
        return StoreHealth(
            connected=self._connected,
            last_error=self._last_error,
            backlog=len(self._queue) + len(self._rows) + len(self._nodes) + len(self._gpus),
            dropped=self._dropped_queued + self._dropped_rows,
            last_flush_ts=self._last_flush_ts,
        )

    def _put(self, item: _Item) -> None:
        with self._lock:
            if len(self._queue) == self.limits.max_queue:
                self._dropped_queued += 1  # the deque drops its oldest item on append
            self._queue.append(item)

    # ---- lifecycle ----

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("StoreWriter already started")
        self._thread = threading.Thread(target=self._run, name="powerd-store-writer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Write what can be written (open minutes included) and stop the thread."""
        if self._thread is None:
            self.flush(final=True)
            return
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            log.warning("store_writer_stop_timeout", timeout_s=timeout_s)
        self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.limits.flush_interval_s)
            self._wake.clear()
            self._cycle_logged(final=False)
        self._cycle_logged(final=True)

    def _cycle_logged(self, *, final: bool) -> None:
        try:
            self._cycle(final=final, force=final)
        except Exception:
            # A bug here must not end the thread: the backlog would then only ever grow.
            log.exception("store_writer_cycle_failed")

    # ---- the writer's side ----

    def flush(self, *, final: bool = False) -> bool:
        """One cycle now, ignoring backoff: drain, reduce, write. True if all was written.

        `final` also closes every open minute (shutdown)."""
        return self._cycle(final=final, force=True)

    def _cycle(self, *, final: bool, force: bool) -> bool:
        self._drain()
        for row in self._minutes.close(final=final):
            self._add_row("minute", row)
        group_rows, excursions = self._groups.close(final=final)
        for row in group_rows:
            self._add_row("group_minute", row)
        for row in excursions:
            self._add_row("excursion", row)
        self._report_drops()

        now = self._clock.monotonic()
        if not force and now < self._next_attempt:
            return False
        ok = self._write_backlog()
        if ok and not (self._rows or self._nodes or self._gpus):
            self._maybe_probe(now)
            self._maybe_prune()
        if final and not ok:
            log.error("store_rows_lost", rows=self.health().backlog, error=self._last_error)
        return ok

    def _drain(self) -> None:
        with self._lock:
            items, self._queue = self._queue, deque(maxlen=self.limits.max_queue)
        for item in items:
            match item:
                case _Samples():
                    self._add_samples(item)
                case _Groups():
                    self._add_groups(item)
                case _Caps():
                    rows = self._caps.changes(item.tick, item.ts, item.caps_by_node)
                    for row in rows:
                        self._add_row("cap", row)
                    if item.why is not None and rows:
                        self._add_reasons(item.why, rows)
                case TickRecord():
                    self._add_row("tick", _tick_row(item))
                case EventRecord():
                    self._add_row("event", event_row(item))
                case _Clear():
                    self._add_row("clear", (item.kind, item.ts))
                case NodeRecord():
                    self._nodes[item.name] = {
                        "name": item.name,
                        "row": item.row,
                        "rack": item.rack,
                        "state": item.state,
                        "first_seen": item.seen_ts,
                        "last_seen": item.seen_ts,
                    }
                case GpuRecord():
                    self._gpus[item.uuid] = {
                        "uuid": item.uuid,
                        "node": item.node,
                        "index": item.index,
                        "name": item.name,
                        "min_cap_w": item.min_cap_w,
                        "max_cap_w": item.max_cap_w,
                    }

    def _add_samples(self, item: _Samples) -> None:
        try:
            self._minutes.add(
                item.uuids, item.ts, item.power_w, item.committed_w, item.energy_j, perf=item.perf
            )
        except ValueError as exc:
            log.warning("store_samples_rejected", error=str(exc))

    def _add_groups(self, item: _Groups) -> None:
        try:
            self._groups.add(
                item.ts,
                names=item.names,
                levels=item.levels,
                budget_w=item.budget_w,
                limit_w=item.limit_w,
                committed_w=item.committed_w,
                draw_w=item.draw_w,
            )
        except ValueError as exc:
            log.warning("store_groups_rejected", error=str(exc))

    def _add_reasons(self, frame: WhyFrame, cap_rows: Sequence[Mapping[str, Any]]) -> None:
        """The explanations of the cap changes just stored, made in one batch."""
        try:
            docs = frame.explain_uuids([row["gpu_uuid"] for row in cap_rows], summaries=False)
        except Exception:  # a bug in an explanation loses the explanations, nothing else
            log.exception("cap_reasons_failed", tick=frame.tick, rows=len(cap_rows))
            return
        for row in cap_rows:
            doc = docs.get(row["gpu_uuid"])
            if doc is not None:
                self._add_row("reason", reason_row(row, doc))

    def _add_row(self, kind: str, row: Any) -> None:
        if len(self._rows) >= self.limits.max_backlog_rows:
            old_kind, old_row = self._rows.popleft()
            self._dropped_rows += 1
            if old_kind == "cap":
                # The store no longer has the cap the dedup state thinks it has.
                self._caps.forget(old_row["gpu_uuid"])
        self._rows.append((kind, row))

    def _write_backlog(self) -> bool:
        while self._rows or self._nodes or self._gpus:
            n = min(self.limits.batch_rows, len(self._rows))
            batch = Batch(nodes=list(self._nodes.values()), gpus=list(self._gpus.values()))
            for kind, row in islice(self._rows, n):
                getattr(batch, _BATCH_FIELD[kind]).append(row)
            try:
                self.store.write_batch(batch)
            except Exception as exc:
                self._failed(exc, backlog=len(self._rows) + len(self._nodes) + len(self._gpus))
                return False
            for _ in range(n):
                self._rows.popleft()
            self._nodes.clear()
            self._gpus.clear()
            self._succeeded()
            self._last_flush_ts = self._clock.wall()
        return True

    def _maybe_probe(self, now: float) -> None:
        # With nothing to write, readiness still needs to know whether the database is there.
        if now - self._last_contact < self.limits.probe_interval_s:
            return
        try:
            self.store.ping()
        except Exception as exc:
            self._failed(exc, backlog=0)
            return
        self._succeeded()

    def _maybe_prune(self) -> None:
        now = self._clock.monotonic()
        if now < self._next_prune:
            return
        self._next_prune = now + self.retention.prune_interval_s
        r = self.retention
        try:
            pruned = self.store.prune(
                self._clock.wall(),
                keep_minutes_days=r.keep_minutes_days,
                keep_ticks_days=r.keep_ticks_days,
                keep_cap_changes_days=r.keep_cap_changes_days,
            )
        except Exception as exc:
            log.warning("store_prune_failed", error=_describe(exc))
            return
        log.info(
            "store_pruned",
            minutes=pruned.minutes,
            ticks=pruned.ticks,
            cap_changes=pruned.cap_changes,
            cap_reasons=pruned.cap_reasons,
            group_minutes=pruned.group_minutes,
            excursions=pruned.excursions,
        )

    def _succeeded(self) -> None:
        if self._failures:
            log.info("store_reconnected", failures=self._failures)
        self._failures = 0
        self._next_attempt = -float("inf")
        self._last_contact = self._clock.monotonic()
        self._connected = True
        self._last_error = None

    def _failed(self, exc: Exception, *, backlog: int) -> None:
        self._failures += 1
        limits = self.limits
        delay = min(limits.backoff_max_s, limits.backoff_initial_s * 2 ** (self._failures - 1))
        delay *= random.uniform(0.5, 1.0)  # jitter: controllers restarted together spread out
        self._next_attempt = self._clock.monotonic() + delay
        self._connected = False
        self._last_error = _describe(exc)
        log.warning(
            "store_flush_failed",
            error=self._last_error,
            failures=self._failures,
            backlog=backlog,
            retry_in_s=round(delay, 2),
        )

    def _report_drops(self) -> None:
        dropped = self._dropped_queued + self._dropped_rows
        if dropped > self._dropped_logged:
            log.warning(
                "store_records_dropped", dropped=dropped - self._dropped_logged, total=dropped
            )
            self._dropped_logged = dropped


# The Batch list each kind of backlog row goes to.
_BATCH_FIELD = {
    "tick": "ticks",
    "cap": "caps",
    "reason": "reasons",
    "event": "events",
    "clear": "clears",
    "minute": "minutes",
    "group_minute": "group_minutes",
    "excursion": "excursions",
}

# (field, column) of a TickRecord: its fields are the Tick model's attributes, some stored
# under other column names (`draw_w` in `measured_w`...: docs/storage.md).
_TICK_COLUMNS = tuple(
    (a.key, a.columns[0].key) for a in sa_inspect(Tick).column_attrs if a.key != "id"
)


def _tick_row(rec: TickRecord) -> dict[str, Any]:
    # Keyed by column (a Core insert).
    return {column: getattr(rec, name) for name, column in _TICK_COLUMNS}


def _describe(exc: BaseException) -> str:
    # SQLAlchemy's messages carry the whole statement and its parameters; the driver's own
    # message is what an operator needs.
    orig = getattr(exc, "orig", None)
    text = f"{type(orig or exc).__name__}: {orig or exc}"
    return text[:MAX_ERROR_LEN].strip()
