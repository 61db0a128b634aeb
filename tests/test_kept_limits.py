"""Nodes whose actuators keep their limits (a BMC steered by `powerd bmc-agent`): when the
bmc-agent dies, its GPUs stay at the limits in force, forever; no lease brings them down.

The property test runs the tick engine over a site mixing agent nodes and such nodes, with
GPUs that draw what their work wants, and at any tick a bmc-agent may die, a budget may be
cut (never below the group's lowest budget) or lifted, and the controller may die. The
caps in force are the ground truth: every budget holds at every tick once its cut has been
obeyed, and after the controller's death and the leases, every group is within its strict
budget, rated or not (docs/safety.md, "BMC-managed nodes: the actuator keeps its limits").
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.honest import GPUS, HonestNode, policy_dict

from powerd.backends.mock import MockBackend
from powerd.bmc.backend import RedfishBackend
from powerd.controller.overrides import BudgetOverride
from powerd.controller.tick import TickEngine
from powerd.policy import Policy, PolicyError, parse_policy
from powerd.safety import GpuLayout, SafetyPlanner
from powerd.wire import CapAck, GpuAck, NodeState, NodeStatus, decode

TOL = 1e-6
LEASE_S = 4.0
NODES = ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]
WALL0 = 1_700_000_000.0
# Ticks a cut is given to be obeyed: the tick that learns it sends the cuts (acks come at
# once here), and the next one's are there too.
OBEY_TICKS = 2


def site(
    keeps: Mapping[str, bool],
    *,
    failsafe_w: float = 200.0,
    lowest: Mapping[str, float] | None = None,
    rated: Mapping[str, float] | None = None,
    headroom_w: float = 50.0,
) -> dict[str, Any]:
    """The honest site (2 racks × 2 nodes × 4 GPUs of 200–700 W; nodes 2,400 W, racks
    3,800 W, facility 7,000 W), nodes written out so each can keep its limits or not."""
    data = policy_dict()
    lowest = lowest or {}
    rated = rated or {}
    racks = []
    for rack in ("r1", "r2"):
        spec: dict[str, Any] = {
            "name": rack,
            "budget_w": 3800,
            "nodes": [
                {
                    "name": f"{rack}-n{k}",
                    "budget_w": 2400,
                    "gpus": GPUS,
                    "keeps_limits": keeps.get(f"{rack}-n{k}", False),
                }
                for k in (1, 2)
            ],
        }
        racks.append(spec)
    data["facility"]["rows"][0]["racks"] = racks
    data["defaults"]["failsafe_w"] = failsafe_w
    data["defaults"]["headroom_w"] = headroom_w
    # Demand from the last sample + headroom: GPUs below their caps strand headroom, which
    # a rating lends (tests/test_overload.py).
    data["control"]["demand"] = {"window_s": 0.0}
    for name, w in lowest.items():
        group_spec(data, name)["lowest_budget_w"] = w
    for name, pct in rated.items():
        group_spec(data, name)["overload"] = {"pct": pct, "for_s": 30}
    return data


def group_spec(data: dict[str, Any], name: str) -> dict[str, Any]:
    if name == "dc":
        spec: dict[str, Any] = data["facility"]
        return spec
    for rack in data["facility"]["rows"][0]["racks"]:
        if rack["name"] == name:
            found: dict[str, Any] = rack
            return found
        for node in rack["nodes"]:
            if node["name"] == name:
                return node  # type: ignore[no-any-return]
    raise KeyError(name)


def members(name: str) -> list[str]:
    return [n for n in NODES if name in ("dc", n) or n.startswith(name + "-")]


class Node(HonestNode):
    """An agent (or one node of a bmc-agent): GPUs that draw what their work wants, a
    lease that lowers them to min(cap, failsafe cap) when no command comes, and, once
    `dead`, nothing at all: the caps in force stay (for a BMC: forever)."""

    def __init__(self, name: str, failsafe_w: float) -> None:
        super().__init__(name)
        self.failsafe_w = failsafe_w
        self.caps = dict.fromkeys(self.uuids, failsafe_w)  # an agent starts at failsafe
        self.demand = dict.fromkeys(self.uuids, 300.0)
        self.dead = False
        self.last_command = 0.0

    def draw(self) -> dict[str, float]:
        return {u: min(self.caps[u], self.demand[u]) for u in self.uuids}

    def command(self, tick: int, caps_w: Mapping[str, float], now: float) -> CapAck | None:
        if self.dead:
            return None
        self.last_command = now
        return self.apply_caps(tick, caps_w)

    def lease(self, now: float) -> None:
        if not self.dead and now - self.last_command > LEASE_S:
            self.caps = {u: min(c, self.failsafe_w) for u, c in self.caps.items()}


class World:
    """The engine and its nodes, with the budgets that bind (for the checks)."""

    def __init__(self, policy: Policy, keeps: Mapping[str, bool], failsafe_w: float) -> None:
        self.policy = policy
        self.engine = TickEngine(policy)
        self.nodes = {n: Node(n, failsafe_w) for n in NODES}
        self.keeps = keeps
        self.groups = {g.name: g for g in policy.groups}
        # Per group: the policy's budget, or a cut once it has been obeyed (its tick + 2).
        self.cuts: dict[str, tuple[float, int]] = {}
        self.t = 0

    def binding(self, name: str) -> float:
        budget = self.groups[name].budget_w
        cut = self.cuts.get(name)
        if cut is not None and self.t >= cut[1] + OBEY_TICKS:
            budget = min(budget, cut[0])
        return budget

    def caps_w(self, name: str) -> float:
        return sum(sum(self.nodes[n].caps.values()) for n in members(name))

    def draw_w(self, name: str) -> float:
        return sum(sum(self.nodes[n].draw().values()) for n in members(name))

    def lowest_w(self, name: str) -> float:
        g = self.groups[name]
        # Undeclared: no cut below the budget is promised.
        return g.budget_w if g.lowest_budget_w is None else g.lowest_budget_w

    def cut(self, name: str, share: float) -> None:
        lo, hi = self.lowest_w(name), self.groups[name].budget_w
        budget = lo + share * (hi - lo)
        wall = WALL0 + self.t
        self.engine.overrides.set_budget(
            self.policy, BudgetOverride(name, budget, None, "test", "test", wall)
        )
        self.cuts[name] = (budget, self.t)

    def lift(self, name: str) -> None:
        if name in self.engine.overrides.budgets:
            self.engine.overrides.clear_budget(name)
        self.cuts.pop(name, None)

    def bmc_agent_dies(self, name: str) -> None:
        node = self.nodes[name]
        if node.dead:
            return
        node.dead = True  # its BMCs keep every limit as it is
        will = NodeStatus(node_id=name, state=NodeState.OFFLINE, keeps_limits=True)
        self.engine.on_status(name, will)

    def tick(self) -> None:
        now, wall = float(self.t), WALL0 + self.t
        for node in self.nodes.values():
            node.lease(now)
            if not node.dead:
                self.engine.on_telemetry(node.sample(wall), now)
        _, plan = self.engine.step(now, wall)
        for cmd in plan.commands:
            ack = self.nodes[cmd.node].command(cmd.tick, cmd.caps_w, now)
            if ack is not None:
                self.engine.on_ack(cmd.node, ack)
        self.t += 1

    def check_live(self) -> None:
        """While the controller leads: caps within every budget that binds (within its
        rating where rated), draw within the rating."""
        for name, g in self.groups.items():
            budget = self.binding(name)
            most = budget * (1 + g.overload.pct / 100) if g.overload else budget
            caps = self.caps_w(name)
            assert caps <= most + TOL, f"t={self.t} {name}: caps {caps:.1f} W > {most:.1f} W"
            assert self.draw_w(name) <= most + TOL

    def check_strict(self) -> None:
        """After the controller died and every lease ran out: within every strict budget."""
        for name in self.groups:
            caps, budget = self.caps_w(name), self.binding(name)
            assert caps <= budget + TOL, f"{name}: caps {caps:.1f} W left above {budget:.1f} W"


# -- the policy ----------------------------------------------------------------------------


def test_the_policy_names_nodes_that_keep_limits_and_the_lowest_cut_it_must_hold() -> None:
    policy = parse_policy(site({"r1-n2": True}, lowest={"dc": 5000.0, "r1": 1600.0}))
    by_name = {g.name: g for g in policy.groups}
    assert by_name["r1-n2"].keeps_limits and not by_name["r1-n1"].keeps_limits
    assert by_name["dc"].lowest_budget_w == 5000.0
    assert by_name["r2"].lowest_budget_w is None  # undeclared: no cut below the budget
    # Within the budget, and holding the failsafe caps plus overhead: 8 × 200 W in r1.
    with pytest.raises(PolicyError, match=r"racks\[0\]\.lowest_budget_w.*above its budget_w"):
        parse_policy(site({}, lowest={"r1": 3900.0}))
    with pytest.raises(PolicyError, match=r"lowest_budget_w: rack 'r1'.*controller dies.*1,600 W"):
        parse_policy(site({}, lowest={"r1": 1500.0}))
    with pytest.raises(PolicyError, match="keeps_limits"):
        bad = site({})
        bad["facility"]["rows"][0]["racks"][0]["nodes"][0]["keeps_limits"] = "maybe"
        parse_policy(bad)


def test_a_node_that_says_it_keeps_limits_is_planned_so_and_can_loosen_nothing() -> None:
    """The policy does not say r1-n2 keeps its limits; its status does (a bmc-agent): it is
    held within the room such GPUs get (alarm), but offline it still counts at its maximum:
    only the policy lets a node's committed caps stand for a vanished agent's."""
    data = site({}, lowest={"r1": 2000.0})
    world = World(parse_policy(data), {}, 200.0)
    for node in world.nodes.values():
        node.demand = dict.fromkeys(node.uuids, 700.0)
    for _ in range(4):
        world.tick()
    assert world.caps_w("r1-n2") > 1000.0  # an agent node: as much as the rack allows
    world.engine.on_status(
        "r1-n2", NodeStatus(node_id="r1-n2", state=NodeState.STEERED, keeps_limits=True)
    )
    for _ in range(3):
        world.tick()
    # A cut of r1 to 2,000 W must be met with r1-n2 frozen and r1-n1 at 4 × 200 W.
    assert world.caps_w("r1-n2") <= 2000.0 - 800.0 + TOL
    assert "keeps_limits_undeclared" in world.engine.alarms.active
    assert "r1-n2" in world.engine.alarms.active["keeps_limits_undeclared"]
    world.bmc_agent_dies("r1-n2")
    planner = world.engine.planner
    assert planner.layout is not None
    first = planner.layout.uuids.index("GPU-r1-n2-0")
    assert planner.committed_w()[first] == 700.0  # its maximum


def test_a_declared_node_whose_agent_does_not_say_so_counts_at_its_maximum_offline() -> None:
    """The policy says r1-n2 keeps its limits; its agent (an NVML node declared by mistake,
    or an older bmc-agent) does not: it is held within the room all the same, but its last
    will counts it at its maximum, as any node's: only both words loosen that."""
    keeps = {"r1-n2": True}
    world = World(parse_policy(site(keeps)), keeps, 200.0)
    for _ in range(4):
        world.tick()
    world.nodes["r1-n2"].dead = True
    world.engine.on_status("r1-n2", NodeStatus(node_id="r1-n2", state=NodeState.OFFLINE))
    world.tick()
    planner = world.engine.planner
    assert planner.layout is not None
    idx = [planner.layout.uuids.index(u) for u in world.nodes["r1-n2"].uuids]
    assert (planner.committed_w()[idx] == 700.0).all()
    assert "r1-n2" in world.engine.alarms.active["keeps_limits_unconfirmed"]


