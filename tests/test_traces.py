"""Recorded nvidia-smi CSV traces: read as nvidia-smi writes them, refused with where and
why when they cannot be replayed. The files are written here, as nvidia-smi would."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import structlog.testing

from powerd.sim.traces import TraceError, load_traces, read_nvidia_smi_csv

UUID_A = "GPU-3a1f9e02-4c11-4b8a-9e2d-7f6b1c0a55e1"
UUID_B = "GPU-78f90e78-39a0-4f40-fcbc-0adf3598c166"


def stamp(k: int, step_s: float = 1.0) -> str:
    """nvidia-smi's timestamp for sample k (from 16:00:00.000 on 2026/12/03)."""
    total_ms = round(k * step_s * 1000)
    s, ms = divmod(total_ms, 1000)
    m, s = divmod(s, 60)
    return f"2026/12/03 16:{m:02d}:{s:02d}.{ms:03d}"


def write(tmp_path: Path, lines: list[str], name: str = "trace.csv") -> Path:
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def two_gpus(n: int = 10, step_s: float = 1.0, units: bool = True) -> list[str]:
    w = " W" if units else ""
    head = "timestamp, index, uuid, power.draw [W], power.limit [W]"
    rows = []
    for k in range(n):
        rows.append(f"{stamp(k, step_s)}, 0, {UUID_A}, {300 + k:.2f}{w}, 700.00{w}")
        rows.append(f"{stamp(k, step_s)}, 1, {UUID_B}, {500 - k:.2f}{w}, 650.00{w}")
    return [head, *rows]


@pytest.mark.parametrize("units", [True, False], ids=["units", "nounits"])
def test_several_gpus_with_or_without_units(tmp_path: Path, units: bool) -> None:
    traces = read_nvidia_smi_csv(write(tmp_path, two_gpus(units=units)))
    by = {t.gpu: t for t in traces}
    assert set(by) == {UUID_A, UUID_B}
    a = by[UUID_A]
    assert a.t_s.tolist() == pytest.approx([float(k) for k in range(10)])
    assert a.draw_w.tolist() == pytest.approx([300.0 + k for k in range(10)])
    assert a.limit_w is not None and a.limit_w.tolist() == pytest.approx([700.0] * 10)
    assert a.interval_s == pytest.approx(1.0) and a.duration_s == pytest.approx(9.0)


def test_any_column_order_only_timestamp_and_draw_required(tmp_path: Path) -> None:
    lines = ["power.draw [W], name, timestamp, clocks.current.sm [MHz]"]
    lines += [f"{200 + 10 * k} W, NVIDIA H200, {stamp(k, 0.1)}, 1980 MHz" for k in range(20)]
    (trace,) = read_nvidia_smi_csv(write(tmp_path, lines))
    assert trace.gpu == "gpu" and trace.limit_w is None
    assert trace.interval_s == pytest.approx(0.1)
    assert trace.draw_w[-1] == pytest.approx(390.0)


def test_a_shorter_trace_loops(tmp_path: Path) -> None:
    (trace,) = read_nvidia_smi_csv(
        write(
            tmp_path,
            ["timestamp, power.draw [W]"] + [f"{stamp(k)}, {100 * (k + 1)}" for k in range(3)],
        )
    )
    # Samples at 0, 1, 2 s (100, 200, 300 W); the loop closes back to 100 W at 3 s.
    got = trace.draw_at(np.array([0.0, 1.5, 2.5, 3.0, 4.0]))
    assert got.tolist() == pytest.approx([100.0, 250.0, 200.0, 100.0, 200.0])


def at(i: int, old: str, new: str) -> Callable[[list[str]], list[str]]:
    """An edit of line index i of a trace: `old` replaced by `new`."""
    return lambda ls: [*ls[:i], ls[i].replace(old, new), *ls[i + 1 :]]


def drop_header_column(ls: list[str]) -> list[str]:
    return [ls[0].replace("timestamp, ", ""), *(r.split(", ", 1)[1] for r in ls[1:])]


def stop_gpu_b(ls: list[str]) -> list[str]:
    return [ls[0], *(r for r in ls[1:] if UUID_B not in r or r < stamp(5))]


@pytest.mark.parametrize(
    ("edit", "where", "what"),
    [
        (drop_header_column, "line 1", "no 'timestamp' column"),
        (at(0, "power.draw", "power.drawn"), "line 1", "no 'power.draw' column"),
        (at(3, "301.00 W", "3o1 W"), "line 4, column 'power.draw'", "is not a number of watts"),
        (at(3, "301.00 W", "[N/A]"), "line 4, column 'power.draw'", "did not report power.draw"),
        (at(5, stamp(2), stamp(0)), "line 6, column 'timestamp'", "time runs backwards"),
        (at(3, stamp(1), "yesterday"), "line 4, column 'timestamp'", "is not a time"),
        (at(3, "700.00 W", "700.00 W, 7"), "line 4", "6 fields where the header has 5"),
        (stop_gpu_b, f"{UUID_B}'s samples stop", "before the file ends"),
        (at(3, "301.00 W", "-5 W"), "line 4", "is not a GPU's power"),
    ],
    ids=[
        "no-timestamp",
        "no-draw",
        "bad-number",
        "n/a",
        "backwards",
        "bad-time",
        "extra-field",
        "samples-stop",
        "negative",
    ],
)
def test_bad_traces_say_where_and_what(
    tmp_path: Path, edit: Callable[[list[str]], list[str]], where: str, what: str
) -> None:
    path = write(tmp_path, edit(two_gpus()))
    with pytest.raises(TraceError) as err:
        read_nvidia_smi_csv(path)
    text = str(err.value)
    assert str(path) in text and what in text, text
    assert where in text, text


