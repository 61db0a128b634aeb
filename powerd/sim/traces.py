"""Recorded GPU power, as operators already record it: `nvidia-smi --query-gpu=... --format=csv`.

    nvidia-smi --query-gpu=timestamp,index,uuid,power.draw,power.limit --format=csv -lms 1000

writes a header such as `timestamp, index, uuid, power.draw [W], power.limit [W]` and one
line per GPU per sample (`2026/12/03 16:01:39.123, 0, GPU-3a1f..., 412.35 W, 700.00 W`);
`--format=csv,nounits` drops the units. Columns come in any order; only `timestamp` and
`power.draw` are required; `uuid` (else `index`) tells the GPUs of one file apart; other
columns are read where they are known (`power.limit`) and ignored otherwise.

A trace that cannot be replayed faithfully is refused with the file, line, column and what
is wrong (`TraceError`), never half-read: a missing column, a number that does not parse,
a reading of `[N/A]` where a number is needed, time running backwards for a GPU, sample
intervals outside 100 ms – 60 s, a GPU whose samples stop before the file ends.

The one exception is a last line without its newline: a file still being written (or
copied while it was), cut mid-line. Whether or not it parses ("312.4 W" cut to "31"
parses), its values cannot be trusted, so it is left out with a warning
(`trace_last_line_dropped`, naming the file and line) and the rest is replayed.

Timestamps only place a GPU's samples relative to each other: replay starts each GPU at its
own first sample (docs/simulator.md, "Recorded traces").
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import cached_property
from pathlib import Path

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.input_errors import InputError

FloatArray = NDArray[np.float64]
log = structlog.get_logger(__name__)

# Readings nvidia-smi writes instead of a number.
NOT_A_READING = ("[N/A]", "[Not Supported]", "[Unknown Error]", "[GPU is lost]", "N/A")
# Header names (as nvidia-smi prints them, unit stripped) → what powerd reads.
DRAW_NAMES = ("power.draw", "power.draw.instant", "power.draw.average")
LIMIT_NAMES = ("power.limit", "enforced.power.limit")
MIN_INTERVAL_S = 0.1
MAX_INTERVAL_S = 60.0
# A GPU whose last sample lies this many of its intervals before the file's end stopped.
STOP_INTERVALS = 3.0
MAX_SANE_W = 10_000.0
TIME_FORMATS = ("%Y/%m/%d %H:%M:%S.%f", "%Y/%m/%d %H:%M:%S", "%Y-%m-%d %H:%M:%S.%f")


class TraceError(InputError):
    """A trace that cannot be replayed: where (file, line, column) and what is wrong."""

    kind = "trace"

    def __init__(
        self,
        path: Path | str,
        message: str,
        *,
        line: int | None = None,
        column: str | None = None,
    ) -> None:
        self.line, self.column = line, column
        where = "" if line is None else f"line {line}"
        if column is not None:
            where += f", column {column!r}" if where else f"column {column!r}"
        super().__init__(str(path), [(where, message)])


@dataclass(frozen=True)
class GpuTrace:
    """One recorded GPU: its samples' times (s since its first), draw and limit (W)."""

    source: str  # the file
    gpu: str  # uuid, `index N`, or `gpu` for a file of one GPU
    t_s: FloatArray
    draw_w: FloatArray
    limit_w: FloatArray | None  # NaN where not reported

    @property
    def duration_s(self) -> float:
        return float(self.t_s[-1])

    @cached_property
    def interval_s(self) -> float:
        """The median time between samples (computed once: `draw_at` runs every tick)."""
        return float(np.median(np.diff(self.t_s)))

    @cached_property
    def _loop(self) -> tuple[float, FloatArray, FloatArray]:
        """The loop `draw_at` interpolates on: its period, times and draws."""
        period = self.duration_s + self.interval_s
        return period, np.append(self.t_s, period), np.append(self.draw_w, self.draw_w[0])

    def draw_at(self, t_s: FloatArray | float) -> FloatArray:
        """The recorded draw at time `t_s` since the start, looping a trace shorter than
        the run (the last sample joins the first one interval later)."""
        period, t, w = self._loop
        x = np.mod(np.asarray(t_s, dtype=np.float64), period)
        return np.asarray(np.interp(x, t, w))


def _columns(header: str) -> dict[str, int]:
    """`power.draw [W]` → `power.draw`; position of each."""
    out: dict[str, int] = {}
    for k, raw in enumerate(header.split(",")):
        name = raw.strip().split(" [", 1)[0].strip().lower()
        if name:
            out.setdefault(name, k)
    return out


def _first(columns: dict[str, int], names: tuple[str, ...]) -> tuple[str, int] | None:
    for n in names:
        if n in columns:
            return n, columns[n]
    return None


def _time(text: str) -> float:
    for fmt in TIME_FORMATS:
        try:
            # nvidia-smi writes the host's local time without a zone; only differences
            # matter here, so read it as UTC (no DST step inside a recording).
            return datetime.strptime(text, fmt).replace(tzinfo=UTC).timestamp()
        except ValueError:
            continue
    value = float(text)  # epoch seconds (a recording of powerd's own): ValueError if not
    if not math.isfinite(value):  # float() takes "nan" and "inf": no time
        raise ValueError(text)
    return value


def _watts(path: Path, line: int, column: str, text: str, *, required: bool) -> float:
    if text in NOT_A_READING:
        if not required:
            return math.nan
        raise TraceError(
            path,
            f"{text!r} where a reading is needed: this GPU did not report {column} "
            "(record GPUs that report it, or leave this one out of the trace)",
            line=line,
            column=column,
        )
    value = text.removesuffix("W").strip()
    try:
        w = float(value)
    except ValueError:
        raise TraceError(
            path, f"{text!r} is not a number of watts", line=line, column=column
        ) from None
    if not (0.0 <= w <= MAX_SANE_W):
        raise TraceError(path, f"{w:g} W is not a GPU's power", line=line, column=column)
    return w


