"""`powerd pilot report` fed what an operator may give it: windows far wider than the data,
windows the data covers in part, outputs that cannot be written (the store as in
test_pilot)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from test_pilot import B0, BASELINE, MANAGED, SPAN_S, filled, iso

from powerd.cli import main
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from powerd.pilot.source import StoreSource
from powerd.pilot.windows import PilotError, Window

YEAR_S = 365 * 86400.0


@pytest.fixture(scope="module")
def sqlite_store(tmp_path_factory: pytest.TempPathFactory) -> str:
    return filled(f"sqlite:///{tmp_path_factory.mktemp('pilot-inputs') / 'powerd.db'}")


@pytest.mark.parametrize("groups", [True, False])
def test_a_window_of_years_reads_only_where_the_store_has_data(
    groups: bool, tmp_path: Path, sqlite_store: str
) -> None:
    # Before: one SQL round per 6 hours of the window, data or not (1,460 for a year; a
    # window of centuries never finished). `groups=False`: a store that kept ticks only.
    url = sqlite_store if groups else filled(f"sqlite:///{tmp_path / 'old.db'}", groups=False)
    lines: list[str] = []
    source = StoreSource(url, lines.append)
    try:
        wide = source.read(Window("baseline", B0 - YEAR_S, B0 + SPAN_S))
        tight = source.read(Window("baseline", B0, B0 + SPAN_S))
    finally:
        source.close()
    rounds = [ln for ln in lines if "GPU minutes" in ln or "ticks" in ln]
    assert rounds and all(" 1/1 " in ln for ln in rounds), rounds[:3]
    assert (wide.fleet.minute == tight.fleet.minute).all()
    assert [g.name for g in wide.groups] == [g.name for g in tight.groups]


def pilot_json(url: str, out: Path, baseline: str, managed: str = MANAGED) -> dict[str, Any]:
    argv = ["pilot", "report", "--db", url, "--baseline", baseline, "--managed", managed]
    assert main([*argv, "--out", str(out), "--quiet"]) == EXIT_OK
    doc: dict[str, Any] = json.loads((out / "pilot.json").read_text())
    return doc


def test_work_per_hour_is_over_the_hours_with_data(sqlite_store: str, tmp_path: Path) -> None:
    # The baseline window twice as long as its 30 recorded minutes. Before: its work per hour
    # was halved (the empty half counted as no work) and the managed window's lead doubled.
    tight = pilot_json(sqlite_store, tmp_path / "tight", BASELINE)
    wide = pilot_json(sqlite_store, tmp_path / "wide", f"{iso(B0)}..{iso(B0 + 2 * SPAN_S)}")
    t, w = tight["baseline"]["work"], wide["baseline"]["work"]
    assert w["total"] == pytest.approx(t["total"])
    assert w["hours"] == pytest.approx(SPAN_S / 3600) == t["hours"]
    assert w["per_hour"] == pytest.approx(t["per_hour"])
    assert wide["comparison"]["work_per_hour"] == pytest.approx(
        tight["comparison"]["work_per_hour"]
    )
    assert any("covers 50% of this window" in n for n in wide["baseline"]["notes"])
    assert not any("covers" in n for n in tight["baseline"]["notes"])


def test_an_out_that_cannot_be_a_folder_is_refused_before_the_store_is_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the store was read and the figures made, then mkdir failed (exit 1).
    in_the_way = tmp_path / "report"
    in_the_way.write_text("not a folder")
    missing = f"sqlite:///{tmp_path / 'none.db'}"  # never opened: the folder is checked first
    argv = ["pilot", "report", "--db", missing, "--baseline", BASELINE, "--managed", MANAGED]
    assert main([*argv, "--out", str(in_the_way / "sub"), "--quiet"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"--out {in_the_way / 'sub'}: cannot write there: a file is in the way (give a folder)"
    )
    assert in_the_way.read_text() == "not a folder"


def test_the_report_files_are_written_both_or_neither(
    sqlite_store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    pilot_json(sqlite_store, out, BASELINE)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert set(before) == {"pilot.json", "pilot.html"}

    def broken(*_: object) -> None:
        raise RuntimeError("a plot failed")

    # Before: the new pilot.json was already over the old one when the page failed.
    monkeypatch.setattr("powerd.pilot.report.write_html", broken)
    argv = ["pilot", "report", "--db", sqlite_store, "--baseline", f"{iso(B0)}..{iso(B0 + 600)}"]
    with pytest.raises(RuntimeError):
        main([*argv, "--managed", MANAGED, "--out", str(out), "--quiet"])
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def _matrix(*series: list[list[object]]) -> dict[str, Any]:
    result = [{"metric": {"i": str(i)}, "values": v} for i, v in enumerate(series)]
    return {"status": "success", "data": {"resultType": "matrix", "result": result}}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        # Before: the sum became inf, and the report printed "n/a -> n/a (+nan %)", exit 0.
        (_matrix([[60.0, "1e308"]], [[60.0, "1e308"]]), "add up to more than a float holds"),
        # Before: negative work per hour and per kWh, compared as if they were figures.
        (_matrix([[60.0, "5"], [120.0, "-5"]]), "gave -5 at 1970-01-01T00:02:00Z"),
    ],
)
def test_prometheus_values_that_are_no_throughput_are_refused(body: object, said: str) -> None:
    from powerd.pilot.source import _parse_matrix

    with pytest.raises(PilotError) as err:
        _parse_matrix(body, "http://prom.example", "--query", 60.0, worst=False)
    assert str(err.value).startswith("--throughput-prom http://prom.example: --query")
    assert said in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "url", ["prom:9090", "ftp://127.0.0.1/", "http://127.0.0.1:99999", "http:///"]
)
def test_a_prometheus_url_that_is_none_is_refused_before_the_store_is_read(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: both windows were read from the store (minutes for weeks of data), then
    # 'unreachable: unknown url type' or an FTP connection attempt, exit 1.
    from powerd.cli import build_parser

    argv = ["pilot", "report", "--baseline", BASELINE, "--managed", MANAGED, "--query", "x"]
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args([*argv, "--throughput-prom", url])
    assert exc.value.code == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        f"powerd pilot report: error: argument --throughput-prom: {url!r} is not a "
        "Prometheus server's URL: give http://HOST:PORT or https://..."
    )


def test_a_folder_in_the_way_of_one_file_leaves_the_other_untouched(
    sqlite_store: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: pilot.html (first by name) was replaced, then pilot.json, a folder, failed.
    out = tmp_path / "out"
    (out / "pilot.json").mkdir(parents=True)
    (out / "pilot.html").write_text("the old page")
    argv = ["pilot", "report", "--db", sqlite_store, "--baseline", BASELINE, "--managed", MANAGED]
    assert main([*argv, "--out", str(out), "--quiet"]) == EXIT_BAD_INPUT
    err = capsys.readouterr().err.strip()
    assert err == f"--out {out}: cannot write there: pilot.json is a folder there"
    assert (out / "pilot.html").read_text() == "the old page"
    assert sorted(p.name for p in out.iterdir()) == ["pilot.html", "pilot.json"]
