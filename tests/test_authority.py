"""One authority per node: the agent's rule (docs/safety.md, "Authority").

An agent obeys one (site, store, domain) at a time. Within it, a higher epoch is a takeover
and wins at once; another authority is refused while the one obeyed is alive, and may take
over only after that one has been silent for its lease (the node then sits at its failsafe
caps), unless the one obeyed handed the node over by name. So two controllers that disagree
about the store or the scope can never take turns on one node.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.honest import NODES, HonestNode, policy_dict
from support.leases import until_lapsed

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.clock import ManualClock
from powerd.controller.build import ControllerOptions, build_controller
from powerd.controller.controller import Controller
from powerd.controller.leadership import Leadership
from powerd.controller.opstate import (
    BudgetState,
    OperatorState,
    ScheduleState,
    StateFile,
    restore,
)
from powerd.controller.overrides import NotFound, OverrideError
from powerd.controller.tick import TickEngine
from powerd.policy import load_policy, parse_policy
from powerd.store import Store, upgrade
from powerd.store.db import make_engine
from powerd.store.leases import Leases
from powerd.transport.base import Message
from powerd.transport.memory import MemoryBroker
from powerd.wire import (
    Authority,
    CapAck,
    CapCommand,
    ControllerState,
    ControllerStatus,
    NodeState,
    NodeStatus,
    Topics,
    encode,
)

NODE = "n1"
TOPICS = Topics()
LEASE_S = 10.0
A = Authority(site="lab", store="store-a", domain="lab")
B = Authority(site="lab", store="store-b", domain="lab")  # a second database, same scope
R = Authority(site="lab", store="store-a", domain="r1")  # an overlapping scope
OTHER_SITE = Authority(site="elsewhere", store="store-a", domain="lab")


@dataclass
class Node:
    agent: Agent
    clock: ManualClock
    fleet: SimulatedGpus

    async def command(
        self,
        authority: Authority,
        tick: int,
        cap_w: float,
        *,
        epoch: int = 1,
        handover: tuple[Authority, ...] = (),
        controller: str = "c",
    ) -> bool:
        """Send one command; True if the agent applied it."""
        before = self.agent.commands
        cmd = CapCommand(
            node_id=NODE,
            tick=tick,
            epoch=epoch,
            authority=authority,
            handover=list(handover),
            lease_s=LEASE_S,
            caps=dict.fromkeys(self.uuids, cap_w),
            failsafe_w=dict.fromkeys(self.uuids, 300.0),
            controller_id=controller,
        )
        await self.agent._on_message(Message(TOPICS.caps(NODE), encode(cmd)))
        return self.agent.commands > before

    @property
    def uuids(self) -> list[str]:
        return list(self.agent.gpus)

    def caps(self) -> list[float]:
        return [float(c) for c in self.fleet.cap_w]


def make_node(state_dir: Path | None = None, site: str | None = None) -> Node:
    clock = ManualClock(start=1000.0)
    settings = AgentSettings(
        node_id=NODE, backend="mock", period_s=1.0, failsafe_w=400.0, state_dir=state_dir, site=site
    )
    fleet = SimulatedGpus(2, Workload.steady(650.0), start_s=clock.monotonic(), uuid_prefix="G")
    agent = Agent(settings, MockBackend(fleet, clock), MemoryBroker().client(), clock)
    return Node(agent, clock, fleet)


async def test_another_store_is_refused_while_the_one_obeyed_is_alive() -> None:
    n = make_node()
    assert await n.command(A, 1, 500.0)
    # A second controller on its own database, same scope, even at a higher epoch and tick.
    assert not await n.command(B, 10**6, 700.0, epoch=99, controller="rogue")
    assert n.caps() == [500.0, 500.0]
    assert n.agent.rejected["other_authority"] == 1
    assert (n.agent.refused_authority, n.agent.refused_controller) == (B, "rogue")
    # The one obeyed goes on, and a higher epoch within it is a takeover, at once.
    n.clock.advance(LEASE_S / 2)
    assert await n.command(A, 2, 450.0)
    assert await n.command(A, 1, 460.0, epoch=2)
    # An overlapping scope of the same database is another authority too.
    assert not await n.command(R, 5, 700.0)
    status = n.agent.status_message()
    assert status.authority == A and status.refused == 2 and status.refused_authority == R


async def test_another_authority_takes_over_only_after_a_lease_of_silence() -> None:
    n = make_node()
    assert await n.command(A, 1, 500.0)
    n.clock.advance(LEASE_S - 0.01)
    assert not await n.command(B, 1, 700.0)
    n.clock.advance(0.02)  # A has been silent for its lease: the node is due at failsafe
    assert await n.command(B, 1, 650.0)
    assert n.agent.authority == B and n.agent.previous_authority == A
    # A new authority's (or leader's) first command raises nothing; its next one may.
    assert n.caps() == [500.0, 500.0]
    assert await n.command(B, 2, 650.0)
    assert n.caps() == [650.0, 650.0]
    # Now A is the other one: refused while B is alive, whatever its epoch.
    assert not await n.command(A, 2, 200.0, epoch=7)
    assert n.agent.status_message().previous_authority == A


async def test_a_handover_names_the_successor_and_leaves_no_gap() -> None:
    n = make_node()
    assert await n.command(A, 1, 500.0, handover=(R,))
    # The successor named by the authority obeyed commands at once, epochs start afresh.
    assert await n.command(R, 1, 480.0, epoch=1)
    assert n.agent.authority == R and n.agent.epoch == 1
    # The predecessor is now refused (it handed the node over).
    assert not await n.command(A, 2, 700.0)
    # A handover is only as good as the authority that gives it: R names none, so B waits.
    assert not await n.command(B, 1, 700.0)


async def test_an_agent_is_enrolled_in_one_site() -> None:
    n = make_node(site="lab")
    before = n.caps()
    assert not await n.command(OTHER_SITE, 1, 500.0)
    assert n.agent.rejected["foreign_site"] == 1 and n.agent.authority is None
    assert n.caps() == before  # untouched
    # Enrolled by its first command when no site is configured, and kept.
    m = make_node()
    assert await m.command(A, 1, 500.0)
    m.clock.advance(LEASE_S * 3)
    assert not await m.command(OTHER_SITE, 1, 700.0)
    assert m.agent.site == "lab"


async def test_a_restart_keeps_the_authority_for_a_lease(tmp_path: Path) -> None:
    n = make_node(state_dir=tmp_path)
    assert await n.command(A, 1, 500.0, epoch=3)
    kept = json.loads((tmp_path / "authority.json").read_text())
    assert kept["authority"] == A.model_dump() and kept["epoch"] == 3 and kept["site"] == "lab"
    again = make_node(state_dir=tmp_path)
    await asyncio.to_thread(again.agent._load_state)
    assert (again.agent.authority, again.agent.epoch, again.agent.site) == (A, 3, "lab")
    # The one obeyed before the restart counts as alive for one lease from the start.
    assert not await again.command(B, 1, 700.0)
    assert not await again.command(A, 9, 700.0, epoch=2)  # a deposed leader of A: fenced
    assert await again.command(A, 1, 450.0, epoch=4)
    third = make_node(state_dir=tmp_path)
    await asyncio.to_thread(third.agent._load_state)
    third.clock.advance(LEASE_S)
    assert await third.command(B, 1, 450.0)


# -- every interleaving: no node takes turns between two authorities --------------------------

Step = tuple[int, float, int, int]  # (which authority, seconds before, epoch, tick)


@settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 2),
            st.sampled_from([0.0, 0.1, 1.0, LEASE_S / 2, LEASE_S - 0.01, LEASE_S, 2 * LEASE_S]),
            st.integers(0, 3),
            st.integers(0, 6),
        ),
        min_size=1,
        max_size=25,
    ),
    st.booleans(),
)
def test_no_node_alternates_between_authorities(steps: list[Step], handover: bool) -> None:
    """Whatever two or three controllers send, in any order and timing: a command of another
    authority than the one obeyed is applied only after the one obeyed has been silent for
    its lease (or named it in a handover), and within one authority the (epoch, tick) of
    applied commands only grows."""
    authorities = (A, B, R)

    async def run() -> None:
        n = make_node()
        obeyed: Authority | None = None
        last_at = -float("inf")
        last_key: tuple[int, int] | None = None
        for who, dt, epoch, tick in steps:
            n.clock.advance(dt)
            a = authorities[who]
            named = (R,) if handover and a == A else ()
            applied = await n.command(a, tick, 500.0, epoch=epoch, handover=named)
            now = n.clock.monotonic()
            if not applied:
                continue
            if obeyed is not None and a != obeyed:
                handed = handover and obeyed == A and a == R
                assert handed or now >= last_at + LEASE_S, (obeyed, a, now - last_at)
                last_key = None
            elif last_key is not None:
                assert (epoch, tick) > last_key or epoch > last_key[0]
            obeyed, last_at, last_key = a, now, (epoch, tick)
            assert n.agent.authority == a
        if obeyed is not None:
            assert n.agent.status_message().authority == obeyed
        assert n.agent.state in (NodeState.STEERED, NodeState.STARTING)

    asyncio.run(run())


# -- controllers: nodes that obey another authority count at their maximum --------------------


def _site_of_two_authorities(
    obeys: dict[str, int], ticks: int
) -> tuple[list[TickEngine], dict[str, HonestNode], list[Any]]:
    """Two controllers of the same policy on two stores, each sure it steers the whole site,
    and nodes that each obey one of them (by `obeys`: 0 or 1). Every tick both decide and
    send; a node applies only its own authority's commands, acks and reports with it."""
    policy = parse_policy(policy_dict())
    authorities = [
        Authority(site="dc", store="store-a", domain="dc"),
        Authority(site="dc", store="store-b", domain="dc"),
    ]
    engines = [TickEngine(policy), TickEngine(policy)]
    for engine, authority in zip(engines, authorities, strict=True):
        engine.obedience.authority = authority
    nodes = {n: HonestNode(n) for n in NODES}
    plans = []
    wall0 = 1_700_000_000.0
    for t in range(ticks):
        now, wall = float(t), wall0 + t
        for name, node in nodes.items():
            mine = authorities[obeys[name]]
            status = NodeStatus(
                node_id=name,
                state=NodeState.STEERED,
                last_tick=node.last_tick,
                caps_w=dict(node.caps),
                authority=mine,
            )
            for engine in engines:
                assert engine.on_status(name, status)
                assert engine.on_telemetry(node.sample(wall), now)
        for k, engine in enumerate(engines):
            report, plan = engine.step(now, wall)
            plans.append((k, report, plan))
            for cmd in plan.commands:
                if obeys[cmd.node] != k:
                    continue  # refused by the agent: another authority's node
                ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
                if ack is not None:
                    ack = ack.model_copy(update={"authority": authorities[k]})
                    for engine_ in engines:
                        engine_.on_ack(cmd.node, ack)
            # What the devices enforce fits every budget, whoever decided last.
            topo = engine.shape.topology if engine.shape is not None else None
            assert topo is not None
            caps = np.array(
                [nodes[n].caps[u] for u, n in zip(report.uuids, report.nodes, strict=True)]
            )
            assert (topo.group_sums(caps) + topo.overhead_w <= topo.budget_w + 1e-6).all()
    return engines, nodes, plans


