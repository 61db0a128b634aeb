"""Metered groups: what a group's meter last read, and what the tick makes of it
(docs/operations.md, "Metered groups"; docs/safety.md, "Overload").

A meter's answer is untrusted input. `redfish_watts` and `prometheus_watts` turn a
document into watts or a `MeterRejected` with the reason, and never raise anything else.
The reader (controller/meter_reader.py) polls each meter off the tick and hands each
reading, stamped with the controller's own monotonic arrival time, to a `MeterBook`; the
tick reads the latest (`MeterStage.see`) and never waits for a meter.

Per metered group the tick gets a `MeteredDraw`: whether the reading is fresh, its value
and which reading it is (the overload's room is lent once per reading). It also learns
the group's overhead (meter − Σ GPUs' reported draw, smoothed, with its spread) and keeps
three alarms: `meter_stale` (no fresh reading: the group steers on its strict budget),
`meter_disagrees` (|meter − (nodes + overhead)| beyond the policy's bound for
`disagree_for_s`) and `meter_overhead` (the learned overhead above the policy's
`overhead_w` by more than the bound). Nothing here does I/O.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from powerd.alarms import Alarms
from powerd.policy import MAX_METER_W, MeterSpec, Policy
from powerd.topology import Topology

FloatArray = NDArray[np.float64]
BoolArray = NDArray[np.bool_]
IntArray = NDArray[np.int64]

# The learned overhead follows each new reading by this share (an exponential average over
# about 1/ALPHA readings), and its spread (the RMS of the residuals around it) alike.
OVERHEAD_ALPHA = 0.2
# Readings it needs before its alarm may sound.
OVERHEAD_MIN_READINGS = 5
MAX_ERROR_CHARS = 200
# The overhead a meter sees beyond the policy's moves a group's limit in steps of at least
# this (or half a percent of its budget), and back down only by more than one and a half
# steps: the meter's noise moves no cap.
UNSEEN_STEP_W = 50.0
# ... and by at most this share of its budget: a meter that sees more than that unexplained
# measures something else (a wrong outlet, scale or series), which `meter_disagrees` says;
# it must not floor the group.
UNSEEN_MAX_SHARE = 0.1


class MeterRejected(Exception):
    """A meter's answer that is no reading: `reason` says why (a short, fixed word set:
    the counters' label) and the message the details."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)


