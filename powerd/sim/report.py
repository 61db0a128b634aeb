"""What a simulation shows: terminal tables, a JSON document, PNG plots and one HTML page.

Plots use matplotlib's Agg backend (no display); the HTML page embeds them as base64, so it
is one self-contained file.
"""

from __future__ import annotations

import base64
import html
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from powerd.numeric import finite_or_none, kw_text
from powerd.policy import LEVELS
from powerd.sim import ORACLE, STATIC, STEERED, UNCAPPED
from powerd.sim.baselines import BaselineResult, Breaker, Trips, trips_of
from powerd.sim.run import RunResult
from powerd.sim.scenario import Scenario
from powerd.sim.site import Site
from powerd.sim.study import OversubPoint, Oversubscription, SweepPoint

COLORS = {
    "fast": "#1f77b4",
    "uniform": "#ff7f0e",
    "priority-bands": "#2ca02c",
    "static": "#7f7f7f",
    UNCAPPED: "#9467bd",
    ORACLE: "#000000",
}


@dataclass
class Report:
    scenario: Scenario
    site: Site
    compare: dict[str, RunResult] = field(default_factory=dict)
    # `static` on the GPUs the feed holds at TDP: the baseline of the headline.
    provisioned: RunResult | None = None
    sweep: list[SweepPoint] = field(default_factory=list)
    oversub: Oversubscription | None = None
    wall_s: float = 0.0
    # `uncapped` and `oracle` on the same GPUs (powerd/sim/baselines.py), and the breaker
    # model that judges every run.
    baselines: dict[str, BaselineResult] = field(default_factory=dict)
    breaker: Breaker = field(default_factory=Breaker)

    @property
    def runs(self) -> dict[str, RunResult]:
        """The policies, then the baselines."""
        return {**self.compare, **self.baselines}

    def trips(self, name: str) -> Trips | None:
        """What the breakers did to run `name`: simulated for `uncapped`, bounded from the
        highest draw/budget for the others (None: that bound cannot rule a trip out)."""
        r = self.runs[name]
        if isinstance(r, BaselineResult) and r.trips is not None:
            return r.trips
        return trips_of(r, self.breaker)

    @property
    def lead(self) -> str | None:
        """The steered policy the headline speaks for: `fast` if run, else the first."""
        steered = [p for p in self.compare if p in STEERED]
        return "fast" if "fast" in steered else (steered[0] if steered else None)


# -- JSON ----------------------------------------------------------------------------------


