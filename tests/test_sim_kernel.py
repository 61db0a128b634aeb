"""A simulated run's loops, compiled (powerd/sim/kernel.py): the accounting's numbers bit
for bit as the numpy expressions `_Run.advance` took them from; the telemetry check's
verdict as numpy's tests give it."""

from __future__ import annotations

import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from powerd.policy import parse_policy
from powerd.sim import kernel
from powerd.testing.synthetic import policy_dict
from powerd.topology import Topology

_watts = st.floats(0.0, 5000.0)
_budgets = st.floats(1.0, 5000.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(_watts, _watts, _budgets, _budgets, st.booleans(), st.floats(0.0, 3.0)),
             min_size=1, max_size=12),
    st.floats(0.01, 10.0),
)  # fmt: skip
def test_groups_over_their_budgets_as_numpy_finds_them(
    groups: list[tuple[float, float, float, float, bool, float]], dt: float
) -> None:
    mean_sum, closing_sum, mean_budget, budget, finite, run0 = (
        np.array(c) for c in zip(*groups, strict=True)
    )
    overhead = np.linspace(0.0, 333.3, len(groups))
    mean_draw, closing = mean_sum + overhead, closing_sum + overhead
    budget = np.where(finite, budget, np.inf)
    mean_budget = np.where(finite, mean_budget, np.inf)
    ratio_budget = np.where(finite & (budget > 0), budget, np.inf)
    level = np.arange(len(groups), dtype=np.int64) % 4
    # numpy's
    draw = np.maximum(mean_draw, closing)
    excess = np.where(finite, np.maximum(mean_draw - mean_budget, closing - budget), -np.inf)
    over = excess > 1e-3
    run = np.where(over, run0 + dt, 0.0)
    ratio = draw / ratio_budget
    peaks = np.full(4, -np.inf)
    for lv in range(4):
        if (level == lv).any():
            peaks[lv] = ratio[level == lv].max()
    # compiled
    run_s, over_levels, step_peak = run0.copy(), np.ones(4, dtype=np.bool_), np.full(4, -np.inf)
    longest, excess_max, ratio_max = kernel.check_groups(
        mean_sum, closing_sum, overhead, mean_budget, budget, finite, ratio_budget, level, 1e-3,
        dt, run_s, over_levels, step_peak,
    )  # fmt: skip
    assert run_s.tobytes() == run.tobytes()
    assert ratio_max == ratio.max()
    assert step_peak.tobytes() == peaks.tobytes()
    assert over_levels.tolist() == [bool(over[level == lv].any()) for lv in range(4)]
    if over.any():
        assert longest == run.max()
        assert excess_max == excess[over].max()
    else:
        assert longest == excess_max == -np.inf


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 2), st.floats(0.0, 1.0), st.booleans(), _watts, _watts,
                       _watts), min_size=1, max_size=40),
    st.floats(0.01, 10.0),
)  # fmt: skip
def test_work_and_time_below_floors_add_up_as_numpys_bincounts(
    gpus: list[tuple[int, float, bool, float, float, float]], dt: float
) -> None:
    cls_l, tput_l, floored_l, caps_l, floor_l, demand_l = zip(*gpus, strict=True)
    cls = np.array(cls_l, dtype=np.int64)
    tput, floored = np.array(tput_l), np.array(floored_l)
    caps, floor_w, demand = np.array(caps_l), np.array(floor_l), np.array(demand_l)
    work0 = np.array([0.1, 2.5, 1e4])
    below0 = np.array([3.0, 0.0, 7.5])
    # numpy's
    work = work0 + np.bincount(cls, weights=tput, minlength=3) * dt
    held = floored & (caps < floor_w - 0.5) & (demand > caps + 0.5)
    below = below0.copy()
    if held.any():
        below += np.bincount(cls[held], minlength=3) * dt
    # compiled
    work_k, below_k = work0.copy(), below0.copy()
    kernel.add_work(cls, tput, dt, work_k)
    kernel.add_below_floor(floored, caps, floor_w, demand, 0.5, cls, dt, below_k)
    assert work_k.tobytes() == work.tobytes()
    assert below_k.tobytes() == below.tobytes()


