"""Where the steered run loses work: by class, by the feed's slack and by cause, and what
allocators that know more would lose (docs/performance.md, "Demand that follows the work").

    PYTHONPATH=. .venv/bin/python bench/demand_loss.py --nodes 52          # 416 GPUs, 0.5 h
    PYTHONPATH=. .venv/bin/python bench/demand_loss.py --nodes 52 --set deadband_w=0

The simulator advances each 5 s tick in two pieces (powerd/sim/run.py): 1 s under the caps
of the last steer (`react_s`), then the steer (the draw at the end of that second, the
engine's rounds at one instant: acks are instant), then 4 s under the new caps. A traced
GPU's demand is held over each piece: the steer sees (capped) the demand of the second
before it, and its caps meet the demand of the next 4 s and of the next tick's first second.
Per piece and GPU the loss is the piece's length × (profile(demand) − the throughput it
delivered); the reference is the same GPUs at their demand on the same pieces (`grid ref`:
the bench's `static` run holds demand over whole ticks, so its total differs by ~0.01 % on
the recorded traces; on work whose phases change within a piece, such as synchronous
training's 4 s swings, the grid reference overstates the loss, 5.84 % against static's
3.93 % on mixed-correlated at 448 GPUs, 1 s: `--by-time` measures against `static`, which
integrates the phases as the steered run does).
A synchronous training job's GPUs work at its slowest GPU's pace, in the reference, the
delivered work and the view oracles alike, as the simulator counts them (docs/simulator.md,
"Synchronous training: the slowest GPU sets the pace"); a job's loss is charged to each of
its GPUs by that GPU's own cause, though a rank that waits loses by another's.

Causes, from the steer whose caps were in force:
- `pressed`: at that steer the GPU drew ≥ `held_share` of its cap (held back, demand
  unknown), split by whether its new cap reached the demand its sample came from, and if
  not, whether the estimate (its probe) fell short, the allocator's target did, or the
  deadband's held cuts left too little room for its raise;
- `cut`: not pressed, its new cap below the draw the steer saw;
- `rise`: not pressed, its new cap covered that draw, and its demand rose after the sample;
- `waiting`: the target above the committed cap after the steer's rounds.

View oracles: allocators that know each GPU's true demand at the steer's sample (not its
capped draw) and nothing after it, spreading the room left by several rules; the best
spreads by the chance of a rise (the run's own rises by class, last change and level,
taken over the whole run: optimistic). They bound what a causal controller can reach here.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

import powerd.allocator.problem as problem_mod
import powerd.controller.tick as tick_mod
from powerd.cli.sim import overload_arg
from powerd.logs import configure_logging
from powerd.policy import Policy, load_policy, with_overload
from powerd.sim.run import _Run, simulate
from powerd.sim.scenario import load_scenario
from powerd.sim.site import Mix, build_mix, build_site

sys.path.insert(0, str(Path(__file__).resolve().parent))
from churn import with_control

ROOT = Path(__file__).resolve().parent.parent
Array = np.ndarray


@dataclass
class Piece:
    t0: float
    dt: float
    cap: Array
    demand: Array
    tput: Array
    steer: int  # the steer whose caps were in force (-1: none yet)


@dataclass
class Steer:
    t: float
    seen: Array  # reported draw
    seen_demand: Array  # the demand that draw came from (the piece before)
    cap_before: Array
    cap_after: Array
    estimate: Array | None  # the allocator's demand (last round)
    target: Array | None  # the allocator's targets before the deadband (last round)
    withheld: Array | None
    rounds: int


@dataclass
class Recorder:
    """Hooks on the run's pieces, steers, demand estimates and the deadband's input."""

    pieces: list[Piece] = field(default_factory=list)
    steers: list[Steer] = field(default_factory=list)
    estimate: Array | None = None
    target: Array | None = None
    withheld: Array | None = None
    rounds: int = 0

    def install(self) -> None:
        rec = self
        orig_advance, orig_steer = _Run.advance, _Run.steer
        orig_demand, orig_hold = problem_mod.demand_w, tick_mod.hold_small_cuts

        def advance(run: _Run, dt: float, t_end: float) -> None:
            cap, demand = run.model.cap_w.copy(), run.model.demand_w.copy()
            orig_advance(run, dt, t_end)
            # What the run credits: a synchronous job's GPUs at its slowest GPU's pace.
            tput = run.mix.sync_throughput(run.model.step_throughput).copy()
            rec.pieces.append(Piece(t_end - dt, dt, cap, demand, tput, len(rec.steers) - 1))

        def steer(run: _Run, now: float) -> None:
            seen, before = run.model.power_w.copy(), run.model.cap_w.copy()
            seen_demand = rec.pieces[-1].demand if rec.pieces else run.model.demand_w.copy()
            rec.rounds = 0
            orig_steer(run, now)
            rec.steers.append(
                Steer(
                    now, seen, seen_demand, before, run.model.cap_w.copy(),
                    rec.estimate, rec.target, rec.withheld, rec.rounds,
                )
            )  # fmt: skip

        def demand_w(*args: Any, **kwargs: Any) -> Array:
            rec.estimate = orig_demand(*args, **kwargs)
            return rec.estimate

        def hold(targets_w: Array, in_force_w: Array, **kwargs: Any) -> Any:
            rec.target = np.asarray(targets_w, dtype=np.float64).copy()
            return orig_hold(targets_w, in_force_w, **kwargs)

        _Run.advance = advance  # type: ignore[method-assign]
        _Run.steer = steer  # type: ignore[method-assign]
        problem_mod.demand_w = demand_w
        tick_mod.hold_small_cuts = hold

    def trace(self, report: Any, plan: Any) -> None:
        self.withheld = np.asarray(plan.withheld, dtype=np.bool_)
        self.rounds += 1


def profile_values(mix: Mix) -> Any:
    """profile(draw) per GPU for arrays whose last axis is the fleet, a synchronous job's
    GPUs at its slowest GPU's pace (as the simulator credits them: `Mix.sync_throughput`)."""
    groups: dict[int, tuple[Any, list[int]]] = {}
    for i, w in enumerate(mix.workloads):
        groups.setdefault(id(w.profile), (w.profile, []))[1].append(i)
    cols = [(p, np.asarray(ix)) for p, ix in groups.values()]

    def value(power: Array) -> Array:
        out = np.zeros(power.shape)
        for p, ix in cols:
            out[..., ix] = p.value(power[..., ix])
        return mix.sync_throughput(out)

    return value