def test_offline_nodes_that_keep_limits_count_at_their_committed_caps_and_block_cuts() -> None:
    keeps = {"r1-n2": True}
    world = World(parse_policy(site(keeps, lowest={"r1": 2000.0})), keeps, 200.0)
    for node in world.nodes.values():
        node.demand = dict.fromkeys(node.uuids, 700.0)
    for _ in range(5):
        world.tick()
    held = world.caps_w("r1-n2")
    assert 800.0 < held <= 1200.0 + TOL  # 2,000 W lowest − r1-n1 at its minimum
    world.bmc_agent_dies("r1-n2")
    world.tick()
    planner = world.engine.planner
    assert planner.layout is not None
    idx = [planner.layout.uuids.index(u) for u in world.nodes["r1-n2"].uuids]
    assert planner.committed_w()[idx].sum() == pytest.approx(held)  # not 4 × 700 W
    # A cut to the lowest budget is met by the others; one below it, not: alarmed, naming
    # the node that cannot move.
    world.cut("r1", 0.0)
    world.tick()
    world.tick()
    assert world.caps_w("r1") <= 2000.0 + TOL
    world.engine.overrides.set_budget(
        world.policy, BudgetOverride("r1", 1500.0, None, "test", "test", WALL0 + world.t)
    )
    world.tick()
    alarm = world.engine.alarms.active["cut_unreachable"]
    assert alarm.startswith("budgets that cannot be met") and "r1 " in alarm and "r1-n2" in alarm
    assert world.caps_w("r1-n1") == pytest.approx(800.0)  # the others at their minimum


