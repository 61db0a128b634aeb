"""What the store keeps for a pilot report (migration 0008): each budget group's minutes and
its excursions above budget, the workload's reported perf per GPU and minute, recorded by
the controller through its writer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from sqlalchemy import func, select
from support.clock import SteppedClock
from test_controller import TICK, Site, site_policy

from powerd.cli import main
from powerd.cli.exits import EXIT_BAD_INPUT
from powerd.clock import ManualClock
from powerd.controller.build import ControllerOptions, build_controller
from powerd.policy import parse_policy
from powerd.store import Store, StoreWriter, upgrade
from powerd.store.aggregate import GroupAggregator, MinuteAggregator
from powerd.store.tables import BudgetExcursion, CapChange, GpuMinute, GroupMinute, Tick

T0 = 1_700_000_040.0  # a minute's start
NAMES = ("dc", "row", "rack", "node")
LEVELS = np.array([0, 1, 2, 3])


def groups(dc_draw: float, budget: float = 1000.0) -> dict[str, Any]:
    """One tick's groups: the rack has no budget and is not kept; the node has one and is."""
    return {
        "names": NAMES,
        "levels": LEVELS,
        "budget_w": np.array([budget, np.inf, np.inf, 500.0]),
        "limit_w": np.array([budget, np.inf, np.inf, 500.0]),
        "committed_w": np.array([900.0, 900.0, 900.0, 450.0]),
        "draw_w": np.array([dc_draw, dc_draw, dc_draw, 400.0]),
    }


def writer_at_t0(store: Store) -> StoreWriter:
    # A clock at T0: its prune keeps what the test writes.
    return StoreWriter(store, clock=ManualClock(start=0.0, wall_offset=T0))


def tick(agg: GroupAggregator, ts: float, dc_draw: float) -> None:
    agg.add(ts, **groups(dc_draw))


def test_an_excursion_across_a_minute_is_one_run_and_its_seconds_split() -> None:
    agg = GroupAggregator()
    for ts, draw in [(50, 800), (55, 1100), (60, 1300), (65, 1050), (70, 900), (75, 900)]:
        tick(agg, T0 + ts, draw)
    rows, runs = agg.close()
    # Minute 0 is over (a tick at or past its end is in); minute 1 is still open.
    assert {r["group"] for r in rows} == {"dc", "row", "node"}  # not the unbudgeted rack
    dc = next(r for r in rows if r["group"] == "dc")
    assert dc["minute"] == int(T0) and dc["ticks"] == 2
    assert dc["over_s"] == pytest.approx(5.0)  # 55 s, until the tick at 60
    assert dc["max_draw_w"] == 1100 and dc["budget_w"] == 1000
    assert next(r for r in rows if r["group"] == "row")["budget_w"] is None
    assert runs == [
        {
            "group": "dc",
            "level": 0,
            "start_ts": T0 + 55,
            "end_ts": T0 + 70,  # the first tick back within the budget
            "peak_draw_w": 1300.0,
            "peak_excess_w": 300.0,
            "budget_w": 1000.0,
        }
    ]
    rows, runs = agg.close(final=True)
    dc = next(r for r in rows if r["group"] == "dc")
    assert dc["over_s"] == pytest.approx(10.0) and dc["ticks"] == 4
    assert runs == []


def test_a_run_under_way_at_a_stop_ends_at_its_last_tick() -> None:
    agg = GroupAggregator()
    tick(agg, T0, 1200)
    tick(agg, T0 + 5, 1400)
    _, runs = agg.close(final=True)
    assert [(r["start_ts"], r["end_ts"], r["peak_excess_w"]) for r in runs] == [(T0, T0 + 5, 400.0)]