@settings(max_examples=40, deadline=None, database=None)
@given(st.lists(st.integers(0, 1), min_size=len(NODES), max_size=len(NODES)))
def test_two_controllers_on_two_stores_never_exceed_a_budget(split: list[int]) -> None:
    obeys = dict(zip(NODES, split, strict=True))
    engines, _, plans = _site_of_two_authorities(obeys, ticks=6)
    for k, engine in enumerate(engines):
        foreign = {n for n, who in obeys.items() if who != k}
        assert set(engine.foreign_nodes()) == foreign
        if foreign:
            assert "foreign_authority" in engine.alarms.active
            assert "store-" in engine.alarms.active["foreign_authority"]
    # A node of the other authority is counted at its maximum by each controller.
    for k, report, plan in plans[-2:]:
        for i, node in enumerate(report.nodes):
            if obeys[node] != k:
                assert plan.committed_w[i] == 700.0


def _said(controller: str, state: ControllerState, authority: Authority) -> ControllerStatus:
    return ControllerStatus(controller_id=controller, state=state, authority=authority)


def test_a_controller_names_a_rival_that_leads_an_overlapping_domain() -> None:
    policy = parse_policy(policy_dict())
    engine = TickEngine(policy)
    engine.obedience.authority = Authority(site="dc", store="store-a", domain="dc")
    standby = ControllerStatus(
        controller_id="twin", state=ControllerState.STANDBY, authority=engine.obedience.authority
    )
    engine.on_controller_status("twin", standby)
    same_pair = ControllerStatus(
        controller_id="twin", state=ControllerState.ACTIVE, authority=engine.obedience.authority
    )
    engine.on_controller_status("twin", same_pair)  # our own pair: no rival
    assert engine.obedience.superseded_by == 0  # it says no epoch
    newer = same_pair.model_copy(update={"epoch": 5})
    engine.on_controller_status("twin", newer)
    assert engine.obedience.superseded_by == 5  # a leader through an outage stops on this
    rack = Authority(site="dc", store="store-c", domain="r1")
    engine.on_controller_status(
        "leftover",
        ControllerStatus(controller_id="leftover", state=ControllerState.ACTIVE, authority=rack),
    )
    other_site = Authority(site="elsewhere", store="store-d", domain="dc")
    engine.on_controller_status(
        "far",
        ControllerStatus(controller_id="far", state=ControllerState.ACTIVE, authority=other_site),
    )
    node = HonestNode(NODES[0])
    engine.on_telemetry(node.sample(1.7e9), 0.0)
    engine.step(0.0, 1.7e9)
    message = engine.alarms.active["authority_conflict"]
    assert "'leftover'" in message and "domain r1" in message and "'far'" not in message
    # Its last will (offline) clears it.
    engine.on_controller_status(
        "leftover",
        ControllerStatus(controller_id="leftover", state=ControllerState.OFFLINE, authority=rack),
    )
    engine.step(1.0, 1.7e9 + 1)
    assert "authority_conflict" not in engine.alarms.active