def test_a_lowest_budget_the_check_refuses_is_one_a_dead_controller_leaves_behind() -> None:
    """What the check refuses, run anyway: r1 may be cut to 1,800 W, below its failsafe
    caps (8 × 250 W). The controller dies, every lease runs out, and then the cut comes (a
    scheduled window that starts while nobody leads): the agents hold r1 at its failsafe
    caps, above the cut. With the lowest budget the check asks for, they do not."""
    keeps = {"r1-n2": True}
    with pytest.raises(PolicyError, match="lowest_budget_w"):
        parse_policy(site(keeps, failsafe_w=250.0, lowest={"r1": 1800.0}))
    for lowest, holds in ((1800.0, False), (2000.0, True)):
        valid = parse_policy(site(keeps, failsafe_w=250.0, lowest={"r1": 2000.0}))
        policy = replace(
            valid,
            groups=tuple(
                replace(g, lowest_budget_w=lowest) if g.name == "r1" else g for g in valid.groups
            ),
        )
        world = World(policy, keeps, 250.0)
        for node in world.nodes.values():
            node.demand = dict.fromkeys(node.uuids, 700.0)
        for _ in range(6):
            world.tick()
            world.check_live()
        for s in range(int(LEASE_S) + 2):  # the controller is gone
            for node in world.nodes.values():
                node.lease(float(world.t + s))
        assert (world.caps_w("r1") <= lowest + TOL) is holds


