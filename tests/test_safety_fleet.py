"""The safety planner's whole-fleet entry points (`on_fleet_telemetry`, `on_fleet_acks`), as
the simulator's agents use them: on any sequence of messages they leave the planner exactly
as the same messages handed over node by node (`on_telemetry`, `on_ack`) do."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.planner import simple_fleet

from powerd.safety import AckedCaps, GpuLayout, SafetyPlanner

NODES = [3, 1, 2, 2]


def _state(planner: SafetyPlanner, tick: int, now: float) -> str:
    layout = planner.layout
    assert layout is not None
    plan = planner.plan(tick, now, np.full(layout.n_gpus, 300.0))
    # As text: NaN (no command) compares equal to NaN there.
    return repr(
        [
            planner.committed_w().tolist(),
            planner._low_w().tolist(),
            planner.defiant().tolist(),
            planner.settling().tolist(),
            planner.pending_since(np.arange(layout.n_gpus)).tolist(),
            planner._seen.tolist(),
            plan.sent_w.tolist(),
            [(c.node, c.caps_w) for c in plan.commands],
            [e.kind for e in plan.events],
        ]
    )


def _node_uuids(layout: GpuLayout) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for u, node in zip(layout.uuids, layout.nodes, strict=True):
        out.setdefault(node, []).append(u)
    return out


# One message batch: telemetry of every node (caps, tick per node, some NaN), or acks of
# some nodes (a tick each, obeyed or with a GPU left out), then a plan.
_caps = st.floats(100.0, 400.0)
_batch = st.tuples(
    st.sampled_from(["telemetry", "acks"]),
    st.lists(_caps, min_size=8, max_size=8),
    st.lists(st.one_of(st.none(), st.integers(0, 3)), min_size=4, max_size=4),
    st.lists(st.booleans(), min_size=4, max_size=4),  # node included / obeyed
    st.booleans(),  # a NaN reading somewhere (telemetry)
    st.one_of(st.none(), st.integers(0, 3)),  # a status of n0 first, of this tick
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(_batch, min_size=1, max_size=8), st.booleans())
def test_fleet_messages_leave_the_planner_as_node_by_node_messages_do(
    batches: list[tuple[str, list[float], list[int | None], list[bool], bool, int | None]],
    settled: bool,
) -> None:
    policy, layout = simple_fleet(NODES, facility=2400.0)
    one, fleet = SafetyPlanner(policy, layout), SafetyPlanner(policy, layout)
    if settled:
        one.assume_settled()
        fleet.assume_settled()
    uuids = _node_uuids(layout)
    nodes = list(uuids)
    for step, (kind, caps, ticks, flags, nan, pre) in enumerate(batches):
        now = float(step)
        if pre is not None:
            # A message node by node just before the batch: the order of arrival holds.
            status = dict(zip(uuids["n0"], caps[::-1], strict=False))
            one.learn_status("n0", status, as_of_tick=pre)
            fleet.learn_status("n0", status, as_of_tick=pre)
        if kind == "telemetry":
            values = list(caps)
            if nan:
                values[step % len(values)] = float("nan")
            as_of = [None if t is None else t for t in ticks]
            a = 0
            for node, t in zip(nodes, as_of, strict=True):
                b = a + len(uuids[node])
                one.on_telemetry(node, (uuids[node], values[a:b]), received_at=now, as_of_tick=t)
                a = b
            cols = [uuids[node] for node in nodes]
            if not fleet.on_fleet_telemetry(nodes, cols, values, now, as_of):
                assert nan  # the batch is refused only where a reading is missing
                a = 0
                for node, t in zip(nodes, as_of, strict=True):
                    b = a + len(uuids[node])
                    fleet.on_telemetry(
                        node, (uuids[node], values[a:b]), received_at=now, as_of_tick=t
                    )
                    a = b
        else:
            acks = []
            a = 0
            for node, t, ok in zip(nodes, ticks, flags, strict=True):
                b = a + len(uuids[node])
                names = uuids[node] if ok else uuids[node][1:]  # a GPU left out
                got = caps[a : a + len(names)]
                acked = AckedCaps(names, got, list(got), [None] * len(names), True)
                acks.append((node, step % 4 if t is None else t, acked))
                a = b
            for node, t, acked in acks:
                one.on_ack(node, t, acked)
            fleet.on_fleet_acks(acks)
        tick = step + 1
        assert _state(one, 100 + tick, now) == _state(fleet, 100 + tick, now)


def test_fleet_telemetry_from_nodes_the_planner_does_not_know_is_refused() -> None:
    policy, layout = simple_fleet([1, 1])
    planner = SafetyPlanner(policy, layout)
    assert not planner.on_fleet_telemetry(["n0", "nx"], [["g0-0"], ["g1-0"]], [200, 200], 0, [1, 1])
    # Another GPU order than the planner's: refused, nothing queued.
    assert not planner.on_fleet_telemetry(["n0", "n1"], [["g0-0"], ["gx"]], [200, 200], 0, [1, 1])
    assert planner.committed_w().tolist() == [400.0, 400.0]
    assert planner.on_fleet_telemetry(["n0", "n1"], [["g0-0"], ["g1-0"]], [200, 300], 0, [1, 1])
    planner.assume_settled()
    assert planner.committed_w().tolist() == [200.0, 300.0]