def test_live_controllers_of_another_site_on_the_broker_raise_an_alarm() -> None:
    # Without TLS nothing proves the broker is this site's; another site's live controllers
    # on our topics are the sign that it may not be (docs/safety.md, "Which broker").
    policy = parse_policy(policy_dict())
    engine = TickEngine(policy)
    engine.obedience.authority = Authority(site="dc", store="store-a", domain="dc")
    engine.on_telemetry(HonestNode(NODES[0]).sample(1.7e9), 0.0)
    ours = Authority(site="dc", store="store-b", domain="r1")  # same site: another alarm's
    engine.on_controller_status("scope", _said("scope", ControllerState.STANDBY, ours))
    engine.step(0.0, 1.7e9)
    assert "other_site_on_broker" not in engine.alarms.active

    theirs = Authority(site="elsewhere", store="store-x", domain="elsewhere")
    for cid, state in (("far-1", ControllerState.ACTIVE), ("far-2", ControllerState.STANDBY)):
        engine.on_controller_status(cid, _said(cid, state, theirs))
    engine.step(1.0, 1.7e9 + 1)
    message = engine.alarms.active["other_site_on_broker"]
    assert "2 controllers of another site" in message
    assert "'far-1' (site 'elsewhere')" in message and "'far-2'" in message
    # Their wills (offline) say nothing of the broker any more: the alarm clears.
    for cid in ("far-1", "far-2"):
        engine.on_controller_status(cid, _said(cid, ControllerState.OFFLINE, theirs))
    engine.step(2.0, 1.7e9 + 2)
    assert "other_site_on_broker" not in engine.alarms.active