_reading = st.one_of(
    st.floats(-100.0, 12_000.0), st.sampled_from([math.nan, math.inf, -math.inf, 0.0])
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(_reading, _reading, _reading), min_size=1, max_size=6))
def test_the_telemetry_check_passes_what_numpys_tests_pass(
    gpus: list[tuple[float, float, float]],
) -> None:
    lo = np.array([0.0, 0.0, -50.0])
    hi = np.array([10_000.0, 10_000.0, 200.0])
    positive = np.array([False, True, False])
    cols = tuple(np.array(c) for c in zip(*gpus, strict=True))
    ok = all(
        (np.isfinite(c) & (c >= lo[k]) & (c <= hi[k]) & ((c > 0) | ~positive[k])).all()
        for k, c in enumerate(cols)
    )
    assert kernel.within(cols, lo, hi, positive, -1, -1) == ok
    assert kernel.within(cols, lo, hi, positive, 0, 1) == (ok and bool((cols[0] <= cols[1]).all()))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 800.0), min_size=8, max_size=8),
    st.lists(st.floats(0.0, 5000.0), min_size=7, max_size=7),
    st.sampled_from([0.0, 1e-6]),
)
def test_committed_caps_over_a_limit_as_the_topologys_sums_find_them(
    caps: list[float], limits: list[float], tol_w: float
) -> None:
    """`any_over` adds each group's caps as `Topology.group_sums` (a bincount) does."""
    policy = parse_policy(policy_dict(1, 2, 2, 2, overhead_w=150.0))
    nodes = [g.name for g in policy.groups if g.level == 3 for _ in range(g.gpus)]
    topo = Topology.build(policy, nodes)
    per_gpu = np.array(caps[: topo.n_gpus])
    limit = np.array(limits + [9e9] * (topo.n_groups - len(limits)))[: topo.n_groups]
    expected = bool(((topo.group_sums(per_gpu) + topo.overhead_w) > limit + tol_w).any())
    assert kernel.any_over(topo.gpu_groups, per_gpu, topo.overhead_w, limit, tol_w) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.one_of(st.just(math.nan), st.floats(-10.0, 11_000.0)), min_size=1, max_size=10),
    st.booleans(),
)
def test_a_plans_caps_set_as_numpys_clip_and_minimum_set_them(
    sent: list[float], miscount: bool
) -> None:
    sent_w = np.array(sent)
    n = sent_w.size
    position = np.arange(n, dtype=np.int64)[::-1].copy()
    lo, hi = np.full(n, 200.0), np.linspace(300.0, 700.0, n)
    override = np.where(np.arange(n) % 3 == 0, 450.0, np.inf)
    requested, cap, out = np.full(n, 1.0), np.full(n, 2.0), np.full(n, np.nan)
    gpu = np.flatnonzero(~np.isnan(sent_w))
    req = sent_w[gpu]
    expected_count = gpu.size + (1 if miscount else 0)
    ok = gpu.size == expected_count and bool(((req >= 0.0) & (req <= 10_000.0)).all())
    done = kernel.apply_caps(
        sent_w, expected_count, position, 10_000.0, lo, hi, override, requested, cap, out
    )
    assert done == ok
    if not ok:
        assert (requested == 1.0).all() and (cap == 2.0).all() and np.isnan(out).all()
        return
    idx = position[gpu]
    target = req.clip(lo[idx], hi[idx])
    want_req, want_cap, want_out = np.full(n, 1.0), np.full(n, 2.0), np.full(n, np.nan)
    want_req[idx] = target
    want_cap[idx] = np.minimum(target, override[idx])
    want_out[gpu] = want_cap[idx]
    assert requested.tobytes() == want_req.tobytes()
    assert cap.tobytes() == want_cap.tobytes()
    assert out.tobytes() == want_out.tobytes()
