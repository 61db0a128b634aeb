"""Bench: a site split into scopes, end to end over a real Mosquitto, every part a process.

`--gpus` GPUs (8 a node, 25 nodes a rack) in `--scopes` rows; one `powerd controller
--scope row-K` per row and one `powerd coordinator --scope-level row` above them, each on
its own SQLite store; bench/fleetsim.py plays every node. After a warm-up it measures for
`--duration` seconds:

- per scope controller: tick start → last command written (its `tick_done` debug lines),
  p50/p99/max; its CPU (% of one core) and peak RSS;
- the coordinator: its CPU and RSS, and its split time per tick (GET /api/v1/scopes);
- Mosquitto's and the simulator's CPU, to show what else the machine carried.

    .venv/bin/python bench/scopes_loop.py --gpus 20000 --scopes 4 [--duration 60]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import yaml

from powerd.auth import new_token_entry
from powerd.policy import load_policy
from powerd.testing.mosquitto import LocalMosquitto, free_port
from powerd.testing.synthetic import policy_dict

BENCH = Path(__file__).resolve().parent
GPUS_PER_NODE = 8
NODES_PER_RACK = 25
CLI = (sys.executable, "-m", "powerd.cli", "--log-format", "json")
BROKER_LIMITS = "max_queued_messages 0\nmax_inflight_messages 0\n"


def proc_cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=20_000)
    parser.add_argument("--scopes", type=int, default=4)
    parser.add_argument("--tick", type=float, default=1.0)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--warmup", type=float, default=30.0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    per_row = args.gpus // args.scopes
    racks = per_row // (GPUS_PER_NODE * NODES_PER_RACK)
    if racks * GPUS_PER_NODE * NODES_PER_RACK * args.scopes != args.gpus:
        raise SystemExit("--gpus must be scopes × racks × 25 nodes × 8 GPUs")
    work = Path(tempfile.mkdtemp(prefix="powerd-scopes-"))
    policy = policy_dict(args.scopes, racks, NODES_PER_RACK, GPUS_PER_NODE)
    t = args.tick
    policy["control"] |= {"tick_s": t, "lease_s": 10 * t, "stale_after_s": 5 * t}
    policy_file = work / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(policy))
    token, entry = new_token_entry("bench", "viewer")
    (work / "tokens.toml").write_text(entry)
    rows = [g.name for g in load_policy(policy_file).groups if g.level == 1]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    logs: dict[str, Path] = {}
    with LocalMosquitto(work / "mosquitto", extra_config=BROKER_LIMITS) as broker:
        assert broker._proc is not None
        sim = subprocess.Popen(
            [
                *(sys.executable, str(BENCH / "fleetsim.py")),
                *("--broker", broker.url, "--policy", str(policy_file), "--period", str(t)),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )

        def start(name: str, *argv: str, level: str = "info") -> None:
            logs[name] = work / f"{name}.log"
            with logs[name].open("wb") as out:
                procs[name] = subprocess.Popen(
                    [*CLI, "--log-level", level, *argv],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )

        coord_port = free_port()
        try:
            assert sim.stdout is not None
            if not sim.stdout.readline().startswith('{"ready"'):
                raise SystemExit("fleet simulator failed to start")
            for row in rows:
                start(
                    row,
                    "controller",
                    f"--policy={policy_file}",
                    f"--broker={broker.url}",
                    f"--db=sqlite:///{work / (row + '.db')}",
                    f"--state-file={work / (row + '.json')}",
                    f"--controller-id=ctl-{row}",
                    f"--scope={row}",
                    level="debug",
                )
            start(
                "coordinator",
                "coordinator",
                f"--policy={policy_file}",
                f"--broker={broker.url}",
                f"--db=sqlite:///{work / 'coordinator.db'}",
                "--scope-level=row",
                f"--state-file={work / 'coordinator.json'}",
                f"--api-port={coord_port}",
                f"--tokens-file={work / 'tokens.toml'}",
            )
            print(
                f"{args.gpus} GPUs in {args.scopes} scopes; warming up {args.warmup:g} s",
                flush=True,
            )
            time.sleep(args.warmup)
            pids = {n: p.pid for n, p in procs.items()} | {
                "mosquitto": broker._proc.pid,
                "fleetsim": sim.pid,
            }
            cpu0 = {n: proc_cpu_s(pid) for n, pid in pids.items()}
            t0 = time.time()
            splits: list[float] = []
            exact: list[bool] = []
            with httpx.Client(
                base_url=f"http://127.0.0.1:{coord_port}",
                headers={"Authorization": f"Bearer {token}"},
                timeout=10,
            ) as c:
                last_tick = None
                while time.time() - t0 < args.duration:
                    view = c.get("/api/v1/scopes").json()
                    if view["tick"] != last_tick and view["solve_ms"] is not None:
                        splits.append(view["solve_ms"])
                        exact.append(bool(view["exact"]))
                        last_tick = view["tick"]
                    time.sleep(t / 2)
                final = view
            elapsed = time.time() - t0
            cpu = {n: 100 * (proc_cpu_s(pid) - cpu0[n]) / elapsed for n, pid in pids.items()}
            rss = {n: peak_rss_mb(pid) for n, pid in pids.items()}
        finally:
            for p in procs.values():
                p.terminate()
            for p in procs.values():
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
            sim.terminate()
            sim.wait(timeout=30)
    result: dict[str, Any] = {"gpus": args.gpus, "scopes": args.scopes, "tick_s": t}
    for row in rows:
        durations = []
        for line in logs[row].read_text().splitlines():
            if '"tick_done"' not in line:
                continue
            ev = json.loads(line)
            stamp = datetime.fromisoformat(ev["timestamp"].replace("Z", "+00:00")).timestamp()
            if t0 <= stamp <= t0 + elapsed:
                durations.append(ev["duration_ms"])
        result[row] = {
            "ticks": len(durations),
            "tick_p50_ms": statistics.median(durations) if durations else None,
            "tick_p99_ms": pct(durations, 0.99) if durations else None,
            "tick_max_ms": max(durations) if durations else None,
            "cpu_pct": round(cpu[row], 1),
            "peak_rss_mb": round(rss[row], 1),
        }
    result["coordinator"] = {
        "split_p50_ms": statistics.median(splits) if splits else None,
        "split_max_ms": max(splits) if splits else None,
        "split_exact_share": round(sum(exact) / len(exact), 3) if exact else None,
        "cpu_pct": round(cpu["coordinator"], 1),
        "peak_rss_mb": round(rss["coordinator"], 1),
        "held_or_waiting": [p["scope"] for p in final["scopes"] if p["held"]] + final["waiting"],
    }
    result["mosquitto_cpu_pct"] = round(cpu["mosquitto"], 1)
    result["fleetsim_cpu_pct"] = round(cpu["fleetsim"], 1)
    print(json.dumps(result, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
