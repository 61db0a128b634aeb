"""`powerd pilot report`: a store filled through the real Store API with a baseline window
and a managed window, the report's figures checked against what was put in; bad windows,
an unreachable store and the Prometheus source over real HTTP."""

from __future__ import annotations

import base64
import json
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from powerd.cli import main
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from powerd.pilot.windows import PilotError, parse_window
from powerd.store import Retention, Store, StoreWriter, TickRecord, upgrade

B0 = datetime(2026, 11, 2, tzinfo=UTC).timestamp()  # the baseline's start (a minute's)
M0 = B0 + 3600.0  # the managed window's start
SPAN_S = 1800.0  # each window: 30 minutes
TICK_S = 10.0
BUDGET_W = 4000.0
ROW_BUDGET_W = 2200.0
GROUPS = ("dc", "row-a", "row-b")
LEVELS = np.array([0, 1, 1], dtype=np.int64)
BUDGETS = np.array([BUDGET_W, ROW_BUDGET_W, ROW_BUDGET_W])


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


BASELINE = f"{iso(B0)}..{iso(B0 + SPAN_S)}"
MANAGED = f"{iso(M0)}..{iso(M0 + SPAN_S)}"


@dataclass(frozen=True)
class Phase:
    start: float
    gpus: int
    perf: float  # per GPU, per second
    power_w: float  # per GPU
    caps_w: tuple[float, float]  # alternating every 2 minutes (the same twice: static)
    over_w: dict[int, float]  # tick index -> facility draw above the budget


BASE = Phase(B0, gpus=8, perf=100.0, power_w=300.0, caps_w=(400.0, 400.0), over_w={})
# Four more GPUs in the same envelope; one excursion of 3 ticks (30 s), 250 W at its peak.
MANAGED_PHASE = Phase(
    M0, gpus=12, perf=90.0, power_w=280.0, caps_w=(300.0, 350.0), over_w={30: 150, 31: 250, 32: 100}
)


