"""Rolling a node back: `powerd agent --restore-defaults` puts every GPU back to its default
power limit (NVML's nvmlDeviceGetPowerManagementDefaultLimit), reads each limit back and
reports it. An agent that stops leaves its GPUs at their failsafe caps, on purpose (nothing
watches the budgets once it is gone); this is the step that gives them back their defaults
when powerd leaves the node (docs/operations.md, "Rolling back").

It must not run beside an agent of the node (the agent would set its caps again, or this
would raise caps under a running controller's feet): a running agent holds `AgentLock`, an
flock on `agent.lock` in its state directory, for its whole life. The kernel drops an flock
when its process dies, so a crashed agent leaves no stale lock behind.

Nor may it raise limits behind a controller that still plans with the caps the agent left
(a clean stop's status names them): before raising, it publishes the node's retained status
as `offline` with no caps, what an agent's last will says, so a controller counts the
node's GPUs at their maximum and cuts the others to make room, and waits `settle_s` for
that to land. Without the broker it refuses (the controller could not be told), unless
forced.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import structlog

from powerd.agent.agent import build_backend, build_transport
from powerd.agent.settings import AgentSettings
from powerd.backends.base import BackendError, GpuBackend
from powerd.clock import SystemClock
from powerd.transport.base import TransportError
from powerd.wire import CAP_TOLERANCE_W, NodeState, NodeStatus, Topics, encode

log = structlog.get_logger(__name__)

LOCK_NAME = "agent.lock"
# How long to wait for the broker when announcing the node's departure.
CONNECT_TIMEOUT_S = 10.0
# After the announcement, before raising: a controller's tick to hear it and plan the
# node at its maximum, and one for the other nodes' cuts to be acknowledged, with margin.
SETTLE_S = 10.0
# Where powerd-agent.service keeps its state (StateDirectory=powerd/agent): a command run
# from a shell, without $STATE_DIRECTORY or state_dir, still finds the service's lock there.
SERVICE_STATE_DIR = Path("/var/lib/powerd/agent")


class AgentRunning(Exception):
    """Another process holds the node's agent lock."""

    def __init__(self, path: Path, pid: str) -> None:
        self.path = path
        self.pid = pid
        super().__init__(f"an agent (pid {pid or '?'}) holds {path}")


class AgentLock:
    """An exclusive flock on `state_dir/agent.lock`, which holds the holder's pid."""

    def __init__(self, state_dir: Path) -> None:
        self.path = state_dir / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take it now or raise AgentRunning; OSError if the file cannot be opened."""
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
            os.close(fd)
            raise AgentRunning(self.path, pid) from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing drops the flock
            self._fd = None


def hold_agent_lock(settings: AgentSettings) -> AgentLock | None:
    """The lock a running agent holds (None without a state directory, or if it cannot be
    made: logged, and the agent runs anyway; a node without its agent is worse).
    AgentRunning if another agent of this state directory runs."""
    if settings.state_dir is None:
        return None
    lock = AgentLock(settings.state_dir)
    try:
        lock.acquire()
    except OSError as exc:
        log.warning("agent_lock_unavailable", path=str(lock.path), error=str(exc))
        return None
    return lock


@dataclass(frozen=True)
class GpuRestored:
    """One GPU's limit before and after (None: could not be read), and what went wrong."""

    index: int
    uuid: str
    default_w: float
    before_w: float | None
    after_w: float | None
    error: str | None = None

    @property
    def ok(self) -> bool:
        after = self.after_w
        return (
            self.error is None
            and after is not None
            and abs(after - self.default_w) <= CAP_TOLERANCE_W
        )

    def line(self) -> str:
        def watts(w: float | None) -> str:
            return "?" if w is None else f"{w:.0f} W"

        if self.error is not None:
            outcome = f"FAILED: {self.error}"
        elif not self.ok:
            # Another limit holds it lower (a BMC's, a DCGM policy): nvidia-smi -q -d POWER.
            outcome = "FAILED: the enforced limit is not the default (another limit holds it)"
        else:
            outcome = "ok"
        return (
            f"GPU {self.index} {self.uuid}: {watts(self.before_w)} -> {watts(self.after_w)} "
            f"(default {watts(self.default_w)}) {outcome}"
        )


