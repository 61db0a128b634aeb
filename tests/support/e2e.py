"""The steering loop across processes, as the end-to-end tests run it (test_e2e, test_ha,
test_scopes, test_shadow, test_attack_ha): a small site whose every level binds, each part a
`powerd` process of its own (`Procs`), and a monitor that subscribes to everything and
checks every budget after every message, from the messages alone (`Monitor`)."""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from powerd.policy import GroupDef, Policy, subtree_totals
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.transport import Message, MqttConfig, MqttTransport
from powerd.wire import CapAck, CapCommand, NodeState, NodeStatus, NodeTelemetry, Topics, decode

TICK_S = 0.5


LEASE_S = 3.0


PERIOD_S = 0.5  # agents' telemetry period, which is also how often they check the lease


GPUS = 4


FAILSAFE_W = 250.0


NODES = ("rack-1-n1", "rack-1-n2", "rack-2-n1", "rack-2-n2")


# Budgets are floats summed in different orders by the allocator and by us.
TOL_W = 0.01


# NVML rounds limits; the agent reads a cap within this of the target as the target.
CAP_TOL_W = 1.0


WAIT_S = 60.0  # generous: six Python processes share the CPUs with whatever else runs


TOPICS = Topics()


def site_policy(rack_1_w: float = 4400, node_w: float = 2500) -> dict[str, Any]:
    """2 racks × 2 nodes × 4 GPUs (200–700 W): every level binds, the facility first."""
    return {
        "version": 1,
        "facility": {
            "name": "dc",
            "budget_w": 8000,
            "rows": [
                {
                    "name": "row",
                    "racks": [
                        {
                            "name": "rack-1",
                            "budget_w": rack_1_w,
                            "nodes": [
                                {"name": "rack-1-n{1..2}", "budget_w": 2500, "overhead_w": 100}
                            ],
                        },
                        {
                            "name": "rack-2",
                            "budget_w": 4400,
                            "nodes": [
                                {"name": "rack-2-n1", "budget_w": node_w, "overhead_w": 100},
                                {"name": "rack-2-n2", "budget_w": 2500, "overhead_w": 100},
                            ],
                        },
                    ],
                }
            ],
        },
        **TRAIN_AND_INFER,
        "defaults": {"class": "training", "failsafe_w": FAILSAFE_W, "gpus_per_node": GPUS},
        "control": {"tick_s": TICK_S, "lease_s": LEASE_S, "stale_after_s": 3 * TICK_S},
    }


@dataclass
class NodeView:
    applied: int = -1  # last tick the agent applied, from acks and statuses
    epoch: int = 0  # the highest epoch it applied: it refuses commands of lower ones
    # (epoch, tick) → caps sent; agents order commands by both (docs/protocol.md)
    pending: dict[tuple[int, int], dict[str, float]] = field(default_factory=dict)
    readings: dict[str, tuple[float, float]] = field(default_factory=dict)  # uuid → (ts, W)
    status: NodeStatus | None = None
    statuses: list[NodeStatus] = field(default_factory=list)
    telemetry_state: str | None = None
    commands: list[CapCommand] = field(default_factory=list)
    acks: list[CapAck] = field(default_factory=list)

    def committed(self) -> dict[str, float]:
        """Per GPU: the highest cap that may be in force now or later."""
        out = {u: w for u, (_, w) in self.readings.items()}
        for caps in self.pending.values():
            for u, w in caps.items():
                out[u] = max(out.get(u, 0.0), w)
        return out

    def read(self, uuid: str, ts: float, watts: float) -> None:
        if ts >= self.readings.get(uuid, (-math.inf, 0.0))[0]:
            self.readings[uuid] = (ts, watts)


