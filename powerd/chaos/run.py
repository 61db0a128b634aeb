"""Carry out a fault schedule on a site and report what the watcher saw.

Per fault: inject, hold, undo, then wait (bounded) until the controller process is alive,
`/healthz` and `/readyz` answer ok, and every node has acknowledged a command sent after
the fault was undone and says it is steered. The time that takes is the recovery time.
Breaches come from the watcher's exact replay of the journals at the end, each credited to
the fault whose window (its start to the next fault's start) it began in.
"""

from __future__ import annotations

import asyncio
import math
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from powerd.chaos.schedule import CLOCK_STEP_S, CUT_SHARE, Fault, FaultKind
from powerd.chaos.site import HUGE_TICK, Site, gpu_uuids
from powerd.chaos.watcher import HORIZON_S, Breach

Undo = Callable[[], Awaitable[None]]
STEADY = "steady"  # breaches before the first fault


@dataclass
class FaultRecord:
    fault: Fault
    injected_s: float  # monotonic
    restored_s: float = math.nan
    recovered_s: float | None = None
    controller_alive: bool = True  # the controller never died unless we killed it
    window_end_s: float = math.inf
    breaches: list[Breach] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    injected: bool = True  # False: the harness could not inject it (see notes)

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_s is None else self.recovered_s - self.restored_s

    @property
    def survived(self) -> bool:
        return self.recovered_s is not None and self.controller_alive and not self.breaches


@dataclass
class KindFigures:
    injected: int = 0
    survived: int = 0
    breaches: int = 0
    worst_overshoot_w: float = 0.0
    worst_breach_s: float = 0.0  # the longest breach
    recovery_s: list[float] = field(default_factory=list)
    not_recovered: int = 0
    not_injected: int = 0  # the harness's own failures, not counted above


@dataclass
class ChaosReport:
    records: list[FaultRecord]
    breaches: list[Breach]
    steady_breaches: list[Breach]
    duration_s: float
    checks: int
    undecodable: dict[str, int]
    facility_budget_w: float
    facility_mean_w: float  # time-weighted Σ caps + overhead: safe but starved shows here

    def by_kind(self) -> dict[str, KindFigures]:
        out: dict[str, KindFigures] = {}
        for r in self.records:
            k = out.setdefault(r.fault.kind.value, KindFigures())
            if not r.injected:
                k.not_injected += 1
                continue
            k.injected += 1
            k.survived += r.survived
            k.breaches += len(r.breaches)
            for b in r.breaches:
                k.worst_overshoot_w = max(k.worst_overshoot_w, b.worst_w)
                k.worst_breach_s = max(k.worst_breach_s, b.duration_s)
            if r.recovery_s is None:
                k.not_recovered += 1
            else:
                k.recovery_s.append(r.recovery_s)
        return out

    def breached_kinds(self) -> set[str]:
        return {r.fault.kind.value for r in self.records if r.breaches}

    def failed_kinds(self) -> set[str]:
        """Kinds with a breach, a controller that died, or steering that never came back."""
        return {r.fault.kind.value for r in self.records if r.injected and not r.survived}

    def worst(self) -> Breach | None:
        return max(self.breaches, key=lambda b: b.worst_w, default=None)

    def render(self) -> str:
        lines = [
            f"{len(self.records)} faults in {self.duration_s:.0f} s; {self.checks} budget checks; "
            f"{len(self.breaches)} breaches ({len(self.steady_breaches)} outside any fault); "
            f"facility caps + overhead {self.facility_mean_w:.0f} W on average of "
            f"{self.facility_budget_w:.0f} W",
            f"{'fault':<20} {'inj':>4} {'ok':>4} {'breach':>6} {'worst W':>9} "
            f"{'longest s':>9} {'recover s (median/max)':>22} {'never':>5} {'not inj':>7}",
        ]
        for kind, f in sorted(self.by_kind().items()):
            rec = (
                f"{statistics.median(f.recovery_s):.1f} / {max(f.recovery_s):.1f}"
                if f.recovery_s
                else "-"
            )
            lines.append(
                f"{kind:<20} {f.injected:>4} {f.survived:>4} {f.breaches:>6} "
                f"{f.worst_overshoot_w:>9.1f} {f.worst_breach_s:>9.3f} {rec:>22} "
                f"{f.not_recovered:>5} {f.not_injected:>7}"
            )
        worst = self.worst()
        if worst is not None:
            lines.append(
                f"worst breach: {worst.group} {worst.committed_w:.1f} W > {worst.budget_w:.0f} W "
                f"(+{worst.worst_w:.1f} W) for {worst.duration_s:.3f} s"
            )
        for r in self.records:
            for note in r.notes:
                lines.append(f"note ({r.fault.describe()}): {note}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "duration_s": self.duration_s,
            "checks": self.checks,
            "faults": len(self.records),
            "breaches": len(self.breaches),
            "steady_breaches": len(self.steady_breaches),
            "facility_budget_w": self.facility_budget_w,
            "facility_mean_w": round(self.facility_mean_w, 1),
            "undecodable": self.undecodable,
            "by_kind": {
                k: {
                    "injected": f.injected,
                    "survived": f.survived,
                    "breaches": f.breaches,
                    "worst_overshoot_w": round(f.worst_overshoot_w, 2),
                    "worst_breach_s": round(f.worst_breach_s, 3),
                    "recovery_median_s": (
                        round(statistics.median(f.recovery_s), 2) if f.recovery_s else None
                    ),
                    "recovery_max_s": round(max(f.recovery_s), 2) if f.recovery_s else None,
                    "not_recovered": f.not_recovered,
                    "not_injected": f.not_injected,
                }
                for k, f in sorted(self.by_kind().items())
            },
            "breach_list": [
                {
                    "group": b.group,
                    "overshoot_w": round(b.worst_w, 2),
                    "duration_s": round(b.duration_s, 3),
                    "fault": next(
                        (r.fault.describe() for r in self.records if b in r.breaches), STEADY
                    ),
                }
                for b in self.breaches
            ],
        }