def bounded_watts(value: Any, max_w: float = MAX_METER_W) -> float:
    """A number of watts in [0, max_w], or MeterRejected."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise MeterRejected("not_a_number", f"reading {str(value)[:40]!r} is not a number")
    if isinstance(value, str):
        if len(value) > 40:
            raise MeterRejected("not_a_number", "reading is a string too long for a number")
        try:
            value = float(value)
        except ValueError:
            raise MeterRejected("not_a_number", f"reading {value!r} is not a number") from None
    try:
        watts = float(value)
    except OverflowError:  # a JSON integer past 1e308
        raise MeterRejected("absurd", f"reading {str(value)[:20]}... is above {max_w:g}") from None
    if not math.isfinite(watts):
        raise MeterRejected("not_a_number", f"reading {watts} is not finite")
    if watts < 0:
        raise MeterRejected("negative", f"reading {watts:g} W is negative")
    if watts > max_w:
        raise MeterRejected("absurd", f"reading {watts:g} W is above {max_w:g} W")
    return watts


def redfish_watts(doc: Any, max_w: float = MAX_METER_W) -> float | str:
    """`PowerWatts.Reading` of a Redfish document (a PDU's `Metrics`, an outlet, a power
    shelf's metrics), in W; or the path of its `Metrics` to read instead (a
    `PowerDistribution`); MeterRejected if neither."""
    if not isinstance(doc, dict):
        raise MeterRejected("malformed", "the answer is not a JSON object")
    power = doc.get("PowerWatts")
    if isinstance(power, dict) and "Reading" in power:
        if power["Reading"] is None:
            raise MeterRejected("no_reading", "PowerWatts.Reading is null")
        return bounded_watts(power["Reading"], max_w)
    metrics = doc.get("Metrics")
    if isinstance(metrics, dict):
        link = metrics.get("@odata.id")
        if isinstance(link, str) and link.startswith("/redfish/v1/") and len(link) <= 500:
            return link
    raise MeterRejected("malformed", "no PowerWatts.Reading and no Metrics link")


def prometheus_watts(doc: Any, max_w: float = MAX_METER_W) -> float:
    """The one sample of a Prometheus instant query's answer (`/api/v1/query`), in W:
    a `vector` of exactly one series or a `scalar`; MeterRejected otherwise."""
    if not isinstance(doc, dict):
        raise MeterRejected("malformed", "the answer is not a JSON object")
    if doc.get("status") != "success":
        error = str(doc.get("error", ""))[:MAX_ERROR_CHARS]
        raise MeterRejected("query_failed", f"status {str(doc.get('status'))[:20]!r} {error}")
    data = doc.get("data")
    if not isinstance(data, dict):
        raise MeterRejected("malformed", "no data object")
    kind, result = data.get("resultType"), data.get("result")
    if kind == "vector":
        if not isinstance(result, list) or len(result) != 1:
            n = len(result) if isinstance(result, list) else "no"
            raise MeterRejected("not_one_series", f"the query gave {n} series, not one")
        sample = result[0].get("value") if isinstance(result[0], dict) else None
    elif kind == "scalar":
        sample = result
    else:
        raise MeterRejected("malformed", f"result type {str(kind)[:20]!r}, not vector or scalar")
    if not isinstance(sample, list) or len(sample) != 2:
        raise MeterRejected("malformed", "a sample is not [time, value]")
    return bounded_watts(sample[1], max_w)


# -- what the reader hands the tick -------------------------------------------------------


@dataclass(frozen=True, slots=True)
class MeterSample:
    """A group's meter as last heard: its last reading (None: none yet) with its arrival
    time on the controller's monotonic clock and a sequence number, when the reading
    last changed value, and the last failure (None when the last poll read)."""

    reading_w: float | None = None
    at: float = -math.inf
    seq: int = 0
    error: str | None = None
    failed_at: float = -math.inf
    changed_at: float = -math.inf


class MeterBook:
    """The latest sample per metered group, written by the reader (any thread), read by the
    tick; and the answers rejected, by group and reason.

    A reader claims the groups it polls (`claim`, with a token it passes to `put` and
    `fail`): a write with another reader's token is dropped, so a reader stopped for a new
    policy cannot land a reading in flight after its successor began. Writes without a
    token (the simulator, tests) always land."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._samples: dict[str, MeterSample] = {}
        self._writer: dict[str, object] = {}
        self.rejected: dict[tuple[str, str], int] = {}

    def claim(self, token: object, groups: Iterable[str], *, forget: Iterable[str] = ()) -> None:
        """From now on only `token` writes `groups`; the groups in `forget` (a meter that
        changed) lose their reading and failure, keeping their sequence number."""
        with self._lock:
            for group in groups:
                self._writer[group] = token
            for group in forget:
                last = self._samples.get(group)
                if last is not None:
                    self._samples[group] = MeterSample(seq=last.seq)

    def _refused(self, group: str, token: object | None) -> bool:
        return token is not None and self._writer.get(group) is not token

    def put(self, group: str, reading_w: float, now: float, token: object | None = None) -> None:
        with self._lock:
            if self._refused(group, token):
                return
            last = self._samples.get(group, MeterSample())
            changed = now if reading_w != last.reading_w else last.changed_at
            self._samples[group] = MeterSample(reading_w, now, last.seq + 1, changed_at=changed)

    @staticmethod
    def _printable(error: str) -> str:
        """The error as one printable line: its text may be the meter's own (an error
        message, a status reason), which must not forge lines in alarms and logs."""
        return "".join(c if c.isprintable() else "?" for c in error[:MAX_ERROR_CHARS])

    def fail(
        self,
        group: str,
        error: str,
        now: float,
        *,
        reason: str | None = None,
        token: object | None = None,
    ) -> None:
        """A poll that gave no reading (`reason`: a rejected answer, counted)."""
        with self._lock:
            if self._refused(group, token):
                return
            last = self._samples.get(group, MeterSample())
            self._samples[group] = MeterSample(
                last.reading_w, last.at, last.seq, self._printable(error), now, last.changed_at
            )
            if reason is not None:
                key = (group, reason)
                self.rejected[key] = self.rejected.get(key, 0) + 1

    def latest(self) -> dict[str, MeterSample]:
        with self._lock:
            return dict(self._samples)

    def rejected_counts(self) -> dict[tuple[str, str], int]:
        with self._lock:
            return dict(self.rejected)


