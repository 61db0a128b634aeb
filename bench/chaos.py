"""Soak: real powerd processes under a random fault schedule, an outside watcher on budgets.

A private Mosquitto, one controller (SQLite by default, or PostgreSQL through a loopback
proxy), 2 racks × 2 nodes × 4 mock GPUs with tight budgets, and the faults of
powerd/chaos/schedule.py drawn at random (every kind in turn) for `--duration` seconds.
The watcher rebuilds every GPU's cap in force from the agents' cap journals and checks
every budget at every change (docs/safety.md, "Chaos harness"). Prints a line per fault,
then the figures: faults by kind, survived, breaches, worst overshoot (W, s), time to
recover steering.

    .venv/bin/python bench/chaos.py --duration 600 --seed 1 [--db postgresql [--pair]]
        [--json out.json]
    .venv/bin/python bench/chaos.py --short           # the test suite's schedule, once

Exit status 0 when no budget was breached, no controller died and every fault saw what it
expects (alarms, roles, no fall to failsafe through a switchover), 1 otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from powerd.chaos.run import FaultRecord, run_schedule
from powerd.chaos.schedule import short_schedule, soak_schedule
from powerd.chaos.site import Site, SiteConfig

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"


def pg_database() -> str:
    """A fresh database on the local server (dropped by hand: it is named chaos_<time>)."""
    import psycopg
    from sqlalchemy.engine import make_url

    name = f"chaos_{int(time.time())}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as c:
        c.execute(f'CREATE DATABASE "{name}"')
    return (
        make_url(PG_ADMIN)
        .set(database=name, drivername="postgresql+psycopg")
        .render_as_string(hide_password=False)
    )


async def main(args: argparse.Namespace) -> int:
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="powerd-chaos-"))
    config = SiteConfig(
        db=args.db, pg_url=pg_database() if args.db == "postgresql" else None, pair=args.pair
    )
    site = Site(workdir, config)
    print(f"site in {workdir} ({config.db}); starting", flush=True)
    t_start = time.monotonic()
    try:
        await site.start()
    except BaseException:
        await site.close()  # a start that fails leaves no processes behind
        raise
    print(f"steered after {time.monotonic() - t_start:.1f} s; faults begin", flush=True)
    # Only budgeted groups can be cut (a row without a budget has none to lower).
    groups = [g.name for g in site.policy.groups if g.budget_w != float("inf")]
    # Scopes a leftover controller may steer: the racks (the row has no budget of its own).
    scopes = [g.name for g in site.policy.groups if g.level == 2]
    if args.short:
        schedule = short_schedule(site.nodes, "rack-1", pair=config.pair)
        until = float("inf")
    else:
        schedule = soak_schedule(
            args.duration, args.seed, site.nodes, groups, scopes, pair=config.pair
        )
        until = args.duration
    if args.only:
        only = set(args.only.split(","))
        schedule = [f for f in schedule if f.kind.value in only]

    def progress(rec: FaultRecord, elapsed_s: float) -> None:
        rec_s = "never" if rec.recovery_s is None else f"{rec.recovery_s:.1f} s"
        live = site.watcher.check
        print(
            f"[{elapsed_s:6.1f} s] {rec.fault.describe():<40} recovered: {rec_s:<8} "
            f"live breaches so far: {len(live.breaches)}; "
            f"facility {live.group_committed_w('dc'):.0f} W",
            flush=True,
        )

    try:
        report = await run_schedule(site, schedule, until_s=until, progress=progress)
    finally:
        await site.close()
    print(report.render())
    if args.json:
        await asyncio.to_thread(Path(args.json).write_text, json.dumps(report.to_json(), indent=2))
    died = any(not r.controller_alive for r in report.records)
    findings = any(r.findings for r in report.records)
    return 1 if report.breaches or died or findings else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600.0, help="seconds of faults")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--db", choices=("sqlite", "postgresql"), default="sqlite")
    parser.add_argument(
        "--pair", action="store_true", help="a standby pair (needs --db postgresql)"
    )
    parser.add_argument("--short", action="store_true", help="the test suite's schedule")
    parser.add_argument("--only", help="only these kinds (comma-separated) of the schedule")
    parser.add_argument("--workdir", help="keep logs and journals here (default: a temp dir)")
    parser.add_argument("--json", help="write the figures here too")
    sys.exit(asyncio.run(main(parser.parse_args())))
