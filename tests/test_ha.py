"""A standby pair of real controller processes on real PostgreSQL and Mosquitto, four mock
agents, and the end-to-end monitor (tests/test_e2e.py), which rebuilds every GPU's
committed cap from the messages alone and checks every budget after every message.

Through one run: the leader killed with SIGKILL (the standby leads, commands within two
ticks of the lease lapsing, no node reaches failsafe), the new leader paused with SIGSTOP
past its lease and resumed (nothing of its lands: agents refuse its epoch), and PostgreSQL
cut off under the leader (it steers through the outage; the standby takes over and the old
leader stops when it hears the new one lead). Also: a standby refuses writes and names the
leader; a controller with the database down at start stands by until it holds the lease; a
second controller on an SQLite store refuses to start.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from support.e2e import NODES, TICK_S, WAIT_S, site_policy
from support.ha import SCOPE, Pair

from powerd.controller.leadership import process_name
from powerd.store.db import make_engine
from powerd.store.leases import Lease, Leases
from powerd.testing.mosquitto import LocalMosquitto

# Controllers, agents and tools as processes, for half a minute and more a test.
pytestmark = [pytest.mark.slow, pytest.mark.process]


async def _steady(p: Pair, leader: str, *, ask: tuple[str, ...] | None = None) -> None:
    """Every node acknowledges a command of `leader`, and the controllers running (or those
    in `ask`) name it as leader."""
    since = len(p.monitor.arrivals)

    def steered() -> bool:
        recent = {c.node_id for _, c in p.monitor.arrivals[since:] if c.controller_id == leader}
        return recent >= set(NODES)

    await p.until(steered, f"{leader} commands every node")
    await p.until(
        lambda: all(
            (p.leadership(n) or {}).get("leader") == leader
            for n in (ask if ask is not None else tuple(p.ctls))
            if n in p.procs.running
        ),
        f"every controller names {leader} as leader",
    )


async def _takeover(p: Pair, old: str, new: str, lease: Lease) -> float:
    """Wait for `new` to command; the seconds from the old lease's lapse to its first
    command (negative: before the lapse, which must not happen)."""

    def firsts() -> list[float]:
        return [at for at, c in p.commands_of(new) if c.epoch > lease.epoch]

    await p.until(lambda: bool(firsts()), f"{new} commands under a new epoch")
    first_at = min(firsts())
    return first_at - lease.expires_at


async def test_a_standby_pair_keeps_every_budget_through_kill_pause_and_db_loss(
    pair: Pair,
) -> None:
    p, mon = pair, pair.monitor
    for node in NODES:
        p.procs.agent(node)
    p.start("ctl-a")
    await p.until(lambda: bool(p.commands_of("ctl-a")), "ctl-a leads")
    p.start("ctl-b")
    await _steady(p, "ctl-a")
    assert p.leadership("ctl-b")["role"] == "standby"
    await p.until(
        lambda: (p.leadership("ctl-a") or {}).get("standbys") == ["ctl-b"],
        "the leader lists its standby",
    )

    # -- `powerd status` on the standby names the leader and the standbys ----------------
    proc = await asyncio.create_subprocess_exec(
        *(sys.executable, "-m", "powerd.cli", "status"),
        *("--url", f"http://127.0.0.1:{p.ctls['ctl-b'].port}", "--token", p.token),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(proc.communicate(), 60)
    assert proc.returncode == 0, err.decode()
    first_line = out.decode().splitlines()[0]
    assert first_line.startswith("scope dc: leader ctl-a (epoch 1); standbys ctl-b;"), first_line
    assert "[answered by standby ctl-b]" in first_line

    # -- a standby refuses writes and names the leader -----------------------------------
    with p.api("ctl-b") as c:
        r = c.put("/api/v1/budgets/dc", json={"budget_w": 7000, "reason": "to the standby"})
    assert r.status_code == 409 and "ctl-a" in r.json()["detail"]

    # -- the leader killed: the standby leads within two ticks of the lapse ---------------
    held = p.lease()
    assert held is not None and process_name(held.holder) == "ctl-a"
    p.procs.kill("ctl-a")
    lapse = p.lease()  # its last renewal: nothing renews it any more
    assert lapse is not None and process_name(lapse.holder) == "ctl-a"
    late_s = await _takeover(p, "ctl-a", "ctl-b", lapse)
    assert 0.0 <= late_s <= 2 * TICK_S, f"ctl-b's first command {late_s:.3f} s after the lapse"
    await _steady(p, "ctl-b")
    assert p.failsafe_nodes() == [], "no GPU reaches failsafe during a failover"
    b = p.leadership("ctl-b")
    assert b["role"] == "leader" and b["takeovers"] == 1 and b["epoch"] == lapse.epoch + 1
    assert mon.breaches == []

    # -- the new leader paused past its lease, then resumed: its epoch is refused ---------
    p.start("ctl-a")  # back as a standby
    await _steady(p, "ctl-b")
    p.procs.signal("ctl-b", signal.SIGSTOP)
    paused = p.lease()
    assert paused is not None and process_name(paused.holder) == "ctl-b"
    late_s = await _takeover(p, "ctl-b", "ctl-a", paused)
    assert 0.0 <= late_s <= 2 * TICK_S
    await p.until(
        lambda: all(mon.nodes[n].epoch > paused.epoch for n in NODES),
        "every node applied the new epoch",
    )
    resumed_at = time.time()
    p.procs.signal("ctl-b", signal.SIGCONT)
    await p.until(lambda: (p.leadership("ctl-b") or {}).get("role") == "standby", "ctl-b stands by")
    await _steady(p, "ctl-a")
    # Whatever ctl-b sent after it resumed, no agent applied it: every ack since is of the
    # new epoch (late commands of the old one are refused and counted as fenced).
    for n in NODES:
        assert all(a.epoch > paused.epoch for a in mon.nodes[n].acks if a.ts >= resumed_at)
    assert p.failsafe_nodes() == []
    assert mon.breaches == []

    # -- PostgreSQL cut off under the leader: it steers through the outage until it hears
    # -- the standby lead at a higher epoch (docs/safety.md, "Steering through a database
    # -- outage"); both command for a moment, and every budget holds ----------------------
    renewed = p.lease()
    assert renewed is not None and process_name(renewed.holder) == "ctl-a"
    p.ctls["ctl-a"].proxy.close()
    late_s = await _takeover(p, "ctl-a", "ctl-b", renewed)
    last = p.lease()
    assert last is not None and process_name(last.holder) == "ctl-b"
    assert late_s <= 1.2 + 2 * TICK_S  # the default lease: 0.4 × the agents' 3 s
    await _steady(p, "ctl-b", ask=("ctl-b",))
    # ctl-a stopped once ctl-b's retained status said it leads: within a few ticks of
    # ctl-b's first command, not at its own lease deadline.
    b_first = min(at for at, c in p.commands_of("ctl-b") if c.epoch == last.epoch)
    a_last = max(at for at, c in p.commands_of("ctl-a"))
    assert a_last <= b_first + 3 * TICK_S + 1.0
    cut_off = p.leadership("ctl-a") or {}
    assert cut_off.get("role") == "standby"
    assert cut_off["db_failures"] > 0 and cut_off["last_error"]
    assert p.failsafe_nodes() == []
    assert mon.breaches == []
    assert mon.bad == []
    # The database back: ctl-a stands by again and hears the leader.
    p.ctls["ctl-a"].proxy.open()
    await p.until(
        lambda: (p.leadership("ctl-a") or {}).get("leader") == "ctl-b", "ctl-a sees ctl-b lead"
    )


async def test_with_the_database_down_at_start_a_controller_stands_by(pair: Pair) -> None:
    p, mon = pair, pair.monitor
    for node in NODES:
        p.procs.agent(node)
    ctl = p.start("ctl-a")
    ctl.proxy.close()
    p.procs.kill("ctl-a")  # restarted with the database cut off
    p.start("ctl-a")
    await p.until(lambda: (p.leadership("ctl-a") or {}).get("role") == "standby", "ctl-a answers")
    await asyncio.sleep(6 * TICK_S)
    assert p.commands_of("ctl-a") == [], "no lease, no command"
    with p.api("ctl-a") as c:
        r = c.put("/api/v1/nodes/rack-1-n1/drain", json={"reason": "while standing by"})
    assert r.status_code == 409
    ctl.proxy.open()
    await p.until(lambda: bool(p.commands_of("ctl-a")), "ctl-a leads once it holds the lease")
    await _steady(p, "ctl-a")
    assert mon.breaches == []


def test_a_second_controller_on_sqlite_refuses_to_start(
    tmp_path: Path, mosquitto: LocalMosquitto
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(site_policy()))
    db = f"sqlite:///{tmp_path / 'powerd.db'}"

    def controller(name: str) -> subprocess.Popen[bytes]:
        return subprocess.Popen(
            [
                sys.executable,
                "-m",
                "powerd.cli",
                "controller",
                f"--policy={policy}",
                f"--broker={mosquitto.url}",
                f"--db={db}",
                f"--state-file={tmp_path / f'{name}.json'}",
                f"--controller-id={name}",
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )

    first = controller("ctl-a")
    try:
        engine = make_engine(db)
        leases = Leases(engine)
        deadline = time.monotonic() + WAIT_S
        while (held := _safe_current(leases)) is None or process_name(held.holder) != "ctl-a":
            assert first.poll() is None, first.stdout.read() if first.stdout else ""
            assert time.monotonic() < deadline, "ctl-a never took the store's lease"
            time.sleep(0.1)
        second = controller("ctl-b")
        out, _ = second.communicate(timeout=WAIT_S)
        engine.dispose()
    finally:
        first.kill()
        first.wait()
    assert second.returncode == 1
    text = out.decode()
    assert "ctl-a" in text and "SQLite" in text and "PostgreSQL" in text, text


def _safe_current(leases: Leases) -> Lease | None:
    try:
        return leases.current(SCOPE)
    except Exception:  # the table is not there until the first controller migrated
        return None