def test_the_wire_says_it_only_where_the_actuator_keeps_limits() -> None:
    # An older agent's status has no such field: it keeps nothing.
    old = decode(b'{"v": 1, "node_id": "n1", "state": "offline"}', NodeStatus, topic_node="n1")
    assert old.keeps_limits is False
    assert RedfishBackend.keeps_limits is True
    assert MockBackend.keeps_limits is False


STEP = st.one_of(
    st.tuples(st.just("demand"), st.integers(0, 2**31)),
    st.tuples(st.just("die"), st.sampled_from(NODES)),
    st.tuples(st.just("die_all")),
    st.tuples(st.just("cut"), st.sampled_from(["dc", "r1", "r2", *NODES]), st.floats(0, 1)),
    st.tuples(st.just("lift"), st.sampled_from(["dc", "r1", "r2", *NODES])),
)


@st.composite
def sites(draw: st.DrawFn) -> tuple[dict[str, Any], dict[str, bool], float]:
    keeps = {n: draw(st.booleans()) for n in NODES}
    failsafe = draw(st.sampled_from([200.0, 300.0, 400.0]))
    lowest = {}
    groups = [("dc", 16, 7000.0), ("r1", 8, 3800.0), ("r2", 8, 3800.0)]
    for name, n_gpus, budget in [*groups, *((n, GPUS, 2400.0) for n in NODES)]:
        if draw(st.booleans()):
            share = draw(st.sampled_from([0.0, 0.5, 0.9, 1.0]) | st.floats(0, 1))
            lowest[name] = n_gpus * failsafe + share * (budget - n_gpus * failsafe)
    rated = {
        name: draw(st.sampled_from([10.0, 25.0]))
        for name in ("dc", "r1", "r2")
        if draw(st.booleans())
    }
    headroom = draw(st.sampled_from([50.0, 200.0]))
    data = site(keeps, failsafe_w=failsafe, lowest=lowest, rated=rated, headroom_w=headroom)
    return data, keeps, failsafe


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    site_=sites(),
    steps=st.lists(STEP, min_size=4, max_size=25),
    death=st.integers(0, 30),
)
def test_every_budget_holds_whatever_dies_when_actuators_keep_their_limits(
    site_: tuple[dict[str, Any], dict[str, bool], float],
    steps: list[tuple[Any, ...]],
    death: int,
) -> None:
    data, keeps, failsafe = site_
    world = World(parse_policy(data), keeps, failsafe)
    for _ in range(3):  # the first acks: GPUs counted at their maximum until then
        world.tick()
    for k, step in enumerate(steps):
        if k == death:
            break
        kind = step[0]
        if kind == "demand":
            rng = np.random.default_rng(step[1])
            for node in world.nodes.values():
                node.demand = {
                    u: float(rng.choice([150.0, 700.0, rng.uniform(150, 700)])) for u in node.uuids
                }
        elif kind == "die" and keeps[step[1]]:
            world.bmc_agent_dies(step[1])
        elif kind == "die_all":  # one bmc-agent process serves every such node
            for name in NODES:
                if keeps[name]:
                    world.bmc_agent_dies(name)
        elif kind == "cut":
            world.cut(step[1], step[2])
        elif kind == "lift":
            world.lift(step[1])
        # The work moved under the caps in force: within the rating at once.
        world.check_live()
        world.tick()
        world.check_live()
    # The controller dies (or the steps ran out and it dies now): the leases run out, every
    # agent and every live bmc-agent lowers to its failsafe caps, the dead ones' BMCs keep
    # theirs. The budgets that bound hold without anyone steering, rated ones strictly.
    for node in world.nodes.values():
        node.demand = dict.fromkeys(node.uuids, 700.0)
    for s in range(int(LEASE_S) + 2):
        for node in world.nodes.values():
            node.lease(float(world.t + s))
    world.check_strict()


