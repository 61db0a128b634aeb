"""The mock GPU fleet: exact physics, workload patterns, faults, and the backend view."""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from powerd.backends import mock_kernel
from powerd.backends.base import GpuLost, InvalidArgument, NoPermission, UnknownGpu
from powerd.backends.mock import (
    IDLE_W,
    CapJournal,
    MockBackend,
    MockGpuSpec,
    Pattern,
    SimulatedGpus,
    Workload,
    _all_edges,
    _curves_of,
    _edge_series,
    _edges,
    _uniform,
)
from powerd.clock import ManualClock
from powerd.profile import Profile


def quiet(n: int, workload: Workload, **kw: float) -> SimulatedGpus:
    return SimulatedGpus(n, workload, spec=MockGpuSpec(noise_frac=0.0, **kw))


def test_draw_follows_the_cap_through_an_exact_first_order_lag() -> None:
    f = quiet(1, Workload.steady(600.0), tau_s=0.2)
    assert f.power_w[0] == 600.0
    f.set_cap(0, 300.0)
    f.advance(0.1)
    assert f.power_w[0] == pytest.approx(300.0 + 300.0 * math.exp(-0.5))
    # Energy is the lag's integral, not power × dt.
    assert f.energy_j[0] == pytest.approx(300.0 * 0.1 + 300.0 * 0.2 * (1 - math.exp(-0.5)))


def test_one_long_step_equals_many_short_ones() -> None:
    coarse = quiet(3, Workload.steady(550.0))
    fine = quiet(3, Workload.steady(550.0))
    for f in (coarse, fine):
        f.set_cap(1, 250.0)
    coarse.advance(2.0)
    for _ in range(200):
        fine.advance(0.01)
    np.testing.assert_allclose(coarse.power_w, fine.power_w)
    np.testing.assert_allclose(coarse.energy_j, fine.energy_j)
    np.testing.assert_allclose(coarse.temp_c, fine.temp_c)


def test_draw_is_min_of_cap_and_demand_and_heats_the_gpu() -> None:
    f = SimulatedGpus(2, Workload.steady(450.0))
    f.set_cap(0, 300.0)
    f.advance(5.0)
    assert f.power_w[0] == pytest.approx(300.0, rel=0.02)
    assert f.power_w[0] <= 300.0 + 1e-6  # noise never shows a settled GPU above its cap
    assert f.power_w[1] == pytest.approx(450.0, rel=0.02)
    assert list(f.power_capped()) == [True, False]
    # Temperature follows the draw, far more slowly than the draw follows the cap.
    hot, cool = (f.ambient_c + f.temp_per_w * w for w in (450.0, 300.0))
    assert cool + 1.0 < f.temp_c[0] < hot
    f.advance(300.0)
    assert f.temp_c[0] == pytest.approx(cool, abs=0.5)
    assert f.temp_c[1] == pytest.approx(hot, abs=0.5)


def test_throughput_follows_the_profile_of_the_draw() -> None:
    w = Workload.steady(700.0)
    f = quiet(2, w)
    f.set_cap(0, 400.0)
    f.advance(5.0)
    np.testing.assert_allclose(f.throughput(), w.profile.value(f.power_w), rtol=1e-6)
    assert f.throughput(0)[0] < f.throughput(1)[0]
    assert f.util_pct(0)[0] == 100.0  # a capped GPU is slowed down, not idle
    assert f.sm_clock_mhz(0)[0] < f.sm_clock_mhz(1)[0]


def test_training_jobs_swing_together_and_apart() -> None:
    job_a = Workload.training(high_w=650.0, low_w=250.0, period_s=10.0, duty=0.6)
    job_b = Workload.training(high_w=650.0, low_w=250.0, period_s=10.0, duty=0.6, phase_s=5.0)
    f = quiet(4, [job_a, job_a, job_b, job_b])
    assert list(f.demand_at(1.0)) == [650.0, 650.0, 250.0, 250.0]
    assert list(f.demand_at(7.0)) == [250.0, 250.0, 650.0, 650.0]
    assert f.workload(0).name == "training"


