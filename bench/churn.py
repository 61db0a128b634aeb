"""Bench: cap churn against work, one rule at a time (docs/allocator.md, "Deadband").

Runs `powerd sim`'s `fast` policy on a scenario once per variant of the policy's `control`
(the deadband, the dwell, the damping), and prints per variant the churn after the first minute
(share of GPUs whose cap moved per tick, median/p95 move, W moved per tick) and the work
lost against the first variant (the same run without the rule: same seed, same demand).

    .venv/bin/python bench/churn.py policies/scenarios/recorded.yaml --tick-s 5 \\
        --duration-h 0.25 --variants deadband_w=0 deadband_w=40 deadband_w=0,damping=1
    .venv/bin/python bench/churn.py policies/scenarios/recorded.yaml --tick-s 5 \\
        --duration-h 0.25 --variants deadband_w=0,raise_deadband_w=0 deadband_w=40 dwell_s=30

`--rule-cost` instead times the rule itself (controller/deadband.py) on a synthetic site of
10 rows × 10 racks × 125 nodes × 8 GPUs (100,000 GPUs): a tick whose held cuts fit, and one
where every group is tight (raises funded in turn, cuts released).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import numpy as np

from powerd.controller.deadband import Bands, hold_small_cuts
from powerd.logs import configure_logging
from powerd.policy import Policy, load_policy
from powerd.sim.run import simulate
from powerd.sim.scenario import Scenario, load_scenario
from powerd.sim.site import build_mix, site_for
from powerd.testing.synthetic import make_policy
from powerd.topology import Topology


def load_run(
    path: str, duration_h: float, tick_s: float, seed: int | None = None
) -> tuple[Scenario, Policy]:
    """The scenario with a bench's length, tick and seed (None: the scenario's own), and the
    policy it names."""
    overrides = {"duration_h": duration_h, "tick_s": tick_s, "seed": seed}
    scenario = load_scenario(path, overrides)
    assert scenario.policy_path is not None
    return scenario, load_policy(scenario.policy_path)


def with_control(policy: Policy, assignments: str) -> Policy:
    """The policy with `key=value[,key=value]` set in its `control`: a number, a word for
    a choice, or `none` for None; a dotted key sets a field of a section
    (`demand.window_s=120`), and `defaults.KEY` one of the policy's defaults
    (`defaults.headroom_w=30`)."""
    spec = policy.spec
    fields = spec.control.model_dump()
    for item in filter(None, assignments.split(",")):
        key, _, text = item.partition("=")
        value: float | str | None
        try:
            value = float(text)
        except ValueError:
            value = None if text == "none" else text
        if key.startswith("defaults."):
            defaults = spec.defaults.model_copy(update={key.removeprefix("defaults."): value})
            spec = spec.model_copy(update={"defaults": defaults})
            continue
        *path, name = key.split(".")
        section = fields
        for part in path:
            section = section[part]
        section[name] = value
    control = spec.control.model_validate(fields)
    return replace(policy, spec=spec.model_copy(update={"control": control}))


def rule_cost(reps: int = 50) -> dict[str, float]:
    """Milliseconds per call of the rule at 100,000 GPUs: a quiet tick (the held cuts fit)
    and a tight one (every group over: raises funded in turn, cuts released)."""
    policy = make_policy(10, 10, 125, 8)
    nodes = [g.name for g in policy.groups if g.level == 3 for _ in range(g.gpus)]
    topo = Topology.build(policy, nodes)
    rng = np.random.default_rng(0)
    n = topo.n_gpus
    targets = rng.uniform(200.0, 700.0, n)
    prev = np.clip(targets + rng.normal(0.0, 30.0, n), 200.0, 700.0)
    holdable = np.ones(n, dtype=np.bool_)
    pressed = rng.random(n) < 0.3
    out: dict[str, float] = {"gpus": n}
    for name, slack in (("fits_ms", 1e9), ("tight_ms", 0.0)):
        capacity = topo.group_sums(targets) + slack
        t0 = time.perf_counter()
        for _ in range(reps):
            hold_small_cuts(
                targets,
                prev,
                bands=Bands(40.0),
                topology=topo,
                capacity_w=capacity,
                holdable=holdable,
                pressed=pressed,
            )
        out[name] = (time.perf_counter() - t0) / reps * 1000.0
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("scenario", nargs="?")
    ap.add_argument("--rule-cost", action="store_true", help="time the rule at 100k GPUs")
    ap.add_argument("--tick-s", type=float, default=5.0)
    ap.add_argument("--duration-h", type=float, default=0.25)
    ap.add_argument("--seed", type=int)
    ap.add_argument(
        "--variants",
        nargs="+",
        default=["deadband_w=0", "deadband_w=25"],
        help="control settings per run, e.g. deadband_w=25,damping=0.1; the first is the base",
    )
    ap.add_argument("--json", action="store_true", help="one JSON object per variant")
    args = ap.parse_args()
    configure_logging(level="warning")
    if args.rule_cost:
        print(json.dumps(rule_cost()))
        return 0
    if args.scenario is None:
        ap.error("a scenario file, or --rule-cost")
    scenario, base_policy = load_run(args.scenario, args.duration_h, args.tick_s, args.seed)
    base_work: float | None = None
    if not args.json:
        print(
            f"{scenario.spec.name}: {args.duration_h:g} h in {args.tick_s:g} s ticks, fast; "
            "churn after the first minute"
        )
        print(
            f"{'variant':<28} {'moved/tick':>10} {'median W':>9} {'p95 W':>7} "
            f"{'W/tick':>9} {'work loss':>9} {'over s':>6} {'wall s':>6}"
        )
    for variant in args.variants:
        policy = with_control(base_policy, variant)
        site = site_for(scenario, policy)
        mix = build_mix(scenario, site)
        t0 = time.perf_counter()
        r = simulate(scenario, site, mix, "fast")
        wall = time.perf_counter() - t0
        if base_work is None:
            base_work = r.work_gpu_s
        loss = 1.0 - r.work_gpu_s / base_work if base_work else 0.0
        c = r.churn
        if args.json:
            row = {"variant": variant, **c, "work_loss": loss, "over_budget_s": r.over_budget_s}
            row["work_gpu_s"] = r.work_gpu_s
            print(json.dumps(row | {"committed_over_ticks": r.committed_over_ticks}))
        else:
            print(
                f"{variant:<28} {c['share_moved']:>10.1%} {c['median_move_w']:>9.1f} "
                f"{c['p95_move_w']:>7.1f} {c['moved_w_per_tick']:>9,.0f} {loss:>9.3%} "
                f"{r.over_budget_s:>6.0f} {wall:>6.0f}"
            )
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