def restore_defaults(backend: GpuBackend) -> list[GpuRestored]:
    """Set every GPU's limit to its default, then read the limit in force back."""
    restored = []
    for info in backend.gpus():
        before: float | None
        try:
            before = backend.enforced_limit_w(info.uuid)
        except BackendError:
            before = None
        try:
            backend.set_power_limit_w(info.uuid, info.default_cap_w)
            after = backend.enforced_limit_w(info.uuid)
        except BackendError as exc:
            restored.append(
                GpuRestored(
                    info.index, info.uuid, info.default_cap_w, before, None, f"{exc.code}: {exc}"
                )
            )
            continue
        restored.append(GpuRestored(info.index, info.uuid, info.default_cap_w, before, after))
        log.info(
            "gpu_default_restored",
            gpu=info.uuid,
            from_w=before,
            to_w=after,
            default_w=info.default_cap_w,
        )
    return restored


def restore_node(
    settings: AgentSettings,
    *,
    force: bool,
    out: TextIO,
    err: TextIO,
    settle_s: float = SETTLE_S,
) -> int:
    """`powerd agent --restore-defaults [--force]`: 0 if every GPU is at its default limit
    now, 1 otherwise (or if an agent of this node runs, or the controller could not be told
    that the node leaves, without `force`)."""
    state_dir = settings.state_dir
    if state_dir is None and SERVICE_STATE_DIR.is_dir():
        state_dir = SERVICE_STATE_DIR
    lock = None
    if state_dir is None:
        if not force:
            print(
                "powerd agent --restore-defaults: no state_dir, so it cannot tell whether an "
                "agent runs on this node. Stop the agent, then run again with --force.",
                file=err,
            )
            return 1
    else:
        lock = AgentLock(state_dir)
        try:
            lock.acquire()
        except (AgentRunning, OSError) as exc:
            lock = None
            if not force:
                print(
                    f"powerd agent --restore-defaults: {exc}. An agent that runs sets its "
                    "caps again: stop it first (systemctl stop powerd-agent), or pass --force "
                    "if that process is no agent of this node.",
                    file=err,
                )
                return 1
            print(f"powerd agent --restore-defaults: --force: {exc}", file=err)
    try:
        try:
            asyncio.run(announce_departure(settings))
        except (OSError, TimeoutError, TransportError) as exc:
            if not force:
                print(
                    f"powerd agent --restore-defaults: cannot reach the broker "
                    f"({type(exc).__name__}: {exc}), so no controller can be told that the "
                    "node's GPUs go back to their defaults. Stop the controllers first, then "
                    "run again with --force.",
                    file=err,
                )
                return 1
            print(f"powerd agent --restore-defaults: --force: broker: {exc}", file=err)
        else:
            print(
                f"node {settings.node_id}: announced offline (no caps: a controller counts its "
                f"GPUs at their maximum); raising in {settle_s:g} s",
                file=out,
            )
            out.flush()
            time.sleep(settle_s)
        return _restore(settings, out)
    finally:
        if lock is not None:
            lock.release()


async def announce_departure(settings: AgentSettings, timeout_s: float | None = None) -> None:
    """Publish the node's retained status as `offline` with no caps (QoS 1, confirmed by the
    broker): a controller then counts its GPUs at their maximum. TimeoutError, OSError or
    TransportError (a publish the broker never confirmed) if the broker does not take it
    within `timeout_s` (default CONNECT_TIMEOUT_S)."""
    timeout_s = CONNECT_TIMEOUT_S if timeout_s is None else timeout_s
    transport = build_transport(settings)
    try:
        await transport.connect()
        await asyncio.wait_for(transport.wait_connected(), timeout_s)
        status = NodeStatus(node_id=settings.node_id, state=NodeState.OFFLINE)
        topic = Topics(settings.topic_prefix).status(settings.node_id)
        await asyncio.wait_for(
            transport.publish(topic, encode(status), qos=1, retain=True), timeout_s
        )
    finally:
        await transport.disconnect()


def _restore(settings: AgentSettings, out: TextIO) -> int:
    backend = build_backend(settings, SystemClock())  # BackendError: the caller's to report
    try:
        restored = restore_defaults(backend)
    finally:
        backend.close()
    for gpu in restored:
        print(gpu.line(), file=out)
    failed = [g for g in restored if not g.ok]
    print(
        f"node {settings.node_id}: {len(restored) - len(failed)} of {len(restored)} GPUs at "
        "their default power limit" + (f"; {len(failed)} FAILED" if failed else ""),
        file=out,
    )
    return 1 if failed else 0
