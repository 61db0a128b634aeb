"""What a pilot report costs: reading two windows of per-minute history, and what recording
the budget groups costs the controller's tick and the writer's thread.

    .venv/bin/python bench/pilot_report.py                          # 200 GPUs, 2 × 24 h, SQLite
    .venv/bin/python bench/pilot_report.py --gpus 1000 --hours 24 \\
        --pg postgresql://postgres@127.0.0.1/postgres

A store is filled through `Store.write_batch` (the writer's own path) with a baseline day
and a managed day (25 % more GPUs): per GPU and minute draw, energy, perf and committed
cap; per budget group (facility, a row per 256 GPUs, a rack per 64) its minute; a cap move
per GPU every 5 minutes in the managed window. Then `powerd.pilot.report.build` and `write`
(the command's two steps) are timed. Printed too: the tick's cost of handing its group
arrays to the writer (the copies) and the writer thread's `GroupAggregator.add`, for the
groups of a 10,000-GPU policy (1,400 with a budget). Figures go in docs/performance.md.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from powerd.pilot.report import build, write
from powerd.pilot.windows import Window
from powerd.store import Store, upgrade
from powerd.store.aggregate import GroupAggregator
from powerd.store.store import Batch

T0 = 1_793_577_600.0  # 2026-11-02T00:00Z
MINUTE_S = 60
SCRATCH = "pilot_bench"


def fill(store: Store, start: float, gpus: int, hours: float, *, moving: bool) -> int:
    rng = np.random.default_rng(int(start))
    minutes = int(hours * 60)
    uuids = [f"GPU-{i:05d}" for i in range(gpus)]
    rows = max(1, gpus // 256)
    racks = max(1, gpus // 64)
    written = 0
    for m0 in range(0, minutes, 60):  # an hour a transaction
        batch = Batch()
        for m in range(m0, min(m0 + 60, minutes)):
            minute = int(start) + m * MINUTE_S
            load = 0.6 + 0.3 * np.sin(2 * np.pi * m / 1440)
            power = np.clip(rng.normal(700 * load, 60, gpus), 100, 700)
            cap = np.full(gpus, 700.0) if not moving else np.clip(power + 80, 200, 700)
            for i, uuid in enumerate(uuids):
                batch.minutes.append(
                    {
                        "uuid": uuid,
                        "minute": minute,
                        "mean_power_w": float(power[i]),
                        "max_power_w": float(power[i]) + 20,
                        "energy_j": float(power[i]) * 60,
                        "mean_cap_w": float(cap[i]),
                        "samples": 12,
                        "mean_perf": float(power[i]) * 2.0,
                        "perf_samples": 12,
                    }
                )
            total = float(power.sum())
            groups: list[tuple[str, int, float, float]] = [("dc", 0, gpus * 560.0, total)]
            groups += [(f"row-{r}", 1, gpus * 600.0 / rows, total / rows) for r in range(rows)]
            groups += [(f"rack-{r}", 2, 64 * 640.0, total / racks) for r in range(racks)]
            for name, level, budget, draw in groups:
                batch.group_minutes.append(
                    {
                        "group": name,
                        "minute": minute,
                        "level": level,
                        "budget_w": budget,
                        "limit_w": budget,
                        "mean_committed_w": draw * 1.1,
                        "max_committed_w": draw * 1.15,
                        "mean_draw_w": draw,
                        "max_draw_w": draw * 1.05,
                        "over_s": 0.0,
                        "ticks": 12,
                    }
                )
            if moving and m % 5 == 0:
                batch.caps += [
                    {
                        "ts": float(minute),
                        "tick": m,
                        "gpu_uuid": uuid,
                        "node": "n",
                        "old_w": float(cap[i]) - 40,
                        "new_w": float(cap[i]),
                    }
                    for i, uuid in enumerate(uuids)
                ]
        store.write_batch(batch)
        written += len(batch)
    return written


def group_costs(n_groups: int = 1_400, ticks: int = 200) -> dict[str, float]:
    """µs per tick: the tick's copies of its group arrays, the writer's aggregation."""
    names = tuple(f"g{i}" for i in range(n_groups))
    levels = np.minimum(np.arange(n_groups), 3)
    budget = np.full(n_groups, 1e5)
    draw = np.full(n_groups, 9e4)
    agg = GroupAggregator()
    copies, adds = [], []
    for k in range(ticks):
        t = time.perf_counter()
        arrays = [a.copy() for a in (budget, budget, draw, draw)]
        copies.append(time.perf_counter() - t)
        t = time.perf_counter()
        agg.add(
            T0 + k,
            names=names,
            levels=levels,
            budget_w=arrays[0],
            limit_w=arrays[1],
            committed_w=arrays[2],
            draw_w=arrays[3] * (1.2 if k % 50 == 0 else 1.0),
        )
        adds.append(time.perf_counter() - t)
        if k % 60 == 59:
            agg.close()
    return {
        "tick_copies_us": statistics.median(copies) * 1e6,
        "writer_add_us": statistics.median(adds) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=200)
    parser.add_argument("--hours", type=float, default=24.0)
    parser.add_argument("--pg", help="a PostgreSQL server URL (a scratch database is made)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        url = f"sqlite:///{Path(tmp) / 'pilot.db'}"
        if args.pg:
            url = _pg_scratch(args.pg)
        upgrade(url)
        store = Store(url)
        managed_gpus = int(args.gpus * 1.25)
        t = time.perf_counter()
        rows = fill(store, T0, args.gpus, args.hours, moving=False)
        rows += fill(store, T0 + 7 * 86_400, managed_gpus, args.hours, moving=True)
        fill_s = time.perf_counter() - t
        store.close()
        span = args.hours * 3600
        baseline = Window("baseline", T0, T0 + span)
        managed = Window("managed", T0 + 7 * 86_400, T0 + 7 * 86_400 + span)
        t = time.perf_counter()
        report, windows = build(url, baseline, managed)
        read_s = time.perf_counter() - t
        t = time.perf_counter()
        out = write(report, windows, Path(tmp) / "out")
        write_s = time.perf_counter() - t
        html_kb = out.html_path.stat().st_size / 1024
    if args.pg:
        _pg(args.pg, f'DROP DATABASE "{SCRATCH}" WITH (FORCE)')
    gpu_minutes = (args.gpus + managed_gpus) * args.hours * 60
    print(f"store: {url.split('://')[0]}, {args.gpus} -> {managed_gpus} GPUs, 2 x {args.hours:g} h")
    print(f"  rows written: {rows:,} in {fill_s:.1f} s")
    print(
        f"  report: read {read_s:.2f} s ({gpu_minutes / read_s:,.0f} GPU-minutes/s), "
        f"plots and files {write_s:.2f} s, page {html_kb:,.0f} KiB"
    )
    costs = group_costs()
    print(
        f"  groups (1,400 with a budget): tick copies {costs['tick_copies_us']:.1f} µs, "
        f"writer add {costs['writer_add_us']:.1f} µs per tick"
    )


def _pg(server: str, sql: str) -> None:
    from sqlalchemy import create_engine, text

    from powerd.store.db import normalize_url

    engine = create_engine(normalize_url(server), isolation_level="AUTOCOMMIT")
    with engine.connect() as conn:
        conn.execute(text(sql))
    engine.dispose()


def _pg_scratch(server: str) -> str:
    from powerd.store.db import normalize_url

    _pg(server, f'CREATE DATABASE "{SCRATCH}"')
    return normalize_url(server).set(database=SCRATCH).render_as_string(hide_password=False)


if __name__ == "__main__":
    main()
