"""`powerd sim SCENARIO --from-db URL`: replay what a controller recorded (steering or in
shadow) as demand: "what would steering have bought on my fleet last week".

The store keeps every GPU's per-minute mean draw (`gpu_minutes`, docs/storage.md). Each
simulated GPU replays the recorded GPU at its place (same node, same index); a place the
recording lacks (a site grown by the scenario, `oversubscribe`) replays the recorded GPUs
round robin. The scenario's workloads still give each GPU its class; their patterns and
idle windows are replaced by the recording.

Per-minute means smooth what happened within a minute: a recording's bursts shorter than
that are not replayed (record with `powerd agent --record` for those). A GPU that drew at
its cap was held back: its recorded draw is a lower bound of its demand, as in any
recording made under a limit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from powerd.backends.mock import Pattern as MockPattern
from powerd.backends.mock import Workload
from powerd.sim.traces import GpuTrace, TraceError
from powerd.store import Store
from powerd.store.db import missing_sqlite_file, shown_url

# Minutes a GPU needs in the window to be replayed.
MIN_MINUTES = 2


@dataclass(frozen=True)
class Recording:
    """Recorded GPUs by place (node, index), in the store's order."""

    url: str
    by_place: dict[tuple[str, int], GpuTrace]
    skipped: tuple[str, ...]  # GPUs with too few minutes in the window

    @property
    def traces(self) -> list[GpuTrace]:
        return list(self.by_place.values())


def read_recording(url: str, since: float | None, until: float | None) -> Recording:
    """Every GPU's per-minute draw in [since, until) (epoch seconds; None: all kept), read
    only: a SQLite file that is not there is refused, not created."""
    shown = f"--from-db {shown_url(url)}"
    if since is not None and until is not None and until <= since:
        raise TraceError(shown, "--until must be after --since")
    missing = missing_sqlite_file(url)
    if missing is not None:
        raise TraceError(shown, f"no such SQLite file ({missing})")
    store = Store(url, read_only=True)
    try:
        gpus = store.gpus()
        by_place: dict[tuple[str, int], GpuTrace] = {}
        skipped = []
        for g in gpus:
            rows = store.gpu_history(g.uuid, since=since, until=until, limit=10_000_000)
            if len(rows) < MIN_MINUTES:
                skipped.append(g.uuid)
                continue
            t = np.array([float(r.minute) for r in rows])
            by_place[(g.node, g.index)] = GpuTrace(
                source=url,
                gpu=g.uuid,
                t_s=t - t[0],
                draw_w=np.array([float(r.mean_power_w) for r in rows]),
                limit_w=np.array([float(r.mean_cap_w) for r in rows]),
            )
    except Exception as exc:  # an unreachable or foreign database: say which and why
        orig = getattr(exc, "orig", None) or exc  # the driver's words, not SQLAlchemy's SQL
        first = (str(orig).strip().splitlines() or [""])[0][:300]
        raise TraceError(
            shown, f"cannot read the recording: {type(orig).__name__}: {first}"
        ) from None
    finally:
        store.close()
    if not by_place:
        raise TraceError(
            shown, "no GPU has two or more recorded minutes in that window (--since/--until)"
        )
    return Recording(url, by_place, tuple(skipped))


def replay(
    workloads: tuple[Workload, ...], places: list[tuple[str, int]], rec: Recording
) -> tuple[Workload, ...]:
    """Each GPU's workload (class and profile kept) replaying its place's recording."""
    fallback = rec.traces
    out = []
    k = 0
    for w, place in zip(workloads, places, strict=True):
        trace = rec.by_place.get(place)
        if trace is None:
            trace = fallback[k % len(fallback)]
            k += 1
        out.append(
            Workload(
                MockPattern.TRACE,
                w.name,
                w.profile,
                high_w=float(trace.draw_w.max()),
                low_w=float(trace.draw_w.min()),
                trace=trace,
            )
        )
    return tuple(out)