# -- the planner: what-if checks at every tick ---------------------------------------------


class PlannerWorld:
    """The safety planner alone, fed acks at once, with limits anywhere between each
    group's budget in force and its rating (what the overload rule may hand it) and budgets
    cut anywhere down to the group's lowest."""

    def __init__(self, policy: Policy, failsafe_w: float) -> None:
        self.policy = policy
        self.uuids = [f"GPU-{n}-{i}" for n in NODES for i in range(GPUS)]
        self.node_of = {u: u[4:-2] for u in self.uuids}
        n = len(self.uuids)
        layout = GpuLayout.build(
            policy, self.uuids, [self.node_of[u] for u in self.uuids], [200.0] * n, [700.0] * n
        )
        self.layout = layout
        self.planner = SafetyPlanner(policy, layout)
        # Their bmc-agent says so too: offline, they count at their committed caps.
        self.planner.claim_keeps_limits([g.name for g in policy.groups if g.keeps_limits])
        self.caps = dict.fromkeys(self.uuids, failsafe_w)
        self.failsafe_w = failsafe_w
        self.dead: set[str] = set()
        self.t = 0
        for node in NODES:
            self.planner.on_telemetry(node, self.node_caps(node), received_at=0.0)
        self.planner.assume_settled()

    def node_caps(self, node: str) -> dict[str, float]:
        return {u: c for u, c in self.caps.items() if self.node_of[u] == node}

    def step(self, targets: np.ndarray, limit: np.ndarray, strict: np.ndarray) -> None:
        self.t += 1
        plan = self.planner.plan(
            self.t, float(self.t), targets, budget_w=limit, strict_w=strict, offline=self.dead
        )
        for cmd in plan.commands:
            if cmd.node in self.dead:
                continue
            self.caps.update(cmd.caps_w)
            acks = {u: GpuAck(requested_w=w, enforced_w=w) for u, w in cmd.caps_w.items()}
            self.planner.on_ack(cmd.node, cmd.tick, acks)
            self.planner.on_telemetry(
                cmd.node, self.node_caps(cmd.node), received_at=float(self.t), as_of_tick=cmd.tick
            )

    def sums(self, per_gpu: Mapping[str, float]) -> np.ndarray:
        topo = self.layout.topology
        return topo.group_sums(np.array([per_gpu[u] for u in self.uuids])) + topo.overhead_w


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    site_=sites(),
    ticks=st.lists(
        st.tuples(
            st.integers(0, 2**31),  # targets
            st.floats(0, 1),  # how much of the rating each rated group is lent
            st.sampled_from([None, "dc", "r1", "r2", *NODES]),  # a group cut
            st.floats(0, 1),  # how deep, between its lowest and its budget
            st.sampled_from([None, *NODES]),  # a bmc-agent that dies
        ),
        min_size=3,
        max_size=25,
    ),
)
def test_at_every_tick_frozen_limits_fit_the_lowest_cut_and_what_leases_take_back(
    site_: tuple[dict[str, Any], dict[str, bool], float], ticks: list[tuple[Any, ...]]
) -> None:
    """After every tick, whatever freezes now: (a) with every GPU that keeps its limits
    frozen and the others at their minimum, every group fits its lowest budget (a live
    controller meets any cut down to it); (b) with those frozen and the others fallen to
    min(cap, failsafe cap) (the controller died, leases ran out), every group fits its
    budget in force (an overload lent nothing those cannot give back)."""
    data, keeps, failsafe = site_
    policy = parse_policy(data)
    world = PlannerWorld(policy, failsafe)
    topo = world.layout.topology
    names = list(topo.names)
    keeps_gpu = {u: keeps[world.node_of[u]] for u in world.uuids}
    lowest = np.array(
        [
            topo.budget_w[k] if g.lowest_budget_w is None else g.lowest_budget_w
            for k, g in enumerate(policy.groups)
        ]
    )
    pct = np.array([g.overload.pct if g.overload else 0.0 for g in policy.groups])
    budget = topo.budget_w.copy()
    for seed, lend, cut, depth, dies in ticks:
        rng = np.random.default_rng(seed)
        if cut is not None:
            k = names.index(cut)
            budget[k] = lowest[k] + depth * (topo.budget_w[k] - lowest[k])
        if dies is not None and keeps[dies] and dies not in world.dead:
            world.dead.add(dies)
            world.planner.node_offline(dies)
        limit = budget * (1 + lend * pct / 100)
        world.step(rng.uniform(200, 700, len(world.uuids)), limit, budget)
        caps = world.caps
        assert (world.sums(caps) <= limit + TOL).all()
        frozen_cut = {u: c if keeps_gpu[u] else 200.0 for u, c in caps.items()}
        over = world.sums(frozen_cut) - lowest
        assert (over <= TOL).all(), f"lowest budget unreachable at {names[int(over.argmax())]}"
        after_leases = {u: c if keeps_gpu[u] else min(c, failsafe) for u, c in caps.items()}
        over = world.sums(after_leases) - budget
        assert (over <= TOL).all(), f"left above the budget at {names[int(over.argmax())]}"


