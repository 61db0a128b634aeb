"""The allocator on hand-made cases: infeasible budgets, pinned and stale GPUs, slew, demand,
the Snapshot API and its JSON."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from powerd.allocator import (
    FLOORS_DROPPED,
    INFEASIBLE_MIN,
    OPTIMAL,
    SOLVERS,
    Allocation,
    allocate,
    allocate_arrays,
    fleet_from_snapshot,
)
from powerd.policy import Policy, load_policy, parse_policy
from powerd.snapshot import Snapshot, parse_snapshot
from powerd.testing.synthetic import make_policy, policy_dict, random_fleet, to_snapshot

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "example.yaml"
NODE = "row-1-rack-1-node-01"
# Small cases: .ci/run also runs them as plain Python (NUMBA_DISABLE_JIT=1, docs/allocator.md).
pytestmark = pytest.mark.plain_python


@pytest.fixture(scope="module")
def example() -> Policy:
    return load_policy(EXAMPLE)


def gpu(uuid: str, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "uuid": uuid,
        "node": NODE,
        "min_cap_w": 200,
        "max_cap_w": 700,
        "power_w": 690,
        "cap_w": 700,
        "workload": "training",
    }
    return base | kw


def snap(policy: Policy, *gpus: dict[str, Any]) -> Snapshot:
    return parse_snapshot({"gpus": list(gpus)}, policy)


def budgets_hold(alloc: Allocation, snapshot: Snapshot, policy: Policy) -> bool:
    topo = fleet_from_snapshot(snapshot, policy).topology
    return topo.violations(alloc.caps_w) == []


def leftover_max(policy: Policy) -> Policy:
    data = policy.spec.model_dump(by_alias=True)
    data["control"]["leftover"] = "max"
    return parse_policy(data)


@pytest.mark.parametrize("solver", SOLVERS)
def test_a_full_node_splits_by_weight_and_hands_out_the_rest(example: Policy, solver: str) -> None:
    # 8 hungry GPUs on one node: 5,500 W of room for 5,600 W of maxima.
    s = snap(
        example, *(gpu(f"g{i}", workload="inference" if i < 2 else "training") for i in range(8))
    )
    alloc = allocate(s, leftover_max(example), solver)
    caps = alloc.caps()
    assert alloc.status == OPTIMAL
    assert sum(caps.values()) == pytest.approx(5500.0, abs=1e-6)
    # The node is full; the site's room (its budget less 64 nodes' overhead) is not.
    assert alloc.unused_w == pytest.approx(250_000.0 - 64 * 1000.0 - 5500.0, abs=1e-6)
    assert budgets_hold(alloc, s, example)
    if solver in ("fast", "cvxpy"):
        # Inference is saturated at 600 W; training shares the rest equally.
        assert caps["g0"] >= 600.0 - 0.5
        assert caps["g2"] == pytest.approx(caps["g7"], abs=0.5)


@pytest.mark.parametrize("solver", SOLVERS)
def test_power_past_a_peak_is_left_unallocated(example: Policy, solver: str) -> None:
    # The same node by default: inference peaks at 600 W (llm-inference is flat from there),
    # so its GPUs stop there, training gets its 700 W maximum, and 100 W stay unused.
    s = snap(
        example, *(gpu(f"g{i}", workload="inference" if i < 2 else "training") for i in range(8))
    )
    alloc = allocate(s, example, solver)
    caps = alloc.caps()
    assert alloc.status == OPTIMAL
    assert caps["g0"] == pytest.approx(600.0, abs=1e-6)
    assert caps["g1"] == pytest.approx(600.0, abs=1e-6)
    assert all(caps[f"g{i}"] == pytest.approx(700.0, abs=1e-6) for i in range(2, 8))
    assert budgets_hold(alloc, s, example)
    # The node is the tightest budget, but what the root reports is the site's room.
    room = 250_000.0 - 64 * 1000.0 - sum(caps.values())
    assert alloc.unused_w == pytest.approx(room, abs=1e-6)
    assert alloc.to_json()["unused_w"] == alloc.unused_w


def test_a_floor_above_the_peak_still_holds() -> None:
    data = policy_dict(1, 1, 1, 2, fractions=(1.0, 1.0, 1.0, 1.0))  # 1,400 W of room
    data["classes"] = dict(data["classes"]) | {
        "gold": {"weight": 8.0, "floor_w": 650.0, "profile": "llm-inference"}
    }
    policy = parse_policy(data)
    node = next(g.name for g in policy.groups if g.level == 3)
    s = snap(
        policy, gpu("a", node=node, workload="gold"), gpu("b", node=node, workload="inference")
    )
    caps = allocate(s, policy).caps()
    assert caps["a"] == pytest.approx(650.0, abs=1e-6)  # the floor wins over the 600 W peak
    assert caps["b"] == pytest.approx(600.0, abs=1e-6)  # the peak


def test_power_past_demand_goes_to_whoever_is_left(example: Policy) -> None:
    # One GPU draws 100 W under a 700 W cap: it wants 150 W; the others use the rest.
    s = snap(example, *(gpu(f"g{i}") for i in range(7)), gpu("idle", power_w=100.0))
    caps = allocate(s, example, budget_overrides={NODE: 5000.0}).caps()  # 4,000 W room
    assert caps["idle"] == pytest.approx(200.0, abs=0.5)  # its device minimum
    assert sum(caps.values()) == pytest.approx(4000.0, abs=1e-6)
    # With room to spare every GPU, idle or not, is raised to its maximum.
    roomy = allocate(s, example, budget_overrides={NODE: 100_000}).caps()
    assert set(roomy.values()) == {700.0}


def test_floors_drop_lowest_weight_first_and_only_where_they_do_not_fit() -> None:
    data = policy_dict(1, 1, 2, 4)
    data["classes"] = dict(data["classes"]) | {
        "gold": {"weight": 8.0, "floor_w": 450.0, "profile": "llm-inference"}
    }
    policy = parse_policy(data)
    node1, node2 = (g.name for g in policy.groups if g.level == 3)
    gpus = [
        gpu(f"a{i}", node=node1, workload="gold" if i < 2 else "inference") for i in range(4)
    ] + [gpu(f"b{i}", node=node2, workload="inference") for i in range(4)]
    s = snap(policy, *gpus)
    # Node 1: floors need 2×450 + 2×350 = 1,600 W; give it 1,400 W of room.
    overhead = 800.0
    alloc = allocate(s, policy, budget_overrides={node1: 1400.0 + overhead})
    caps = alloc.caps()
    assert alloc.status == FLOORS_DROPPED
    assert sorted(alloc.dropped_floors) == ["a2", "a3"]
    assert caps["a0"] >= 450.0 - 1e-6 and caps["a1"] >= 450.0 - 1e-6
    assert all(caps[f"b{i}"] >= 350.0 - 1e-6 for i in range(4))
    topo = fleet_from_snapshot(s, policy).topology
    budget = topo.budget_w.copy()
    budget[topo.names.index(node1)] = 1400.0 + overhead
    assert np.all(topo.group_sums(alloc.caps_w) + topo.overhead_w <= budget + 1e-6)


@pytest.mark.parametrize("solver", SOLVERS)
def test_minimums_that_do_not_fit_pin_that_group_and_the_rest_is_solved(solver: str) -> None:
    policy = make_policy(1, 2, 2, 4)
    fleet = random_fleet(policy, 7, limited_share=1.0)
    topo = fleet.topology
    bad = topo.groups_at(3)[0]
    budget = topo.budget_w.copy()
    budget[bad] = topo.overhead_w[bad] + 500.0  # four GPUs, minimums ≥ 600 W
    alloc = allocate_arrays(fleet, policy, solver, budget_w=budget)
    assert alloc.status == INFEASIBLE_MIN
    assert alloc.infeasible_groups == (topo.names[bad],)
    under = topo.gpu_groups[:, 3] == bad
    assert np.allclose(alloc.caps_w[under], fleet.min_cap_w[under])
    assert not np.allclose(alloc.caps_w[~under], fleet.min_cap_w[~under])
    excess = topo.group_sums(alloc.caps_w) + topo.overhead_w - budget
    assert excess[bad] > 0  # the alarm: nothing can make this node fit
    assert np.all(np.delete(excess, bad) <= 1e-6)  # its ancestors and the rest still hold


def test_pinned_and_stale_gpus(example: Policy) -> None:
    s = snap(
        example,
        *(gpu(f"g{i}") for i in range(6)),
        gpu("pinned", pinned_w=333.0),
        gpu("stale", stale=True, cap_w=410.0, power_w=409.0),
    )
    caps = allocate(s, example, budget_overrides={NODE: 100_000}).caps()
    assert caps["pinned"] == pytest.approx(333.0, abs=1e-9)
    assert caps["stale"] == pytest.approx(410.0, abs=1e-9)  # not raised, even with room
    assert caps["g0"] == pytest.approx(700.0)


def test_slew_limits_moves_but_never_a_safety_cut(example: Policy) -> None:
    data = policy_dict(1, 1, 1, 4, slew_w=50.0)
    policy = parse_policy(data)
    fleet = random_fleet(policy, 3, limited_share=1.0)
    loose = fleet.topology.budget_w * 10
    alloc = allocate_arrays(fleet, policy, budget_w=loose)
    assert np.all(np.abs(alloc.caps_w - fleet.cap_w) <= 50.0 + 1e-6)
    # A budget far below the caps in force: cuts go past the slew limit.
    tight = fleet.topology.budget_w.copy()
    tight[:] = fleet.topology.overhead_w + fleet.min_cap_w.sum() + 10.0
    cut = allocate_arrays(fleet, policy, budget_w=tight)
    excess = fleet.topology.group_sums(cut.caps_w) + fleet.topology.overhead_w - tight
    assert np.all(excess <= 1e-6)
    assert np.any(fleet.cap_w - cut.caps_w > 50.0 + 1e-6)


def test_zero_damping_is_deterministic_and_splits_ties_evenly(example: Policy) -> None:
    data = policy_dict(1, 1, 1, 4, damping=0.0)
    policy = parse_policy(data)
    node = policy.node_names()[0]
    s = snap(policy, *(gpu(f"g{i}", node=node, cap_w=500.0, power_w=499.0) for i in range(4)))
    a = allocate(s, policy).caps()
    assert a == allocate(s, policy).caps()
    assert max(a.values()) - min(a.values()) <= 0.5


def test_reserved_power_is_taken_from_the_group_and_its_ancestors(example: Policy) -> None:
    s = snap(example, *(gpu(f"g{i}") for i in range(8)))
    alloc = allocate(s, example, reserved_w={NODE: 1000.0})
    assert sum(alloc.caps().values()) == pytest.approx(4500.0, abs=1e-6)


def test_unknown_group_or_solver_is_refused(example: Policy) -> None:
    s = snap(example, gpu("g0"))
    with pytest.raises(ValueError, match="ghost"):
        allocate(s, example, budget_overrides={"ghost": 1.0})
    with pytest.raises(ValueError, match="unknown solver"):
        allocate(s, example, "magic")


def test_json_output_and_snapshot_path_match_the_array_path() -> None:
    policy = make_policy(1, 2, 2, 2)
    fleet = random_fleet(policy, 11, stale_share=0.2, pinned_share=0.2)
    by_arrays = allocate_arrays(fleet, policy)
    by_snapshot = allocate(to_snapshot(fleet, policy), policy)
    assert np.allclose(by_arrays.caps_w, by_snapshot.caps_w, rtol=0, atol=1e-9)
    out = by_snapshot.to_json()
    assert {"status", "solver", "objective", "solve_ms", "caps"} <= set(out)
    assert out["caps"] == by_snapshot.caps()
    assert list(out["caps"]) == list(fleet.uuids)


def test_empty_snapshot(example: Policy) -> None:
    alloc = allocate(Snapshot(gpus=[]), example)
    assert alloc.status == OPTIMAL
    assert alloc.caps() == {}