async def inject(site: Site, fault: Fault) -> Undo:
    """Do the fault now; return what undoes it."""
    do = _INJECT.get(fault.kind)
    if do is not None:
        return await do(site, fault.target)
    await _adversary(site, fault)
    return _nothing


async def _nothing() -> None:
    return None


async def _kill_controller(site: Site, _target: str) -> Undo:
    site.controller.kill()

    async def restart() -> None:
        site.start_controller()

    return restart


async def _kill_agent(site: Site, node: str) -> Undo:
    site.agents[node].kill()

    async def restart() -> None:
        site.start_agent(node)

    return restart


async def _kill_broker(site: Site, _target: str) -> Undo:
    site.broker.kill()

    async def restart() -> None:
        await asyncio.to_thread(site.broker.start)

    return restart


async def _partition(site: Site, node: str) -> Undo:
    await site.partition(node)
    return lambda: site.heal(node)


def _clock_step(step_s: float) -> Callable[[Site, str], Awaitable[Undo]]:
    async def step(site: Site, node: str) -> Undo:
        site.step_clock(node, step_s)

        async def step_back() -> None:
            site.step_clock(node, 0.0)

        return step_back

    return step


async def _lock_db(site: Site, _target: str) -> Undo:
    await site.hold_db_lock()
    return site.release_db_lock


async def _db_down(site: Site, _target: str) -> Undo:
    await site.db_down()
    return site.db_up


async def _cut_budget(site: Site, group_name: str) -> Undo:
    group = next(g for g in site.policy.groups if g.name == group_name)
    await site.cut_budget(group.name, round(CUT_SHARE * group.budget_w))
    return lambda: site.clear_budget(group.name)


# The faults done to the site's parts; every other kind is an adversary's message.
_INJECT: dict[FaultKind, Callable[[Site, str], Awaitable[Undo]]] = {
    FaultKind.CONTROLLER_KILL: _kill_controller,
    FaultKind.AGENT_KILL: _kill_agent,
    FaultKind.BROKER_KILL: _kill_broker,
    FaultKind.PARTITION: _partition,
    FaultKind.CLOCK_FORWARD: _clock_step(CLOCK_STEP_S),
    FaultKind.CLOCK_BACK: _clock_step(-CLOCK_STEP_S),
    FaultKind.DB_LOCK: _lock_db,
    FaultKind.DB_OUTAGE: _db_down,
    FaultKind.BUDGET_CUT: _cut_budget,
}


