"""Bench: cap churn in `powerd demo` (a controller and 512 simulated GPUs, real time, 1 s
ticks), with and without the deadband (docs/allocator.md, "Deadband").

Runs the demo headless for --duration seconds per deadband and prints, after the first
minute, the share of GPUs whose cap moved per tick, the median/p95 move, W moved per tick
(from the caps each tick sent against the last tick's), the same per second (ticks on acks,
`control.ack_ticks`, are ticks too: per second counts every move once, whatever the ticks)
and the demo's mean throughput (a real-time run: its workloads' phases against the ticks
differ between runs, so throughput is only roughly comparable).

    .venv/bin/python bench/churn_demo.py --duration 150 --deadbands 0,40
    .venv/bin/python bench/churn_demo.py --duration 150 --variants ack_ticks=0 ack_ticks=2
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import sys
from pathlib import Path

import numpy as np

from powerd.controller.churn import Churn
from powerd.controller.report import TickReport
from powerd.demo import LiveView, default_policy, run_demo
from powerd.logs import configure_logging
from powerd.policy import Policy

sys.path.insert(0, str(Path(__file__).resolve().parent))
from churn import with_control

SETTLE_S = 60.0


def measure(policy: Policy, duration_s: float) -> dict[str, float | int]:
    churn = Churn()
    last: dict[str, object] = {}
    span: list[float] = []  # the counted ticks' times
    show = LiveView.show

    def counting(view: LiveView, r: TickReport) -> None:
        t0 = last.setdefault("t0", r.ts)
        prev = last.get("sent")
        if prev is not None and last.get("uuids") == r.uuids and r.ts - float(t0) >= SETTLE_S:  # type: ignore[arg-type]
            churn.add(np.asarray(prev), r.sent_w)
            span.append(r.ts)
        last["sent"], last["uuids"] = r.sent_w, r.uuids
        show(view, r)

    LiveView.show = counting  # type: ignore[method-assign]
    try:
        s = asyncio.run(run_demo(policy, duration_s=duration_s, out=io.StringIO()))
    finally:
        LiveView.show = show  # type: ignore[method-assign]
    summary = churn.summary()
    seconds = span[-1] - span[0] + 1.0 if span else 0.0  # each tick counts its second
    per_s = float(summary["moves_per_tick"]) * int(summary["ticks"]) / seconds if seconds else 0.0
    uuids = last.get("uuids")
    n = len(uuids) if isinstance(uuids, list) else 0
    return {
        **summary,
        "share_moved_per_s": per_s / n if n else 0.0,
        "mean_throughput": s["mean_throughput"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=150.0)
    ap.add_argument("--deadbands", default="0,40")
    ap.add_argument(
        "--variants", nargs="*", default=None, help="control settings instead, e.g. ack_ticks=0"
    )
    args = ap.parse_args()
    configure_logging(level="warning")
    if args.variants is not None:
        for v in args.variants:
            row = measure(with_control(default_policy(), v), args.duration)
            print(json.dumps({"variant": v, **row}), flush=True)
        return 0
    for band in (float(b) for b in args.deadbands.split(",")):
        row = measure(with_control(default_policy(), f"deadband_w={band}"), args.duration)
        print(json.dumps({"deadband_w": band, **row}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