def test_intervals_outside_100ms_to_60s_are_refused(tmp_path: Path) -> None:
    fast = write(tmp_path, two_gpus(step_s=0.01), "fast.csv")
    with pytest.raises(TraceError, match=r"sampled every 0\.01 s"):
        read_nvidia_smi_csv(fast)
    slow = write(tmp_path, two_gpus(step_s=120.0), "slow.csv")
    with pytest.raises(TraceError, match="sampled every 120 s"):
        read_nvidia_smi_csv(slow)


def test_several_gpus_without_index_or_uuid_are_refused(tmp_path: Path) -> None:
    lines = ["timestamp, power.draw [W]"]
    for k in range(5):
        lines += [f"{stamp(k)}, 300 W", f"{stamp(k)}, 500 W"]
    with pytest.raises(TraceError, match="need a 'uuid' or 'index' column"):
        read_nvidia_smi_csv(write(tmp_path, lines))


def test_globs_relative_to_the_scenario(tmp_path: Path) -> None:
    (tmp_path / "traces").mkdir()
    write(tmp_path / "traces", two_gpus(), "node-1.csv")
    write(tmp_path / "traces", two_gpus(), "node-2.csv")
    traces = load_traces(["traces/node-*.csv"], tmp_path)
    assert len(traces) == 4
    assert [Path(t.source).name for t in traces] == ["node-1.csv"] * 2 + ["node-2.csv"] * 2
    with pytest.raises(TraceError, match="no file matches"):
        load_traces(["traces/rack-*.csv"], tmp_path)
    with pytest.raises(TraceError, match="no such trace file"):
        load_traces(["traces/missing.csv"], tmp_path)


def draw_last(n: int = 10) -> list[str]:
    """One GPU, power.draw the last column: a cut line can end inside the number."""
    return ["timestamp, power.draw [W]"] + [f"{stamp(k)}, 312.40 W" for k in range(n)]


@pytest.mark.parametrize(
    ("lines", "cut_to"),
    [
        (draw_last(), f"{stamp(9)}, 31"),  # parses: 31 W would be replayed as drawn
        (draw_last(), f"{stamp(9)}, 312.40 W"),  # whole, only its newline missing
        (draw_last(), f"{stamp(9)[:7]}"),  # no longer a time
        (two_gpus(), f"{stamp(9)}, 1, {UUID_B}, 491.00"),  # fields missing
        (two_gpus(), f"{stamp(9)}, 1, {UUID_B}, 491.00 W, 65"),  # a cut limit
    ],
    ids=["number-still-parses", "whole-line", "cut-time", "fields-missing", "cut-limit"],
)
def test_a_last_line_cut_mid_write_is_left_out_with_a_warning(
    tmp_path: Path, lines: list[str], cut_to: str
) -> None:
    # Before: a cut number that still parsed was replayed (31 W for 312.4 W, a 65 W
    # limit), and one that did not refused the whole file, still being recorded.
    path = tmp_path / "live.csv"
    path.write_text("\n".join([*lines[:-1], cut_to]))  # no newline: cut mid-write
    with structlog.testing.capture_logs() as logs:
        traces = read_nvidia_smi_csv(path)
    whole = read_nvidia_smi_csv(write(tmp_path, lines[:-1], "whole.csv"))
    assert [t.gpu for t in traces] == [t.gpu for t in whole]
    for got, want in zip(traces, whole, strict=True):
        assert got.draw_w.tolist() == want.draw_w.tolist()
        assert got.t_s.tolist() == want.t_s.tolist()
    (event,) = [e for e in logs if e["event"] == "trace_last_line_dropped"]
    assert event["log_level"] == "warning"
    assert event["file"] == str(path) and event["line"] == len(lines)
    assert event["text"] == cut_to and "no newline" in event["why"]


def test_a_bad_line_with_its_newline_is_still_refused_by_file_and_line(tmp_path: Path) -> None:
    lines = draw_last()
    cut_middle = [*lines[:4], f"{stamp(4)}, 31x", *lines[5:]]
    for name, bad, line in [("middle.csv", cut_middle, 5), ("last.csv", [*lines, "2026/1"], 12)]:
        path = write(tmp_path, bad, name)
        with structlog.testing.capture_logs() as logs, pytest.raises(TraceError) as err:
            read_nvidia_smi_csv(path)
        assert str(path) in str(err.value) and err.value.line == line
        assert not logs


def test_a_lone_header_without_newline_is_not_dropped(tmp_path: Path) -> None:
    path = tmp_path / "head.csv"
    path.write_text("timestamp, power.draw [W]")
    with pytest.raises(TraceError, match="has a header but no samples"):
        read_nvidia_smi_csv(path)
