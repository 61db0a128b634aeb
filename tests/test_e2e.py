"""The steering loop across processes: a controller and four agents over a real Mosquitto.

Every part runs as its own `powerd` process (mock GPUs on the agents), the store is SQLite
and then a fresh PostgreSQL database. A monitor in the test subscribes to `powerd/v1/#` and,
after every message, rebuilds each GPU's committed cap from the messages alone (the newest
cap read back in acks, telemetry and statuses, by the agent's clock, and the highest cap
sent but not yet acknowledged) and checks every group's committed sum plus overhead
against its budget. Through the run: a budget cut by SIGHUP, an agent killed and restarted,
the controller killed (every node must fall to failsafe within its lease) and replaced.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from support.e2e import (
    CAP_TOL_W,
    LEASE_S,
    NODES,
    PERIOD_S,
    TOL_W,
    WAIT_S,
    Monitor,
    Procs,
    site_policy,
)

from powerd.policy import load_policy
from powerd.store import Store
from powerd.testing.mosquitto import LocalMosquitto
from powerd.wire import NodeState

# A minute or more of powerd processes (the broker and the database come by the fixtures).
pytestmark = [pytest.mark.slow, pytest.mark.process]


@dataclass
class Site:
    monitor: Monitor
    procs: Procs
    policy_file: Path
    db: str

    async def until(self, cond: Callable[[], bool], what: str) -> None:
        """Wait (generously) until cond() holds, failing early if a process died."""
        deadline = time.monotonic() + WAIT_S
        while not cond():
            self.procs.check_alive()
            if time.monotonic() > deadline:
                pytest.fail(f"timed out waiting until {what}; breaches: {self.monitor.breaches}")
            await asyncio.sleep(0.02)

    async def ticks(self, n: int) -> None:
        """Let n more ticks of commands go by."""
        target = self.monitor.last_tick + n
        await self.until(lambda: self.monitor.last_tick >= target, f"tick {target}")

    def steered_since(self, node: str, tick: int, controller: str) -> bool:
        """The node applied a command of `controller` newer than `tick` and says so."""
        view = self.monitor.nodes[node]
        sent = {c.tick for c in view.commands if c.controller_id == controller}
        return (
            any(a.tick > tick and a.tick in sent for a in view.acks)
            and view.status is not None
            and view.status.state is NodeState.STEERED
            and view.telemetry_state == "steered"
        )

    def all_steered_since(self, tick: int, controller: str) -> bool:
        return all(self.steered_since(n, tick, controller) for n in NODES)


@pytest.fixture
async def site(mosquitto: LocalMosquitto, db_url: str, tmp_path: Path) -> AsyncIterator[Site]:
    policy_file = tmp_path / "policy.yaml"
    policy_file.write_text(yaml.safe_dump(site_policy()))
    monitor = Monitor(mosquitto.url, load_policy(policy_file))
    await monitor.start()
    procs = Procs(tmp_path, mosquitto.url)
    try:
        yield Site(monitor, procs, policy_file, db_url)
    finally:
        procs.close()
        await monitor.stop()


async def test_controller_and_agents_keep_every_budget_through_cuts_and_deaths(
    site: Site,
) -> None:
    mon, procs = site.monitor, site.procs

    # -- start: every node steered, the facility's budget in use ---------------------------
    for node in NODES:
        procs.agent(node)
    procs.controller("ctl-a", site.policy_file, site.db)
    await site.until(lambda: site.all_steered_since(0, "ctl-a"), "every node is steered")
    await site.ticks(6)
    assert mon.breaches == []
    # The power left after demand is handed out, so budgets bind: the check is not idle.
    # (Raises wait for the acks of the cuts that pay for them: on a loaded machine that can
    # take more than six ticks.)
    await site.until(lambda: mon.group_committed("dc") > 0.95 * 8000, "the budget in use")
    assert mon.group_committed("rack-1") > 3000 + 100
    assert mon.group_committed("rack-2-n1") > 1500 + 100

    # -- a budget cut by SIGHUP is obeyed within two ticks ---------------------------------
    # The first tick to start after the reload is at most two past the last one seen (one
    # may be under way); its cuts must be acknowledged within two more.
    site.policy_file.write_text(yaml.safe_dump(site_policy(rack_1_w=3000, node_w=1500)))
    cut = load_policy(site.policy_file)
    mon.cut([g.budget_w for g in cut.groups], strict_from_tick=mon.last_tick + 4)
    procs.signal("controller", signal.SIGHUP)
    await site.ticks(8)
    assert mon.budget_w == [g.budget_w for g in cut.groups]  # the strict check is in force
    assert mon.group_committed("rack-1") <= 3000 + TOL_W
    assert mon.group_committed("rack-2-n1") <= 1500 + TOL_W
    assert mon.breaches == []

    # -- an agent killed and restarted is re-admitted --------------------------------------
    node = NODES[3]
    procs.kill(node)
    killed_at = mon.last_tick
    await site.until(
        lambda: (
            mon.nodes[node].status is not None and mon.nodes[node].status.state is NodeState.OFFLINE
        ),
        f"{node}'s last will says offline",
    )
    procs.agent(node)
    await site.until(lambda: site.steered_since(node, killed_at, "ctl-a"), f"{node} re-admitted")
    assert any(s.state is NodeState.STARTING for s in mon.nodes[node].statuses)
    await site.ticks(4)
    assert mon.breaches == []

    # -- the controller killed: every node falls to failsafe within its lease ---------------
    procs.kill("controller")
    await site.until(
        lambda: all(
            mon.nodes[n].status is not None and mon.nodes[n].status.state is NodeState.FAILSAFE
            for n in NODES
        ),
        "every node is in failsafe",
    )
    last = {n: mon.nodes[n].commands[-1] for n in NODES}  # the dead controller's last words
    for n in NODES:
        status = mon.nodes[n].status
        assert status is not None
        # Both clocks are this machine's wall clock.
        late_s = status.ts - last[n].ts
        assert late_s <= LEASE_S + PERIOD_S, (
            f"{n} in failsafe {late_s:.2f} s after its last command"
        )
        assert status.caps_w.keys() == last[n].failsafe_w.keys()
        for uuid, watts in status.caps_w.items():
            assert watts <= last[n].failsafe_w[uuid] + CAP_TOL_W, (n, uuid, watts)
    assert mon.breaches == []

    # -- a new controller learns the caps in force and resumes, with no breach -------------
    dead_tick = mon.last_tick
    procs.controller("ctl-b", site.policy_file, site.db)
    await site.until(lambda: site.all_steered_since(dead_tick, "ctl-b"), "ctl-b steers all")
    await site.ticks(6)
    # Raised again off failsafe, up to what the cut leaves: rack-1 3000 + 1500 + 2500 W.
    assert mon.group_committed("dc") > 0.95 * 7000
    assert mon.breaches == []
    assert mon.bad == []
    assert mon.checks > 200

    # -- the store kept what both controllers did ------------------------------------------
    assert procs.stop("controller") == 0
    sent: dict[str, float] = {}
    for view in mon.nodes.values():
        for cmd in view.commands:
            sent.update(cmd.caps)
    store = Store(site.db)
    try:
        # Cap changes are stored when a cap moves by 0.5 W or more (smaller: solver noise).
        assert store.latest_caps() == pytest.approx(sent, abs=0.5)
        assert len(store.recent_ticks(limit=1000)) >= 20
        versions = store.policy_versions().items
        assert any(v.author == "sighup" for v in versions)
    finally:
        store.close()
