"""The simulator's decisions are the shipped tick's: a scenario's caps, tick by tick, equal
those of a `TickEngine` driven directly (its own loop of telemetry, steps and acks written
here from the wire types, not the simulator's agents), with a scheduled window, an overload
rating and learning in play."""

from __future__ import annotations

import copy
from typing import Any

import numpy as np
import pytest
from test_sim import small_policy

from powerd.allocator import ClassTable
from powerd.backends.mock import MockGpuSpec, SimulatedGpus
from powerd.controller.overrides import ScheduledBudget
from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.policy import Overload, parse_policy, with_overload
from powerd.safety import SafePlan
from powerd.sim.run import engine_policy, rounds_per_steer, simulate, start_cap_w
from powerd.sim.scenario import Scenario, parse_scenario
from powerd.sim.site import Mix, Site, build_mix, build_site
from powerd.wire import CapAck, GpuAck, GpuTelemetry, NodeTelemetry

Caps = list[tuple[int, dict[str, float]]]  # per engine tick: (tick, caps sent by uuid)


def scenario(**changes: Any) -> Scenario:
    data: dict[str, Any] = {
        "name": "equal",
        "duration_h": 0.25,
        "tick_s": 15,
        "seed": 5,
        "ramp_w_per_s": {"up": 40, "down": 80},
        "schedule": [{"fraction": 0.8, "start_h": 0.05, "end_h": 0.12}],
        "workloads": [
            {
                "name": "serving",
                "class": "inference",
                "share": 0.5,
                "pattern": "inference",
                "low_w": 250,
                "high_w": 650,
                "day_h": 0.25,
                "peak_hour": 0.1,
                "bursts": {"extra_w": 100, "probability": 0.3, "slot_s": 30},
            },
            {"name": "train", "class": "training", "share": 0.5, "pattern": "training"},
        ],
    }
    data.update(changes)
    return parse_scenario(data, "<equal>")


def direct(sc: Scenario, site: Site, mix: Mix, solver: str, *, learn: bool = False) -> Caps:
    """The engine driven by hand over the same GPU model, on the simulator's timeline: a
    steer before time starts, then each tick a steer one control tick in."""
    policy = engine_policy(site.policy, sc, learn=learn, profiles={}, rates=sc.spec.ramp_w_per_s)
    engine = TickEngine(policy, solver=solver)
    model = SimulatedGpus(
        site.n_gpus,
        list(mix.workloads),
        spec=MockGpuSpec(
            min_cap_w=site.min_cap_w, max_cap_w=site.tdp_w, default_cap_w=start_cap_w(site)
        ),
        seed=sc.spec.seed,
        uuid_prefix="GPU-sim",
    )
    topo = site.topology
    for k, w in enumerate(sc.spec.schedule):
        budget_w = float(topo.budget_w[0]) * (w.fraction or 0.0)
        entry = ScheduledBudget(
            f"w{k}", topo.names[0], budget_w, w.start_h * 3600, w.end_h * 3600, "", "", 0.0
        )
        engine.overrides.add_schedule(policy, entry.on_monotonic(0.0, 0.0), 0.0)
    names = list(dict.fromkeys(site.gpu_nodes))
    members = {n: [i for i, g in enumerate(site.gpu_nodes) if g == n] for n in names}
    labels = ClassTable.from_policy(site.policy).names
    applied: dict[str, int | None] = dict.fromkeys(names)
    out: Caps = []

    def telemetry(now: float) -> None:
        tput = model.throughput()
        util, clock = model.util_pct(), model.sm_clock_mhz()
        for n in names:
            gpus = [
                GpuTelemetry(
                    uuid=model.uuids[i],
                    index=j,
                    name="sim",
                    power_w=float(model.power_w[i]),
                    energy_j=float(model.energy_j[i]),
                    cap_w=float(model.cap_w[i]),
                    min_cap_w=float(model.min_cap_w[i]),
                    max_cap_w=float(model.max_cap_w[i]),
                    default_cap_w=float(model.default_cap_w[i]),
                    temp_c=float(np.clip(model.temp_c[i], -50, 200)),
                    util_pct=float(util[i]),
                    sm_clock_mhz=float(clock[i]),
                    workload=labels[int(mix.class_index[i])],
                    job=mix.gpu_jobs[i] if mix.gpu_jobs else None,
                    perf=float(tput[i]),
                )
                for j, i in enumerate(members[n])
            ]
            msg = NodeTelemetry(
                node_id=n, ts=now, seq=1, period_s=sc.spec.tick_s, gpus=gpus, tick=applied[n]
            )
            engine.on_telemetry(msg, now)

    def steer(now: float) -> None:
        telemetry(now)
        for _ in range(rounds_per_steer(site.policy, sc.spec.tick_s)):
            _, plan = engine.step(now, now)
            out.append((plan.tick, {u: w for c in plan.commands for u, w in c.caps_w.items()}))
            for cmd in plan.commands:
                acks = {}
                for u, w in cmd.caps_w.items():
                    i = model.uuids.index(u)
                    enforced = model.set_cap(i, min(max(w, site.min_cap_w), site.tdp_w))
                    acks[u] = GpuAck(requested_w=w, enforced_w=enforced)
                applied[cmd.node] = cmd.tick
                engine.on_ack(cmd.node, CapAck(node_id=cmd.node, tick=cmd.tick, gpus=acks))
            if not plan.withheld.any():
                break

    telemetry(0.0)
    engine.observe(0.0)
    engine.planner.assume_settled()
    tick_s = sc.spec.tick_s
    react_s = min(site.policy.control.tick_s, tick_s / 2)
    events, nxt = mix.events, 0
    for k in range(sc.ticks):
        now = k * tick_s
        while nxt < len(events) and events[nxt][0] <= now:
            model.set_workload(events[nxt][1], events[nxt][2])
            nxt += 1
        if k == 0:
            steer(now)
        model.advance(react_s)
        steer(now + react_s)
        model.advance(tick_s - react_s)
    return out


