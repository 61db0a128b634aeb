"""A BMC-only node under the controller, end to end: the controller and a node agent as
processes, `powerd bmc-agent` as a process steering a node whose only way in is its BMC
(the Redfish emulator in this test, over HTTPS), all over a real Mosquitto. The monitor of
tests/support/e2e.py checks every budget after every message, from the messages alone; the
emulator says what the GPUs really enforce.

- on both layouts of GPU limits: `EnvironmentMetrics` and Chassis `Controls`;
- a budget cut reaches the BMC node's GPUs through its BMC (read back from the emulator);
- a BMC that stops answering: the node's telemetry stops or fails, the controller never
  raises its GPUs while it is silent, the BMC keeps the limits it had, no budget is
  exceeded; when it answers again the node is steered again.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.e2e import FAILSAFE_W, GPUS, LEASE_S, TICK_S, TOL_W, E2eSite, Monitor, Procs

from powerd.backends.mock import Workload
from powerd.policy import load_policy
from powerd.testing.mosquitto import LocalMosquitto
from powerd.testing.redfish import EmulatorServer, Meter, RedfishService, TestCa
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.wire import NodeState

pytestmark = [pytest.mark.slow, pytest.mark.process]

BMC_NODE = "rack-2-n1"
AGENT_NODE = "rack-2-n2"
STALE_S = 3 * TICK_S


# The rack's PDU is wired to the BMC node only (the agent node's GPUs live in its own
# process): it reads far below what the nodes report, for good. A meter reading low never
# loosens anything (docs/safety.md, "Overload"); `meter_disagrees` names the rack.
PDU_METER = {"poll_s": 0.5, "timeout_s": 0.3, "fresh_s": 3.0, "disagree_w": 300,
             "disagree_pct": 0, "disagree_for_s": 2.0}  # fmt: skip


def bmc_site(
    bmc_node_w: float = 2500,
    *,
    keeps: bool = False,
    dc_w: float = 4000,
    lowest_w: float | None = None,
    meter: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """One rack: a BMC-managed node and an agent node, 4 GPUs (200–700 W) each; the
    facility's budget binds. `keeps`: the policy declares the BMC node's limits kept.
    `meter`: the rack's PDU (`redfish` settings), which measures the BMC node alone."""
    rack: dict[str, Any] = {} if meter is None else {"meter": {"redfish": meter, **PDU_METER}}
    facility: dict[str, Any] = {} if lowest_w is None else {"lowest_budget_w": lowest_w}
    return {
        "version": 1,
        "facility": {
            "name": "dc",
            "budget_w": dc_w,
            **facility,
            "rows": [
                {
                    "name": "row",
                    "racks": [
                        {
                            "name": "rack-2",
                            "budget_w": 4400,
                            **rack,
                            "nodes": [
                                {
                                    "name": BMC_NODE,
                                    "budget_w": bmc_node_w,
                                    "overhead_w": 100,
                                    "keeps_limits": keeps,
                                },
                                {"name": AGENT_NODE, "budget_w": 2500, "overhead_w": 100},
                            ],
                        }
                    ],
                }
            ],
        },
        **TRAIN_AND_INFER,
        "defaults": {"class": "training", "failsafe_w": FAILSAFE_W, "gpus_per_node": GPUS},
        "control": {"tick_s": TICK_S, "lease_s": LEASE_S, "stale_after_s": STALE_S},
    }


@dataclass
class BmcSite(E2eSite):
    hgx: RedfishService
    policy_file: Path
    meter: dict[str, Any]  # the rack PDU's settings, for each policy the test writes

    def steered_since(self, node: str, tick: int) -> bool:
        view = self.monitor.nodes[node]
        return (
            any(a.tick > tick for a in view.acks)
            and view.status is not None
            and view.status.state is NodeState.STEERED
            and view.telemetry_state == "steered"
        )

    def truth(self) -> list[float]:
        """The limits the BMC's GPUs really enforce."""
        return list(self.truth_by_uuid().values())

    def truth_by_uuid(self) -> dict[str, float]:
        """The same, by the names the bmc-agent gives them on the wire."""
        gpus = self.hgx.gpus
        assert gpus is not None
        return {
            f"GPU-{self.hgx.processor_uuid(i)}": gpus.enforced_limit_w(g.uuid)
            for i, g in enumerate(gpus.gpus())
        }

    def controller_events(self, event: str) -> list[dict[str, Any]]:
        log = self.procs.workdir / f"controller.{self.procs.started['controller']}.log"
        lines = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
        return [x for x in lines if x.get("event") == event]