async def _adversary(site: Site, fault: Fault) -> None:
    """Publish, on the target node's own topics, what no honest agent would."""
    node = fault.target
    t = site.topics
    gpus = site.config.gpus
    uuids = gpu_uuids(node, gpus)
    low = dict.fromkeys(uuids, 200.0)  # "my caps are at the minimum": lets others rise
    now = time.time()
    match fault.kind:
        case FaultKind.EVIL_ACK_TICK:
            ack = {
                "v": 1,
                "node_id": node,
                "tick": HUGE_TICK,
                "gpus": {u: {"requested_w": 200.0, "enforced_w": 200.0} for u in uuids},
                "ts": now,
            }
            await site.publish_raw(t.ack(node), ack)
        case FaultKind.EVIL_STATUS_TICK:
            status = {
                "v": 1,
                "node_id": node,
                "state": "steered",
                "ts": now,
                "last_tick": HUGE_TICK,
                "gpus": gpus,
                "caps_w": low,
            }
            await site.publish_raw(t.status(node), status, retain=True)
        case FaultKind.EVIL_MIN_GT_MAX:
            bad = [
                site.gpu_json(u, i, 200.0, min_cap_w=650.0, max_cap_w=210.0)
                for i, u in enumerate(uuids)
            ]
            await site.publish_raw(t.telemetry(node), site.telemetry_json(node, bad))
        case FaultKind.EVIL_GHOST_GPUS:
            ghosts = [site.gpu_json(f"GPU-ghost-{i:06d}", i, 200.0) for i in range(60)]
            await site.publish_raw(t.telemetry(node), site.telemetry_json(node, ghosts))
        case FaultKind.EVIL_FOREIGN_UUID:
            other = site.nodes[(site.nodes.index(node) + 1) % len(site.nodes)]
            stolen = [site.gpu_json(u, i, 200.0) for i, u in enumerate(gpu_uuids(other, gpus))]
            await site.publish_raw(t.telemetry(node), site.telemetry_json(node, stolen))
        case FaultKind.EVIL_TS_AHEAD:
            ahead = [site.gpu_json(u, i, 200.0) for i, u in enumerate(uuids)]
            await site.publish_raw(
                t.telemetry(node), site.telemetry_json(node, ahead, ts=now + 3600)
            )
        case FaultKind.EVIL_OFFLINE_WILL:
            # What the broker publishes for a node whose connection died (retained).
            will = {"v": 1, "node_id": node, "state": "offline"}
            await site.publish_raw(t.status(node), will, retain=True)
        case _:
            raise ValueError(f"not an adversary's fault: {fault.kind}")


async def run_fault(site: Site, fault: Fault, recover_timeout_s: float) -> FaultRecord:
    rec = FaultRecord(fault, injected_s=time.monotonic())
    try:
        undo = await inject(site, fault)
    except Exception as exc:  # the harness's own trouble: say so, keep going
        rec.notes.append(f"injection failed: {exc!r}")
        rec.injected = False
        rec.restored_s = time.monotonic()
        return rec
    await asyncio.sleep(fault.hold_s)
    try:
        await undo()
    except Exception as exc:
        rec.notes.append(f"undo failed: {exc!r}")
    rec.restored_s = time.monotonic()
    deadline = rec.restored_s + recover_timeout_s
    while time.monotonic() < deadline:
        _restart_the_dead(site, rec)
        live, ready = await site.health()
        if live and ready and site.watcher.steered_since(rec.restored_s):
            rec.recovered_s = time.monotonic()
            break
        await asyncio.sleep(0.1)
    else:
        rec.notes.append(f"steering not back within {recover_timeout_s:g} s")
    return rec


def _restart_the_dead(site: Site, rec: FaultRecord) -> None:
    """A process that died on its own is a finding: note it, start it again, go on."""
    if not site.controller.alive:
        rec.controller_alive = False
        rec.notes.append(f"controller died: {site.controller.tail(5)}")
        site.start_controller()
    for node, agent in site.agents.items():
        if not agent.alive:
            rec.notes.append(f"agent {node} died: {agent.tail(5)}")
            site.start_agent(node)


async def run_schedule(
    site: Site,
    schedule: list[Fault],
    *,
    until_s: float = math.inf,
    recover_timeout_s: float = 30.0,
    settle_s: float = 1.0,
    progress: Callable[[FaultRecord, float], None] | None = None,
) -> ChaosReport:
    """Run the faults in order (none started past `until_s`), then replay the journals."""
    t0 = time.monotonic()
    records: list[FaultRecord] = []
    for fault in schedule:
        now = time.monotonic() - t0
        if max(now, fault.at_s) >= until_s:
            break
        if fault.at_s > now:
            await asyncio.sleep(fault.at_s - now)
        rec = await run_fault(site, fault, recover_timeout_s)
        if records:
            records[-1].window_end_s = rec.injected_s
        records.append(rec)
        if progress is not None:
            progress(rec, time.monotonic() - t0)
        await asyncio.sleep(settle_s)
    end = time.monotonic()
    await asyncio.sleep(HORIZON_S + 0.2)  # the last journal lines land
    check = site.watcher.replay(end)
    steady = []
    for b in check.breaches:
        owner = next((r for r in records if r.injected_s <= b.start_s < r.window_end_s), None)
        if owner is None:
            steady.append(b)
        else:
            owner.breaches.append(b)
    return ChaosReport(
        records=records,
        breaches=check.breaches,
        steady_breaches=steady,
        duration_s=end - t0,
        checks=check.checks,
        undecodable=dict(site.watcher.undecodable),
        facility_budget_w=site.policy.groups[0].budget_w,
        facility_mean_w=check.mean_committed_w(site.policy.groups[0].name),
    )