def test_inference_demand_is_deterministic_per_seed() -> None:
    w = Workload.inference(high_w=500.0, low_w=200.0, burst_w=150.0, burst_prob=0.3)
    times = np.arange(0.0, 600.0, 2.0)
    a = np.array([SimulatedGpus(64, w, seed=7).demand_at(t) for t in times])
    b = np.array([SimulatedGpus(64, w, seed=7).demand_at(t) for t in times])
    c = np.array([SimulatedGpus(64, w, seed=8).demand_at(t) for t in times])
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)
    bursting = a > 200.0 + 1.0  # daily curve is near its low at t ≈ 0
    assert 0.2 < bursting.mean() < 0.4
    # The daily curve peaks half a day in.
    noon = SimulatedGpus(1, Workload.inference(burst_prob=0.0)).demand_at(43_200.0)[0]
    assert noon == pytest.approx(550.0)


def test_idle_gpus_draw_little_and_do_no_work() -> None:
    f = quiet(1, Workload.idle())
    f.advance(1.0)
    assert f.power_w[0] == pytest.approx(IDLE_W)
    assert f.throughput()[0] == 0.0
    assert f.util_pct()[0] == 0.0


def test_workloads_can_change_at_run_time() -> None:
    f = quiet(2, Workload.idle())
    f.set_workload([1], Workload.steady(500.0, name="batch"))
    f.advance(2.0)
    assert f.power_w[1] == pytest.approx(500.0, rel=1e-3)
    assert f.workload(1).name == "batch"
    assert f.workload(0).name == "idle"


def test_backend_is_a_lazy_view_on_a_slice_of_the_fleet() -> None:
    clock = ManualClock(start=100.0)
    fleet = SimulatedGpus(16, Workload.steady(600.0), start_s=100.0, uuid_prefix="GPU-x")
    node = MockBackend(fleet, clock, start=8, count=8)
    gpus = node.gpus()
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[0].uuid == fleet.uuids[8]
    assert (gpus[0].min_cap_w, gpus[0].max_cap_w, gpus[0].default_cap_w) == (200.0, 700.0, 700.0)

    assert node.set_power_limit_w(gpus[0].uuid, 350.0) == 350.0
    clock.advance(3.0)
    r = node.read(gpus[0].uuid)
    assert fleet.t == 103.0
    assert r.cap_w == 350.0
    assert r.power_w == pytest.approx(350.0, rel=0.02)
    assert r.energy_j > 3 * 340.0
    assert r.throttle == ["sw_power_cap"]
    assert r.workload == "batch"
    assert r.perf is not None
    assert 0 < r.perf < 1
    with pytest.raises(UnknownGpu):
        node.read(fleet.uuids[0])  # another node's GPU
    with pytest.raises(InvalidArgument):
        node.set_power_limit_w(gpus[0].uuid, 150.0)
    assert [uuid for uuid, _ in node.set_log] == [gpus[0].uuid]


def test_journal_records_every_change_and_outlives_the_process(tmp_path: Path) -> None:
    journal = tmp_path / "caps.journal"
    clock = ManualClock(start=50.0)
    node = MockBackend(SimulatedGpus(2, Workload.steady(600.0)), clock, journal=journal)
    a, b = (g.uuid for g in node.gpus())
    clock.advance(1.0)
    node.set_power_limit_w(a, 300.0)
    node.set_power_limit_w(a, 300.0)  # no change in force: not journalled
    clock.advance(0.5)
    node.set_power_limit_w(b, 450.0)
    with pytest.raises(InvalidArgument):
        node.set_power_limit_w(b, 900.0)  # refused: the cap in force stays
    node.close()
    assert CapJournal.read(journal) == [
        (50.0, "start", a, 700.0),
        (50.0, "start", b, 700.0),
        (51.0, "set", a, 300.0),
        (51.5, "set", b, 450.0),
    ]

    # A new agent process on the same GPUs: the limits are where the last one left them
    # (a driver keeps them), and the journal goes on.
    clock.advance(2.0)
    again = MockBackend(SimulatedGpus(2, Workload.steady(600.0)), clock, journal=journal)
    assert [again.read(u).cap_w for u in (a, b)] == [300.0, 450.0]
    assert CapJournal.read(journal)[-2:] == [(53.5, "start", a, 300.0), (53.5, "start", b, 450.0)]
    with journal.open("a") as f:
        f.write("54.0 set")  # a line cut short is skipped
    assert len(CapJournal.read(journal)) == 6
    again.close()


