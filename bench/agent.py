"""Bench: one agent with mock GPUs against a private Mosquitto.

Reports the agent's CPU (% of one core) and peak RSS, measured inside the agent process over
its steady state, and command→ack latency as seen by a controller-like client that sends
CapCommands and times the acks (so it includes two trips through the broker).

    .venv/bin/python bench/agent.py [--duration 60] [--gpus 8] [--period 1] [--rate 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerd.agent import Agent, AgentSettings, build_backend, build_transport
from powerd.clock import SystemClock
from powerd.logs import configure_logging
from powerd.testing.mosquitto import LocalMosquitto
from powerd.transport import MqttConfig, MqttTransport
from powerd.wire import CapAck, CapCommand, NodeStatus, Topics, decode, encode

NODE = "bench-node"
TOPICS = Topics()


async def run_agent_process(args: argparse.Namespace) -> None:
    """The measured process: one agent, then its own CPU and memory figures as JSON."""
    configure_logging("json", "warning")
    settings = AgentSettings(
        node_id=NODE,
        broker=args.broker,
        backend="mock",
        mock_gpus=args.gpus,
        period_s=args.period,
    )
    clock = SystemClock()
    transport = build_transport(settings)
    agent = Agent(settings, build_backend(settings, clock), transport, clock)
    stop = asyncio.Event()
    task = asyncio.create_task(agent.run(stop), name="bench-agent")
    await asyncio.wait_for(transport.wait_connected(), 30)
    start_cpu, start_wall = _cpu_s(), time.monotonic()
    await asyncio.sleep(args.duration)
    cpu_s, wall_s = _cpu_s() - start_cpu, time.monotonic() - start_wall
    stop.set()
    await task
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"cpu_s": cpu_s, "wall_s": wall_s, "peak_rss_mb": peak_kb / 1024}))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def drive(url: str, gpus: int, duration_s: float, rate_hz: float) -> list[float]:
    """Send commands at `rate_hz` for `duration_s`; the command→ack latency of each, in s."""
    client = MqttTransport(MqttConfig.from_url(url))
    await client.connect()
    await client.subscribe(TOPICS.ack(NODE))
    await client.subscribe(TOPICS.status(NODE))
    messages = client.messages()
    # Wait for the agent: its status comes once it is subscribed to its commands.
    while True:
        m = await asyncio.wait_for(anext(messages), 60)
        if m.topic == TOPICS.status(NODE):
            decode(m.payload, NodeStatus, NODE)
            break
    uuids = [f"GPU-{NODE}-0-{i:06d}" for i in range(gpus)]
    latencies: list[float] = []
    deadline = time.monotonic() + duration_s
    tick = 0
    while time.monotonic() < deadline:
        tick += 1
        # Alternate between two plans, so every command moves caps both down and up.
        caps = [400.0 + 200.0 * ((i + tick) % 2) for i in range(gpus)]
        cmd = CapCommand(
            node_id=NODE,
            tick=tick,
            lease_s=10.0,
            caps=dict(zip(uuids, caps, strict=True)),
            failsafe_w=dict.fromkeys(uuids, 300.0),
        )
        sent = time.perf_counter()
        await client.publish(TOPICS.caps(NODE), encode(cmd), qos=1)
        while True:
            m = await asyncio.wait_for(anext(messages), 10)
            if m.topic == TOPICS.ack(NODE) and decode(m.payload, CapAck).tick == tick:
                latencies.append(time.perf_counter() - sent)
                break
        await asyncio.sleep(max(0.0, sent + 1.0 / rate_hz - time.perf_counter()))
    await client.disconnect()
    return latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds (default 60)")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--period", type=float, default=1.0, help="telemetry period, s")
    parser.add_argument("--rate", type=float, default=2.0, help="commands per second")
    parser.add_argument("--role", choices=["bench", "agent"], default="bench", help="internal")
    parser.add_argument("--broker", help="internal: the broker of the agent process")
    args = parser.parse_args()
    if args.role == "agent":
        asyncio.run(run_agent_process(args))
        return

    configure_logging("console", "warning")
    with tempfile.TemporaryDirectory() as tmp, LocalMosquitto(Path(tmp)) as broker:
        agent_args = ["--broker", broker.url, "--duration", str(args.duration)]
        agent_args += ["--gpus", str(args.gpus), "--period", str(args.period)]
        agent = subprocess.Popen(
            [sys.executable, __file__, "--role", "agent", *agent_args],
            stdout=subprocess.PIPE,
            text=True,
        )
        latencies = asyncio.run(drive(broker.url, args.gpus, args.duration, args.rate))
        out, _ = agent.communicate(timeout=args.duration + 60)
    if agent.returncode != 0:
        sys.exit(f"agent process failed ({agent.returncode})")
    figures = json.loads(out.strip().splitlines()[-1])
    lat_ms = sorted(x * 1000 for x in latencies)
    p99 = lat_ms[min(len(lat_ms) - 1, int(0.99 * len(lat_ms)))]
    print(f"agent: {args.gpus} mock GPUs, telemetry every {args.period:g} s, {args.rate:g} cmd/s")
    print(f"  CPU        {100 * figures['cpu_s'] / figures['wall_s']:.2f} % of one core")
    print(f"             over {figures['wall_s']:.0f} s steady state")
    print(f"  peak RSS   {figures['peak_rss_mb']:.1f} MB")
    print(
        f"  cmd→ack    median {statistics.median(lat_ms):.2f} ms, p99 {p99:.2f} ms, "
        f"max {lat_ms[-1]:.2f} ms over {len(lat_ms)} commands"
    )


if __name__ == "__main__":
    main()
