"""Bench: what moves, tick by tick (docs/performance.md, "Cap churn").

Runs one size of a scenario under `fast` (as bench/demand_ladder.py: nodes of the policy's
shape under one feed, inner budgets at nameplate) per variant, and breaks each simulated
tick's committed-cap moves (> 1 W against the tick before, after the first minute) down by
what the tick saw where the GPU's cap moved (the first round of the tick whose target,
after the deadband, was off its cap):

- class (the GPU's class name) and direction (up / down);
- up: the GPU pressed on its cap (`held_back`: a probe) or not;
- down: the allocator's target more than `deadband_w` below the cap in force (a cut the
  band lets through) or within it (a held cut released where a limit needed it);
- the GPU's draw then against its recent peak (the estimate's `recent_w`): in the low part
  of a swing (draw < 60 % of the recent peak) or not;
- whether the move reverses the GPU's previous one.

    PYTHONPATH=. .venv/bin/python bench/churn_why.py \\
        --scenario policies/scenarios/mixed-correlated.yaml --tick-s 1 --nodes 47 \\
        --duration-h 0.25 --variants held-probe dwell_s=5
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from powerd.allocator.problem import held_back
from powerd.controller import tick as tick_mod
from powerd.logs import configure_logging
from powerd.safety import SafePlan
from powerd.sim.run import simulate
from powerd.sim.site import build_mix, build_site

sys.path.insert(0, str(Path(__file__).resolve().parent))
from churn import load_run
from demand_ladder import ROOT, with_variant

MOVE_W = 1.0
LOW_SHARE = 0.6  # a draw below this share of its recent peak: the low part of a swing


class Why:
    """Per simulated tick, the moves of committed caps and what the rounds saw."""

    def __init__(self, tick_s: float, band_w: float) -> None:
        self.skip = int(60 / tick_s)
        self.band_w = band_w
        self.rounds: list[dict[str, np.ndarray]] = []
        self.prev: np.ndarray | None = None
        self.last_dir: np.ndarray | None = None
        self.ticks = 0
        self.counted = 0
        self.n = 0
        self.kinds: Counter[str] = Counter()
        self.sizes: dict[str, list[float]] = {}
        self.per_gpu: np.ndarray | None = None

    def seen(self, info: dict[str, np.ndarray]) -> None:
        self.rounds.append(info)

    def trace(self, report: object, plan: SafePlan) -> None:
        if self.rounds:
            self.rounds[-1]["committed"] = np.asarray(plan.committed_w, dtype=np.float64).copy()

    def tick(self, _n: int) -> None:
        rounds = [r for r in self.rounds if "committed" in r]
        self.rounds = []
        if not rounds:
            return
        now = rounds[-1]["committed"]
        if self.prev is None or self.prev.shape != now.shape:
            self.prev = now.copy()
            self.last_dir = np.zeros(now.size)
            self.per_gpu = np.zeros(now.size)
            return
        assert self.last_dir is not None and self.per_gpu is not None
        self.ticks += 1
        delta = now - self.prev
        moved = np.abs(delta) > MOVE_W
        if self.ticks > self.skip:
            self.counted += 1
            self.n = now.size
            self.per_gpu += moved
            # The round that first decided each GPU's move (its target off its cap).
            which = np.full(now.size, -1)
            for k, r in enumerate(rounds):
                first = (which < 0) & (np.abs(r["post"] - r["prev"]) > MOVE_W)
                which[first] = k
            for i in np.flatnonzero(moved):
                r = rounds[max(which[i], 0)]
                up = delta[i] > 0
                cls = str(r["cls"][i])
                if up:
                    how = "pressed" if r["pressed"][i] else "free"
                else:
                    pre = r["pre"][i] - r["prev"][i]
                    how = "cut>band" if pre < -self.band_w else "released"
                swing = "low" if r["power"][i] < LOW_SHARE * r["recent"][i] else "high"
                rev = "rev" if self.last_dir[i] * delta[i] < 0 else "same"
                key = f"{cls} {'up' if up else 'down'} {how} {swing} {rev}"
                self.kinds[key] += 1
                self.sizes.setdefault(f"{cls} {'up' if up else 'down'}", []).append(
                    abs(float(delta[i]))
                )
        self.last_dir = np.where(moved, np.sign(delta), self.last_dir)
        self.prev = now.copy()

    def report(self) -> list[str]:
        gpu_ticks = max(self.counted * self.n, 1)
        total = sum(self.kinds.values())
        lines = [f"moved/tick {100 * total / gpu_ticks:.1f} % ({self.counted} ticks)"]
        groups: Counter[str] = Counter()
        for key, c in self.kinds.items():
            cls, d, how, _swing, _rev = key.split()
            groups[f"{cls} {d}"] += c
            groups[f"{cls} {d} {how}"] += c
            groups[f"{cls} {d} {how} {_swing}"] += c
            groups[f"{cls} {d} rev={_rev}"] += c
        for key in sorted(groups):
            extra = ""
            if key in self.sizes:
                s = np.asarray(self.sizes[key])
                extra = f"  median {np.median(s):.1f} W, p95 {np.percentile(s, 95):.1f} W"
            lines.append(f"  {key:<36} {100 * groups[key] / gpu_ticks:6.2f} %{extra}")
        if self.per_gpu is not None and self.counted:
            lines.append(
                "  moves per GPU over the run: median "
                f"{np.median(self.per_gpu):.0f}, p90 {np.percentile(self.per_gpu, 90):.0f}"
            )
        return lines


def instrument(why: Why) -> Any:
    """Wrap TickEngine._deadband to record what each round saw (restored by the caller)."""
    original = tick_mod.TickEngine._deadband

    def wrapped(self: Any, seen: Any, budgets: Any, targets: Any) -> Any:
        out = original(self, seen, budgets, targets)
        fleet = targets.fleet
        names = np.asarray(self.targets.classes.names)
        recent = fleet.recent_w if fleet.recent_w is not None else fleet.power_w
        why.seen(
            {
                "cls": names[targets.class_index],
                "prev": fleet.cap_w.copy(),
                "pre": np.asarray(targets.targets_w, dtype=np.float64).copy(),
                "post": np.asarray(out[0].targets_w, dtype=np.float64).copy(),
                "pressed": held_back(fleet, self.policy.control.demand),
                "power": fleet.power_w.copy(),
                "recent": np.asarray(recent, dtype=np.float64).copy(),
            }
        )
        return out

    tick_mod.TickEngine._deadband = wrapped  # type: ignore[method-assign]
    return original


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "policies/scenarios/recorded.yaml"))
    ap.add_argument("--nodes", type=int, default=47)
    ap.add_argument("--duration-h", type=float, default=0.25)
    ap.add_argument("--tick-s", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--variants", nargs="+", default=["held-probe"])
    args = ap.parse_args(argv)
    configure_logging("console", "warning")
    scenario, base = load_run(args.scenario, args.duration_h, args.tick_s, args.seed)
    site0 = build_site(base, nodes=args.nodes).inner_at_nameplate()
    mix = build_mix(scenario, site0)
    ref = simulate(scenario, site0, mix, "static")
    for name in args.variants:
        policy = with_variant(base, name)
        site = build_site(policy, nodes=args.nodes).inner_at_nameplate()
        why = Why(args.tick_s, policy.spec.control.deadband_w)
        original = instrument(why)
        t0 = time.perf_counter()
        try:
            r = simulate(scenario, site, mix, "fast", trace=why.trace, progress=why.tick)
        finally:
            tick_mod.TickEngine._deadband = original  # type: ignore[method-assign]
        loss = 1.0 - r.work_gpu_s / ref.work_gpu_s
        print(
            f"# {Path(args.scenario).name}, {site.n_gpus} GPUs, {args.duration_h:g} h, "
            f"{args.tick_s:g} s ticks, {name}: loss {100 * loss:.3f} %, "
            f"{time.perf_counter() - t0:.0f} s"
        )
        print("\n".join(why.report()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
