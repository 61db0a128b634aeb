"""Where a node's `perf` comes from: what serving and training stacks already export.

A workload's progress rate (tokens/s, samples/s) is read from
- a Prometheus text endpoint (a serving engine's /metrics) and one metric of it: a counter
  (its rate is computed from deltas between polls; a counter that goes down was reset and
  that interval is skipped) or a gauge (a rate already); series chosen by label values;
- or a file the job writes: a number, or JSON (a number, {"perf": x}, or
  {"gpus": {"0": x, "GPU-…": y}} per GPU index or uuid), a rate or a counter the same way.

Values map to GPUs per series through a label (`gpu_label`, whose value is a GPU index or
uuid), or the node's total is shared equally by its GPUs (or those listed in `gpus`).

Reading never blocks the agent's loop: a daemon thread polls (with a timeout per request and
a bound on what it reads) and the loop only looks up the latest values. Every value is
bounded: non-finite, negative or above `max_value` is dropped; a value older than `max_age_s`
is not sent (the job stopped exporting), and neither is one from a file not written for that
long. Settings: docs/operations.md, "Workload perf".
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import structlog
from prometheus_client.parser import text_string_to_metric_families

from powerd.agent.poller import Poller

log = structlog.get_logger(__name__)

MAX_READ_BYTES = 4 * 1024 * 1024
Kind = Literal["counter", "gauge"]
# (series key, value): key "" is the node's total, else a GPU index or uuid as text.
Series = list[tuple[str, float]]


class PerfReadError(Exception):
    """The source could not be read or parsed this time (logged, retried next poll)."""


@dataclass(frozen=True)
class PerfConfig:
    url: str | None = None
    metric: str | None = None
    labels: Mapping[str, str] = field(default_factory=dict)
    gpu_label: str | None = None
    file: Path | None = None
    kind: Kind = "counter"
    period_s: float = 5.0
    timeout_s: float = 2.0
    max_value: float = 1e9
    max_age_s: float = 30.0
    gpus: Sequence[int] | None = None  # indices sharing a node total (None: all)


def parse_prometheus(
    text: str, metric: str, labels: Mapping[str, str], gpu_label: str | None
) -> Series:
    """The metric's series that match `labels`: per GPU label value, else summed to one."""
    names = {metric, metric + "_total"} if not metric.endswith("_total") else {metric}
    per: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError) as exc:
        raise PerfReadError(f"not Prometheus text: {exc}") from None
    for fam in families:
        for s in fam.samples:
            if s.name not in names:
                continue
            if any(s.labels.get(k) != v for k, v in labels.items()):
                continue
            key = ""
            if gpu_label is not None:
                key = s.labels.get(gpu_label, "")
                if not key:
                    continue  # a series of no GPU: not ours to place
            per[key] = per.get(key, 0.0) + float(s.value)
    return list(per.items())


def parse_file(text: str) -> Series:
    """A number, or JSON: a number, {"perf": x} or {"gpus": {index or uuid: x}}."""
    text = text.strip()
    try:
        doc = json.loads(text)
    except ValueError:
        raise PerfReadError("neither a number nor JSON") from None
    if isinstance(doc, bool):
        raise PerfReadError("a boolean is not a rate")
    if isinstance(doc, int | float):
        return [("", float(doc))]
    if isinstance(doc, dict):
        if "gpus" in doc and isinstance(doc["gpus"], dict):
            out = []
            for k, v in list(doc["gpus"].items())[:1024]:
                if isinstance(v, int | float) and not isinstance(v, bool):
                    out.append((str(k), float(v)))
            return out
        v = doc.get("perf")
        if isinstance(v, int | float) and not isinstance(v, bool):
            return [("", float(v))]
    raise PerfReadError('want a number, {"perf": x} or {"gpus": {"0": x}}')


def _read_within(resp: Any, timeout_s: float) -> bytes:
    """The body, at most MAX_READ_BYTES + 1 bytes, read within about `timeout_s` in all: the
    socket's timeout bounds each read only, and a body dripped a byte at a time would keep
    a plain read() going for weeks."""
    deadline = time.monotonic() + timeout_s
    chunks: list[bytes] = []
    size = 0
    while size <= MAX_READ_BYTES:
        if time.monotonic() > deadline:
            raise PerfReadError(f"response not read within {timeout_s:g} s")
        chunk = resp.read1(MAX_READ_BYTES + 1 - size)
        if not chunk:
            break
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