def test_an_out_of_band_limit_is_journalled_and_not_kept_as_the_set(tmp_path: Path) -> None:
    # A BMC holds GPU a at 250 W under the 400 W set, then lets go: both changes of the cap
    # in force are journalled (the watcher's ground truth), reads show the limit enforced
    # and the one requested, and a new process starts at the 400 W set, not the BMC's.
    journal = tmp_path / "caps.journal"
    clock = ManualClock(start=10.0)
    node = MockBackend(SimulatedGpus(2, Workload.steady(600.0)), clock, journal=journal)
    a, _ = (g.uuid for g in node.gpus())
    node.set_power_limit_w(a, 400.0)
    clock.advance(1.0)
    node.hold_out_of_band(a, 250.0)
    assert (node.read(a).cap_w, node.read(a).requested_w) == (250.0, 400.0)
    node.hold_out_of_band(a, 260.0)  # moved: journalled
    node.hold_out_of_band(a, 500.0)  # above the set: the set is enforced
    clock.advance(1.0)
    node.hold_out_of_band(a, None)  # gone: no change in force, nothing journalled
    node.close()
    assert CapJournal.read(journal)[2:] == [
        (10.0, "set", a, 400.0),
        (11.0, "out_of_band", a, 250.0),
        (11.0, "out_of_band", a, 260.0),
        (11.0, "out_of_band", a, 400.0),
    ]
    again = MockBackend(SimulatedGpus(2, Workload.steady(600.0)), clock, journal=journal)
    assert again.read(a).cap_w == 400.0
    again.close()


