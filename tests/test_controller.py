"""The steering loop end to end in one process: real agents, mock GPUs, in-process broker.

Time is a stepped clock, so every tick, lease and period is exact; after every step the
true caps in force on the agents are checked against every budget.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry
from support.clock import SteppedClock

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.controller.build import ControllerOptions, build_controller
from powerd.controller.controller import Controller
from powerd.controller.hooks import metrics_hook
from powerd.controller.overrides import OverrideError
from powerd.controller.report import TickReport
from powerd.controller.settings import ControllerSettings
from powerd.metrics import ControllerMetrics
from powerd.policy import Policy, PolicyError, parse_policy
from powerd.settings import SettingsError
from powerd.store import Retention, Store, StoreWriter, upgrade
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.transport import MemoryBroker, Message, MqttConfig, MqttTransport
from powerd.wire import Authority, CapAck, NodeState, Topics, encode

TICK = 1.0
LEASE = 4.0
GPUS = 4


def site_policy() -> dict[str, Any]:
    return {
        "facility": {
            "name": "dc",
            "budget_w": 8000,
            "rows": [
                {
                    "name": "row",
                    "racks": [
                        {
                            "name": "rack-{1..2}",
                            "budget_w": 4400,
                            "nodes": [
                                {
                                    "name": "{rack}-n{1..2}",
                                    "budget_w": 2500,
                                    "overhead_w": 100,
                                    "gpus": GPUS,
                                }
                            ],
                        }
                    ],
                }
            ],
        },
        **TRAIN_AND_INFER,
        "defaults": {"class": "training", "failsafe_w": 250},
        "control": {"tick_s": TICK, "lease_s": LEASE, "stale_after_s": 3.0},
    }


class Site:
    """A controller and four agents on one in-process broker, driven by a stepped clock."""

    def __init__(
        self, policy: Policy, clock: SteppedClock, store: Store | None, broker: Any = None
    ) -> None:
        self.policy = policy
        self.clock = clock
        self.broker = MemoryBroker() if broker is None else broker  # anything with `client`
        self.store = store
        self.writer = StoreWriter(store) if store is not None else None
        self.writer_started = False
        nodes = policy.node_names()
        workloads = [
            Workload.inference(burst_prob=0.0) if k == 0 else Workload.training()
            for k in range(len(nodes))
            for _ in range(GPUS)
        ]
        self.model = SimulatedGpus(len(workloads), workloads, seed=1, start_s=clock.now)
        self.agents: dict[str, Agent] = {}
        self.stops: dict[str, asyncio.Event] = {}
        self.tasks: dict[str, asyncio.Task[None]] = {}
        for k, node in enumerate(nodes):
            self.start_agent(node, k * GPUS)
        self.controller: Controller | None = None
        self.reports: list[TickReport] = []
        self.breaches: list[str] = []

    def start_agent(self, node: str, first: int) -> None:
        settings = AgentSettings(node_id=node, backend="mock", period_s=TICK, failsafe_w=250)
        agent = Agent(
            settings,
            MockBackend(self.model, self.clock, first, GPUS),
            self.broker.client(f"agent-{node}"),
            self.clock,
        )
        self.agents[node] = agent
        self.stops[node] = asyncio.Event()
        self.tasks[node] = asyncio.create_task(agent.run(self.stops[node]), name=node)

    def start_controller(self, solver: str = "fast", name: str = "controller") -> Controller:
        if self.writer is not None and not self.writer_started:
            self.writer.start()
            self.writer_started = True
        ctl = build_controller(
            self.policy,
            self.broker.client(name),
            self.clock,
            ControllerOptions(controller_id=name, solver=solver),
            store=self.store,
            writer=self.writer,
        )
        ctl.on_tick.append(self.reports.append)
        self.controller = ctl
        self.stops[name] = asyncio.Event()
        self.tasks[name] = asyncio.create_task(ctl.run(self.stops[name], learn_s=TICK), name=name)
        return ctl

    def true_caps(self) -> dict[str, float]:
        caps: dict[str, float] = {}
        for agent in self.agents.values():
            caps.update(agent.caps_w)
        return caps

    def check_budgets(self, budgets: dict[str, float] | None = None) -> None:
        """Σ caps in force + overhead ≤ budget for every group, right now."""
        caps = self.true_caps()
        groups = self.policy.groups
        totals = [0.0] * len(groups)
        for i, g in enumerate(groups):
            if g.level == 3:
                agent = self.agents.get(g.name)
                node_caps = [caps[u] for u in agent.caps_w] if agent else []
                totals[i] = sum(node_caps) + g.overhead_w
        for i in range(len(groups) - 1, 0, -1):
            totals[groups[i].parent] += totals[i]
        for g, total in zip(groups, totals, strict=True):
            budget = min(g.budget_w, (budgets or {}).get(g.name, float("inf")))
            if total > budget + 1e-6:
                self.breaches.append(f"t={self.clock.now}: {g.name} {total:.1f} > {budget:.1f}")

    async def settle(self) -> None:
        for _ in range(60):
            await asyncio.sleep(0)

    async def step(self, seconds: float = TICK, budgets: dict[str, float] | None = None) -> None:
        """Advance in quarter ticks, checking every budget after each."""
        for _ in range(round(seconds / (TICK / 4))):
            self.clock.advance(TICK / 4)
            await self.settle()
            self.check_budgets(budgets)

    async def close(self) -> None:
        for stop in self.stops.values():
            stop.set()
        for _ in range(20):
            self.clock.advance(TICK)
            await self.settle()
        for task in self.tasks.values():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.writer is not None:
            await asyncio.to_thread(self.writer.stop)


@pytest.fixture
async def site(stepped_clock: SteppedClock, tmp_path: Path) -> AsyncIterator[Site]:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    s = Site(parse_policy(site_policy(), "site.yaml"), stepped_clock, Store(url))
    await s.settle()
    try:
        yield s
    finally:
        await s.close()


async def test_steers_every_gpu_and_keeps_every_budget_at_every_moment(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(12 * TICK)
    assert site.breaches == []
    last = site.reports[-1]
    assert last.status == "optimal"
    assert not last.group_over.any()
    caps = site.true_caps()
    assert len(caps) == 4 * GPUS
    # Steering moved caps off the 250 W failsafe, and the inference node got at least its floor.
    inference = [caps[u] for u in site.agents["rack-1-n1"].caps_w]
    assert min(inference) >= 350 - 1e-6
    assert max(caps.values()) > 300
    assert all(a.state is NodeState.STEERED for a in site.agents.values())
    # Power left after demand is handed out: the facility (the binding level: its 8 kW is
    # less than the racks' 2 × 4.4 kW) runs at its budget.
    assert last.group_committed_w[0] == pytest.approx(8000.0, abs=1.0)
    assert ctl.counters.caps_sent >= 4 * 8
    # What the controller remembers of each tick (the API's /ticks without a store): the
    # facility's figures, not the per-GPU arrays.
    assert [h.tick for h in ctl.history] == [r.tick for r in site.reports]
    h = ctl.history[-1]
    assert (h.budget_w, h.committed_w, h.draw_w) == (
        last.group_budget_w[0],
        last.group_committed_w[0],
        last.group_draw_w[0],
    )
    assert (h.gpus, h.gpus_stale, h.throughput) == (4 * GPUS, 0, last.throughput_total)


async def test_budget_cut_is_obeyed_within_two_ticks(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(8 * TICK)
    assert site.breaches == []
    ctl.set_budget("dc", 6000, expires_at=None, actor="grid", reason="demand response")
    cut_at = site.clock.now
    await site.step(2 * TICK)
    site.breaches.clear()
    await site.step(6 * TICK, budgets={"dc": 6000})
    assert site.breaches == [], f"cut made at t={cut_at}"
    assert site.reports[-1].group_budget_w[0] == 6000
    assert site.reports[-1].group_committed_w[0] <= 6000 + 1e-6
    # Clearing the override lets the site use its full budget again.
    ctl.clear_budget("dc", actor="grid", reason="event over")
    await site.step(6 * TICK)
    assert site.reports[-1].group_committed_w[0] > 6000
    assert site.breaches == []


async def test_temporary_budget_expires_on_its_own(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(4 * TICK)
    ctl.set_budget(
        "rack-1",
        3000,
        expires_at=site.clock.wall() + 3 * TICK,
        actor="op",
        reason="breaker maintenance",
    )
    await site.step(2 * TICK)
    assert "rack-1" in ctl.overrides.budgets
    await site.step(4 * TICK)
    assert "rack-1" not in ctl.overrides.budgets
    with pytest.raises(OverrideError, match="unknown group"):
        ctl.set_budget("nope", 100, expires_at=None, actor="op", reason="x")
    with pytest.raises(OverrideError, match="can only lower"):
        ctl.set_budget("rack-1", 5000, expires_at=None, actor="op", reason="x")


async def test_dead_controller_sends_nodes_to_failsafe_and_a_new_one_resumes(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(6 * TICK)
    # The controller process dies: its connection drops without a goodbye.
    ctl.transport.crash()  # type: ignore[attr-defined]
    site.tasks["controller"].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await site.tasks["controller"]
    await site.step(LEASE + 2 * TICK)
    assert all(a.state is NodeState.FAILSAFE for a in site.agents.values())
    assert max(site.true_caps().values()) <= 250 + 1e-6
    # A new controller learns the caps in force before it raises any, and resumes steering.
    new = site.start_controller()
    # It numbers its ticks above those the agents applied (learnt from retained status), so
    # its first commands are accepted at once: steering is back within three ticks.
    await site.step(3 * TICK)
    assert all(a.state is NodeState.STEERED for a in site.agents.values())
    await site.step(5 * TICK)
    assert max(site.true_caps().values()) > 300
    assert new.last_tick is not None and not new.last_tick.group_over.any()
    assert site.breaches == []


async def test_a_deposed_leader_moves_no_cap(site: Site) -> None:
    # Two controllers command the same nodes: the old leader (epoch 1) does not know it
    # was deposed and keeps sending. Agents follow the higher epoch and fence the other.
    old = site.start_controller(name="old")
    old.epoch = 1
    await site.step(6 * TICK)
    assert all(a.epoch == 1 for a in site.agents.values())
    new = site.start_controller(name="new")
    new.epoch = 2
    await site.step(8 * TICK)
    assert all(a.epoch == 2 and a.state is NodeState.STEERED for a in site.agents.values())
    # The old leader went on ticking, and every command it sent since was refused.
    assert old.counters.caps_sent > 6 * 4
    assert all(a.fenced >= 4 for a in site.agents.values())
    assert sum(a.rejected["stale_epoch"] for a in site.agents.values()) == sum(
        a.fenced for a in site.agents.values()
    )
    assert new.last_tick is not None and not new.last_tick.group_over.any()
    assert site.breaches == []


async def test_restarted_agent_is_readmitted(site: Site) -> None:
    site.start_controller()
    await site.step(6 * TICK)
    node = "rack-2-n2"
    site.agents[node].transport.crash()  # type: ignore[attr-defined]
    site.tasks[node].cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await site.tasks[node]
    await site.step(5 * TICK)
    site.start_agent(node, 3 * GPUS)
    await site.step(6 * TICK)
    assert site.agents[node].state is NodeState.STEERED
    assert site.breaches == []


async def test_solver_failure_falls_back_to_failsafe_caps_with_an_alarm(site: Site) -> None:
    ctl = site.start_controller(solver="no-such-solver")
    await site.step(6 * TICK)
    assert "solver_failed" in ctl.alarms
    assert site.reports[-1].status == "fallback"
    assert ctl.counters.caps_sent > 0  # a tick never ends without caps
    assert max(site.true_caps().values()) <= 250 + 1e-6
    assert site.breaches == []


async def test_bad_messages_are_counted_and_dropped(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(3 * TICK)
    topics = Topics()
    junk = site.broker.client("junk")
    await junk.connect()
    await junk.wait_connected()
    await junk.publish(topics.telemetry("rack-1-n1"), b"not json")
    await junk.publish(
        topics.ack("rack-1-n1"), b'{"v": 1, "node_id": "rack-2-n1", "tick": 1, "gpus": {}}'
    )
    await junk.publish(topics.status("rack-1-n1"), b'{"v": 2, "node_id": "rack-1-n1"}')
    await site.step(2 * TICK)
    assert ctl.counters.dropped["not_json"] == 1
    assert ctl.counters.dropped["node_mismatch"] == 1
    assert ctl.counters.dropped["bad_version"] == 1
    assert site.breaches == []
    await junk.disconnect()


async def test_unknown_node_is_never_raised(site: Site, stepped_clock: SteppedClock) -> None:
    ctl = site.start_controller()
    rogue_model = SimulatedGpus(
        2, Workload.training(), start_s=stepped_clock.now, uuid_prefix="GPU-rogue"
    )
    settings = AgentSettings(node_id="rogue", backend="mock", period_s=TICK, failsafe_w=250)
    rogue = Agent(
        settings,
        MockBackend(rogue_model, stepped_clock),
        site.broker.client("rogue"),
        stepped_clock,
    )
    stop = asyncio.Event()
    task = asyncio.create_task(rogue.run(stop))
    await site.step(6 * TICK)
    assert ctl.counters.dropped["unknown_node"] > 0
    assert "rogue" in ctl.fleet.unknown_nodes
    assert max(rogue.caps_w.values()) <= 250
    assert rogue.last_tick is None  # never commanded
    stop.set()
    await site.step(TICK)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_operator_overrides_take_effect_next_tick_and_are_audited(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(5 * TICK)
    report = site.reports[-1]
    gpu = report.uuids[-1]
    ctl.pin(gpu, 300, actor="alice", reason="thermal check")
    ctl.drain("rack-2-n1", actor="alice", reason="maintenance")
    ctl.assign_class("inference", uuids=[], nodes=["rack-1-n2"], actor="sched", reason="job 42")
    # Applied in memory at once; the audit rows reach the database off the loop.
    await ctl.ledger.flush(10.0)
    await site.step(3 * TICK)
    report = site.reports[-1]
    caps = dict(zip(report.uuids, report.targets_w.tolist(), strict=True))
    assert caps[gpu] == pytest.approx(300)
    drained = [u for u, n in zip(report.uuids, report.nodes, strict=True) if n == "rack-2-n1"]
    assert all(caps[u] == pytest.approx(200) for u in drained)
    classes = dict(zip(report.nodes, report.classes, strict=True))
    assert classes["rack-1-n2"] == "inference"
    assert site.true_caps()[gpu] == pytest.approx(300)
    with pytest.raises(OverrideError, match="outside the GPU's limits"):
        ctl.pin(gpu, 5000, actor="alice", reason="typo")
    assert site.store is not None
    actions = [e.action for e in site.store.audit_log().items]
    assert {"gpu.pin", "node.drain", "class.assign"} <= set(actions)
    assert site.breaches == []


async def test_policy_replace_validates_first(site: Site) -> None:
    ctl = site.start_controller()
    await site.step(3 * TICK)
    with pytest.raises(PolicyError):
        ctl.replace_policy("facility: {}", actor="admin", reason="oops")
    assert ctl.policy.groups[0].budget_w == 8000  # the running policy stays
    import yaml

    data = site_policy()
    data["facility"]["budget_w"] = 7000
    text = yaml.safe_dump(data)
    outcome = await ctl.ledger.commit(
        lambda: ctl.replace_policy(text, actor="admin", reason="new contract"),
        lowers_power=False,
    )
    assert outcome.applied and outcome.audited
    assert outcome.policy_version is not None and outcome.policy_version >= 1
    await site.step(4 * TICK, budgets={"dc": 7000})
    assert site.reports[-1].group_budget_w[0] == 7000
    assert float(np.max(site.reports[-1].group_committed_w[0])) <= 7000 + 1e-6


def test_command_window_setting_reaches_the_mqtt_client(monkeypatch: pytest.MonkeyPatch) -> None:
    # No limit by default: a tick's commands leave in one burst.
    assert ControllerSettings().mqtt_config().max_inflight_messages == 0
    monkeypatch.setenv("POWERD_COMMAND_WINDOW", "500")
    assert ControllerSettings.load().mqtt_config().max_inflight_messages == 500
    with pytest.raises(SettingsError, match="command_window"):
        ControllerSettings.load(command_window=-1)


def test_storage_settings_reach_the_store_writer(monkeypatch: pytest.MonkeyPatch) -> None:
    s = ControllerSettings()
    assert s.retention() == Retention()  # the documented defaults
    assert (s.cap_epsilon_w, s.cap_interval_s) == (0.5, 60.0)
    monkeypatch.setenv("POWERD_KEEP_TICKS_DAYS", "2")
    monkeypatch.setenv("POWERD_CAP_INTERVAL_S", "0")
    s = ControllerSettings.load(keep_minutes_days=90.0, cap_epsilon_w=2.0)
    assert s.retention() == Retention(keep_minutes_days=90.0, keep_ticks_days=2.0)
    assert (s.cap_epsilon_w, s.cap_interval_s) == (2.0, 0.0)
    with pytest.raises(SettingsError, match="keep_minutes_days"):
        ControllerSettings.load(keep_minutes_days=0)


@pytest.mark.parametrize("ack_ticks", [2, 0])
async def test_raises_held_for_their_cuts_go_on_the_acks_not_a_tick_later(
    stepped_clock: SteppedClock, ack_ticks: int
) -> None:
    # Draining rack-1-n1 frees power in rack-1 that rack-1-n2's GPUs take up: the tick that
    # cuts n1 must hold n2's raises until n1's agent has acknowledged (decreases before
    # increases). With control.ack_ticks the controller ticks again as soon as it has, at
    # the same instant here (acks travel at once in memory); with 0 the raises wait for the
    # next regular tick. Every budget holds at every quarter tick.
    raw = site_policy()
    raw["control"]["ack_ticks"] = ack_ticks
    site = Site(parse_policy(raw, "site.yaml"), stepped_clock, None)
    await site.settle()
    try:
        ctl = site.start_controller()
        registry = CollectorRegistry()
        ctl.on_tick.append(metrics_hook(ctl, ControllerMetrics(registry)))
        await site.step(8 * TICK)
        first = len(site.reports)
        ctl.drain("rack-1-n1", actor="op", reason="maintenance")
        await site.step(3 * TICK)
        assert site.breaches == []
        new = site.reports[first:]
        nodes = np.array(new[0].nodes)
        n1, n2 = nodes == "rack-1-n1", nodes == "rack-1-n2"
        cut = next(k for k, r in enumerate(new) if float(r.sent_w[n1].sum()) < 1000.0)
        before = float(new[cut].committed_w[n2].sum())
        raised = next(
            k for k, r in enumerate(new) if float(r.committed_w[n2].sum()) > before + 100.0
        )
        # The tick that raised n2: at the cut's own instant on acks, a tick later without.
        assert raised > cut
        late = new[raised].ts - new[cut].ts
        if ack_ticks:
            assert late == 0.0 and ctl.counters.ack_ticks >= 1
            # A tick on acks commands only the nodes whose caps move: every node it sent
            # to has a GPU whose cap moved from the tick before, and at least one did not.
            extra, prev = new[raised], new[raised - 1]
            sent = ~np.isnan(extra.sent_w)
            moved = np.abs(np.nan_to_num(extra.sent_w) - prev.committed_w) > 1e-6
            for node in set(nodes[sent]):
                assert (moved & (nodes == node)).any(), node
            assert not sent.all()
        else:
            assert late == pytest.approx(TICK) and ctl.counters.ack_ticks == 0
        # Extra ticks are bounded: at most ack_ticks between two regular ones.
        per_instant = np.unique([r.ts for r in site.reports], return_counts=True)[1]
        assert per_instant.max() <= 1 + ack_ticks
        # The operator sees them: powerd_ack_ticks_total, of powerd_ticks_total.
        assert registry.get_sample_value("powerd_ack_ticks_total") == ctl.counters.ack_ticks
    finally:
        await site.close()


async def test_only_the_awaited_ticks_acks_end_the_wait(site: Site) -> None:
    # The wait on acks ends on an ack of the awaited tick (or a later one) from every node
    # it commanded: a late ack of an older tick, or a node it did not command, does not.
    ctl = site.start_controller()
    await site.step(3 * TICK)
    acks_in = ctl._acks_in
    assert acks_in is not None
    ctl._ack_wait, ctl._ack_tick = {"rack-1-n1", "rack-1-n2"}, 100
    acks_in.clear()
    ctl._ack_heard("rack-1-n1", 99)  # late: an older tick's
    ctl._ack_heard("rack-2-n1", 100)  # not awaited
    assert ctl._ack_wait == {"rack-1-n1", "rack-1-n2"} and not acks_in.is_set()
    ctl._ack_heard("rack-1-n1", 100)
    assert not acks_in.is_set()
    ctl._ack_heard("rack-1-n2", 101)
    assert acks_in.is_set() and not ctl._ack_wait


def _bare_controller(clock: SteppedClock) -> Controller:
    """The site's controller on a broker of its own, not running (its loop's parts called
    one at a time)."""
    return build_controller(
        parse_policy(site_policy(), "site.yaml"),
        MemoryBroker().client("controller"),
        clock,
        ControllerOptions(controller_id="controller"),
    )


async def test_a_regular_tick_due_serves_the_acks_no_extra_tick_before_it(
    stepped_clock: SteppedClock,
) -> None:
    # An extra tick on acks when the regular one is due would be followed at once by the
    # regular one: two ticks bunched where one serves. Acks in after a tick that overran, or
    # at the very instant the regular tick comes due, make the regular tick (next_at moves
    # on, the period's extra ticks start again); before it, an extra tick at once.
    ctl = _bare_controller(stepped_clock)
    acks_in = ctl._acks_in = asyncio.Event()
    now = stepped_clock.now

    acks_in.set()  # in during a tick that overran by half a tick
    assert await ctl._until_next(now - 1.5 * TICK, False, 1, True) == (now, False, 0)
    assert ctl.counters.ack_ticks == 0

    acks_in.set()  # in before the regular tick is due: an extra one at once
    assert await ctl._until_next(now - 0.5 * TICK, False, 1, True) == (now + 0.5, True, 1)
    assert ctl.counters.ack_ticks == 1 and not acks_in.is_set()

    # A flood: acks in again at once after every extra tick (an event set as soon as it
    # is cleared). After ack_ticks extra ones the loop sleeps until the regular tick.
    at, early, extra = now + 0.5, True, 1
    acks_in.set()
    assert await ctl._until_next(at, early, extra, True) == (at, True, 2)
    acks_in.set()
    flooded = asyncio.ensure_future(ctl._until_next(at, True, 2, True))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not flooded.done()  # asleep, not spinning
    stepped_clock.advance(0.5)
    assert await flooded == (at, False, 2)
    assert ctl.counters.ack_ticks == 2
    now = stepped_clock.now
    acks_in.clear()

    ctl._ack_wait, ctl._ack_tick = {"rack-1-n1"}, 7  # awaited as the regular tick comes due
    waiting = asyncio.ensure_future(ctl._until_next(now + TICK, True, 1, True))
    for _ in range(5):
        await asyncio.sleep(0)
    stepped_clock.advance(TICK)
    ctl._ack_heard("rack-1-n1", 7)
    assert await waiting == (now + TICK, False, 1)
    assert ctl.counters.ack_ticks == 2


async def test_an_ack_of_another_epoch_or_authority_ends_no_wait(
    stepped_clock: SteppedClock,
) -> None:
    # The wait on acks ends when every node commanded has acknowledged *our* commands. An
    # older leader's ack (its ticks may run above ours), a newer one's, or one for another
    # authority resolves none of them: the planner ignores it, so an extra tick on it would
    # find the raises still held and spend the period's extra ticks for nothing.
    ctl = _bare_controller(stepped_clock)
    ours = Authority(site="dc", store="s1", domain="dc")
    ctl.engine.obedience.epoch, ctl.engine.obedience.authority = 5, ours
    acks_in = ctl._acks_in = asyncio.Event()
    ctl._ack_wait, ctl._ack_tick = {"rack-1-n1"}, 7

    def ack(epoch: int, authority: Authority) -> None:
        payload = CapAck(node_id="rack-1-n1", tick=9, epoch=epoch, authority=authority, gpus={})
        ctl.handle(Message(ctl.topics.ack("rack-1-n1"), encode(payload)), stepped_clock.now)

    ack(4, ours)  # an older leader's
    ack(6, ours)  # a newer one's
    ack(5, Authority(site="dc", store="s2", domain="dc"))  # another store's
    assert ctl._ack_wait == {"rack-1-n1"} and not acks_in.is_set()
    assert ctl.counters.dropped["unknown_node"] == 0
    ack(5, ours)
    assert not ctl._ack_wait and acks_in.is_set()


class _Mosquitto:
    """Clients of a real broker, as a Site's `broker`."""

    def __init__(self, url: str) -> None:
        self.url = url

    def client(self, name: str) -> MqttTransport:
        return MqttTransport(MqttConfig.from_url(self.url, client_id=name))


