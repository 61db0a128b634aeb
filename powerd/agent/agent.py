"""The node agent: telemetry out, caps in, and a lease that keeps the node safe on its own.

Safety rules, which everything else here serves:
- The agent never raises a cap on its own. Only a valid CapCommand raises a cap.
- A command's caps hold for its `lease_s`. Without a valid command for that long (controller
  dead, broker down, network cut) every GPU goes to min(current cap, failsafe cap), and
  stays there until the next valid command. The same holds from start until the first one.
- Bad input (malformed, mismatched, replayed, oversized, retained) is counted by reason,
  logged and dropped; it never changes a cap and never stops the agent.
- Every sample checks each GPU's enforced limit against the one the agent last set. Above
  it (another tool, a GPU reset or a driver reload that brought the default limit back) the
  agent sets its limit again at once, before the sample is published; below it, it leaves
  the limit (setting it back would be a raise the controller did not plan from what it
  heard) and reports it. Either way telemetry carries `set_w` and the controller alarms.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

import structlog
from pydantic import ValidationError

from powerd import __version__
from powerd.agent.kubelet import PodSource
from powerd.agent.perf import PerfSource
from powerd.agent.settings import AgentSettings
from powerd.backends.base import BackendError, GpuBackend, GpuInfo, GpuReading
from powerd.clock import Clock
from powerd.transport.base import (
    LastWill,
    Message,
    Transport,
    TransportError,
    cancel_and_wait,
)
from powerd.transport.mqtt import MqttTransport
from powerd.wire import (
    CAP_TOLERANCE_W,
    LEGACY_AUTHORITY,
    MAX_SANE_WATTS,
    MAX_TICK,
    AckError,
    Authority,
    CapAck,
    CapCommand,
    GpuAck,
    GpuTelemetry,
    NodeState,
    NodeStatus,
    NodeTelemetry,
    Topics,
    WireError,
    decode,
    encode,
)

log = structlog.get_logger(__name__)


_TELEMETRY_STATE: dict[NodeState, Literal["steered", "failsafe", "starting"]] = {
    NodeState.STARTING: "starting",
    NodeState.STEERED: "steered",
    NodeState.FAILSAFE: "failsafe",
    NodeState.OFFLINE: "failsafe",  # only while shutting down, at failsafe caps
}


class Agent:
    """One node's agent. `run` until a stop event; counters are attributes for metrics.

    `rejected` counts dropped input by reason: the wire's (oversized, not_json, bad_version,
    invalid, node_mismatch) and the agent's (bad_topic, retained, stale_epoch, stale_tick,
    unknown_gpu). Commands are ordered by (epoch, tick): a command from a lower epoch than
    the highest seen is fenced (a deposed or paused leader), counted in `fenced` too.
    `unsent` counts messages that could not be published (disconnected), by kind.
    """

    def __init__(
        self, settings: AgentSettings, backend: GpuBackend, transport: Transport, clock: Clock
    ) -> None:
        self.settings = settings
        self.node_id = settings.node_id
        self.backend = backend
        self.transport = transport
        self.clock = clock
        self.topics = Topics(settings.topic_prefix)
        self.gpus: dict[str, GpuInfo] = {g.uuid: g for g in backend.gpus()}
        self.state = NodeState.STARTING
        self.last_tick: int | None = None
        self.epoch = 0  # the highest leader epoch seen in a command applied
        self.fenced = 0  # commands refused for a lower epoch
        # The one authority this agent obeys (docs/safety.md, "Authority"): its site, store
        # and domain. None until the first command. Another authority is refused while this
        # one is alive (`incumbent_until`), unless this one named it in `handover`.
        self.site = settings.site
        self.authority: Authority | None = None
        self.successors: tuple[Authority, ...] = ()
        self.previous_authority: Authority | None = None
        self.incumbent_until = -math.inf  # monotonic
        self.refused = 0  # commands refused for coming from another authority or site
        self.refused_authority: Authority | None = None
        self.refused_controller = ""
        self._refusal_published_at = -math.inf
        self._handed_until = -math.inf  # no handover back to the previous one before this
        # Site, authority and epoch survive a restart here (written before a command that
        # changes them is applied); `epoch` is the file of earlier releases (epoch only).
        state_dir = settings.state_dir
        self.state_file = None if state_dir is None else state_dir / "authority.json"
        self.epoch_file = None if state_dir is None else state_dir / "epoch"
        self.lease_until = 0.0  # monotonic time at which the last command's caps lapse
        self.caps_w: dict[str, float] = {}  # enforced caps, as last read back
        # The limit this agent last set per GPU (a command's cap, or its failsafe cap): what
        # every sample's read-back is checked against.
        self.set_w: dict[str, float] = {}
        # The limit requested through the driver per GPU, as last read (NVML's management
        # limit: a predecessor's set, the default after a reset); unknown for a BMC's GPUs.
        self.requested_w: dict[str, float] = {}
        self.restores: Counter[str] = Counter()  # limits found above set_w and set back
        self.found_w: dict[str, float] = {}  # the limit found, the latest time
        self._differs: set[str] = set()  # GPUs whose read-back differed at the last sample
        self.failsafe_w: dict[str, float] = {}  # from the latest command
        self.seq = 0
        self.rejected: Counter[str] = Counter()
        self.unsent: Counter[str] = Counter()
        self.commands = 0  # valid commands applied
        self.caps_applied = 0  # per-GPU limits set successfully
        self.on_telemetry: list[Callable[[NodeTelemetry], None]] = []  # e.g. metrics
        # Where perf comes from when the backend has none (agent/perf.py); set by main.
        self.perf_source: PerfSource | None = None
        # Which job (and class) each GPU's pod has, in Kubernetes (agent/kubelet.py).
        self.pod_source: PodSource | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.log = log.bind(node=self.node_id)

    # -- lifecycle -----------------------------------------------------------------------

    async def run(self, stop: asyncio.Event) -> None:
        await asyncio.to_thread(self._load_state)
        self._sample()
        self._enforce_failsafe()
        self.log.info("agent_started", gpus=len(self.gpus), state=self.state)
        will = LastWill(
            self.topics.status(self.node_id),
            encode(
                NodeStatus(
                    node_id=self.node_id,
                    state=NodeState.OFFLINE,
                    keeps_limits=self.backend.keeps_limits,
                )
            ),
        )
        await self.transport.connect(will=will, on_connect=self._publish_status)
        await self.transport.subscribe(self.topics.caps(self.node_id), qos=1)
        try:
            async with asyncio.TaskGroup() as tg:
                loops = [
                    tg.create_task(self._telemetry_loop(), name=f"agent-{self.node_id}-telemetry"),
                    tg.create_task(self._command_loop(), name=f"agent-{self.node_id}-commands"),
                    tg.create_task(self._lease_loop(), name=f"agent-{self.node_id}-lease"),
                ]
                await stop.wait()
                await cancel_and_wait(loops)
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        # Nobody watches the lease once we are gone, so leave the node at its failsafe caps.
        self._enforce_failsafe()
        self.state = NodeState.OFFLINE
        await self._publish_status()
        await self.transport.disconnect()
        self.log.info("agent_stopped", caps_w=self.caps_w)

    # -- loops ---------------------------------------------------------------------------

    async def _telemetry_loop(self) -> None:
        period = self.settings.period_s
        next_at = self.clock.monotonic()
        while True:
            await self._publish_telemetry()
            next_at += period
            now = self.clock.monotonic()
            next_at = max(next_at, now)  # fell behind (suspended, overloaded): don't burst
            await self.clock.sleep(next_at - now)

    async def _command_loop(self) -> None:
        async for message in self.transport.messages():
            await self._on_message(message)

    async def _lease_loop(self) -> None:
        period = self.settings.period_s
        while True:
            now = self.clock.monotonic()
            if self.state is NodeState.STEERED and now >= self.lease_until:
                self.log.warning("lease_expired", last_tick=self.last_tick)
                self.state = NodeState.FAILSAFE
                self._enforce_failsafe()
                await self._publish_status()
            elif self.state is not NodeState.STEERED and self._enforce_failsafe():
                # A cap read back above failsafe (an out-of-band tool, a GPU back from the
                # dead) is lowered again while nobody steers.
                await self._publish_status()
            wait = period
            if self.state is NodeState.STEERED:
                wait = min(period, self.lease_until - now)
            await self.clock.sleep(wait)

    # -- commands ------------------------------------------------------------------------

    async def _on_message(self, message: Message) -> None:
        if message.topic != self.topics.caps(self.node_id):
            self._reject("bad_topic", message.topic[:200])
            return
        if message.retain:
            # A retained command could be any age; replaying it after a restart is unsafe.
            self._reject("retained", "commands must not be retained")
            return
        try:
            cmd = decode(message.payload, CapCommand, topic_node=self.node_id)
        except WireError as exc:
            self._reject(exc.reason, exc.detail)
            return
        change = self._authority_change(cmd)
        if change is None:
            return  # refused, counted and reported
        if change in ("same", "first"):  # first: an epoch kept by an earlier release
            if cmd.epoch < self.epoch:
                self.fenced += 1
                self._reject("stale_epoch", f"epoch {cmd.epoch} < {self.epoch} (tick {cmd.tick})")
                return
            newer_leader = cmd.epoch > self.epoch
            if not newer_leader and self.last_tick is not None and cmd.tick <= self.last_tick:
                self._reject("stale_tick", f"tick {cmd.tick} <= last applied {self.last_tick}")
                return
        else:
            newer_leader = True
        if change != "same":
            if change != "first":
                # Epochs order leaders within one authority only: another one starts afresh.
                self.log.warning(
                    "authority_changed",
                    how=change,
                    previous=None if self.authority is None else self.authority.label(),
                    now=cmd.authority.label(),
                    controller=cmd.controller_id,
                )
                self.previous_authority = self.authority
                self.last_tick = None
                self._handed_until = self.clock.monotonic() + cmd.lease_s
            self.authority = cmd.authority
            if self.site is None and cmd.authority.site:  # enrolled by its first site
                self.site = cmd.authority.site
        self.successors = tuple(cmd.handover)
        if newer_leader:
            await self._save_state(cmd.epoch, cmd.lease_s)
        # The first command of a new leader (or authority) never raises a cap: an old
        # leader may have cut since the new one last heard this node, and the new one's
        # hold on a cap it read would then be a raise nobody planned (docs/safety.md,
        # "Steering through a database outage"). The ack says what was enforced.
        ack = self._apply(cmd, hold=newer_leader)
        self.incumbent_until = self.lease_until
        self.commands += 1
        await self._send("ack", self.topics.ack(self.node_id), ack, qos=1)
        await self._publish_status()

    def _authority_change(self, cmd: CapCommand) -> str | None:
        """Whether `cmd`'s authority may command this node: "same" (the one obeyed),
        "first" (none yet), "handover" (named by the one obeyed), "takeover" (the one obeyed
        has been silent for its lease: the node is at its failsafe caps), or None: refused,
        so that two authorities can never take turns on one node."""
        a = cmd.authority
        if self.site is not None and a.site != self.site:
            self._refuse(cmd, "foreign_site", f"site {a.site!r}, enrolled in {self.site!r}")
            return None
        if self.authority is None:
            return "first"
        if a == self.authority:
            return "same"
        now = self.clock.monotonic()
        back_too_soon = a == self.previous_authority and now < self._handed_until
        if (a in self.successors and not back_too_soon) or self.authority == LEGACY_AUTHORITY:
            # Named by the one obeyed; or that one is a controller of a release before
            # authorities (the empty one): an upgrade must not cost a lease at failsafe.
            # Not straight back to the one just left (two authorities naming each other
            # would flip the node at every command): that waits one lease.
            return "handover"
        if now < self.incumbent_until:
            self._refuse(
                cmd, "other_authority", f"{a.label()} while {self.authority.label()} is alive"
            )
            return None
        return "takeover"

    def _refuse(self, cmd: CapCommand, reason: str, detail: str) -> None:
        self.refused += 1
        fresh = cmd.authority != self.refused_authority
        self.refused_authority = cmd.authority
        self.refused_controller = cmd.controller_id
        self._reject(reason, f"{detail} (controller {cmd.controller_id!r}, tick {cmd.tick})")
        # The status names the refused authority, so both controllers alarm: at once for a
        # new one, then once a period (a refused controller commands every tick).
        now = self.clock.monotonic()
        if fresh or now - self._refusal_published_at >= self.settings.period_s:
            self._refusal_published_at = now
            self._status_soon()

    def _status_soon(self) -> None:
        task = asyncio.get_running_loop().create_task(self._publish_status())
        self._pending.add(task)  # a reference until it ends; _send logs its own failures
        task.add_done_callback(self._pending.discard)

    def _load_state(self) -> None:
        """(worker thread) Site, authority and epoch kept by a previous run. The authority
        obeyed then counts as alive for one of its leases from now: a restart does not let
        another authority in sooner than silence would."""
        if self.state_file is None:
            return
        try:
            doc = json.loads(self.state_file.read_text(encoding="utf-8"))
            site = doc.get("site")
            authority = None if doc.get("authority") is None else Authority(**doc["authority"])
            epoch, lease_s = int(doc.get("epoch", 0)), float(doc.get("lease_s", 0.0))
            if not (0 <= epoch <= MAX_TICK and 0.0 <= lease_s <= 86_400.0):
                raise ValueError(f"epoch {epoch} or lease_s {lease_s} out of range")
        except FileNotFoundError:
            if self.epoch_file is not None:
                self.epoch = self._load_epoch(self.epoch_file)
            return
        except (OSError, ValueError, TypeError, AttributeError, ValidationError) as exc:
            self.log.warning(
                "authority_not_loaded", path=str(self.state_file), error=str(exc)[:300]
            )
            return
        if self.site is None and isinstance(site, str) and site:
            self.site = site
        self.authority, self.epoch = authority, epoch
        self.incumbent_until = self.clock.monotonic() + lease_s
        self.log.info(
            "authority_loaded",
            authority=None if authority is None else authority.label(),
            epoch=epoch,
            site=self.site,
        )

    async def _save_state(self, epoch: int, lease_s: float) -> None:
        """Keep the site, authority and `epoch` before a command that sets them is applied. A
        failure is logged, not fatal: the command is safe to apply; only a later restart
        would forget them."""
        if self.state_file is None:
            return
        doc = {
            "site": self.site,
            "authority": None if self.authority is None else self.authority.model_dump(),
            "epoch": epoch,
            "lease_s": lease_s,
        }
        try:
            await asyncio.to_thread(_write_atomically, self.state_file, json.dumps(doc) + "\n")
        except OSError as exc:
            self.log.warning(
                "authority_not_saved", path=str(self.state_file), epoch=epoch, error=str(exc)
            )

    def _load_epoch(self, path: Path) -> int:
        """(worker thread) The epoch kept by a previous run; 0 if none or unreadable."""
        try:
            text = path.read_text(encoding="ascii").strip()
        except FileNotFoundError:
            return 0
        except OSError as exc:
            self.log.warning("epoch_not_loaded", path=str(path), error=str(exc))
            return 0
        if not text.isdigit() or int(text) > MAX_TICK:
            self.log.warning("epoch_not_loaded", path=str(path), error=f"not an epoch: {text!r}")
            return 0
        return int(text)

    def _reject(self, reason: str, detail: str) -> None:
        self.rejected[reason] += 1
        self.log.warning("input_rejected", reason=reason, detail=detail)

    def _apply(self, cmd: CapCommand, *, hold: bool = False) -> CapAck:
        """Apply a valid command: decreases first, so the node never sums above before/after.
        `hold`: no cap rises (each GPU gets at most the limit it has)."""
        acks: dict[str, GpuAck] = {}
        plan: list[tuple[float, str, float, float]] = []  # (change, uuid, requested, target)
        for uuid, requested in cmd.caps.items():
            info = self.gpus.get(uuid)
            if info is None:
                self._reject("unknown_gpu", uuid)
                acks[uuid] = GpuAck(requested_w=requested, error=AckError.UNKNOWN_GPU)
                continue
            target = min(max(requested, info.min_cap_w), info.max_cap_w)
            current = self.caps_w.get(uuid, info.max_cap_w)
            if hold:
                target = min(target, current)
            plan.append((target - current, uuid, requested, target))
        # Decreases (and holds) first, then raises: the node never sums above before/after.
        # Each phase goes to the backend at once (a BMC sets them concurrently; NVML one by
        # one, in this order).
        ordered = sorted(plan)
        for phase in ([p for p in ordered if p[0] <= 0], [p for p in ordered if p[0] > 0]):
            if not phase:
                continue
            before = {
                uuid: (self.set_w.get(uuid), self._found_above(uuid)) for _, uuid, _, _ in phase
            }
            results = self.backend.set_power_limits_w(
                [(uuid, target) for _, uuid, _, target in phase]
            )
            for (_, uuid, requested, target), result in zip(phase, results, strict=True):
                acks[uuid] = ack = self._record_set(uuid, requested, target, result)
                mine, found = before[uuid]
                if mine is not None and found is not None and ack.enforced_w is not None:
                    self._restored(self.gpus[uuid], found, mine, ack.enforced_w, by="command")
        for uuid, watts in cmd.failsafe_w.items():
            if uuid in self.gpus:
                self.failsafe_w[uuid] = watts
        self.last_tick = cmd.tick
        self.epoch = cmd.epoch
        self.lease_until = self.clock.monotonic() + cmd.lease_s
        if self.state is not NodeState.STEERED:
            self.log.info("steering_resumed", tick=cmd.tick, previous=self.state)
        self.state = NodeState.STEERED
        self.log.debug("caps_applied", tick=cmd.tick, caps_w=self.caps_w)
        return CapAck(
            node_id=self.node_id,
            tick=cmd.tick,
            epoch=cmd.epoch,
            authority=cmd.authority,
            gpus=acks,
            ts=self.clock.wall(),
        )

    def _set_cap(self, uuid: str, requested: float, target: float) -> GpuAck:
        try:
            result: float | BackendError = self.backend.set_power_limit_w(uuid, target)
        except BackendError as exc:
            result = exc
        return self._record_set(uuid, requested, target, result)

    def _record_set(
        self, uuid: str, requested: float, target: float, result: float | BackendError
    ) -> GpuAck:
        """What a set of `target` came to (the enforced limit read back, or the error)."""
        if not isinstance(result, BackendError) and not 0 <= result <= MAX_SANE_WATTS:
            # A read-back no GPU has (NaN, negative, beyond any device): the limit in force
            # is unknown, so nothing is kept and the ack says the set failed (the
            # controller keeps counting the GPU at its committed cap).
            result = BackendError(f"limit read back as {result!r}", uuid)
        if isinstance(result, BackendError):
            exc = result
            self.log.warning(
                "cap_set_failed", gpu=uuid, watts=target, error=exc.code, detail=str(exc)
            )
            return GpuAck(requested_w=requested, error=exc.code)
        enforced = result
        self.caps_w[uuid] = enforced
        self.set_w[uuid] = target
        self.requested_w[uuid] = target  # the driver's requested limit is this set now
        self.caps_applied += 1
        if abs(enforced - target) > CAP_TOLERANCE_W:
            self.log.warning("cap_overridden", gpu=uuid, watts=target, enforced_w=enforced)
            return GpuAck(requested_w=requested, enforced_w=enforced, error=AckError.OVERRIDDEN)
        return GpuAck(requested_w=requested, enforced_w=enforced)

    # -- failsafe ------------------------------------------------------------------------

    def failsafe_cap_w(self, info: GpuInfo) -> float:
        watts = self.failsafe_w.get(info.uuid, self.settings.failsafe_w or info.min_cap_w)
        return min(max(watts, info.min_cap_w), info.max_cap_w)

    def _enforce_failsafe(self) -> bool:
        """Lower every GPU above its failsafe cap to it (never raise one); True if any moved.
        A GPU held lower by a limit another sets (an out-of-band cap) is judged by the limit
        it goes back to when the other lifts (`lifts_to_w`): left there, it would return
        above its failsafe cap with no controller counting it."""
        moves: list[tuple[str, float, float]] = []  # (uuid, target, current): decreases only
        for uuid, info in self.gpus.items():
            current = self.caps_w.get(uuid)
            if current is None:  # never read (lost GPU): nothing known to lower from
                continue
            current = max(current, self.lifts_to_w(uuid) or current)
            target = self.failsafe_cap_w(info)
            if current > target + CAP_TOLERANCE_W:
                moves.append((uuid, target, current))
        if not moves:
            return False
        moved = False
        results = self.backend.set_power_limits_w([(uuid, target) for uuid, target, _ in moves])
        for (uuid, target, current), result in zip(moves, results, strict=True):
            ack = self._record_set(uuid, target, target, result)
            moved = moved or ack.enforced_w is not None
            self.log.info("failsafe_cap", gpu=uuid, from_w=current, to_w=self.caps_w[uuid])
        return moved

    # -- publishing ----------------------------------------------------------------------

    def _sample(self) -> list[GpuTelemetry]:
        samples = []
        for uuid, info in self.gpus.items():
            try:
                reading = self._guard(info, self.backend.read(uuid))
                sample = self._telemetry(info, reading)
            except BackendError as exc:
                self.log.warning("gpu_read_failed", gpu=uuid, error=exc.code, detail=str(exc))
                sample = self._failed_telemetry(info, str(exc.code))
            except ValidationError as exc:
                self.log.warning("gpu_reading_invalid", gpu=uuid, detail=str(exc)[:300])
                sample = self._failed_telemetry(info, "invalid_reading")
            samples.append(sample)
        return samples

    def _guard(self, info: GpuInfo, r: GpuReading) -> GpuReading:
        """Check the enforced limit read back against the one this agent set (unsteered: no
        higher than the failsafe cap either). Above it, set it again now: a sample never
        reports, and a GPU never keeps, a limit above what the controller counts, for
        longer than one sample period. Below it, report only (docs/safety.md, "Limits
        powerd did not set")."""
        uuid = info.uuid
        mine = self.set_w.get(uuid)
        limit = mine
        if self.state is not NodeState.STEERED:
            failsafe = self.failsafe_cap_w(info)
            limit = failsafe if limit is None else min(limit, failsafe)
        if limit is None:  # nothing set yet (steered, before a command names the GPU)
            return r
        # Under a lower limit another holds (a BMC's), the enforced one cannot show a limit
        # raised behind the agent's back (a reset's default, `nvidia-smi -pl`, a set whose
        # read-back failed): the driver's requested limit does, and the GPU goes there when
        # the other lets go.
        requested = self._requested(info, r)
        found = r.cap_w if requested is None else max(r.cap_w, requested)
        if found > limit + CAP_TOLERANCE_W:
            ack = self._set_cap(uuid, limit, limit)
            if ack.enforced_w is None:  # logged (cap_set_failed); the next sample tries again
                return r
            r = replace(r, cap_w=ack.enforced_w, requested_w=limit)
            if mine is None or found <= mine + CAP_TOLERANCE_W:
                # Not a limit of ours replaced: the failsafe cap enforced (at start, or one
                # never lowered to it).
                self.log.info("failsafe_cap", gpu=uuid, from_w=found, to_w=ack.enforced_w)
                return r
            self._restored(info, found, mine, ack.enforced_w, by="sample")
        differs = abs(r.cap_w - self.set_w.get(uuid, r.cap_w)) > CAP_TOLERANCE_W
        if differs and uuid not in self._differs:
            self._differs.add(uuid)
            self.log.warning(
                "cap_differs", gpu=uuid, enforced_w=r.cap_w, set_w=self.set_w.get(uuid)
            )
        elif not differs and uuid in self._differs:
            self._differs.discard(uuid)
            self.log.info("cap_matches", gpu=uuid, enforced_w=r.cap_w)
        return r

    def _reported_set_w(self, uuid: str, enforced: float) -> float | None:
        """Telemetry's `set_w`: the limit this agent set, or, where another's lower limit
        holds the GPU under the driver's requested one and that is higher than the set (a
        limit raised behind the agent's back that it could not set back: a permission
        lost), the requested one: what the GPU goes back to when the lower limit lifts.
        (Without a lower limit in the way, such a raise shows in the enforced limit itself,
        and the set stays what it is, for `cap_overridden`.)"""
        mine = self.set_w.get(uuid)
        requested = self.requested_w.get(uuid)
        if mine is None or requested is None or requested <= enforced + CAP_TOLERANCE_W:
            return mine
        return self.lifts_to_w(uuid)

    @staticmethod
    def _requested(info: GpuInfo, r: GpuReading) -> float | None:
        """The driver's requested limit of a reading, where known and possible (a value
        beyond the GPU's maximum is no reading: the GPU cannot go there)."""
        w = r.requested_w
        if w is None or not 0 <= w <= info.max_cap_w + CAP_TOLERANCE_W:  # (NaN: neither)
            return None
        return w

    def _found_above(self, uuid: str) -> float | None:
        """Before a command sets a GPU's limit: the limit in force if it is above the one
        this agent set (changed since the last sample); the command's set puts it back, and
        counts as a restore when it succeeds. None otherwise."""
        mine = self.set_w.get(uuid)
        if mine is None:
            return None
        try:
            found = self.backend.enforced_limit_w(uuid)
        except BackendError:
            return None  # the set that follows fails too, and its ack says so
        return found if found > mine + CAP_TOLERANCE_W else None

    def _restored(
        self, info: GpuInfo, found: float, mine: float, enforced: float | None, *, by: str
    ) -> None:
        uuid = info.uuid
        self.restores[uuid] += 1
        self.found_w[uuid] = found
        self.log.warning(
            "cap_restored",
            gpu=uuid,
            found_w=found,
            set_w=mine,
            enforced_w=enforced,
            by=by,  # the sample that found it, or the command that was about to set it
            # At its default limit: a GPU reset, a driver reload, a reboot (or a tool that
            # set exactly the default).
            cause="default_limit"
            if abs(found - info.default_cap_w) <= CAP_TOLERANCE_W
            else "foreign_limit",
        )

    def _telemetry(self, info: GpuInfo, r: GpuReading) -> GpuTelemetry:
        pod = None if self.pod_source is None else self.pod_source.of(info.uuid)
        requested = self._requested(info, r)
        if requested is not None:
            self.requested_w[info.uuid] = requested
        else:
            self.requested_w.pop(info.uuid, None)
        sample = GpuTelemetry(
            uuid=info.uuid,
            index=info.index,
            name=info.name,
            power_w=r.power_w,
            energy_j=r.energy_j,
            cap_w=r.cap_w,
            min_cap_w=info.min_cap_w,
            max_cap_w=info.max_cap_w,
            default_cap_w=info.default_cap_w,
            temp_c=r.temp_c,
            util_pct=r.util_pct,
            sm_clock_mhz=r.sm_clock_mhz,
            throttle=r.throttle,
            workload=r.workload if pod is None or pod.cls is None else pod.cls,
            job=None if pod is None else pod.job,
            perf=r.perf if self.perf_source is None else self.perf_source.value(info.uuid),
            set_w=self._reported_set_w(info.uuid, r.cap_w),
            restores=self.restores[info.uuid],
            found_w=self.found_w.get(info.uuid),
        )
        # Kept only once the reading passed the wire's bounds: a limit read back as NaN or
        # beyond them must not become the cap a later failed sample reports.
        self.caps_w[info.uuid] = r.cap_w
        return sample

    def _failed_telemetry(self, info: GpuInfo, error: str) -> GpuTelemetry:
        """A GPU we could not read: the cap is the last known (else the maximum), no readings."""
        return GpuTelemetry(
            uuid=info.uuid,
            index=info.index,
            name=info.name,
            power_w=0.0,
            energy_j=0.0,
            cap_w=self.caps_w.get(info.uuid, info.max_cap_w),
            min_cap_w=info.min_cap_w,
            max_cap_w=info.max_cap_w,
            default_cap_w=info.default_cap_w,
            temp_c=0.0,
            util_pct=0.0,
            sm_clock_mhz=0.0,
            error=error,
        )

    async def _publish_telemetry(self) -> None:
        msg = NodeTelemetry(
            node_id=self.node_id,
            ts=self.clock.wall(),
            seq=self.seq,
            period_s=self.settings.period_s,
            gpus=self._sample(),
            state=_TELEMETRY_STATE[self.state],
            # Read with the sample (nothing awaits between): the controller orders readings
            # by the command they reflect.
            tick=self.last_tick,
            epoch=None if self.last_tick is None else self.epoch,
        )
        self.seq += 1
        for hook in self.on_telemetry:
            try:
                hook(msg)
            except Exception:
                self.log.exception("telemetry_hook_failed")
        await self._send("telemetry", self.topics.telemetry(self.node_id), msg, qos=0)

    def lifts_to_w(self, uuid: str) -> float | None:
        """The limit GPU `uuid` goes back to should a lower one another holds lift: the
        larger of the one this agent set and the one the driver reads as requested (a
        predecessor's set, which a new agent process knows only from there). None: neither
        known."""
        known = [w for w in (self.set_w.get(uuid), self.requested_w.get(uuid)) if w is not None]
        return max(known) if known else None

    def lifts_to_all_w(self) -> dict[str, float]:
        """`lifts_to_w` of every GPU that has one (the retained status's `set_w`)."""
        return {u: w for u in self.gpus if (w := self.lifts_to_w(u)) is not None}

    def status_message(self) -> NodeStatus:
        """What the retained status says now."""
        return NodeStatus(
            node_id=self.node_id,
            state=self.state,
            ts=self.clock.wall(),
            last_tick=self.last_tick,
            epoch=self.epoch,
            fenced=self.fenced,
            gpus=len(self.gpus),
            agent_version=__version__,
            caps_w=self.caps_w,
            set_w=self.lifts_to_all_w(),
            authority=self.authority,
            refused=self.refused,
            refused_authority=self.refused_authority,
            refused_controller=self.refused_controller,
            previous_authority=self.previous_authority,
            keeps_limits=self.backend.keeps_limits,
        )

    async def _publish_status(self) -> None:
        status = self.status_message()
        await self._send("status", self.topics.status(self.node_id), status, qos=1, retain=True)

    async def _send(
        self,
        kind: str,
        topic: str,
        msg: CapAck | NodeStatus | NodeTelemetry,
        qos: int,
        retain: bool = False,
    ) -> None:
        try:
            await self.transport.publish(topic, encode(msg), qos=qos, retain=retain)
        except TransportError as exc:
            self.unsent[kind] += 1
            self.log.debug("publish_failed", kind=kind, error=str(exc))


def _write_atomically(path: Path, text: str) -> None:
    """Replace `path` with `text`, durably: a crash leaves the old file or the new one."""
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w", encoding="ascii") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


async def run_agent(
    settings: AgentSettings,
    backend: GpuBackend,
    transport: Transport,
    clock: Clock,
    stop: asyncio.Event,
) -> None:
    """Run one node's agent until `stop` is set; leaves the node at failsafe caps."""
    await Agent(settings, backend, transport, clock).run(stop)


def build_backend(settings: AgentSettings, clock: Clock) -> GpuBackend:
    """The backend the settings name: NVML (imported only here), or a mock fleet of one node."""
    if settings.backend == "nvml":
        from powerd.backends.nvml import NvmlBackend

        return NvmlBackend(clock)
    from powerd.backends.mock import MockBackend, SimulatedGpus, Workload

    fleet = SimulatedGpus(
        settings.mock_gpus,
        Workload.of(settings.mock_workload),
        seed=settings.mock_seed,
        start_s=clock.monotonic(),
        uuid_prefix=f"GPU-{settings.node_id}",
    )
    return MockBackend(fleet, clock, journal=settings.mock_journal)


def build_transport(settings: AgentSettings) -> MqttTransport:
    return MqttTransport(settings.mqtt_config())