class Monitor:
    """Subscribes to everything and checks every budget after every message."""

    def __init__(self, broker_url: str, policy: Policy) -> None:
        self.transport = MqttTransport(MqttConfig.from_url(broker_url, client_id="e2e-monitor"))
        self.groups: tuple[GroupDef, ...] = policy.groups
        self.budget_w = [g.budget_w for g in self.groups]
        self.overhead_w = subtree_totals(self.groups, [g.overhead_w for g in self.groups])
        self.nodes: dict[str, NodeView] = {n: NodeView() for n in NODES}
        self.ticks: list[int] = []  # tick of every command, in arrival order
        self.checks = 0
        self.breaches: list[str] = []
        self.bad: list[str] = []  # messages that did not decode
        self.committed_w: list[float] = [0.0] * len(self.groups)  # at the last check
        self._cut: tuple[list[float], int] | None = None  # (budgets, strict from tick)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.transport.connect()
        await self.transport.subscribe(f"{TOPICS.prefix}/#", qos=1)
        await asyncio.wait_for(self.transport.wait_connected(), WAIT_S)
        self._task = asyncio.create_task(self._listen(), name="e2e-monitor")

    async def stop(self) -> None:
        await self.transport.disconnect()
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait_for(self._task, 5)

    async def _listen(self) -> None:
        async for message in self.transport.messages():
            self.handle(message)

    @property
    def last_tick(self) -> int:
        return max(self.ticks, default=0)

    def cut(self, budgets: list[float], strict_from_tick: int) -> None:
        """New budgets, to hold once commands of `strict_from_tick` are seen; until then the
        old ones still hold (a cut lowers them: the controller may not raise past either)."""
        self._cut = (budgets, strict_from_tick)

    def handle(self, message: Message) -> None:
        parts = message.topic.split("/")
        if parts[:3] != ["powerd", "v1", "nodes"] or len(parts) != 5:
            return  # the controller's status
        node, kind = parts[3], parts[4]
        view = self.nodes.get(node)
        if view is None:
            self.bad.append(f"message from unknown node {node}")
            return
        try:
            if kind == "caps":
                cmd = decode(message.payload, CapCommand, topic_node=node)
                view.commands.append(cmd)
                self.ticks.append(cmd.tick)
                # The agent drops what it has passed: older epochs, and older ticks.
                if (cmd.epoch, cmd.tick) > (view.epoch, view.applied):
                    caps = dict(cmd.caps)
                    if cmd.epoch > view.epoch and all(k[0] != cmd.epoch for k in view.pending):
                        # The first command of a newer leader raises no cap (the agent's
                        # rule, docs/safety.md): at most what may be in force now.
                        now = view.committed()
                        caps = {u: min(w, now.get(u, w)) for u, w in caps.items()}
                    view.pending[(cmd.epoch, cmd.tick)] = caps
                if self._cut is not None and cmd.tick >= self._cut[1]:
                    self.budget_w = self._cut[0]
                    self._cut = None
            elif kind == "ack":
                ack = decode(message.payload, CapAck, topic_node=node)
                view.acks.append(ack)
                if ack.epoch > view.epoch:
                    view.epoch, view.applied = ack.epoch, ack.tick
                view.applied = max(view.applied, ack.tick)
                # Agents apply commands in (epoch, tick) order: every command up to this one
                # is settled, and one of a lower epoch can never land any more.
                done = (ack.epoch, ack.tick)
                for key in [k for k in view.pending if k <= done or k[0] < ack.epoch]:
                    requested = view.pending.pop(key)
                    if key == done:
                        for u, g in ack.gpus.items():
                            enforced = g.enforced_w if g.error is None else None
                            # A failed set leaves the cap unknown: keep the request as a bound.
                            view.read(u, ack.ts, requested[u] if enforced is None else enforced)
            elif kind == "telemetry":
                t = decode(message.payload, NodeTelemetry, topic_node=node)
                view.telemetry_state = t.state
                for g in t.gpus:
                    view.read(g.uuid, t.ts, g.cap_w)
            elif kind == "status":
                status = decode(message.payload, NodeStatus, topic_node=node)
                view.status = status
                view.statuses.append(status)
                if status.state is NodeState.STARTING:
                    # A new agent process applies any tick of the epoch it kept (its state
                    # directory; none: 0).
                    view.applied, view.epoch = -1, status.epoch
                elif status.epoch > view.epoch:
                    view.epoch = status.epoch
                    view.applied = -1 if status.last_tick is None else status.last_tick
                elif status.last_tick is not None and status.epoch == view.epoch:
                    view.applied = max(view.applied, status.last_tick)
                for key in [k for k in view.pending if k[0] < view.epoch]:
                    del view.pending[key]  # refused if it ever arrives
                # The last will knows no caps: the GPUs keep the ones last read.
                for u, w in status.caps_w.items():
                    view.read(u, status.ts, w)
        except Exception as exc:  # a protocol bug: report it, keep checking
            self.bad.append(f"{message.topic}: {exc}")
            return
        self.check(f"after {kind} from {node}")

    def check(self, where: str) -> None:
        per_node = [0.0] * len(self.groups)
        for i, g in enumerate(self.groups):
            if g.level == 3:
                caps = self.nodes[g.name].committed()
                # GPUs not heard of yet: an agent lowers them to failsafe before it connects.
                per_node[i] = sum(caps.values()) + max(0, g.gpus - len(caps)) * g.failsafe_w
        group_caps = subtree_totals(self.groups, per_node)
        budgets = self.budget_w
        if self._cut is not None:
            budgets = [max(a, b) for a, b in zip(budgets, self._cut[0], strict=True)]
        self.checks += 1
        for g, caps_w, overhead, budget in zip(
            self.groups, group_caps, self.overhead_w, budgets, strict=True
        ):
            if caps_w + overhead > budget + TOL_W:
                self.breaches.append(
                    f"{where}, last tick {self.last_tick}: {g.name} committed "
                    f"{caps_w:.2f} W + overhead {overhead:g} W > budget {budget:g} W"
                )
        self.committed_w = [c + o for c, o in zip(group_caps, self.overhead_w, strict=True)]

    def group_committed(self, name: str) -> float:
        return self.committed_w[next(i for i, g in enumerate(self.groups) if g.name == name)]