# -- one configuration of record: the store's active policy version ----------------------------


def _policy_file(path: Path, facility_w: int) -> Path:
    data = policy_dict()
    data["facility"]["budget_w"] = facility_w
    path.write_text(yaml.safe_dump(data))
    return path


def _member(
    url: str, name: str, policy_file: Path, tmp: Path, authority: Authority | None = None
) -> tuple[Controller, Leadership]:
    lead = Leadership(
        Leases(make_engine(url, timeout_s=2.0)),
        scope="dc",
        holder=name,
        lease_s=0.6,
        renew_s=0.1,
        margin_s=0.05,
    )
    controller = build_controller(
        load_policy(policy_file),
        MemoryBroker().client(),
        ManualClock(),
        ControllerOptions(controller_id=name, policy_path=str(policy_file)),
        store=Store(url),
        state_file=StateFile(tmp / f"{name}.json"),
        authority=authority,
        leadership=lead,
    )
    return controller, lead


@dataclass
class StalePair:
    """A pair on one SQLite store: the leader's file at 6,000 W (stored as the policy of
    record), the standby's a stale one at 7,000 W."""

    leader: Controller
    lead_a: Leadership
    standby: Controller
    lead_b: Leadership
    stale_file: Path


async def _stale_pair(tmp_path: Path) -> StalePair:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    leader_file = _policy_file(tmp_path / "leader.yaml", 6000)
    stale_file = _policy_file(tmp_path / "standby.yaml", 7000)
    leader, lead_a = _member(url, "ctl-a", leader_file, tmp_path)
    standby, lead_b = _member(url, "ctl-b", stale_file, tmp_path)
    # The leader started first, on a store with no policy yet: its file is of record.
    await leader.ledger.store_start_version(
        leader_file.read_text(), str(leader_file), db_ok=True, of_record=True
    )
    assert leader.policy_version is not None
    return StalePair(leader, lead_a, standby, lead_b, stale_file)


