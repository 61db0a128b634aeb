"""Bench: the steering loop at fleet scale, over a real Mosquitto.

This process is the controller: `Controller` with an `MqttTransport`, the fast solver and a
SQLite store, built by `build_controller` (powerd/controller/build.py) as for `powerd
controller`. A private Mosquitto runs on a free port, and bench/fleetsim.py, in a separate
process, plays every node (telemetry each period, a CapAck and a NodeStatus for every
command). After the fleet is known and a warm-up, it measures for `--duration` seconds:

- per tick, `TickReport.duration_ms`: tick start → last CapCommand handed to the MQTT
  client, with its parts: solve, safety plan, publish; and tick start → the last command
  written to the socket (the client's write queue empty);
- the controller process's CPU (user + system, all threads: the store writer included) as a
  percentage of one core, and its peak RSS;
- the CPU of Mosquitto and of the fleet simulator, to show what else the machine carried;
- safety: ticks that ended with a group above budget, and ticks that overran the tick.

    .venv/bin/python bench/loop.py --gpus 10000 [--duration 60] [--warmup 15] [--json]
    .venv/bin/python bench/loop.py --gpus 10000 --window 20   # MqttConfig's default QoS 1 window
    .venv/bin/python bench/loop.py --gpus 10000 --profile prof.out   # cProfile of the run
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import faulthandler
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from powerd.clock import SystemClock
from powerd.controller.build import ControllerOptions, build_controller
from powerd.controller.report import TickReport
from powerd.controller.settings import ControllerSettings
from powerd.logs import configure_logging
from powerd.policy import load_policy
from powerd.safety import SafePlan
from powerd.store import Store, StoreWriter, upgrade
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.synthetic import policy_dict
from powerd.transport import MqttConfig, MqttTransport

BENCH = Path(__file__).resolve().parent
GPUS_PER_NODE = 8
# (rows, racks per row, nodes per rack) for each size; 8 GPUs a node.
SHAPES = {1000: (1, 5, 25), 10_000: (2, 25, 25), 100: (1, 1, 13)}


def write_policy(path: Path, gpus: int, tick_s: float, ack_ticks: int | None = None) -> None:
    rows, racks, nodes = SHAPES[gpus]
    data = policy_dict(rows, racks, nodes, GPUS_PER_NODE)
    if gpus % GPUS_PER_NODE == 0 and rows * racks * nodes * GPUS_PER_NODE != gpus:
        raise SystemExit(f"no shape for {gpus} GPUs")
    data["control"] |= {"tick_s": tick_s, "lease_s": 10 * tick_s, "stale_after_s": 5 * tick_s}
    if ack_ticks is not None:
        data["control"]["ack_ticks"] = ack_ticks
    path.write_text(yaml.safe_dump(data))


def cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def proc_cpu_s(pid: int) -> float:
    """User + system seconds of another process (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * len(s) + 0.5) - 1))]


def machine() -> dict[str, Any]:
    model = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"nproc": os.cpu_count(), "cpu": model, "python": platform.python_version()}


# The broker's per-client queues sized for the simulator: its one connection stands for
# every node, so Mosquitto's defaults (1,000 queued and 20 in-flight QoS 1 messages per
# client) would drop the commands a thousand separate agents would get.
BENCH_BROKER_LIMITS = "max_queued_messages 0\nmax_inflight_messages 0\n"


@dataclass(frozen=True, slots=True)
class TickFigures:
    duration_ms: float
    solve_ms: float
    plan_ms: float
    over: bool  # a group's committed load above its budget
    stale: bool  # a GPU's telemetry stale

    @classmethod
    def of(cls, r: TickReport) -> TickFigures:
        return cls(
            r.duration_ms, r.solve_ms, r.plan_ms, bool(r.group_over.any()), bool(r.stale.any())
        )


