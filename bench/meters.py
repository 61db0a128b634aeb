"""What a metered group costs the tick: the engine's budgets stage with and without meters.

    PYTHONPATH=. .venv/bin/python bench/meters.py                 # 10,240 GPUs, 4 meters
    PYTHONPATH=. .venv/bin/python bench/meters.py --rows 2 --ticks 20
    PYTHONPATH=. .venv/bin/python bench/meters.py --racks 250 --nodes 1 --rack-meters

Runs the shipped tick (`powerd sim`'s engine, honest simulated agents) on a synthetic site
with every row and the facility rated for 5 %, once without meters and once with a meter
on the facility and on each row (fed the true draw each tick, as in the simulator), and
prints the median CPU milliseconds per tick of `TickEngine._budgets` (where meters enter)
and of the whole step. Figures: docs/performance.md, "Metered groups".
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import time
from typing import Any

import structlog

from powerd.controller.tick import TickEngine
from powerd.policy import Overload, parse_policy, with_overload
from powerd.sim.run import simulate
from powerd.sim.scenario import parse_scenario
from powerd.sim.site import build_mix, build_site
from powerd.testing.synthetic import policy_dict

PROM = {"prometheus": {"url": "http://127.0.0.1:9", "query": "x"}, "poll_s": 5, "timeout_s": 1}


def run(data: dict[str, Any], ticks: int) -> tuple[float, float]:
    """Median CPU ms per tick: the budgets stage, the whole step."""
    policy = with_overload(parse_policy(data), Overload(pct=5, for_s=60))
    scenario = parse_scenario(
        {
            "name": "bench",
            "duration_h": ticks * 5 / 3600,
            "tick_s": 5,
            "seed": 1,
            "workloads": [{"name": "t", "class": "batch", "share": 1.0, "pattern": "training"}],
        },
        "<bench>",
    )
    budgets: list[float] = []
    steps: list[float] = []
    original_budgets, original_step = TickEngine._budgets, TickEngine.step

    def timed_budgets(self: TickEngine, *args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return original_budgets(self, *args, **kwargs)
        finally:
            budgets.append((time.process_time() - t0) * 1000.0)

    def timed_step(self: TickEngine, *args: Any, **kwargs: Any) -> Any:
        t0 = time.process_time()
        try:
            return original_step(self, *args, **kwargs)
        finally:
            steps.append((time.process_time() - t0) * 1000.0)

    TickEngine._budgets = timed_budgets  # type: ignore[method-assign]
    TickEngine.step = timed_step  # type: ignore[method-assign]
    try:
        site = build_site(policy)
        simulate(scenario, site, build_mix(scenario, site), "fast")
    finally:
        TickEngine._budgets = original_budgets  # type: ignore[method-assign]
        TickEngine.step = original_step  # type: ignore[method-assign]
    return statistics.median(budgets[2:]), statistics.median(steps[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--racks", type=int, default=10)
    parser.add_argument("--nodes", type=int, default=32)
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--ticks", type=int, default=40)
    parser.add_argument("--rack-meters", action="store_true", help="a meter on every rack too")
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    data = policy_dict(args.rows, args.racks, args.nodes, args.gpus)
    metered = copy.deepcopy(data)
    metered["facility"]["meter"] = PROM
    rows = metered["facility"]["rows"]
    # One entry per row, each named apart (a meter measures one group).
    template = rows[0]
    if "{" in template["name"]:
        rows[:] = [
            {**copy.deepcopy(template), "name": f"row-{k}", "meter": PROM}
            for k in range(1, args.rows + 1)
        ]
    if args.rack_meters:
        for row in rows:
            rack = row["racks"][0]
            row["racks"] = [
                {**copy.deepcopy(rack), "name": f"{row['name']}-rack-{j}", "meter": PROM}
                for j in range(1, args.racks + 1)
            ]
    n = args.rows * args.racks * args.nodes * args.gpus
    for label, d in (("no meters", data), ("meters", metered)):
        b, s = run(d, args.ticks)
        print(f"{label:>10}: {n} GPUs, budgets stage {b:.2f} ms, step {s:.1f} ms (median CPU)")


if __name__ == "__main__":
    main()
