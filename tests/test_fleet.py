"""FleetState: latest sample per GPU, ages, staleness, unknown nodes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from powerd.controller.fleet import FleetState, NodeReadings, split_fleet
from powerd.policy import load_policy
from powerd.wire import GpuTelemetry, NodeState, NodeStatus, NodeTelemetry

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "example.yaml"


def telemetry(node: str, uuids: list[str], power: float = 400.0, seq: int = 0) -> NodeTelemetry:
    gpus = [
        GpuTelemetry(
            uuid=u,
            index=i,
            power_w=power,
            energy_j=1.0,
            cap_w=700,
            min_cap_w=200,
            max_cap_w=700,
            default_cap_w=700,
            temp_c=50,
            util_pct=90,
            sm_clock_mhz=1800,
            workload="inference" if i == 0 else None,
        )
        for i, u in enumerate(uuids)
    ]
    return NodeTelemetry(node_id=node, ts=0.0, seq=seq, period_s=1.0, gpus=gpus)


def test_arrays_follow_policy_order_and_mark_stale_gpus() -> None:
    fleet = FleetState(load_policy(EXAMPLE))
    n2, n1 = "row-1-rack-1-node-02", "row-1-rack-1-node-01"
    assert fleet.ingest_telemetry(telemetry(n2, ["c", "d"]), now=10.0)
    assert fleet.ingest_telemetry(telemetry(n1, ["b", "a"], power=300), now=12.0)
    arrays = fleet.arrays(now=16.0, stale_after_s=5.0)
    assert arrays.uuids == ["b", "a", "c", "d"]  # node order, then GPU index
    assert arrays.nodes == [n1, n1, n2, n2]
    assert list(arrays.age_s) == [4.0, 4.0, 6.0, 6.0]
    assert list(arrays.stale) == [False, False, True, True]
    assert list(arrays.power_w) == [300, 300, 400, 400]
    assert arrays.workloads == ["inference", None, "inference", None]


def test_unknown_nodes_are_tracked_apart_and_never_enter_the_arrays() -> None:
    fleet = FleetState(load_policy(EXAMPLE))
    assert not fleet.ingest_telemetry(telemetry("intruder", ["x"]), now=1.0)
    assert "intruder" in fleet.unknown_nodes
    assert fleet.arrays(now=1.0, stale_after_s=5.0).uuids == []


def test_gpu_set_changes_bump_the_version_and_status_caps_are_kept() -> None:
    fleet = FleetState(load_policy(EXAMPLE))
    node = "row-1-rack-1-node-01"
    fleet.ingest_telemetry(telemetry(node, ["a"]), now=1.0)
    v = fleet.version
    fleet.ingest_telemetry(telemetry(node, ["a"], seq=1), now=2.0)
    assert fleet.version == v
    fleet.ingest_telemetry(telemetry(node, ["a", "b"], seq=2), now=3.0)
    assert fleet.version == v + 1
    fleet.ingest_status(NodeStatus(node_id=node, state=NodeState.FAILSAFE, caps_w={"a": 300}))
    assert fleet.nodes[node].state is NodeState.FAILSAFE
    assert fleet.nodes[node].status_caps_w == {"a": 300}


def test_a_node_is_unseen_until_its_telemetry_and_counts_by_state() -> None:
    policy = load_policy(EXAMPLE)
    fleet = FleetState(policy)
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    fleet.ingest_status(NodeStatus(node_id=n2, state=NodeState.OFFLINE))  # no telemetry yet
    fleet.ingest_telemetry(telemetry(n1, ["a"]), now=1.0)
    assert (fleet.node_state(n1), fleet.node_state(n2)) == ("steered", "unseen")
    fleet.ingest_status(NodeStatus(node_id=n1, state=NodeState.FAILSAFE))
    assert fleet.node_state(n1) == "failsafe"
    assert fleet.state_counts() == {"failsafe": 1, "unseen": len(policy.node_names()) - 1}


def test_a_policy_without_a_node_forgets_its_gpus_and_keeps_the_others_samples() -> None:
    policy = load_policy(EXAMPLE)
    fleet = FleetState(policy)
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    fleet.ingest_telemetry(telemetry(n1, ["a", "b"], power=300), now=1.0)
    fleet.ingest_telemetry(telemetry(n2, ["c"], power=450), now=2.0)
    others = [name for name in policy.node_names() if name != n1]
    fleet.set_policy(policy.subset(others))
    arrays = fleet.arrays(now=3.0, stale_after_s=5.0)
    assert arrays.uuids == ["c"]
    assert list(arrays.power_w) == [450]
    assert list(arrays.age_s) == [1.0]
    assert set(fleet.gpus) == {"c"}


def test_a_gpu_index_change_reorders_the_arrays() -> None:
    fleet = FleetState(load_policy(EXAMPLE))
    node = "row-1-rack-1-node-01"
    fleet.ingest_telemetry(telemetry(node, ["a", "b"]), now=1.0)
    assert fleet.arrays(now=1.0, stale_after_s=5.0).uuids == ["a", "b"]
    swapped = telemetry(node, ["b", "a"], seq=1)
    fleet.ingest_telemetry(swapped, now=2.0)
    arrays = fleet.arrays(now=2.0, stale_after_s=5.0)
    assert arrays.uuids == ["b", "a"]
    assert arrays.workloads == ["inference", None]


def test_a_node_reports_at_most_its_inventory_and_keeps_its_own_gpus() -> None:
    policy = load_policy(EXAMPLE)
    fleet = FleetState(policy)
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    inventory = fleet.inventory[n1]
    assert inventory == next(g.gpus for g in policy.groups if g.name == n1)
    phantoms = [f"p{i}" for i in range(60)]
    fleet.ingest_telemetry(telemetry(n1, phantoms[:40]), now=1.0)
    fleet.ingest_telemetry(telemetry(n1, phantoms[40:]), now=2.0)
    assert sum(g.node == n1 for g in fleet.gpus.values()) == inventory
    assert fleet.nodes[n1].refused == 20
    # A uuid of n1's named by n2 too: it belongs to neither now; n2's own GPU is taken.
    fleet.ingest_telemetry(telemetry(n2, ["p0", "own"]), now=3.0)
    assert "p0" not in fleet.gpus and fleet.gpus["own"].node == n2
    assert set(fleet.disputes["p0"].seen) == {n1, n2}
    fleet.ingest_telemetry(telemetry(n1, phantoms[:40]), now=4.0)  # n1 still names it
    assert "p0" not in fleet.gpus


def test_gpus_and_disputes_unseen_for_forget_after_are_forgotten() -> None:
    fleet = FleetState(load_policy(EXAMPLE))
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    fleet.ingest_telemetry(telemetry(n1, ["a", "b", "c"]), now=0.0)
    fleet.ingest_telemetry(telemetry(n2, ["a"]), now=5.0)  # "a" disputed: nobody's
    fleet.ingest_telemetry(telemetry(n1, ["a", "c"]), now=50.0)  # n1 no longer names "b"
    v = fleet.version
    assert fleet.forget(now=70.0, after_s=30.0) == ["b"]
    assert set(fleet.gpus) == {"c"} and fleet.version > v
    # n2 stopped naming "a" over 30 s ago: the dispute ends, n1's next sample takes it back.
    assert fleet.disputes == {}
    fleet.ingest_telemetry(telemetry(n1, ["a", "c"]), now=71.0)
    assert fleet.gpus["a"].node == n1


def test_a_nodes_repeated_sample_is_written_whole_and_a_dispute_still_stops_it() -> None:
    """The second sample of a node naming the same GPUs goes in one slice per column; a
    uuid another node claims in between is no longer written (nor steered) for either."""
    fleet = FleetState(load_policy(EXAMPLE))
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    fleet.ingest_telemetry(telemetry(n1, ["a", "b"], power=300), now=1.0)
    fleet.ingest_telemetry(telemetry(n1, ["a", "b"], power=350, seq=1), now=2.0)
    arrays = fleet.arrays(now=2.0, stale_after_s=5.0)
    assert list(arrays.power_w) == [350, 350]
    assert list(arrays.age_s) == [0.0, 0.0]
    fleet.ingest_telemetry(telemetry(n2, ["b"]), now=3.0)  # claims n1's "b"
    fleet.ingest_telemetry(telemetry(n1, ["a", "b"], power=250, seq=2), now=4.0)
    arrays = fleet.arrays(now=4.0, stale_after_s=5.0)
    assert arrays.uuids == ["a"]
    assert list(arrays.power_w) == [250]
    assert set(fleet.disputes["b"].seen) == {n1, n2}
    # The same GPUs named in another order: each GPU's own values, not the slots'.
    fleet.ingest_telemetry(telemetry(n2, ["d", "c"], power=200), now=5.0)
    fleet.ingest_telemetry(telemetry(n2, ["c", "d"], power=210, seq=1), now=6.0)
    by_uuid = dict(
        zip(
            fleet.arrays(now=6.0, stale_after_s=5.0).uuids,
            fleet.arrays(now=6.0, stale_after_s=5.0).power_w.tolist(),
            strict=True,
        )
    )
    assert by_uuid == {"a": 250, "c": 210, "d": 210}


def _end_to_end(samples: list[NodeReadings]) -> NodeReadings:
    """Samples' columns end to end, as the simulated agents' whole-fleet sample."""
    first = samples[0]
    values = {
        f.name: (
            [v for r in samples for v in getattr(r, f.name)]
            if isinstance(getattr(first, f.name), list)
            else getattr(first, f.name)
        )
        for f in dataclasses.fields(first)
    }
    values["no_errors"] = all(r.no_errors for r in samples)
    values["any_restores"] = any(r.any_restores for r in samples)
    return NodeReadings(**values)


def _same_arrays(a: FleetState, b: FleetState, now: float) -> None:
    x, y = a.arrays(now, stale_after_s=5.0), b.arrays(now, stale_after_s=5.0)
    for f in dataclasses.fields(x):
        u, v = getattr(x, f.name), getattr(y, f.name)
        if isinstance(u, np.ndarray):
            assert np.array_equal(u, v, equal_nan=True), f.name
        else:
            assert u == v, f.name
    assert (a.version, a.jobs_version, a.stops) == (b.version, b.jobs_version, b.stops)


def _two_fleets_and_a_sample(n2: str, n1: str) -> tuple[FleetState, FleetState, list[NodeReadings]]:
    """Two fleets that found n2's GPUs c, d, then n1's b, a (their slots in that order), and
    a sample of both nodes (n2 at 350 W, n1 at 250 W, seq 1)."""
    one, each = FleetState(load_policy(EXAMPLE)), FleetState(load_policy(EXAMPLE))
    for fleet in (one, each):
        fleet.ingest_telemetry(telemetry(n2, ["c", "d"]), now=1.0)
        fleet.ingest_telemetry(telemetry(n1, ["b", "a"]), now=1.0)
    samples = [
        NodeReadings.from_message(telemetry(n2, ["c", "d"], power=350.0, seq=1)),
        NodeReadings.from_message(telemetry(n1, ["b", "a"], power=250.0, seq=1)),
    ]
    return one, each, samples


def test_a_whole_fleets_samples_at_once_are_recorded_as_each_in_turn() -> None:
    n2, n1 = "row-1-rack-1-node-02", "row-1-rack-1-node-01"
    # The GPUs sit in slots in the order they were found: n2's, then n1's.
    one, each, samples = _two_fleets_and_a_sample(n2, n1)
    assert one.ingest_fleet(samples, _end_to_end(samples), now=2.0)
    for r in samples:
        each.ingest(r, now=2.0)
    _same_arrays(one, each, now=2.0)
    assert one.nodes == each.nodes  # each node's record: when, which sample, its state
    assert one.arrays(2.0, stale_after_s=5.0).power_w.tolist() == [250.0, 250.0, 350.0, 350.0]
    assert one.nodes[n1].seq == 1
    # Not in their slots' order, or a GPU in dispute: nothing recorded, each in turn instead.
    swapped = samples[::-1]
    assert not one.ingest_fleet(swapped, _end_to_end(swapped), now=3.0)
    assert one.nodes[n1].seen_at == 2.0
    one.ingest_telemetry(telemetry("row-1-rack-1-node-03", ["a"]), now=3.0)
    each.ingest_telemetry(telemetry("row-1-rack-1-node-03", ["a"]), now=3.0)
    assert not one.ingest_fleet(samples, _end_to_end(samples), now=3.0)
    _same_arrays(one, each, now=3.0)


def test_a_dispute_mid_message_keeps_the_later_gpus_samples() -> None:
    """A GPU that starts a dispute mid-message replaces the fleet's columns (its slot goes):
    the GPUs the same message names after it are recorded in the new columns, not lost in
    the old ones; a GPU first named after it joins the fleet with its sample."""
    fleet = FleetState(load_policy(EXAMPLE))
    n1, n2 = "row-1-rack-1-node-01", "row-1-rack-1-node-02"
    fleet.ingest_telemetry(telemetry(n1, ["a", "x"], power=300), now=1.0)
    fleet.ingest_telemetry(telemetry(n2, ["b", "c"], power=300), now=1.0)
    # n2 names n1's "x" between its own: "x" is disputed, "c" and the new "d" come after.
    fleet.ingest_telemetry(telemetry(n2, ["b", "x", "c", "d"], power=450, seq=1), now=2.0)
    assert "x" not in fleet.gpus and set(fleet.disputes["x"].seen) == {n1, n2}
    arrays = fleet.arrays(now=2.0, stale_after_s=5.0)
    by_uuid = dict(zip(arrays.uuids, arrays.power_w.tolist(), strict=True))
    assert by_uuid == {"a": 300, "b": 450, "c": 450, "d": 450}
    assert fleet.gpus["c"].power_w == 450 and fleet.gpus["d"].power_w == 450
    assert list(arrays.age_s) == [1.0, 0.0, 0.0, 0.0]


def _headers(samples: list[NodeReadings]) -> list[NodeReadings]:
    """The samples with every column but `uuid` emptied: what the simulator's agents hand
    over beside the whole fleet's columns."""
    blank = {name: [] for name in ("index", "name", "power_w", "cap_w", "perf", "job", "error")}
    return [dataclasses.replace(r, **blank) for r in samples]


