"""What a pilot window holds: the store's per-minute aggregates (SQL does the summing, so a
week of 10,000 GPUs is not read row by row into Python) and a throughput series.

Throughput comes from the agents' reported perf (`gpu_minutes.mean_perf`: the workload's
rate, tokens/s or samples/s, per GPU; a minute's work is the mean rate × 60 s × the share
of its samples that carried one) or from a Prometheus range query (`PromSource`).
"""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import numpy.typing as npt
from sqlalchemy import ColumnElement, Integer, and_, case, cast, func, select
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import InstrumentedAttribute

from powerd.pilot.windows import PilotError, Window
from powerd.store import Store
from powerd.store.aggregate import GroupAggregator
from powerd.store.db import missing_sqlite_file, shown_url
from powerd.store.tables import BudgetExcursion, CapChange, GpuMinute, GroupMinute, Tick

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Progress = Callable[[str], None]

MINUTE_S = 60
CHUNK_S = 6 * 3600  # one SQL round per 6 hours of a window: progress, and bounded answers
CAP_BIN_W = 25.0  # the caps' distribution, in bins this wide
MOVE_BIN_W = 5.0  # the sizes of cap moves, in bins this wide
PROM_MAX_POINTS = 10_000  # Prometheus refuses a range query of more than 11,000 points


@dataclass(frozen=True)
class FleetMinutes:
    """The fleet minute by minute (minutes with at least one GPU sample)."""

    minute: IntArray
    gpus: IntArray  # GPUs with a sample in the minute
    gpu_power_w: FloatArray  # Σ over GPUs of their mean draw
    energy_j: FloatArray
    work: FloatArray  # Σ reported perf × seconds
    perf_gpus: IntArray  # GPUs that reported perf in the minute
    committed_w: FloatArray  # Σ mean committed cap


@dataclass(frozen=True)
class GroupMinutes:
    """One budget group minute by minute."""

    name: str
    level: int
    minute: IntArray
    budget_w: FloatArray  # NaN: none
    mean_committed_w: FloatArray
    mean_draw_w: FloatArray
    max_draw_w: FloatArray
    over_s: FloatArray


@dataclass(frozen=True)
class Excursion:
    group: str
    level: int
    start_ts: float
    end_ts: float
    peak_draw_w: float
    peak_excess_w: float
    budget_w: float

    @property
    def duration_s(self) -> float:
        return self.end_ts - self.start_ts


@dataclass(frozen=True)
class CapHistory:
    """The committed caps over the window: how GPU-minutes spread over cap levels (bins of
    CAP_BIN_W from their lower edge), and the stored moves (one a GPU a minute at most:
    docs/storage.md, `cap_interval_s`), their sizes in bins of MOVE_BIN_W."""

    cap_bins: dict[float, int]
    moves: int
    gpus_moved: int
    move_bins: dict[float, int]


@dataclass(frozen=True)
class Series:
    """A Prometheus range query's answer: values summed over the series at each step."""

    ts: FloatArray
    value: FloatArray
    step_s: float
    series: int  # how many series were summed (a latency: the largest taken)


@dataclass
class WindowData:
    window: Window
    fleet: FleetMinutes
    groups: list[GroupMinutes]
    excursions: list[Excursion]
    caps: CapHistory
    throughput: Series | None = None  # from Prometheus; None: the agents' perf
    latency: Series | None = None
    notes: list[str] = field(default_factory=list)


