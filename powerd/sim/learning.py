"""How fast online learning recovers from wrong profiles: three runs of one scenario.

- `off`: the allocator steers by the policy's class profiles (which may be wrong);
- `on`: it steers by curves learned online from the GPUs' perf (TickEngine's rule,
  powerd/allocator/learn.py), starting from the policy's;
- `best`: it steers by the workloads' true curves (each class's first workload's `profile`),
  the best steering this allocator can do on the scenario.

The GPUs deliver, and report as perf, throughput from their true curves in all three. The
figure of merit is weighted throughput (what powerd maximises), compared over a trailing
window; "recovered" is the first time from which `on` stays at or above `threshold` of `best`
to the end. See docs/simulator.md, "Learning profiles".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerd.profile import Profile
from powerd.sim.run import simulate
from powerd.sim.scenario import HOUR_S, Scenario
from powerd.sim.site import Mix, Site, workload_profile

FloatArray = NDArray[np.float64]
RUNS = ("off", "on", "best")
DEFAULT_THRESHOLD = 0.95
DEFAULT_WINDOW_H = 0.5


@dataclass(frozen=True)
class LearningStudy:
    scenario: str
    tick_s: float
    t_h: FloatArray  # end of each tick
    weighted: dict[str, FloatArray]  # per run: weighted throughput per tick
    window_h: float
    threshold: float
    # Per run: time any budget was exceeded by measured draw, and ticks whose committed
    # caps were above one (both must stay 0: learning never bends a bound).
    over_budget_s: dict[str, float]
    committed_over_ticks: dict[str, int]

    def _trailing(self, x: FloatArray) -> FloatArray:
        k = max(1, round(self.window_h * HOUR_S / self.tick_s))
        c = np.concatenate([[0.0], np.cumsum(x)])
        out = np.empty_like(x)
        idx = np.arange(x.size)
        lo = np.maximum(idx + 1 - k, 0)
        out[:] = (c[idx + 1] - c[lo]) / (idx + 1 - lo)
        return out

    def ratio(self, run: str) -> FloatArray:
        """`run`'s trailing-window weighted throughput as a share of `best`'s."""
        best = self._trailing(self.weighted["best"])
        mine = self._trailing(self.weighted[run])
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.where(best > 0, mine / best, 1.0)

    def recovered_h(self, run: str = "on") -> float | None:
        """The first time from which `run` stays at or above the threshold to the end."""
        below = np.flatnonzero(self.ratio(run) < self.threshold)
        if below.size == 0:
            return 0.0
        last = int(below[-1])
        return None if last + 1 >= self.t_h.size else float(self.t_h[last])

    def totals(self) -> dict[str, float]:
        """Weighted work over the whole run, as a share of `best`'s."""
        best = float(self.weighted["best"].sum())
        return {r: float(self.weighted[r].sum()) / best for r in RUNS}

    def to_json(self) -> dict[str, Any]:
        return {
            "scenario": self.scenario,
            "tick_s": self.tick_s,
            "window_h": self.window_h,
            "threshold": self.threshold,
            "recovered_h": {"on": self.recovered_h("on"), "off": self.recovered_h("off")},
            "time_below": {
                r: float(np.mean(self.ratio(r) < self.threshold)) for r in ("off", "on")
            },
            "share_of_best": self.totals(),
            "over_budget_s": self.over_budget_s,
            "committed_over_ticks": self.committed_over_ticks,
            "series": {
                "t_h": self.t_h.tolist(),
                **{f"weighted_{r}": self.weighted[r].tolist() for r in RUNS},
                "ratio_on": self.ratio("on").tolist(),
                "ratio_off": self.ratio("off").tolist(),
            },
        }

    def lines(self) -> list[str]:
        tot = self.totals()
        out = [
            f"learning study: {self.scenario} ({self.t_h[-1]:g} h simulated, ticks of "
            f"{self.tick_s:g} s; ratios over a trailing {self.window_h:g} h)",
            f"  weighted work, share of steering by the true curves: learning off "
            f"{tot['off']:.3f}, learning on {tot['on']:.3f}",
        ]
        for run in ("off", "on"):
            ratio = self.ratio(run)
            at = self.recovered_h(run)
            when = "never" if at is None else f"from {at:g} h on"
            out.append(
                f"  learning {run:>3}: below {self.threshold:.0%} of best "
                f"{float(np.mean(ratio < self.threshold)):.0%} of the time (worst window "
                f"{float(ratio.min()):.3f}); at or above it {when} to the end"
            )
        return out


def true_profiles(scenario: Scenario, site: Site) -> dict[str, Profile]:
    """Each class's true curve: that of its first workload in the scenario."""
    out: dict[str, Profile] = {}
    for w in scenario.spec.workloads:
        out.setdefault(w.class_, workload_profile(w, site.policy))
    return out


def learning_study(
    scenario: Scenario,
    site: Site,
    mix: Mix,
    *,
    window_h: float = DEFAULT_WINDOW_H,
    threshold: float = DEFAULT_THRESHOLD,
) -> LearningStudy:
    runs = {
        "off": simulate(scenario, site, mix, "fast"),
        "on": simulate(scenario, site, mix, "fast", learn=True),
        "best": simulate(scenario, site, mix, "fast", profiles=true_profiles(scenario, site)),
    }
    return LearningStudy(
        scenario=scenario.spec.name,
        tick_s=scenario.spec.tick_s,
        t_h=runs["best"].series.t_h,
        weighted={r: res.series.weighted_throughput for r, res in runs.items()},
        window_h=window_h,
        threshold=threshold,
        over_budget_s={r: res.over_budget_s for r, res in runs.items()},
        committed_over_ticks={r: res.committed_over_ticks for r, res in runs.items()},
    )


def plot_learning(study: LearningStudy, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    colors = {"off": "tab:red", "on": "tab:blue", "best": "black"}
    labels = {
        "off": "policy profiles (learning off)",
        "on": "learning on",
        "best": "true profiles",
    }
    for r in RUNS:
        top.plot(
            study.t_h, study._trailing(study.weighted[r]), color=colors[r], lw=1, label=labels[r]
        )
    top.set_ylabel("weighted throughput")
    top.set_title(f"{study.scenario}: trailing {study.window_h:g} h mean")
    top.legend(fontsize=8)
    for r in ("off", "on"):
        bottom.plot(study.t_h, study.ratio(r), color=colors[r], lw=1, label=labels[r])
    bottom.axhline(study.threshold, color="grey", ls="--", label=f"{study.threshold:.0%}")
    bottom.set_ylabel("share of true-profile run")
    bottom.set_xlabel("hours")
    bottom.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
