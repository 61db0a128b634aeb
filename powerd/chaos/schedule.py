"""Faults as data: at t, do what, to whom, for how long.

`Fault.at_s` is the earliest start, in seconds after the site is up; the runner starts a
fault only once the one before it has been undone and steering has recovered (or its
recovery timed out), so each fault has a window of its own for the breaches it causes.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import StrEnum


class FaultKind(StrEnum):
    CONTROLLER_KILL = "controller_kill"  # SIGKILL, down for hold_s, start a new one
    AGENT_KILL = "agent_kill"  # SIGKILL the target node's agent, down for hold_s
    BROKER_KILL = "broker_kill"  # SIGKILL Mosquitto (retained state lost), down for hold_s
    PARTITION = "partition"  # cut the target agent's TCP path to the broker for hold_s
    CLOCK_FORWARD = "clock_forward"  # the target agent's wall clock +600 s for hold_s
    CLOCK_BACK = "clock_back"  # the target agent's wall clock −600 s for hold_s
    DB_LOCK = "db_lock"  # an exclusive lock on the store from another process, hold_s
    DB_OUTAGE = "db_outage"  # the store unreachable for hold_s
    BUDGET_CUT = "budget_cut"  # temporary budget (admin API) on the target group, cleared
    EVIL_ACK_TICK = "evil_ack_tick"  # an ack with tick 10^29 claiming 200 W caps
    EVIL_STATUS_TICK = "evil_status_tick"  # a retained status with last_tick 10^29
    EVIL_MIN_GT_MAX = "evil_min_gt_max"  # telemetry with min_cap_w > max_cap_w
    EVIL_GHOST_GPUS = "evil_ghost_gpus"  # telemetry listing 60 GPUs that do not exist
    EVIL_FOREIGN_UUID = "evil_foreign_uuid"  # telemetry with another node's GPUs at 200 W
    EVIL_TS_AHEAD = "evil_ts_ahead"  # telemetry an hour ahead claiming 200 W caps
    EVIL_OFFLINE_WILL = "evil_offline_will"  # the node's offline last will, node alive
    # A BMC holds the target node's GPUs at their minimum under powerd's caps for hold_s,
    # then lets go: they go back to powerd's caps at once, with no command in between.
    OUT_OF_BAND = "out_of_band"
    # Hosts that disagree (issue 27): real controllers where none should be, or a pair whose
    # members disagree with each other. Hold times count from the intruder being up.
    SECOND_STORE = "second_store"  # a 2nd controller, same policy, a SQLite store of its own
    OVERLAPPING_SCOPE = "overlapping_scope"  # a leftover `--scope <target>` on its own store
    STALE_STANDBY = "stale_standby"  # pair: leader's file lowered + SIGHUP; kill -9 the leader
    SKEWED_STANDBY_CLOCK = "skewed_standby_clock"  # pair: standby +1 h, a window; kill leader
    DB_SWITCHOVER = "db_switchover"  # the store unreachable for 10–30 s under the leader


NODE_FAULTS = frozenset(FaultKind) - {
    FaultKind.CONTROLLER_KILL,
    FaultKind.BROKER_KILL,
    FaultKind.DB_LOCK,
    FaultKind.DB_OUTAGE,
    FaultKind.BUDGET_CUT,
    FaultKind.SECOND_STORE,
    FaultKind.OVERLAPPING_SCOPE,
    FaultKind.STALE_STANDBY,
    FaultKind.SKEWED_STANDBY_CLOCK,
    FaultKind.DB_SWITCHOVER,
}
# Faults of a standby pair (two controllers on one PostgreSQL store): SiteConfig(pair=True).
PAIR_FAULTS = frozenset({FaultKind.STALE_STANDBY, FaultKind.SKEWED_STANDBY_CLOCK})

CLOCK_STEP_S = 600.0
OUT_OF_BAND_W = 200.0  # the mock GPUs' minimum: as far under powerd's caps as a BMC can hold
CUT_SHARE = 0.7  # a demand-response event takes this share of the group's budget
SKEW_S = 3600.0  # a standby's wall clock an hour ahead


def kinds_for(pair: bool) -> list[FaultKind]:
    """The kinds a site can suffer: a pair's only where there is a pair."""
    return [k for k in FaultKind if pair or k not in PAIR_FAULTS]