def test_agent_settings_name_the_journal(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from powerd.agent.agent import build_backend
    from powerd.agent.settings import AgentSettings

    monkeypatch.setenv("POWERD_MOCK_JOURNAL", str(tmp_path / "j"))
    settings = AgentSettings.load(node_id="n1", backend="mock", mock_gpus=3)
    backend = build_backend(settings, ManualClock())
    assert isinstance(backend, MockBackend)
    backend.close()
    assert [e for _, e, _, _ in CapJournal.read(tmp_path / "j")] == ["start"] * 3


def test_injected_faults() -> None:
    clock = ManualClock()
    fleet = SimulatedGpus(3, Workload.steady(600.0))
    node = MockBackend(fleet, clock)
    a, b, c = (g.uuid for g in node.gpus())

    fleet.fail_set(0, NoPermission)
    with pytest.raises(NoPermission):
        node.set_power_limit_w(a, 300.0)
    assert node.read(a).cap_w == 700.0  # reading still works
    fleet.fail_set(0, None)
    assert node.set_power_limit_w(a, 300.0) == 300.0

    fleet.lose(1)
    for call in (lambda: node.read(b), lambda: node.set_power_limit_w(b, 300.0)):
        with pytest.raises(GpuLost):
            call()
    assert [g.uuid for g in node.gpus()] == [a, c]

    fleet.override(2, 450.0)
    assert node.set_power_limit_w(c, 600.0) == 450.0  # enforced: the out-of-band limit
    assert fleet.requested_cap_w[2] == 600.0
    fleet.override(2, None)
    assert node.read(c).cap_w == 600.0


def test_rejects_a_fleet_that_cannot_exist() -> None:
    with pytest.raises(ValueError, match="workloads for"):
        SimulatedGpus(3, [Workload.idle()])
    with pytest.raises(ValueError, match="default_cap_w"):
        MockGpuSpec(default_cap_w=800.0)
    with pytest.raises(ValueError, match="not all in a fleet"):
        MockBackend(SimulatedGpus(4), ManualClock(), start=2, count=4)


def _sync_job() -> Workload:
    """A synchronous training job: 3 s iterations (75 % compute), a 20 s checkpoint every
    90 s, running from 30 s to 200 s."""
    return Workload(
        Pattern.TRAINING,
        "training",
        Workload.training().profile,
        high_w=680.0,
        low_w=300.0,
        period_s=3.0,
        duty=0.75,
        ckpt_every_s=90.0,
        ckpt_s=20.0,
        ckpt_w=110.0,
        ckpt_phase_s=20.0,
        runs=((30.0, 200.0),),
    )


def test_swings_within_a_step_are_integrated_exactly() -> None:
    # A job swinging every 3 s, checkpointing, starting and ending within 60 s steps, and a
    # service whose bursts and surges change every few seconds: one step per minute gives
    # the energy and the work of steps of 0.25 s (which every change falls on, so that
    # each of them holds one level).
    surging = Workload(
        Pattern.INFERENCE,
        "inference",
        Workload.inference().profile,
        high_w=550.0,
        low_w=200.0,
        period_s=86_400.0,
        burst_w=200.0,
        burst_prob=0.3,
        burst_slot_s=1.5,
        surge_w=120.0,
        surge_prob=0.4,
        surge_slot_s=7.0,
        key=5,
    )
    workloads = [_sync_job(), _sync_job(), surging, surging]
    coarse = SimulatedGpus(4, workloads, spec=MockGpuSpec(noise_frac=0.0))
    fine = SimulatedGpus(4, workloads, spec=MockGpuSpec(noise_frac=0.0))
    work_coarse, work_fine = np.zeros(4), np.zeros(4)
    for f in (coarse, fine):
        f.set_cap(1, 450.0)  # a capped rank draws min(cap, level) in every phase
        f.set_cap(3, 400.0)
    for _ in range(4):
        coarse.advance(60.0)
        work_coarse += coarse.step_throughput * 60.0
    for _ in range(960):
        fine.advance(0.25)
        work_fine += fine.step_throughput * 0.25
    np.testing.assert_allclose(coarse.energy_j, fine.energy_j, rtol=1e-6)
    np.testing.assert_allclose(work_coarse, work_fine, rtol=1e-6)
    np.testing.assert_allclose(coarse.power_w, fine.power_w, rtol=1e-6)
    # The job ran 170 s, 40 s of them in two checkpoints (no work); 130 s of iterations.
    job = _sync_job()
    at = job.profile.value
    assert work_coarse[0] == pytest.approx(130 * (0.75 * at(680.0) + 0.25 * at(300.0)), rel=0.02)
    assert coarse.power_w[0] == pytest.approx(IDLE_W)  # ended: back to idle


def test_held_sampling_would_miss_what_integration_counts() -> None:
    # One step of 60 s over a 3 s swing: the mean draw is the duty-weighted level, whatever
    # phase the step starts at (sampling the demand once per step would give 680 or 300),
    # up to the lag's share: tau × the swing / the step, 1.3 W.
    job = Workload.training(high_w=680.0, low_w=300.0, period_s=3.0, duty=0.75)
    for start in (0.0, 1.0, 2.5):
        f = SimulatedGpus(1, job, spec=MockGpuSpec(noise_frac=0.0), start_s=start)
        f.advance(60.0)
        assert f.energy_j[0] / 60.0 == pytest.approx(0.75 * 680 + 0.25 * 300, abs=1.3)


_times = st.floats(-50.0, 5000.0, allow_nan=False)


@st.composite
def _workload(draw: st.DrawFn) -> Workload:
    """A training job or an inference service with every kind of edge, at any phase."""
    phase = draw(st.floats(0.0, 100.0))
    if draw(st.booleans()):
        start = draw(_times)
        return replace(
            Workload.of(Pattern.TRAINING),
            period_s=draw(st.floats(0.3, 30.0)),
            duty=draw(st.sampled_from([0.0, 0.3, 0.7, 1.0])),
            phase_s=phase,
            ckpt_every_s=draw(st.sampled_from([0.0, 7.0, 600.0])),
            ckpt_s=draw(st.floats(0.5, 5.0)),
            ckpt_phase_s=draw(st.floats(0.0, 50.0)),
            runs=((start, start + draw(st.floats(0.0, 100.0))),),
        )
    return replace(
        Workload.of(Pattern.INFERENCE),
        phase_s=phase,
        burst_w=draw(st.sampled_from([0.0, 80.0])),
        burst_prob=draw(st.sampled_from([0.0, 0.2])),
        burst_slot_s=draw(st.floats(0.2, 10.0)),
        surge_w=draw(st.sampled_from([0.0, 120.0])),
        surge_prob=draw(st.sampled_from([0.0, 0.1])),
        surge_slot_s=draw(st.floats(1.0, 120.0)),
    )


@settings(max_examples=300, deadline=None)
@given(st.lists(_workload(), max_size=6), _times, st.floats(0.0, 30.0))
def test_every_workloads_edges_at_once_are_each_ones_edges(
    workloads: list[Workload], t0: float, dt: float
) -> None:
    """The model's step cuts at `_all_edges`: for all workloads at once, exactly the times
    (to the bit) that walking each workload's `_edges` finds."""
    t1 = t0 + dt
    walked = sorted({x for w in workloads for x in _edges(w, t0, t1)})
    assert _all_edges(*_edge_series(workloads), t0, t1).tolist() == walked


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_workload(), min_size=1, max_size=5),
    _times,
    st.lists(st.floats(0.01, 12.0), min_size=1, max_size=40),
)
def test_steps_that_skip_looking_for_edges_miss_none(
    workloads: list[Workload], t0: float, steps: list[float]
) -> None:
    """Step after step, the model finds each step's edges (`_edges_within`, which skips
    looking until the next edge it knows of) exactly as looking every time does."""
    model = SimulatedGpus(len(workloads), workloads)
    series = _edge_series([w for w in workloads if w.pattern is not Pattern.STEADY])
    t = t0
    for dt in steps:
        assert model._edges_within(t, t + dt).tolist() == _all_edges(*series, t, t + dt).tolist()
        t += dt