def record(writer: StoreWriter, phase: Phase, *, groups: bool = True) -> None:
    """What a steering controller submits each tick, through the writer it uses; without
    `groups`, what one did before migration 0008 (its ticks instead)."""
    uuids = [f"GPU-{i:02d}" for i in range(phase.gpus)]
    energy = np.zeros(phase.gpus)
    for k in range(int(SPAN_S / TICK_S)):
        ts = phase.start + k * TICK_S
        cap = phase.caps_w[int((ts - phase.start) // 120) % 2]
        power = np.full(phase.gpus, phase.power_w)
        energy = energy + power * TICK_S
        writer.submit_samples(
            uuids,
            ts,
            power,
            np.full(phase.gpus, cap),
            energy.copy(),
            perf=np.full(phase.gpus, phase.perf),
        )
        writer.submit_caps(k, ts, {"n1": dict.fromkeys(uuids, cap)})
        total = phase.gpus * phase.power_w
        draw = np.array([total, total / 2, total / 2])
        draw[0] = BUDGET_W + phase.over_w.get(k, -500.0)
        committed = phase.gpus * cap
        if not groups:
            writer.submit_tick(
                TickRecord(
                    tick=k,
                    ts=ts,
                    status="optimal",
                    solver="fast",
                    solve_ms=1.0,
                    budget_w=BUDGET_W,
                    committed_w=committed,
                    draw_w=float(draw[0]),
                    throughput=0.0,
                    gpus=phase.gpus,
                    gpus_stale=0,
                    rows={
                        name: {"budget_w": ROW_BUDGET_W, "load_w": committed / 2, "draw_w": d}
                        for name, d in (("row-a", draw[1]), ("row-b", draw[2]))
                    },
                )
            )
            continue
        writer.submit_groups(
            ts,
            names=GROUPS,
            levels=LEVELS,
            budget_w=BUDGETS.copy(),
            limit_w=BUDGETS.copy(),
            committed_w=np.array([phase.gpus * cap, phase.gpus * cap / 2, phase.gpus * cap / 2]),
            draw_w=draw,
        )
        if k % 30 == 0:
            writer.flush()


def filled(
    url: str, phases: tuple[Phase, ...] = (BASE, MANAGED_PHASE), *, groups: bool = True
) -> str:
    upgrade(url)
    store = Store(url)
    # Kept for ever: the windows lie in the past of the writer's clock, which prunes.
    writer = StoreWriter(store, retention=Retention(keep_minutes_days=1e6, keep_ticks_days=1e6))
    for phase in phases:
        record(writer, phase, groups=groups)
    writer.stop()  # not started: one last cycle here, every open minute closed
    store.close()
    return url


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    """One filled SQLite store for the tests that only read it."""
    return filled(f"sqlite:///{tmp_path_factory.mktemp('pilot') / 'powerd.db'}")


def report(url: str, out: Path, *extra: str) -> tuple[int, dict[str, Any] | None]:
    argv = ["pilot", "report", "--db", url, "--baseline", BASELINE, "--managed", MANAGED]
    code = main([*argv, "--out", str(out), "--quiet", *extra])
    path = out / "pilot.json"
    return code, json.loads(path.read_text()) if code == EXIT_OK else None


def budget(fig: dict[str, Any], group: str) -> dict[str, Any]:
    return next(b for b in fig["budgets"] if b["group"] == group)


# ---- the report's figures ----


def test_the_report_gives_back_what_the_store_was_given(
    db_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, rep = report(filled(db_url), tmp_path / "out")
    assert code == EXIT_OK and rep is not None
    base, man, cmp = rep["baseline"], rep["managed"], rep["comparison"]

    # Work: every GPU reported its rate in every sample, for the whole window.
    assert base["work"]["total"] == pytest.approx(8 * 100.0 * SPAN_S)
    assert man["work"]["total"] == pytest.approx(12 * 90.0 * SPAN_S)
    assert man["work"]["per_gpu"] == pytest.approx(90.0 * SPAN_S)
    assert base["work"]["coverage"] == pytest.approx(1.0)
    # Energy from the counters (the first sample has none): per kWh follows.
    assert base["gpu_energy_kwh"] == pytest.approx(8 * 300.0 * (SPAN_S - TICK_S) / 3.6e6)
    assert base["work"]["per_kwh"] == pytest.approx(base["work"]["total"] / base["gpu_energy_kwh"])
    assert (base["gpus"]["mean"], man["gpus"]["max"]) == (8, 12)

    # Draw against the facility's budget: the managed window's one excursion.
    assert budget(base, "dc")["time_over_s"] == 0 and budget(base, "dc")["excursions"] == 0
    dc = budget(man, "dc")
    assert dc["budget_w"] == BUDGET_W
    assert dc["max_draw_w"] == BUDGET_W + 250
    assert dc["time_over_s"] == pytest.approx(30.0)
    assert dc["excursions"] == 1
    assert dc["largest"]["duration_s"] == pytest.approx(30.0)
    assert dc["largest"]["peak_excess_w"] == pytest.approx(250.0)
    assert dc["largest"]["start"] == datetime.fromtimestamp(M0 + 300, UTC).isoformat()
    # Committed against measured, per group.
    row = budget(man, "row-a")
    assert row["mean_draw_w"] == pytest.approx(12 * 280.0 / 2)
    mean_cap = (8 * 300.0 + 7 * 350.0) / 15  # 15 two-minute blocks, the first at 300 W
    assert row["mean_committed_w"] == pytest.approx(12 * mean_cap / 2)
    assert row["time_over_s"] == 0

    # The caps: static in the baseline, moving by 50 W in the managed window.
    assert base["caps"]["median_w"] == pytest.approx(412.5)  # the 400-425 W bin
    assert base["caps"]["moves"] == 0
    assert man["caps"]["moves"] > 0 and man["caps"]["move_median_w"] == pytest.approx(52.5)

    # The comparison.
    assert cmp["gpus_mean"]["delta"] == pytest.approx(4.0)
    assert cmp["envelope_w"] == {"baseline": BUDGET_W, "managed": BUDGET_W, "same": True}
    assert cmp["work_per_hour"]["delta_pct"] == pytest.approx((12 * 90 / (8 * 100) - 1) * 100)
    assert cmp["compliance"]["managed"] == {
        "time_over_s": pytest.approx(30.0),
        "excursions": 1,
        "worst_excess_w": pytest.approx(250.0),
    }

    out = capsys.readouterr().out
    assert "GPUs (mean): 8.0 -> 12.0 (+50.0 %)" in out
    assert "managed: 30 s over a budget, 1 excursion(s), worst 250 W over" in out


def test_the_html_page_is_one_file_with_its_plots(sqlite_store: str, tmp_path: Path) -> None:
    code, rep = report(sqlite_store, tmp_path / "out")
    assert code == EXIT_OK and rep is not None
    page = (tmp_path / "out" / "pilot.html").read_text()
    assert page.startswith("<!doctype html>") and page.rstrip().endswith("</html>")
    images = [part.split("'", 1)[0] for part in page.split("src='data:image/png;base64,")[1:]]
    assert len(images) == 5  # no latency without a Prometheus latency query
    assert all(base64.b64decode(img).startswith(b"\x89PNG\r\n\x1a\n") for img in images)
    assert "src='http" not in page and "<script" not in page  # nothing fetched
    assert "row-a" in page and "4.0 kW" in page  # the budget tables


def test_a_baseline_recorded_elsewhere(tmp_path: Path) -> None:
    """A shadow's recording (`record_db`) holds the baseline; the steering store the rest."""
    recording = filled(f"sqlite:///{tmp_path / 'shadow.db'}", (BASE,))
    steering = filled(f"sqlite:///{tmp_path / 'steer.db'}", (MANAGED_PHASE,))
    code, rep = report(steering, tmp_path / "out", "--baseline-db", recording)
    assert code == EXIT_OK and rep is not None
    assert (rep["baseline"]["gpus"]["mean"], rep["managed"]["gpus"]["mean"]) == (8, 12)
    assert rep["baseline_db"] == recording
    # Without it the baseline is looked for in --db, where there is none.
    assert report(steering, tmp_path / "out")[0] == EXIT_FAILED


def test_a_store_from_before_the_group_minutes_derives_them_from_its_ticks(
    tmp_path: Path,
) -> None:
    url = filled(f"sqlite:///{tmp_path / 'old.db'}", groups=False)
    code, rep = report(url, tmp_path / "out")
    assert code == EXIT_OK and rep is not None
    man = rep["managed"]
    dc = budget(man, "facility")  # the ticks do not name it
    assert (dc["time_over_s"], dc["excursions"]) == (pytest.approx(30.0), 1)
    assert dc["largest"]["peak_excess_w"] == pytest.approx(250.0)
    assert budget(man, "row-a")["mean_draw_w"] == pytest.approx(12 * 280.0 / 2)
    assert rep["comparison"]["envelope_w"]["same"] is True
    assert any("derived from the ticks" in note for note in man["notes"])
    assert not any("no GPU reported perf" in note for note in man["notes"])


def test_a_window_without_perf_says_its_work_is_unknown(tmp_path: Path) -> None:
    silent = Phase(M0, 12, perf=float("nan"), power_w=280.0, caps_w=(300.0, 300.0), over_w={})
    url = filled(f"sqlite:///{tmp_path / 'p.db'}", (BASE, silent))
    code, rep = report(url, tmp_path / "out")
    assert code == EXIT_OK and rep is not None
    assert rep["managed"]["work"]["coverage"] == 0
    assert any("work is unknown" in note for note in rep["managed"]["notes"])
    assert not any("work is unknown" in note for note in rep["baseline"]["notes"])


# ---- refused ----


@pytest.mark.parametrize(
    ("baseline", "managed", "message"),
    [
        ("2026-11-02T00:00..2026-11-02T01:00Z", MANAGED, "has no time zone"),
        ("2026-11-02T01:00Z..2026-11-02T00:00Z", MANAGED, "ends before it starts"),
        ("2026-11-02T00:00Z", MANAGED, "expected START..END"),
        ("yesterday..today", MANAGED, "is not an ISO 8601 time"),
        (BASELINE, f"{iso(B0 + 600)}..{iso(B0 + 7200)}", "overlap"),
    ],
)
def test_bad_windows_are_refused_in_one_line(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    baseline: str,
    managed: str,
    message: str,
) -> None:
    # Refused before any store is opened: this one is not there.
    url = f"sqlite:///{tmp_path / 'none.db'}"
    argv = ["pilot", "report", "--db", url, "--baseline", baseline, "--managed", managed]
    assert main([*argv, "--out", str(tmp_path / "out"), "--quiet"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_a_window_without_data_is_an_error(
    sqlite_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["pilot", "report", "--db", sqlite_store, "--baseline", BASELINE]
    empty = f"{iso(M0 + 7200)}..{iso(M0 + 9000)}"
    assert main([*argv, "--managed", empty, "--out", str(tmp_path), "--quiet"]) == EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert "--managed" in err and "no GPU minutes" in err and "\n" not in err


def test_an_unreachable_or_missing_store_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for url, says in (
        (f"sqlite:///{tmp_path / 'typo.db'}", "no such SQLite file"),
        ("postgresql://postgres@127.0.0.1:9/none", "cannot read the store"),
    ):
        code, _ = report(url, tmp_path / "out")
        assert code == EXIT_FAILED
        err = capsys.readouterr().err.strip()
        assert says in err and "\n" not in err
    assert not (tmp_path / "typo.db").exists()  # a report creates no database


def test_windows_take_iso_8601_with_any_zone() -> None:
    w = parse_window("managed", "2026-11-02T01:00:00+01:00..2026-11-02 00:30Z")
    assert (w.start, w.end) == (B0, B0 + 1800)
    with pytest.raises(PilotError, match="no time zone"):
        parse_window("baseline", "2026-11-02T00:00Z..2026-11-02T01:00")


def test_help_names_the_formats_and_the_extra(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["pilot", "report", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "ISO 8601 with a time zone" in text and "`sim` extra" in text


# ---- Prometheus over HTTP ----

WORK_SERIES = (50.0, 30.0)  # two series of work per second, summed by the report


class _Prometheus(BaseHTTPRequestHandler):
    """Just enough of Prometheus's HTTP API: /api/v1/query_range, points from start to end
    inclusive every step, errors as Prometheus words them."""

    queries: list[dict[str, str]]

    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        self.queries.append(q)
        if url.path != "/api/v1/query_range":
            return self._send(404, {"status": "error", "error": "not found"})
        if "{" in q["query"]:
            error = {"status": "error", "errorType": "bad_data", "error": "parse error at char 5"}
            return self._send(400, error)
        start, end, step = float(q["start"]), float(q["end"]), float(q["step"])
        steps = np.arange(start, end + step / 2, step)
        # Work as given; a latency in two series, lower in the managed window.
        latency = (0.2, 0.1) if start < M0 else (0.15, 0.05)
        values = WORK_SERIES if q["query"] == "work" else latency
        result = [
            {"metric": {"i": str(i)}, "values": [[t, str(v)] for t in steps.tolist()]}
            for i, v in enumerate(values)
        ]
        return self._send(
            200, {"status": "success", "data": {"resultType": "matrix", "result": result}}
        )

    def _send(self, code: int, body: dict[str, Any]) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_args: Any) -> None:
        pass


@pytest.fixture
def prometheus() -> Iterator[tuple[str, list[dict[str, str]]]]:
    queries: list[dict[str, str]] = []
    handler = type("Handler", (_Prometheus,), {"queries": queries})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", queries
    finally:
        server.shutdown()
        server.server_close()
        thread.join()


def test_work_and_latency_from_prometheus(
    sqlite_store: str, tmp_path: Path, prometheus: tuple[str, list[dict[str, str]]]
) -> None:
    url, queries = prometheus
    prom = ["--throughput-prom", url, "--query", "work", "--latency-query", "latency"]
    code, rep = report(sqlite_store, tmp_path / "out", *prom)
    assert code == EXIT_OK and rep is not None
    # Points every 60 s from START to END; the one at END belongs to the next minute.
    assert rep["baseline"]["work"]["total"] == pytest.approx(sum(WORK_SERIES) * SPAN_S)
    assert rep["managed"]["work"]["coverage"] == pytest.approx(1.0)
    assert "Prometheus query (2 series, step 60 s)" in rep["managed"]["work"]["source"]
    # The worst of the latency's series, not their sum.
    assert rep["baseline"]["latency"]["p95"] == pytest.approx(0.2)
    assert rep["comparison"]["latency_p95"]["delta_pct"] == pytest.approx(-25.0)
    assert {q["query"] for q in queries} == {"work", "latency"}
    assert float(queries[0]["start"]) == B0 and float(queries[0]["step"]) == 60.0
    assert (tmp_path / "out" / "pilot.html").read_text().count("data:image/png") == 6


def test_prometheus_errors_are_one_line(
    sqlite_store: str,
    tmp_path: Path,
    prometheus: tuple[str, list[dict[str, str]]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    url, _ = prometheus
    code, _ = report(sqlite_store, tmp_path, "--throughput-prom", url, "--query", "rate(x{")
    assert code == EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert "HTTP 400" in err and "parse error at char 5" in err and "\n" not in err

    closed = "http://127.0.0.1:9"  # nothing listens there
    code, _ = report(sqlite_store, tmp_path, "--throughput-prom", closed, "--query", "work")
    assert code == EXIT_FAILED
    err = capsys.readouterr().err.strip()
    assert "unreachable" in err and "\n" not in err

    code, _ = report(sqlite_store, tmp_path, "--query", "work")
    assert code == EXIT_BAD_INPUT
    assert "--throughput-prom and --query go together" in capsys.readouterr().err


def _matrix(result: object) -> dict[str, Any]:
    return {"status": "success", "data": {"resultType": "matrix", "result": result}}


@pytest.mark.parametrize(
    "body",
    [
        {"status": "success", "data": ["not", "an", "object"]},
        {"status": "success", "data": "matrix"},
        _matrix({"not": "a list"}),
        _matrix(["not a series"]),
        _matrix([{"values": "not a list"}]),
        _matrix([{"values": [[1.0]]}]),
        _matrix([{"values": [[1.0, "abc"]]}]),
        _matrix([{"values": [["yesterday", "1"]]}]),
        _matrix([{"values": [[1.0, {"a": 1}]]}]),
    ],
)
def test_a_garbage_prometheus_answer_is_a_one_line_error(body: object) -> None:
    """An answer that says success but is not a range vector of (time, number) points is the
    report's one-line error naming the server, not a traceback."""
    from powerd.pilot.source import _parse_matrix

    with pytest.raises(PilotError, match=r"--throughput-prom http://prom\.example") as err:
        _parse_matrix(body, "http://prom.example", "--query", 60.0, worst=False)
    assert "\n" not in str(err.value)


def test_non_finite_prometheus_points_are_skipped() -> None:
    """NaN and ±Inf values (Prometheus sends them as strings) and non-finite times are no
    points (series whose sum overflows are refused: test_pilot_inputs)."""
    from powerd.pilot.source import _parse_matrix

    body = _matrix([{"values": [[60.0, "NaN"], [120.0, "+Inf"], ["NaN", "5"], [180.0, "2"]]}])
    s = _parse_matrix(body, "http://prom.example", "--query", 60.0, worst=False)
    assert s.ts.tolist() == [180.0] and s.value.tolist() == [2.0]


class _Nested(BaseHTTPRequestHandler):
    """A server that answers every query with JSON nested deeper than the parser recurses."""

    def do_GET(self) -> None:
        raw = b"[" * 200_000 + b"]" * 200_000
        self.send_response(200)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *_args: Any) -> None:
        pass


def test_a_prometheus_answer_nested_too_deep_is_a_one_line_error() -> None:
    from powerd.pilot.source import PromSource

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Nested)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        window = parse_window("managed", "2026-11-02T00:00Z..2026-11-02T01:00Z")
        with pytest.raises(PilotError, match="not JSON"):
            PromSource(url, timeout_s=5.0).range("work", window)
    finally:
        server.shutdown()
        server.server_close()
        thread.join()