# -- what the tick makes of it ------------------------------------------------------------


@dataclass(frozen=True)
class MeteredDraw:
    """Per group (topology order), this tick: whether it has a meter, whether its reading
    is fresh, the reading (NaN: none fresh), which reading it is (`seq`), and the nodes'
    figure it is compared with (Σ draw + overhead, as the overload rule counts it)."""

    metered: BoolArray
    fresh: BoolArray
    reading_w: FloatArray
    seq: IntArray
    nodes_w: FloatArray
    # Per group, overhead its meter has learned beyond the policy's `overhead_w` (learned
    # mean less its error, in steps): the strict budget assumed less, so the limit is that
    # much lower (BudgetsInForce.limits). 0 where none or not yet learned.
    unseen_w: FloatArray | None = None

    def draw_w(self, nodes_w: FloatArray) -> FloatArray:
        """The measured draw the overload rule trusts: where a reading is fresh, the larger
        of it and the nodes' figure (a meter that reads low lends no more than the nodes'
        figures would); elsewhere the nodes' figure."""
        return np.where(self.fresh, np.fmax(nodes_w, self.reading_w), nodes_w)


@dataclass(frozen=True)
class MeterView:
    """Per metered group, for the API and /metrics."""

    group: str
    # "fresh", "stale" (a reading too old), "frozen" (unchanged for the meter's frozen_s)
    # or "none" (never read)
    state: str
    reading_w: float | None
    age_s: float | None
    nodes_w: float
    gap_w: float | None  # meter − (nodes + overhead), fresh readings only
    bound_w: float | None
    overhead_w: float  # the policy's
    overhead_learned_w: float | None
    overhead_error_w: float | None
    readings: int  # readings the learned overhead has taken
    error: str | None
    unchanged_s: float | None = None  # how long the reading has kept its value
    overhead_unseen_w: float = 0.0  # learned beyond the policy's: the limit is that much lower


@dataclass
class _Learned:
    mean_w: float = math.nan
    var_w2: float = 0.0
    n: int = 0
    seq: int = 0

    def add(self, x: float) -> None:
        if self.n == 0:
            self.mean_w, self.var_w2 = x, 0.0
        else:
            d = x - self.mean_w
            self.mean_w += OVERHEAD_ALPHA * d
            self.var_w2 = (1 - OVERHEAD_ALPHA) * (self.var_w2 + OVERHEAD_ALPHA * d * d)
        self.n += 1


