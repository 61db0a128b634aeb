"""The pilot report's figures, from what `source` read: one dict per window and the
comparison, plain JSON values (the JSON file is these dicts as they are)."""

from __future__ import annotations

import math
from datetime import UTC, datetime
from typing import Any

import numpy as np

from powerd.pilot.source import MINUTE_S, Series, WindowData

J_PER_KWH = 3.6e6
SAME_ENVELOPE_TOL = 0.005  # facility budgets within 0.5 % are the same envelope
COVERED_WARN = 0.99  # a window its work source covers less than this says so


def throughput_series(data: WindowData) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """(epoch seconds, work per second) over the window, from the source in use."""
    if data.throughput is None:
        return data.fleet.minute.astype(np.float64), data.fleet.work / MINUTE_S
    s, w = data.throughput, data.window
    inside = (s.ts >= w.start) & (s.ts < w.end)
    return s.ts[inside], s.value[inside]


def window_figures(data: WindowData) -> dict[str, Any]:
    w, fleet = data.window, data.fleet
    energy_kwh = float(fleet.energy_j.sum()) / J_PER_KWH
    gpus_mean = float(fleet.gpus.mean())
    work = _work(data)
    out: dict[str, Any] = {
        "window": {"start": _iso(w.start), "end": _iso(w.end), "hours": round(w.hours, 4)},
        "minutes_with_data": int(fleet.minute.size),
        "gpus": _stats(fleet.gpus.astype(np.float64)),
        "power": _power(data),
        "gpu_energy_kwh": energy_kwh,
        "work": {
            **work,
            "per_gpu": work["total"] / gpus_mean if gpus_mean else None,
            "per_kwh": work["total"] / energy_kwh if energy_kwh > 0 else None,
        },
        "latency": None if data.latency is None else _latency(data.latency, w.start, w.end),
        "budgets": [_budget(data, i) for i in range(len(data.groups))],
        "caps": _caps(data),
        "notes": list(data.notes),
    }
    covered = min(work["hours"] / w.hours, 1.0) if w.hours > 0 else 0.0
    if covered < COVERED_WARN:
        out["notes"].append(
            f"the work source covers {covered:.0%} of this window "
            f"({work['hours']:,.1f} of {w.hours:,.1f} h): rates are over the hours it covers; "
            "choose windows the recording covers"
        )
    if data.throughput is None and not data.fleet.perf_gpus.any():
        out["notes"].append(
            "no GPU reported perf in this window: its work is unknown, not 0 "
            "(agents' --perf-url/--perf-file, or --throughput-prom)"
        )
    return out


def compare(baseline: dict[str, Any], managed: dict[str, Any]) -> dict[str, Any]:
    """Managed against baseline: more GPUs in the same envelope, work, compliance."""
    b_env, m_env = _envelope(baseline), _envelope(managed)
    same = (
        None  # not known: a window without a facility budget stored
        if b_env is None or m_env is None
        else abs(m_env - b_env) <= SAME_ENVELOPE_TOL * max(b_env, m_env)
    )
    b_gpus, m_gpus = baseline["gpus"]["mean"], managed["gpus"]["mean"]
    out = {
        "gpus_mean": {
            "baseline": b_gpus,
            "managed": m_gpus,
            "delta": m_gpus - b_gpus,
            "delta_pct": _pct(m_gpus, b_gpus),
        },
        "envelope_w": {"baseline": b_env, "managed": m_env, "same": same},
        "peak_draw_share_of_envelope": {
            "baseline": _share(baseline["power"]["max_w"], b_env),
            "managed": _share(managed["power"]["max_w"], m_env),
        },
        "work_per_hour": _delta(baseline["work"]["per_hour"], managed["work"]["per_hour"]),
        "work_per_gpu_hour": _delta(
            _per(baseline["work"]["per_hour"], b_gpus), _per(managed["work"]["per_hour"], m_gpus)
        ),
        "work_per_kwh": _delta(baseline["work"]["per_kwh"], managed["work"]["per_kwh"]),
        "compliance": {
            name: {
                "time_over_s": sum(b["time_over_s"] for b in fig["budgets"]),
                "excursions": sum(b["excursions"] for b in fig["budgets"]),
                "worst_excess_w": max(
                    (b["largest"]["peak_excess_w"] for b in fig["budgets"] if b["largest"]),
                    default=0.0,
                ),
            }
            for name, fig in (("baseline", baseline), ("managed", managed))
        },
    }
    if baseline["latency"] and managed["latency"]:
        out["latency_p95"] = _delta(baseline["latency"]["p95"], managed["latency"]["p95"])
    return out


# ---- pieces ----


def _work(data: WindowData) -> dict[str, Any]:
    w = data.window
    if data.throughput is None:
        total = float(data.fleet.work.sum())
        reporting = data.fleet.perf_gpus.astype(np.float64)
        coverage = float((reporting / np.maximum(data.fleet.gpus, 1)).mean())
        source = "agents' reported perf (gpu_minutes.mean_perf)"
        rate = data.fleet.work / MINUTE_S
        hours = data.fleet.minute.size * MINUTE_S / 3600.0
    else:
        s = data.throughput
        inside = (s.ts >= w.start) & (s.ts < w.end)
        total = float(s.value[inside].sum() * s.step_s)
        coverage = float(inside.sum() * s.step_s / max(w.end - w.start, 1.0))
        source = f"Prometheus query ({s.series} series, step {s.step_s:g} s)"
        rate = s.value[inside]
        hours = float(inside.sum()) * s.step_s / 3600.0
    # The rate over the hours the source has, not the window's: a window the recording
    # covers in half would otherwise halve its work per hour (and double the other's lead).
    return {
        "source": source,
        "total": total,
        "hours": hours,
        "per_hour": total / hours if hours > 0 else None,
        "coverage": coverage,  # perf: GPUs that reported; Prometheus: time with points
        "rate": _stats(rate) if rate.size else None,
    }