def test_group_minutes_and_perf_merge_when_a_minute_is_written_twice(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    store = Store(url)
    # A controller stops mid-minute (its last write closes the minute) and starts again.
    for part, (draws, perf) in enumerate([((800, 1100), 10.0), ((1200, 900), None)]):
        writer = writer_at_t0(store)
        for k, draw in enumerate(draws):
            ts = T0 + 20 * part + 5 * k
            writer.submit_groups(ts, **groups(draw))
            writer.submit_samples(
                ["GPU-a"],
                ts,
                [300.0],
                [400.0],
                [1000.0 * (k + 1)],
                perf=None if perf is None else [perf + k],
            )
        writer.stop()
    with store.engine.connect() as conn:
        dc = conn.execute(select(GroupMinute).where(GroupMinute.group == "dc")).one()
        runs = conn.execute(select(BudgetExcursion)).all()
        gpu = conn.execute(select(GpuMinute)).one()
    assert dc.ticks == 4 and dc.max_draw_w == 1200
    assert dc.mean_draw_w == pytest.approx((800 + 1100 + 1200 + 900) / 4)
    # 1100 W at +5 s: its writer stopped before another tick, so for no time known; 1200 W
    # at +20 s until +25 s.
    assert dc.over_s == pytest.approx(5.0)
    assert [(r.start_ts, r.end_ts) for r in runs] == [(T0 + 5, T0 + 5), (T0 + 20, T0 + 25)]
    # Perf: the first part's two samples (10, 11), none in the second.
    assert (gpu.samples, gpu.perf_samples) == (4, 2)
    assert gpu.mean_perf == pytest.approx(10.5)
    store.close()


def test_perf_is_the_mean_of_the_samples_that_carry_one() -> None:
    agg = MinuteAggregator()
    for k, perf in enumerate([100.0, np.nan, 200.0]):
        agg.add(["GPU-a"], T0 + k, [300.0], [400.0], [float(k)], perf=[perf])
    [row] = agg.close(final=True)
    assert (row["mean_perf"], row["perf_samples"], row["samples"]) == (150.0, 2, 3)


def test_prune_drops_old_group_minutes_and_excursions(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    store = Store(url)
    writer = writer_at_t0(store)
    writer.submit_groups(T0, **groups(1200))
    writer.submit_groups(T0 + 5, **groups(900))
    writer.flush(final=True)
    pruned = store.prune(T0 + 2 * 86_400, keep_minutes_days=1, keep_ticks_days=1)
    assert (pruned.group_minutes, pruned.excursions) == (3, 1)
    store.close()


async def test_the_controller_records_groups_and_perf(
    stepped_clock: SteppedClock, tmp_path: Path
) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    policy = parse_policy(site_policy(), "site.yaml")
    site = Site(policy, stepped_clock, Store(url))
    await site.settle()
    try:
        site.start_controller()
        await site.step(8 * TICK)
    finally:
        await site.close()  # stops the writer: every open minute is written
    reports = [r for r in site.reports if r.status != "tick_failed"]
    store = Store(url)
    with store.engine.connect() as conn:
        rows = conn.execute(select(GroupMinute)).all()
        perf = conn.execute(select(GpuMinute.mean_perf, GpuMinute.perf_samples)).all()
    store.close()
    # Every budgeted group, and the row (level 1) without a budget.
    budgeted = {g.name for g in policy.groups if g.budget_w != float("inf")}
    assert {r.group for r in rows} == budgeted | {"row"}
    dc = [r for r in rows if r.group == "dc"]  # one or two minutes
    # One row's tick per instant: a tick on acks (control.ack_ticks) at the same instant as
    # the one before it (the stepped clock's) is a repeat to the aggregator.
    assert sum(r.ticks for r in dc) == len({r.ts for r in reports})
    assert {r.budget_w for r in dc} == {8000.0}
    draws = [float(r.group_draw_w[0]) for r in reports]
    assert max(r.max_draw_w for r in dc) == pytest.approx(max(draws))
    # The simulated GPUs report their throughput as perf.
    assert perf and all(n > 0 and p is not None and p > 0 for p, n in perf)


async def test_a_shadow_records_what_the_fleet_did_into_its_own_database(
    stepped_clock: SteppedClock, tmp_path: Path
) -> None:
    """A pilot's baseline under a shadow (`record_db`): the caps the agents report in force
    and the measured draw, nothing of what the shadow decided (it sent nothing)."""
    url = f"sqlite:///{tmp_path / 'recorded.db'}"
    upgrade(url)
    policy = parse_policy(site_policy(), "site.yaml")
    site = Site(policy, stepped_clock, Store(url))
    await site.settle()
    assert site.writer is not None
    try:
        site.writer.start()
        site.writer_started = True
        shadow = build_controller(
            policy,
            site.broker.client("shadow"),
            stepped_clock,
            ControllerOptions(controller_id="shadow", shadow=True),
            writer=site.writer,
        )
        shadow.on_tick.append(site.reports.append)
        site.stops["shadow"] = asyncio.Event()
        site.tasks["shadow"] = asyncio.create_task(
            shadow.run(site.stops["shadow"], learn_s=TICK), name="shadow"
        )
        await site.step(8 * TICK)
        in_force = site.true_caps()
    finally:
        await site.close()
    assert all(agent.last_tick is None for agent in site.agents.values())  # never commanded
    store = Store(url)
    with store.engine.connect() as conn:
        ticks = conn.execute(select(func.count()).select_from(Tick)).scalar_one()
        caps = conn.execute(select(func.count()).select_from(CapChange)).scalar_one()
        minutes = conn.execute(select(GpuMinute.uuid, GpuMinute.mean_cap_w)).all()
        dc = conn.execute(select(GroupMinute).where(GroupMinute.group == "dc")).all()
    store.close()
    assert (ticks, caps) == (0, 0)
    assert dict(minutes) == pytest.approx(in_force)  # the caps as reported, not decided
    overhead_w = 4 * 100.0
    assert dc
    for row in dc:
        assert row.mean_committed_w == pytest.approx(sum(in_force.values()) + overhead_w)
        assert row.budget_w == 8000


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--shadow", "--record-db={db}"], "must be a database of the shadow's own"),
        (["--record-db={other}"], "only with shadow"),
    ],
)
def test_a_recording_is_a_shadows_into_its_own_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], says: str
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(site_policy()))
    db, other = f"sqlite:///{tmp_path / 'a.db'}", f"sqlite:///{tmp_path / 'b.db'}"
    argv = ["controller", f"--policy={policy}", f"--db={db}", "--broker=mqtt://127.0.0.1:9"]
    code = main([*argv, *(f.format(db=db, other=other) for f in flags)])
    assert code == EXIT_BAD_INPUT
    assert says in capsys.readouterr().err
    assert not (tmp_path / "b.db").exists()
