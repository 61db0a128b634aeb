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
import signal
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from powerd.chaos.schedule import (
    CLOCK_STEP_S,
    CUT_SHARE,
    OUT_OF_BAND_W,
    SKEW_S,
    Fault,
    FaultKind,
)
from powerd.chaos.site import HUGE_TICK, NODE_OVERHEAD_W, Site, gpu_uuids
from powerd.chaos.watcher import HORIZON_S, Breach, BudgetCheck
from powerd.testing.mosquitto import free_port

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
    # What the fault expects besides the budgets and did not see (an alarm not raised, a
    # node that obeyed an intruder, a fleet at failsafe through a switchover): not survived.
    findings: list[str] = field(default_factory=list)
    # The facility's lowest Σ caps + overhead from injection to undo, and the seconds of
    # that span with the whole fleet at (or below) its failsafe caps.
    facility_min_w: float = math.nan
    fleet_failsafe_s: float = 0.0

    @property
    def recovery_s(self) -> float | None:
        return None if self.recovered_s is None else self.recovered_s - self.restored_s

    @property
    def survived(self) -> bool:
        return (
            self.recovered_s is not None
            and self.controller_alive
            and not self.breaches
            and not self.findings
        )


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
    findings: int = 0
    facility_min_w: float = math.inf  # the lowest over every fault of the kind
    fleet_failsafe_s: float = 0.0  # the longest, over every fault of the kind


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
            k.findings += len(r.findings)
            k.facility_min_w = min(k.facility_min_w, r.facility_min_w)
            k.fleet_failsafe_s = max(k.fleet_failsafe_s, r.fleet_failsafe_s)
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
            f"{'longest s':>9} {'recover s (median/max)':>22} {'never':>5} {'not inj':>7} "
            f"{'find':>4} {'min dc W':>8} {'failsafe s':>10}",
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
                f"{f.not_recovered:>5} {f.not_injected:>7} {f.findings:>4} "
                f"{f.facility_min_w:>8.0f} {f.fleet_failsafe_s:>10.1f}"
            )
        worst = self.worst()
        if worst is not None:
            lines.append(
                f"worst breach: {worst.group} {worst.committed_w:.1f} W > {worst.budget_w:.0f} W "
                f"(+{worst.worst_w:.1f} W) for {worst.duration_s:.3f} s"
            )
        for r in self.records:
            for finding in r.findings:
                lines.append(f"FINDING ({r.fault.describe()}): {finding}")
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
                    "findings": f.findings,
                    "facility_min_w": round(f.facility_min_w, 1),
                    "fleet_failsafe_s": round(f.fleet_failsafe_s, 2),
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
            "fault_list": [
                {
                    "fault": r.fault.describe(),
                    "recovery_s": None if r.recovery_s is None else round(r.recovery_s, 2),
                    "facility_min_w": round(r.facility_min_w, 1),
                    "fleet_failsafe_s": round(r.fleet_failsafe_s, 2),
                    "survived": r.survived,
                }
                for r in self.records
                if r.injected
            ],
            "findings": [f"{r.fault.describe()}: {f}" for r in self.records for f in r.findings],
            "notes": [f"{r.fault.describe()}: {n}" for r in self.records for n in r.notes],
        }


async def inject(site: Site, fault: Fault, rec: FaultRecord | None = None) -> Undo:
    """Do the fault now; return what undoes it. Faults of hosts that disagree also check
    what they expect (alarms, roles) and write what they miss into `rec.findings`."""
    do = _INJECT.get(fault.kind)
    if do is not None:
        return await do(site, fault.target)
    checked = _INJECT_CHECKED.get(fault.kind)
    if checked is not None:
        return await checked(site, fault, rec or FaultRecord(fault, time.monotonic()))
    await _adversary(site, fault)
    return _nothing


async def _nothing() -> None:
    return None


async def _kill_controller(site: Site, _target: str) -> Undo:
    # In a pair: the leader; the standby takes over and the victim comes back as standby
    # (the recovery loop finds who leads, `Site.follow_leader`).
    victim = site.controller
    victim.kill()

    async def restart() -> None:
        site.start_controller(victim)

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


