"""Two leaders of one authority at once: what steering through a database outage rests on.

A leader that cannot reach its database keeps commanding past its lease (docs/safety.md,
"Steering through a database outage"), so a standby that could reach the database leads
beside it, at a higher epoch, until the old one hears of it. Nothing here relies on the
lease's timing: the budget rests on the epoch fence (a node that applied the new leader's
command refuses the old one's), on the new leader counting every GPU at its maximum until it
acknowledges one of its commands (older-epoch acks resolve nothing), and on an agent never
raising a cap on a new leader's first command. The old leader is never told here: the
worst case, its controller status lost.

Real agents (their decisions, in `Agent._on_message`) and two real tick engines exchange
every message through a queue the test reorders at random; after each delivery the caps the
mock GPUs enforce are summed against every budget of the policy.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.honest import NODES, policy_dict

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.clock import ManualClock
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.topology import Topology
from powerd.transport.base import Message
from powerd.transport.memory import MemoryBroker
from powerd.wire import (
    Authority,
    CapAck,
    CapCommand,
    NodeStatus,
    NodeTelemetry,
    Topics,
    encode,
)

TOPICS = Topics()
SITE = Authority(site="dc", store="store-a", domain="dc")
TOL = 1e-6


class Site:
    """Four nodes with real agents, two engines of one authority, a message queue."""

    def __init__(self, seed: int) -> None:
        self.policy = parse_policy(policy_dict())
        self.clock = ManualClock(start=1000.0)
        self.agents: dict[str, Agent] = {}
        self.fleets: dict[str, SimulatedGpus] = {}
        # (to: "agent", or an engine's index as "0" / "1", message): each engine hears each
        # node message on its own, in its own order, or not at all (QoS 0, a reconnect).
        self.queue: list[tuple[str, Any]] = []
        for k, name in enumerate(NODES):
            fleet = SimulatedGpus(
                4,
                # Every GPU on its own phase: power moves between GPUs, nodes and racks.
                [Workload.training(phase_s=1.7 * (4 * k + i), period_s=5.0) for i in range(4)],
                seed=seed + k,
                start_s=self.clock.monotonic(),
                uuid_prefix=f"GPU-{name}",
            )
            agent = Agent(
                AgentSettings(node_id=name, backend="mock", period_s=1.0, failsafe_w=200.0),
                MockBackend(fleet, self.clock),
                MemoryBroker().client(),
                self.clock,
            )
            agent._send = self._sender(name)  # type: ignore[method-assign]
            agent._enforce_failsafe()  # as an agent starts
            self.agents[name], self.fleets[name] = agent, fleet
        self.engines = [TickEngine(self.policy), TickEngine(self.policy)]
        for engine in self.engines:
            engine.obedience.authority = SITE
        self.topology = Topology.build(
            self.policy, [n for n in NODES for _ in range(4)]
        )  # GPUs in node order, as `caps_now` lists them
        self.worst_w = 0.0

    def _sender(self, node: str) -> Any:
        async def send(kind: str, topic: str, msg: Any, qos: int, retain: bool = False) -> None:
            self.queue += [("0", msg), ("1", msg)]

        return send

    def caps_now(self) -> np.ndarray:
        return np.concatenate([np.asarray(self.fleets[n].cap_w, dtype=float) for n in NODES])

    def check(self) -> None:
        """The caps the GPUs enforce, plus overhead, fit every budget of the policy."""
        sums = self.topology.group_sums(self.caps_now()) + self.topology.overhead_w
        over = sums - self.topology.budget_w
        self.worst_w = max(self.worst_w, float(over.max()))
        assert (over <= TOL).all(), dict(
            zip(self.topology.names, over.round(1).tolist(), strict=True)
        )

    async def sample(self) -> None:
        for agent in self.agents.values():
            await agent._publish_telemetry()

    def tick(self, k: int, epoch: int) -> None:
        engine = self.engines[k]
        engine.obedience.epoch = epoch
        now = self.clock.monotonic()
        _, plan = engine.step(now, self.clock.wall())
        for cmd in plan.commands:
            wire = cmd.to_wire(self.clock.wall(), f"ctl-{k}", epoch, SITE)
            self.queue.append(("agent", wire))

    async def deliver(self, i: int) -> None:
        to, msg = self.queue.pop(i)
        if to == "agent":
            assert isinstance(msg, CapCommand)
            agent = self.agents[msg.node_id]
            await agent._on_message(Message(TOPICS.caps(msg.node_id), encode(msg)))
            self.check()
            return
        now = self.clock.monotonic()
        engine = self.engines[int(to)]
        if isinstance(msg, NodeTelemetry):
            engine.on_telemetry(msg, now)
        elif isinstance(msg, CapAck):
            engine.on_ack(msg.node_id, msg)
        elif isinstance(msg, NodeStatus):
            engine.on_status(msg.node_id, msg)

    async def drain(self) -> None:
        while self.queue:
            await self.deliver(0)


Action = tuple[str, int]


@pytest.mark.slow  # seconds of CPU: many outages
@settings(
    max_examples=60,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    st.integers(0, 1000),
    st.lists(
        st.tuples(
            st.sampled_from(
                ["old", "new", "deliver", "deliver", "deliver", "drop", "sample", "time", "pin"]
            ),
            st.integers(0, 10_000),
        ),
        min_size=10,
        max_size=120,
    ),
)
def test_two_leaders_of_one_authority_never_exceed_a_budget(
    seed: int, actions: list[Action]
) -> None:
    async def run() -> None:
        site = Site(seed)
        # The old leader steers alone for a while; the standby hears everything.
        for _ in range(6):
            await site.sample()
            await site.drain()
            site.tick(0, 1)
            await site.drain()
            site.clock.advance(1.0)
        # Its database is gone; the standby took the lease at epoch 2. Both command now,
        # and the old one never hears of the new (its controller status lost).
        for what, n in actions:
            if what == "old":
                site.tick(0, 1)
            elif what == "new":
                site.tick(1, 2)
            elif what == "deliver" and site.queue:
                await site.deliver(n % len(site.queue))
            elif what == "drop":  # a message to an engine lost (commands are QoS 1)
                lost = [i for i, (to, _) in enumerate(site.queue) if to != "agent"]
                if lost:
                    site.queue.pop(lost[n % len(lost)])
            elif what == "sample":
                await site.sample()
            elif what == "time":
                site.clock.advance(0.5)
            elif what == "pin":
                # An operator pins (or unpins) a GPU through the old leader: it cuts there
                # and hands the room to other GPUs, which the new one may not have heard.
                node = NODES[n % len(NODES)]
                uuid = list(site.agents[node].gpus)[(n // 4) % 4]
                pins = site.engines[0].overrides.pins
                if pins.pop(uuid, None) is None:
                    pins[uuid] = 200.0
        await site.drain()
        # The new leader fenced the nodes it commanded: the old one's commands to those are
        # refused from then on.
        fenced = [a for a in site.agents.values() if a.epoch == 2]
        for agent in fenced:
            before = agent.fenced
            old = CapCommand(
                node_id=agent.node_id,
                tick=10**9,
                epoch=1,
                authority=SITE,
                lease_s=4.0,
                caps=dict.fromkeys(agent.gpus, 700.0),
                failsafe_w=dict.fromkeys(agent.gpus, 200.0),
            )
            await agent._on_message(Message(TOPICS.caps(agent.node_id), encode(old)))
            assert agent.fenced == before + 1
        site.check()

    asyncio.run(run())


def test_a_new_leader_steers_every_node_once_they_ack_its_epoch() -> None:
    """Availability: with the old leader still sending, the new one brings every node
    under its epoch and then raises where the budget allows (no node stuck at its cut)."""

    async def run() -> None:
        site = Site(7)
        for _ in range(6):
            await site.sample()
            await site.drain()
            site.tick(0, 1)
            await site.drain()
            site.clock.advance(1.0)
        for _ in range(8):
            site.tick(0, 1)  # the old leader, through its outage
            site.tick(1, 2)
            await site.drain()
            await site.sample()
            await site.drain()
            site.clock.advance(1.0)
        assert {a.epoch for a in site.agents.values()} == {2}
        new = site.engines[1]
        assert not new.foreign_nodes()
        # The new leader's view is no longer at every GPU's maximum: it steers the budget.
        total = float(site.caps_now().sum())
        assert 5000.0 < total <= 7000.0 + TOL
        # The old leader sees every node obey a newer leader and counts them at maximum.
        assert "newer leader" in site.engines[0].alarms.active["foreign_authority"]

    asyncio.run(run())