def to_json(report: Report) -> dict[str, Any]:
    sc, site = report.scenario, report.site
    out: dict[str, Any] = {
        "scenario": {
            "name": sc.spec.name,
            "source": sc.source,
            "policy": site.policy.source,
            "duration_h": sc.ticks * sc.spec.tick_s / 3600.0,
            "tick_s": sc.spec.tick_s,
            "seed": sc.spec.seed,
        },
        "site": {
            "gpus": site.n_gpus,
            "nodes": site.n_nodes,
            "feed_w": finite_or_none(site.feed_w),
            "nameplate_w": site.nameplate_w,
            "feed_fraction": finite_or_none(site.feed_w / site.nameplate_w),
        },
    }
    if report.compare:
        static = report.compare.get(STATIC)
        out["compare"] = {
            p: {
                **r.summary(),
                "vs_static": r.work_gpu_s / static.work_gpu_s if static else None,
            }
            for p, r in report.compare.items()
        }
        for p in report.compare:
            t = report.trips(p)
            out["compare"][p]["trips"] = None if t is None else t.summary()
    if report.baselines:
        out["baselines"] = {b: r.summary() for b, r in report.baselines.items()}
    headline = headline_json(report)
    if headline:
        out["headline"] = headline
    base = report.provisioned
    if base is not None:
        out["provisioned"] = base.summary()
        for p, r in report.compare.items():
            out["compare"][p]["vs_provisioned"] = {
                "work": r.work_gpu_s / base.work_gpu_s if base.work_gpu_s else None,
                "facility_energy": r.facility_energy_j / base.facility_energy_j
                if base.facility_energy_j
                else None,
                "work_per_joule": r.work_per_joule / base.work_per_joule
                if base.work_per_joule
                else None,
                "work_per_facility_joule": r.work_per_facility_joule / base.work_per_facility_joule
                if base.work_per_facility_joule
                else None,
            }
    if report.sweep:
        out["budget_sweep"] = [
            {
                "fraction": pt.fraction,
                "feed_w": pt.feed_w,
                "policies": {
                    p: {
                        "mean_throughput": r.mean_throughput,
                        "mean_weighted_throughput": r.weighted_work_gpu_s / r.duration_s,
                        "mean_facility_draw_w": r.facility_energy_j / r.duration_s,
                        "over_budget_s": r.over_budget_s,
                        "beyond_rating_s": r.beyond_rating_s,
                        "below_floor_share": r.below_floor_share,
                    }
                    for p, r in pt.results.items()
                },
            }
            for pt in report.sweep
        ]
    o = report.oversub
    if o is not None:
        out["oversubscribe"] = {
            "feed_w": o.feed_w,
            "threshold": o.threshold,
            "metric": o.metric,
            "gpus_per_node": o.gpus_per_node,
            "node_nameplate_w": o.node_nameplate_w,
            "static_tdp_gpus": o.static_tdp_gpus,
            "max_gpus_min_caps": o.max_nodes * o.gpus_per_node,
            "fit_gpus": {p: o.fit_gpus(p) for p in o.fit_nodes},
            "uncapped_fit_gpus": {k: o.uncapped_fit_gpus(k) for k in o.uncapped_fit_nodes},
            "gain_vs_static": {
                p: (g / o.static_tdp_gpus - 1.0) if g is not None and o.static_tdp_gpus else None
                for p in o.fit_nodes
                for g in [o.fit_gpus(p)]
            },
            "points": [
                {
                    "gpus": pt.gpus,
                    "loss": pt.loss,
                    "weighted_loss": pt.weighted_loss,
                    "over_budget_s": pt.over_budget_s,
                    "beyond_rating_s": pt.beyond_rating_s,
                    "trips": pt.trips,
                    # Runs the search ended once they provably failed: their losses are the
                    # least they can have lost, their time over budget up to that hour.
                    "stopped_h": pt.stopped_h,
                }
                for pt in o.points
            ],
        }
    out["runtime"] = {"wall_s": report.wall_s}
    return out


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def headline_json(report: Report) -> dict[str, Any]:
    """powerd (the lead policy) against static provisioning, against uncapped at the same
    risk, and as a share of the oracle; with --oversubscribe, the same in GPUs."""
    lead = report.lead
    if lead is None:
        return {}
    r = report.compare[lead]
    t = report.trips(lead)
    out: dict[str, Any] = {"policy": lead, "trips": None if t is None else t.trips}
    if report.provisioned is not None:
        out["vs_static"] = _ratio(r.work_gpu_s, report.provisioned.work_gpu_s)
    u = report.baselines.get(UNCAPPED)
    if u is not None and u.trips is not None:
        out["vs_uncapped"] = {
            "work": _ratio(r.work_gpu_s, u.work_gpu_s),
            "same_risk": u.trips.trips == 0 and u.over_budget_s == 0,
            "uncapped_trips": u.trips.trips,
            "uncapped_over_budget_s": u.over_budget_s,
            "uncapped_over_budget_s_by_level": u.over_budget_s_by_level,
            "uncapped_max_draw_over_budget": u.max_excess_ratio,
            "uncapped_lost_work_gpu_h": u.trips.lost_work_gpu_s / 3600.0,
        }
    orc = report.baselines.get(ORACLE)
    if orc is not None:
        out["share_of_oracle"] = {
            "work": _ratio(r.work_gpu_s, orc.work_gpu_s),
            "weighted_work": _ratio(r.weighted_work_gpu_s, orc.weighted_work_gpu_s),
        }
    o = report.oversub
    if o is not None:
        fit = o.fit_gpus(lead)
        best = o.fit_gpus(ORACLE)
        out["oversubscribe"] = {
            "gpus": fit,
            "static_tdp_gpus": o.static_tdp_gpus,
            "uncapped_same_risk_gpus": o.uncapped_fit_gpus("never_over"),
            "uncapped_no_trip_gpus": o.uncapped_fit_gpus("no_trip"),
            "uncapped_never_over_gpus": o.uncapped_fit_gpus("never_over"),
            "oracle_gpus": best,
            "share_of_oracle": _ratio(fit, best) if fit is not None and best else None,
        }
    return out