# Both places a BMC may keep GPU limits: the Processors' EnvironmentMetrics, and Chassis
# Controls of type Power (found by the bmc-agent's default `limits = "auto"`).
# A test may name the policy's keys (`bmc_site`) through indirect parametrisation.
@pytest.fixture(
    params=[{"limits": "processors"}, {"limits": "controls"}], ids=lambda p: p["limits"]
)
async def site(
    mosquitto: LocalMosquitto, tmp_path: Path, request: pytest.FixtureRequest
) -> AsyncIterator[BmcSite]:
    ca = TestCa.make(tmp_path / "pki")
    param = dict(request.param)
    limits = param.pop("limits", "processors")
    hgx = RedfishService.hgx(
        GPUS, Workload.training(), password="s3cret", node=BMC_NODE, limits=limits
    )
    (tmp_path / "bmc.password").write_text("s3cret\n")
    config = tmp_path / "bmc-agent.toml"
    policy_file = tmp_path / "policy.yaml"
    assert hgx.gpus is not None
    pdu = RedfishService.pdu(Meter([hgx.gpus], overhead_w=100.0), password="pdu-pw")
    (tmp_path / "pdu.password").write_text("pdu-pw\n")
    procs = Procs(tmp_path, mosquitto.url)
    with EmulatorServer([hgx, pdu], ca) as server:
        meter = {
            "url": server.url(1),
            "pdu": "1",
            "username": "admin",
            "password_file": str(tmp_path / "pdu.password"),
            "ca_file": str(ca.ca_file),
        }
        policy_file.write_text(yaml.safe_dump(bmc_site(**param, meter=meter)))
        monitor = Monitor(mosquitto.url, load_policy(policy_file))
        config.write_text(
            f'broker = "{mosquitto.url}"\n'
            "period_s = 0.5\ntimeout_s = 0.2\nretries = 0\n"
            f"failsafe_w = {FAILSAFE_W}\n"
            "[[nodes]]\n"
            f'node_id = "{BMC_NODE}"\nurl = "{server.url()}"\nusername = "admin"\n'
            f'password_file = "{tmp_path / "bmc.password"}"\nca_file = "{ca.ca_file}"\n'
        )
        await monitor.start()
        try:
            procs.agent(AGENT_NODE)
            procs.start("bmc-agent", "bmc-agent", f"--config={config}")
            procs.controller("ctl-a", policy_file, f"sqlite:///{tmp_path / 'powerd.db'}")
            yield BmcSite(monitor, procs, hgx, policy_file, meter)
        finally:
            procs.close()
            await monitor.stop()


async def test_a_bmc_node_obeys_a_cut_and_a_silent_bmc_is_never_raised(site: BmcSite) -> None:
    mon, procs, hgx = site.monitor, site.procs, site.hgx

    # -- both nodes steered, the BMC node through its BMC ----------------------------------
    await site.until(
        lambda: site.steered_since(BMC_NODE, 0) and site.steered_since(AGENT_NODE, 0),
        "both nodes are steered",
    )
    await site.ticks(4)
    bmc_view = mon.nodes[BMC_NODE]
    assert len(bmc_view.readings) == GPUS  # discovered through Redfish, named by the BMC
    assert all(u.startswith("GPU-") for u in bmc_view.readings)
    assert hgx.sessions, "the bmc-agent holds a Redfish session"
    await site.until(lambda: mon.group_committed("dc") > 0.9 * 4000, "the budget in use")

    # -- the rack's PDU disagrees with its nodes: named, and nothing loosened --------------
    def disagrees() -> list[dict[str, Any]]:
        return [
            a
            for e in ("alarm_raised", "alarm_changed")
            for a in site.controller_events(e)
            if a["alarm"] == "meter_disagrees"
        ]

    await site.until(lambda: bool(disagrees()), "meter_disagrees")
    assert "rack-2 (meter " in disagrees()[-1]["message"]
    assert mon.breaches == []

    # -- a cut of the BMC node's budget is obeyed through the BMC --------------------------
    site.policy_file.write_text(yaml.safe_dump(bmc_site(bmc_node_w=1200, meter=site.meter)))
    cut = load_policy(site.policy_file)
    mon.cut([g.budget_w for g in cut.groups], strict_from_tick=mon.last_tick + 4)
    procs.signal("controller", signal.SIGHUP)
    await site.ticks(8)
    await site.until(lambda: sum(site.truth()) <= 1200 - 100 + TOL_W, "the BMC enforces the cut")
    assert mon.group_committed(BMC_NODE) <= 1200 + TOL_W
    assert mon.breaches == []

    # -- the BMC stops answering -----------------------------------------------------------
    hung_at = mon.last_tick
    hgx.faults.hang = True
    # Until the controller has heard that (its telemetry stale or failed, its acks
    # set_failed), a raise it sent is legitimate: it is counted, as any command is.
    await asyncio.sleep(STALE_S + 4 * TICK_S)
    committed = dict(bmc_view.committed())
    silent_from = mon.last_tick
    await site.ticks(6)
    after = [c for c in bmc_view.commands if c.tick > silent_from]
    assert after, "the controller keeps commanding the node (its lease renewed)"
    for cmd in after:
        for uuid, watts in cmd.caps.items():
            # Never raised while silent: stale or failing GPUs get min(target, committed).
            assert watts <= committed[uuid] + TOL_W, (cmd.tick, uuid, watts, committed[uuid])
    # The BMC keeps the limits it had (a PATCH in flight at the hang may have landed:
    # still no more than what was committed).
    for uuid, watts in site.truth_by_uuid().items():
        assert watts <= committed[uuid] + TOL_W, (uuid, watts, committed[uuid])
    # The controller heard every GPU's caps unconfirmed (acks set_failed) and planned the
    # node's GPUs at their committed caps, cutting the others instead, with an alarm that
    # names each of them: one that refuses a tick after the first is named as it does
    # (the alarm changes with the GPUs it names, and says so in the log).
    unconfirmed = {
        u for a in bmc_view.acks if a.tick >= hung_at for u, g in a.gpus.items() if g.error
    }
    assert unconfirmed == set(committed)
    refused = [
        a
        for e in ("alarm_raised", "alarm_changed")
        for a in site.controller_events(e)
        if a["alarm"] == "caps_refused"
    ]
    named = {u for u in committed if any(u in a["message"] for a in refused)}
    assert named == set(committed)
    assert mon.breaches == []

    # -- it answers again: steered again ---------------------------------------------------
    hgx.faults.hang = False
    resumed_from = mon.last_tick
    await site.until(lambda: site.steered_since(BMC_NODE, resumed_from), "the BMC node is back")
    await site.ticks(4)
    assert sum(site.truth()) <= 1200 - 100 + TOL_W
    assert mon.breaches == [] and mon.bad == []
    assert mon.checks > 100

    # -- a clean stop leaves the failsafe caps, which the BMC keeps ------------------------
    assert procs.stop("bmc-agent") == 0
    assert all(w <= FAILSAFE_W + TOL_W for w in site.truth())
    assert hgx.sessions == {}  # logged out