@dataclass(frozen=True)
class Fault:
    at_s: float
    kind: FaultKind
    target: str = ""  # a node (node faults) or a group (budget cuts); "" for the rest
    hold_s: float = 2.0

    def describe(self) -> str:
        target = f" {self.target}" if self.target else ""
        return f"{self.kind}{target} for {self.hold_s:.1f} s"


def short_schedule(
    nodes: list[str], group: str, scope: str = "rack-1", pair: bool = False
) -> list[Fault]:
    """Every kind the site can suffer once, back to back: the test suite's run (about two
    minutes of faults)."""
    victim = nodes[1]  # a training node in the first rack
    holds = {
        FaultKind.CONTROLLER_KILL: 1.0,
        FaultKind.AGENT_KILL: 1.0,
        FaultKind.BROKER_KILL: 1.0,
        FaultKind.PARTITION: 4.0,  # past the 3 s lease: the node falls to failsafe
        FaultKind.CLOCK_FORWARD: 3.0,
        FaultKind.CLOCK_BACK: 3.0,
        FaultKind.DB_LOCK: 3.0,
        FaultKind.DB_OUTAGE: 7.0,  # past SQLite's 5 s busy_timeout: writes fail
        FaultKind.OUT_OF_BAND: 3.0,  # ticks enough for the room to go elsewhere
        FaultKind.BUDGET_CUT: 3.0,
        FaultKind.SECOND_STORE: 4.0,
        FaultKind.OVERLAPPING_SCOPE: 4.0,
        FaultKind.STALE_STANDBY: 5.0,
        FaultKind.SKEWED_STANDBY_CLOCK: 6.0,
        FaultKind.DB_SWITCHOVER: 10.0,
    }
    faults = []
    for kind in kinds_for(pair):
        faults.append(Fault(0.0, kind, _target(kind, victim, group, scope), holds.get(kind, 2.0)))
    return faults


def _target(kind: FaultKind, node: str, group: str, scope: str) -> str:
    if kind in NODE_FAULTS:
        return node
    if kind is FaultKind.BUDGET_CUT:
        return group
    if kind is FaultKind.OVERLAPPING_SCOPE:
        return scope
    return ""


_HOLD_RANGE_S = {
    FaultKind.CONTROLLER_KILL: (0.5, 6.0),
    FaultKind.AGENT_KILL: (0.5, 6.0),
    FaultKind.BROKER_KILL: (0.5, 6.0),
    FaultKind.PARTITION: (1.0, 8.0),
    FaultKind.CLOCK_FORWARD: (2.0, 8.0),
    FaultKind.CLOCK_BACK: (2.0, 8.0),
    FaultKind.DB_LOCK: (1.0, 4.0),
    FaultKind.DB_OUTAGE: (6.0, 12.0),
    # Up to past the 60 s demand window: the held GPUs' recent peaks fall to the BMC's
    # limit, and the room under it may go to other GPUs.
    FaultKind.OUT_OF_BAND: (10.0, 70.0),
    FaultKind.BUDGET_CUT: (3.0, 10.0),
    FaultKind.SECOND_STORE: (4.0, 10.0),
    FaultKind.OVERLAPPING_SCOPE: (4.0, 10.0),
    FaultKind.STALE_STANDBY: (4.0, 10.0),
    FaultKind.SKEWED_STANDBY_CLOCK: (5.0, 12.0),
    FaultKind.DB_SWITCHOVER: (10.0, 30.0),  # a PostgreSQL switchover
}


def soak_schedule(
    duration_s: float,
    seed: int,
    nodes: list[str],
    groups: list[str],
    scopes: list[str],
    *,
    pair: bool = False,
) -> list[Fault]:
    """Random faults for `duration_s`: every kind the site can suffer in turn (shuffled
    rounds), random targets (`scopes`: rows and racks), holds and gaps; the same seed gives
    the same list."""
    rng = random.Random(seed)
    kinds = kinds_for(pair)
    faults: list[Fault] = []
    t = 3.0
    while t < duration_s:
        rng.shuffle(kinds)
        for kind in kinds:
            if t >= duration_s:
                break
            lo, hi = _HOLD_RANGE_S.get(kind, (1.0, 4.0))
            target = _target(kind, rng.choice(nodes), rng.choice(groups), rng.choice(scopes))
            faults.append(Fault(round(t, 1), kind, target, round(rng.uniform(lo, hi), 1)))
            t += rng.uniform(2.0, 6.0)
    return faults