# -- terminal ------------------------------------------------------------------------------


def _duration(s: float) -> str:
    if s == 0:
        return "0"
    if s < 1:
        return f"{s:.1f} s"
    if s < 3600:
        return f"{s / 60:.0f} min" if s >= 60 else f"{s:.0f} s"
    return f"{s / 3600:.1f} h"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = "  ".join(
        h.ljust(w) if i == 0 else h.rjust(w)
        for i, (h, w) in enumerate(zip(head, widths, strict=True))
    )
    out = [line, "-" * len(line)]
    for r in rows:
        out.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    return out


def header(report: Report) -> list[str]:
    sc, site = report.scenario, report.site
    frac = site.feed_w / site.nameplate_w
    feed = kw_text(site.feed_w) + (f" ({frac:.0%} of nameplate)" if math.isfinite(frac) else "")
    return [
        f"scenario {sc.spec.name} ({sc.source}): {site.n_gpus:,} GPUs on {site.n_nodes} nodes, "
        f"feed {feed}, nameplate {kw_text(site.nameplate_w)}",
        f"  {sc.ticks * sc.spec.tick_s / 3600:g} h in {sc.spec.tick_s:g} s ticks, seed "
        f"{sc.spec.seed}; policy {site.policy.source}",
    ]


def _gain(a: float, b: float) -> str:
    """`a` against `b` as a change (+45%), or as a multiple from 3× up (a baseline that
    tripped and delivered almost nothing is "295× the", not "+29426%")."""
    if not b > 0:
        return "-"
    ratio = a / b
    return f"{ratio:,.0f}× the" if ratio >= 3 else f"{ratio - 1:+.0%}"


def _energy(j: float) -> str:
    kwh = j / 3.6e6
    return f"{kwh / 1000:,.2f} MWh" if kwh >= 1000 else f"{kwh:,.1f} kWh"


def headline_lines(
    results: dict[str, RunResult], base: RunResult, *, searched: bool = False
) -> list[str]:
    """What steering buys under the same feed, against the GPUs that feed holds at TDP."""
    lines = [
        f"under the same {kw_text(base.feed_w)} feed: provisioned at TDP (static), "
        f"{base.n_gpus:,} GPUs deliver {base.mean_throughput:,.1f} GPU-equivalents "
        f"({base.weighted_work_gpu_s / base.duration_s:,.1f} weighted) for "
        f"{_energy(base.facility_energy_j)}",
    ]
    for p, r in results.items():
        if p == STATIC:
            continue
        energy = _gain(r.facility_energy_j, base.facility_energy_j)
        lines.append(
            f"  {p} on {r.n_gpus:,} GPUs: {r.mean_throughput:,.1f} "
            f"({_gain(r.work_gpu_s, base.work_gpu_s)} work, "
            f"{_gain(r.weighted_work_gpu_s, base.weighted_work_gpu_s)} weighted) for "
            f"{_energy(r.facility_energy_j)} ({energy} energy, "
            f"{_gain(r.work_per_facility_joule, base.work_per_facility_joule)} work per "
            "facility joule)"
        )
    if not searched:  # a pointer to the search, not printed beside its answer
        lines.append("  (how many GPUs the feed runs within a loss threshold: --oversubscribe)")
    return lines


def _levels(by_level: dict[str, float]) -> str:
    parts = [f"{lv} {_duration(v)}" for lv, v in by_level.items() if v > 0]
    return f" ({', '.join(parts)})" if parts else ""


def breaker_text(b: Breaker) -> str:
    return (
        f"breakers rated {b.rating:.0%} of each budget: never trip below {b.pickup:.0%} of "
        f"the rating, trip in {_duration(b.trip_s(1.35))} at 135 %, {_duration(b.trip_s(2.0))} "
        f"at 200 %, at once at {b.instant:.0%}; a trip is restored after "
        f"{_duration(b.restore_s)}"
    )


