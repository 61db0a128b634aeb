"""Metrics: what a Prometheus scrape of the controller's and the agent's registry shows."""

from __future__ import annotations

import math
from typing import Any

import httpx
import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from powerd.backends.base import THROTTLE_REASON_BITS, throttle_mask, throttle_reasons
from powerd.metrics import ControllerMetrics, GpuSnapshot, exposition
from powerd.node_metrics import AgentMetrics, start_metrics_server
from powerd.wire import GpuTelemetry

Parsed = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(registry: CollectorRegistry) -> Parsed:
    """What the controller's /metrics serves, parsed: sample name → {sorted labels → value}."""
    return parse(exposition(registry).decode())


def parse(text: str) -> Parsed:
    out: Parsed = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


def gpu_key(index: int, uuid: str, node: str, model: str = "") -> tuple[tuple[str, str], ...]:
    labels = {
        "gpu": str(index),
        "UUID": uuid,
        "device": f"nvidia{index}",
        "modelName": model,
        "Hostname": node,
    }
    return tuple(sorted(labels.items()))


def snapshot(**values: Any) -> GpuSnapshot:
    """A GpuSnapshot from plain lists (the snapshot copies them into arrays)."""
    return GpuSnapshot(**values)


UUIDS = ["GPU-a0", "GPU-a1", "GPU-b0"]
NODES = ["a", "a", "b"]


def update(m: ControllerMetrics, power: list[float], uuids: list[str] = UUIDS) -> None:
    m.update_gpus(
        snapshot(
            uuids=uuids,
            nodes=NODES,
            index=[0, 1, 0],
            power_w=power,
            cap_w=[500.0, 400.0, 700.0],
            energy_j=[1.5, 2.0, 3.0],
            temp_c=[60.0, 61.0, math.nan],
            committed_w=[550.0, 400.0, 700.0],
            target_w=[520.0, 380.0, 700.0],
            throttle=[["sw_power_cap"], [], ["sw_thermal", "hw_slowdown"]],
            models=["H100", "H100", "H200"],
        )
    )


def test_controller_gpu_series_in_dcgm_style() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    update(m, [450.0, 390.5, 10.0])
    got = scrape(reg)
    a0 = gpu_key(0, "GPU-a0", "a", "H100")
    b0 = gpu_key(0, "GPU-b0", "b", "H200")
    assert got["DCGM_FI_DEV_POWER_USAGE"][a0] == 450.0
    assert got["DCGM_FI_DEV_POWER_USAGE"][gpu_key(1, "GPU-a1", "a", "H100")] == 390.5
    assert got["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"][a0] == 500.0  # cap_w: reported in force
    assert got["DCGM_FI_DEV_ENFORCED_POWER_LIMIT"][b0] == 700.0
    assert got["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION_total"][a0] == 1500.0  # mJ, as DCGM
    assert got["DCGM_FI_DEV_GPU_TEMP"][a0] == 60.0
    assert b0 not in got["DCGM_FI_DEV_GPU_TEMP"]  # NaN: no reading, no sample
    assert got["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"][a0] == 0x4
    assert got["DCGM_FI_DEV_CLOCKS_EVENT_REASONS"][b0] == 0x20 | 0x8
    assert got["powerd_gpu_cap_watts"][a0] == 550.0  # committed_w
    assert got["powerd_gpu_target_watts"][a0] == 520.0


def test_next_tick_replaces_values_and_drops_departed_gpus() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    update(m, [450.0, 390.5, 10.0])
    update(m, [300.0, 300.0, 300.0], uuids=["GPU-a0", "GPU-a1", "GPU-c0"])
    got = scrape(reg)["DCGM_FI_DEV_POWER_USAGE"]
    assert got[gpu_key(0, "GPU-a0", "a", "H100")] == 300.0
    assert gpu_key(0, "GPU-b0", "b", "H200") not in got
    assert got[gpu_key(0, "GPU-c0", "b", "H200")] == 300.0


def test_update_copies_arrays_the_caller_reuses() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    power = np.array([1.0, 2.0, 3.0])
    update(m, power)  # type: ignore[arg-type]
    power[:] = 99.0
    assert scrape(reg)["DCGM_FI_DEV_POWER_USAGE"][gpu_key(0, "GPU-a0", "a", "H100")] == 1.0


def test_mismatched_lengths_are_refused() -> None:
    m = ControllerMetrics(CollectorRegistry())
    with pytest.raises(ValueError, match="power_w"):
        update(m, [1.0, 2.0])