KEPT_LOWEST_W = 2600.0  # 8 × 250 W failsafe + 200 W overhead = 2,200 W at least


@pytest.mark.parametrize("site", [{"keeps": True, "lowest_w": KEPT_LOWEST_W}], indirect=True)
async def test_a_dead_bmc_agent_leaves_limits_that_a_cut_to_the_lowest_budget_gets_past(
    site: BmcSite,
) -> None:
    """The policy says the BMC node keeps its limits and the facility may be cut to
    2,600 W: the BMC node's GPUs hold at most 2,600 − 4 × 200 (the agent node at its
    minimum) − 200 (overhead) = 1,600 W. The bmc-agent is killed (its GPUs frozen for good),
    then the facility is cut to 2,600 W: the agent node alone makes room, the outside
    watcher sees no budget exceeded, and the BMC's limits never moved. A cut below the
    lowest budget is alarmed, naming the node that cannot move."""
    mon, procs = site.monitor, site.procs
    await site.until(
        lambda: site.steered_since(BMC_NODE, 0) and site.steered_since(AGENT_NODE, 0),
        "both nodes are steered",
    )
    await site.until(lambda: mon.group_committed("dc") > 0.9 * 4000, "the budget in use")
    await site.ticks(4)
    room = KEPT_LOWEST_W - GPUS * 200.0 - 200.0
    # Every status of the bmc-agent's node says its limits are kept; the agent's do not.
    assert all(st.keeps_limits for st in mon.nodes[BMC_NODE].statuses)
    assert not any(st.keeps_limits for st in mon.nodes[AGENT_NODE].statuses)
    assert mon.group_committed(BMC_NODE) - 100 <= room + TOL_W
    assert sum(site.truth()) <= room + TOL_W

    # -- the bmc-agent dies: its BMC keeps every limit -------------------------------------
    procs.kill("bmc-agent")
    frozen = site.truth_by_uuid()
    await site.until(
        lambda: (
            mon.nodes[BMC_NODE].status is not None
            and mon.nodes[BMC_NODE].status.state is NodeState.OFFLINE
        ),
        "its last will",
    )
    await site.ticks(2)

    # -- the facility is cut to its lowest budget: met without the frozen GPUs -------------
    site.policy_file.write_text(
        yaml.safe_dump(
            bmc_site(keeps=True, dc_w=KEPT_LOWEST_W, lowest_w=KEPT_LOWEST_W, meter=site.meter)
        )
    )
    cut = load_policy(site.policy_file)
    mon.cut([g.budget_w for g in cut.groups], strict_from_tick=mon.last_tick + 4)
    procs.signal("controller", signal.SIGHUP)
    await site.ticks(8)
    assert site.truth_by_uuid() == frozen
    assert mon.group_committed("dc") <= KEPT_LOWEST_W + TOL_W
    assert mon.breaches == [] and mon.bad == []
    assert not [
        a for a in site.controller_events("alarm_raised") if a["alarm"] == "cut_unreachable"
    ]

    # -- below the lowest budget, nothing can make room for them: said so, by name ---------
    deeper = 2250.0  # above the failsafe caps plus overhead; below frozen + minimums + overhead
    assert sum(frozen.values()) + GPUS * 200.0 + 200.0 > deeper
    site.policy_file.write_text(yaml.safe_dump(bmc_site(keeps=True, dc_w=deeper, meter=site.meter)))
    procs.signal("controller", signal.SIGHUP)
    await site.until(
        lambda: any(
            a["alarm"] == "cut_unreachable" and BMC_NODE in a["message"]
            for a in site.controller_events("alarm_raised")
        ),
        "the alarm naming the node that cannot move",
    )