def trips_text(t: Trips) -> str:
    if t.trips == 0:
        return "no trip" if t.exact else "no trip (draw stays below every breaker's pickup)"
    levels = ", ".join(f"{lv} {k}" for lv, k in t.by_level.items() if k)
    first = t.first_trip_s or 0.0
    return (
        f"{t.trips} trip(s) ({levels}), the first after {_duration(first)}; "
        f"{t.down_gpu_s / 3600:,.0f} GPU-h down, {t.lost_work_gpu_s / 3600:,.1f} GPU-h of "
        "work lost"
    )


def baseline_lines(report: Report) -> list[str]:
    """What a site would choose instead, on the same GPUs, and the lead policy against it."""
    lines = [f"baselines on the same {report.site.n_gpus:,} GPUs ({breaker_text(report.breaker)}):"]
    u = report.baselines.get(UNCAPPED)
    if u is not None and u.trips is not None:
        over = _duration(u.over_budget_s)
        lines.append(
            f"  uncapped (no caps at all): over a budget {over}{_levels(u.over_budget_s_by_level)}"
            f", worst {u.max_excess_ratio:.1%} of a budget (+{kw_text(u.max_excess_w)}); "
            f"{trips_text(u.trips)}; delivers {u.mean_throughput:,.1f} ({u.loss():.2%} lost)"
        )
    orc = report.baselines.get(ORACLE)
    if orc is not None:
        lines.append(
            f"  oracle (perfect foresight, re-solved every {orc.step_s:g} s): delivers "
            f"{orc.mean_throughput:,.1f} ({orc.weighted_work_gpu_s / orc.duration_s:,.1f} "
            f"weighted, {orc.loss():.2%} lost), never over a budget: the upper bound"
        )
    return lines


def headline_block(report: Report) -> list[str]:
    """The lead policy in a few lines: against static, against uncapped at the same risk,
    as a share of the oracle (and, with --oversubscribe, the same in GPUs)."""
    lead = report.lead
    if lead is None:
        return []
    r = report.compare[lead]
    t = report.trips(lead)
    trips = "trips not ruled out" if t is None else trips_text(t)
    over = _duration(r.over_budget_s) + " over a budget"
    if r.within_rating:
        over += (
            f" within its rating (longest {_duration(r.longest_over_s)}, worst "
            f"{r.max_excess_ratio:.1%} of a budget)"
        )
    lines = [f"headline: {lead} on {r.n_gpus:,} GPUs, {over}, {trips}"]
    base = report.provisioned
    if base is not None:
        lines.append(
            f"  against static (TDP caps, the {base.n_gpus:,} GPUs the feed holds at nameplate): "
            f"{_gain(r.work_gpu_s, base.work_gpu_s)} work"
        )
    u = report.baselines.get(UNCAPPED)
    if u is not None and u.trips is not None:
        # The same risk as powerd is never over a budget: a draw over it that trips no
        # breaker still runs the feed past what the site committed to (decision 0006).
        same = u.trips.trips == 0 and u.over_budget_s == 0
        risk = "the same risk" if same else "more risk"
        lines.append(
            f"  against uncapped on the same GPUs ({risk}: {trips_text(u.trips)}, "
            f"{_duration(u.over_budget_s)} over a budget, worst {u.max_excess_ratio:.1%}): "
            f"{_gain(r.work_gpu_s, u.work_gpu_s)} work"
        )
        lines += _rating_hint(report, r, u, same=same)
    orc = report.baselines.get(ORACLE)
    if orc is not None and orc.work_gpu_s > 0:
        share = r.weighted_work_gpu_s / orc.weighted_work_gpu_s
        lines.append(
            f"  share of the oracle (perfect foresight): {share:.1%} of its weighted work, "
            f"{r.work_gpu_s / orc.work_gpu_s:.1%} of its work"
        )
    o = report.oversub
    if o is not None:
        fit, best = o.fit_gpus(lead), o.fit_gpus(ORACLE)
        parts = [f"  --oversubscribe at {o.threshold:.1%} loss: {lead} fits {fit or 0:,} GPUs"]
        parts.append(f"static {o.static_tdp_gpus:,}")
        if o.uncapped_fit_nodes:
            parts.append(
                f"uncapped {o.uncapped_fit_gpus('never_over') or 0:,} never over a budget "
                f"(the same risk), {o.uncapped_fit_gpus('no_trip') or 0:,} with no trip but "
                "over a budget (more risk)"
            )
        if best:
            parts.append(f"oracle {best:,} ({lead} = {(fit or 0) / best:.1%} of it)")
        lines.append(", ".join(parts))
    return lines


