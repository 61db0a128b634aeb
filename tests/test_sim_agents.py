"""The simulated agents' samples (powerd/sim/agents.py): the model's values per node as
columns, held to the wire's bounds like a telemetry message."""

from __future__ import annotations

import math

import numpy as np
import pytest

from powerd.backends.mock import SimulatedGpus, Workload
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