def pct(x: float, total: float) -> str:
    return f"{100 * x / total:.4f} %"


def decompose(rec: Recorder, policy: Policy, mix: Mix, feed_w: float, room_w: float) -> float:
    """Print where the loss is; return the grid reference's work (GPU-seconds)."""
    value = profile_values(mix)
    cls = mix.class_index
    names = list(policy.spec.classes)
    n = cls.size
    share = policy.spec.control.demand.held_share
    floor_w = np.asarray([policy.spec.classes[c].floor_w or 0.0 for c in names])[cls]
    causes = ("pressed", "cut", "rise", "waiting")
    lost = {k: np.zeros(len(names)) for k in causes}
    by_piece = {"first second (caps a tick old)": 0.0, "after the steer": 0.0}
    bins = [0.0, 0.01, 0.02, 0.03, 0.05, 1.0]
    by_slack, time_slack = np.zeros(len(bins) - 1), np.zeros(len(bins) - 1)
    pressed_why = dict.fromkeys(("rose after", "estimate short", "target short", "deadband"), 0.0)
    deadband_cls = np.zeros(len(names))
    target_cls = np.zeros(len(names))
    short_w: list[float] = []
    over_room, floor_idle, unallocated = [], [], []
    total = 0.0
    none = np.zeros(n, dtype=np.bool_)
    for pc in rec.pieces:
        ideal = value(pc.demand)
        short = np.maximum(ideal - pc.tput, 0.0) * pc.dt
        total += float(ideal.sum()) * pc.dt
        b = int(np.searchsorted(bins, (room_w - float(pc.demand.sum())) / feed_w, side="right"))
        b = min(max(b - 1, 0), len(by_slack) - 1)
        by_slack[b] += float(short.sum())
        time_slack[b] += pc.dt
        if pc.steer < 0:
            continue
        st = rec.steers[pc.steer]
        after = abs(pc.t0 - st.t) < 1e-9
        by_piece["after the steer" if after else "first second (caps a tick old)"] += short.sum()
        pressed = st.seen >= share * st.cap_before
        waiting = st.withheld if st.withheld is not None and st.withheld.shape == (n,) else none
        cut = ~pressed & ~waiting & (st.cap_after < st.seen - 1.0)
        masks = {
            "pressed": pressed & ~waiting,
            "cut": cut,
            "rise": ~pressed & ~cut & ~waiting,
            "waiting": waiting,
        }
        for k, mask in masks.items():
            lost[k] += np.bincount(cls[mask], weights=short[mask], minlength=len(names))
        p = masks["pressed"]
        under = p & (st.cap_after < st.seen_demand - 1.0)
        pressed_why["rose after"] += float(short[p & ~under].sum())
        if after:
            short_w.extend((st.seen_demand - st.cap_after)[under].tolist())
            unallocated.append(room_w - float(st.cap_after.sum()))
        est, target = st.estimate, st.target
        if est is None or est.shape != (n,) or target is None or target.shape != (n,):
            continue
        low = under & (est < st.seen_demand - 1.0)
        granted = under & ~low
        tshort = granted & (target < est - 1.0)
        dband = granted & ~tshort & (st.cap_after < est - 1.0)
        pressed_why["estimate short"] += float(short[low].sum())
        pressed_why["target short"] += float(short[tshort].sum())
        pressed_why["deadband"] += float(short[dband].sum())
        deadband_cls += np.bincount(cls[dband], weights=short[dband], minlength=len(names))
        target_cls += np.bincount(cls[tshort], weights=short[tshort], minlength=len(names))
        if after:
            over_room.append(float(est.sum()) - room_w)
            floor_idle.append(float(np.maximum(floor_w - est, 0.0).sum()))

    lost_total = sum(float(v.sum()) for v in lost.values())
    print("cause      " + " ".join(f"{c:>10}" for c in names) + "    share")
    for k, v in lost.items():
        cells = " ".join(f"{100 * x / total:>9.4f}%" for x in v)
        print(f"{k:<10} {cells}  {100 * float(v.sum()) / max(lost_total, 1e-12):>6.1f} %")
    for k, x in by_piece.items():
        print(f"piece: {k:<32} {pct(x, total)}")
    print("by the feed's slack (feed − overhead − Σ uncapped demand, share of the feed):")
    for j in range(len(by_slack)):
        print(
            f"  [{bins[j]:.2f}, {bins[j + 1]:.2f}): {pct(by_slack[j], total)} "
            f"over {time_slack[j]:.0f} s"
        )
    print("pressed, by why: " + ", ".join(f"{k} {pct(x, total)}" for k, x in pressed_why.items()))
    if short_w:
        print(
            f"  new cap below the demand the sample came from by median "
            f"{np.median(short_w):.0f} W, p90 {np.percentile(short_w, 90):.0f} W"
        )
    for what, arr in (("target short", target_cls), ("deadband", deadband_cls)):
        by_cls = zip(names, arr, strict=True)
        print(f"  {what}, by class: " + ", ".join(f"{c} {pct(x, total)}" for c, x in by_cls))
    if over_room:
        orr = np.asarray(over_room)
        print(
            f"Σ demand estimate − room: median {np.median(orr):.0f} W, above the room at "
            f"{100 * (orr > 0).mean():.0f} % of steers; floors above the estimate: median "
            f"{np.median(floor_idle):.0f} W; room left unallocated: mean "
            f"{np.mean(unallocated):.0f} W"
        )
    runs: dict[int, int] = {}
    length = np.zeros(n, dtype=np.int64)
    for st in rec.steers:
        pressed = st.seen >= share * st.cap_before
        for r in length[~pressed & (length > 0)].tolist():
            runs[r] = runs.get(r, 0) + 1
        length = np.where(pressed, length + 1, 0)
    print(
        "pressed runs (successive steers), count by length: "
        + ", ".join(f"{k}: {v}" for k, v in sorted(runs.items())[:8])
    )
    return total


