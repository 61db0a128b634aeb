"""The simulated agents' samples (powerd/sim/agents.py): the model's values per node as
columns, held to the wire's bounds like a telemetry message."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from support.planner import policy_dict

from powerd.backends.mock import SimulatedGpus, Workload
from powerd.policy import parse_policy
from powerd.safety import GpuLayout, SafetyPlanner
from powerd.sim.agents import SimAgents, check_readings


def agents() -> SimAgents:
    model = SimulatedGpus(6, Workload.steady(500.0))
    return SimAgents(model, ["n1"] * 4 + ["n2"] * 2, ["training"] * 6, period_s=5.0)


def test_readings_are_the_models_values_per_node_and_the_messages_carry_the_same() -> None:
    a = agents()
    a.model.advance(3.0)
    first = a.readings(10.0)
    m = a.model
    assert [r.node_id for r in first] == ["n1", "n2"]
    assert first[1].uuid == m.uuids[4:6]
    assert first[1].index == [0, 1]
    assert first[0].power_w == m.power_w[:4].tolist()
    assert first[1].perf == m.throughput()[4:6].tolist()
    assert first[0].workload == ["training"] * 4
    assert all(math.isnan(v) for v in first[0].set_w)
    seq = first[0].seq
    msgs = a.telemetry(11.0)  # the next sample, as wire messages
    assert msgs[0].seq == seq + 1
    assert [g.power_w for g in msgs[0].gpus] == m.power_w[:4].tolist()
    assert [g.uuid for g in msgs[1].gpus] == m.uuids[4:6]


def test_values_out_of_the_wires_bounds_are_refused() -> None:
    ok = {
        "power_w": np.array([300.0]), "energy_j": np.array([1.0]), "cap_w": np.array([700.0]),
        "min_cap_w": np.array([200.0]), "max_cap_w": np.array([700.0]),
        "default_cap_w": np.array([700.0]), "temp_c": np.array([50.0]),
        "util_pct": np.array([90.0]), "sm_clock_mhz": np.array([1800.0]),
        "perf": np.array([0.5]),
    }  # fmt: skip
    check_readings(**ok)
    for name, bad in [("temp_c", math.nan), ("util_pct", 101.0), ("power_w", -1.0),
                      ("max_cap_w", 0.0), ("perf", math.inf)]:  # fmt: skip
        with pytest.raises(ValueError, match=name):
            check_readings(**{**ok, name: np.array([bad])})
    with pytest.raises(ValueError, match="min_cap_w"):
        check_readings(**{**ok, "min_cap_w": np.array([800.0])})


def test_a_plan_applied_as_columns_sets_and_acknowledges_what_its_commands_do() -> None:
    """`apply_plan` = `apply(plan.commands)`: the same caps set on the model (clamped to the
    device), and per GPU of the plan's layout the limit each command's ack would carry."""
    by_plan, by_command = agents(), agents()
    uuids = by_plan.model.uuids
    policy = parse_policy(policy_dict([{"name": "n1", "gpus": 4}, {"name": "n2", "gpus": 2}]))
    # The layout's GPUs in another order than the model's, limits wider than the device's.
    order = [3, 1, 2, 0, 5, 4]
    nodes = ["n1"] * 4 + ["n2"] * 2
    layout = GpuLayout.build(
        policy, [uuids[i] for i in order], nodes, np.full(6, 50.0), np.full(6, 2000.0)
    )
    planner = SafetyPlanner(policy, layout)
    heard = [list(layout.uuids[:4]), list(layout.uuids[4:])]
    assert planner.on_fleet_telemetry(["n1", "n2"], heard, [300.0] * 6, 0.0, [None, None])
    planner.assume_settled()
    plan = planner.plan(1, 0.0, np.array([60.0, 250.0, 310.0, 1500.0, 280.0, 290.0]))
    assert [c.node for c in plan.commands] == ["n1", "n2"]
    enforced = by_plan.apply_plan(plan)
    acks = by_command.apply(plan.commands)
    assert by_plan.model.cap_w.tolist() == by_command.model.cap_w.tolist()
    assert by_plan.model.cap_w.min() > 60.0  # the device's minimum, not the plan's cap
    for _, acked in acks:
        for u, w in zip(acked.uuids, acked.enforced_w, strict=True):
            assert enforced[layout.uuids.index(u)] == w
    assert by_plan.applied == by_command.applied == {"n1": 1, "n2": 1}
    assert plan.acks(enforced) == [(cmd.node, cmd.tick, acked) for cmd, acked in acks]


def test_a_plan_with_a_cap_out_of_the_wires_bounds_is_refused() -> None:
    a = agents()
    policy = parse_policy(policy_dict([{"name": "n1", "gpus": 4}, {"name": "n2", "gpus": 2}]))
    layout = GpuLayout.build(policy, a.model.uuids, ["n1"] * 4 + ["n2"] * 2,
                             np.full(6, 50.0), np.full(6, 2000.0))  # fmt: skip
    planner = SafetyPlanner(policy, layout)
    heard = [list(layout.uuids[:4]), list(layout.uuids[4:])]
    assert planner.on_fleet_telemetry(["n1", "n2"], heard, [300.0] * 6, 0.0, [None, None])
    plan = planner.plan(1, 0.0, np.full(6, 200.0))
    assert plan.commands
    bad = plan.sent_w.copy()
    bad[0] = math.nan  # a command's cap the columns do not hold
    with pytest.raises(ValueError, match="wire's bounds"):
        a.apply_plan(replace(plan, sent_w=bad))
    bad[0] = 1e9
    with pytest.raises(ValueError, match="wire's bounds"):
        a.apply_plan(replace(plan, sent_w=bad))


def test_the_fleets_sample_lists_the_device_bounds_as_they_are_now() -> None:
    """The bounds' lists are kept from sample to sample while the model's bounds stay the
    same: a bound that changes (a GPU's device replaced) shows in the next sample."""
    a = agents()
    m = a.model
    _, first = a.fleet_readings(5.0)
    before = list(first.max_cap_w)  # (the sample object is reused: its lists replaced)
    assert before == m.max_cap_w.tolist()
    m.max_cap_w[2] -= 50.0
    m.min_cap_w[5] += 10.0
    m.default_cap_w[0] = -0.0 if m.default_cap_w[0] == 0.0 else m.default_cap_w[0] - 1.0
    _, second = a.fleet_readings(10.0)
    assert second.max_cap_w == m.max_cap_w.tolist()
    assert second.min_cap_w == m.min_cap_w.tolist()
    assert second.default_cap_w == m.default_cap_w.tolist()
    assert second.max_cap_w[2] == before[2] - 50.0
