"""Load generator for bench/loop.py: every node of a policy's fleet, on one MQTT connection.

A thousand agent processes (or a thousand MQTT clients in one process) would measure the
load generator more than the controller. This process plays every node instead, speaking
the wire protocol exactly as `powerd agent` does, from one connection:

- one `SimulatedGpus` (powerd/backends/mock.py) holds every GPU: draw follows min(cap,
  demand) with a lag, energy integrates, demand follows a job's pattern (a quarter of the
  nodes serve inference, a fifth run batch jobs, the rest train, phases staggered per node);
- every period each node's `NodeTelemetry` is published (QoS 0), spread evenly over the
  period as independently started agents would be, not in one burst;
- every `CapCommand` is validated (`powerd.wire.decode`, as the agent does), its caps
  clamped to the device limits and applied to the model, and answered with a `CapAck`
  (QoS 1) carrying the enforced caps, then the node's retained `NodeStatus` (QoS 1), as the
  agent does after every command. The answers to every command read in one pass go to the
  client in one batch, without waiting for each PUBACK, as separate agents would not wait
  for each other;
- a command whose tick is not above the node's last one is dropped (`stale_tick`).

Not simulated: the lease and failsafe (the bench's controller never stops), NVML latency.
At the end (SIGTERM/SIGINT) it prints one JSON line of counts and its own CPU time.

    .venv/bin/python bench/fleetsim.py --broker mqtt://127.0.0.1:1883 --policy policy.yaml
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import resource
import signal
import time
from typing import Any

import numpy as np

from powerd.backends.mock import SimulatedGpus, Workload
from powerd.logs import configure_logging
from powerd.policy import load_policy
from powerd.transport import Message, MqttConfig, MqttTransport, TransportError
from powerd.transport.base import cancel_and_wait
from powerd.wire import CapCommand, NodeTelemetry, Topics, WireError, decode

TOPICS = Topics()
CHUNKS = 20  # telemetry goes out in this many slices per period
THROTTLE = {False: "[]", True: '["sw_power_cap"]'}
MODEL_STEP_S = 0.005  # while commands arrive, the model moves on at most this often


class FleetSim:
    def __init__(self, nodes: list[tuple[str, int]], broker: str, period_s: float, seed: int):
        self.period_s = period_s
        self.node_names = [name for name, _ in nodes]
        self.first: list[int] = []
        n = 0
        for _, gpus in nodes:
            self.first.append(n)
            n += gpus
        self.first.append(n)
        workloads = []
        rng = np.random.default_rng(seed)
        for _, gpus in nodes:
            draw = rng.random()
            phase = float(rng.uniform(0, 10))
            if draw < 0.25:
                w = Workload.inference(phase_s=phase * 8640)
            elif draw < 0.45:
                w = Workload.steady(level_w=float(rng.uniform(350, 650)))
            else:
                w = Workload.training(phase_s=phase)
            workloads += [w] * gpus
        self.model = SimulatedGpus(
            n, workloads, seed=seed, start_s=time.monotonic(), uuid_prefix="GPU-sim"
        )
        self.index = {u: i for i, u in enumerate(self.model.uuids)}
        self.node_of = {name: k for k, name in enumerate(self.node_names)}
        self.last_tick = [-1] * len(nodes)
        self.seq = [0] * len(nodes)
        self._static = [
            self._gpu_static(i, k)
            for k in range(len(nodes))
            for i in range(self.first[k], self.first[k + 1])
        ]
        self.transport = MqttTransport(
            # One connection answers for every node: with a window of 20 QoS 1 messages ahead
            # of the broker's PUBACKs (MqttConfig's default), 2,500 answers a second at 10k
            # GPUs fell behind; each real agent has a window of its own.
            MqttConfig.from_url(
                broker,
                client_id="powerd-fleetsim",
                max_queued_messages=100_000,
                max_inflight_messages=200,
            )
        )
        self.counts = {
            "telemetry": 0,
            "commands": 0,
            "acks": 0,
            "statuses": 0,
            "rejected": 0,
            "publish_failed": 0,
        }
        self._pending: set[asyncio.Task[None]] = set()
        self._acks: list[tuple[str, bytes]] = []  # answers not yet handed to the client
        self._statuses: list[tuple[str, bytes]] = []

    # -- telemetry -----------------------------------------------------------------------

    def _gpu_static(self, i: int, k: int) -> str:
        """The GPU's fields that never change, as a JSON fragment (no braces)."""
        m = self.model
        fields = {
            "uuid": m.uuids[i],
            "index": i - self.first[k],
            "name": m.name,
            "min_cap_w": float(m.min_cap_w[i]),
            "max_cap_w": float(m.max_cap_w[i]),
            "default_cap_w": float(m.default_cap_w[i]),
            "workload": m.workload(i).name,
        }
        return json.dumps(fields)[1:-1]

    def telemetry_payloads(self, nodes: range) -> list[tuple[str, bytes]]:
        """Payloads of these nodes, written straight from the model's arrays as JSON text
        (not pydantic, not a dict per GPU: the simulator must stay cheaper than the
        controller it loads; `run` checks one payload against the protocol's model)."""
        m = self.model
        m.advance_to(time.monotonic())
        lo, hi = self.first[nodes.start], self.first[nodes.stop]
        sel = slice(lo, hi)
        columns = zip(
            self._static[lo:hi],
            m.power_w[sel].tolist(),
            m.energy_j[sel].tolist(),
            m.cap_w[sel].tolist(),
            m.temp_c[sel].tolist(),
            np.clip(m.util_pct(sel), 0, 100).tolist(),
            m.sm_clock_mhz(sel).tolist(),
            m.throughput(sel).tolist(),
            m.power_capped(sel).tolist(),
            strict=True,
        )
        gpus = [
            f'{{{static}, "power_w": {power!r}, "energy_j": {energy!r}, "cap_w": {cap!r}, '
            f'"temp_c": {temp!r}, "util_pct": {util!r}, "sm_clock_mhz": {clock!r}, '
            f'"perf": {perf!r}, "throttle": {THROTTLE[capped]}}}'
            for static, power, energy, cap, temp, util, clock, perf, capped in columns
        ]
        wall = time.time()
        out = []
        for k in nodes:
            node = self.node_names[k]
            state = "steered" if self.last_tick[k] >= 0 else "starting"
            body = ", ".join(gpus[self.first[k] - lo : self.first[k + 1] - lo])
            msg = (
                f'{{"v": 1, "node_id": {json.dumps(node)}, "ts": {wall!r}, "seq": {self.seq[k]}, '
                f'"period_s": {self.period_s!r}, "state": "{state}", "gpus": [{body}]}}'
            )
            self.seq[k] += 1
            out.append((TOPICS.telemetry(node), msg.encode()))
        return out

    async def telemetry_loop(self) -> None:
        n = len(self.node_names)
        bounds = [round(c * n / CHUNKS) for c in range(CHUNKS + 1)]
        slot = self.period_s / CHUNKS
        next_at = time.monotonic()
        while True:
            for c in range(CHUNKS):
                batch = self.telemetry_payloads(range(bounds[c], bounds[c + 1]))
                await self._publish_batch("telemetry", batch, qos=0)
                next_at += slot
                await asyncio.sleep(max(0.0, next_at - time.monotonic()))

    # -- commands ------------------------------------------------------------------------

    async def command_loop(self) -> None:
        async for message in self.transport.messages():
            self.on_command(message)

    def on_command(self, message: Message) -> None:
        node = message.topic.split("/")[-2]
        k = self.node_of.get(node)
        if k is None:
            self.counts["rejected"] += 1
            return
        try:
            cmd = decode(message.payload, CapCommand, topic_node=node)
        except WireError:
            self.counts["rejected"] += 1
            return
        self.counts["commands"] += 1
        if cmd.tick <= self.last_tick[k]:
            self.counts["rejected"] += 1
            return
        m = self.model
        now = time.monotonic()
        if now - m.t > MODEL_STEP_S:
            # A tick's 1,250 commands arrive within milliseconds: stepping all 10,000 GPUs for
            # each of them was half of this process's CPU.
            m.advance_to(now)
        acks: dict[str, dict[str, Any]] = {}
        plan = []  # (change, index, requested, target): decreases first, as the agent does
        for uuid, watts in cmd.caps.items():
            i = self.index.get(uuid)
            if i is None or not self.first[k] <= i < self.first[k + 1]:
                acks[uuid] = {"requested_w": watts}  # error: unknown_gpu
                continue
            target = min(max(watts, float(m.min_cap_w[i])), float(m.max_cap_w[i]))
            plan.append((target - float(m.cap_w[i]), i, watts, target))
        for _, i, watts, target in sorted(plan):
            acks[m.uuids[i]] = {"requested_w": watts, "enforced_w": m.set_cap(i, target)}
        self.last_tick[k] = cmd.tick
        wall = time.time()
        for a in acks.values():
            if "enforced_w" not in a:
                a["error"] = "unknown_gpu"
        ack = {"v": 1, "node_id": node, "tick": cmd.tick, "gpus": acks, "ts": wall}
        caps = {m.uuids[i]: float(m.cap_w[i]) for i in range(self.first[k], self.first[k + 1])}
        status = {
            "v": 1,
            "node_id": node,
            "state": "steered",
            "ts": wall,
            "last_tick": cmd.tick,
            "gpus": len(caps),
            "agent_version": "fleetsim",
            "caps_w": caps,
        }
        self._acks.append((TOPICS.ack(node), json.dumps(ack).encode()))
        self._statuses.append((TOPICS.status(node), json.dumps(status).encode()))
        if len(self._acks) == 1:
            # Commands arrive in a burst: answer every one read in this pass in one batch.
            asyncio.get_running_loop().call_soon(self._flush_answers)

    def _flush_answers(self) -> None:
        acks, statuses = self._acks, self._statuses
        self._acks, self._statuses = [], []
        task = asyncio.create_task(self._answer(acks, statuses))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _answer(
        self, acks: list[tuple[str, bytes]], statuses: list[tuple[str, bytes]]
    ) -> None:
        # Handed to the client without awaiting each PUBACK, as separate agents would not
        # wait for each other: the ack of every node goes before any status, as in the agent.
        await self._publish_batch("acks", acks, qos=1)
        await self._publish_batch("statuses", statuses, qos=1, retain=True)

    async def _publish_batch(
        self, kind: str, batch: list[tuple[str, bytes]], qos: int, retain: bool = False
    ) -> None:
        try:
            failed = await self.transport.publish_many(batch, qos=qos, retain=retain)
        except TransportError:
            failed = len(batch)
        self.counts["publish_failed"] += failed
        self.counts[kind] += len(batch) - failed

    async def _publish(self, topic: str, payload: bytes, qos: int, retain: bool = False) -> None:
        try:
            await self.transport.publish(topic, payload, qos=qos, retain=retain)
        except TransportError:
            self.counts["publish_failed"] += 1

    # -- running -------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        # One payload through the protocol's own validation: the fast JSON path stays exact.
        sample = decode(self.telemetry_payloads(range(1))[0][1], NodeTelemetry, self.node_names[0])
        gpu = sample.gpus[-1]
        i = self.first[1] - 1
        assert (gpu.uuid, gpu.power_w, gpu.cap_w) == (
            self.model.uuids[i],
            float(self.model.power_w[i]),
            float(self.model.cap_w[i]),
        ), "telemetry JSON does not carry the model's values"
        self.seq[0] = 0
        await self.transport.connect()
        await self.transport.subscribe(TOPICS.all_nodes("caps"), qos=1)
        await self.transport.wait_connected()
        for k, node in enumerate(self.node_names):
            caps = {
                self.model.uuids[i]: float(self.model.cap_w[i])
                for i in range(self.first[k], self.first[k + 1])
            }
            status = {"v": 1, "node_id": node, "state": "starting", "ts": time.time()}
            status |= {"gpus": len(caps), "agent_version": "fleetsim", "caps_w": caps}
            await self._publish(TOPICS.status(node), json.dumps(status).encode(), 1, True)
        print(json.dumps({"ready": True}), flush=True)
        tasks = [
            asyncio.create_task(self.telemetry_loop(), name="fleetsim-telemetry"),
            asyncio.create_task(self.command_loop(), name="fleetsim-commands"),
        ]
        await stop.wait()
        await cancel_and_wait([*tasks, *self._pending])
        await self.transport.disconnect()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--broker", required=True)
    parser.add_argument("--policy", required=True)
    parser.add_argument("--period", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    configure_logging("json", "warning")
    policy = load_policy(args.policy)
    nodes = [(g.name, g.gpus) for g in policy.groups if g.level == 3]
    sim = FleetSim(nodes, args.broker, args.period, args.seed)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    start = time.monotonic()
    await sim.run(stop)
    r = resource.getrusage(resource.RUSAGE_SELF)
    wall = time.monotonic() - start
    cpu = r.ru_utime + r.ru_stime
    print(
        json.dumps(
            sim.counts
            | {
                "cpu_s": cpu,
                "wall_s": wall,
                "cpu_pct": 100 * cpu / wall if wall > 0 else math.nan,
                "dropped_incoming": sim.transport.dropped_messages,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    asyncio.run(main())