class Run:
    """The controller and what it measured."""

    def __init__(self, policy_file: Path, broker: str, db: str, window: int) -> None:
        self.policy = load_policy(policy_file)
        self.n_gpus = sum(g.gpus for g in self.policy.groups if g.level == 3)
        store = Store(db)
        self.writer = StoreWriter(store)
        config = MqttConfig.from_url(
            broker,
            client_id="bench-controller",
            max_queued_messages=100_000,
            max_inflight_messages=window,
        )
        transport = MqttTransport(config)
        self.transport = transport
        self.controller = build_controller(
            self.policy,
            transport,
            SystemClock(),
            ControllerOptions(controller_id="bench", policy_path=str(policy_file)),
            store=store,
            writer=self.writer,
        )
        self.measuring = False
        # Per measured tick, the figures only: a TickReport holds ~0.75 MB of per-GPU arrays at
        # 10k GPUs, and keeping them all made this process grow 0.75 MB a second.
        self.reports: list[TickFigures] = []
        self.publish_ms: list[float] = []
        self.controller.on_tick.append(self._on_tick)
        inner = self.controller.publish_plan

        async def timed_publish(plan: SafePlan) -> None:
            t0 = time.perf_counter()
            await inner(plan)
            if self.measuring:
                self.publish_ms.append((time.perf_counter() - t0) * 1000.0)

        self.controller.publish_plan = timed_publish  # type: ignore[method-assign]
        # Tick start → the last command written to the socket. publish_many writes the batch
        # at once, up to `window` QoS 1 messages ahead of the broker's PUBACKs (the rest wait
        # for those); what the socket does not take at once the event loop writes later. The
        # moment measured: the transport has nothing of the tick's left to write
        # (`unwritten` is 0, told by its `on_written` callbacks).
        self.written_ms: list[float] = []
        self.unwritten_ticks = 0  # measured ticks whose last command was not written in time
        self._tick_t0 = 0.0
        self._drained_at = 0.0  # when the transport last had nothing left to write
        self._waiting = False  # a measured tick's commands not all written yet
        inner_tick = self.controller.tick_once

        async def timed_tick(*, early: bool = False) -> TickReport:
            if self._waiting:
                self.unwritten_ticks += 1
                self._waiting = False
            self._tick_t0 = time.perf_counter()
            report = await inner_tick(early=early)
            if self.measuring:
                if self.transport.unwritten == 0:
                    # Written when the transport last ran empty: often within publish_many,
                    # before the tick's end (recording, hooks).
                    done = self._drained_at
                    if done < self._tick_t0:
                        done = time.perf_counter()
                    self.written_ms.append((done - self._tick_t0) * 1000.0)
                else:
                    self._waiting = True
            return report

        self.controller.tick_once = timed_tick  # type: ignore[method-assign]

    def watch_writes(self) -> None:
        """Be told each time the transport has written everything it was given."""

        def written() -> None:
            self._drained_at = time.perf_counter()
            if self._waiting:
                self._waiting = False
                self.written_ms.append((self._drained_at - self._tick_t0) * 1000.0)

        self.transport.on_written.append(written)

    def _on_tick(self, report: TickReport) -> None:
        self.last = report
        if self.measuring:
            self.reports.append(TickFigures.of(report))

    def steering_all(self) -> bool:
        last = getattr(self, "last", None)
        return last is not None and len(last.uuids) == self.n_gpus and not last.waiting_nodes


