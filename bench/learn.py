"""Bench: what online profile learning costs the tick (powerd/allocator/learn.py).

Per tick the controller samples (draw, perf) of the fleet's GPUs, in batches (most ticks
touch no GPU); every `refit_ticks` it refits the classes, one a tick. This times both at
several fleet sizes with the default settings (buffer 4,096 per class, 1 s ticks, a 6 h
window), and prints JSON lines.

    .venv/bin/python bench/learn.py [--gpus 1000,10000,100000] [--classes 4] [--reps 200]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from powerd.allocator.learn import ProfileLearner
from powerd.policy import Learn
from powerd.profile import Profile

TRUE = Profile.from_points("t", [(200, 0.25), (400, 0.58), (550, 0.8), (700, 1.0)])


def bench(n: int, classes: int, reps: int) -> dict[str, float]:
    rng = np.random.default_rng(0)
    settings = Learn(enabled=True)
    keys = [f"c{k}" for k in range(classes)]
    lrn = ProfileLearner(
        keys, [TRUE] * classes, [True] * classes, settings, max_w=700.0, tick_s=1.0
    )
    cls = rng.integers(0, classes, n).astype(np.int64)
    usable = np.ones(n, dtype=np.bool_)
    p = rng.uniform(200, 700, n)
    y = 1000 * TRUE.value(p)
    # Fill every buffer first (what a refit sees in steady state).
    for k in range(classes):
        lrn._rings[k].add(0.0, p[: settings.buffer], y[: settings.buffer])
    t0 = time.perf_counter()
    for t in range(reps):
        lrn.observe(float(t), cls, p, y, usable, min_w=200.0)
    observe_ms = (time.perf_counter() - t0) / reps * 1000
    # A tick that takes a batch for every class (one in buffer / (batch × window) ticks).
    t0 = time.perf_counter()
    for t in range(reps):
        lrn._credit[:] = 16.0
        lrn.observe(float(t), cls, p, y, usable, min_w=200.0)
    batch_ms = (time.perf_counter() - t0) / reps * 1000
    t0 = time.perf_counter()
    fits = max(1, reps // 20)
    for _ in range(fits):
        lrn.refit_next(float(reps))  # one class: what a refitting tick pays
    fit_ms = (time.perf_counter() - t0) / fits * 1000
    return {
        "gpus": n,
        "classes": classes,
        "observe_ms_per_tick": round(observe_ms, 3),
        "observe_batch_tick_ms": round(batch_ms, 3),
        "fit_one_class_ms": round(fit_ms, 3),
        "fit_ms_per_tick_amortised": round(fit_ms * classes / settings.refit_ticks, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gpus", default="1000,10000,100000")
    ap.add_argument("--classes", type=int, default=4)
    ap.add_argument("--reps", type=int, default=200)
    a = ap.parse_args()
    for n in (int(x) for x in a.gpus.split(",")):
        print(json.dumps(bench(n, a.classes, a.reps)))


if __name__ == "__main__":
    main()