def test_a_step_without_edges_counts_the_jobs_work_as_the_whole_fleets() -> None:
    """A step that no job's or service's edge cuts counts their GPUs' work from their
    profiles at their level alone: the same numbers, bit for bit, as the whole fleet's
    throughput at those levels (idle, steady and checkpointing GPUs among them)."""
    workloads = [_sync_job(), Workload.inference(), Workload.idle(), Workload.training()]
    gpus = SimulatedGpus(8, workloads * 2, spec=MockGpuSpec(noise_frac=0.0))
    gpus.set_cap(1, 350.0)
    gpus.set_cap(6, 250.0)
    g = gpus._group_gpus
    assert g.size
    for _ in range(40):
        target = np.minimum(gpus.cap_w, gpus.demand_w) * np.linspace(0.1, 1.0, 8)
        whole = gpus._throughput_at(target, slice(None))[g]
        assert gpus._group_throughput(target[g]).tobytes() == whole.tobytes()
        gpus.advance(5.0)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(_workload(), min_size=1, max_size=5),
    st.floats(-20_000.0, 20_000.0, allow_nan=False),
    st.floats(-20_000.0, 0.0),
)
def test_demand_at_one_time_is_numpys_to_the_bit(
    workloads: list[Workload], t: float, phase: float
) -> None:
    """Demand at one time (every step's, compiled: mock_kernel.demand_now) is what numpy's
    formulas give at that time, the same grid's row at many times, bit for bit: before
    the origin too (burst slots below 0, as a day's phase puts them), with checkpoints,
    runs and surges or without."""
    fleet = [replace(w, phase_s=w.phase_s + phase) for w in workloads]
    fleet += [Workload.steady(500.0), Workload.idle()]
    # As drawn, and without checkpoints, runs and surges (`demand_and_working_at`'s own
    # pass at one time).
    plain = [replace(w, ckpt_every_s=0.0, runs=(), surge_prob=0.0) for w in fleet]
    for gpus in (fleet, plain):
        model = SimulatedGpus(len(gpus), gpus, seed=3, compiled=True)
        one, works = model._grid(np.array([t]))
        many, works_many = model._grid(np.array([t, t + 1.0]))
        now, works_now = model.demand_and_working_at(t)
        assert one[0].tobytes() == many[0].tobytes() == now.tobytes()
        assert works[0].tolist() == works_many[0].tolist() == works_now.tolist()
    assert model._patterned_only


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.floats(200.0, 700.0), min_size=4, max_size=4),
    st.floats(0.001, 30.0),
    st.floats(0.0, 0.05),
)
def test_a_held_step_is_numpys_formulas_to_the_bit(
    caps: list[float], dt: float, noise: float
) -> None:
    """A step no edge cuts (compiled: mock_kernel.step_held and reported_power) moves the
    draw, energy, temperature and reported draw as numpy's closed forms do, bit for bit."""
    spec = MockGpuSpec(noise_frac=noise)
    model = SimulatedGpus(
        4, [Workload.steady(650.0), Workload.steady(300.0)] * 2, spec=spec, compiled=True
    )
    model.advance(3.0)
    for i, w in enumerate(caps):
        model.set_cap(i, w)
    x0, temp0, energy0 = model._lagged_w.copy(), model.temp_c.copy(), model.energy_j.copy()
    target = np.minimum(model.cap_w, model.demand_w)
    decay = np.exp(-dt / spec.tau_s)
    gap = x0 - target
    energy = energy0 + (target * dt + gap * spec.tau_s * (1.0 - decay))
    lagged = target + gap * decay
    settled = spec.ambient_c + spec.temp_per_w * target
    passed = spec.temp_per_w * gap * spec.tau_s / (spec.tau_s - spec.temp_tau_s)
    own = (temp0 - settled - passed) * np.exp(-dt / spec.temp_tau_s)
    temp = settled + passed * decay + own
    t_bits = np.float64(model.t + dt).view(np.uint64)
    spread = noise * np.sqrt(12.0) * (_uniform(model._seeds ^ t_bits) - 0.5)
    reported = np.maximum(np.minimum(lagged * (1.0 + spread), np.maximum(model.cap_w, lagged)), 0)
    model.advance(dt)
    assert model._lagged_w.tobytes() == lagged.tobytes()
    assert model.energy_j.tobytes() == energy.tobytes()
    assert model.temp_c.tobytes() == temp.tobytes()
    assert model.power_w.tobytes() == reported.tobytes()


