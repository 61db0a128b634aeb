"""Demand that follows the work: the ladder of changes, measured at fixed site sizes.

    PYTHONPATH=. .venv/bin/python bench/demand_ladder.py                      # defaults
    PYTHONPATH=. .venv/bin/python bench/demand_ladder.py --nodes 61 72 76 \\
        --variants last-sample default --duration-h 0.5 --tick-s 5

For each size (nodes of the policy's shape, under one feed, inner budgets at nameplate as
`powerd sim --oversubscribe` has them) the same GPUs run once unconstrained (`static`: every
cap at TDP, budgets ignored, the reference) and once under `fast` per variant of the policy
(`VARIANTS`: settings of the demand estimate and its neighbours, one change at a time).
Printed per size and variant: the work lost against unconstrained, seconds any budget was
over, the unconstrained facility draw's maximum against the feed (where it stays under, a
perfect allocator loses nothing), and the share of GPUs whose cap moved per tick (after the
first minute, > 1 W).
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from powerd.cli.sim import overload_arg
from powerd.logs import configure_logging
from powerd.policy import Policy, with_overload
from powerd.safety import SafePlan
from powerd.sim.baselines import oracle
from powerd.sim.run import simulate
from powerd.sim.site import build_mix, build_site

sys.path.insert(0, str(Path(__file__).resolve().parent))
from churn import load_run, with_control

ROOT = Path(__file__).resolve().parent.parent
MOVE_W = 1.0  # a cap counts as moved when it changes by more than this

# Each variant: policy settings (section → {field: value}) on top of the policy's own.
VARIANTS: dict[str, dict[str, dict[str, Any]]] = {
    # powerd before issue 30: demand = the last sample + headroom_w, spare power around the
    # caps in force, a held-back GPU wants its maximum.
    "last-sample": {"control": {"demand": {"window_s": 0.0}}},
    # 1. spare power around each GPU's recent peak of draw (60 s), not its cap in force
    "spare-recent": {"control": {"demand": {"margin": "headroom", "held": "max"}}},
    # 2. + the headroom is spare power, not demand (demand: the least cap not read as held)
    "margin-least": {"control": {"demand": {"held": "max"}}},
    # 3. + a held-back GPU climbs from its recent peak by headroom, not to its maximum
    "held-probe": {},  # the shipped default
    # held-probe with the former 95 % rule for "held back by its cap" (no hysteresis against
    # the least margin's 95 %; control.demand.held_share, docs/allocator.md, "Demand")
    "held-share-95": {"control": {"demand": {"held_share": 0.95}}},
    # held-probe with a 45 W cut deadband (control.deadband_w; docs/allocator.md, "Deadband")
    "deadband-45": {"control": {"deadband_w": 45.0}},
    # 4. + class floors hold up to each GPU's recent draw (not shipped: see docs)
    "floors-follow": {"control": {"demand": {"floors": "follow"}}},
    # 5. + the swing: recent peak + the largest rise between samples
    "swing-1": {"control": {"demand": {"swing": 1.0}}},
    # 6. spare power around a held-back GPU's probe + held_spare_w (not claimed; 100 W is
    # the default since h-lag: held-probe is it; held-spare-0 is the default before)
    "held-spare-0": {"control": {"demand": {"held_spare_w": 0.0}}},
    "held-spare-50": {"control": {"demand": {"held_spare_w": 50.0}}},
    "held-spare-100": {"control": {"demand": {"held_spare_w": 100.0}}},
    "held-spare-200": {"control": {"demand": {"held_spare_w": 200.0}}},
    # held-probe without holding small raises of GPUs not pressing on their cap
    # (control.raise_deadband_w: 0; docs/allocator.md, "Deadband")
    "no-raise-band": {"control": {"raise_deadband_w": 0.0}},
    # held-probe with a dwell: a cap that moved stays 15 / 30 s unless its move is larger
    # than 80 W (control.dwell_s, dwell_max_w; docs/allocator.md, "Deadband")
    "dwell-15": {"control": {"dwell_s": 15.0}},
    "dwell-30": {"control": {"dwell_s": 30.0}},
}


def with_settings(policy: Policy, settings: dict[str, dict[str, Any]]) -> Policy:
    spec = policy.spec
    update: dict[str, Any] = {}
    for section, fields in settings.items():
        current = getattr(spec, section)
        sub: dict[str, Any] = {}
        for name, value in fields.items():
            if isinstance(value, dict):
                sub[name] = getattr(current, name).model_copy(update=value)
            else:
                sub[name] = value
        update[section] = current.model_copy(update=sub)
    return replace(policy, spec=spec.model_copy(update=update))


def with_variant(policy: Policy, name: str) -> Policy:
    """The policy with a named rung's settings, or `key=value[,key=value]` control
    settings (`demand.window_s=120`, as bench/churn.py takes them)."""
    if name in VARIANTS:
        return with_settings(policy, VARIANTS[name])
    if "=" not in name:
        raise SystemExit(f"--variants {name}: not one of {', '.join(VARIANTS)} nor key=value")
    return with_control(policy, name)


class Moves:
    """Per simulated tick, how many GPUs' committed caps moved since the last one."""

    def __init__(self, tick_s: float) -> None:
        self.last: np.ndarray | None = None
        self.prev: np.ndarray | None = None
        self.shares: list[float] = []
        self.skip = int(60 / tick_s)

    def trace(self, report: object, plan: SafePlan) -> None:
        self.last = plan.committed_w

    def tick(self, _n: int) -> None:
        if self.last is None:
            return
        if self.prev is not None and self.prev.shape == self.last.shape:
            moved = np.abs(self.last - self.prev) > MOVE_W
            self.shares.append(float(moved.mean()))
        self.prev = self.last.copy()

    def share(self) -> float:
        s = self.shares[self.skip :]
        return float(np.mean(s)) if s else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "policies/scenarios/recorded.yaml"))
    ap.add_argument("--nodes", type=int, nargs="+", default=[61, 72, 76])
    ap.add_argument("--feed-w", type=float, default=None, help="default: the site's")
    ap.add_argument("--duration-h", type=float, default=0.5)
    ap.add_argument("--tick-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["last-sample", "held-probe"],
        help=f"names ({', '.join(VARIANTS)}) or control settings, e.g. deadband_w=0,dwell_s=30",
    )
    ap.add_argument("--solver", default="fast")
    ap.add_argument(
        "--overload",
        metavar="PCT:SECONDS[:TARGET]",
        help="rate every budgeted group, as `powerd sim --overload` does",
    )
    ap.add_argument("--uncapped-only", action="store_true", help="only the reference runs")
    ap.add_argument("--oracle", action="store_true", help="also perfect foresight per size")
    args = ap.parse_args(argv)
    configure_logging("console", "warning")

    scenario, base = load_run(args.scenario, args.duration_h, args.tick_s, args.seed)
    if args.overload:
        base = with_overload(base, overload_arg(args.overload))
    feed = args.feed_w
    print(
        f"# {Path(args.scenario).name}: {args.duration_h} h, {args.tick_s:g} s ticks, "
        f"solver {args.solver}" + (f", overload {args.overload}" if args.overload else "")
    )
    print(
        f"{'nodes':>5} {'gpus':>5} {'variant':<14} {'loss %':>7} {'over s':>7} "
        f"{'uncapped max/feed':>17} {'moved/tick':>10} {'wall s':>7}"
    )
    for n in args.nodes:
        site0 = build_site(base, nodes=n, facility_budget_w=feed).inner_at_nameplate()
        feed_w = site0.feed_w
        mix = build_mix(scenario, site0)
        ref = simulate(scenario, site0, mix, "static")
        peak = float(ref.series.facility_draw_w.max()) / feed_w
        if args.oracle:
            orc = oracle(scenario, site0, mix)[0]
            print(
                f"{n:>5} {site0.n_gpus:>5} {'oracle':<14} {100 * orc.loss():>7.3f} "
                f"{orc.over_budget_s:>7.0f} {peak:>8.3f}",
                flush=True,
            )
        if args.uncapped_only:
            print(
                f"{n:>5} {site0.n_gpus:>5} {'uncapped':<14} {0:>7.3f} {ref.over_budget_s:>7.0f} "
                f"{peak:>8.3f}",
                flush=True,
            )
            continue
        for name in args.variants:
            policy = with_variant(base, name)
            site = build_site(policy, nodes=n, facility_budget_w=feed).inner_at_nameplate()
            moves = Moves(args.tick_s)
            t0 = time.perf_counter()
            r = simulate(scenario, site, mix, args.solver, trace=moves.trace, progress=moves.tick)
            loss = 1.0 - r.work_gpu_s / ref.work_gpu_s
            print(
                f"{n:>5} {site.n_gpus:>5} {name:<14} {100 * loss:>7.3f} {r.over_budget_s:>7.0f} "
                f"{peak:>8.3f} (over {ref.over_budget_s:>4.0f} s) {100 * moves.share():>9.1f}% "
                f"{time.perf_counter() - t0:>7.1f}",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
