"""What the hostile-node tests share (test_hostile, test_attack_*): the node that attacks, the
topics, and a GPU of telemetry as a plain dict, to be broken field by field."""

from __future__ import annotations

from typing import Any

from powerd.wire import (
    Topics,
)

HOSTILE = "r1-n1"


TOPICS = Topics()


def gpu_dict(uuid: str, index: int, **over: Any) -> dict[str, Any]:
    base = {
        "uuid": uuid,
        "index": index,
        "power_w": 300.0,
        "energy_j": 1.0,
        "cap_w": 300.0,
        "min_cap_w": 200.0,
        "max_cap_w": 700.0,
        "default_cap_w": 700.0,
        "temp_c": 40.0,
        "util_pct": 50.0,
        "sm_clock_mhz": 1000.0,
    }
    base.update(over)
    return base