# Work lost against uncapped never over a budget from which the headline names a rating.
RATING_HINT_LOSS = 0.001


def _rating_hint(report: Report, r: RunResult, u: BaselineResult, *, same: bool) -> list[str]:
    """Where uncapped was never over a budget and the lead still lost work to it under the
    strict rule, the one lever left: caps may commit above the budgets while the draw stays
    below them only with an overload rating (no causal allocator recovers bursts seen a tick
    late: docs/performance.md, "Bursty serving")."""
    rated = any(g.overload is not None for g in report.site.policy.groups)
    if not same or rated or u.work_gpu_s <= 0:
        return []
    if 1.0 - r.work_gpu_s / u.work_gpu_s <= RATING_HINT_LOSS:
        return []
    return [
        f"  uncapped never drew over {u.max_excess_ratio:.1%} of a budget: with a rating "
        "(`overload`, --overload PCT:SECONDS[:TARGET[:RISE]]) caps may commit above the "
        "budgets while the draw stays below them"
    ]


def compare_lines(results: dict[str, RunResult]) -> list[str]:
    static = results.get(STATIC)
    classes = sorted({c for r in results.values() for c in r.work_by_class})
    floored = sorted({c for r in results.values() for c in r.below_floor_share})
    head = ["policy", "throughput", "weighted", "vs unconstrained"]
    head += [f"{c} GPU-h" for c in classes]
    head += ["facility MWh", "GPU-h/GPU-MWh", "over budget", "max draw/budget"]
    head += [f"{c}<floor" for c in floored]
    rows = []
    for p, r in results.items():
        over = _duration(r.over_budget_s)
        if r.over_budget_s:
            levels = [lv for lv, s in r.over_budget_s_by_level.items() if s > 0]
            over += f" ({', '.join(levels)})"
            if r.within_rating:
                over += " within rating"
        row = [
            p,
            f"{r.mean_throughput:,.1f}",
            f"{r.weighted_work_gpu_s / r.duration_s:,.1f}",
            f"{r.work_gpu_s / static.work_gpu_s:.1%}" if static else "-",
        ]
        row += [f"{r.work_by_class.get(c, 0.0) / 3600:,.0f}" for c in classes]
        row += [
            f"{r.facility_energy_j / 3.6e9:,.2f}",
            f"{r.work_gpu_s / 3600 / (r.gpu_energy_j / 3.6e9):,.0f}" if r.gpu_energy_j else "-",
            over,
            f"{r.max_excess_ratio:.1%}",
        ]
        row += [
            f"{r.below_floor_share[c]:.2%}" + ("" if r.floors_fit else " (floors do not fit)")
            if c in r.below_floor_share
            else "-"
            for c in floored
        ]
        rows.append(row)
    lines = _table(head, rows)
    lines.append(
        "throughput: mean GPU-equivalents at full speed; weighted: by class weight (what powerd "
        "maximises); vs unconstrained: against the same GPUs free to draw their TDP (static, "
        "ignoring the budgets); facility MWh: GPUs plus overhead; GPU-h/GPU-MWh: per MWh of GPU "
        "energy alone; over budget: time any budget "
        "was exceeded by measured draw"
    )
    return lines