async def _out_of_band(site: Site, node: str) -> Undo:
    # Every GPU of the node held at the mock GPUs' 200 W minimum under powerd's caps.
    site.hold_out_of_band(node, dict.fromkeys(range(site.config.gpus), OUT_OF_BAND_W))

    async def let_go() -> None:
        site.hold_out_of_band(node, {})

    return let_go


async def _cut_budget(site: Site, group_name: str) -> Undo:
    group = next(g for g in site.policy.groups if g.name == group_name)
    await site.cut_budget(group.name, round(CUT_SHARE * group.budget_w))
    return lambda: site.clear_budget(group.name)


# -- hosts that disagree (issue 27) --------------------------------------------------------

UP_TIMEOUT_S = 30.0  # a controller's start-up: migrations, kernel warm-up, learning


async def _wait(_what: str, ok: Callable[[], Awaitable[bool]], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await ok():
            return True
        await asyncio.sleep(0.2)
    return False


async def _intruder(site: Site, fault: Fault, rec: FaultRecord) -> Undo:
    """A controller that should not be there (a copied unit without POWERD_DB; a leftover
    `--scope`): the site's policy, a store of its own, for hold_s once it is up. Agents must
    keep obeying the site's controller (the watcher judges the budgets); each side must say
    so: `foreign_authority` on the intruder, `authority_conflict` on the leader."""
    port = free_port()
    proc = site.start_intruder(fault.target or None, port)
    client = site.client(port)

    async def up() -> bool:
        if not proc.alive:
            raise RuntimeError(f"{proc.name} exited: {proc.tail(5)}")
        try:
            return (await client.get("/healthz")).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        if not await _wait("intruder up", up, UP_TIMEOUT_S):
            raise RuntimeError(f"{proc.name} not up within {UP_TIMEOUT_S:g} s")
    except Exception:
        proc.kill()
        await client.aclose()
        raise

    async def stop() -> None:
        try:
            theirs = await site.alarms(client)
            ours = await site.alarms(site.http)
            if "foreign_authority" not in theirs:
                rec.findings.append(f"{proc.name} raised no foreign_authority ({sorted(theirs)})")
            if "authority_conflict" not in ours:
                rec.findings.append(f"the leader raised no authority_conflict ({sorted(ours)})")
            rec.notes.append(
                f"{proc.name}: foreign_authority: {theirs.get('foreign_authority', '-')[:160]}"
            )
        finally:
            await client.aclose()
            await asyncio.to_thread(proc.stop)  # SIGTERM, as an operator stops a unit

    return stop


def _lowered_policy(text: str, group: str, budget_w: float) -> str:
    doc = yaml.safe_load(text)
    stack = [doc["facility"]]
    while stack:
        g = stack.pop()
        if g.get("name") == group:
            g["budget_w"] = budget_w
        stack.extend(g.get("rows", []) + g.get("racks", []) + g.get("nodes", []))
    return str(yaml.safe_dump(doc))


async def _in_force(site: Site, client: httpx.AsyncClient, group: str, watts: float) -> bool:
    got = await site.budget_in_force(client, group)
    return got is not None and abs(got - watts) < 0.5


async def _stale_standby(site: Site, fault: Fault, rec: FaultRecord) -> Undo:
    """The leader's policy file lowered (facility × CUT_SHARE) and reloaded with SIGHUP; the
    standby's file still says the old, higher budget. kill -9 the leader: the standby must
    steer the stored (lower) policy. The watcher holds the lower budget from two ticks after
    the leader's API shows it until the undo raises it again (a SIGHUP of the old file)."""
    assert site.standby is not None, "stale_standby needs a pair"
    root = site.policy.groups[0]
    low_w = round(CUT_SHARE * root.budget_w)
    leader, standby = site.controller, site.standby
    original = site.member_policy[leader.name].read_text()
    site.member_policy[leader.name].write_text(_lowered_policy(original, root.name, low_w))
    leader.signal(signal.SIGHUP)
    if not await _wait("reload", lambda: _in_force(site, site.http, root.name, low_w), 15):
        raise RuntimeError("the leader did not apply the lowered policy within 15 s")
    site.watcher.cut(root.name, low_w, site.watcher.last_tick)
    # A standby does not tick (its /groups shows no budget in force): it follows the policy
    # of record, which its /policy names.
    stored = await _policy_sha(site.http)

    async def follows() -> bool:
        return stored is not None and await _policy_sha(site.clients[standby.name]) == stored

    followed = await _wait("standby follows", follows, 10)
    if not followed:
        rec.findings.append("the standby did not follow the stored (lowered) policy in 10 s")

    async def differs() -> bool:
        return "policy_differs" in await site.alarms(site.clients[standby.name])

    if not await _wait("policy_differs", differs, 5):
        alarms = sorted(await site.alarms(site.clients[standby.name]))
        rec.findings.append(f"the standby raised no policy_differs ({alarms})")
    await _wait("cut binds", _cut_bound(site), 10)
    leader.kill()

    async def undo() -> None:
        site.member_policy[leader.name].write_text(original)
        site.start_controller(leader)  # back as a standby
        await site.follow_leader()
        if site.controller is leader:
            rec.findings.append("the killed leader leads again: the standby never took over")
        # Back to the policy's budget: the member that leads stores its (old) file anew.
        site.watcher.clear(root.name)
        site.controller.signal(signal.SIGHUP)
        if not await _wait(
            "restored", lambda: _in_force(site, site.http, root.name, root.budget_w), 15
        ):
            rec.notes.append("the policy's budget was not back within 15 s of the SIGHUP")

    return undo


async def _policy_sha(client: httpx.AsyncClient) -> str | None:
    try:
        r = await client.get("/api/v1/policy")
    except httpx.HTTPError:
        return None
    return str(r.json().get("sha256")) if r.status_code == 200 else None


def _cut_bound(site: Site) -> Callable[[], Awaitable[bool]]:
    async def bound() -> bool:
        return not site.watcher.cut_pending()

    return bound


async def _skewed_standby(site: Site, fault: Fault, rec: FaultRecord) -> Undo:
    """The standby's wall clock an hour ahead, then a scheduled window (facility ×
    CUT_SHARE, from now + 1 s for ten minutes) at the leader; kill -9 the leader. The
    standby must not lead while its clock disagrees with the database's (`clock_skew`); once
    its clock is set right it may, and must keep the window. The watcher holds the window's
    budget from two ticks after its start until it is cancelled."""
    assert site.standby is not None, "skewed_standby_clock needs a pair"
    root = site.policy.groups[0]
    low_w = round(CUT_SHARE * root.budget_w)
    leader, standby = site.controller, site.standby
    skewed = site.clients[standby.name]
    site.step_member_clock(standby, SKEW_S)

    async def skew_seen() -> bool:
        return "clock_skew" in await site.alarms(skewed)

    if not await _wait("clock_skew", skew_seen, 10):
        rec.findings.append("the standby an hour ahead raised no clock_skew within 10 s")
    start = time.time() + 1.0
    body = {"budget_w": low_w, "start": start, "end": start + 600, "reason": "chaos: window"}
    r = await site.http.post(f"/api/v1/budgets/{root.name}/schedule", json=body)
    r.raise_for_status()
    schedule_id = str(r.json()["target"])
    await asyncio.sleep(max(0.0, start - time.time()))
    site.watcher.cut(root.name, low_w, site.watcher.last_tick)
    await _wait("cut binds", _cut_bound(site), 10)

    async def standby_keeps() -> bool:
        try:
            got = await skewed.get("/api/v1/schedules")
        except httpx.HTTPError:
            return False
        return got.status_code == 200 and any(e["id"] == schedule_id for e in got.json())

    if not await _wait("standby keeps the window", standby_keeps, 5):
        rec.findings.append("the standby an hour ahead does not hold the scheduled window")
    takeovers = await _takeovers(skewed)
    leader.kill()
    killed_at = time.monotonic()

    async def undo() -> None:
        if (await _takeovers(skewed) or 0) > (takeovers or 0):
            rec.findings.append("the standby led with its clock an hour ahead")
        site.step_member_clock(standby, 0.0)
        site.start_controller(leader)
        fixed = time.monotonic()

        async def leads() -> bool:
            await site.follow_leader()
            return await site.role(site.controller) == "leader"

        if not await _wait("a leader", leads, UP_TIMEOUT_S):
            rec.notes.append("nobody led within 30 s of the clock set right")
        # Steer under the window for a while before it ends: the watcher judges it.
        await _wait("steered", lambda: _steered(site, fixed), 15)
        rec.notes.append(f"leaderless for {time.monotonic() - killed_at:.1f} s (by design)")
        site.watcher.clear(root.name)
        await site.http.delete(f"/api/v1/schedules/{schedule_id}", params={"reason": "over"})

    return undo


async def _steered(site: Site, since: float) -> bool:
    return site.watcher.steered_since(since)


async def _takeovers(client: httpx.AsyncClient) -> int | None:
    try:
        r = await client.get("/api/v1/leadership")
    except httpx.HTTPError:
        return None
    return int(r.json()["takeovers"]) if r.status_code == 200 else None


_INJECT_CHECKED: dict[FaultKind, Callable[[Site, Fault, FaultRecord], Awaitable[Undo]]] = {
    FaultKind.SECOND_STORE: _intruder,
    FaultKind.OVERLAPPING_SCOPE: _intruder,
    FaultKind.STALE_STANDBY: _stale_standby,
    FaultKind.SKEWED_STANDBY_CLOCK: _skewed_standby,
}

# The faults done to the site's parts; every other kind is an adversary's message.
_INJECT: dict[FaultKind, Callable[[Site, str], Awaitable[Undo]]] = {
    FaultKind.CONTROLLER_KILL: _kill_controller,
    FaultKind.AGENT_KILL: _kill_agent,
    FaultKind.BROKER_KILL: _kill_broker,
    FaultKind.PARTITION: _partition,
    FaultKind.CLOCK_FORWARD: _clock_step(CLOCK_STEP_S),
    FaultKind.CLOCK_BACK: _clock_step(-CLOCK_STEP_S),
    FaultKind.OUT_OF_BAND: _out_of_band,
    FaultKind.DB_LOCK: _lock_db,
    FaultKind.DB_OUTAGE: _db_down,
    FaultKind.DB_SWITCHOVER: _db_down,  # longer: what a PostgreSQL switchover costs
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
        undo = await inject(site, fault, rec)
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
        await site.follow_leader()
        live, ready = await site.health()
        if live and ready and site.watcher.steered_since(rec.restored_s):
            rec.recovered_s = time.monotonic()
            break
        await asyncio.sleep(0.1)
    else:
        rec.notes.append(f"steering not back within {recover_timeout_s:g} s")
    return rec


# Database faults a leader steers through (`through_outage`; alone on SQLite, always): no
# node may fall to failsafe while one is held.
_STEERED_THROUGH = frozenset({FaultKind.DB_LOCK, FaultKind.DB_OUTAGE, FaultKind.DB_SWITCHOVER})


def _judge_windows(site: Site, records: list[FaultRecord], check: BudgetCheck) -> None:
    """Per fault: the facility's lowest point and time at failsafe while it was held, nodes
    that switched authority in its window, and a database fault that sent nodes to failsafe."""
    c = site.config
    fleet_failsafe_w = len(site.nodes) * (c.gpus * c.failsafe_w + NODE_OVERHEAD_W)
    for r in records:
        if not r.injected:
            continue
        r.facility_min_w, r.fleet_failsafe_s = check.root_between(
            r.injected_s, r.restored_s, fleet_failsafe_w
        )
        for s in site.watcher.switches:
            if r.injected_s <= s.t_s < r.window_end_s:
                r.findings.append(
                    f"{s.node} switched authority: {s.before.label()} -> {s.after.label()}"
                )
        if r.fault.kind in _STEERED_THROUGH:
            fell = sorted(
                {n for t, n in site.watcher.failsafe_entries if r.injected_s <= t < r.restored_s}
            )
            if fell:
                r.findings.append(f"nodes fell to failsafe while the store was down: {fell}")


def _restart_the_dead(site: Site, rec: FaultRecord) -> None:
    """A process that died on its own is a finding: note it, start it again, go on."""
    for member in site.members:
        if not member.alive:
            rec.controller_alive = False
            rec.notes.append(f"{member.name} died: {member.tail(5)}")
            site.start_controller(member)
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
    _judge_windows(site, records, check)
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