async def test_a_standby_with_a_stale_policy_file_steers_the_policy_of_record(
    tmp_path: Path,
) -> None:
    """Finding 3: the leader's file lowered to 6,000 W and stored; the standby's file still
    7,000 W. The standby steers the stored 6,000 W (and says its file differs), also after
    it takes over; a SIGHUP on any member stores its file for the whole pair."""
    p = await _stale_pair(tmp_path)
    leader, lead_a, standby, lead_b = p.leader, p.lead_a, p.standby, p.lead_b
    stale_file = p.stale_file
    await lead_a.attempt()
    assert lead_a.may_command()
    await lead_b.attempt()
    assert not lead_b.may_command()
    assert standby.policy.groups[0].budget_w == 6000.0
    assert standby.policy_version == leader.policy_version
    assert "standby.yaml" in standby.alarms["policy_differs"]
    assert "policy_differs" not in leader.alarms
    # The leader dies; the standby takes over, still at the policy of record.
    await until_lapsed(lead_b.leases)
    await lead_b.attempt()
    assert lead_b.may_command()
    assert standby.policy.groups[0].budget_w == 6000.0
    # An operator stores the standby's file (SIGHUP there): the whole pair follows it.
    stale_file.write_text(_policy_file(tmp_path / "x.yaml", 5000).read_text())
    outcome = await standby.ledger.reload_policy_file()
    assert outcome.applied and standby.policy.groups[0].budget_w == 5000.0
    await standby.ledger.flush(5.0)
    await lead_b.attempt()
    assert "policy_differs" not in standby.alarms
    await lead_a.attempt()  # the old leader, back as a standby
    assert leader.policy.groups[0].budget_w == 5000.0
    assert "leader.yaml" in leader.alarms["policy_differs"]


# -- time agrees or the host does not lead -----------------------------------------------------


