"""Bench: where a controller's memory goes, stage by stage, in one process.

Resident memory (VmRSS) after each stage: the interpreter, numpy, the tick's modules, the
engine and a fleet heard, numba imported, the compiled kernels loaded from numba's cache
(the first load starts LLVM's JIT), the first tick, and N more ticks at fleet scale. No
broker, no store: bench/loop.py measures the whole daemon over Mosquitto; this one says
which part of its figure is whose.

    PYTHONPATH=. .venv/bin/python bench/memory.py --gpus 10000 --ticks 30
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path


def rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpus", type=int, default=10_000, help="a multiple of 8")
    parser.add_argument("--ticks", type=int, default=30)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    stages: dict[str, float] = {"python": rss_mb()}

    import structlog

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    stages["numpy"] = rss_mb()

    from powerd.backends.mock import SimulatedGpus, Workload
    from powerd.controller.tick import TickEngine
    from powerd.policy import parse_policy
    from powerd.sim.agents import SimAgents
    from powerd.testing.synthetic import policy_dict

    stages["tick modules"] = rss_mb()
    nodes_n = args.gpus // 8
    racks = max(1, nodes_n // 25)
    policy = parse_policy(policy_dict(1, racks, nodes_n // racks, 8))
    n = sum(g.gpus for g in policy.groups if g.level == 3)
    engine = TickEngine(policy)
    model = SimulatedGpus(n, Workload.steady(500.0))
    names = [g.name for g in policy.groups if g.level == 3]
    agents = SimAgents(model, [names[i // 8] for i in range(n)], ["training"] * n, period_s=1.0)
    for msg in agents.telemetry(0.0):
        engine.on_telemetry(msg, 0.0)
    engine.observe(0.0)
    engine.planner.assume_settled()
    stages[f"engine, {n:,} GPUs heard"] = rss_mb()

    import numba  # noqa: F401

    stages["numba imported"] = rss_mb()
    from powerd.allocator import kernel

    t0 = time.perf_counter()
    kernel.warm_up()
    load_s = time.perf_counter() - t0
    stages["kernels loaded (LLVM's JIT started)"] = rss_mb()
    t = 1.0
    _, plan = engine.step(t, t)
    stages["first tick"] = rss_mb()
    for _ in range(args.ticks):
        t += 1.0
        for msg in agents.telemetry(t):
            engine.on_telemetry(msg, t)
        _, plan = engine.step(t, t)
        for cmd, acked in agents.apply(plan.commands):
            engine.on_acked(cmd.node, cmd.tick, 0, None, acked)
    gc.collect()
    stages[f"after {args.ticks} more ticks"] = rss_mb()
    if args.json:
        print(json.dumps({"gpus": n, "stages_mb": stages, "kernel_load_s": load_s}))
        return
    last = 0.0
    print(f"{n:,} GPUs; kernels loaded in {load_s:.1f} s (from numba's cache when warm)")
    for stage, mb in stages.items():
        print(f"  {stage:40s} {mb:6.0f} MB  (+{mb - last:.0f})")
        last = mb
    sys.stdout.flush()


if __name__ == "__main__":
    main()