class _RealIoSite(Site):
    """A Site whose messages cross a real broker: each settle gives the I/O real time."""

    async def settle(self) -> None:
        for _ in range(4):
            await asyncio.sleep(0.01)


async def test_an_ack_flood_over_mosquitto_buys_no_more_than_ack_ticks(
    stepped_clock: SteppedClock, mosquitto: LocalMosquitto
) -> None:
    # A rogue client floods every node's ack topic with acks of the controller's latest
    # tick (which ends any wait on acks the moment it is armed) while a drain moves power.
    # The controller must still run at most ack_ticks extra ticks between two regular
    # ones, never spin, keep ticking on time, and every budget must hold at every moment.
    ack_ticks = 2
    raw = site_policy()
    raw["control"]["ack_ticks"] = ack_ticks
    site = _RealIoSite(
        parse_policy(raw, "site.yaml"), stepped_clock, None, _Mosquitto(mosquitto.url)
    )
    rogue = MqttTransport(MqttConfig.from_url(mosquitto.url, client_id="rogue"))
    await rogue.connect()
    flooding = asyncio.Event()

    async def flood() -> None:
        ctl = site.controller
        assert ctl is not None
        while not flooding.is_set():
            batch = [
                (ctl.topics.ack(node), encode(CapAck(node_id=node, tick=ctl.tick_no, gpus={})))
                for node in site.agents
            ]
            await rogue.publish_many(batch, qos=0)
            await asyncio.sleep(0.001)

    flooder: asyncio.Task[None] | None = None
    try:
        await rogue.wait_connected()
        ctl = site.start_controller()
        for _ in range(8):
            await site.step(TICK)
        first = len(site.reports)
        heard = ctl.counters.received["ack"]
        flooder = asyncio.create_task(flood(), name="rogue")
        ctl.drain("rack-1-n1", actor="op", reason="maintenance")
        for _ in range(6):
            await site.step(TICK)
        flooding.set()
        await flooder
        assert site.breaches == []
        assert ctl.counters.received["ack"] - heard > 100  # the flood got through
        new = site.reports[first:]
        # Ticks per regular period (the stepped clock stands still within a step).
        start = new[0].ts
        periods = np.floor((np.array([r.ts for r in new]) - start) / TICK + 1e-9)
        counts = np.unique(periods, return_counts=True)[1]
        assert counts.max() <= 1 + ack_ticks
        assert len(counts) >= 6  # a regular tick every period: none starved
        assert 1 <= ctl.counters.ack_ticks <= ack_ticks * ctl.counters.ticks
    finally:
        flooding.set()
        if flooder is not None:
            with contextlib.suppress(Exception):
                await flooder
        await rogue.disconnect()
        await site.close()