def test_groups_tick_counters_alarms() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    m.update_groups(
        names=["site", "row-a"],
        levels=["facility", "row"],
        budget_w=[1e6, math.inf],
        committed_w=[9e5, 4e5],
        draw_w=[8e5, 3.5e5],
    )
    m.observe_tick(
        duration_s=0.12,
        solve_s=0.03,
        status="optimal",
        ts=1.7e9,
        throughput={"a": 2},
        churn=(3, 45.0, 2),
    )
    m.observe_tick(
        duration_s=0.3, solve_s=0.2, status="fallback", ts=1.7e9 + 1, unused_w=1234.5, starved=5
    )
    m.update_counters(
        received={"telemetry": 10, "ack": 4},
        dropped={"malformed": 2},
        caps_sent=40,
        acks=4,
        ack_ticks=3,
    )
    m.update_fleet(gpus={"fresh": 3, "stale": 1}, nodes={"steered": 2})
    m.alarm_raised("solver_failed")
    m.alarm_raised("solver_failed")
    m.set_active_alarms({"solver_failed": 1})
    got = scrape(reg)
    site = (("group", "site"), ("level", "facility"))
    assert got["powerd_group_budget_watts"][site] == 1e6
    assert got["powerd_group_budget_watts"][(("group", "row-a"), ("level", "row"))] == math.inf
    assert got["powerd_group_committed_watts"][site] == 9e5
    assert got["powerd_group_draw_watts"][site] == 8e5
    assert got["powerd_tick_duration_seconds_count"][()] == 2
    assert got["powerd_tick_duration_seconds_bucket"][(("le", "0.15"),)] == 1
    assert got["powerd_solve_duration_seconds_sum"][()] == pytest.approx(0.23)
    assert got["powerd_ticks_total"] == {(("status", "fallback"),): 1, (("status", "optimal"),): 1}
    assert got["powerd_ack_ticks_total"][()] == 3
    assert got["powerd_solver_status"] == {
        (("status", "fallback"),): 1.0,
        (("status", "optimal"),): 0.0,
    }
    assert got["powerd_last_tick_timestamp_seconds"][()] == 1.7e9 + 1
    assert got["powerd_throughput"][(("class", "a"),)] == 2
    assert got["powerd_unused_watts"][()] == 1234.5
    assert got["powerd_messages_received_total"][(("kind", "telemetry"),)] == 10
    assert got["powerd_messages_dropped_total"][(("reason", "malformed"),)] == 2
    assert got["powerd_caps_sent_total"][()] == 40
    assert got["powerd_caps_moved_total"][()] == 3
    assert got["powerd_cap_moved_watts_total"][()] == 45.0
    assert got["powerd_caps_held_total"][()] == 2
    assert got["powerd_raises_starved"][()] == 5  # the last tick's, a gauge
    assert got["powerd_acks_received_total"][()] == 4
    assert got["powerd_gpus"][(("state", "stale"),)] == 1
    assert got["powerd_alarms_total"][(("kind", "solver_failed"),)] == 2
    assert got["powerd_alarms_active"][(("kind", "solver_failed"),)] == 1


def test_fast_exposition_matches_prometheus_client() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    update(m, [450.0, 390.5, 10.0])
    m.update_gpus(
        snapshot(
            uuids=["GPU-1"],
            nodes=['odd "node"\\name'],  # quotes and backslashes must be escaped alike
            index=[0],
            power_w=[1e-3],
            cap_w=[math.inf],
            energy_j=[1e12],
            temp_c=[-5.0],
            models=["model\nwith newline"],
        )
    )
    m.update_groups(
        names=["site"], levels=["facility"], budget_w=[math.inf], committed_w=[1], draw_w=[2]
    )
    m.observe_tick(duration_s=0.1, solve_s=0.01, status="optimal", ts=1.0)
    fast = exposition(reg).decode()
    reference = generate_latest(reg).decode()
    assert parse(fast) == parse(reference)
    # The same families, typed the same way, in the same order.
    headers = [line for line in fast.splitlines() if line.startswith("#")]
    assert headers == [line for line in reference.splitlines() if line.startswith("#")]
    assert "DCGM_FI_DEV_POWER_USAGE" in parse(fast)


def test_limits_powerd_did_not_set_per_gpu() -> None:
    reg = CollectorRegistry()
    m = ControllerMetrics(reg)
    m.update_gpus(
        snapshot(
            uuids=UUIDS,
            nodes=NODES,
            index=[0, 1, 0],
            power_w=[400.0, 300.0, 200.0],
            cap_w=[450.0, 250.0, 500.0],
            energy_j=[1.0, 1.0, 1.0],
            temp_c=[50.0, 50.0, 50.0],
            # matches within 1 W; lowered behind powerd's back; no set limit known
            set_w=[450.5, 400.0, math.nan],
            restores=[3.0, 0.0, 0.0],
        )
    )
    got = scrape(reg)
    assert got["powerd_gpu_cap_overridden"] == {
        gpu_key(0, "GPU-a0", "a"): 0.0,
        gpu_key(1, "GPU-a1", "a"): 1.0,
    }
    assert got["powerd_gpu_cap_restores_total"][gpu_key(0, "GPU-a0", "a")] == 3.0
    assert parse(generate_latest(reg).decode()) == got  # the fast path renders them alike