class MeterStage:
    """The tick's use of the meters: which groups have one (from the policy), the learned
    overhead and the disagreement's start per group, the alarms."""

    def __init__(self) -> None:
        self.specs: dict[str, MeterSpec] = {}
        self._learned: dict[str, _Learned] = {}
        self._gap_since: dict[str, float] = {}
        self._first_seen: dict[str, float] = {}  # when each meter's group was first steered
        self._unseen: dict[str, float] = {}  # the overhead beyond the policy's, in force
        # The metered groups' indices in the last topology seen (names, [(index, name)]).
        self._where: tuple[tuple[str, ...], list[tuple[int, str]]] | None = None
        self.views: tuple[MeterView, ...] = ()

    def adopt(self, policy: Policy) -> None:
        old, self.specs = (
            self.specs,
            {g.name: g.meter for g in policy.groups if g.meter is not None},
        )
        self._where = None
        # A group pointed at another meter learns its overhead anew.
        self._learned = {
            n: v
            for n, v in self._learned.items()
            if n in self.specs and n in old and self.specs[n].source == old[n].source
        }
        self._gap_since = {n: t for n, t in self._gap_since.items() if n in self.specs}
        self._first_seen = {n: t for n, t in self._first_seen.items() if n in self.specs}
        self._unseen = {n: w for n, w in self._unseen.items() if n in self._learned}

    def see(
        self,
        samples: Mapping[str, MeterSample],
        topo: Topology,
        now: float,
        *,
        nodes_w: FloatArray,
        gpus_w: FloatArray,
        complete: BoolArray,
    ) -> MeteredDraw | None:
        """This tick's metered draw (None: no group has a meter). `nodes_w`: per group the
        nodes' figure (Σ draw + overhead + reserve); `gpus_w`: Σ GPUs' reported draw;
        `complete`: every GPU of the group reported fresh (the overhead is learned only
        there)."""
        if not self.specs:
            self.views = ()
            return None
        n = topo.n_groups
        metered = np.zeros(n, dtype=bool)
        fresh = np.zeros(n, dtype=bool)
        reading = np.full(n, np.nan)
        seq = np.zeros(n, dtype=np.int64)
        unseen = np.zeros(n)
        views = []
        if self._where is None or self._where[0] is not topo.names:
            where = [(g, n) for g, n in enumerate(topo.names) if n in self.specs]
            self._where = (topo.names, where)
        for g, name in self._where[1]:
            spec = self.specs[name]
            metered[g] = True
            self._first_seen.setdefault(name, now)
            s = samples.get(name, MeterSample())
            age = now - s.at
            unchanged = now - s.changed_at
            frozen = s.reading_w is not None and unchanged > spec.frozen_after_s
            is_fresh = s.reading_w is not None and -1.0 <= age <= spec.fresh_s and not frozen
            gap = bound = None
            learned = self._learned.setdefault(name, _Learned())
            if is_fresh:
                assert s.reading_w is not None
                fresh[g], reading[g], seq[g] = True, s.reading_w, s.seq
                gap = s.reading_w - float(nodes_w[g])
                bound = spec.bound_w(s.reading_w)
                if complete[g] and s.seq != learned.seq:
                    learned.seq = s.seq
                    learned.add(s.reading_w - float(gpus_w[g]))
            unseen[g] = self._unseen_w(
                name, learned, float(topo.overhead_w[g]), float(topo.budget_w[g])
            )
            views.append(
                MeterView(
                    group=name,
                    state=(
                        "fresh"
                        if is_fresh
                        else "none"
                        if s.reading_w is None
                        else "frozen"
                        if frozen
                        else "stale"
                    ),
                    reading_w=s.reading_w,
                    age_s=None if s.reading_w is None else max(age, 0.0),
                    nodes_w=float(nodes_w[g]),
                    gap_w=gap,
                    bound_w=bound,
                    overhead_w=float(topo.overhead_w[g]),
                    overhead_learned_w=None if learned.n == 0 else learned.mean_w,
                    overhead_error_w=None if learned.n == 0 else math.sqrt(learned.var_w2),
                    readings=learned.n,
                    error=s.error if s.failed_at >= s.at else None,
                    unchanged_s=None if s.reading_w is None else max(unchanged, 0.0),
                    overhead_unseen_w=float(unseen[g]),
                )
            )
        self.views = tuple(views)
        return MeteredDraw(
            metered, fresh, reading, seq, np.asarray(nodes_w, dtype=np.float64), unseen
        )

    def _unseen_w(self, name: str, learned: _Learned, policy_w: float, budget_w: float) -> float:
        """The overhead group `name`'s meter has learned beyond the policy's: the learned
        mean less its error, once it has OVERHEAD_MIN_READINGS readings, rounded up to a
        step, at most UNSEEN_MAX_SHARE of the budget; up at once, down only by more than one
        and a half steps. Kept while the meter is stale (the hardware did not change): it
        only ever lowers a limit."""
        old = self._unseen.get(name, 0.0)
        if learned.n < OVERHEAD_MIN_READINGS:
            return old
        if not math.isfinite(budget_w):
            return 0.0  # no budget to keep
        step = max(UNSEEN_STEP_W, 0.005 * budget_w)
        excess = min(
            learned.mean_w - math.sqrt(learned.var_w2) - policy_w, UNSEEN_MAX_SHARE * budget_w
        )
        new = math.ceil(max(excess, 0.0) / step) * step if math.isfinite(excess) else old
        if new > old or excess < old - 1.5 * step:
            self._unseen[name] = old = new
        return old

    def alarm(self, alarms: Alarms, now: float, wall: float) -> None:
        """Raise or clear the three meter alarms from this tick's views."""
        stale, disagree, overhead = [], [], []
        for v in self.views:
            spec = self.specs[v.group]
            if v.state != "fresh":
                self._gap_since.pop(v.group, None)
                # A meter never read yet gets fresh_s from when its group is first steered
                # (a start, a new policy) before it alarms; its group is strict meanwhile.
                if v.state != "none" or now - self._first_seen.get(v.group, now) >= spec.fresh_s:
                    stale.append(v)
                continue
            assert v.gap_w is not None and v.bound_w is not None
            if abs(v.gap_w) > v.bound_w:
                since = self._gap_since.setdefault(v.group, now)
                if now - since >= spec.disagree_for_s:
                    disagree.append(v)
            else:
                self._gap_since.pop(v.group, None)
            if (
                v.readings >= OVERHEAD_MIN_READINGS
                and v.overhead_learned_w is not None
                and v.reading_w is not None
                and v.overhead_learned_w - v.overhead_w > spec.bound_w(v.reading_w)
            ):
                overhead.append(v)
        alarms.set(
            "meter_stale",
            _listing("no fresh meter reading (strict budget in force) at", stale, _why_stale),
            wall,
            subjects=tuple(v.group for v in stale) or None,
        )
        alarms.set(
            "meter_disagrees",
            _listing("meter and nodes disagree at", disagree, _why_gap),
            wall,
            subjects=tuple(v.group for v in disagree) or None,
            data=None if not disagree else {"gaps_w": {v.group: v.gap_w for v in disagree}},
        )
        alarms.set(
            "meter_overhead",
            _listing("learned overhead above the policy's at", overhead, _why_overhead),
            wall,
            subjects=tuple(v.group for v in overhead) or None,
        )