def _power(data: WindowData) -> dict[str, Any]:
    root = next((g for g in data.groups if g.level == 0), None)
    if root is not None:
        stats = _stats(root.mean_draw_w)
        return {
            "source": f"facility {root.name}: measured GPU draw + overhead",
            "mean_w": stats["mean"],
            "p95_w": stats["p95"],
            "max_w": float(root.max_draw_w.max()),
        }
    stats = _stats(data.fleet.gpu_power_w)
    return {
        "source": "GPU draw (no facility group stored)",
        "mean_w": stats["mean"],
        "p95_w": stats["p95"],
        "max_w": stats["max"],
    }


def _budget(data: WindowData, i: int) -> dict[str, Any]:
    g = data.groups[i]
    w = data.window
    budgets = g.budget_w[np.isfinite(g.budget_w)]
    budget = float(budgets.min()) if budgets.size else None
    runs = [e for e in data.excursions if e.group == g.name]
    largest = max(runs, key=lambda e: (e.peak_excess_w, e.duration_s), default=None)
    max_draw = float(g.max_draw_w.max())
    committed = float(g.mean_committed_w.mean())
    draw = float(g.mean_draw_w.mean())
    return {
        "group": g.name,
        "level": g.level,
        "budget_w": budget,
        "max_draw_w": max_draw,
        "max_draw_pct": _share(max_draw, budget),
        "time_over_s": float(g.over_s.sum()),
        "excursions": len(runs),
        "longest_s": max((e.duration_s for e in runs), default=0.0),
        "largest": None
        if largest is None
        else {
            "start": _iso(largest.start_ts),
            "duration_s": largest.duration_s,
            "peak_excess_w": largest.peak_excess_w,
            "peak_draw_w": largest.peak_draw_w,
            "budget_w": largest.budget_w,
            "clipped": largest.start_ts < w.start or largest.end_ts > w.end,
        },
        "mean_committed_w": committed,
        "mean_draw_w": draw,
        "draw_share_of_committed": _share(draw, committed),
    }


def _caps(data: WindowData) -> dict[str, Any]:
    caps = data.caps
    hours = data.window.hours
    gpus = float(data.fleet.gpus.mean())
    return {
        "bin_w": 25.0,
        "distribution": {f"{k:g}": n for k, n in sorted(caps.cap_bins.items())},
        "p5_w": _hist_pct(caps.cap_bins, 5, 25.0),
        "median_w": _hist_pct(caps.cap_bins, 50, 25.0),
        "p95_w": _hist_pct(caps.cap_bins, 95, 25.0),
        "mean_committed_w": float(data.fleet.committed_w.sum() / max(data.fleet.gpus.sum(), 1)),
        "moves": caps.moves,
        "gpus_moved": caps.gpus_moved,
        "moves_per_gpu_hour": caps.moves / (gpus * hours) if gpus and hours else None,
        "move_median_w": _hist_pct(caps.move_bins, 50, 5.0),
        "move_p95_w": _hist_pct(caps.move_bins, 95, 5.0),
        "note": "moves as stored: at most one a GPU a minute (cap_interval_s, docs/storage.md)",
    }


def _latency(s: Series, start: float, end: float) -> dict[str, Any] | None:
    inside = (s.ts >= start) & (s.ts < end)
    if not inside.any():
        return None
    stats = _stats(s.value[inside])
    return {**stats, "series": s.series}


def _stats(x: np.ndarray[Any, Any]) -> dict[str, float]:
    if x.size == 0:
        return {"mean": math.nan, "p95": math.nan, "max": math.nan}
    return {
        "mean": float(x.mean()),
        "p95": float(np.percentile(x, 95)),
        "max": float(x.max()),
    }


def _hist_pct(bins: dict[float, int], pct: float, width: float) -> float | None:
    """The percentile of a histogram, at the middle of its bin."""
    total = sum(bins.values())
    if not total:
        return None
    need = total * pct / 100.0
    seen = 0
    for lo in sorted(bins):
        seen += bins[lo]
        if seen >= need:
            return lo + width / 2
    return max(bins) + width / 2


def _envelope(fig: dict[str, Any]) -> float | None:
    root = next((b for b in fig["budgets"] if b["level"] == 0), None)
    return None if root is None else root["budget_w"]


def _delta(before: float | None, after: float | None) -> dict[str, Any]:
    return {"baseline": before, "managed": after, "delta_pct": _pct(after, before)}


def _pct(after: float | None, before: float | None) -> float | None:
    if after is None or before is None or not before:
        return None
    return (after - before) / before * 100.0


def _per(x: float | None, n: float) -> float | None:
    return None if x is None or not n else x / n


def _share(x: float | None, of: float | None) -> float | None:
    return None if x is None or not of else x / of


def _iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, UTC).isoformat(timespec="seconds")