def spread_by_chance(
    seen: Array,
    changes: list[tuple[Array, float]],
    key: Array,
    n_keys: int,
    value: Any,
    bounds: tuple[Array, Array],
    room_w: float,
    weight: Array,
) -> Array:
    """Caps where every GPU's expected marginal work meets one price within the room: the
    profile's slope at the cap × the chance its demand lies above the cap in the pieces
    ahead (each piece's changes from the seen demand, weighted by its length, from the GPUs
    that share its key), within [lo, hi] (bisection per steer, 5 W steps)."""
    step = 5.0
    xs = np.arange(-400.0, 400.0 + step, step)
    table = np.zeros((n_keys, xs.size))
    length = sum(dt for _, dt in changes)
    for k in range(n_keys):
        sel = key == k
        if sel.any():
            for change, dt in changes:
                table[k] += dt / length * (change[sel][None, :] > xs[:, None]).mean(axis=1)
    lo_w, hi_w = bounds
    out = np.empty_like(seen)
    for t in range(seen.shape[0]):
        levels = seen[t][None, :] + xs[:, None]  # (x, gpu)
        marginal = (value(levels + step) - value(levels)) / step * table[key[t]].T * weight
        # Below its lower bound a GPU is given the watt anyway: counted first, so the
        # watts taken stay a prefix of the levels (concave profile, falling chance).
        marginal = np.where(levels < lo_w[None, :], np.inf, marginal)

        def caps(price: float, t: int = t, marginal: Array = marginal) -> Array:
            got = seen[t] + xs[0] + (marginal >= price).sum(axis=0) * step
            return np.clip(got, lo_w, hi_w)

        lo, hi = 0.0, float(marginal[np.isfinite(marginal)].max(initial=0.0)) + 1.0
        for _ in range(40):
            price = 0.5 * (lo + hi)
            if caps(price).sum() <= room_w:
                hi = price
            else:
                lo = price
        out[t] = caps(hi)
    return out


