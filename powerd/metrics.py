"""Prometheus metrics for the controller, on a registry the caller owns.

Per-GPU series follow NVIDIA dcgm-exporter where it has a field for the quantity (same
metric names, same `gpu`/`UUID`/`device`/`modelName`/`Hostname` labels), so existing GPU
dashboards work on powerd's numbers; what only powerd knows is `powerd_*`. The families are
named in powerd/node_metrics.py, which also holds the agent's metrics (no numpy there: the
agent's install carries none).

Cost model: the controller calls `update_*` once per tick with the arrays it already holds.
An update only stores them (numeric arrays copied: cheap next to the tick; bench/scrape.py
times it, docs/performance.md); samples are built when Prometheus scrapes, every 15-60 s,
not every tick. Serve `/metrics` from a thread (the API does) so a scrape of a large fleet
never stalls the event loop.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray
from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from powerd.backends.base import throttle_mask
from powerd.controller.meters import MeterView
from powerd.node_metrics import (
    CLOCK_EVENTS,
    COMMITTED,
    ENERGY,
    ENFORCED,
    OVERRIDDEN,
    POWER,
    RESTORES,
    TARGET,
    TEMP,
    GpuFamily,
    counter,
    family,
    gauges,
    gpu_labels,
    scalar,
)
from powerd.wire import CAP_TOLERANCE_W

FloatArray = NDArray[np.float64]
# Ticks run at ~1 s with a 250 ms target at 10k GPUs: resolve the fast end finely.
TICK_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def _array(values: ArrayLike, n: int, what: str) -> FloatArray:
    a = np.array(values, dtype=np.float64)  # a copy: the caller may reuse its buffers
    if a.shape != (n,):
        raise ValueError(f"{what}: expected {n} values, got shape {a.shape}")
    return a


@dataclass(frozen=True)
class Rows:
    """Label sets of a family's rows (GPUs, groups), also pre-rendered as exposition text.

    Rendering labels is most of a scrape's cost (prometheus-client escapes and sorts each
    label of each sample); rows change rarely, so their text is built once and reused.
    """

    labels: list[dict[str, str]]
    text: list[str]

    @classmethod
    def of(cls, labels: list[dict[str, str]]) -> Rows:
        return cls(labels, [_label_text(lb) for lb in labels])


def _label_text(labels: Mapping[str, str]) -> str:
    inner = ",".join(f'{k}="{_escape(labels[k])}"' for k in sorted(labels))
    return "{" + inner + "}" if inner else ""


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _go_float(v: float) -> str:
    # The text format's spelling (what prometheus-client's floatToGoString writes).
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


class RowFamily(Metric):
    """A family with one sample per row, NaN rows left out. `text()` renders it fast;
    `samples` is built only for consumers that read it (prometheus-client's own exposition,
    e.g. the agent's HTTP server), so the controller's scrape never pays for it."""

    def __init__(
        self, name: str, doc: str, typ: str, rows: Rows, values: FloatArray, *, sample: str
    ) -> None:
        super().__init__(name, doc, typ)
        del self.samples  # see __getattr__
        self._sample = sample
        self._rows = rows
        self._values = values

    def __getattr__(self, attr: str) -> Any:
        if attr != "samples":
            raise AttributeError(attr)
        samples = [
            Sample(self._sample, lb, v)
            for lb, v in zip(self._rows.labels, self._values.tolist(), strict=True)
            if not math.isnan(v)
        ]
        self.samples = samples
        return samples

    def text(self) -> str:
        name = self.name + "_total" if self.type == "counter" else self.name
        doc = self.documentation.replace("\\", "\\\\").replace("\n", "\\n")
        head = f"# HELP {name} {doc}\n# TYPE {name} {self.type}\n"
        values, texts = self._values, self._rows.text
        finite = np.isfinite(values)
        if not finite.all():  # rare (unbudgeted groups, missing readings): the slow path
            keep = ~np.isnan(values)
            texts = [t for t, k in zip(texts, keep.tolist(), strict=True) if k]
            values = values[keep]
            shown = [_go_float(v) for v in values.tolist()]
        else:
            shown = _shown(values)
        prefix = self._sample
        return head + "".join([f"{prefix}{t} {v}\n" for t, v in zip(texts, shown, strict=True)])


def _shown(values: FloatArray) -> list[str]:
    """Finite values as text. Integral ones (energy in mJ, temperatures, bitmasks, most caps)
    print as integers, which is much cheaper than repr(); float repr dominates a large scrape
    (bench/scrape.py; docs/performance.md)."""
    whole = np.rint(values)
    if np.all(np.abs(whole) < 2.0**53) and np.array_equal(whole, values):
        return [str(i) for i in whole.astype(np.int64).tolist()]
    return [repr(v) for v in values.tolist()]


def exposition(registry: Collector) -> bytes:
    """The text format of everything in `registry`, as `generate_latest` writes it but with
    row families rendered from their cached label text: a fleet's label text is built once,
    not per sample per scrape (bench/scrape.py measures both; docs/performance.md)."""
    out: list[bytes] = []
    for metric in registry.collect():
        if isinstance(metric, RowFamily):
            out.append(metric.text().encode())
        else:
            out.append(generate_latest(_One(metric)))
    return b"".join(out)


class _One(Collector):
    def __init__(self, metric: Metric) -> None:
        self.metric = metric

    def collect(self) -> Iterable[Metric]:
        return [self.metric]


@dataclass(frozen=True)
class GpuSnapshot:
    """One tick's (or sample's) per-GPU values, in one order (the fleet's); replaced whole,
    so a scrape in another thread sees one tick. NaN: no value (the row is left out). The
    arrays are copied: the caller may reuse its buffers."""

    uuids: Sequence[str]
    nodes: Sequence[str]
    index: NDArray[np.int64]
    power_w: FloatArray
    cap_w: FloatArray  # the limit the GPU reports in force (read back from the device)
    energy_j: FloatArray
    temp_c: FloatArray
    models: Sequence[str] | None = None
    throttle: Sequence[Sequence[str]] | None = None
    committed_w: FloatArray | None = None  # controller: the committed cap (docs/safety.md)
    target_w: FloatArray | None = None  # controller: this tick's allocation
    # The limit the GPU's agent last set (NaN: none known): `powerd_gpu_cap_overridden`.
    set_w: FloatArray | None = None
    # Per GPU: limits found above set_w and set back by its agent (the agent's count, which
    # starts again when it restarts). Read when Prometheus scrapes (a live view of records).
    restores: Sequence[float] | None = None
    _rows: list[Rows] = field(default_factory=list, repr=False)  # built on first scrape

    def __post_init__(self) -> None:
        n = len(self.uuids)
        if len(self.nodes) != n or (self.models is not None and len(self.models) != n):
            raise ValueError("uuids, nodes and models must have the same length")
        if self.throttle is not None and len(self.throttle) != n:
            raise ValueError("throttle must have one entry per GPU")
        set_ = object.__setattr__
        set_(self, "index", np.array(self.index, dtype=np.int64))
        if self.restores is not None and len(self.restores) != n:
            raise ValueError("restores must have one entry per GPU")
        names = ("power_w", "cap_w", "energy_j", "temp_c", "committed_w", "target_w", "set_w")
        for name in names:
            value = getattr(self, name)
            if value is not None:
                set_(self, name, _array(value, n, name))

    def rows(self) -> Rows:
        if not self._rows:
            models = self.models or [""] * len(self.uuids)
            self._rows.append(
                Rows.of(
                    [
                        gpu_labels(i, u, m, n)
                        for u, n, i, m in zip(
                            self.uuids, self.nodes, self.index.tolist(), models, strict=True
                        )
                    ]
                )
            )
        return self._rows[0]


def _gauge_rows(name: str, doc: str, rows: Rows, values: FloatArray) -> RowFamily:
    return RowFamily(name, doc, "gauge", rows, values, sample=name)


class GpuCollector(Collector):
    """Per-GPU series, built at scrape time from the latest snapshot."""

    def __init__(self) -> None:
        self._snap: GpuSnapshot | None = None

    def update(self, snap: GpuSnapshot) -> None:
        prev = self._snap
        # The fleet's GPU list is the same object from tick to tick until a GPU comes or
        # goes (FleetState caches it): keep the rows rendered for it.
        if (
            prev is not None
            and prev.uuids is snap.uuids
            and prev.nodes is snap.nodes
            and prev.models is snap.models
            and prev._rows
            and np.array_equal(prev.index, snap.index)
        ):
            snap._rows.extend(prev._rows)
        self._snap = snap

    def collect(self) -> Iterator[Metric]:
        s = self._snap
        if s is None:
            return
        labels = s.rows()
        yield _rows(POWER, labels, s.power_w)
        yield _rows(ENFORCED, labels, s.cap_w)
        yield _rows(ENERGY, labels, s.energy_j * 1000.0)
        yield _rows(TEMP, labels, s.temp_c)
        if s.throttle is not None:
            masks = np.array([throttle_mask(t) for t in s.throttle], dtype=np.float64)
            yield _rows(CLOCK_EVENTS, labels, masks)
        if s.committed_w is not None:
            yield _rows(COMMITTED, labels, s.committed_w)
        if s.target_w is not None:
            yield _rows(TARGET, labels, s.target_w)
        if s.set_w is not None:
            with np.errstate(invalid="ignore"):
                differs = np.abs(s.cap_w - s.set_w) > CAP_TOLERANCE_W
            yield _rows(
                OVERRIDDEN, labels, np.where(np.isnan(s.set_w), np.nan, differs.astype(np.float64))
            )
        if s.restores is not None:
            yield _rows(RESTORES, labels, np.array(list(s.restores), dtype=np.float64))


def _rows(f: GpuFamily, labels: Rows, values: FloatArray) -> RowFamily:
    return RowFamily(f.name, f.doc, f.typ, labels, values, sample=f.sample)


METER_GAUGES = {
    "powerd_group_meter_watts": "A metered group's last meter reading (in W).",
    "powerd_group_meter_age_seconds": "Age of that reading on the controller's clock (in s).",
    "powerd_group_meter_fresh": "1 while the reading is fresh (the overload rule uses it), 0 not.",
    "powerd_group_meter_gap_watts": "Meter minus the nodes' draw plus overhead (in W).",
    "powerd_group_overhead_learned_watts": "Overhead learned: meter minus GPUs' draw (in W).",
    "powerd_group_overhead_error_watts": "Spread (RMS) of the learned overhead (in W).",
    "powerd_group_overhead_unseen_watts": "Learned overhead beyond the policy's: the limit "
    "is that much lower (in W).",
}


class _Families(Collector):
    """Controller-wide series from plain values the controller hands over each tick."""

    def __init__(self) -> None:
        self.groups: tuple[Rows, FloatArray, FloatArray, FloatArray] | None = None
        self.received: Mapping[str, float] = {}
        self.dropped: Mapping[str, float] = {}
        self.caps_sent = 0.0
        self.acks = 0.0
        self.ack_ticks = 0.0
        self.ticks: dict[str, float] = {}
        self.solver_status = ""
        self.statuses: set[str] = set()
        self.last_tick_ts: float | None = None
        self.unused_w: float | None = None
        # Churn (controller/churn.py), summed over ticks: caps moved, W moved, cuts held.
        self.caps_moved = 0.0
        self.moved_w = 0.0
        self.caps_held = 0.0
        self.raises_starved = 0.0  # the last tick's (a gauge)
        self.throughput: Mapping[str, float] = {}
        self.gpus: Mapping[str, float] = {}
        self.nodes: Mapping[str, float] = {}
        self.alarms_active: Mapping[str, float] = {}
        self.alarms_raised: dict[str, float] = {}
        self.leadership: Leadership | None = None
        # Online learning, per class: samples in the window, learned curve in use, fit error.
        self.learn_samples: Mapping[str, float] = {}
        self.learn_in_use: Mapping[str, float] = {}
        self.learn_error: Mapping[str, float] = {}
        # Metered groups (controller/meters.py), per group: gauges by name, and answers
        # rejected.
        self.meters: Mapping[str, Mapping[str, float]] = {}
        self.meter_rejected: Mapping[str, float] = {}

    def collect(self) -> Iterator[Metric]:
        for name, doc in METER_GAUGES.items():
            values = self.meters.get(name)
            if values:
                yield gauges(name, doc, "group", values)
        if self.meter_rejected:
            yield counter(
                "powerd_meter_rejected",
                "Meter answers rejected (not a number, negative, absurd, malformed), per group.",
                "group",
                self.meter_rejected,
            )
        if self.learn_samples:
            yield gauges(
                "powerd_learn_samples",
                "Perf samples within the learning window, per class.",
                "class",
                self.learn_samples,
            )
            yield gauges(
                "powerd_learn_in_use",
                "1 while the class is steered by its learned curve, 0 by the policy's.",
                "class",
                self.learn_in_use,
            )
            yield gauges(
                "powerd_learn_fit_error",
                "RMS gap of the last fit to its envelope, share of its peak (NaN: none).",
                "class",
                self.learn_error,
            )
        if self.leadership is not None:
            yield from self.leadership.families()
        if self.groups is not None:
            labels, budget, committed, draw = self.groups
            yield _gauge_rows(
                "powerd_group_budget_watts",
                "Budget in force per group (policy or temporary, the lower; +Inf: none) (in W).",
                labels,
                budget,
            )
            yield _gauge_rows(
                "powerd_group_committed_watts",
                "Sum of committed caps plus overhead per group: the most it may draw (in W).",
                labels,
                committed,
            )
            yield _gauge_rows(
                "powerd_group_draw_watts", "Measured draw per group (in W).", labels, draw
            )
        yield counter(
            "powerd_messages_received", "MQTT messages received, by kind.", "kind", self.received
        )
        yield counter(
            "powerd_messages_dropped",
            "Messages dropped (malformed, oversized, mismatched, stale...), by reason.",
            "reason",
            self.dropped,
        )
        yield scalar("powerd_caps_sent", "Per-GPU caps sent to agents.", "counter", self.caps_sent)
        yield scalar("powerd_acks_received", "Cap acknowledgements received.", "counter", self.acks)
        yield scalar(
            "powerd_caps_moved",
            "GPUs whose cap a tick moved (more than 0.5 W), summed over ticks.",
            "counter",
            self.caps_moved,
        )
        yield scalar(
            "powerd_cap_moved_watts",
            "Size of those moves, summed over ticks (in W).",
            "counter",
            self.moved_w,
        )
        yield scalar(
            "powerd_caps_held",
            "Moves the deadband held at the cap in force (control.deadband_w and"
            " raise_deadband_w), summed over ticks.",
            "counter",
            self.caps_held,
        )
        yield scalar(
            "powerd_raises_starved",
            "GPUs pressing on their cap whose raise the deadband's held cuts have trimmed at"
            " every tick for at least 60 s, as of the last tick (control.fund_pressed_w"
            " funds them where the draw leaves control.fund_room_pct of the budget).",
            "gauge",
            self.raises_starved,
        )
        yield counter("powerd_ticks", "Controller ticks, by solver status.", "status", self.ticks)
        yield scalar(
            "powerd_ack_ticks",
            "Of the ticks, the extra ones run on the acks of a tick that held raises back"
            " (control.ack_ticks).",
            "counter",
            self.ack_ticks,
        )
        yield family(
            "powerd_solver_status",
            "1 for the last tick's solver status, 0 for the others seen.",
            "gauge",
            "powerd_solver_status",
            (({"status": s}, float(s == self.solver_status)) for s in sorted(self.statuses)),
        )
        if self.last_tick_ts is not None:
            yield scalar(
                "powerd_last_tick_timestamp_seconds",
                "Wall time the last tick ended.",
                "gauge",
                self.last_tick_ts,
            )
        if self.unused_w is not None:
            yield scalar(
                "powerd_unused_watts",
                "Room in the root's budget the last allocation left to nobody: power no GPU "
                "could use (in W; 0 when the root has no budget).",
                "gauge",
                self.unused_w,
            )
        yield gauges(
            "powerd_throughput",
            "Weighted useful work per class (profile units).",
            "class",
            self.throughput,
        )
        yield gauges("powerd_gpus", "GPUs known to the controller, by state.", "state", self.gpus)
        yield gauges("powerd_nodes", "Nodes in the policy, by state.", "state", self.nodes)
        yield gauges(
            "powerd_alarms_active",
            "Alarms raised and not cleared, by kind.",
            "kind",
            self.alarms_active,
        )
        yield counter("powerd_alarms", "Alarms raised, by kind.", "kind", self.alarms_raised)


@dataclass(frozen=True)
class Leadership:
    """A scope's leadership as one controller sees it (docs/operations.md, "A standby pair")."""

    scope: str
    controller_id: str
    leading: bool
    epoch: int
    leader: str | None
    standbys: int
    takeovers: int
    stepped_down: int
    fenced: int  # commands the agents refused for a lower epoch (their statuses' sum)
    withheld: int  # commands this controller did not send: its lease ran out first

    def families(self) -> Iterator[Metric]:
        scope = {"scope": self.scope}
        yield family(
            "powerd_leader",
            "1 while this controller leads its scope (commands), 0 while it stands by.",
            "gauge",
            "powerd_leader",
            [(scope | {"controller": self.controller_id}, float(self.leading))],
        )
        yield family(
            "powerd_leader_epoch",
            "The epoch of the scope's leader (a fencing token: agents refuse lower ones).",
            "gauge",
            "powerd_leader_epoch",
            [(scope | {"leader": self.leader or ""}, float(self.epoch))],
        )
        rows: list[tuple[str, str, float, str]] = [
            ("powerd_standbys", "Controllers standing by for the scope.", self.standbys, "gauge"),
            ("powerd_takeovers", "Times this controller began to lead.", self.takeovers, "counter"),
            (
                "powerd_leadership_lost",
                "Times this controller stopped leading (lease lost or not renewed in time).",
                self.stepped_down,
                "counter",
            ),
            (
                "powerd_fenced_commands",
                "Commands the scope's agents refused for a lower epoch (their statuses' sum).",
                self.fenced,
                "gauge",
            ),
            (
                "powerd_commands_withheld",
                "Commands planned but not sent: the lease ran out before they were.",
                self.withheld,
                "counter",
            ),
        ]
        for name, doc, value, typ in rows:
            yield family(
                name, doc, typ, name + "_total" if typ == "counter" else name, [(scope, value)]
            )


class ControllerMetrics:
    """Everything the controller exports. Register once on a registry, update per tick."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.gpus = GpuCollector()
        self._f = _Families()
        self._lock = threading.Lock()
        self._group_rows: tuple[tuple[list[str], list[str]], Rows] | None = None
        registry.register(self.gpus)
        registry.register(self._f)
        self.tick_seconds = Histogram(
            "powerd_tick_duration_seconds",
            "From the tick's start to its last cap published.",
            buckets=TICK_BUCKETS,
            registry=registry,
        )
        self.solve_seconds = Histogram(
            "powerd_solve_duration_seconds",
            "Allocator time per tick.",
            buckets=TICK_BUCKETS,
            registry=registry,
        )

    def update_gpus(self, snap: GpuSnapshot) -> None:
        """Per-GPU values of this tick."""
        self.gpus.update(snap)

    def update_groups(
        self,
        *,
        names: Sequence[str],
        levels: Sequence[str],
        budget_w: ArrayLike,
        committed_w: ArrayLike,
        draw_w: ArrayLike,
    ) -> None:
        """Every budgeted group of the tree (facility, rows, racks, nodes), in any order."""
        n = len(names)
        if len(levels) != n:
            raise ValueError("names and levels must have the same length")
        key = (list(names), list(levels))
        rows = self._group_rows
        if rows is None or rows[0] != key:  # the tree changes only with the policy
            labels = [{"group": g, "level": lv} for g, lv in zip(names, levels, strict=True)]
            rows = self._group_rows = (key, Rows.of(labels))
        self._f.groups = (
            rows[1],
            _array(budget_w, n, "budget_w"),
            _array(committed_w, n, "committed_w"),
            _array(draw_w, n, "draw_w"),
        )

    def update_meters(
        self, views: Sequence[MeterView], rejected: Mapping[tuple[str, str], int]
    ) -> None:
        """The metered groups' readings and learned overheads (controller/meters.py's
        `MeterView`s), and the answers rejected by (group, reason)."""
        out: dict[str, dict[str, float]] = {name: {} for name in METER_GAUGES}
        for v in views:
            fields = {
                "powerd_group_meter_watts": v.reading_w,
                "powerd_group_meter_age_seconds": v.age_s,
                "powerd_group_meter_fresh": 1.0 if v.state == "fresh" else 0.0,
                "powerd_group_meter_gap_watts": v.gap_w,
                "powerd_group_overhead_learned_watts": v.overhead_learned_w,
                "powerd_group_overhead_error_watts": v.overhead_error_w,
                "powerd_group_overhead_unseen_watts": v.overhead_unseen_w,
            }
            for name, value in fields.items():
                if value is not None:
                    out[name][v.group] = float(value)
        by_group: dict[str, float] = {}
        for (group, _reason), n in rejected.items():
            by_group[group] = by_group.get(group, 0.0) + n
        self._f.meters = out
        self._f.meter_rejected = by_group

    def observe_tick(
        self,
        *,
        duration_s: float,
        solve_s: float,
        status: str,
        ts: float,
        throughput: Mapping[str, float] | None = None,
        unused_w: float | None = None,
        churn: tuple[int, float, int] = (0, 0.0, 0),
        starved: int = 0,
    ) -> None:
        """`churn`: the tick's (caps moved, W moved, cuts held)."""
        self.tick_seconds.observe(duration_s)
        self.solve_seconds.observe(solve_s)
        with self._lock:
            self._f.ticks[status] = self._f.ticks.get(status, 0.0) + 1
            self._f.statuses.add(status)
            self._f.solver_status = status
            self._f.last_tick_ts = ts
            if throughput is not None:
                self._f.throughput = dict(throughput)
            if unused_w is not None:
                self._f.unused_w = unused_w
            self._f.caps_moved += churn[0]
            self._f.moved_w += churn[1]
            self._f.caps_held += churn[2]
            self._f.raises_starved = float(starved)

    def update_counters(
        self,
        *,
        received: Mapping[str, float],
        dropped: Mapping[str, float],
        caps_sent: float,
        acks: float,
        ack_ticks: float = 0.0,
    ) -> None:
        """The controller's own cumulative counts (never reset while it runs)."""
        self._f.received = dict(received)
        self._f.dropped = dict(dropped)
        self._f.caps_sent = caps_sent
        self._f.acks = acks
        self._f.ack_ticks = ack_ticks

    def update_fleet(self, *, gpus: Mapping[str, float], nodes: Mapping[str, float]) -> None:
        """Counts by state, e.g. gpus={"fresh": 9990, "stale": 10}, nodes={"steered": ...}."""
        self._f.gpus = dict(gpus)
        self._f.nodes = dict(nodes)

    def update_learning(
        self,
        *,
        samples: Mapping[str, float],
        in_use: Mapping[str, float],
        fit_error: Mapping[str, float],
    ) -> None:
        """Online learning per class (docs/allocator.md, "Profiles learned online")."""
        self._f.learn_samples = dict(samples)
        self._f.learn_in_use = dict(in_use)
        self._f.learn_error = dict(fit_error)

    def alarm_raised(self, kind: str) -> None:
        with self._lock:
            self._f.alarms_raised[kind] = self._f.alarms_raised.get(kind, 0.0) + 1

    def set_active_alarms(self, active: Mapping[str, float]) -> None:
        self._f.alarms_active = dict(active)

    @property
    def active_alarms(self) -> Mapping[str, float]:
        return self._f.alarms_active

    def update_leadership(self, leadership: Leadership) -> None:
        """Who leads the scope, its epoch, the standbys, takeovers and fenced commands."""
        self._f.leadership = leadership
