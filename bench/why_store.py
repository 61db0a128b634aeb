"""What explaining caps costs: the tick's frame, one explanation, and the `cap_reasons` rows.

    .venv/bin/python bench/why_store.py                       # 100k frame, 10k stored, SQLite
    .venv/bin/python bench/why_store.py --pg postgresql://postgres@127.0.0.1/postgres
    .venv/bin/python bench/why_store.py --frame-gpus 10000 --store-gpus 2000 --ticks 10

A synthetic fleet (powerd.testing.synthetic: 8 GPUs/node, 8 nodes/rack, 16 racks/row, every
level binding) whose demand drifts every tick, allocated by the fast solver and planned by
the safety planner, like the engine's tick. Printed:
- the frame (`why_frame`) per tick, and the fleet-wide tightest group (`tightest_groups`);
- one explanation (`explain`), what the writer's thread spends per stored cap change;
- the store: the caps that moved per tick, the rows written (cap changes + reasons) with the
  default one-a-GPU-a-minute interval and with every move stored, write time and bytes per
  `cap_reasons` row (SQLite file growth; PostgreSQL table + indexes).
Figures go in docs/storage.md ("Cap reasons").
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from powerd.allocator import ClassTable, Tree, allocate_arrays
from powerd.controller.why import (
    Decided,
    WhyFrame,
    explain,
    explain_many,
    tightest_groups,
    why_frame,
)
from powerd.safety import GpuLayout, SafetyPlanner
from powerd.testing.synthetic import Drift, make_policy, random_fleet

GPUS_PER_ROW = 8 * 8 * 16


class Ticks:
    """A drifting synthetic fleet through allocator and planner, one frame per tick."""

    def __init__(self, gpus: int, seed: int = 1) -> None:
        rows = max(1, round(gpus / GPUS_PER_ROW))
        self.policy = make_policy(rows, 16, 8, 8)
        self.fleet = random_fleet(self.policy, seed=seed)
        self.classes = ClassTable.from_policy(self.policy)
        self.tree = Tree(self.fleet.topology)
        self.drift = Drift.start(self.fleet, seed=seed)
        topo = self.fleet.topology
        self.nodes = [topo.names[g] for g in topo.gpu_groups[:, -1].tolist()]
        layout = GpuLayout.build(
            self.policy, self.fleet.uuids, self.nodes, self.fleet.min_cap_w, self.fleet.max_cap_w
        )
        self.planner = SafetyPlanner(self.policy, layout)
        self.index = {u: i for i, u in enumerate(self.fleet.uuids)}
        self.by_node: dict[str, list[int]] = {}
        for i, n in enumerate(self.nodes):
            self.by_node.setdefault(n, []).append(i)
        self._report(self.fleet.cap_w)
        self.planner.assume_settled()
        self.tick_no = 0
        self.warm: Any = None
        self.frame_ms: list[float] = []

    def _report(self, caps: np.ndarray) -> None:
        uuids = self.fleet.uuids
        values = caps.tolist()
        for node, idx in self.by_node.items():
            self.planner.learn_status(node, {uuids[i]: values[i] for i in idx})

    def step(self) -> tuple[WhyFrame, dict[str, dict[str, float]]]:
        self.tick_no += 1
        fleet = self.fleet
        budget = fleet.topology.budget_w
        alloc = allocate_arrays(
            fleet, self.policy, "fast", warm=self.warm, classes=self.classes, tree=self.tree
        )
        self.warm = alloc
        prev = self.planner.committed_w()
        plan = self.planner.plan(self.tick_no, float(self.tick_no), alloc.caps_w, record=False)
        decided = Decided(
            self.tick_no,
            1.7e9 + self.tick_no,
            alloc.status,
            "fast",
            alloc.caps_w,
            budget,
            budget,
            np.minimum(prev, fleet.max_cap_w),
            np.zeros(fleet.n, dtype=np.bool_),
            (),
            self.policy.control.slew_w,
        )
        arrays = _Arrays(self.nodes, np.zeros(fleet.n), fleet.cap_w)
        t0 = time.perf_counter()
        # The engine also builds its node → seq map each tick: timed with the frame.
        node_seq = {n: len(idx) + self.tick_no for n, idx in self.by_node.items()}
        frame = why_frame(
            decided,
            fleet=fleet,
            arrays=arrays,  # type: ignore[arg-type]
            index=self.index,
            alloc=alloc,
            plan=plan,
            planner=self.planner,
            classes=self.classes,
            drained=(),
            node_seq=node_seq,
        )
        self.frame_ms.append((time.perf_counter() - t0) * 1000.0)
        sent = plan.sent_w.tolist()
        uuids = fleet.uuids
        caps = {n: {uuids[i]: sent[i] for i in idx} for n, idx in self.by_node.items()}
        # The agents obey: next tick's telemetry reports these caps, its draw drifts.
        self._report(plan.sent_w)
        self.fleet = self.drift.tick(plan.sent_w)
        return frame, caps


class _Arrays:
    """The two FleetArrays fields a frame reads besides the GpuArrays' (nodes, sample ages)."""

    def __init__(self, nodes: list[str], age_s: np.ndarray, cap_w: np.ndarray) -> None:
        self.nodes = nodes
        self.age_s = age_s
        self.cap_w = cap_w