def test_registries_are_independent() -> None:
    # No import-time singletons: two controllers in one process (tests, demo) do not clash.
    a, b = CollectorRegistry(), CollectorRegistry()
    update(ControllerMetrics(a), [1.0, 2.0, 3.0])
    ControllerMetrics(b)
    assert "DCGM_FI_DEV_POWER_USAGE" in scrape(a)
    assert "DCGM_FI_DEV_POWER_USAGE" not in scrape(b)


@pytest.mark.parametrize("bit", [1 << i for i in range(11)] + [0x1000])
def test_throttle_mask_inverts_the_nvml_backend_names(bit: int) -> None:
    assert throttle_mask(throttle_reasons(bit)) == bit


def test_throttle_names_cover_every_known_bit() -> None:
    assert throttle_reasons(sum(THROTTLE_REASON_BITS.values())) == list(THROTTLE_REASON_BITS)


def gpu_sample(index: int, uuid: str, **values: Any) -> GpuTelemetry:
    """One GPU of an agent's telemetry; what a test does not give is a plausible H100's."""
    fields: dict[str, Any] = {
        "name": "H100",
        "power_w": 300.0,
        "energy_j": 1.0,
        "cap_w": 700.0,
        "min_cap_w": 200.0,
        "max_cap_w": 700.0,
        "default_cap_w": 700.0,
        "temp_c": 50.0,
        "util_pct": 90.0,
        "sm_clock_mhz": 1800.0,
    }
    return GpuTelemetry(uuid=uuid, index=index, **(fields | values))


def test_agent_serves_its_registry_over_http() -> None:
    reg = CollectorRegistry()
    m = AgentMetrics(reg, node_id="n01")
    m.update_gpus(
        [
            gpu_sample(
                3,
                "GPU-x",
                name="",
                power_w=321.0,
                cap_w=400.0,
                energy_j=10.0,
                temp_c=55.0,
                throttle=["sw_power_cap"],
            )
        ]
    )
    m.update_counters(commands=5, rejected={"stale": 1}, caps_applied=40, failsafe=False)
    server = start_metrics_server(reg, "127.0.0.1", 0)
    try:
        r = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=5)
    finally:
        server.close()
    assert r.status_code == 200
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
    }
    assert samples[("DCGM_FI_DEV_POWER_USAGE", gpu_key(3, "GPU-x", "n01"))] == 321.0
    assert samples[("powerd_agent_commands_total", ())] == 5
    assert samples[("powerd_agent_commands_rejected_total", (("reason", "stale"),))] == 1
    assert samples[("powerd_agent_failsafe", ())] == 0


def test_agent_and_controller_export_the_same_gpu_series() -> None:
    """One node's GPUs as its agent exports them (no numpy) and as the controller exports the
    same samples (arrays): the same families, labels and values."""
    gpus = [
        gpu_sample(0, "GPU-a0", power_w=412.25, energy_j=12.5, cap_w=500.0, set_w=500.0),
        gpu_sample(1, "GPU-a1", throttle=["sw_power_cap", "hw_slowdown"], restores=2),
        gpu_sample(2, "GPU-a2", name='odd "name"', cap_w=650.0, set_w=450.0, restores=1),
    ]
    agent_reg = CollectorRegistry()
    AgentMetrics(agent_reg, "a").update_gpus(gpus)
    controller_reg = CollectorRegistry()
    ControllerMetrics(controller_reg).update_gpus(
        GpuSnapshot(
            uuids=[g.uuid for g in gpus],
            nodes=["a"] * len(gpus),
            index=[g.index for g in gpus],
            power_w=[g.power_w for g in gpus],
            cap_w=[g.cap_w for g in gpus],
            energy_j=[g.energy_j for g in gpus],
            temp_c=[g.temp_c for g in gpus],
            models=[g.name for g in gpus],
            throttle=[g.throttle for g in gpus],
            set_w=[math.nan if g.set_w is None else g.set_w for g in gpus],
            restores=[float(g.restores) for g in gpus],
        )
    )
    agent = parse(generate_latest(agent_reg).decode())
    controller = scrape(controller_reg)
    gpu_series = {n: v for n, v in controller.items() if n in agent}
    assert agent == gpu_series
    assert len(agent) == 7  # power, limit, energy, temperature, clocks, overridden, restores
    assert agent["powerd_gpu_cap_overridden"] == {
        gpu_key(0, "GPU-a0", "a", "H100"): 0.0,
        gpu_key(2, "GPU-a2", "a", 'odd "name"'): 1.0,
    }
