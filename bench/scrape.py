"""Bench: one Prometheus scrape of the controller's metrics at fleet scale.

Fills `ControllerMetrics` with N GPUs (eight to a node, every per-GPU family set) and times
the text exposition two ways: powerd's `exposition` (rows rendered from cached label text,
integral values printed as integers) and prometheus_client's own `generate_latest` over the
same registry. Prints the median of `--repeat` scrapes of each, the size of the text, and
the time of one `update_gpus` with a new `GpuSnapshot` (what each tick pays).

    .venv/bin/python bench/scrape.py [--gpus 10000] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from prometheus_client import CollectorRegistry, generate_latest

from powerd.metrics import ControllerMetrics, GpuSnapshot, exposition


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpus", type=int, default=10_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    n = args.gpus
    rng = np.random.default_rng(1)
    registry = CollectorRegistry()
    metrics = ControllerMetrics(registry)
    uuids = [f"GPU-{i:08d}" for i in range(n)]
    nodes = [f"node-{i // 8:05d}" for i in range(n)]
    reasons = [["sw_power_cap"] if i % 3 == 0 else [] for i in range(n)]
    models = ["NVIDIA H200"] * n

    def update() -> float:
        t0 = time.perf_counter()
        metrics.update_gpus(
            GpuSnapshot(
                uuids=uuids,
                nodes=nodes,
                index=np.arange(n) % 8,
                power_w=rng.uniform(200, 700, n).round(1),
                cap_w=np.full(n, 700.0),
                energy_j=rng.uniform(1e6, 1e9, n).round(),
                temp_c=rng.integers(40, 85, n).astype(np.float64),
                committed_w=rng.uniform(300, 700, n).round(1),
                target_w=rng.uniform(300, 700, n).round(1),
                throttle=reasons,
                models=models,
            )
        )
        return time.perf_counter() - t0

    update_s = statistics.median(update() for _ in range(args.repeat))

    def timed(render: object) -> tuple[float, int]:
        times, size = [], 0
        for _ in range(args.repeat):
            update()
            t0 = time.perf_counter()
            text = render(registry)  # type: ignore[operator]
            times.append(time.perf_counter() - t0)
            size = len(text)
        return statistics.median(times), size

    ours_s, ours_bytes = timed(exposition)
    theirs_s, theirs_bytes = timed(generate_latest)
    print(f"GPUs {n:,}: update_gpus {update_s * 1e3:.1f} ms")
    print(f"  powerd exposition:  {ours_s * 1e3:8.1f} ms  {ours_bytes / 1e6:.1f} MB")
    print(f"  generate_latest:    {theirs_s * 1e3:8.1f} ms  {theirs_bytes / 1e6:.1f} MB")
    print(f"  ratio: {theirs_s / ours_s:.0f}x")


if __name__ == "__main__":
    main()
