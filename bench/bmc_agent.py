"""Bench: how many BMCs one `powerd bmc-agent` process serves, and at what tick.

N emulated HGX BMCs (8 GPUs each, every answer delayed uniformly 100–500 ms) are served
over HTTPS by the Redfish emulator in a process of its own (`--emulator-procs` of them,
the BMCs dealt out between them); `powerd bmc-agent` runs as its own process against
them and a private Mosquitto; a controller-like client in this process sends every node a
CapCommand each tick (caps alternating between two levels, so every command cuts or
raises every GPU) and records telemetry arrivals and acks. Printed per N:

- telemetry age: at each tick, for every node, the time since its latest telemetry (what
  the controller's snapshot would see), p50 / p99 / max, and the nodes whose age passed
  the policy's `stale_after_s` (default 5 s) at least once: stale at the controller;
- command → ack latency (p50, p99), and the share of commands acknowledged (the rest were
  replaced by a newer one before the node got to them, or are in flight at the end);
- the CPU of the bmc-agent and of the emulators (% of one core, from /proc), the
  Redfish requests the bmc-agent made per second and its CPU per request (from its own
  /metrics: `powerd_bmc_requests_total`), its threads, and the machine's load average at
  the end of the row. The CPU per request is the figure that carries to another machine:
  a core serves about 1 / (CPU per request) requests a second.

    .venv/bin/python bench/bmc_agent.py [--nodes 50 200 500] [--duration 30] [--tick 2]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

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


def serve_bmcs(
    first: int,
    n: int,
    latency: tuple[float, float],
    ca: TestCa,
    urls: multiprocessing.Queue[list[str]],
    stop: multiprocessing.Event,
) -> None:
    """An emulator process: BMCs first..first+n-1, their URLs put on `urls`, until `stop`."""
    services = [
        RedfishService.hgx(
            GPUS,
            Workload.steady(600.0),
            password="bench",
            node=f"bmc-{i:04d}",
            faults=Faults(latency_s=latency),
        )
        for i in range(first, first + n)
    ]
    with EmulatorServer(services, ca) as server:
        urls.put([server.url(i) for i in range(n)])
        stop.wait()


class Emulators:
    """N BMCs served by `procs` emulator processes (the bench's own loop stays free)."""

    def __init__(self, n: int, procs: int, latency: tuple[float, float], ca: TestCa) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.stop = ctx.Event()
        self.urls: list[str] = []
        share = [n // procs + (1 if k < n % procs else 0) for k in range(procs)]
        queues = []
        self.procs = []
        first = 0
        for count in share:
            if count == 0:
                continue
            q: multiprocessing.Queue[list[str]] = ctx.Queue()
            p = ctx.Process(target=serve_bmcs, args=(first, count, latency, ca, q, self.stop))
            p.start()
            queues.append(q)
            self.procs.append(p)
            first += count
        for q in queues:
            self.urls += q.get(timeout=300)

    def cpu_s(self) -> float:
        return sum(cpu_s(p.pid) for p in self.procs if p.pid is not None)

    def close(self) -> None:
        self.stop.set()
        for p in self.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()


async def measure(n: int, args: argparse.Namespace, broker: LocalMosquitto, work: Path) -> str:
    ca = TestCa.make(work / f"pki-{n}")
    (work / "pw").write_text("bench\n")
    server = await asyncio.to_thread(Emulators, n, args.emulator_procs, tuple(args.latency), ca)
    try:
        metrics_port = free_port()
        config = work / f"bmc-{n}.toml"
        lines = [
            f'broker = "{broker.url}"',
            f"period_s = {args.period}",
            f"timeout_s = {args.timeout}",
            "retries = 1",
            f"concurrency = {args.concurrency}",
            "failsafe_w = 300",
            f"metrics_port = {metrics_port}",
        ]
        for i in range(n):
            lines += [
                "[[nodes]]",
                f'node_id = "bmc-{i:04d}"',
                f'url = "{server.urls[i]}"',
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
            return await drive(n, args, broker, proc.pid, server, metrics_port)
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
    finally:
        await asyncio.to_thread(server.close)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def requests_made(port: int) -> float:
    """The bmc-agent's Redfish requests so far, every BMC's, from its /metrics."""
    async with httpx.AsyncClient() as client:
        text = (await client.get(f"http://127.0.0.1:{port}/metrics", timeout=30)).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("powerd_bmc_requests_total{")
    )


async def drive(
    n: int,
    args: argparse.Namespace,
    broker: LocalMosquitto,
    pid: int,
    emulators: Emulators,
    metrics_port: int,
) -> str:
    client = MqttTransport(MqttConfig.from_url(broker.url, client_id="bench-controller"))
    await client.connect()
    for kind in ("telemetry", "ack"):
        await client.subscribe(TOPICS.all_nodes(kind), qos=1)
    await client.wait_connected()
    uuids: dict[str, list[str]] = {}
    arrivals: dict[str, list[float]] = {}
    sent: dict[tuple[str, int], float] = {}
    last: dict[str, float] = {}  # node → its latest telemetry's arrival
    ages: list[float] = []
    stale_nodes: set[str] = set()
    latencies: list[float] = []
    measuring = False

    async def listen() -> None:
        async for m in client.messages():
            node, kind = m.topic.split("/")[3:5]
            now = time.monotonic()
            if kind == "telemetry":
                t = decode(m.payload, NodeTelemetry, topic_node=node)
                uuids[node] = [g.uuid for g in t.gpus]
                last[node] = now
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
    # Commands from now on; figures only after the warm-up (every node steered a while: its
    # first commands, a new leader's, are applied with holds and its state saved).
    start = time.monotonic()
    t0 = start + args.warmup
    end = t0 + args.duration
    req0 = cpu0 = emu0 = 0.0
    while time.monotonic() < end:
        tick += 1
        now = time.monotonic()
        if not measuring and now >= t0:
            req0 = await requests_made(metrics_port)
            cpu0, emu0, t0 = cpu_s(pid), emulators.cpu_s(), time.monotonic()
            end = t0 + args.duration
            measuring = True
        for node in uuids if measuring else ():  # what a controller's snapshot sees now
            age = now - last.get(node, t0)
            ages.append(age)
            if age > args.stale_after:
                stale_nodes.add(node)
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
            if measuring:
                sent[(node, tick)] = time.monotonic()
            batch.append((TOPICS.caps(node), encode(cmd)))
            commands += 1 if measuring else 0
        await client.publish_many(batch, qos=1)
        await asyncio.sleep(max(0.0, start + tick * args.tick - time.monotonic()))
    elapsed = time.monotonic() - t0
    cpu_used = cpu_s(pid) - cpu0
    cpu = cpu_used / elapsed * 100
    made = await requests_made(metrics_port) - req0
    emu_cpu = (emulators.cpu_s() - emu0) / elapsed * 100
    nthreads = threads(pid)
    measuring = False
    listener.cancel()
    await client.disconnect()
    intervals = [b - a for ts in arrivals.values() for a, b in itertools.pairwise(ts)]
    worst = max((max(ts[0] - t0, end - ts[-1]) for ts in arrivals.values() if ts), default=0.0)
    silent = n - len(uuids)  # never reported: stale throughout
    return (
        f"{n:5d} {n * GPUS:6d} {ready_s:7.1f} {args.tick:5.1f} {args.period:6.1f} "
        f"{pct(ages, 0.5):7.2f} {pct(ages, 0.99):7.2f} {max(ages, default=float('nan')):7.2f} "
        f"{len(stale_nodes) + silent:6d} "
        f"{statistics.median(intervals) if intervals else float('nan'):7.2f} "
        f"{pct(latencies, 0.5):7.2f} {pct(latencies, 0.99):7.2f} "
        f"{len(latencies) / max(1, commands) * 100:6.1f} {cpu:6.1f} {emu_cpu:6.1f} "
        f"{made / elapsed:6.0f} {cpu_used / max(made, 1) * 1000:6.2f} {nthreads:5d} "
        f"{os.getloadavg()[0]:5.1f}"
        + (f"  (edge gap {worst:.1f} s)" if worst > args.stale_after else "")
    )


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, nargs="+", default=[50, 200, 500])
    p.add_argument("--duration", type=float, default=30.0, help="measured seconds per N")
    p.add_argument("--warmup", type=float, default=15.0, help="commands before measuring")
    p.add_argument("--tick", type=float, default=2.0, help="seconds between commands")
    p.add_argument("--period", type=float, default=2.0, help="the bmc-agent's period_s")
    p.add_argument("--timeout", type=float, default=0.9, help="per request attempt")
    p.add_argument("--keep-logs", type=Path, metavar="DIR", help="copy the bmc-agent's logs here")
    p.add_argument("--concurrency", type=int, default=4, help="connections per BMC")
    p.add_argument("--latency", type=float, nargs=2, default=[0.1, 0.5], metavar=("LO", "HI"))
    p.add_argument("--stale-after", type=float, default=5.0, help="the policy's stale_after_s")
    p.add_argument("--emulator-procs", type=int, default=2, help="processes serving the BMCs")
    args = p.parse_args()
    configure_logging("console", "warning")
    print(
        f"BMCs answering in {args.latency[0]:g}-{args.latency[1]:g} s, {GPUS} GPUs each; "
        f"{args.concurrency} connections per BMC; {os.cpu_count()} CPUs; "
        f"{args.duration:g} s measured per row after {args.warmup:g} s of commands"
    )
    print(
        "nodes   gpus ready_s tick_s period age_p50 age_p99 age_max  stale tel_int "
        "ack_p50 ack_p99 acked%   cpu%  emu%  req/s ms/req thrds  load"
    )
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with LocalMosquitto(work) as broker:
            for n in args.nodes:
                print(await measure(n, args, broker, work), flush=True)


if __name__ == "__main__":
    asyncio.run(main())
