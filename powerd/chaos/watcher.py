"""The outside watcher: the caps actually in force, every budget, at every change.

Ground truth is the mock backend's cap journal of each agent (powerd/backends/mock.py,
`CapJournal`): every change of a cap in force, written by the agent's own process with the
system-wide monotonic time. The watcher merges the journals on one time line with the
budgets in force and, at every event, checks Σ caps in force + overhead ≤ budget for every
group (node, rack, row, facility). It never asks the controller what it believes.

Budgets in force: the policy's; a temporary cut (admin API) is obeyed within a grace, as
docs/safety.md defines it ("cuts are obeyed within two ticks"): the old budget holds until
the watcher sees commands of the tick two past the first tick that knows the cut; clearing
a cut raises the budget at once (the controller can raise nothing before its next tick).

The broker is watched too, for context: ticks, acks and node states (recovery after a
fault), and messages that did not decode.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import math
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from powerd.policy import GroupDef, Policy, subtree_totals
from powerd.transport import Message, MqttConfig, MqttTransport
from powerd.wire import (
    Authority,
    CapAck,
    CapCommand,
    NodeState,
    NodeStatus,
    Topics,
    WireError,
    decode,
)

# Budgets are floats summed in different orders by the allocator and by us.
TOL_W = 0.01
# A journal line is written just after its cap is set; the watcher waits this long before it
# folds a moment into the check, so lines from every agent up to then have landed.
HORIZON_S = 1.0
CUT_GRACE_TICKS = 2


@dataclass
class Breach:
    """A group above its budget in force, from `start_s` to `end_s` (monotonic)."""

    group: str
    start_s: float
    end_s: float
    worst_w: float  # the largest overshoot: Σ caps + overhead − budget
    budget_w: float  # the budget at the worst moment
    committed_w: float  # Σ caps + overhead at the worst moment

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(order=True)
class _Event:
    t_s: float
    order: int  # arming and budget changes before cap changes at the same instant
    kind: Literal["arm", "budget", "cap"] = field(compare=False)
    name: str = field(compare=False)  # the GPU's node, or the group of a budget change
    uuid: str = field(compare=False)  # the GPU ("" for the others)
    watts: float = field(compare=False)  # NaN: the policy's budget again


class BudgetCheck:
    """Caps in force per GPU and budgets in force per group → breaches, event by event.

    Pure: feed it events in time order (`cap`, `budget`); `arm` starts the checking (before
    it, agents start up at whatever the GPUs held). A node's GPU that has no event yet counts
    at `unknown_w` (the device maximum).
    """

    def __init__(self, groups: tuple[GroupDef, ...], unknown_w: float = 700.0) -> None:
        self.groups = groups
        self.index = {g.name: i for i, g in enumerate(groups)}
        self.policy_budget_w = [g.budget_w for g in groups]
        self.budget_w = list(self.policy_budget_w)
        self.overhead_w = subtree_totals(groups, [g.overhead_w for g in groups])
        self.unknown_w = unknown_w
        self.caps: dict[str, dict[str, float]] = {g.name: {} for g in groups if g.level == 3}
        self.armed = False
        self.checks = 0
        self.breaches: list[Breach] = []
        self._open: dict[int, Breach] = {}
        self.committed_w = [0.0] * len(groups)
        self.t_s = -math.inf
        # ∫ committed dt per group since arming: a site held safe but starved shows here.
        self._committed_ws = [0.0] * len(groups)
        self._armed_s = math.nan
        # The root's Σ caps + overhead at each change (a step function), to read a fault's
        # lowest point and its time at failsafe back from.
        self.root_trace: list[tuple[float, float]] = []

    def arm(self, t_s: float) -> None:
        self.armed = True
        self._armed_s = t_s
        self._evaluate(t_s)

    def mean_committed_w(self, name: str) -> float:
        """Σ caps + overhead of a group, averaged over time from arming to the last event."""
        span = self.t_s - self._armed_s
        i = self.index[name]
        return self._committed_ws[i] / span if span > 0 else self.committed_w[i]

    def cap(self, t_s: float, node: str, uuid: str, watts: float) -> None:
        self.caps[node][uuid] = watts
        self._evaluate(t_s)

    def budget(self, t_s: float, group: str, watts: float | None) -> None:
        """The budget in force from t_s (None: the policy's again)."""
        i = self.index[group]
        self.budget_w[i] = self.policy_budget_w[i] if watts is None else watts
        self._evaluate(t_s)

    def finish(self, t_s: float) -> None:
        """Close breaches still open at the end of the run (and count time up to t_s)."""
        self._evaluate(t_s)
        for b in self._open.values():
            b.end_s = t_s
        self._open.clear()

    def _evaluate(self, t_s: float) -> None:
        if self.armed and t_s > self.t_s:
            for i, committed in enumerate(self.committed_w):
                self._committed_ws[i] += committed * (t_s - max(self.t_s, self._armed_s))
        self.t_s = max(self.t_s, t_s)
        per_node = [0.0] * len(self.groups)
        for i, g in enumerate(self.groups):
            if g.level == 3:
                caps = self.caps[g.name]
                per_node[i] = sum(caps.values()) + max(0, g.gpus - len(caps)) * self.unknown_w
        sums = subtree_totals(self.groups, per_node)
        self.committed_w = [s + o for s, o in zip(sums, self.overhead_w, strict=True)]
        if not self.armed:
            return
        if not self.root_trace or self.root_trace[-1][1] != self.committed_w[0]:
            self.root_trace.append((t_s, self.committed_w[0]))
        self.checks += 1
        for i, g in enumerate(self.groups):
            over = self.committed_w[i] - self.budget_w[i]
            b = self._open.get(i)
            if over > TOL_W:
                if b is None:
                    b = self._open[i] = Breach(g.name, t_s, t_s, 0.0, 0.0, 0.0)
                    self.breaches.append(b)
                if over > b.worst_w:
                    b.worst_w, b.budget_w = over, self.budget_w[i]
                    b.committed_w = self.committed_w[i]
                b.end_s = t_s
            elif b is not None:
                b.end_s = t_s
                del self._open[i]

    def group_committed_w(self, name: str) -> float:
        return self.committed_w[self.index[name]]

    def root_between(self, t0_s: float, t1_s: float, level_w: float) -> tuple[float, float]:
        """(the root's lowest Σ caps + overhead from t0 to t1, seconds of that span at or
        below `level_w`), from the step function of its changes since arming."""
        lowest, below_s = math.inf, 0.0
        for i, (t, w) in enumerate(self.root_trace):
            end = self.root_trace[i + 1][0] if i + 1 < len(self.root_trace) else self.t_s
            if t > t1_s or end <= t0_s:
                continue
            lowest = min(lowest, w)
            if w <= level_w + TOL_W:
                below_s += min(end, t1_s) - max(t, t0_s)
        return lowest, below_s


class JournalTail:
    """New whole lines of one agent's cap journal, from where the last read stopped."""

    def __init__(self, node: str, path: Path) -> None:
        self.node = node
        self.path = path
        self._offset = 0
        self._partial = b""

    def read_new(self) -> list[tuple[float, str, str, float]]:
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        out = []
        for line in lines:
            parts = line.decode(errors="replace").split()
            if len(parts) == 4:
                out.append((float(parts[0]), parts[1], parts[2], float(parts[3])))
        return out


@dataclass
class NodeContext:
    """What the broker says of one node (for recovery, not for the budget check)."""

    state: NodeState | None = None
    last_ack_tick: int = -1
    last_ack_at: float = -math.inf  # watcher's monotonic time of arrival
    acks: int = 0
    authority: Authority | None = None  # the one its status says it obeys


@dataclass(frozen=True)
class AuthoritySwitch:
    """A node's status named another authority than before (an alarm on both sides)."""

    t_s: float
    node: str
    before: Authority
    after: Authority


class Watcher:
    """Journals + budgets → `BudgetCheck`, live; broker traffic → context. `start`/`stop`."""

    def __init__(
        self,
        policy: Policy,
        journals: dict[str, Path],
        broker_url: str,
        topics: Topics | None = None,
    ) -> None:
        self.policy = policy
        self.topics = topics or Topics()
        self.tails = {node: JournalTail(node, path) for node, path in journals.items()}
        self.check = BudgetCheck(policy.groups)
        self.events: list[_Event] = []  # everything, for the exact replay at the end
        self._queue: list[_Event] = []  # not yet folded into the live check
        self._seq = 0
        self.armed_at: float | None = None
        self.transport = MqttTransport(MqttConfig.from_url(broker_url, client_id="chaos-watch"))
        self.nodes = {node: NodeContext() for node in journals}
        self.last_tick = -1
        self.last_tick_at = -math.inf
        self.tick_times: dict[int, float] = {}  # tick → first command seen (monotonic)
        self.messages: Counter[str] = Counter()
        self.undecodable: Counter[str] = Counter()
        self._cuts: list[tuple[str, float, int]] = []  # (group, W, strict from tick)
        self.switches: list[AuthoritySwitch] = []
        self.failsafe_entries: list[tuple[float, str]] = []  # (arrival, node) of each fall
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> None:
        await self.transport.connect()
        await self.transport.subscribe(f"{self.topics.prefix}/#", qos=1)
        self._tasks = [
            asyncio.create_task(self._listen(), name="chaos-watch-broker"),
            asyncio.create_task(self._poll(), name="chaos-watch-journals"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.transport.disconnect()
        self._read_journals()

    def arm(self) -> None:
        """Check every budget from now on (the site is up and steered)."""
        self.armed_at = time.monotonic()
        self._push(self.armed_at, "arm", "", "", math.nan)

    # -- budgets -------------------------------------------------------------------------

    def cut(self, group: str, watts: float, after_tick: int) -> None:
        """A temporary budget took effect after `after_tick` (the API's answer): it binds
        once commands of tick after_tick + 1 + CUT_GRACE_TICKS are seen."""
        self._cuts.append((group, watts, after_tick + 1 + CUT_GRACE_TICKS))

    def cut_pending(self) -> bool:
        """A cut is waiting for the tick it binds from."""
        return bool(self._cuts)

    def clear(self, group: str) -> None:
        """A temporary budget ends now (call before the API call that ends it)."""
        self._cuts = [c for c in self._cuts if c[0] != group]
        self._push(time.monotonic(), "budget", group, "", math.nan)

    # -- input ---------------------------------------------------------------------------

    def _push(
        self, t_s: float, kind: Literal["arm", "budget", "cap"], name: str, uuid: str, watts: float
    ) -> None:
        order = (0 if kind != "cap" else 10**12) + self._seq
        event = _Event(t_s, order, kind, name, uuid, watts)
        self._seq += 1
        self.events.append(event)
        heapq.heappush(self._queue, event)

    def _read_journals(self) -> None:
        for tail in self.tails.values():
            for t_s, _, uuid, watts in tail.read_new():
                self._push(t_s, "cap", tail.node, uuid, watts)

    async def _poll(self) -> None:
        while True:
            self._read_journals()
            self._fold(time.monotonic() - HORIZON_S)
            await asyncio.sleep(0.05)

    def _fold(self, until_s: float) -> None:
        while self._queue and self._queue[0].t_s <= until_s:
            self._apply(self.check, heapq.heappop(self._queue))

    @staticmethod
    def _apply(check: BudgetCheck, e: _Event) -> None:
        if e.kind == "arm":
            check.arm(e.t_s)
        elif e.kind == "budget":
            check.budget(e.t_s, e.name, None if math.isnan(e.watts) else e.watts)
        else:
            check.cap(e.t_s, e.name, e.uuid, e.watts)

    def replay(self, end_s: float) -> BudgetCheck:
        """The exact check over every event, in time order, whatever arrived late."""
        self._read_journals()
        check = BudgetCheck(self.policy.groups)
        for e in sorted(self.events):
            if e.t_s > end_s:
                break
            self._apply(check, e)
        check.finish(end_s)
        return check

    async def _listen(self) -> None:
        async for message in self.transport.messages():
            self._on_message(message, time.monotonic())

    def _on_message(self, message: Message, now: float) -> None:
        try:
            node, kind = self.topics.parse_node_topic(message.topic)
        except WireError:
            self.messages["controller"] += 1
            return
        self.messages[kind] += 1
        ctx = self.nodes.get(node)
        try:
            if kind == "caps":
                cmd = decode(message.payload, CapCommand, topic_node=node)
                if cmd.tick not in self.tick_times:  # the first node's command of a tick
                    # By arrival, not by value: a controller misled into huge ticks (or back
                    # from them) still shows as ticking.
                    self.last_tick, self.last_tick_at = cmd.tick, now
                    self.tick_times[cmd.tick] = now
                    self._on_tick(cmd.tick, now)
            elif kind == "ack" and ctx is not None:
                ack = decode(message.payload, CapAck, topic_node=node)
                ctx.last_ack_tick, ctx.last_ack_at = ack.tick, now
                ctx.acks += 1
            elif kind == "status" and ctx is not None:
                status = decode(message.payload, NodeStatus, topic_node=node)
                if status.state is NodeState.FAILSAFE and ctx.state is not NodeState.FAILSAFE:
                    self.failsafe_entries.append((now, node))
                ctx.state = status.state
                if status.authority is not None:
                    if ctx.authority is not None and status.authority != ctx.authority:
                        self.switches.append(
                            AuthoritySwitch(now, node, ctx.authority, status.authority)
                        )
                    ctx.authority = status.authority
        except WireError as exc:
            self.undecodable[f"{kind}:{exc.reason}"] += 1

    def _on_tick(self, tick: int, now: float) -> None:
        due = [c for c in self._cuts if tick >= c[2]]
        for group, watts, _ in due:
            self._push(now, "budget", group, "", watts)
        self._cuts = [c for c in self._cuts if tick < c[2]]

    # -- recovery ------------------------------------------------------------------------

    def steered_since(self, t_s: float) -> bool:
        """Every node acknowledged a command first sent after t_s and says it is steered."""
        for ctx in self.nodes.values():
            if ctx.state is not NodeState.STEERED or ctx.last_ack_at <= t_s:
                return False
            sent = self.tick_times.get(ctx.last_ack_tick)
            if sent is None or sent <= t_s:
                return False
        return True
