"""Bench: how many BMCs one `powerd bmc-agent` process serves, and at what tick.

N emulated HGX BMCs (8 GPUs each, every answer delayed uniformly 100–500 ms) are served
over HTTPS by the Redfish emulator in this process; `powerd bmc-agent` runs as its own
process against them and a private Mosquitto; a controller-like client in this process
sends every node a CapCommand each tick (caps alternating between two levels, so every
command cuts or raises every GPU) and records telemetry arrivals and acks. Printed per N:

- telemetry interval per node (p50, p99, max) against its period: a node whose interval
  passes the policy's `stale_after_s` (default 5 s) would be stale at the controller;
- command → ack latency (p50, p99), and the share of commands acknowledged (the rest were
  replaced by a newer one before the node got to them, or are in flight at the end);
- the bmc-agent's CPU (% of one core, from /proc) and its threads.

    .venv/bin/python bench/bmc_agent.py [--nodes 10 50 100] [--duration 30] [--tick 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerd.backends.mock import Workload
from powerd.logs import configure_logging
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.redfish import EmulatorServer, Faults, RedfishService, TestCa
from powerd.transport import MqttConfig, MqttTransport
from powerd.wire import CapAck, CapCommand, NodeTelemetry, Topics, decode, encode

TOPICS = Topics()
GPUS = 8
BMC_AGENT = [sys.executable, "-m", "powerd.cli", "--log-level", "warning", "bmc-agent"]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def threads(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("Threads:"):
            return int(line.split()[1])
    return 0


async def measure(n: int, args: argparse.Namespace, broker: LocalMosquitto, work: Path) -> str:
    ca = TestCa.make(work / f"pki-{n}")
    lo, hi = args.latency
    services = [
        RedfishService.hgx(
            GPUS,
            Workload.steady(600.0),
            password="bench",
            node=f"bmc-{i:04d}",
            faults=Faults(latency_s=(lo, hi)),
        )
        for i in range(n)
    ]
    (work / "pw").write_text("bench\n")
    with EmulatorServer(services, ca) as server:
        config = work / f"bmc-{n}.toml"
        lines = [
            f'broker = "{broker.url}"',
            f"period_s = {args.period}",
            f"timeout_s = {args.timeout}",
            "retries = 1",
            f"concurrency = {args.concurrency}",
            "failsafe_w = 300",
        ]
        for i in range(n):
            lines += [
                "[[nodes]]",
                f'node_id = "bmc-{i:04d}"',
                f'url = "{server.url(i)}"',
                'username = "admin"',
                f'password_file = "{work / "pw"}"',
                f'ca_file = "{ca.ca_file}"',
            ]
        config.write_text("\n".join(lines) + "\n")
        log = (work / f"bmc-agent-{n}.log").open("wb")
        proc = subprocess.Popen(  # noqa: ASYNC220 - started once, before measuring
            [*BMC_AGENT, f"--config={config}"],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            return await drive(n, args, broker, proc.pid)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            log.close()
            if args.keep_logs is not None:
                kept = args.keep_logs / f"bmc-agent-{n}.log"
                kept.write_bytes((work / f"bmc-agent-{n}.log").read_bytes())
                print(f"the bmc-agent's log: {kept}")


async def drive(n: int, args: argparse.Namespace, broker: LocalMosquitto, pid: int) -> str:
    client = MqttTransport(MqttConfig.from_url(broker.url, client_id="bench-controller"))
    await client.connect()
    for kind in ("telemetry", "ack"):
        await client.subscribe(TOPICS.all_nodes(kind), qos=1)
    await client.wait_connected()
    uuids: dict[str, list[str]] = {}
    arrivals: dict[str, list[float]] = {}
    sent: dict[tuple[str, int], float] = {}
    latencies: list[float] = []
    measuring = False

    async def listen() -> None:
        async for m in client.messages():
            node, kind = m.topic.split("/")[3:5]
            now = time.monotonic()
            if kind == "telemetry":
                t = decode(m.payload, NodeTelemetry, topic_node=node)
                uuids[node] = [g.uuid for g in t.gpus]
                if measuring:
                    arrivals.setdefault(node, []).append(now)
            elif kind == "ack":
                ack = decode(m.payload, CapAck, topic_node=node)
                at = sent.pop((node, ack.tick), None)
                if at is not None and measuring:
                    latencies.append(now - at)

    listener = asyncio.create_task(listen())
    start = time.monotonic()
    while len(uuids) < n and time.monotonic() - start < 120:  # noqa: ASYNC110
        await asyncio.sleep(0.2)
    ready_s = time.monotonic() - start
    if len(uuids) < n:
        print(f"only {len(uuids)} of {n} nodes reported within 120 s", file=sys.stderr)
    tick = 0
    commands = 0
    cpu0, t0 = cpu_s(pid), time.monotonic()
    measuring = True
    end = t0 + args.duration
    while time.monotonic() < end:
        tick += 1
        level = 400.0 if tick % 2 else 450.0
        batch = []
        for node, gpus in uuids.items():
            cmd = CapCommand(
                node_id=node,
                tick=tick,
                lease_s=60.0,
                caps=dict.fromkeys(gpus, level),
                failsafe_w=dict.fromkeys(gpus, 300.0),
            )
            sent[(node, tick)] = time.monotonic()
            batch.append((TOPICS.caps(node), encode(cmd)))
            commands += 1
        await client.publish_many(batch, qos=1)
        await asyncio.sleep(max(0.0, t0 + tick * args.tick - time.monotonic()))
    elapsed = time.monotonic() - t0
    cpu = (cpu_s(pid) - cpu0) / elapsed * 100
    nthreads = threads(pid)
    measuring = False
    listener.cancel()
    await client.disconnect()
    intervals = [b - a for ts in arrivals.values() for a, b in itertools.pairwise(ts)]
    worst = max((max(ts[0] - t0, end - ts[-1]) for ts in arrivals.values() if ts), default=0.0)
    silent = n - len(arrivals)
    over = sum(
        1
        for ts in arrivals.values()
        if any(b - a > args.stale_after for a, b in itertools.pairwise(ts))
    )
    return (
        f"{n:5d} {n * GPUS:6d} {ready_s:7.1f} {args.tick:5.1f} {args.period:6.1f} "
        f"{statistics.median(intervals) if intervals else float('nan'):7.2f} "
        f"{pct(intervals, 0.99):7.2f} {max(intervals, default=float('nan')):7.2f} "
        f"{over + silent:6d} {pct(latencies, 0.5):7.2f} {pct(latencies, 0.99):7.2f} "
        f"{len(latencies) / max(1, commands) * 100:6.1f} {cpu:6.1f} {nthreads:5d}"
        + (f"  (edge gap {worst:.1f} s)" if worst > args.stale_after else "")
    )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[10, 50, 100])
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per N")
    p.add_argument("--tick", type=float, default=2.0, help="seconds between commands")
    p.add_argument("--period", type=float, default=2.0, help="the bmc-agent's period_s")
    p.add_argument("--timeout", type=float, default=0.9, help="per request attempt")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy the bmc-agent's logs here")
    p.add_argument("--concurrency", type=int, default=4, help="connections per BMC")
    p.add_argument("--latency", type=float, nargs=2, default=[0.1, 0.5], metavar=("LO", "HI"))
    p.add_argument("--stale-after", type=float, default=5.0, help="the policy's stale_after_s")
    args = p.parse_args()
    configure_logging("console", "warning")
    print(
        f"BMCs answering in {args.latency[0]:g}-{args.latency[1]:g} s, {GPUS} GPUs each; "
        f"{args.concurrency} connections per BMC; {os.cpu_count()} CPUs; "
        f"{args.duration:g} s measured per row"
    )
    print(
        "nodes   gpus ready_s tick_s period  tel_p50 tel_p99 tel_max  stale "
        "ack_p50 ack_p99 acked%   cpu% thrds"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with LocalMosquitto(work) as broker:
            for n in args.nodes:
                print(await measure(n, args, broker, work), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
