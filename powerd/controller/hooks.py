"""Hooks that connect the controller to metrics and to systemd's watchdog.

The controller calls every function in `controller.on_tick` with each TickReport, and every
function in `controller.on_round` once per round of its loop (a tick, or a standby's round)
with whether it led; these build such functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, overload

import numpy as np

from powerd.controller.controller import Controller
from powerd.controller.fleet import FleetGpu
from powerd.controller.report import TickReport
from powerd.metrics import ControllerMetrics, GpuSnapshot, Leadership
from powerd.policy import LEVELS
from powerd.sdnotify import Notifier

TickHook = Callable[[TickReport], None]
RoundHook = Callable[[bool], None]  # every round of the loop: whether this controller led


class _LiveThrottle(Sequence[tuple[str, ...]]):
    """Each GPU's throttle reasons, read from its record when Prometheus scrapes: building
    10k lists every tick would cost more than everything else the hook does."""

    def __init__(self, recs: list[FleetGpu]) -> None:
        self._recs = recs

    def __len__(self) -> int:
        return len(self._recs)

    @overload
    def __getitem__(self, i: int) -> tuple[str, ...]: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[tuple[str, ...]]: ...
    def __getitem__(self, i: int | slice) -> tuple[str, ...] | Sequence[tuple[str, ...]]:
        if isinstance(i, slice):
            return [r.throttle for r in self._recs[i]]
        return self._recs[i].throttle


class _LiveRestores(Sequence[float]):
    """Each GPU's restore count (`cap_restored`), read from its record when scraped."""

    def __init__(self, recs: list[FleetGpu]) -> None:
        self._recs = recs

    def __len__(self) -> int:
        return len(self._recs)

    @overload
    def __getitem__(self, i: int) -> float: ...
    @overload
    def __getitem__(self, i: slice) -> Sequence[float]: ...
    def __getitem__(self, i: int | slice) -> float | Sequence[float]:
        if isinstance(i, slice):
            return [float(r.restores) for r in self._recs[i]]
        return float(self._recs[i].restores)


def metrics_hook(controller: Controller, metrics: ControllerMetrics) -> TickHook:
    """Update every metric from the tick's report."""
    # Per GPU set (the report's uuid list is the same object until a GPU comes or goes):
    # the records, which FleetState updates in place, and what never changes per GPU.
    shape: dict[str, Any] = {"uuids": None}

    def update(r: TickReport) -> None:
        if shape["uuids"] is not r.uuids:
            recs = [controller.fleet.gpus[u] for u in r.uuids]
            shape.update(
                uuids=r.uuids,
                recs=recs,
                index=np.array([g.index for g in recs], dtype=np.int64),
                models=[g.name for g in recs],
                throttle=_LiveThrottle(recs),
                restores=_LiveRestores(recs),
            )
        recs = shape["recs"]
        n = len(recs)
        metrics.update_gpus(
            GpuSnapshot(
                uuids=r.uuids,
                nodes=r.nodes,
                index=shape["index"],
                power_w=r.power_w,
                cap_w=r.cap_w,
                energy_j=r.energy_j,
                temp_c=r.temp_c,
                committed_w=r.committed_w,
                target_w=r.targets_w,
                throttle=shape["throttle"],
                models=shape["models"],
                set_w=r.set_w,
                restores=shape["restores"],
            )
        )
        metrics.update_groups(
            names=r.group_names,
            levels=[LEVELS[int(lv)] for lv in r.group_levels.tolist()],
            budget_w=r.group_budget_w,
            committed_w=r.group_committed_w,
            draw_w=r.group_draw_w,
        )
        metrics.update_meters(r.meters, r.meter_rejected)
        metrics.observe_tick(
            duration_s=r.duration_ms / 1000.0,
            solve_s=r.solve_ms / 1000.0,
            status=r.status,
            ts=r.ts,
            throughput=r.throughput_by_class(),
            unused_w=r.unused_w,
            churn=(r.caps_moved, r.moved_w, r.caps_held),
            starved=r.raises_starved,
        )
        c = controller.counters
        metrics.update_counters(
            received=dict(c.received),
            dropped=dict(c.dropped),
            caps_sent=c.caps_sent,
            acks=c.received.get("ack", 0),
            ack_ticks=c.ack_ticks,
        )
        stale = int(r.stale.sum())
        metrics.update_fleet(
            gpus={"fresh": n - stale, "stale": stale}, nodes=controller.fleet.state_counts()
        )
        learner = controller.engine.targets.learner
        if learner is not None and learner.due():
            states = learner.states()
            metrics.update_learning(
                samples={s.key: s.samples for s in states},
                in_use={s.key: float(s.in_use) for s in states},
                fit_error={s.key: math.nan if s.fit_error is None else s.fit_error for s in states},
            )
        for kind in set(r.alarms) - set(metrics.active_alarms):
            metrics.alarm_raised(kind)
        metrics.set_active_alarms(dict.fromkeys(r.alarms, 1))

    return update


def watchdog_hook(notifier: Notifier) -> TickHook:
    """WATCHDOG=1 and a status line after every tick: a loop that stops ticking stops
    pinging, and systemd restarts it after WatchdogSec."""

    def ping(r: TickReport) -> None:
        status = (
            f"STATUS=tick {r.tick}: {r.status}, {len(r.uuids)} GPUs, "
            f"committed {r.group_committed_w[0] / 1000:.1f} kW "
            f"of {r.group_budget_w[0] / 1000:.1f} kW"
        )
        if notifier.watchdog_s is not None:
            notifier.notify("WATCHDOG=1", status)
        else:
            notifier.notify(status)

    return ping


def leadership_hook(controller: Controller, metrics: ControllerMetrics) -> RoundHook:
    """Who leads, the epoch, standbys, takeovers and fenced commands, every round."""

    def update(leading: bool) -> None:
        lead = controller.leadership
        if lead is None:
            return
        v = lead.view()
        controller.set_alarm("clock_skew", lead.skew_error)
        controller.set_alarm("scope_overlap", lead.overlap_error)
        metrics.update_leadership(
            Leadership(
                scope=v.scope,
                controller_id=v.controller_id,
                leading=leading,
                epoch=v.epoch,
                leader=v.leader,
                standbys=sum(m.role != "leader" for m in v.members),
                takeovers=v.takeovers,
                stepped_down=v.stepped_down,
                fenced=controller.engine.fenced_total(),
                withheld=controller.counters.withheld,
            )
        )

    return update


def standby_watchdog_hook(notifier: Notifier, controller: Controller) -> RoundHook:
    """A standby never ticks: it pings systemd's watchdog from its rounds instead."""

    def ping(leading: bool) -> None:
        if leading:
            return  # the tick's own hook pings
        lead = controller.leadership
        leader = lead.view().leader if lead is not None else None
        status = f"STATUS=standing by; leader {leader or 'none'}"
        if notifier.watchdog_s is not None:
            notifier.notify("WATCHDOG=1", status)
        else:
            notifier.notify(status)

    return ping
