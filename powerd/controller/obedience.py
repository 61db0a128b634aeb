"""Who each node obeys, and at which tick and epoch (docs/safety.md, "Authority"): the tick's
bookkeeping of the authority this controller commands for, the epochs and ticks its nodes
report, other authorities they refuse or obey, and rival controllers over our domain.

Nodes that obey another authority (`foreign`), or a newer leader of ours (`ahead`), count
at their GPUs' maximum in the planner (`count_foreign`); our next tick overtakes what the
nodes say they applied, without letting a minority push it (`next_tick`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import structlog

from powerd.alarms import Alarms, Severity
from powerd.policy import Policy, overlapping_domains
from powerd.safety import SafetyPlanner
from powerd.wire import (
    LEGACY_AUTHORITY,
    MAX_TICK,
    Authority,
    ControllerState,
    ControllerStatus,
    NodeStatus,
)

log = structlog.get_logger(__name__)

# A restarted controller's first tick lies this far above the newest it has heard of: its
# predecessor may have sent ticks nobody reported yet, and agents apply only newer ticks, so
# ours must overtake all of them (ticks are plain numbers: 1,000 is minutes of a run at 1 s).
TAKEOVER_TICK_GAP = 1000
# Nodes (or controllers) an alarm's message names; the rest are counted.
ALARM_NAMES = 5


class Obedience:
    """The authority we command for, and what the nodes say of whom they obey."""

    def __init__(self) -> None:
        # The authority this controller commands for; None: none to compare with (the
        # simulator, a shadow).
        self.authority: Authority | None = None
        # The epoch our commands carry (the controller sets it each tick it leads). Within
        # our authority, a node that reports a higher one obeys a newer leader (`ahead`:
        # counted at its maximum, like a foreign node); an ack of a lower one is an older
        # leader's and resolves none of ours; `superseded_by`: the highest epoch another
        # controller of our authority says it leads at (its retained status).
        self.epoch = 0
        self.superseded_by = 0
        self.ahead: dict[str, int] = {}
        self.foreign: dict[str, Authority] = {}
        # The newest tick each node says it applied (statuses, acks): ours must stay above
        # them, or its agent refuses our commands.
        self._node_ticks: dict[str, int] = {}
        # The epoch each node reports (acks, statuses) and the commands it refused for a
        # lower one (statuses): a new leader's epoch must overtake what the agents have seen.
        self._node_epochs: dict[str, int] = {}
        self._node_fenced: dict[str, int] = {}
        self._intruders: dict[str, tuple[Authority, str, int, float]] = {}
        self._rivals: dict[str, ControllerStatus] = {}  # controller id → its status
        # Controllers whose retained status names another site: on this topic prefix, a
        # broker that carries them may be another site's (docs/safety.md, "Which broker").
        self._other_sites: dict[str, str] = {}  # controller id → its site
        self._came_over: dict[str, Authority] = {}  # node → the authority it left (events)
        self.outliers: tuple[str, ...] = ()

    # -- what messages say -----------------------------------------------------------------

    def obeys_us(self, node: str, authority: Authority | None) -> bool:
        """Whether a node's message speaks for the authority we command for; a node that
        obeys another is foreign until it says otherwise. None: an agent that obeys nobody
        yet (or an older agent), which any command of ours may still take."""
        ours = self.authority
        if ours is None or authority is None or authority in (ours, LEGACY_AUTHORITY):
            if self.foreign.pop(node, None) is not None:
                log.warning("node_obeys_us_again", node=node)
            return True
        if self.foreign.get(node) != authority:
            log.warning("node_obeys_another_authority", node=node, authority=authority.label())
        self.foreign[node] = authority
        return False

    def our_epoch(self, node: str, epoch: int, *, status: bool = False) -> bool:
        """Whether a node's ack (or status) of `epoch` is news of our commands. A higher
        epoch: the node obeys a newer leader of our authority (fenced away from us; counted
        at its maximum: one node's word moves nothing else). A lower one: an older leader's
        ack, which resolves none of ours (its ticks may even run above ours); a status of
        a lower epoch still tells the caps in force, as readings."""
        ours = self.epoch
        if ours in (0, epoch):
            self.ahead.pop(node, None)
            return True
        if epoch > ours:
            self.ahead[node] = epoch
            return False
        self.ahead.pop(node, None)
        return status

    def telemetry_epoch(self, node: str, epoch: int | None) -> bool:
        """Whether a node's telemetry is of our epoch (or says none): a higher one obeys a
        newer leader of ours."""
        if epoch is not None and epoch > self.epoch > 0:
            self.ahead[node] = epoch
            return False
        return True

    def seen(self, node: str, tick: int | None, epoch: int | None = None) -> None:
        """A tick (and epoch) the node says it applied or acknowledged."""
        if tick is not None:
            self._node_ticks[node] = max(self._node_ticks.get(node, 0), tick)
        if epoch is not None:
            self._node_epochs[node] = max(self._node_epochs.get(node, 0), epoch)

    def seen_acks(self, acks: Sequence[tuple[str, int, object]], epoch: int) -> None:
        """`seen(node, tick, epoch)` of each ack (node, tick, ...) in turn."""
        ticks, epochs = self._node_ticks, self._node_epochs
        for node, tick, _ in acks:
            ticks[node] = max(ticks.get(node, 0), tick)
            epochs[node] = max(epochs.get(node, 0), epoch)

    def seen_tick(self, nodes: Sequence[str], tick: int, epoch: int) -> None:
        """`seen(node, tick, epoch)` of each node in turn (one tick's acks)."""
        ticks, epochs = self._node_ticks, self._node_epochs
        for node in nodes:
            t = ticks.get(node)
            if t is None or t < tick:
                ticks[node] = max(0, tick) if t is None else tick
            e = epochs.get(node)
            if e is None or e < epoch:
                epochs[node] = max(0, epoch) if e is None else epoch

    def restarted(self, node: str) -> None:
        """A new agent process: it applies any tick."""
        self._node_ticks.pop(node, None)

    def fenced(self, node: str, count: int) -> None:
        self._node_fenced[node] = count

    def note_came_over(self, node: str, status: NodeStatus, alarms: Alarms, wall: float) -> None:
        """A node that obeys us now and obeyed another authority before (after that one's
        silence, or a handover): an event naming the one it left, once per change."""
        prev = status.previous_authority
        ours = self.authority
        if ours is None or status.authority != ours or prev in (None, LEGACY_AUTHORITY, ours):
            return
        assert prev is not None
        if self._came_over.get(node) == prev:
            return
        self._came_over[node] = prev
        alarms.once(
            "authority_changed",
            f"node {node} now obeys this controller; it obeyed {prev.label()} before",
            wall,
            severity=Severity.WARNING,
            data={"node": node, "previous": prev.model_dump()},
        )

    def note_refusals(self, node: str, status: NodeStatus, now: float) -> None:
        """Another authority that a node of ours refuses (its refusals grew): an intruder."""
        other = status.refused_authority
        if self.authority is None or other is None or other == self.authority:
            return
        seen = self._intruders.get(node)
        if seen is None or status.refused > seen[2]:
            self._intruders[node] = (other, status.refused_controller, status.refused, now)

    def on_controller_status(
        self, controller_id: str, status: ControllerStatus, policy: Policy
    ) -> None:
        """Another controller's retained status: one that leads (or would) for another
        authority over an overlapping domain is a rival, alarmed by name."""
        ours = self.authority
        other = status.authority
        # A stopped one's status (its will) clears it: it says nothing of the broker now.
        if (
            ours is not None
            and other is not None
            and other != LEGACY_AUTHORITY
            and other.site != ours.site
            and status.state is not ControllerState.OFFLINE
        ):
            self._other_sites[controller_id] = other.site
        else:
            self._other_sites.pop(controller_id, None)
        if ours is not None and other == ours:
            self._rivals.pop(controller_id, None)
            if status.state is ControllerState.ACTIVE and status.epoch is not None:
                # A newer leader of our own authority: a leader steering through a
                # database outage stops here (docs/safety.md).
                self.superseded_by = max(self.superseded_by, status.epoch)
            return
        if ours is None or other is None:
            self._rivals.pop(controller_id, None)
            return
        domains = {ours.domain, *overlapping_domains(policy, ours.domain)}
        overlaps = other.site == ours.site and other.domain in domains
        if status.state is ControllerState.ACTIVE and overlaps:
            self._rivals[controller_id] = status
        else:
            self._rivals.pop(controller_id, None)

    # -- what a tick needs -----------------------------------------------------------------

    def standby(self) -> None:
        """A standby commands nothing, so no epoch is ours: the leader's messages are news
        of the caps in force (a standby that led before must not take the epoch it led at
        for its own, or it would take the leader's nodes for a newer leader's)."""
        self.epoch = 0
        self.ahead.clear()

    def agents_epoch(self, nodes: Collection[str]) -> int:
        """The epoch the agents have seen: the median over *every* node of the policy (one
        that reported none counts as 0), so no minority of nodes can push a leader's epoch
        where it likes (as with ticks, `next_tick`)."""
        epochs = sorted(self._node_epochs.get(n, 0) for n in nodes)
        return epochs[len(epochs) // 2] if epochs else 0

    def fenced_total(self) -> int:
        """Commands the agents say they refused for a lower epoch, summed over the nodes."""
        return sum(self._node_fenced.values())

    def next_tick(self, nodes: Collection[str], last: int) -> int:
        """Our next tick after `last`: above every tick the nodes say they applied, with room
        for any a predecessor sent that nobody reported (first tick, or when we fall behind:
        a controller that ticked before hearing its agents).

        A node cannot push our ticks where it likes: a tick more than TAKEOVER_TICK_GAP
        above the median over *every* node of the policy (a node that reported none counts
        as 0) is not followed. A predecessor sends all nodes the same ticks, so honest nodes
        agree; the outlier's agent refuses our commands and stays at its failsafe caps, and
        it is alarmed (`tick_outliers`)."""
        known = self._node_ticks
        ticks = [known.get(n, 0) for n in nodes]
        ceiling = sorted(ticks)[len(ticks) // 2] + TAKEOVER_TICK_GAP if ticks else 0
        if max(known.values(), default=0) <= ceiling:  # no outlier (the common case)
            self.outliers = ()
            needed = max(ticks, default=0)
        else:
            self.outliers = tuple(sorted(n for n, t in known.items() if t > ceiling))
            needed = max((t for t in ticks if t <= ceiling), default=0)
        tick = last + 1
        if needed >= tick:
            if last:
                log.warning("ticks_behind", ours=last, theirs=needed)
            # A majority claiming absurd ticks still leaves half the tick space to run in.
            tick = max(tick, min(needed + TAKEOVER_TICK_GAP, MAX_TICK // 2))
        return tick

    def count_foreign(self, planner: SafetyPlanner, *, handing_over: bool) -> None:
        """Before planning: nodes that obey another authority, or a newer leader of ours,
        count at their maximum; while handing over, every node does."""
        for node, epoch in list(self.ahead.items()):
            if epoch <= self.epoch:  # we lead at that epoch (or above) now
                del self.ahead[node]
        for node in (*self.foreign, *self.ahead):
            planner.node_foreign(node)
        if handing_over:
            # Handing over: the successor may command any node from its first command on.
            planner.count_at_max()

    def alarm(self, alarms: Alarms, now: float, wall: float, lease_s: float) -> None:
        """Hosts that disagree about who commands (docs/safety.md, "Authority"), by name."""
        foreign = [(n, a.label()) for n, a in sorted(self.foreign.items())]
        foreign += [(n, f"a newer leader, epoch {e}") for n, e in sorted(self.ahead.items())]
        alarms.set(
            "foreign_authority",
            None
            if not foreign
            else f"{len(foreign)} nodes obey another authority and count at their GPUs' "
            "maximum: " + ", ".join(f"{n} ({a})" for n, a in foreign[:ALARM_NAMES]),
            wall,
        )
        sites = sorted(self._other_sites.items())
        alarms.set(
            "other_site_on_broker",
            None
            if not sites
            else f"this broker carries {len(sites)} controllers of another site, so it may "
            "not be this site's broker: "
            + ", ".join(f"{cid!r} (site {site!r})" for cid, site in sites[:ALARM_NAMES]),
            wall,
        )
        recent = lease_s * 3
        others: dict[tuple[Authority, str], list[str]] = {}
        for node, (auth, ctl, _, at) in sorted(self._intruders.items()):
            if now - at <= recent:
                others.setdefault((auth, ctl), []).append(node)
        for cid, st in sorted(self._rivals.items()):
            if st.authority is not None:
                others.setdefault((st.authority, cid), [])
        alarms.set(
            "authority_conflict",
            None
            if not others
            else "another authority commands (or leads) over our domain: "
            + "; ".join(
                f"controller {ctl!r} ({a.label()})"
                + (f", refused by {len(nodes)} of our nodes" if nodes else ", says it leads")
                for (a, ctl), nodes in list(others.items())[:ALARM_NAMES]
            ),
            wall,
        )