async def test_a_host_whose_clock_disagrees_with_its_database_does_not_lead(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    ahead = Leadership(
        Leases(make_engine(url)),
        scope="dc",
        holder="ahead",
        lease_s=0.6,
        renew_s=0.1,
        margin_s=0.05,
        wall=lambda: time.time() + 3600.0,  # an hour ahead
    )
    await ahead.attempt()
    assert not ahead.may_command() and ahead.leases.current("dc") is None
    assert ahead.skew_s is not None and 3590 < ahead.skew_s < 3610
    assert ahead.skew_error is not None and "+3600" in ahead.skew_error
    # Once NTP has brought it back, it leads.
    ahead.wall = time.time
    await ahead.attempt()
    assert ahead.may_command() and ahead.skew_error is None


def test_a_standby_never_drops_a_window_by_its_own_clock() -> None:
    """Finding 4: a standby an hour ahead followed the leader's state and dropped a grid
    window still in force at the leader. Stored windows and cuts are kept whatever this
    host's clock says; the tick judges them, on a clock checked against the database's."""
    policy = parse_policy(policy_dict())
    now = 1_700_000_000.0
    window = ScheduleState(
        id="grid",
        group="dc",
        budget_w=6000.0,
        start=now + 10,
        end=now + 600,
        reason="grid",
        actor="op",
        created_at=now,
    )
    cut = BudgetState(
        group="r1", budget_w=3000.0, expires_at=now + 600, reason="r", actor="op", created_at=now
    )
    state = OperatorState(revision=3, schedules=[window], budgets=[cut])
    skewed = restore(state, policy, now + 3600.0, 50.0)
    assert set(skewed.schedules) == {"grid"} and set(skewed.budgets) == {"r1"}
    # Back on the true clock, the window binds as the leader's does.
    true_clock = restore(state, policy, now, 50.0)
    assert set(true_clock.schedules) == {"grid"}
    assert true_clock.active_budgets(policy, now, 50.0)["r1"] == 3000.0


# -- a deliberate handover: no failsafe gap, nothing raised on a guess -------------------------


async def test_a_handover_moves_nodes_without_a_failsafe_gap() -> None:
    """A row re-scoped into a rack (or a move to a new database): the leader names the
    successor in every command; each agent obeys the successor's first command at once
    (no lease of silence at failsafe), and the old leader counts every GPU at its maximum
    meanwhile, so it only holds or cuts."""
    policy = parse_policy(policy_dict())
    broker = MemoryBroker()
    old = build_controller(
        policy,
        broker.client("old"),
        ManualClock(),
        ControllerOptions(controller_id="old"),
        authority=Authority(site="dc", store="store-a", domain="dc"),
    )
    successor = Authority(site="dc", store="store-a", domain="r1")
    heard: list[CapCommand] = []
    tap = broker.client("tap")
    await tap.connect()
    await tap.subscribe(TOPICS.all_nodes("caps"))
    await old.transport.connect()
    nodes = {n: HonestNode(n) for n in NODES}
    wall = 1_700_000_000.0
    for t in range(4):
        for node in nodes.values():
            old.engine.on_telemetry(node.sample(wall + t), float(t))
        _, plan = old.engine.step(float(t), wall + t)
        for cmd in plan.commands:
            ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                old.engine.on_ack(cmd.node, ack.model_copy(update={"authority": old.authority}))
    with pytest.raises(OverrideError, match="site"):
        old.hand_over([Authority(site="far", store="s", domain="dc")], actor="a", reason="r")
    with pytest.raises(OverrideError, match="another authority"):
        old.hand_over([Authority(domain="dc")], actor="a", reason="r")  # ourselves
    old.hand_over([Authority(domain="r1")], actor="admin", reason="re-scope")  # our site, store
    assert old.overrides.handover == (successor,)
    before = {u: w for n in nodes.values() for u, w in n.caps.items()}
    _, plan = old.engine.step(4.0, wall + 4)
    assert (plan.committed_w == 700.0).all()  # every GPU at its maximum meanwhile
    for cmd in plan.commands:
        for u, w in cmd.caps_w.items():
            assert w <= before[u] + 1e-6  # holds or cuts, never a raise
    await old.publish_plan(plan)
    await asyncio.sleep(0)
    async for message in tap.messages():
        heard.append(CapCommand.model_validate_json(message.payload))
        if len(heard) == len(plan.commands):
            break
    assert all(c.handover == [successor] and c.authority == old.authority for c in heard)
    # A real agent that obeys the old leader takes the successor's first command at once.
    n = make_node()
    assert await n.command(old.authority, 1, 500.0, handover=(successor,))
    assert await n.command(successor, 1, 450.0)
    assert n.agent.authority == successor and n.agent.previous_authority == old.authority
    # The successor's controller says so, once: the node came over from the old authority.
    new = TickEngine(policy)
    new.obedience.authority = successor
    status = n.agent.status_message().model_copy(update={"node_id": NODES[0]})
    with capture_logs():
        new.on_status(NODES[0], status)
        new.on_status(NODES[0], status)
    changes = [c for c in new.alarms.take() if c.kind == "authority_changed"]
    assert len(changes) == 1 and "domain dc" in (changes[0].message or "")
    # Cancelled, the handover is gone from the commands and the counting.
    old.cancel_handover(actor="admin", reason="done")
    with pytest.raises(NotFound):
        old.cancel_handover(actor="admin", reason="again")


async def test_an_upgrade_from_a_controller_without_authorities_costs_no_failsafe() -> None:
    """Agents that obey a controller of an earlier release (commands without an authority:
    the empty one) take the upgraded controller's first command at once."""
    n = make_node()
    assert await n.command(Authority(), 1, 500.0)
    assert await n.command(A, 1, 450.0, epoch=2)
    assert n.agent.authority == A
    assert not await n.command(Authority(), 2, 700.0)  # and not back


async def test_two_authorities_that_name_each_other_do_not_flip_a_node() -> None:
    """A handed to B while B names A (a hand-back without cancelling): the node moves once,
    and back only after a lease, not at every command."""
    n = make_node()
    assert await n.command(A, 1, 500.0, handover=(B,))
    flips = 0
    for t in range(2, 40):
        who, names = (A, (B,)) if t % 2 else (B, (A,))
        before = n.agent.authority
        await n.command(who, t, 500.0, handover=names)
        flips += n.agent.authority != before
        n.clock.advance(0.1)
    assert flips == 1 and n.agent.authority == B  # 3.8 s of commands, a 10 s lease
    n.clock.advance(LEASE_S)
    assert await n.command(A, 99, 500.0, handover=(B,))  # and back, a lease later


async def test_a_member_started_while_its_database_is_down_never_replaces_the_policy(
    tmp_path: Path,
) -> None:
    """Attack finding: a standby started with a stale file while its database was down
    queued the file as a start-up version, stored it as active when the database came
    back, and the leader followed it (+33 %). A start-up version under a lease is stored
    only into an empty store; once the store answers, the policy of record is followed."""
    p = await _stale_pair(tmp_path)
    leader, lead_a, standby, lead_b = p.leader, p.lead_a, p.standby, p.lead_b
    stale_file, store = p.stale_file, p.leader.store
    assert store is not None
    # What a start during the outage queues (controller/main.py, as a member of a pair).
    await standby.ledger.store_start_version(
        stale_file.read_text(), str(stale_file), db_ok=False, of_record=True
    )
    assert [v.unless_active for v in standby.ledger.versions] == [True]
    await lead_a.attempt()
    await lead_b.attempt()  # the database answers again
    assert standby.policy.groups[0].budget_w == 6000.0
    assert standby.ledger.versions == []
    await standby.ledger.flush(5.0)
    active = store.active_policy()
    assert active is not None and active.version == leader.policy_version
    # Directly: a start-up version never replaces another active one.
    assert (
        store.record_policy_version(
            stale_file.read_text(), source="x", author="c", reason="start-up", unless_active=True
        )
        is None
    )
    assert store.active_policy().version == leader.policy_version  # type: ignore[union-attr]


def test_a_store_id_guessed_at_a_start_during_an_outage_is_replaced_before_leading(
    tmp_path: Path,
) -> None:
    url = f"sqlite:///{tmp_path / 'powerd.db'}"
    upgrade(url)
    guessed = Authority(site="dc", store="unreached-0123", domain="dc")
    policy_file = _policy_file(tmp_path / "p.yaml", 6000)
    ctl, lead = _member(url, "ctl-a", policy_file, tmp_path, authority=guessed)
    assert ctl.leadership is lead and ctl.authority == guessed
    lead.store_id = lead.leases.store_id()
    assert lead.store_id and lead.store_id == Store(url).store_id()
    ctl._learn_store_id(lead)
    assert ctl.authority == Authority(site="dc", store=lead.store_id, domain="dc")


def test_a_coordinator_names_a_scope_controller_that_overlaps_its_scopes(tmp_path: Path) -> None:
    """Finding 2's other side: a leftover `--scope row` controller beside the coordinator's
    racks reported to it and was dropped as `unknown_scope`, unnamed. Now it is named."""
    from typing import cast

    from powerd.coordinator.main import Coordinator
    from powerd.coordinator.split import BudgetSplitter
    from powerd.wire import ScopeReport

    data = policy_dict()
    policy = parse_policy(data)
    splitter = BudgetSplitter(policy, scope_level="rack")
    assert set(splitter.scopes) == {"r1", "r2"}
    coord = Coordinator(
        splitter,
        cast(Any, None),
        cast(Any, None),
        coordinator_id="coord",
        topics=TOPICS,
        state_file=tmp_path / "coord.json",
        store=cast(Any, None),
    )

    def report(scope: str) -> bytes:
        msg = ScopeReport(
            scope=scope,
            controller_id="leftover",
            tick=1,
            budget_w=4000.0,
            committed_w=3000.0,
            failsafe_w=1600.0,
            lo_w=1600.0,
            hi_w=5600.0,
        )
        return encode(msg)

    with capture_logs() as logs:
        coord.handle(TOPICS.scope_report("row"), report("row"))
        coord.handle(TOPICS.scope_report("elsewhere"), report("elsewhere"))
    assert coord.overlapping == {"row": "leftover"}
    assert coord.dropped == {"overlapping_scope": 1, "unknown_scope": 1}
    assert any(e["event"] == "scope_overlap" and e["scope"] == "row" for e in logs)


def test_a_standby_that_led_before_keeps_its_view_warm() -> None:
    """Chaos soak: a controller that had led at epoch 5 stood by while another led at 7; it
    took the leader's nodes for a newer leader's (its own epoch still 5), heard none of
    their caps, and when it took over at 8 the fleet sat at its minimums for a minute."""
    policy = parse_policy(policy_dict())
    engine = TickEngine(policy)
    engine.obedience.authority = Authority(site="dc", store="s", domain="dc")
    nodes = {n: HonestNode(n) for n in NODES}
    wall = 1_700_000_000.0
    engine.obedience.epoch = 5  # it led at epoch 5 once
    for t in range(4):  # now the other controller leads at 7; this one stands by
        for name, node in nodes.items():
            node.apply_caps(100 + t, dict.fromkeys(node.uuids, 450.0))
            msg = node.sample(wall + t).model_copy(update={"epoch": 7})
            engine.on_telemetry(msg, float(t))
            engine.on_ack(
                name,
                CapAck(
                    node_id=name,
                    tick=100 + t,
                    epoch=7,
                    authority=engine.obedience.authority,
                    gpus={},
                ),
            )
        engine.observe(float(t))
    assert engine.foreign_nodes() == {}
    engine.obedience.epoch = 8  # it takes over
    _, plan = engine.step(4.0, wall + 4)
    assert plan.waiting_nodes == () and {c.node for c in plan.commands} == set(NODES)
    assert "foreign_authority" not in engine.alarms.active
    # Its first commands hold the caps in force (450 W), not every GPU's minimum.
    assert all(w == 450.0 for c in plan.commands for w in c.caps_w.values())