def view_oracles(
    rec: Recorder,
    policy: Policy,
    mix: Mix,
    room_w: float,
    *,
    floors: bool = True,
    weighted: bool = False,
) -> None:
    """Loss of allocators that know each GPU's true demand at the steer's sample (holding
    the class floors as powerd does, unless `floors` is False)."""
    value = profile_values(mix)
    cls = mix.class_index
    names = list(policy.spec.classes)
    by_t0 = {round(pc.t0, 6): pc for pc in rec.pieces}
    rows: list[tuple[Array, Array, Array, Array, Array]] = []
    order = sorted(by_t0)
    dt_a = dt_b = 0.0
    for st in rec.steers:
        before = by_t0.get(round(st.t - 1.0, 6))  # the piece the steer's sample came from
        a = by_t0.get(round(st.t, 6))
        b = None if a is None else by_t0.get(round(st.t + a.dt, 6))
        if before is None or a is None or b is None:
            continue
        past = [by_t0[t0].demand for t0 in order if st.t - 61.0 <= t0 < st.t]
        rows.append((before.demand, a.demand, b.demand, st.cap_after, np.max(past, axis=0)))
        dt_a, dt_b = a.dt, b.dt
    if not rows:
        return
    seen, nxt, nxt2, ctl, peak = (np.asarray(x) for x in zip(*rows, strict=True))
    ideal = (value(nxt) * dt_a + value(nxt2) * dt_b).sum()

    def loss(caps: Array) -> str:
        a = (value(nxt) - value(np.minimum(caps, nxt))).sum() * dt_a
        b = (value(nxt2) - value(np.minimum(caps, nxt2))).sum() * dt_b
        return f"{pct(a + b, ideal)} ({pct(a, ideal)} after the steer, {pct(b, ideal)} the next)"

    floor_w = np.asarray([policy.spec.classes[c].floor_w or 0.0 for c in names])[cls]
    lo_w = np.maximum(floor_w if floors else np.zeros(cls.size), policy.spec.defaults.gpu.min_cap_w)
    bounds = (lo_w, np.full(cls.size, policy.spec.defaults.gpu.max_cap_w))
    changes = [(nxt - seen, dt_a), (nxt2 - seen, dt_b)]
    by_class = np.broadcast_to(cls, seen.shape)
    change = np.diff(seen, axis=0, prepend=seen[:1])
    trend = np.where(change > 5.0, 2, np.where(change < -5.0, 0, 1))
    level = np.clip((seen / 100.0).astype(np.int64), 0, 7)
    k = len(names)
    one = np.zeros(seen.shape, dtype=np.int64)
    class_weight = np.asarray([policy.spec.classes[c].weight for c in names])
    weight = class_weight[cls] if weighted else np.ones(cls.size)
    args = (value, bounds, room_w, weight)
    exact = spread_by_chance(seen, [(np.zeros(seen.shape), 1.0)], one, 1, *args)
    left = np.maximum(room_w - exact.sum(axis=1, keepdims=True), 0.0)
    even = np.minimum(exact + left / seen.shape[1], bounds[1])
    best_class = spread_by_chance(seen, changes, by_class, k, *args)
    best_trend = spread_by_chance(seen, changes, by_class * 3 + trend, 3 * k, *args)
    best = spread_by_chance(seen, changes, (by_class * 3 + trend) * 8 + level, 24 * k, *args)
    gap = np.digitize(peak - seen, [25.0, 100.0, 200.0])  # the 60 s peak's height above
    key = ((by_class * 3 + trend) * 8 + level) * 4 + gap
    best_peak = spread_by_chance(seen, changes, key, 96 * k, *args)
    print("on the same pieces (the steer's 4 s and the next tick's first second):")
    print(f"  powerd's caps: {loss(ctl)}")
    print("view oracles (true demand at the steer's sample, nothing after it):")
    print(f"  that demand where it fits (by the profiles' slopes), no margin: {loss(exact)}")
    print(f"  + the room left spread evenly: {loss(even)}")
    print(f"  spread by the chance of a rise, by class: {loss(best_class)}")
    print(f"  ... by class and last change: {loss(best_trend)}")
    print(f"  ... by class, last change and level (100 W): {loss(best)}")
    print(f"  ... and the 60 s peak's height above it (4 bins): {loss(best_peak)}")
    print("margin above the demand the sample came from, mean W (powerd / the last oracle):")
    for c in range(k):
        cells = []
        for lv in range(2, 7):
            sel = (by_class == c) & (level == lv)
            if sel.sum() >= 50:
                cells.append(
                    f"{lv * 100}-{lv * 100 + 99} W {np.mean((ctl - seen)[sel]):.0f} / "
                    f"{np.mean((best - seen)[sel]):.0f}"
                )
        if cells:
            print(f"  {names[c]}: " + "; ".join(cells))