def rss_mb() -> float:
    """This process's resident memory now (VmRSS), MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def show_allocations(snapshot: tracemalloc.Snapshot, top: int) -> None:
    """The Python allocations alive since the fleet was steered, by where they were made
    (memory of numba's compiled code and of C libraries is not traced)."""
    stats = snapshot.statistics("traceback")
    total = sum(s.size for s in stats)
    print(f"traced since steering: {total / 2**20:.1f} MB", file=sys.stderr)
    for s in stats[:top]:
        frame = next((f for f in s.traceback if "/powerd/" in f.filename), s.traceback[0])
        print(
            f"  {s.size / 2**20:7.1f} MB {s.count:8d} blocks  {frame.filename}:{frame.lineno}",
            file=sys.stderr,
        )


def bench(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    """Broker and fleet simulator here; the controller's part in `measure`."""
    policy_file = workdir / "policy.yaml"
    write_policy(policy_file, args.gpus, args.tick, args.ack_ticks)
    db = f"sqlite:///{workdir / 'powerd.db'}"
    upgrade(db)
    with LocalMosquitto(workdir / "mosquitto", extra_config=BENCH_BROKER_LIMITS) as broker:
        assert broker._proc is not None
        sim = subprocess.Popen(
            [
                *(sys.executable, str(BENCH / "fleetsim.py")),
                *("--broker", broker.url, "--policy", str(policy_file)),
                *("--period", str(args.tick)),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert sim.stdout is not None
            line = sim.stdout.readline()
            if not line.startswith('{"ready"'):
                raise SystemExit(f"fleet simulator failed to start: {line!r}")
            result = asyncio.run(
                measure(args, policy_file, broker.url, db, broker._proc.pid, sim.pid)
            )
        finally:
            sim.terminate()
            try:
                out, _ = sim.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                sim.kill()
                out, _ = sim.communicate()
    result["fleetsim"] = json.loads(out.strip().splitlines()[-1]) if out.strip() else {}
    return result


async def measure(
    args: argparse.Namespace, policy_file: Path, broker: str, db: str, broker_pid: int, sim_pid: int
) -> dict[str, Any]:
    rss = {"imports": rss_mb()}
    run = Run(policy_file, broker, db, window=args.window)
    run.writer.start()
    stop = asyncio.Event()
    task = asyncio.create_task(
        run.controller.run(stop, learn_s=2 * args.tick), name="bench-controller"
    )
    deadline = time.monotonic() + 120
    while not run.steering_all():
        if task.done() or time.monotonic() > deadline:
            raise SystemExit("the controller never steered the whole fleet")
        await asyncio.sleep(0.1)
    print(f"steering {run.n_gpus} GPUs; warming up", file=sys.stderr, flush=True)
    rss["steering"] = rss_mb()
    if args.tracemalloc:
        tracemalloc.start(25)
    run.watch_writes()
    await asyncio.sleep(args.warmup)
    counters = run.controller.counters
    profiler = cProfile.Profile() if args.profile else None
    c0, w0 = cpu_s(), time.monotonic()
    b0, s0 = proc_cpu_s(broker_pid), proc_cpu_s(sim_pid)
    sent0, received0 = counters.caps_sent, sum(counters.received.values())
    ack0 = counters.ack_ticks
    rss["warm"] = rss_mb()
    run.measuring = True
    if profiler is not None:
        profiler.enable()
    await asyncio.sleep(args.duration)
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(args.profile)
    run.measuring = False
    rss["measured"] = rss_mb()
    if args.tracemalloc:
        show_allocations(tracemalloc.take_snapshot(), args.tracemalloc)
        tracemalloc.stop()
    wall = time.monotonic() - w0
    ctl_cpu = cpu_s() - c0
    broker_cpu = proc_cpu_s(broker_pid) - b0
    sim_cpu = proc_cpu_s(sim_pid) - s0
    sent = counters.caps_sent - sent0
    received = sum(counters.received.values()) - received0
    print("measured; stopping", file=sys.stderr, flush=True)
    stop.set()
    await task
    await asyncio.to_thread(run.writer.stop)
    reports = run.reports
    dur = [r.duration_ms for r in reports]
    return {
        "gpus": run.n_gpus,
        "nodes": len(run.policy.node_names()),
        "tick_s": args.tick,
        "measured_s": round(wall, 1),
        "ticks": len(reports),
        "tick_ms_all": [round(r.duration_ms, 1) for r in reports],
        "tick_ms": {"median": statistics.median(dur), "p99": pct(dur, 99), "max": max(dur)},
        "solve_ms_median": statistics.median(r.solve_ms for r in reports),
        "plan_ms_median": statistics.median(r.plan_ms for r in reports),
        "publish_ms": {"median": statistics.median(run.publish_ms), "p99": pct(run.publish_ms, 99)},
        "written_ms": {
            "ticks": len(run.written_ms),
            "not_written_before_next_tick": run.unwritten_ticks,
            "median": statistics.median(run.written_ms) if run.written_ms else float("nan"),
            "p99": pct(run.written_ms, 99),
            "max": max(run.written_ms, default=float("nan")),
            "all": [round(v, 1) for v in run.written_ms],
        },
        "controller_cpu_pct": 100 * ctl_cpu / wall,
        "controller_peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        # VmRSS at each stage: imports done, steering every GPU, after the warm-up, at the end
        "controller_rss_mb": rss,
        "broker_cpu_pct": 100 * broker_cpu / wall,
        "fleetsim_cpu_pct": 100 * sim_cpu / wall,
        "commands_per_s": sent / wall,
        # of the ticks, those on acks (control.ack_ticks: raises held for their cuts' acks)
        "ack_ticks": counters.ack_ticks - ack0,
        "messages_in_per_s": received / wall,
        "controller_dropped": dict(counters.dropped),
        "transport_dropped": run.transport.dropped_messages,
        "ticks_over_budget": sum(r.over for r in reports),
        "ticks_with_stale_gpus": sum(r.stale for r in reports),
        "machine": machine(),
    }


def show(r: dict[str, Any]) -> None:
    t = r["tick_ms"]
    print(
        f"{r['gpus']:,} GPUs ({r['nodes']} nodes), tick {r['tick_s']:g} s, "
        f"{r['ticks']} ticks ({r['ack_ticks']} on acks) over {r['measured_s']} s on "
        f"{r['machine']['nproc']} × "
        f"{r['machine']['cpu']}"
    )
    print(
        f"  tick start → last cap published: median {t['median']:.1f} ms, "
        f"p99 {t['p99']:.1f} ms, max {t['max']:.1f} ms"
    )
    w = r["written_ms"]
    print(
        f"  tick start → last cap written to the socket: median {w['median']:.1f} ms, "
        f"p99 {w['p99']:.1f} ms, max {w['max']:.1f} ms ({w['ticks']} ticks)"
    )
    print(
        f"    solve {r['solve_ms_median']:.1f} ms, plan {r['plan_ms_median']:.1f} ms, publish "
        f"{r['publish_ms']['median']:.1f} ms (medians); publish p99 {r['publish_ms']['p99']:.1f} ms"
    )
    print(
        f"  controller CPU {r['controller_cpu_pct']:.0f}% of one core, peak RSS "
        f"{r['controller_peak_rss_mb']:.0f} MB; broker {r['broker_cpu_pct']:.0f}%, fleet "
        f"simulator {r['fleetsim_cpu_pct']:.0f}%"
    )
    rss = r["controller_rss_mb"]
    print("  controller RSS: " + ", ".join(f"{stage} {mb:.0f} MB" for stage, mb in rss.items()))
    print(
        f"  {r['commands_per_s']:.0f} commands/s out, {r['messages_in_per_s']:.0f} messages/s in; "
        f"ticks over budget {r['ticks_over_budget']}, with stale GPUs "
        f"{r['ticks_with_stale_gpus']}; dropped {r['controller_dropped'] or 0}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, choices=sorted(SHAPES), default=1000)
    parser.add_argument("--tick", type=float, default=1.0, help="tick and telemetry period, s")
    parser.add_argument("--duration", type=float, default=60.0, help="measured seconds")
    parser.add_argument("--warmup", type=float, default=15.0, help="seconds before measuring")
    parser.add_argument("--profile", help="write a cProfile of the measured window here")
    parser.add_argument(
        "--window",
        type=int,
        default=ControllerSettings.model_fields["command_window"].default,
        help="the controller's QoS 1 window, as its command_window setting (0: no limit)",
    )
    parser.add_argument(
        "--ack-ticks",
        type=int,
        default=None,
        help="the policy's control.ack_ticks (default: the policy's default)",
    )
    parser.add_argument("--json", action="store_true")
    parser.add_argument(
        "--tracemalloc",
        type=int,
        default=0,
        metavar="N",
        help="trace Python allocations from the first steered tick; print the N largest sites",
    )
    args = parser.parse_args()
    configure_logging("json", "error")
    # A hung run (a broker or simulator that stopped answering) shows where it hangs.
    faulthandler.dump_traceback_later(args.warmup + args.duration + 300, exit=True)
    with tempfile.TemporaryDirectory(prefix="powerd-bench-loop-") as tmp:
        result = bench(args, Path(tmp))
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)


if __name__ == "__main__":
    main()
