"""Failover time of a standby pair: the leader killed (SIGKILL), again and again.

Real processes on this machine: Mosquitto (started here), PostgreSQL (a fresh database on
the server at --pg-admin), two `powerd controller`s on it, and mock agents. Each round
waits until the leader commands every node, kills it, and measures

- failover: the kill → the first command of the new leader (what an operator sees);
- after lapse: the old lease's expiry (read from the database right after the kill; the
  database's clock is this machine's) → that first command: the issue's "within two
  ticks of the lease lapsing";

then restarts the killed controller as the next standby. It also reports whether any node
reached failsafe. Prints one line per kill and the median and maximum.

    .venv/bin/python bench/failover.py --kills 10 [--agents 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
import yaml
from psycopg import sql
from sqlalchemy.engine import make_url

from powerd.controller.leadership import process_name
from powerd.store.db import make_engine
from powerd.store.leases import Leases
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.transport import MqttConfig, MqttTransport
from powerd.wire import CapCommand, NodeState, NodeStatus, Topics

PG_ADMIN = "postgresql://postgres@127.0.0.1:5432/postgres"
TOPICS = Topics()


def policy(nodes: list[str], tick_s: float, lease_s: float) -> dict[str, Any]:
    return {
        "version": 1,
        "facility": {
            "name": "dc",
            "budget_w": 1800.0 * len(nodes),
            "rows": [
                {"name": "row", "racks": [{"name": "rack", "nodes": [{"name": n} for n in nodes]}]}
            ],
        },
        **TRAIN_AND_INFER,
        "defaults": {"class": "training", "failsafe_w": 250.0, "gpus_per_node": 4},
        "control": {"tick_s": tick_s, "lease_s": lease_s, "stale_after_s": 3 * tick_s},
    }


class Watch:
    """Every command (arrival time, controller, epoch) and every node's failsafe."""

    def __init__(self, url: str) -> None:
        self.t = MqttTransport(MqttConfig.from_url(url, client_id="failover-watch"))
        self.commands: list[tuple[float, CapCommand]] = []
        self.failsafe: list[str] = []

    async def start(self) -> None:
        await self.t.connect()
        await self.t.subscribe(f"{TOPICS.prefix}/nodes/#", qos=1)
        await self.t.wait_connected()
        asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        async for m in self.t.messages():
            kind = m.topic.rsplit("/", 1)[-1]
            if kind == "caps":
                self.commands.append((time.time(), CapCommand.model_validate_json(m.payload)))
            elif kind == "status":
                s = NodeStatus.model_validate_json(m.payload)
                if s.state is NodeState.FAILSAFE:
                    self.failsafe.append(s.node_id)


def start(workdir: Path, name: str, *args: str) -> subprocess.Popen[bytes]:
    log = (workdir / f"{name}.log").open("ab")
    return subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", "--log-format", "json", *args],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )


async def until(cond: Any, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        await asyncio.sleep(0.01)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    name = f"powerd_failover_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(args.pg_admin, autocommit=True) as c:
        c.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    db = make_url(args.pg_admin).set(database=name).render_as_string(hide_password=False)
    workdir = Path(tempfile.mkdtemp(prefix="powerd-failover-"))
    nodes = [f"n{i:02d}" for i in range(args.agents)]
    (workdir / "policy.yaml").write_text(yaml.safe_dump(policy(nodes, args.tick_s, args.lease_s)))
    broker = LocalMosquitto(workdir / "mosquitto")
    broker.start()
    procs: dict[str, subprocess.Popen[bytes]] = {}
    leases = Leases(make_engine(db))
    results: list[dict[str, float]] = []
    try:
        watch = Watch(broker.url)
        await watch.start()
        for n in nodes:
            procs[n] = start(
                workdir,
                n,
                "agent",
                f"--node-id={n}",
                f"--broker={broker.url}",
                "--backend=mock",
                "--mock-gpus=4",
                "--period=0.5",
            )

        def controller(ctl: str) -> None:
            procs[ctl] = start(
                workdir,
                ctl,
                "controller",
                f"--policy={workdir / 'policy.yaml'}",
                f"--broker={broker.url}",
                f"--db={db}",
                f"--state-file={workdir / (ctl + '.json')}",
                f"--controller-id={ctl}",
                f"--learn-s={2 * args.tick_s}",
            )

        controller("ctl-a")
        await until(lambda: any(c.controller_id == "ctl-a" for _, c in watch.commands), "ctl-a")
        controller("ctl-b")
        leader, standby = "ctl-a", "ctl-b"
        for k in range(args.kills):
            mark = len(watch.commands)
            await until(
                lambda mark=mark, leader=leader: (
                    {c.node_id for _, c in watch.commands[mark:] if c.controller_id == leader}
                    >= set(nodes)
                ),
                f"{leader} commands every node",
            )
            await asyncio.sleep(args.settle_s)  # the standby has renewed and heard it all
            held = await asyncio.to_thread(leases.current, "dc")
            assert held is not None and process_name(held.holder) == leader, held
            killed_at = time.time()
            procs[leader].kill()
            procs[leader].wait()
            lease = await asyncio.to_thread(leases.current, "dc")
            assert lease is not None
            await until(
                lambda lease=lease, standby=standby: any(
                    c.controller_id == standby and c.epoch > lease.epoch for _, c in watch.commands
                ),
                f"{standby} takes over",
            )
            first = min(
                at
                for at, c in watch.commands
                if c.controller_id == standby and c.epoch > lease.epoch
            )
            row = {
                "failover_s": first - killed_at,
                "after_lapse_s": first - lease.expires_at,
                "epoch": float(lease.epoch + 1),
            }
            results.append(row)
            print(
                f"kill {k + 1:2d}: {leader} → {standby}: failover {row['failover_s']:.3f} s, "
                f"{row['after_lapse_s']:+.3f} s after the lease lapsed (epoch {lease.epoch + 1})",
                flush=True,
            )
            controller(leader)  # back as the standby
            leader, standby = standby, leader
        failover = [r["failover_s"] for r in results]
        lapse = [r["after_lapse_s"] for r in results]
        summary = {
            "kills": len(results),
            "tick_s": args.tick_s,
            "agent_lease_s": args.lease_s,
            "leader_lease_s": 0.4 * args.lease_s,
            "failover_median_s": statistics.median(failover),
            "failover_max_s": max(failover),
            "after_lapse_median_s": statistics.median(lapse),
            "after_lapse_max_s": max(lapse),
            "nodes_in_failsafe": sorted(set(watch.failsafe)),
        }
        print(
            f"\n{len(results)} kills, tick {args.tick_s:g} s, leader lease "
            f"{0.4 * args.lease_s:g} s, agents' lease {args.lease_s:g} s\n"
            f"failover (kill → first command of the new leader): median "
            f"{summary['failover_median_s']:.3f} s, max {summary['failover_max_s']:.3f} s\n"
            f"after the lease lapsed: median {summary['after_lapse_median_s']:.3f} s, "
            f"max {summary['after_lapse_max_s']:.3f} s\n"
            f"nodes that reached failsafe: {summary['nodes_in_failsafe'] or 'none'}"
        )
        return summary
    finally:
        for p in procs.values():
            p.kill()
        for p in procs.values():
            p.wait()
        broker.kill()
        leases.engine.dispose()
        with psycopg.connect(args.pg_admin, autocommit=True) as c:
            c.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--tick-s", type=float, default=1.0)
    parser.add_argument("--lease-s", type=float, default=10.0, help="the agents' lease")
    parser.add_argument("--settle-s", type=float, default=2.0)
    parser.add_argument("--pg-admin", default=PG_ADMIN)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    summary = asyncio.run(run(args))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