def bench_frame(gpus: int, ticks: int) -> None:
    sim = Ticks(gpus)
    frame = sim.step()[0]
    for _ in range(ticks):
        frame = sim.step()[0]
    t0 = time.perf_counter()
    tight = tightest_groups(frame)
    tight_ms = (time.perf_counter() - t0) * 1000.0
    pick = np.random.default_rng(0).choice(frame.targets_w.size, size=2000, replace=False)
    t0 = time.perf_counter()
    docs = explain_many(frame, pick)
    per_us = (time.perf_counter() - t0) / len(pick) * 1e6
    t0 = time.perf_counter()
    explain(frame, int(pick[0]))
    one_us = (time.perf_counter() - t0) * 1e6
    reasons: dict[str, int] = {}
    for d in docs:
        reasons[d["decided_by"][0]] = reasons.get(d["decided_by"][0], 0) + 1
    print(f"frame, {frame.targets_w.size:,} GPUs ({ticks} ticks):")
    print(
        f"  why_frame + node seq map per tick: min {min(sim.frame_ms[1:]):.2f} ms, median "
        f"{statistics.median(sim.frame_ms[1:]):.2f} ms ({frame.cuts.size:,} cuts in flight)"
    )
    print(
        f"  tightest_groups over the fleet: {tight_ms:.1f} ms ({len(set(tight.tolist()))} groups)"
    )
    print(
        f"  explain_many (2,000 GPUs, as the writer does): {per_us:.0f} us per GPU "
        f"({1e6 / per_us:,.0f} explanations/s on one core); one alone (the API): {one_us:.0f} us"
    )
    print(f"  main reasons of 2,000 GPUs: {dict(sorted(reasons.items()))}")


def _sqlite_bytes(url: str) -> int:
    return Path(url.removeprefix("sqlite:///")).stat().st_size


def bench_store(
    url: str, gpus: int, ticks: int, interval_s: float, *, reasons: bool = True
) -> dict[str, float]:
    from sqlalchemy import text

    from powerd.clock import ManualClock
    from powerd.store import Store, StoreWriter, WriterLimits, upgrade

    upgrade(url)
    store = Store(url)
    clock = ManualClock(start=0.0, wall_offset=1.7e9)
    writer = StoreWriter(
        store, limits=WriterLimits(cap_interval_s=interval_s, batch_rows=50_000), clock=clock
    )
    sim = Ticks(gpus, seed=2)
    moved, write_s = [], 0.0
    last: dict[str, float] = {}
    for _ in range(ticks):
        frame, caps = sim.step()
        flat = {u: w for c in caps.values() for u, w in c.items()}
        moved.append(sum(1 for u, w in flat.items() if abs(last.get(u, -1.0) - w) >= 0.5))
        last = flat
        writer.submit_caps(frame.tick, frame.ts, caps, frame if reasons else None)
        t0 = time.perf_counter()
        assert writer.flush()
        write_s += time.perf_counter() - t0
        clock.advance(1.0)
    with store.engine.connect() as conn:
        stored = conn.execute(text("SELECT count(*) FROM cap_reasons")).scalar_one()
        changes = conn.execute(text("SELECT count(*) FROM cap_changes")).scalar_one()
        if url.startswith("sqlite"):
            conn.exec_driver_sql("PRAGMA wal_checkpoint(TRUNCATE)")
            size = _sqlite_bytes(url)
            base = conn.execute(
                text("SELECT sum(pgsize) FROM dbstat WHERE name LIKE '%cap_reasons%'")
            ).scalar()
            size = int(base) if base is not None else size
        else:
            size = conn.execute(text("SELECT pg_total_relation_size('cap_reasons')")).scalar_one()
    store.close()
    return {
        "moved_per_tick": statistics.mean(moved[1:]),
        "reasons": stored,
        "changes": changes,
        "rows_per_s_written": (stored + changes) / write_s,
        "bytes_per_reason": size / max(stored, 1),
        "write_s": write_s,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--frame-gpus", type=int, default=100_000)
    ap.add_argument("--store-gpus", type=int, default=10_000)
    ap.add_argument("--ticks", type=int, default=20)
    ap.add_argument("--pg", help="a PostgreSQL server URL (a database is made and dropped)")
    args = ap.parse_args()
    bench_frame(args.frame_gpus, min(args.ticks, 5))
    with tempfile.TemporaryDirectory() as tmp:
        for interval, reasons in ((60.0, True), (0.0, True), (60.0, False)):
            url = f"sqlite:///{tmp}/why-{interval:g}-{reasons}.db"
            r = bench_store(url, args.store_gpus, args.ticks, interval, reasons=reasons)
            _print_store("sqlite", interval, args, r, reasons)
    if args.pg:
        import psycopg
        from sqlalchemy.engine import make_url

        for interval, reasons in ((60.0, True), (0.0, True), (60.0, False)):
            name = f"powerd_bench_why_{int(interval)}_{int(reasons)}"
            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {name}")
                conn.execute(f"CREATE DATABASE {name}")
            try:
                url = make_url(args.pg).set(database=name).render_as_string(hide_password=False)
                r = bench_store(url, args.store_gpus, args.ticks, interval, reasons=reasons)
                _print_store("postgresql", interval, args, r, reasons)
            finally:
                with psycopg.connect(args.pg, autocommit=True) as conn:
                    conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


def _print_store(
    backend: str, interval: float, args: argparse.Namespace, r: dict[str, float], reasons: bool
) -> None:
    every = "every move" if interval == 0 else f"at most one a GPU a {interval:g} s"
    if not reasons:
        every += ", cap changes only (no reasons: the baseline)"
    print(f"store, {backend}, {args.store_gpus:,} GPUs, {args.ticks} ticks of 1 s, {every}:")
    print(
        f"  caps moved {r['moved_per_tick']:,.0f} a tick; stored {r['changes']:,} cap changes "
        f"and {r['reasons']:,} reasons; written at {r['rows_per_s_written']:,.0f} rows/s "
        f"({r['write_s']:.2f} s in all)"
        + (f"; {r['bytes_per_reason']:,.0f} B a reason row" if reasons else "")
    )


if __name__ == "__main__":
    main()