async def test_a_budget_cut_and_a_drain_during_a_wait_on_acks_hold_every_budget(
    stepped_clock: SteppedClock,
) -> None:
    # The tick that drains rack-1-n1 holds rack-1-n2's raises and waits on n1's ack. As it
    # ends (in its own hook: its commands out, the extra tick not yet run), the operator
    # cuts rack-1's budget and drains rack-2-n1 too. The extra tick on the acks must plan
    # under the cut: every budget holds at every quarter tick, the old one throughout and
    # the cut one from two ticks on, as without acks (test_budget_cut_is_obeyed_within_two_ticks).
    raw = site_policy()
    raw["control"]["ack_ticks"] = 2
    site = Site(parse_policy(raw, "site.yaml"), stepped_clock, None)
    await site.settle()
    cut: list[float] = []
    try:
        ctl = site.start_controller()
        await site.step(8 * TICK)

        def during_the_wait(r: TickReport) -> None:
            if ctl._ack_tick == r.tick and not cut:
                cut.append(stepped_clock.now)
                ctl.set_budget("rack-1", 3000, expires_at=None, actor="grid", reason="cut")
                ctl.drain("rack-2-n1", actor="op", reason="maintenance")

        ctl.on_tick.append(during_the_wait)
        # And at every tick, extra ones included (they come at one instant of the clock).
        ctl.on_tick.append(lambda _: site.check_budgets())
        ticks = ctl.counters.ack_ticks
        ctl.drain("rack-1-n1", actor="op", reason="maintenance")
        await site.step(2 * TICK)
        assert cut and ctl.counters.ack_ticks > ticks  # the cut came during a wait
        assert site.breaches == []
        await site.step(6 * TICK, budgets={"rack-1": 3000})
        assert site.breaches == []
        rack1 = ctl.policy.groups.index(next(g for g in ctl.policy.groups if g.name == "rack-1"))
        assert site.reports[-1].group_committed_w[rack1] <= 3000 + 1e-6
    finally:
        await site.close()