class StoreSource:
    """Reads one window after another from a controller's store (read-only)."""

    def __init__(self, url: str, progress: Progress | None = None, flag: str = "--db") -> None:
        self.url = url
        self.flag = flag  # names the store in errors
        self.progress = progress or (lambda _line: None)
        _check_sqlite_file(url, flag)
        try:
            self.store = Store(url, read_only=True)
            self.store.ping()
        except (SQLAlchemyError, OSError, ValueError) as exc:
            raise PilotError(f"{flag} {_shown(url)}: cannot read the store: {_why(exc)}") from None

    def close(self) -> None:
        self.store.close()

    def read(self, window: Window) -> WindowData:
        try:
            fleet = self._fleet(window)
            if fleet.minute.size == 0:
                raise PilotError(
                    f"--{window.name} {window.label()}: the store has no GPU minutes in this "
                    "window (was a steering controller recording? a shadow records none)"
                )
            groups = self._groups(window)
            excursions = self._excursions(window)
            caps = self._caps(window)
            notes = []
            if not groups:
                groups, excursions = self._groups_from_ticks(window)
                notes.append(
                    "no budget groups' minutes stored in this window (recorded before "
                    "migration 0008): the facility and its rows are derived from the ticks"
                    if groups
                    else "no budget groups' minutes and no ticks stored in this window: draw "
                    "against budgets is not known"
                )
        except SQLAlchemyError as exc:
            raise PilotError(f"{self.flag} {_shown(self.url)}: {_why(exc)}") from None
        return WindowData(window, fleet, groups, excursions, caps, notes=notes)

    def _chunks(
        self, window: Window, first_s: float | None, last_s: float | None
    ) -> list[tuple[int, int]]:
        """The window in CHUNK_S pieces, from the first to the last time the store holds in
        it (`first_s`, `last_s`; None: nothing), so a window of years over a week of data
        costs a week of rounds, not a round per six hours of the years."""
        if first_s is None or last_s is None:
            return []
        first = int(max(window.start, first_s) // MINUTE_S * MINUTE_S)
        end = min(window.end, last_s + MINUTE_S)
        out = []
        lo = first
        while lo < end:
            hi = min(lo + CHUNK_S, int(math.ceil(end / MINUTE_S) * MINUTE_S))
            out.append((lo, hi))
            lo = hi
        return out

    def _fleet(self, window: Window) -> FleetMinutes:
        m = GpuMinute
        work = func.coalesce(m.mean_perf, 0.0) * MINUTE_S * m.perf_samples / m.samples
        stmt = select(
            m.minute,
            func.count(),
            func.sum(m.mean_power_w),
            func.sum(m.energy_j),
            func.sum(work),
            func.sum(case((m.perf_samples > 0, 1), else_=0)),
            func.sum(m.mean_cap_w),
        ).group_by(m.minute)
        rows: list[tuple[int, int, float, float, float, int, float]] = []
        with self.store.engine.connect() as conn:
            first, last = conn.execute(
                select(func.min(m.minute), func.max(m.minute)).where(
                    m.minute + MINUTE_S > window.start, m.minute < window.end
                )
            ).one()
            chunks = self._chunks(window, first, last)
            for i, (lo, hi) in enumerate(chunks, 1):
                self.progress(
                    f"{window.name}: GPU minutes {i}/{len(chunks)} "
                    f"({min(hi, window.end) - window.start:,.0f} of "
                    f"{window.end - window.start:,.0f} s)"
                )
                part = conn.execute(
                    stmt.where(m.minute >= lo, m.minute < hi, m.minute + MINUTE_S > window.start)
                    .where(m.minute < window.end)
                    .order_by(m.minute)
                ).all()
                rows.extend((r[0], r[1], r[2], r[3], r[4] or 0.0, r[5] or 0, r[6]) for r in part)
        cols = list(zip(*rows, strict=True)) if rows else [()] * 7
        return FleetMinutes(
            minute=np.asarray(cols[0], dtype=np.int64),
            gpus=np.asarray(cols[1], dtype=np.int64),
            gpu_power_w=np.asarray(cols[2], dtype=np.float64),
            energy_j=np.asarray(cols[3], dtype=np.float64),
            work=np.asarray(cols[4], dtype=np.float64),
            perf_gpus=np.asarray(cols[5], dtype=np.int64),
            committed_w=np.asarray(cols[6], dtype=np.float64),
        )

    def _groups(self, window: Window) -> list[GroupMinutes]:
        g = GroupMinute
        self.progress(f"{window.name}: budget groups")
        stmt = (
            select(
                g.group,
                g.level,
                g.minute,
                g.budget_w,
                g.mean_committed_w,
                g.mean_draw_w,
                g.max_draw_w,
                g.over_s,
            )
            .where(g.minute + MINUTE_S > window.start, g.minute < window.end)
            .order_by(g.level, g.group, g.minute)
        )
        by_name: dict[str, list[tuple[int, float, float, float, float, float]]] = {}
        levels: dict[str, int] = {}
        with self.store.engine.connect() as conn:
            for r in conn.execute(stmt):
                levels[r[0]] = r[1]
                by_name.setdefault(r[0], []).append(
                    (r[2], math.nan if r[3] is None else r[3], r[4], r[5], r[6], r[7])
                )
        out = []
        for name, rows in by_name.items():
            cols = list(zip(*rows, strict=True))
            out.append(
                GroupMinutes(
                    name=name,
                    level=levels[name],
                    minute=np.asarray(cols[0], dtype=np.int64),
                    budget_w=np.asarray(cols[1], dtype=np.float64),
                    mean_committed_w=np.asarray(cols[2], dtype=np.float64),
                    mean_draw_w=np.asarray(cols[3], dtype=np.float64),
                    max_draw_w=np.asarray(cols[4], dtype=np.float64),
                    over_s=np.asarray(cols[5], dtype=np.float64),
                )
            )
        return out

    def _groups_from_ticks(self, window: Window) -> tuple[list[GroupMinutes], list[Excursion]]:
        """The facility's and its rows' minutes and excursions from the `ticks` table (what a
        store kept before migration 0008, for `keep_ticks_days`), through the writer's own
        aggregation, so the figures mean the same."""
        t = Tick
        agg = GroupAggregator()
        rows: list[dict[str, Any]] = []
        runs: list[dict[str, Any]] = []
        stmt = select(t.ts, t.budget_w, t.committed_w, t.draw_w, t.rows).order_by(t.ts, t.id)
        with self.store.engine.connect() as conn:
            first, last = conn.execute(
                select(func.min(t.ts), func.max(t.ts)).where(
                    t.ts >= window.start, t.ts < window.end
                )
            ).one()
            chunks = self._chunks(window, first, last)
            for i, (lo, hi) in enumerate(chunks, 1):
                self.progress(f"{window.name}: ticks {i}/{len(chunks)} (no group minutes stored)")
                lo_ts, hi_ts = max(lo, window.start), min(hi, window.end)
                for ts, budget, committed, draw, per in conn.execute(
                    stmt.where(t.ts >= lo_ts, t.ts < hi_ts)
                ):
                    per_row = sorted((per or {}).items())
                    row_budgets = [u.get("budget_w") for _, u in per_row]
                    agg.add(
                        ts,
                        names=("facility", *(name for name, _ in per_row)),
                        levels=np.asarray([0] + [1] * len(per_row), dtype=np.int64),
                        budget_w=_floats([budget, *row_budgets]),
                        limit_w=_floats([budget, *row_budgets]),
                        committed_w=_floats([committed, *(u.get("load_w") for _, u in per_row)]),
                        draw_w=_floats([draw, *(u.get("draw_w") for _, u in per_row)]),
                    )
                    done, ended = agg.close()
                    rows += done
                    runs += ended
        done, ended = agg.close(final=True)
        rows += done
        runs += ended
        by_name: dict[str, list[dict[str, Any]]] = {}
        for row in rows:
            by_name.setdefault(row["group"], []).append(row)
        groups = [
            GroupMinutes(
                name=name,
                level=items[0]["level"],
                minute=np.asarray([x["minute"] for x in items], dtype=np.int64),
                budget_w=_floats([x["budget_w"] for x in items]),
                mean_committed_w=_floats([x["mean_committed_w"] for x in items]),
                mean_draw_w=_floats([x["mean_draw_w"] for x in items]),
                max_draw_w=_floats([x["max_draw_w"] for x in items]),
                over_s=_floats([x["over_s"] for x in items]),
            )
            for name, items in by_name.items()
        ]
        excursions = [
            Excursion(
                e["group"],
                e["level"],
                e["start_ts"],
                e["end_ts"],
                e["peak_draw_w"],
                e["peak_excess_w"],
                e["budget_w"],
            )
            for e in runs
        ]
        return groups, excursions

    def _excursions(self, window: Window) -> list[Excursion]:
        e = BudgetExcursion
        stmt = (
            select(e)
            .where(e.start_ts < window.end, e.end_ts >= window.start)
            .order_by(e.start_ts, e.id)
        )
        with self.store.engine.connect() as conn:
            return [
                Excursion(
                    r.group,
                    r.level,
                    r.start_ts,
                    r.end_ts,
                    r.peak_draw_w,
                    r.peak_excess_w,
                    r.budget_w,
                )
                for r in conn.execute(stmt)
            ]

    def _caps(self, window: Window) -> CapHistory:
        self.progress(f"{window.name}: cap history")
        m, c = GpuMinute, CapChange
        with self.store.engine.connect() as conn:
            cap_bin = self._bin(conn.dialect.name, m.mean_cap_w, CAP_BIN_W)
            cap_rows = conn.execute(
                select(cap_bin, func.count())
                .where(m.minute + MINUTE_S > window.start, m.minute < window.end)
                .group_by(cap_bin)
            ).all()
            size = func.abs(c.new_w - c.old_w)
            move_bin = self._bin(conn.dialect.name, size, MOVE_BIN_W)
            in_window = and_(c.ts >= window.start, c.ts < window.end, c.old_w.is_not(None))
            move_rows = conn.execute(
                select(move_bin, func.count()).where(in_window).group_by(move_bin)
            ).all()
            moved = conn.execute(
                select(func.count(func.distinct(c.gpu_uuid))).where(in_window)
            ).scalar_one()
        return CapHistory(
            cap_bins={float(k) * CAP_BIN_W: int(n) for k, n in cap_rows if k is not None},
            moves=sum(int(n) for _, n in move_rows),
            gpus_moved=int(moved or 0),
            move_bins={float(k) * MOVE_BIN_W: int(n) for k, n in move_rows if k is not None},
        )

    @staticmethod
    def _bin(
        dialect: str, expr: ColumnElement[float] | InstrumentedAttribute[float], width: float
    ) -> ColumnElement[int]:
        # floor(x / width): PostgreSQL rounds a cast to integer, SQLite truncates (x ≥ 0).
        if dialect == "postgresql":
            return cast(func.floor(expr / width), Integer)
        return cast(expr / width, Integer)


class PromSource:
    """A Prometheus server's HTTP API: `/api/v1/query_range` of the operator's query."""

    def __init__(self, url: str, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s

    def range(
        self, query: str, window: Window, flag: str = "--query", *, worst: bool = False
    ) -> Series:
        """The query's values over the window, summed over its series at each step (a
        rate); `worst`: the largest of them instead (a latency)."""
        step = max(float(MINUTE_S), math.ceil(window.hours * 3600.0 / PROM_MAX_POINTS))
        params = urllib.parse.urlencode(
            {"query": query, "start": window.start, "end": window.end, "step": step}
        )
        url = f"{self.url}/api/v1/query_range?{params}"
        try:
            with urllib.request.urlopen(url, timeout=self.timeout_s) as resp:
                body = json.loads(resp.read())
        except urllib.error.HTTPError as exc:
            detail = _prom_error(exc.read())
            raise PilotError(
                f"--throughput-prom {self.url}: {flag} refused (HTTP {exc.code}): {detail}"
            ) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise PilotError(f"--throughput-prom {self.url}: unreachable: {reason}") from None
        except (ValueError, RecursionError):  # RecursionError: nested deeper than it parses
            raise PilotError(
                f"--throughput-prom {self.url}: the answer is not JSON (is it Prometheus?)"
            ) from None
        return _parse_matrix(body, self.url, flag, step, worst=worst)


def _parse_matrix(body: object, url: str, flag: str, step: float, *, worst: bool) -> Series:
    if not isinstance(body, dict) or body.get("status") != "success":
        detail = body.get("error", "no status") if isinstance(body, dict) else "not an object"
        raise PilotError(f"--throughput-prom {url}: {flag} failed: {detail}")
    data = body.get("data") or {}
    kind = data.get("resultType") if isinstance(data, dict) else type(data).__name__
    if kind != "matrix":
        raise PilotError(
            f"--throughput-prom {url}: {flag} gave a {kind!r}, not a range vector (matrix)"
        )
    sums: dict[float, float] = {}
    result = data.get("result") or []
    garbage = PilotError(
        f"--throughput-prom {url}: {flag} gave a matrix that is not series of "
        "[time, value] points (is it Prometheus?)"
    )
    if not isinstance(result, list) or not all(
        isinstance(r, dict) and isinstance(r.get("values", []), list) for r in result
    ):
        raise garbage
    for series in result:
        for point in series.get("values", []):
            try:
                ts, value = point
                v, t = float(value), float(ts)
            except (TypeError, ValueError):
                raise garbage from None
            if math.isfinite(v) and math.isfinite(t):
                if v < 0:
                    raise PilotError(
                        f"--throughput-prom {url}: {flag} gave {v:g} at {_iso_s(t)}: a "
                        "throughput or a latency is never negative (a counter wants rate())"
                    )
                if worst:
                    sums[t] = max(sums.get(t, -math.inf), v)
                else:
                    sums[t] = sums.get(t, 0.0) + v
    overflow = next((t for t, v in sums.items() if not math.isfinite(v)), None)
    if overflow is not None:
        raise PilotError(
            f"--throughput-prom {url}: {flag}'s series add up to more than a float holds "
            f"at {_iso_s(overflow)}: is it a rate?"
        )
    ts_sorted = sorted(sums)
    return Series(
        ts=np.asarray(ts_sorted, dtype=np.float64),
        value=np.asarray([sums[t] for t in ts_sorted], dtype=np.float64),
        step_s=step,
        series=len(result),
    )


def _iso_s(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _prom_error(raw: bytes) -> str:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw[:200].decode(errors="replace").strip() or "no detail"
    return str(body.get("error", body))[:300] if isinstance(body, dict) else str(body)[:300]


def _floats(values: list[Any]) -> FloatArray:
    """None (a budget not stored, a draw not finite) as NaN."""
    return np.asarray([math.nan if v is None else v for v in values], dtype=np.float64)


def _check_sqlite_file(url: str, flag: str) -> None:
    """A report reads a store: a SQLite path that is not there is a typo, not a new file."""
    path = missing_sqlite_file(url)
    if path is not None:
        raise PilotError(f"{flag} {url}: no such SQLite file ({path})")


def _shown(url: str) -> str:
    """The URL without its password."""
    return shown_url(url)


def _why(exc: BaseException) -> str:
    orig = getattr(exc, "orig", None)
    text = str(orig or exc).strip().splitlines()
    return f"{type(orig or exc).__name__}: {text[0] if text else ''}"[:300]