def test_a_scope_leaves_the_lowest_budgets_above_it_to_the_coordinator() -> None:
    policy = parse_policy(site({"r1-n2": True}, lowest={"dc": 5000.0, "r1": 2000.0}))
    scoped = {g.name: g for g in policy.scope("r1").groups}
    assert scoped["dc"].lowest_budget_w is None  # no budget there: the coordinator's
    assert scoped["r1"].lowest_budget_w == 2000.0
    assert scoped["r1-n2"].keeps_limits


def test_a_group_whose_frozen_limits_the_leases_cannot_cover_is_lent_nothing() -> None:
    """r1 is rated 25 % and may be cut to 2,600 W; r1-n1 keeps its limits, r1-n2 runs an
    agent (failsafe 300 W). r1-n1 holds 2,600 − 4 × 200 = 1,800 W and freezes there. r1 is
    cut to 2,600 W: were it still lent room, r1-n2 could rise above 800 W, and once the
    controller died its lease would leave it at 4 × 300 W: 3,000 W in r1. So r1 is held
    to its strict budget: r1-n2 at its minimum."""
    keeps = {"r1-n1": True}
    policy = parse_policy(site(keeps, failsafe_w=300.0, lowest={"r1": 2600.0}, rated={"r1": 25}))
    world = PlannerWorld(policy, 300.0)
    names = list(world.layout.topology.names)
    r1 = names.index("r1")
    budget = world.layout.topology.budget_w.copy()
    pct = np.array([g.overload.pct if g.overload else 0.0 for g in policy.groups])
    targets = np.full(len(world.uuids), 700.0)
    for _ in range(4):
        world.step(targets, budget * (1 + pct / 100), budget)
    frozen = sum(c for u, c in world.caps.items() if world.node_of[u] == "r1-n1")
    assert frozen == pytest.approx(1800.0)
    world.dead.add("r1-n1")
    world.planner.node_offline("r1-n1")
    budget[r1] = 2600.0
    for _ in range(3):
        world.step(targets, budget * (1 + pct / 100), budget)
        after_leases = {
            u: c if keeps.get(world.node_of[u]) else min(c, 300.0) for u, c in world.caps.items()
        }
        assert world.sums(after_leases)[r1] <= 2600.0 + TOL
    assert sum(c for u, c in world.caps.items() if world.node_of[u] == "r1-n2") == pytest.approx(
        800.0
    )