async def test_no_extra_ticks_for_raises_no_ack_can_release(stepped_clock: SteppedClock) -> None:
    # rack-2-n2's agent goes away: its GPUs count at the caps they may have, and rack-2-n1
    # wants that room, a raise held every tick that no ack can release (no cut is in
    # flight: the gone node gets no command). Waiting on
    # every commanded node's acks made an extra tick (a whole solve) follow every regular
    # one for as long as the node was gone. The wait is on the nodes a tick cuts: a drain
    # still gets its raises on the acks, and the fleet at rest runs its regular ticks only.
    raw = site_policy()
    raw["control"]["ack_ticks"] = 2
    site = Site(parse_policy(raw, "site.yaml"), stepped_clock, None)
    await site.settle()
    try:
        ctl = site.start_controller()
        await site.step(8 * TICK)
        site.tasks["rack-2-n2"].cancel()
        await site.step(6 * TICK)
        before = ctl.counters.ack_ticks
        ctl.drain("rack-1-n1", actor="op", reason="maintenance")
        await site.step(2 * TICK)
        assert ctl.counters.ack_ticks > before  # the drain's raises went on the acks
        rest, ticks = ctl.counters.ack_ticks, len(site.reports)
        await site.step(8 * TICK)
        assert len(site.reports) - ticks == 8 and ctl.counters.ack_ticks == rest
        # Raises were held meanwhile: rack-2-n1 wants room its gone neighbour is counted at.
        held = [
            bool((r.targets_w > r.sent_w + 1.0)[np.array(r.nodes) == "rack-2-n1"].any())
            for r in site.reports[ticks:]
        ]
        assert sum(held) >= 4
        assert site.breaches == []
    finally:
        await site.close()