def read_nvidia_smi_csv(path: str | Path) -> list[GpuTrace]:
    """Every GPU of one `nvidia-smi --format=csv[,nounits]` file (TraceError if unusable)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(path, f"cannot be read: {exc}") from None
    lines = text.splitlines()
    numbered = [(k + 1, ln) for k, ln in enumerate(lines) if ln.strip()]
    if not numbered:
        raise TraceError(path, "is empty")
    if len(numbered) > 1 and numbered[-1][0] == len(lines) and not text.endswith(("\n", "\r")):
        _drop_cut_line(path, *numbered.pop())
    header_line, header = numbered[0]
    cols = _columns(header)
    if "timestamp" not in cols:
        raise TraceError(
            path, "no 'timestamp' column (record with --query-gpu=timestamp,...)", line=header_line
        )
    draw = _first(cols, DRAW_NAMES)
    if draw is None:
        raise TraceError(
            path,
            "no 'power.draw' column (record with --query-gpu=...,power.draw)",
            line=header_line,
        )
    limit = _first(cols, LIMIT_NAMES)
    key_col = cols.get("uuid", cols.get("index"))
    key_name = "uuid" if "uuid" in cols else "index"
    width = len(header.split(","))
    samples: dict[str, tuple[list[float], list[float], list[float], list[int]]] = {}
    for line, text in numbered[1:]:
        fields = [f.strip() for f in text.split(",")]
        if len(fields) != width:
            raise TraceError(path, f"{len(fields)} fields where the header has {width}", line=line)
        try:
            t = _time(fields[cols["timestamp"]])
        except ValueError:
            raise TraceError(
                path,
                f"{fields[cols['timestamp']]!r} is not a time (nvidia-smi writes "
                "YYYY/MM/DD HH:MM:SS.mmm)",
                line=line,
                column="timestamp",
            ) from None
        gpu = "gpu" if key_col is None else f"{key_name} {fields[key_col]}"
        if key_name == "uuid" and key_col is not None:
            gpu = fields[key_col]
        ts, ws, ls, at = samples.setdefault(gpu, ([], [], [], []))
        if ts and t <= ts[-1]:
            raise TraceError(
                path,
                f"time runs backwards (or repeats) for {gpu}: {fields[cols['timestamp']]!r} "
                f"after the sample of line {at[-1]}"
                + (
                    ""
                    if key_col is not None
                    else "; several GPUs in one file need a 'uuid' or 'index' column"
                ),
                line=line,
                column="timestamp",
            )
        ts.append(t)
        ws.append(_watts(path, line, draw[0], fields[draw[1]], required=True))
        ls.append(
            math.nan
            if limit is None
            else _watts(path, line, limit[0], fields[limit[1]], required=False)
        )
        at.append(line)
    if not samples:
        raise TraceError(path, "has a header but no samples")
    return _checked(path, samples, limit is not None)


def _drop_cut_line(path: Path, line: int, text: str) -> None:
    """nvidia-smi and `powerd agent --record` end every line with a newline: a last line
    without one was cut while being written, and a cut number can still parse."""
    log.warning(
        "trace_last_line_dropped",
        file=str(path),
        line=line,
        text=text[:120],
        why="no newline at its end: the file was cut mid-line (still being written?); "
        "left out, the samples before it are replayed",
    )


def _checked(
    path: Path,
    samples: dict[str, tuple[list[float], list[float], list[float], list[int]]],
    has_limit: bool,
) -> list[GpuTrace]:
    end = max(ts[-1] for ts, _, _, _ in samples.values())
    out = []
    for gpu, (ts, ws, ls, at) in samples.items():
        if len(ts) < 2:
            raise TraceError(path, f"{gpu} has one sample: a trace needs two", line=at[0])
        t = np.array(ts)
        step = float(np.median(np.diff(t)))
        if not (MIN_INTERVAL_S * 0.9 <= step <= MAX_INTERVAL_S * 1.1):
            raise TraceError(
                path,
                f"{gpu} is sampled every {step:.3g} s: powerd replays 100 ms to 60 s "
                "(nvidia-smi -lms 100 … -l 60)",
                line=at[1],
            )
        if end - t[-1] > STOP_INTERVALS * step:
            raise TraceError(
                path,
                f"{gpu}'s samples stop {end - t[-1]:.1f} s before the file ends (its last "
                "sample): a GPU lost or reset while recording; cut the file there, or leave "
                "the GPU out",
                line=at[-1],
            )
        out.append(
            GpuTrace(
                source=str(path),
                gpu=gpu,
                t_s=t - t[0],
                draw_w=np.array(ws),
                limit_w=np.array(ls) if has_limit else None,
            )
        )
    return out


def load_traces(patterns: list[str], base: Path) -> list[GpuTrace]:
    """The GPUs of every file the patterns (paths or globs, relative to `base`) name, in
    name order; TraceError for a pattern that names nothing."""
    out: list[GpuTrace] = []
    for pattern in patterns:
        p = Path(pattern)
        root = p if p.is_absolute() else base / p
        glob = any(c in pattern for c in "*?[")
        files = sorted(root.parent.glob(root.name)) if glob else [root]
        files = [f for f in files if f.is_file()]
        if not files:
            raise TraceError(root, "no such trace file" if not glob else "no file matches")
        for f in files:
            out.extend(read_nvidia_smi_csv(f))
    return out