def test_whole_fleet_samples_are_read_from_their_columns_end_to_end() -> None:
    """`ingest_fleet` and `split_fleet` take each node's columns from `whole`: samples that
    carry only each node's identity record the same as full ones, an index change included."""
    n2, n1 = "row-1-rack-1-node-02", "row-1-rack-1-node-01"
    one, each, samples = _two_fleets_and_a_sample(n2, n1)
    samples[1].index = [1, 0]  # n1's GPUs swap indices: the fleet's order changes
    whole = _end_to_end(samples)
    assert one.ingest_fleet(_headers(samples), whole, now=2.0)
    for r in samples:
        each.ingest(r, now=2.0)
    _same_arrays(one, each, now=2.0)
    parts = split_fleet(_headers(samples), whole)
    assert [(r.node_id, r.power_w, r.index) for r in parts] == [
        (r.node_id, r.power_w, r.index) for r in samples
    ]


def _with_arrays(whole: NodeReadings) -> NodeReadings:
    """The whole fleet's sample carrying its float columns as arrays too (as the simulated
    agents send it)."""
    names = ("min_cap_w", "max_cap_w", "power_w", "cap_w", "energy_j", "temp_c", "perf", "set_w")
    arrays = {n: np.array(getattr(whole, n), dtype=np.float64) for n in names}
    return dataclasses.replace(whole, arrays=arrays)