class PerfSource:
    """Latest perf per GPU uuid from one configured source; `poll` reads it once."""

    def __init__(
        self,
        config: PerfConfig,
        gpus: Mapping[str, int],  # uuid -> index
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (config.url is None) == (config.file is None):
            raise ValueError("a perf source needs exactly one of a URL or a file")
        if config.url is not None and not config.metric:
            raise ValueError("a Prometheus perf source needs a metric name")
        self.config = config
        self.clock = clock
        self._uuid_of = {str(i): u for u, i in gpus.items()} | {u: u for u in gpus}
        share = [u for u, i in gpus.items() if config.gpus is None or i in config.gpus]
        self._shared = share
        self._prev: dict[str, tuple[float, float]] = {}  # series -> (value, time)
        self._lock = threading.Lock()
        self._latest: dict[str, tuple[float, float]] = {}  # uuid -> (perf, time)
        self.dropped: dict[str, int] = {}
        self.errors = 0
        self._poller = Poller("powerd-perf", self.poll, config.period_s, config.timeout_s + 1.0)

    # -- reading (the poller thread) -------------------------------------------------------

    def _read(self) -> Series:
        c = self.config
        if c.file is not None:
            try:
                st = os.stat(c.file)
                if time.time() - st.st_mtime > c.max_age_s:
                    raise PerfReadError(f"not written for over {c.max_age_s:g} s")
                with open(c.file, "rb") as f:
                    raw = f.read(MAX_READ_BYTES + 1)
            except OSError as exc:
                raise PerfReadError(f"cannot read {c.file}: {exc.strerror}") from None
            if len(raw) > MAX_READ_BYTES:
                raise PerfReadError("file too large")
            return parse_file(raw.decode("utf-8", "replace"))
        assert c.url is not None and c.metric is not None
        try:
            with urllib.request.urlopen(c.url, timeout=c.timeout_s) as resp:
                raw = _read_within(resp, c.timeout_s)
        except (urllib.error.URLError, OSError, ValueError) as exc:
            raise PerfReadError(f"cannot fetch {c.url}: {exc}") from None
        if len(raw) > MAX_READ_BYTES:
            raise PerfReadError("response too large")
        return parse_prometheus(raw.decode("utf-8", "replace"), c.metric, c.labels, c.gpu_label)

    def _drop(self, why: str) -> None:
        self.dropped[why] = self.dropped.get(why, 0) + 1

    def poll(self) -> None:
        """Read the source once and update the latest values (never raises)."""
        now = self.clock()
        try:
            series = self._read()
        except PerfReadError as exc:
            self.errors += 1
            log.warning("perf_read_failed", error=str(exc)[:200])
            return
        except Exception:  # a bug here must not kill the poller
            self.errors += 1
            log.exception("perf_read_crashed")
            return
        fresh: dict[str, tuple[float, float]] = {}
        for key, rate in self._rates(series, now):
            for uuid, v in self._place(key, rate):
                if not math.isfinite(v) or v > self.config.max_value:
                    self._drop("above_max")
                    continue
                fresh[uuid] = (v, now)
        with self._lock:
            self._latest.update(fresh)

    def _rates(self, series: Series, now: float) -> list[tuple[str, float]]:
        """Per series: the value (gauge) or its rate since the last poll (counter)."""
        rates: list[tuple[str, float]] = []
        for key, value in series:
            if not math.isfinite(value) or value < 0:
                self._drop("not_finite_or_negative")
                continue
            if self.config.kind == "gauge":
                rates.append((key, value))
                continue
            prev = self._prev.get(key)
            self._prev[key] = (value, now)
            if prev is None:
                continue  # a first reading: no rate yet
            dv, dt = value - prev[0], now - prev[1]
            if dv < 0:
                self._drop("counter_reset")  # restarted: the next interval has a rate again
            elif dt > 0:
                rates.append((key, dv / dt))
        return rates

    def _place(self, key: str, rate: float) -> list[tuple[str, float]]:
        """Which GPUs a series' rate belongs to: the one its label names, or all sharing."""
        if key == "":
            n = len(self._shared)
            return [(u, rate / n) for u in self._shared]
        uuid = self._uuid_of.get(key)
        if uuid is None:
            self._drop("unknown_gpu")
            return []
        return [(uuid, rate)]

    # -- the agent's side (its loop: a dict lookup, nothing else) ---------------------------

    def value(self, uuid: str) -> float | None:
        """The latest perf of this GPU, or None when there is none or it is too old."""
        with self._lock:
            got = self._latest.get(uuid)
        if got is None or self.clock() - got[1] > self.config.max_age_s:
            return None
        return got[0]

    # -- the poller thread -----------------------------------------------------------------

    def start(self) -> None:
        self._poller.start()

    def stop(self) -> None:
        self._poller.stop()