def ramp_lines(report: Report) -> list[str]:
    """The facility's fastest moves tick to tick (W/s): what a feed sees of each policy."""
    spec = report.scenario.spec
    policy_rates = report.site.policy.control.ramp_w_per_s
    rates = spec.ramp_w_per_s or policy_rates
    limit = (
        "none (windows step)" if rates is None else f"up {rates.up:,.0f}, down {rates.down:,.0f}"
    )
    rows = [
        [
            p,
            f"{r.ramp_w_per_s['committed_up']:,.0f}",
            f"{r.ramp_w_per_s['committed_down']:,.0f}",
            f"{r.ramp_w_per_s['draw_up']:,.0f}",
            f"{r.ramp_w_per_s['draw_down']:,.0f}",
        ]
        for p, r in report.runs.items()
    ]
    head = ["policy", "committed up W/s", "committed down W/s", "draw up W/s", "draw down W/s"]
    lines = [
        f"facility ramp (fastest move over one {spec.tick_s:g} s tick); "
        f"{len(spec.schedule)} scheduled windows, ramp limit {limit}"
    ]
    return lines + _table(head, rows)


def churn_lines(results: dict[str, RunResult]) -> list[str]:
    """Cap moves per tick (controller/churn.py): each is a call on a node and a message."""
    rows = [
        [
            p,
            f"{c['share_moved']:.1%}",
            f"{c['median_move_w']:.0f}",
            f"{c['p95_move_w']:.0f}",
            f"{c['moved_w_per_tick']:,.0f}",
        ]
        for p, r in results.items()
        if (c := r.churn)
    ]
    head = ["policy", "caps moved/tick", "median move W", "p95 move W", "W moved/tick"]
    return ["cap churn after the first minute (every move: a call on a node, a message)"] + (
        _table(head, rows) if rows else []
    )


def sweep_lines(points: list[SweepPoint]) -> list[str]:
    policies = list(points[0].results) if points else []
    head = ["feed", "kW"] + [f"{p}" for p in policies]
    rows = []
    for pt in points:
        row = [f"{pt.fraction:.0%}", f"{pt.feed_w / 1000:,.1f}"]
        for p in policies:
            r = pt.results[p]
            cell = f"{r.mean_throughput:,.1f} / {r.weighted_work_gpu_s / r.duration_s:,.1f}"
            if r.over_budget_s:
                cell += f" OVER {_duration(r.over_budget_s)}"
                if r.within_rating:
                    cell += " within rating"
            row.append(cell)
        rows.append(row)
    lines = ["budget sweep (feed as a share of nameplate; every budget scaled alike):"]
    lines += _table(head, rows)
    lines.append("cells: mean throughput / weighted throughput (GPU-equivalents)")
    return lines


def _loss_cell(pt: OversubPoint, p: str, metric: str) -> str:
    """A size's loss by the search's metric; for a run stopped once it provably failed, the
    least it lost."""
    loss = pt.weighted_loss if metric == "weighted" else pt.loss
    if p not in loss:
        return "-"
    if p in pt.stopped_h:
        return f"≥ {loss[p]:.2%} (stopped at {pt.stopped_h[p]:.1f} h)"
    return f"{loss[p]:.2%}"


def oversub_lines(o: Oversubscription) -> list[str]:
    lines = [
        f"oversubscription under a {kw_text(o.feed_w)} feed, loss threshold {o.threshold:.1%} "
        f"({o.metric} throughput against the same GPUs unconstrained):",
        f"  static TDP provisioning: {o.static_tdp_gpus:,} GPUs "
        f"({o.static_tdp_nodes} nodes of {o.node_nameplate_w / 1000:.1f} kW nameplate); device "
        f"minimums fill the feed at {o.max_nodes * o.gpus_per_node:,} GPUs",
    ]
    for p in o.fit_nodes:
        g = o.fit_gpus(p)
        gain = f" ({g / o.static_tdp_gpus - 1:+.0%} vs static)" if g and o.static_tdp_gpus else ""
        note = " (perfect foresight: the upper bound)" if p == ORACLE else ""
        lines.append(f"  {p}: {g:,} GPUs{gain}{note}" if g else f"  {p}: none")
    risk = {
        "no_trip": "with no breaker trip, over a budget (more risk than powerd)",
        "never_over": "with draw never over a budget (the same risk as powerd)",
    }
    for k, g in ((k, o.uncapped_fit_gpus(k)) for k in o.uncapped_fit_nodes):
        lines.append(f"  uncapped {risk.get(k, k)}: {f'{g:,} GPUs' if g else 'none'}")
    policies = list(o.fit_nodes)
    uncapped = any(UNCAPPED in pt.trips for pt in o.points)
    head = ["GPUs", *(f"{p} loss" for p in policies), "static over budget"]
    head += ["uncapped trips", "uncapped loss"] if uncapped else []
    rows = []
    for pt in o.points:
        row = [
            f"{pt.gpus:,}",
            *(_loss_cell(pt, p, o.metric) for p in policies),
            _duration(pt.over_budget_s.get(STATIC, 0.0)),
        ]
        if uncapped:
            row += [
                str(pt.trips[UNCAPPED]) if UNCAPPED in pt.trips else "-",
                _loss_cell(pt, UNCAPPED, o.metric),
            ]
        rows.append(row)
    return lines + _table(head, rows)


