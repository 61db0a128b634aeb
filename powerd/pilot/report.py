"""`powerd pilot report`: read both windows, compute the figures, write the files."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from powerd.outputs import staged
from powerd.pilot.figures import compare, window_figures
from powerd.pilot.render import summary, write_html, write_json
from powerd.pilot.source import Progress, PromSource, StoreSource, WindowData
from powerd.pilot.windows import PilotError, Window, check_windows


@dataclass(frozen=True)
class PromQuery:
    url: str
    query: str  # work per second, summed over its series
    latency_query: str | None = None


@dataclass(frozen=True)
class Written:
    report: dict[str, Any]
    json_path: Path
    html_path: Path
    text: str


def build(
    db: str,
    baseline: Window,
    managed: Window,
    *,
    prom: PromQuery | None = None,
    progress: Progress | None = None,
    baseline_db: str | None = None,
) -> tuple[dict[str, Any], dict[str, WindowData]]:
    """Both windows' data and the report's figures. `baseline_db`: where the baseline was
    recorded, when not in `db` (a shadow's `record_db`)."""
    check_windows(baseline, managed)
    windows: dict[str, WindowData] = {}
    for window, url in ((baseline, baseline_db or db), (managed, db)):
        source = StoreSource(url, progress, flag="--baseline-db" if url != db else "--db")
        try:
            windows[window.name] = source.read(window)
        finally:
            source.close()
    if prom is not None:
        client = PromSource(prom.url)
        for data in windows.values():
            if progress is not None:
                progress(f"{data.window.name}: Prometheus range query")
            data.throughput = client.range(prom.query, data.window)
            if data.throughput.value.size == 0:
                raise PilotError(
                    f"--query: Prometheus returned no points in --{data.window.name} "
                    f"{data.window.label()}"
                )
            if prom.latency_query:
                data.latency = client.range(
                    prom.latency_query, data.window, "--latency-query", worst=True
                )
    figs = {name: window_figures(data) for name, data in windows.items()}
    report = {
        "db": db,
        "baseline_db": baseline_db or db,
        "baseline": figs["baseline"],
        "managed": figs["managed"],
        "comparison": compare(figs["baseline"], figs["managed"]),
    }
    return report, windows


def write(
    report: dict[str, Any], windows: dict[str, WindowData], out: Path, title: str = "powerd pilot"
) -> Written:
    """pilot.json and pilot.html into `out`, both or neither (OutputError if it cannot take
    them)."""
    with staged(out) as stage:
        write_json(report, stage / "pilot.json")
        write_html(report, windows, stage / "pilot.html", title)
    return Written(report, out / "pilot.json", out / "pilot.html", summary(report))