def simulated(sc: Scenario, site: Site, mix: Mix, solver: str, *, learn: bool = False) -> Caps:
    out: Caps = []

    def keep(report: TickReport, plan: SafePlan) -> None:
        out.append((plan.tick, {u: w for c in plan.commands for u, w in c.caps_w.items()}))

    simulate(sc, site, mix, solver, learn=learn, trace=keep)
    return out


def rated_site() -> Site:
    policy = parse_policy(copy.deepcopy(small_policy()), "<small>")
    return build_site(with_overload(policy, Overload(pct=10.0, for_s=60)))


@pytest.mark.parametrize(
    ("solver", "site_of", "learn"),
    [
        ("fast", lambda: build_site(parse_policy(small_policy(), "<small>")), False),
        ("fast", rated_site, False),
        ("uniform", lambda: build_site(parse_policy(small_policy(), "<small>")), False),
        ("fast", lambda: build_site(parse_policy(small_policy(), "<small>")), True),
    ],
    ids=["fast", "fast-overload", "uniform", "fast-learning"],
)
def test_the_simulators_caps_are_the_engines_tick_by_tick(
    solver: str, site_of: Any, learn: bool
) -> None:
    sc = scenario()
    site = site_of()
    mix = build_mix(sc, site)
    by_sim = simulated(sc, site, mix, solver, learn=learn)
    by_hand = direct(sc, site, build_mix(sc, site), solver, learn=learn)
    assert len(by_sim) > sc.ticks  # a steer before time starts, and catch-up ticks
    assert [t for t, _ in by_sim] == [t for t, _ in by_hand]
    for (tick, a), (_, b) in zip(by_sim, by_hand, strict=True):
        assert a.keys() == b.keys(), tick
        assert np.allclose([a[u] for u in a], [b[u] for u in a], rtol=0, atol=1e-9), tick
    # The run steered: caps moved under the window and the workloads' swings.
    moved = {round(w) for _, caps in by_sim for w in caps.values()}
    assert len(moved) > 10