def test_the_fleets_util_and_clock_at_once_are_each_methods_to_the_bit() -> None:
    """`util_and_clock` (compiled: mock_kernel.gauges) gives what `util_pct` and
    `sm_clock_mhz` give, bit for bit: capped, idle, busy and checkpointing GPUs."""
    workloads = [_sync_job(), Workload.inference(), Workload.idle(), Workload.training()]
    gpus = SimulatedGpus(8, workloads * 2, compiled=True)
    for i, w in enumerate([220.0, 700.0, 350.0, 480.0, 200.0, 600.0, 300.0, 650.0]):
        gpus.set_cap(i, w)
    for _ in range(30):
        util, clock = gpus.util_and_clock()
        assert util.tobytes() == gpus.util_pct().tobytes()
        assert clock.tobytes() == gpus.sm_clock_mhz(util_pct=gpus.util_pct()).tobytes()
        gpus.advance(7.3)


@st.composite
def _curve_and_draws(draw: st.DrawFn) -> tuple[Profile, list[float]]:
    points = draw(
        st.lists(st.tuples(st.floats(10.0, 1000.0), st.floats(0.0, 2.0)), min_size=1, max_size=8)
    )
    profile = Profile.from_points("p", points)
    knots = profile.power_w.tolist()
    near = [x + d for x in knots for d in (-1e-9, 0.0, 1e-9)]
    draws = draw(st.lists(st.floats(-100.0, 1200.0) | st.sampled_from(near), max_size=20))
    return profile, draws


