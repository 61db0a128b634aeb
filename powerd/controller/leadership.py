"""Which controller of a scope commands: a lease in the database, renewed by the leader.

Two modes (docs/operations.md, "A standby pair"):

- **lease** (PostgreSQL, the default there): any number of controllers run for a scope; the
  one holding the lease commands, the others stand by with a warm view. A leader whose
  renewals merely stop (a paused host) stops commanding at a deadline of its own, before
  the lease could lapse on the database's clock (docs/safety.md has the timing argument);
  one whose renewals fail (the database unreachable) steers on until a newer leader is
  heard (`through_outage`). A standby takes the lease only once it has lapsed, under a
  higher epoch that agents use to refuse the old leader
  (docs/decisions/0004-leases-epochs-failsafe.md).
- **alone** (SQLite, the embedded default): one controller, which commands whether or not the
  database answers (a lone controller keeps steering from its policy file through an outage).
  It still holds the lease, so that a second controller on the same store refuses to start.

The database calls block: they run in a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Literal

import structlog
from sqlalchemy.engine import make_url

from powerd.policy import Control
from powerd.settings import SettingsError
from powerd.store.db import make_engine
from powerd.store.leases import Lease, Leases, Member

log = structlog.get_logger(__name__)

Mode = Literal["lease", "alone"]
LEADER = "leader"
STANDBY = "standby"

# How much slower than the database's the leader's clock may run (docs/safety.md).
CLOCK_RHO = 1e-3
# How far a controller's wall clock may stand from its database's before it may not lead:
# scheduled windows and temporary budgets bind on the wall clock (docs/safety.md, "Time").
MAX_CLOCK_SKEW_S = 2.0


def boot_clock() -> float:
    """Seconds on a clock that also runs while the host is suspended (CLOCK_BOOTTIME): a
    leader's deadline must pass during a suspend, as the lease does on the database."""
    return time.clock_gettime(time.CLOCK_BOOTTIME)


def mode_for(leadership: str, db_url: str) -> Mode:
    """`auto`: alone on SQLite (the embedded store of one process), a lease otherwise."""
    if leadership == "lease":
        return "lease"
    if leadership == "alone":
        return "alone"
    url = make_url(db_url) if "://" in db_url else None
    return "alone" if url is None or url.get_backend_name() == "sqlite" else "lease"


def for_daemon(
    db_url: str,
    *,
    scope: str,
    holder: str,
    control: Control,
    lease_s: float | None,
    mode: Mode,
    setting: str = "leader_lease_s",
    wall: Callable[[], float] = time.time,
) -> Leadership:
    """The leadership of a daemon (controller or coordinator) with the default timings:
    a lease of `lease_s` (default 0.4 × the policy's lease_s) renewed every min(lease / 4,
    tick_s), on its own engine whose statements give up after max(renewal, lease / 2): a
    lease answer that comes late is worthless, and the daemon's store may hold its own
    connections through a long outage. Under a lease, a takeover (lease + renewal + one
    tick) must end before the leases it hands out (agents' caps, scopes' budgets: the
    policy's lease_s) run out; SettingsError otherwise."""
    lease = lease_s or 0.4 * control.lease_s
    renew_s = min(lease / 4, control.tick_s)
    takeover_s = lease + renew_s + control.tick_s
    if mode == "lease" and takeover_s >= control.lease_s:
        raise SettingsError(
            "settings",
            [
                (
                    setting,
                    f"a takeover may take lease + renewal + one tick = {takeover_s:g} s, "
                    f"which must be shorter than the policy's lease_s ({control.lease_s:g} s) "
                    "or what it steers falls to failsafe during a failover",
                )
            ],
        )
    return Leadership(
        Leases(make_engine(db_url, timeout_s=max(renew_s, lease / 2))),
        scope=scope,
        holder=holder,
        lease_s=lease,
        renew_s=renew_s,
        mode=mode,
        margin_s=min(0.25, lease / 10),
        wall=wall,
    )


def process_name(holder: str) -> str:
    """The controller's name in a lease holder (`name/nonce`: one process of it)."""
    return holder.rsplit("/", 1)[0]