def _listing(head: str, views: list[MeterView], why: Any) -> str | None:
    if not views:
        return None
    more = f" (+{len(views) - 5} more)" if len(views) > 5 else ""
    return f"{head} " + "; ".join(f"{v.group} {why(v)}" for v in views[:5]) + more


def _why_stale(v: MeterView) -> str:
    if v.state == "frozen" and v.reading_w is not None and v.unchanged_s is not None:
        last = f"reading unchanged at {v.reading_w:,.0f} W for {v.unchanged_s:.0f} s"
    elif v.age_s is None:
        last = "never read"
    else:
        last = f"last read {v.age_s:.0f} s ago"
    return last + (f", {v.error}" if v.error else "")


def _why_gap(v: MeterView) -> str:
    assert v.reading_w is not None and v.gap_w is not None and v.bound_w is not None
    return (
        f"(meter {v.reading_w:,.0f} W, nodes + overhead {v.nodes_w:,.0f} W, "
        f"gap {v.gap_w:+,.0f} W, bound {v.bound_w:,.0f} W)"
    )


def _why_overhead(v: MeterView) -> str:
    assert v.overhead_learned_w is not None and v.overhead_error_w is not None
    return (
        f"(learned {v.overhead_learned_w:,.0f} ± {v.overhead_error_w:,.0f} W, "
        f"policy {v.overhead_w:,.0f} W)"
    )