def by_time(ref: list[Piece], run: list[Piece], policy: Policy, mix: Mix, stretch_s: float) -> None:
    """Per stretch of `stretch_s`: the work the steered run lost against the static run (TDP
    caps, the same GPUs and demand) in that stretch, by class, as shares of the static run's
    whole work. Both runs integrate a workload's phases within each piece alike, so this
    holds on swinging work, where the per-GPU grid reference above does not."""
    names = list(policy.spec.classes)
    cls = mix.class_index

    def sums(pieces: list[Piece]) -> dict[int, Array]:
        out: dict[int, Array] = {}
        for pc in pieces:
            k = int(pc.t0 // stretch_s)
            row = out.setdefault(k, np.zeros(len(names)))
            row += np.bincount(cls, weights=pc.tput * pc.dt, minlength=len(names))
        return out

    base, got = sums(ref), sums(run)
    total = sum(float(v.sum()) for v in base.values())
    print(f"work lost by stretch of {stretch_s:g} s (share of the static run's work):")
    print("   from s " + " ".join(f"{c:>10}" for c in names) + "      all")
    for k in sorted(base):
        lost = 100 * (base[k] - got.get(k, np.zeros(len(names)))) / total
        cells = " ".join(f"{x:>9.3f}%" for x in lost)
        print(f"{k * stretch_s:>9.0f} {cells} {float(lost.sum()):>8.3f}%")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scenario", default=str(ROOT / "policies/scenarios/recorded.yaml"))
    ap.add_argument("--nodes", type=int, default=52)
    ap.add_argument("--duration-h", type=float, default=0.5)
    ap.add_argument("--tick-s", type=float, default=5.0)
    ap.add_argument("--set", nargs="*", default=[], help="control settings, e.g. deadband_w=0")
    ap.add_argument(
        "--overload",
        metavar="PCT:SECONDS[:TARGET[:RISE]]",
        help="rate every budgeted group, as `powerd sim --overload` does",
    )
    ap.add_argument("--no-oracles", action="store_true")
    ap.add_argument("--oracles-without-floors", action="store_true", help="a lower bound")
    ap.add_argument(
        "--oracles-weighted", action="store_true", help="oracles maximise weighted work, as powerd"
    )
    ap.add_argument(
        "--by-time",
        type=float,
        metavar="SECONDS",
        help="also the work lost per stretch of this length, by class, against the static "
        "run's work in the same stretch (phases integrated alike: the measure for swinging work)",
    )
    args = ap.parse_args(argv)
    configure_logging("console", "warning")
    scenario = load_scenario(args.scenario, {"duration_h": args.duration_h, "tick_s": args.tick_s})
    assert scenario.policy_path is not None
    policy = with_control(load_policy(scenario.policy_path), ",".join(args.set))
    if args.overload:
        policy = with_overload(policy, overload_arg(args.overload))
    site = build_site(policy, nodes=args.nodes).inner_at_nameplate()
    mix = build_mix(scenario, site)
    rec = Recorder()
    rec.install()
    ref = simulate(scenario, site, mix, "static")
    ref_pieces = rec.pieces
    rec.pieces, rec.steers = [], []
    run = simulate(scenario, site, mix, "fast", trace=rec.trace)
    room_w = site.feed_w - float(site.topology.overhead_w[0])
    print(
        f"# {site.n_gpus} GPUs, {args.duration_h} h, {args.tick_s:g} s ticks, {args.set}"
        + (f", overload {args.overload}" if args.overload else "")
    )
    total = decompose(rec, policy, mix, site.feed_w, room_w)
    print(
        f"loss {100 * (1 - run.work_gpu_s / ref.work_gpu_s):.3f} % against static, "
        f"{100 * (1 - run.work_gpu_s / total):.3f} % against the grid reference; "
        f"engine rounds a steer: {np.mean([s.rounds for s in rec.steers]):.2f}"
    )
    if args.by_time:
        by_time(ref_pieces, rec.pieces, policy, mix, args.by_time)
    if not args.no_oracles:
        view_oracles(
            rec,
            policy,
            mix,
            room_w,
            floors=not args.oracles_without_floors,
            weighted=args.oracles_weighted,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