@settings(max_examples=300, deadline=None)
@given(st.lists(_curve_and_draws(), min_size=1, max_size=3))
def test_compiled_throughput_is_each_profiles_value_to_the_bit(
    curves: list[tuple[Profile, list[float]]],
) -> None:
    """mock_kernel.throughput (every step's throughput) gives what `Profile.value` (numpy's
    interp, the first slope continued below the curve) gives, bit for bit: on the knots, a
    hair off them, below the first and past the last, NaN."""
    profiles = [p for p, _ in curves]
    rows = _curves_of(profiles)
    assert rows is not None
    power = np.array([x for _, xs in curves for x in [*xs, math.nan]])
    which = np.array([k for k, (_, xs) in enumerate(curves) for _ in range(len(xs) + 1)])
    out = np.empty(power.size)
    gpus = np.arange(power.size, dtype=np.int64)
    idle, working = np.zeros(power.size, dtype=bool), np.ones(power.size, dtype=bool)
    mock_kernel.throughput(power, gpus, which.astype(np.int64), idle, working, *rows, out)
    expected = np.empty(power.size)
    for k, p in enumerate(profiles):
        expected[which == k] = p.value(power[which == k])
    assert out.tobytes() == expected.tobytes()


@settings(max_examples=60, deadline=None)
@given(
    st.lists(_workload(), min_size=1, max_size=4),
    st.lists(st.tuples(st.floats(0.05, 12.0), st.floats(150.0, 750.0)), min_size=1, max_size=12),
    st.floats(0.0, 0.05),
)
def test_the_compiled_model_steps_as_numpys_to_the_bit(
    workloads: list[Workload], steps: list[tuple[float, float]], noise: float
) -> None:
    """The simulator's model (`compiled=True`: mock_kernel's loops) and the agents' and the
    demo's (numpy alone, no numba on an event loop) move every GPU alike, bit for bit: draw,
    reported draw, energy, temperature, demand, throughput and the gauges, step by step,
    with caps moving between steps and steps cut by edges or not."""
    fleet = [*workloads, Workload.steady(500.0), Workload.idle(), Workload.training()]
    spec = MockGpuSpec(noise_frac=noise)
    models = [
        SimulatedGpus(len(fleet), fleet, spec=spec, seed=5, compiled=compiled)
        for compiled in (True, False)
    ]
    for dt, cap in steps:
        for m in models:
            m.set_cap(0, cap)
            m.set_cap(len(fleet) - 1, 900.0 - cap)
            m.advance(dt)
        a, b = models
        for name in ("_lagged_w", "power_w", "energy_j", "temp_c", "demand_w", "step_throughput"):
            assert getattr(a, name).tobytes() == getattr(b, name).tobytes(), name
        assert a.throughput().tobytes() == b.throughput().tobytes()
        for x, y in zip(a.util_and_clock(), b.util_and_clock(), strict=True):
            assert x.tobytes() == y.tobytes()