def test_a_sample_carrying_arrays_reads_the_same_and_later_samples_are_not_hidden() -> None:
    """A whole fleet's sample that carries its columns as arrays gives the fleet the same
    arrays as the lists do; a node's later sample (or a forgotten GPU) is read from the lists
    again, not from the arrays of the sample before."""
    n2, n1 = "row-1-rack-1-node-02", "row-1-rack-1-node-01"
    one, each, samples = _two_fleets_and_a_sample(n2, n1)
    assert one.ingest_fleet(samples, _with_arrays(_end_to_end(samples)), now=2.0)
    assert each.ingest_fleet(samples, _end_to_end(samples), now=2.0)
    _same_arrays(one, each, now=4.0)
    for fleet in (one, each):
        fleet.ingest_telemetry(telemetry(n1, ["b", "a"], power=150.0, seq=2), now=3.0)
    _same_arrays(one, each, now=4.0)
    assert one.arrays(4.0, stale_after_s=5.0).power_w.tolist() == [150.0, 150.0, 350.0, 350.0]
    assert one.arrays(4.0, stale_after_s=5.0).age_s.tolist() == [1.0, 1.0, 2.0, 2.0]
    # Again from arrays; then n2's GPUs go unheard past forget_after_s and are forgotten.
    assert one.ingest_fleet(samples, _with_arrays(_end_to_end(samples)), now=5.0)
    assert each.ingest_fleet(samples, _end_to_end(samples), now=5.0)
    for fleet in (one, each):
        fleet.ingest_telemetry(telemetry(n1, ["b", "a"], power=100.0, seq=3), now=20.0)
        assert sorted(fleet.forget(now=20.0, after_s=10.0)) == ["c", "d"]
    _same_arrays(one, each, now=20.0)
    assert one.arrays(20.0, stale_after_s=5.0).power_w.tolist() == [100.0, 100.0]