def text(report: Report) -> str:
    lines = header(report)
    head = headline_block(report)
    if head:
        lines += ["", *head]
    if report.compare and report.provisioned is not None:
        searched = report.oversub is not None
        lines += ["", *headline_lines(report.compare, report.provisioned, searched=searched)]
    if report.baselines:
        lines += ["", *baseline_lines(report)]
    if report.compare:
        lines += ["", *compare_lines(report.runs)]
        lines += ["", *ramp_lines(report)]
        if any(r.churn for r in report.compare.values()):
            lines += ["", *churn_lines(report.compare)]
    if report.sweep:
        lines += ["", *sweep_lines(report.sweep)]
    if report.oversub is not None:
        lines += ["", *oversub_lines(report.oversub)]
    runs = ", ".join(f"{p} {r.wall_s:.1f} s" for p, r in report.runs.items())
    lines.append(f"\n(simulated in {report.wall_s:.1f} s" + (f"; runs: {runs})" if runs else ")"))
    return "\n".join(lines)


# -- plots ---------------------------------------------------------------------------------


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_power(results: dict[str, RunResult], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(len(LEVELS), 1, figsize=(10, 9), sharex=True)
    for p, r in results.items():
        s = r.series
        c = COLORS.get(p)
        axes[0].plot(s.t_h, s.facility_draw_w / 1000, label=p, color=c, lw=1)
        for lv in range(1, len(LEVELS)):
            axes[lv].plot(s.t_h, 100 * s.peak_ratio[:, lv], label=p, color=c, lw=1)
    first = next(iter(results.values()))
    if math.isfinite(first.series.facility_budget_w):
        axes[0].axhline(first.series.facility_budget_w / 1000, color="red", ls="--", label="feed")
    axes[0].set_ylabel("facility draw, kW")
    axes[0].set_title("measured draw against budgets")
    axes[0].legend(loc="lower right", fontsize=8, ncol=5)
    for lv in range(1, len(LEVELS)):
        axes[lv].axhline(100, color="red", ls="--")
        axes[lv].set_ylabel(f"hottest {LEVELS[lv]},\n% of budget")
    axes[-1].set_xlabel("hours")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_throughput(results: dict[str, RunResult], path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    for p, r in results.items():
        ax.plot(r.series.t_h, r.series.throughput, label=p, color=COLORS.get(p), lw=1)
    ax.set_xlabel("hours")
    ax.set_ylabel("throughput, GPU-equivalents")
    ax.set_title("delivered throughput over time")
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_pareto(points: list[SweepPoint], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    policies = list(points[0].results)
    for p in policies:
        c = COLORS.get(p)
        feeds = [pt.feed_w / 1000 for pt in points]
        rs = [pt.results[p] for pt in points]
        for ax, values in (
            (axes[0], [r.mean_throughput for r in rs]),
            (axes[1], [r.weighted_work_gpu_s / r.duration_s for r in rs]),
        ):
            ax.plot(feeds, values, "-", color=c, label=p)
            ok = [r.over_budget_s == 0 for r in rs]
            ax.scatter(
                [f for f, g in zip(feeds, ok, strict=True) if g],
                [v for v, g in zip(values, ok, strict=True) if g],
                color=c,
                s=18,
            )
            ax.scatter(
                [f for f, g in zip(feeds, ok, strict=True) if not g],
                [v for v, g in zip(values, ok, strict=True) if not g],
                facecolors="none",
                edgecolors=c,
                s=30,
            )
    axes[0].set_ylabel("throughput, GPU-equivalents")
    axes[1].set_ylabel("weighted throughput")
    for ax in axes:
        ax.set_xlabel("facility feed, kW")
        ax.grid(alpha=0.3)
    axes[0].set_title("throughput vs feed (hollow: budget exceeded)")
    axes[1].set_title("priority-weighted throughput vs feed")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _metric_loss(o: Oversubscription, pt: Any) -> dict[str, float]:
    return dict(pt.weighted_loss if o.metric == "weighted" else pt.loss)


def plot_oversub(o: Oversubscription, path: Path) -> None:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    for p in o.fit_nodes:
        pts = [pt for pt in o.points if p in pt.loss]
        values = [pt.weighted_loss[p] if o.metric == "weighted" else pt.loss[p] for pt in pts]
        ax.plot(
            [pt.gpus for pt in pts],
            [100 * v for v in values],
            "o-",
            ms=3,
            color=COLORS.get(p),
            label=p,
        )
        # Runs stopped once they failed: the least they lost, a bound from below.
        low = [pt for pt in pts if p in pt.stopped_h]
        if low:
            ax.plot(
                [pt.gpus for pt in low],
                [100 * _metric_loss(o, pt)[p] for pt in low],
                "^",
                ms=6,
                color=COLORS.get(p),
                label=f"{p}: at least (run stopped)",
            )
    pts = [pt for pt in o.points if UNCAPPED in pt.loss]
    if pts:
        ax.plot(
            [pt.gpus for pt in pts],
            [
                100 * (pt.weighted_loss if o.metric == "weighted" else pt.loss)[UNCAPPED]
                for pt in pts
            ],
            "x--",
            ms=4,
            color=COLORS[UNCAPPED],
            label="uncapped (work lost to trips)",
        )
    for k, ls in (("no_trip", "-."), ("never_over", ":")):
        g = o.uncapped_fit_gpus(k)
        if g:
            ax.axvline(g, color=COLORS[UNCAPPED], ls=ls, label=f"uncapped, {k.replace('_', ' ')}")
    ax.axhline(100 * o.threshold, color="red", ls="--", label=f"{o.threshold:.0%} loss")
    ax.axvline(o.static_tdp_gpus, color=COLORS["static"], ls=":", label="static TDP provisioning")
    ax.set_xlabel(f"GPUs under a {o.feed_w / 1000:,.0f} kW feed")
    ax.set_ylabel(f"{o.metric} throughput loss, %")
    ax.set_title("how many GPUs fit the feed")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_outputs(report: Report, out_dir: Path) -> list[Path]:
    """PNG plots and report.html (images embedded) into out_dir; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    images: list[tuple[str, Path]] = []
    if report.compare:
        images.append(("Power against budgets", out_dir / "power.png"))
        plot_power(report.runs, images[-1][1])
        images.append(("Throughput over time", out_dir / "throughput.png"))
        plot_throughput(report.runs, images[-1][1])
    if report.sweep:
        images.append(("Pareto: throughput vs feed", out_dir / "pareto.png"))
        plot_pareto(report.sweep, images[-1][1])
    if report.oversub is not None and report.oversub.points:
        images.append(("Oversubscription", out_dir / "oversubscription.png"))
        plot_oversub(report.oversub, images[-1][1])
    page = out_dir / "report.html"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>powerd sim: {html.escape(report.scenario.spec.name)}</title>",
        "<style>body{font-family:sans-serif;max-width:1100px;margin:2em auto}"
        "pre{background:#f6f6f6;padding:1em;overflow-x:auto;font-size:12px}</style>",
        "</head><body>",
        f"<h1>powerd sim: {html.escape(report.scenario.spec.name)}</h1>",
        f"<p>{html.escape(report.scenario.spec.description)}</p>",
        f"<pre>{html.escape(text(report))}</pre>",
    ]
    for title, img in images:
        data = base64.b64encode(img.read_bytes()).decode("ascii")
        parts.append(f"<h2>{html.escape(title)}</h2>")
        parts.append(f"<img alt='{html.escape(title)}' src='data:image/png;base64,{data}'>")
    parts.append("</body></html>")
    page.write_text("\n".join(parts), encoding="utf-8")
    return [img for _, img in images] + [page]
