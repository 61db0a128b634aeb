"""Topology arrays and snapshot validation against the policy."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from powerd.policy import Policy, load_policy
from powerd.snapshot import SnapshotError, load_snapshot, parse_snapshot
from powerd.topology import Topology, TopologyError

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "example.yaml"


@pytest.fixture(scope="module")
def policy() -> Policy:
    return load_policy(EXAMPLE)


def test_group_sums_count_every_gpu_at_every_level(policy: Policy) -> None:
    nodes = [n for n in policy.node_names() for _ in range(8)]
    topo = Topology.build(policy, nodes)
    sums = topo.group_sums(np.full(topo.n_gpus, 700.0))
    assert sums[0] == 512 * 700
    rows = topo.groups_at(1)
    assert list(sums[rows]) == [256 * 700, 256 * 700]
    assert set(sums[topo.groups_at(3)]) == {8 * 700}
    # Overhead is pushed up the tree: 64 nodes × 1 kW at the facility.
    assert topo.overhead_w[0] == 64_000
    assert topo.capacity_w[0] == 250_000 - 64_000
    assert list(topo.subtree_gpus(topo.groups_at(3)[1])) == list(range(8, 16))


def test_violations_report_group_and_excess(policy: Policy) -> None:
    nodes = [n for n in policy.node_names() for _ in range(8)]
    topo = Topology.build(policy, nodes)
    caps = np.full(topo.n_gpus, 300.0)
    assert topo.violations(caps) == []
    caps[:8] = 700.0  # node 1: 5,600 + 1,000 overhead > 6,500
    ((group, excess),) = topo.violations(caps)
    assert topo.names[group] == "row-1-rack-1-node-01"
    assert excess == pytest.approx(100.0)


def test_gpus_on_unknown_nodes_are_refused(policy: Policy) -> None:
    with pytest.raises(TopologyError, match="1 node\\(s\\) not in the policy: ghost"):
        Topology.build(policy, ["row-1-rack-1-node-01", "ghost"])


def gpu(uuid: str, **kw: object) -> dict[str, object]:
    base: dict[str, object] = {
        "uuid": uuid,
        "node": "row-1-rack-1-node-01",
        "min_cap_w": 200,
        "max_cap_w": 700,
        "power_w": 400,
        "cap_w": 700,
    }
    return base | kw


def test_snapshot_problems_name_each_bad_gpu(policy: Policy) -> None:
    data = {
        "gpus": [
            gpu("a"),
            gpu("a"),
            gpu("b", node="ghost"),
            gpu("c", workload="gold"),
            gpu("d", min_cap_w=800),
        ]
    }
    with pytest.raises(SnapshotError) as info:
        parse_snapshot(data, policy, "s.json")
    assert [p for p, _ in info.value.problems] == ["gpus[4]"]  # schema errors come first
    data["gpus"].pop()
    with pytest.raises(SnapshotError) as info:
        parse_snapshot(data, policy, "s.json")
    paths = [p for p, _ in info.value.problems]
    assert paths == ["gpus[1].uuid", "gpus[2].node", "gpus[3].workload"]
    assert "valid: batch, inference, training" in info.value.problems[2][1]


def test_negative_watts_and_bad_json_are_refused(policy: Policy, tmp_path: Path) -> None:
    with pytest.raises(SnapshotError, match=r"gpus\[0\].power_w"):
        parse_snapshot({"gpus": [gpu("a", power_w=-1)]}, policy)
    bad = tmp_path / "s.json"
    bad.write_text("{not json")
    with pytest.raises(SnapshotError, match="not valid JSON"):
        load_snapshot(bad, policy)
    good = tmp_path / "g.json"
    good.write_text(json.dumps({"gpus": [gpu("a")]}))
    assert load_snapshot(good, policy).gpus[0].uuid == "a"