class StartRefused(Exception):
    """This controller may not run here (another controller holds an SQLite store)."""


@dataclass(frozen=True)
class LeadershipView:
    """A scope's leadership as this controller sees it, for status, the API and metrics."""

    scope: str
    controller_id: str
    mode: Mode
    role: str  # "leader" or "standby"
    epoch: int  # the epoch of the leader's lease (ours while we lead)
    leader: str | None  # the lease's holder, as last read (None: never led, or unknown)
    lease_left_s: float | None  # leading: time left before we stop commanding
    members: tuple[Member, ...]  # every controller of the scope heard from recently
    takeovers: int  # times this controller began to lead
    stepped_down: int  # times it stopped leading (lease lost or not renewed in time)
    db_failures: int  # lease attempts that failed in a row
    last_error: str | None


@dataclass(frozen=True)
class _Round:
    lease: Lease | None
    current: Lease | None
    members: tuple[Member, ...]


class Leadership:
    """Takes and renews the scope's lease every `renew_s`; says whether we may command."""

    def __init__(
        self,
        leases: Leases,
        *,
        scope: str,
        holder: str,
        lease_s: float,
        renew_s: float,
        mode: Mode = "lease",
        clock: Callable[[], float] = boot_clock,
        margin_s: float = 0.25,
        wall: Callable[[], float] = time.time,
        max_skew_s: float = MAX_CLOCK_SKEW_S,
    ) -> None:
        if not 0 < renew_s < lease_s:
            raise ValueError("renew_s must be positive and shorter than lease_s")
        if not lease_s * (1 - CLOCK_RHO) - margin_s > renew_s:
            raise ValueError("lease_s is too short for its renewal interval and margin")
        self.leases = leases
        self.scope = scope
        self.name = holder
        # The lease is held by this process, not by its name: a second process started
        # with the same id (a copied config) cannot renew a lease it did not take, and a
        # restarted one takes it anew (epoch + 1) once its predecessor's has lapsed.
        self.holder = f"{holder}/{secrets.token_hex(4)}"
        self.lease_s = lease_s
        self.renew_s = renew_s
        self.mode: Mode = mode
        self.clock = clock
        self.margin_s = margin_s
        self.wall = wall
        self.max_skew_s = max_skew_s
        # A leader that cannot reach its database keeps commanding past its deadline until
        # it hears of a newer leader (`supersede`): safety rests on the epoch fence and on
        # counting unacknowledged GPUs at their maximum, not on the lease's timing
        # (docs/safety.md, "Steering through a database outage"). Controllers do; the
        # coordinator keeps its deadline.
        self.through_outage = False
        # The scope registry (docs/operations.md, "Scopes"): the lease domains that overlap
        # ours (the groups above and below our scope). While one of them is led, and its
        # leader does not hand its nodes to us, we do not take our lease (`overlap_error`).
        self.overlaps: tuple[str, ...] = ()
        self.handing_to: Callable[[], tuple[str, ...]] = tuple
        self.overlap_error: str | None = None
        self._acquired_at: float | None = None  # our lease's, on the database's clock
        # The store's id as its database says (under a lease, no lease without it: the
        # authority we would command for names it; a start during an outage only guessed).
        self.store_id: str | None = None
        self.outage_since: float | None = None  # on `clock`, while leading through one
        # Our wall clock minus the database's, as last measured (None: not yet), and why we
        # may not lead while it is too large (None: it agrees).
        self.skew_s: float | None = None
        self.skew_error: str | None = None
        self.leading = mode == "alone"
        self.epoch = 0  # of the lease we hold or last held; 0 before the first
        self.leader: str | None = None
        self.leader_epoch = 0
        self.members: tuple[Member, ...] = ()
        self.takeovers = 0
        self.stepped_down = 0
        self.failures = 0
        self.last_error: str | None = None
        self._deadline = -math.inf  # on `clock`: we stop commanding then
        # Set whenever the role changes: the tick loop wakes at once, not at its next tick.
        self.changed = asyncio.Event()
        # The operators' state as the database holds it: awaited after the lease is taken
        # and before the first command (a failure keeps us from commanding this round), and
        # at every round a standby makes (failures logged).
        self.follow: Callable[[], Awaitable[object]] | None = None
        # Every round that reached the database, leading or not: the policy of record.
        self.each_round: Callable[[], Awaitable[object]] | None = None
        self._ready = mode == "alone"

    # -- what the controller asks --------------------------------------------------------

    def may_command(self) -> bool:
        """True while this controller may send commands: alone, always; under a lease,
        only while leading, ready, and before the local deadline, or past it while the
        database cannot be reached (`through_outage`)."""
        if self.mode == "alone":
            return True
        in_time = self.clock() < self._deadline or self._through_outage()
        return self.leading and self._ready and in_time

    def _through_outage(self) -> bool:
        """Past the deadline: whether we steer on because the database failed us (its last
        attempt failed, before the deadline or after it), as opposed to renewals that
        merely stopped (a paused host), which end leadership at the deadline."""
        if self.outage_since is not None:
            return True
        if not (self.through_outage and self._ready and self.leading and self.failures > 0):
            return False
        self.outage_since = self.clock()
        log.error(
            "steering_through_db_outage",
            scope=self.scope,
            epoch=self.epoch,
            failures=self.failures,
            why="the lease could not be renewed; commanding until a newer leader is heard "
            "(the epoch fences it)",
        )
        return True

    def supersede(self, epoch: int) -> None:
        """Another controller of our authority says it leads at a higher `epoch`: stop at
        once if we lead through a database outage. With the database answering, the lease
        decides (a stale retained status of a dead controller must not stop a leader)."""
        if self.outage_since is not None and self.leading and epoch > self.epoch:
            self._lost(f"a newer leader commands (epoch {epoch} > {self.epoch})")
            self.changed.set()

    def view(self) -> LeadershipView:
        leading = self.may_command()
        leader = self.holder if leading and self.mode == "alone" else self.leader
        return LeadershipView(
            scope=self.scope,
            controller_id=self.name,
            mode=self.mode,
            role=LEADER if leading else STANDBY,
            epoch=self.epoch if leading else self.leader_epoch,
            leader=None if leader is None else process_name(leader),
            lease_left_s=max(0.0, self._deadline - self.clock())
            if leading and self.mode == "lease"
            else None,
            members=tuple(
                Member(process_name(m.holder), m.role, m.epoch, m.age_s) for m in self.members
            ),
            takeovers=self.takeovers,
            stepped_down=self.stepped_down,
            db_failures=self.failures,
            last_error=self.last_error,
        )

    # -- start (alone) -------------------------------------------------------------------

    async def claim_alone(self, *, wait_s: float | None = None) -> None:
        """Alone: take the store's lease before the first tick. Another controller's lease
        that lapses within `wait_s` (default: one lease; a predecessor that died) is taken;
        one that is renewed meanwhile refuses the start (StartRefused). A database that does
        not answer lets the controller steer anyway (it is alone)."""
        give_up = self.clock() + (self.lease_s + self.renew_s if wait_s is None else wait_s)
        while True:
            try:
                got = await asyncio.to_thread(self._round, 0)
            except Exception as exc:
                self._failed(exc)
                return
            if got.lease is not None:
                self._won(got.lease, self.clock())
                self._heard(got)
                return
            if self.clock() >= give_up:
                held = got.current
                who = (
                    "another controller"
                    if held is None
                    else f"controller {process_name(held.holder)!r}"
                )
                raise StartRefused(
                    f"{who} holds scope {self.scope!r} of this SQLite store and keeps "
                    "renewing its lease. SQLite is the embedded store for one controller; "
                    "run controllers that stand by for each other on PostgreSQL "
                    "(docs/operations.md, 'A standby pair'), or stop the other one."
                )
            log.info(
                "lease_held_by_another",
                scope=self.scope,
                holder=None if got.current is None else got.current.holder,
                why="waiting for it to lapse (a predecessor that stopped) before starting",
            )
            await asyncio.sleep(self.renew_s)

    # -- the loop ------------------------------------------------------------------------

    async def run(self, stop: asyncio.Event, above: Callable[[], int]) -> None:
        """Until `stop`: one attempt every `renew_s`. `above()`: the highest epoch agents
        report that is not ours (0 if none): a new lease's epoch goes above it."""
        while not stop.is_set():
            await self.attempt(above())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.renew_s)
        await self._step_down_cleanly()

    async def attempt(self, above: int = 0) -> None:
        """One round: take or renew the lease, say we are here, read who else is."""
        t0 = self.clock()  # before the statement is sent: the lease runs from later
        was = self.may_command()
        try:
            got = await asyncio.to_thread(self._round, above)
        except Exception as exc:
            self._failed(exc)
        else:
            self._heard(got)
            if got.lease is not None:
                self._won(got.lease, t0)
                if not self._ready:
                    await self._prepare()
            else:
                if self.leading and self.mode == "lease":
                    self._lost(
                        self.skew_error
                        or self.overlap_error
                        or "another controller holds the lease"
                    )
                await self._follow_quietly()
            await self._each_round_quietly()
        if self.may_command() != was:
            self.changed.set()

    def _round(self, above: int) -> _Round:
        """(worker thread) Check our clock against the database's; take or renew (only while
        they agree), then note ourselves and read the members."""
        if self.store_id is None:
            self.store_id = self.leases.store_id()
        known = self.mode == "alone" or self.store_id is not None
        agrees = known and self._check_clock() and self._check_overlap()
        lease = (
            self.leases.acquire(self.scope, self.holder, self.lease_s, above=above)
            if agrees
            else None
        )
        role = LEADER if lease is not None else STANDBY
        epoch = lease.epoch if lease is not None else 0
        current = lease
        members: tuple[Member, ...] = self.members
        try:
            handing = ",".join(self.handing_to()) if lease is not None else ""
            self.leases.heartbeat(self.scope, self.holder, role, epoch, handing or None)
            members = tuple(self.leases.members(self.scope, within_s=3 * self.lease_s))
            if lease is None:
                current = self.leases.current(self.scope)
        except Exception as exc:  # the lease itself is decided; the rest is for status
            log.warning("lease_members_unread", error=f"{type(exc).__name__}: {exc}"[:200])
        return _Round(lease, current, members)

    def _check_clock(self) -> bool:
        """(worker thread) Whether our wall clock agrees with the database's within
        `max_skew_s`, net of the time the reading took. A host that disagrees does not take
        or renew a lease: the windows it would enforce are judged on its wall clock."""
        before = self.wall()
        db_now = self.leases.db_time()
        after = self.wall()
        skew = (before + after) / 2 - db_now
        self.skew_s = skew
        if abs(skew) - (after - before) / 2 <= self.max_skew_s:
            if self.skew_error is not None:
                log.info("clock_skew_cleared", scope=self.scope, skew_s=round(skew, 3))
            self.skew_error = None
            return True
        if self.skew_error is None:
            log.error("clock_skew", scope=self.scope, skew_s=round(skew, 3))
        self.skew_error = (
            f"this host's wall clock is {skew:+.1f} s from its database's (at most "
            f"{self.max_skew_s:g} s allowed): it does not lead until they agree (NTP)"
        )
        return False

    def _check_overlap(self) -> bool:
        """(worker thread) Whether no overlapping scope is led by another controller that
        took its lease before ours (or while we hold none) and does not hand over to us."""
        if not self.overlaps:
            return True
        mine = self._acquired_at if self.leading else None
        blockers = [
            o
            for o in self.leases.overlapping(self.overlaps)
            if self.scope not in o.handing_to and (mine is None or o.acquired_at <= mine)
        ]
        if not blockers:
            if self.overlap_error is not None:
                log.info("scope_overlap_cleared", scope=self.scope)
            self.overlap_error = None
            return True
        named = ", ".join(f"{o.scope} (led by {process_name(o.holder)})" for o in blockers[:5])
        if self.overlap_error is None:
            log.error("scope_overlap", scope=self.scope, overlapping=named)
        self.overlap_error = (
            f"scope {self.scope!r} overlaps {named} on this store: it does not lead while "
            "they do (re-scope with a handover: docs/operations.md)"
        )
        return False

    def _heard(self, got: _Round) -> None:
        if self.outage_since is not None:
            log.warning(
                "db_outage_over",
                scope=self.scope,
                steered_through_s=round(self.clock() - self.outage_since, 3),
            )
            self.outage_since = None
        if self.failures:
            log.info("lease_store_back", scope=self.scope, failures=self.failures)
        self.failures = 0
        self.last_error = None
        self.members = got.members
        if got.current is not None and not got.current.lapsed:
            self.leader, self.leader_epoch = got.current.holder, got.current.epoch
        elif got.current is not None:
            self.leader, self.leader_epoch = None, got.current.epoch

    def _won(self, lease: Lease, t0: float) -> None:
        self._deadline = t0 + self.lease_s * (1 - CLOCK_RHO) - self.margin_s
        if not self.leading or lease.epoch != self.epoch:
            self.takeovers += self.mode == "lease"
            self._ready = self.mode == "alone"
            log.warning(
                "leadership_taken",
                scope=self.scope,
                controller=self.holder,
                epoch=lease.epoch,
                mode=self.mode,
            )
        self.leading = True
        self.epoch = lease.epoch
        self._acquired_at = lease.acquired_at
        self.leader, self.leader_epoch = self.holder, lease.epoch

    async def _follow_quietly(self) -> None:
        if self.follow is None:
            return
        try:
            await self.follow()
        except Exception as exc:
            log.warning("standby_not_following", error=f"{type(exc).__name__}: {exc}"[:300])

    async def _each_round_quietly(self) -> None:
        if self.each_round is None:
            return
        try:
            await self.each_round()
        except Exception as exc:
            log.warning("round_hook_failed", error=f"{type(exc).__name__}: {exc}"[:300])

    async def _prepare(self) -> None:
        """Before a new leader's first command: the operators' state and the policy of
        record as the database holds them."""
        try:
            if self.follow is not None:
                await self.follow()
            if self.each_round is not None:
                await self.each_round()
        except Exception as exc:
            self.last_error = (
                "holding the lease but not commanding: the operators' state could not be "
                f"read ({type(exc).__name__}: {exc})"
            )[:300]
            log.error(
                "leadership_not_ready",
                scope=self.scope,
                why="could not read the operators' state; not commanding this round",
                error=f"{type(exc).__name__}: {exc}"[:300],
            )
            return
        self._ready = True

    def _lost(self, why: str, *, leader_unknown: bool = False) -> None:
        self.leading = False
        self.outage_since = None
        if leader_unknown:
            self.leader = None  # until the database answers again
        self._ready = self.mode == "alone"
        self.stepped_down += 1
        log.warning("leadership_lost", scope=self.scope, controller=self.holder, why=why)

    def _failed(self, exc: Exception) -> None:
        self.failures += 1
        self.members = ()  # unknown while the database does not answer
        self.last_error = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
        log.warning(
            "lease_attempt_failed",
            scope=self.scope,
            failures=self.failures,
            error=self.last_error,
            commanding_for_s=round(max(0.0, self._deadline - self.clock()), 3)
            if self.mode == "lease" and self.leading
            else None,
        )
        if self.mode == "lease" and self.leading and self.clock() >= self._deadline:
            if self._through_outage():
                return
            self._lost("the lease could not be renewed in time", leader_unknown=True)

    def check_deadline(self) -> None:
        """Step down once the deadline has passed without a renewal (called each tick),
        unless the database could not be reached and we steer through the outage."""
        if self.mode != "lease" or not self.leading or self.clock() < self._deadline:
            return
        if self._through_outage():
            return
        self._lost("the lease could not be renewed in time", leader_unknown=True)
        self.changed.set()

    async def _step_down_cleanly(self) -> None:
        """A clean stop gives the lease up, so a standby need not wait for it to lapse."""
        leading = self.leading and self.mode == "lease"
        self.leading = False
        self._ready = False
        try:
            await asyncio.to_thread(self._leave, leading)
        except Exception as exc:
            log.warning("lease_not_released", error=f"{type(exc).__name__}: {exc}"[:200])

    def _leave(self, leading: bool) -> None:
        if leading or self.mode == "alone":
            self.leases.release(self.scope, self.holder)
        self.leases.forget(self.scope, self.holder)
