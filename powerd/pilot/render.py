"""The pilot report as files and text: `pilot.json` (every figure), `pilot.html` (one
self-contained page, its plots embedded as base64 PNG) and a short summary for stdout."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from powerd.pilot.figures import throughput_series
from powerd.pilot.source import WindowData

COLORS = {"baseline": "#777777", "managed": "#1f77b4"}


def write_json(report: dict[str, Any], path: Path) -> None:
    path.write_text(json.dumps(_clean(report), indent=2, allow_nan=False) + "\n")


def summary(report: dict[str, Any]) -> str:
    b, m, c = report["baseline"], report["managed"], report["comparison"]
    lines = [f"pilot report: baseline {_span(b)} vs managed {_span(m)}"]
    env = c["envelope_w"]
    lines.append(
        f"  envelope: baseline {_kw(env['baseline'])}, managed {_kw(env['managed'])}"
        + {
            True: "",
            False: "  (NOT the same envelope: the comparison is not like for like)",
            None: "  (not known: no facility budget stored in a window)",
        }[env["same"]]
    )
    g = c["gpus_mean"]
    lines.append(
        f"  GPUs (mean): {g['baseline']:.1f} -> {g['managed']:.1f} ({_signed(g['delta_pct'])})"
    )
    for key, label in (
        ("work_per_hour", "work per hour"),
        ("work_per_gpu_hour", "work per GPU-hour"),
        ("work_per_kwh", "work per GPU kWh"),
    ):
        d = c[key]
        lines.append(
            f"  {label}: {_num(d['baseline'])} -> {_num(d['managed'])} ({_signed(d['delta_pct'])})"
        )
    if "latency_p95" in c:
        d = c["latency_p95"]
        lines.append(
            f"  latency p95: {_num(d['baseline'])} -> {_num(d['managed'])} "
            f"({_signed(d['delta_pct'])})"
        )
    share = c["peak_draw_share_of_envelope"]
    lines.append(f"  peak draw / envelope: {_pct(share['baseline'])} -> {_pct(share['managed'])}")
    for name in ("baseline", "managed"):
        comp = c["compliance"][name]
        lines.append(
            f"  {name}: {_dur(comp['time_over_s'])} over a budget, {comp['excursions']} "
            f"excursion(s), worst {comp['worst_excess_w']:,.0f} W over"
        )
    for name, fig in (("baseline", b), ("managed", m)):
        for note in fig["notes"]:
            lines.append(f"  note ({name}): {note}")
    return "\n".join(lines)


def write_html(
    report: dict[str, Any], windows: dict[str, WindowData], path: Path, title: str
) -> None:
    plots = [
        ("Facility draw against its budget", _plot_power(windows)),
        ("Work delivered per second", _plot_throughput(windows)),
        ("GPUs reporting", _plot_gpus(windows)),
        ("Committed caps and measured draw per budget group (means)", _plot_groups(report)),
        ("Committed caps: how GPU-minutes spread", _plot_caps(report)),
    ]
    latency = _plot_latency(windows)
    if latency is not None:
        plots.append(("Latency", latency))
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:auto;padding:1em}"
        "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;"
        "padding:3px 8px;text-align:right}th{background:#f4f4f4}td:first-child,"
        "th:first-child{text-align:left}.bad{color:#b00;font-weight:bold}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<pre>{html.escape(summary(report))}</pre>",
        "<h2>Per window</h2>",
        _window_table(report),
    ]
    for name in ("baseline", "managed"):
        parts.append(f"<h2>Budgets, {name} ({html.escape(_span(report[name]))})</h2>")
        parts.append(_budget_table(report[name]))
    for caption, png in plots:
        parts.append(f"<h2>{html.escape(caption)}</h2>")
        parts.append(f"<img alt='{html.escape(caption)}' src='data:image/png;base64,{png}'>")
    parts.append(
        "<p>Every figure is in the JSON file beside this page. Work is the throughput source's "
        "unit times seconds; energy is the GPUs' own (their energy counters).</p>"
    )
    parts.append("</body></html>")
    path.write_text("\n".join(parts))


# ---- tables ----


def _window_table(report: dict[str, Any]) -> str:
    rows: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("hours", lambda f: f"{f['window']['hours']:.2f}"),
        ("minutes with data", lambda f: f"{f['minutes_with_data']:,}"),
        ("GPUs mean / p95 / max", lambda f: _triple(f["gpus"], "{:.1f}")),
        (
            "power mean / p95 / max",
            lambda f: " / ".join(_kw(f["power"][k]) for k in ("mean_w", "p95_w", "max_w")),
        ),
        ("GPU energy", lambda f: f"{f['gpu_energy_kwh']:,.1f} kWh"),
        ("work", lambda f: _num(f["work"]["total"])),
        ("work per hour", lambda f: _num(f["work"]["per_hour"])),
        ("work per GPU", lambda f: _num(f["work"]["per_gpu"])),
        ("work per GPU kWh", lambda f: _num(f["work"]["per_kwh"])),
        ("throughput coverage", lambda f: _pct(f["work"]["coverage"])),
        (
            "latency mean / p95 / max",
            lambda f: "n/a" if not f["latency"] else _triple(f["latency"], "{:.4g}"),
        ),
        ("cap p5 / median / p95", lambda f: _cap_triple(f["caps"])),
        ("cap moves (stored)", lambda f: f"{f['caps']['moves']:,}"),
        ("moves per GPU-hour", lambda f: _num(f["caps"]["moves_per_gpu_hour"])),
        (
            "move median / p95",
            lambda f: _w(f["caps"]["move_median_w"]) + " / " + _w(f["caps"]["move_p95_w"]),
        ),
    ]
    out = ["<table><tr><th></th><th>baseline</th><th>managed</th></tr>"]
    for label, cell in rows:
        out.append(
            f"<tr><td>{html.escape(label)}</td><td>{html.escape(cell(report['baseline']))}</td>"
            f"<td>{html.escape(cell(report['managed']))}</td></tr>"
        )
    out.append("</table>")
    out.append(f"<p>Work source: {html.escape(report['managed']['work']['source'])}.</p>")
    return "\n".join(out)


def _budget_table(fig: dict[str, Any]) -> str:
    head = (
        "<table><tr><th>group</th><th>budget</th><th>max draw</th><th>of budget</th>"
        "<th>time over</th><th>excursions</th><th>largest: over by</th><th>for</th>"
        "<th>from</th><th>committed (mean)</th><th>draw (mean)</th></tr>"
    )
    out = [head]
    for b in fig["budgets"]:
        big = b["largest"]
        bad = " class='bad'" if b["time_over_s"] > 0 else ""
        out.append(
            "<tr>"
            f"<td>{html.escape(b['group'])}</td><td>{_kw(b['budget_w'])}</td>"
            f"<td>{_kw(b['max_draw_w'])}</td><td>{_pct(b['max_draw_pct'])}</td>"
            f"<td{bad}>{_dur(b['time_over_s'])}</td><td>{b['excursions']}</td>"
            f"<td>{'' if big is None else _kw(big['peak_excess_w'])}</td>"
            f"<td>{'' if big is None else _dur(big['duration_s'])}</td>"
            f"<td>{'' if big is None else html.escape(big['start'])}</td>"
            f"<td>{_kw(b['mean_committed_w'])}</td><td>{_kw(b['mean_draw_w'])}</td></tr>"
        )
    out.append("</table>")
    if not fig["budgets"]:
        return "<p>No budget groups stored in this window.</p>"
    return "\n".join(out)


# ---- plots ----


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> str:
    plt = _pyplot()
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _axis(windows: dict[str, WindowData]) -> tuple[float, str]:
    """(seconds a unit, the x axis' label): hours, or minutes when a window is under 3 h."""
    if any(d.window.hours < 3 for d in windows.values()):
        return 60.0, "minutes into the window"
    return 3600.0, "hours into the window"


def _into(ts: np.ndarray[Any, Any], data: WindowData, unit_s: float) -> np.ndarray[Any, Any]:
    return (ts - data.window.start) / unit_s


def _plot_power(windows: dict[str, WindowData]) -> str:
    plt = _pyplot()
    unit_s, label = _axis(windows)
    fig, ax = plt.subplots(figsize=(10, 4))
    for name, data in windows.items():
        root = next((g for g in data.groups if g.level == 0), None)
        if root is None:
            t, y = data.fleet.minute.astype(np.float64), data.fleet.gpu_power_w
            ax.plot(
                _into(t, data, unit_s), y / 1000, color=COLORS[name], lw=1, label=f"{name} GPUs"
            )
            continue
        t = _into(root.minute.astype(np.float64), data, unit_s)
        ax.plot(t, root.mean_draw_w / 1000, color=COLORS[name], lw=1, label=f"{name} mean")
        ax.plot(t, root.max_draw_w / 1000, color=COLORS[name], lw=0.5, ls=":", label=f"{name} max")
        ax.plot(
            t,
            root.budget_w / 1000,
            color="red" if name == "managed" else "salmon",
            ls="--",
            lw=1,
            label=f"{name} budget",
        )
    ax.set_xlabel(label)
    ax.set_ylabel("kW")
    ax.legend(fontsize=8, ncol=3)
    return _png(fig)


def _plot_throughput(windows: dict[str, WindowData]) -> str:
    plt = _pyplot()
    unit_s, label = _axis(windows)
    fig, ax = plt.subplots(figsize=(10, 3.5))
    for name, data in windows.items():
        t, y = throughput_series(data)
        ax.plot(_into(t, data, unit_s), y, color=COLORS[name], lw=1, label=name)
    ax.set_xlabel(label)
    ax.set_ylabel("work per second")
    ax.legend(fontsize=8)
    return _png(fig)


def _plot_gpus(windows: dict[str, WindowData]) -> str:
    plt = _pyplot()
    unit_s, label = _axis(windows)
    fig, ax = plt.subplots(figsize=(10, 2.8))
    for name, data in windows.items():
        t = _into(data.fleet.minute.astype(np.float64), data, unit_s)
        ax.step(t, data.fleet.gpus, color=COLORS[name], lw=1, label=name, where="post")
    ax.set_xlabel(label)
    ax.set_ylabel("GPUs")
    ax.legend(fontsize=8)
    return _png(fig)


def _plot_groups(report: dict[str, Any]) -> str:
    plt = _pyplot()
    names = sorted(
        {
            b["group"]
            for f in (report["baseline"], report["managed"])
            for b in f["budgets"]
            if b["level"] <= 1
        }
    )[:24]
    fig, ax = plt.subplots(figsize=(10, 3.8))
    x = np.arange(len(names))
    width = 0.2
    for k, win in enumerate(("baseline", "managed")):
        by = {b["group"]: b for b in report[win]["budgets"]}
        committed = [by[n]["mean_committed_w"] / 1000 if n in by else 0.0 for n in names]
        draw = [by[n]["mean_draw_w"] / 1000 if n in by else 0.0 for n in names]
        budget = [(by[n]["budget_w"] or 0.0) / 1000 if n in by else 0.0 for n in names]
        base = x + (2 * k - 1.5) * width
        ax.bar(base, committed, width, color=COLORS[win], alpha=0.45, label=f"{win} committed")
        ax.bar(base + width, draw, width, color=COLORS[win], label=f"{win} draw")
        ax.scatter(base + width / 2, budget, marker="_", s=200, color="red")
    ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("kW (red: budget)")
    ax.legend(fontsize=8, ncol=4)
    return _png(fig)


def _plot_caps(report: dict[str, Any]) -> str:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for win in ("baseline", "managed"):
        caps = report[win]["caps"]
        dist = caps["distribution"]
        total = sum(dist.values()) or 1
        lows = [float(k) for k in dist]
        ax.bar(
            [lo + caps["bin_w"] / 2 for lo in lows],
            [100 * n / total for n in dist.values()],
            width=caps["bin_w"] * 0.9,
            color=COLORS[win],
            alpha=0.6,
            label=win,
        )
    ax.set_xlabel("mean committed cap over a GPU-minute, W")
    ax.set_ylabel("% of GPU-minutes")
    ax.legend(fontsize=8)
    return _png(fig)


def _plot_latency(windows: dict[str, WindowData]) -> str | None:
    if not any(d.latency is not None for d in windows.values()):
        return None
    plt = _pyplot()
    unit_s, label = _axis(windows)
    fig, ax = plt.subplots(figsize=(10, 3.2))
    for name, data in windows.items():
        s = data.latency
        if s is None:
            continue
        inside = (s.ts >= data.window.start) & (s.ts < data.window.end)
        ax.plot(
            _into(s.ts[inside], data, unit_s), s.value[inside], color=COLORS[name], lw=1, label=name
        )
    ax.set_xlabel(label)
    ax.set_ylabel("latency (the query's unit)")
    ax.legend(fontsize=8)
    return _png(fig)


# ---- formatting ----


def _clean(x: Any) -> Any:
    """JSON has no NaN: unknown figures are null."""
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_clean(v) for v in x]
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def _span(fig: dict[str, Any]) -> str:
    return f"{fig['window']['start']}..{fig['window']['end']}"


def _kw(w: float | None) -> str:
    return "n/a" if w is None or not math.isfinite(w) else f"{w / 1000:,.1f} kW"


def _w(w: float | None) -> str:
    return "n/a" if w is None else f"{w:,.0f} W"


def _pct(x: float | None) -> str:
    return "n/a" if x is None or not math.isfinite(x) else f"{100 * x:.1f} %"


def _signed(p: float | None) -> str:
    return "n/a" if p is None else f"{p:+.1f} %"


def _num(x: float | None) -> str:
    if x is None or not math.isfinite(x):
        return "n/a"
    return f"{x:,.4g}" if abs(x) < 1000 else f"{x:,.0f}"


def _dur(s: float) -> str:
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def _triple(stats: dict[str, Any], fmt: str) -> str:
    return " / ".join(fmt.format(stats[k]) for k in ("mean", "p95", "max"))


def _cap_triple(caps: dict[str, Any]) -> str:
    return " / ".join(_w(caps[k]) for k in ("p5_w", "median_w", "p95_w"))
