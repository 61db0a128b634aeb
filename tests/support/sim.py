"""A small policy and scenario for the simulator's tests (test_sim, test_sim_recorded,
test_sim_schedule, test_sim_traces)."""

from __future__ import annotations

from typing import Any

from powerd.testing.synthetic import policy_dict


def small_policy() -> dict[str, Any]:
    """2 rows × 2 racks × 2 nodes × 4 GPUs; every level binds (synthetic fractions)."""
    return policy_dict(2, 2, 2, 4, overhead_w=400.0)


def scenario_dict(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = {
        "name": "small",
        "duration_h": 1,
        "tick_s": 60,
        "seed": 7,
        "workloads": [
            {
                "name": "serving",
                "class": "inference",
                "share": 0.5,
                "pattern": "inference",
                "low_w": 250,
                "high_w": 600,
                "day_h": 2,
                "peak_hour": 0.5,
                "bursts": {"extra_w": 100, "probability": 0.2, "slot_s": 60},
            },
            {
                "name": "train",
                "class": "training",
                "share": 0.375,
                "pattern": "training",
                "jobs": 2,
                "high_w": 690,
                "low_w": 300,
                "period_s": 600,
                "idle": [{"start_h": 0.5, "end_h": 0.75}],
            },
            {"name": "batch", "class": "batch", "share": 0.125, "pattern": "steady"},
        ],
    }
    data.update(changes)
    return data