class Procs:
    """The powerd processes of one test, each with a log file; all killed at the end."""

    def __init__(self, workdir: Path, broker_url: str) -> None:
        self.workdir = workdir
        self.broker_url = broker_url
        self.running: dict[str, subprocess.Popen[bytes]] = {}
        self.started: dict[str, int] = {}

    def start(self, name: str, *args: str, env: dict[str, str] | None = None) -> None:
        n = self.started[name] = self.started.get(name, 0) + 1
        log = self.workdir / f"{name}.{n}.log"
        with log.open("wb") as out:
            self.running[name] = subprocess.Popen(
                [sys.executable, "-m", "powerd.cli", "--log-format", "json", *args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            )

    def agent(self, node: str) -> None:
        self.start(
            node,
            "agent",
            f"--node-id={node}",
            f"--broker={self.broker_url}",
            "--backend=mock",
            f"--mock-gpus={GPUS}",
            # One node serves inference (weight 4, with a floor), the rest train.
            f"--mock-workload={'inference' if node == NODES[0] else 'training'}",
            f"--failsafe-w={FAILSAFE_W}",
            f"--period={PERIOD_S}",
        )

    def controller(self, name: str, policy: Path, db: str) -> None:
        self.start(
            "controller",
            "controller",
            f"--policy={policy}",
            f"--broker={self.broker_url}",
            f"--db={db}",
            # The site's own state file (the default would be the working directory).
            f"--state-file={self.workdir / 'powerd-state.json'}",
            f"--controller-id={name}",
            f"--learn-s={TICK_S * 2}",
            # Every cap move stored (not one a GPU a minute), so the store can be checked
            # against the commands themselves.
            env={"POWERD_CAP_INTERVAL_S": "0"},
        )

    def signal(self, name: str, sig: signal.Signals) -> None:
        proc = self.running[name]
        assert proc.poll() is None, f"{name} exited early:\n{self.tail(name)}"
        proc.send_signal(sig)

    def kill(self, name: str) -> None:
        proc = self.running.pop(name)
        proc.kill()
        proc.wait()

    def stop(self, name: str) -> int:
        """SIGTERM and wait: a clean stop (failsafe caps, offline status, store flushed)."""
        proc = self.running.pop(name)
        proc.terminate()
        try:
            return proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise

    def tail(self, name: str, lines: int = 15) -> str:
        log = self.workdir / f"{name}.{self.started.get(name, 1)}.log"
        text = log.read_text(errors="replace") if log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        for name, proc in self.running.items():
            assert proc.poll() is None, f"{name} exited ({proc.returncode}):\n{self.tail(name)}"

    def close(self) -> None:
        for proc in self.running.values():
            proc.kill()
        for proc in self.running.values():
            proc.wait()
        self.running.clear()


@dataclass
class E2eSite:
    """The watcher and the processes of an end-to-end site, and the waits every test of one
    needs (a test's own site adds its parts)."""

    monitor: Monitor
    procs: Procs

    async def until(self, cond: Callable[[], bool], what: str, poll_s: float = 0.02) -> None:
        """Wait until `cond()`, failing with every process's log tail after WAIT_S, or at
        once when a process exited."""
        deadline = time.monotonic() + WAIT_S
        while not cond():
            self.procs.check_alive()
            if time.monotonic() > deadline:
                logs = "\n".join(f"-- {n}\n{self.procs.tail(n)}" for n in self.procs.running)
                pytest.fail(f"timed out waiting until {what}; {self.monitor.breaches}\n{logs}")
            await asyncio.sleep(poll_s)

    async def ticks(self, n: int) -> None:
        target = self.monitor.last_tick + n
        await self.until(lambda: self.monitor.last_tick >= target, f"tick {target}")
