"""Limits powerd did not set, end to end: the real agents (mock GPUs) and the controller over
a real Mosquitto, its store on SQLite and on PostgreSQL, its API and metrics over real HTTP.

Someone sets a GPU's limit behind powerd's back (`nvidia-smi -pl`: the mock's `tamper`), an
out-of-band limit holds one lower (the mock's `override`: the agent's `overridden` path),
a GPU is reset (the mock's `reset`: back at its default limit). Each must show as an alarm
or an event in the API, the metrics and the store, naming the node and the GPU, and clear
once resolved (docs/safety.md, "Limits powerd did not set").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.honest import NODES as HONEST_NODES
from support.honest import HonestNode, policy_dict
from support.live_api import GPUS_PER_NODE, NODES, LiveApi, wait_until

from powerd.alarms import Alarms, Severity
from powerd.backends.base import NoPermission
from powerd.backends.mock import SimulatedGpus
from powerd.controller.tick import TickEngine
from powerd.policy import parse_policy
from powerd.testing.mosquitto import LocalMosquitto
from powerd.wire import NodeTelemetry

V1 = "/api/v1"


@pytest.fixture
def site(tmp_path: Path, mosquitto: LocalMosquitto, db_url: str) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path, broker_url=mosquitto.url, db_url=db_url).start()
    # These tests follow every change of the alarms; their hold-down has a test of its own.
    assert api.controller is not None
    controller = api.controller
    api.call(lambda: setattr(controller.engine.inputs, "hold_s", 0.0))
    try:
        yield api
    finally:
        api.close()


def where(k: int) -> tuple[str, int]:
    """The node and index of the model's GPU k."""
    return NODES[k // GPUS_PER_NODE], k % GPUS_PER_NODE


def gpu_view(c: httpx.Client, uuid: str) -> dict[str, Any]:
    (item,) = [
        g for g in c.get(f"{V1}/gpus", params={"limit": 100}).json()["items"] if g["uuid"] == uuid
    ]
    return item


def metric(c: httpx.Client, name: str, **labels: str) -> float | None:
    text = c.get("/metrics").text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def events(c: httpx.Client, kind: str, **params: Any) -> list[dict[str, Any]]:
    r = c.get(f"{V1}/events", params={"kind": kind, **params})
    assert r.status_code == 200, r.text
    items: list[dict[str, Any]] = r.json()["items"]
    return items


def alarm(c: httpx.Client, kind: str) -> str | None:
    found = [a["message"] for a in c.get(f"{V1}/alarms").json() if a["kind"] == kind]
    return found[0] if found else None


def steered(c: httpx.Client, uuid: str) -> bool:
    g = gpu_view(c, uuid)
    return g["set_w"] is not None and abs(g["cap_w"] - g["set_w"]) <= 1.0


def test_limits_powerd_did_not_set_are_alarmed_and_cleared(site: LiveApi) -> None:
    model = site.model
    assert model is not None
    uuids = model.uuids
    # GPUs 0 and 6 (steady at 650 W, which the allocator may give their 700 W maximum when
    # the training GPUs beside them dip) pinned at 400 W by the operator: what powerd sets
    # on them is then known at every tick, and a limit of 700 W is never powerd's.
    pinned = (0, 6)
    with site.client() as admin:
        for g in pinned:
            r = admin.put(f"{V1}/gpus/{uuids[g]}/pin", json={"watts": 400, "reason": "test"})
            assert r.status_code == 200, r.text
    with site.client("viewer") as c:
        wait_until(lambda: all(steered(c, u) for u in uuids), "every GPU steered")
        wait_until(lambda: all(gpu_view(c, uuids[g])["set_w"] == 400.0 for g in pinned), "the pins")
        assert alarm(c, "cap_overridden") is None

        # 1. nvidia-smi -pl 700 on a GPU steered lower: its agent sets it back at once (the
        # sample that finds it, or the command about to set it), and says so.
        k = 0
        node, index = where(k)
        site.call(lambda: model.tamper(k, 700.0))
        wait_until(lambda: gpu_view(c, uuids[k])["cap_restores"] >= 1, "the restore")
        assert site.call(lambda: float(model.cap_w[k])) == 400.0
        restored = wait_until(lambda: events(c, "cap_restored"), "the cap_restored event")
        ev = restored[0]
        assert ev["severity"] == "warning" and ev["cleared_at"] is not None  # an event only
        assert f"{node} GPU {index} ({uuids[k]}): 700 W found" in ev["message"]
        data = ev["data"]["gpus"][0]
        assert (data["node"], data["uuid"], data["index"], data["found_w"]) == (
            node,
            uuids[k],
            index,
            700.0,
        )
        assert data["set_w"] == 400.0
        assert (metric(c, "powerd_gpu_cap_restores_total", UUID=uuids[k]) or 0) >= 1
        assert metric(c, "powerd_gpu_cap_overridden", UUID=uuids[k]) == 0

        # 2. An out-of-band limit below the cap (the agent's `overridden` path): alarmed for
        # as long as it holds, never raised by the agent, cleared when it goes.
        k = 2
        node, index = where(k)
        site.call(lambda: model.override(k, 220.0))
        message = wait_until(lambda: alarm(c, "cap_overridden"), "the cap_overridden alarm")
        assert f"{node} GPU {index} ({uuids[k]}): enforced 220 W, powerd set" in message
        assert metric(c, "powerd_gpu_cap_overridden", UUID=uuids[k], Hostname=node) == 1
        assert metric(c, "powerd_alarms_active", kind="cap_overridden") == 1
        stored = wait_until(lambda: events(c, "cap_overridden", active=True), "the stored alarm")
        assert stored[0]["severity"] == "alarm"
        assert [(g["node"], g["uuid"], g["enforced_w"]) for g in stored[0]["data"]["gpus"]] == [
            (node, uuids[k], 220.0)
        ]
        g = gpu_view(c, uuids[k])
        assert g["cap_w"] == 220.0 and g["set_w"] > 221.0

        # 3. A limit raised that the agent cannot set back (a tool that keeps raising it, a
        # permission lost): the other direction, while the first still holds.
        j = 6
        node_j, index_j = where(j)

        def raised_and_stuck() -> None:
            model.fail_set(j, NoPermission)
            model.tamper(j, 700.0)

        site.call(raised_and_stuck)
        # Both named. (Not at every tick: while the stuck GPU's 700 W holds the site over
        # its budget, every GPU under it is sent no more than the least cap that may be in
        # force, which for GPU k is the 220 W held under powerd's cap; for that tick powerd
        # set what is enforced, and GPU k drops out of the alarm.)
        wait_until(
            lambda: all(
                f"{name} GPU {i} ({uuids[g]})" in (alarm(c, "cap_overridden") or "")
                for name, i, g in ((node_j, index_j, j), (node, index, k))
            ),
            "the raised GPU in the alarm beside the first",
        )
        assert f"{node_j} GPU {index_j} ({uuids[j]}): enforced 700 W" in (
            alarm(c, "cap_overridden") or ""
        )
        # The store keeps each set of GPUs: the first alarm closed, the new one names both.
        stored = wait_until(
            lambda: [
                e for e in events(c, "cap_overridden", active=True) if len(e["data"]["gpus"]) == 2
            ],
            "the stored alarm naming both GPUs",
        )
        assert {g["uuid"] for g in stored[0]["data"]["gpus"]} == {uuids[k], uuids[j]}
        assert len(events(c, "cap_overridden", active=True)) == 1  # the first one closed
        assert metric(c, "powerd_gpu_cap_overridden", UUID=uuids[j]) == 1

        site.call(lambda: model.override(k, None))
        site.call(lambda: model.fail_set(j, None))
        wait_until(lambda: alarm(c, "cap_overridden") is None, "the alarm to clear")
        wait_until(lambda: not events(c, "cap_overridden", active=True), "the stored clear")
        assert len(events(c, "cap_overridden")) >= 2
        assert metric(c, "powerd_gpu_cap_overridden", UUID=uuids[k]) == 0
        assert metric(c, "powerd_gpu_cap_overridden", UUID=uuids[j]) == 0
        assert metric(c, "powerd_alarms_active", kind="cap_overridden") is None
        assert site.call(lambda: float(model.cap_w[j])) == 400.0
        assert gpu_view(c, uuids[j])["cap_restores"] >= 1  # set back once it could be


def test_a_gpu_back_from_a_reset_gets_its_cap_again_and_is_reported(site: LiveApi) -> None:
    model: SimulatedGpus | None = site.model
    assert model is not None
    uuids = model.uuids
    k = 4
    node, index = where(k)
    with site.client() as admin:  # pinned: at 700 W the allocator's cap would be no restore
        r = admin.put(f"{V1}/gpus/{uuids[k]}/pin", json={"watts": 400, "reason": "test"})
        assert r.status_code == 200, r.text
    with site.client("viewer") as c:
        wait_until(lambda: all(steered(c, u) for u in uuids), "every GPU steered")
        wait_until(lambda: gpu_view(c, uuids[k])["set_w"] == 400.0, "the pin")
        # A driver reload: the GPU is unreachable for a while, then back at its default limit.
        site.call(lambda: model.lose(k))
        wait_until(lambda: gpu_view(c, uuids[k])["state"] == "stale", "the lost GPU")

        def back() -> None:
            model.reset(k)
            model.lose(k, False)

        site.call(back)
        wait_until(lambda: gpu_view(c, uuids[k])["cap_restores"] >= 1, "the restore")
        assert site.call(lambda: float(model.cap_w[k])) == 400.0
        ev = wait_until(
            lambda: [e for e in events(c, "cap_restored") if uuids[k] in e["message"]],
            "the cap_restored event",
        )[0]
        assert f"{node} GPU {index} ({uuids[k]}): 700 W found (its default limit)" in ev["message"]
        assert ev["data"]["gpus"][0]["default_limit"] is True
        wait_until(lambda: steered(c, uuids[k]), "the GPU steered again")
        assert alarm(c, "cap_overridden") is None


# -- the tick engine alone: what it alarms on, from what the agents report --------------------


def reported(
    node: HonestNode, wall: float, changes: dict[int, dict[str, Any]] | None = None
) -> NodeTelemetry:
    """The node's sample as an agent of this version sends it: each GPU's `set_w` is the cap
    it applied; `changes` (by GPU index) replace fields."""
    msg = node.sample(wall)
    gpus = []
    for i, g in enumerate(msg.gpus):
        fields = {"set_w": g.cap_w} | (changes or {}).get(i, {})
        gpus.append(g.model_copy(update=fields))
    return msg.model_copy(update={"gpus": gpus})


class Site:
    def __init__(self, hold_s: float = 0.0) -> None:
        self.engine = TickEngine(parse_policy(policy_dict()))
        self.engine.inputs.hold_s = hold_s  # 0: every change at once
        self.nodes = {n: HonestNode(n) for n in HONEST_NODES}
        self.t = 0

    def tick(self, changes: dict[str, dict[int, dict[str, Any]]] | None = None) -> None:
        """Telemetry from every node (as changed), one tick, its commands applied."""
        self.t += 1
        now, wall = float(self.t), 1_700_000_000.0 + self.t
        for name, node in self.nodes.items():
            assert self.engine.on_telemetry(reported(node, wall, (changes or {}).get(name)), now)
        _, plan = self.engine.step(now, wall)
        for cmd in plan.commands:
            ack = self.nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                self.engine.on_ack(cmd.node, ack)


def test_the_engine_alarms_a_limit_away_from_the_one_its_agent_set() -> None:
    site = Site()
    for _ in range(4):  # commands sent and not yet applied in between: no alarm
        site.tick()
    assert "cap_overridden" not in site.engine.alarms.active
    site.engine.alarms.take()

    low = {"r1-n1": {1: {"cap_w": 250.0, "set_w": 450.0}}}
    site.tick(low)
    message = site.engine.alarms.active["cap_overridden"]
    assert "r1-n1 GPU 1 (GPU-r1-n1-1): enforced 250 W, powerd set 450 W" in message
    (raised,) = [c for c in site.engine.alarms.take() if c.kind == "cap_overridden"]
    assert raised.severity is Severity.ALARM
    assert raised.data is not None and raised.data["gpus"] == [
        {"node": "r1-n1", "uuid": "GPU-r1-n1-1", "index": 1, "enforced_w": 250.0, "set_w": 450.0}
    ]
    site.tick(low)  # the same GPUs: no change to record
    assert [c for c in site.engine.alarms.take() if c.kind == "cap_overridden"] == []

    # Another GPU, the other way: the alarm is raised anew (just after its clear) naming both.
    both = low | {"r2-n2": {0: {"cap_w": 700.0, "set_w": 400.0}}}
    site.tick(both)
    clear, again = [c for c in site.engine.alarms.take() if c.kind == "cap_overridden"]
    assert clear.message is None and again.message is not None and again.ts > clear.ts
    assert again.data is not None and [g["uuid"] for g in again.data["gpus"]] == [
        "GPU-r1-n1-1",
        "GPU-r2-n2-0",
    ]

    # A GPU that cannot be read carries its last cap, not a reading: it alarms nothing.
    lost = {
        "r1-n1": {1: {"cap_w": 250.0, "set_w": 450.0, "error": "gpu_lost"}},
        "r2-n2": both["r2-n2"],
    }
    site.tick(lost)
    assert "r1-n1 GPU 1" not in site.engine.alarms.active["cap_overridden"]
    assert "r2-n2 GPU 0" in site.engine.alarms.active["cap_overridden"]
    site.tick()
    assert "cap_overridden" not in site.engine.alarms.active
    changes = [c for c in site.engine.alarms.take() if c.kind == "cap_overridden"]
    assert [c.message for c in changes][-1] is None

    # Every GPU: the message names five, the data all of them.
    everywhere = {n: {i: {"cap_w": 650.0, "set_w": 300.0} for i in range(4)} for n in site.nodes}
    site.tick(everywhere)
    message = site.engine.alarms.active["cap_overridden"]
    assert message.count("enforced 650 W") == 5 and message.endswith("and 11 more GPUs")
    (raised,) = [c for c in site.engine.alarms.take() if c.kind == "cap_overridden"]
    assert raised.data is not None and raised.data["count"] == 16


def test_the_engine_reports_each_restore_once() -> None:
    site = Site()
    # An agent restarted with restores behind it: the count the controller starts from.
    site.tick({"r1-n2": {0: {"restores": 5, "found_w": 650.0}}})
    site.tick({"r1-n2": {0: {"restores": 5, "found_w": 650.0}}})
    assert [c for c in site.engine.alarms.take() if c.kind == "cap_restored"] == []

    site.tick({"r1-n2": {0: {"restores": 7, "found_w": 700.0}}})
    (event,) = [c for c in site.engine.alarms.take() if c.kind == "cap_restored"]
    assert event.severity is Severity.WARNING
    assert event.message is not None
    assert "r1-n2 GPU 0 (GPU-r1-n2-0): 700 W found (its default limit)" in event.message
    assert "(2 times)" in event.message
    assert event.data is not None and event.data["gpus"][0]["times"] == 2
    assert "cap_restored" not in site.engine.alarms.active  # an event, nothing to clear

    site.tick({"r1-n2": {0: {"restores": 7, "found_w": 700.0}}})
    assert [c for c in site.engine.alarms.take() if c.kind == "cap_restored"] == []
    # The agent restarted and restored once since: its count began again.
    site.tick({"r1-n2": {0: {"restores": 1, "found_w": 500.0}}})
    (event,) = [c for c in site.engine.alarms.take() if c.kind == "cap_restored"]
    assert event.message is not None and "500 W found, set back" in event.message


def test_an_alarm_with_subjects_follows_them() -> None:
    alarms = Alarms()
    alarms.set("k", "a", 1.0, subjects=("a",), data={"n": 1})
    alarms.set("k", "a, now 2 W", 2.0, subjects=("a",))
    assert alarms.active["k"] == "a, now 2 W"  # the live message follows
    alarms.set("k", "a and b", 3.0, subjects=("a", "b"), data={"n": 2})
    alarms.set("k", None, 4.0)
    assert [(c.ts, c.message, c.data) for c in alarms.take()] == [
        (1.0, "a", {"n": 1}),
        (3.0, None, None),
        (pytest.approx(3.0), "a and b", {"n": 2}),
        (4.0, None, None),
    ]
    # Without subjects the live message follows too; the store keeps the raise as it was.
    alarms.set("j", "first", 1.0)
    alarms.set("j", "second", 2.0)
    assert alarms.active["j"] == "second"
    assert [c.message for c in alarms.take()] == ["first"]


def test_a_node_flapping_a_limit_every_message_changes_the_alarm_at_most_every_hold() -> None:
    """A node that flips one GPU's reported limit on every message (a hostile agent, a tool
    fighting powerd) once cleared and raised cap_overridden every tick and sent a
    cap_restored event with each: some 240,000 stored rows a day from one node. With the
    hold-down each changes at most once per ALARM_HOLD_S; restores are merged, not lost."""
    site = Site(hold_s=30.0)
    for _ in range(4):
        site.tick()
    site.engine.alarms.take()
    restores = 0
    for t in range(100):  # 100 ticks of 1 s
        odd = t % 2 == 1
        restores += 1
        changes = {
            "r1-n1": {
                1: {"cap_w": 250.0 if odd else 450.0, "set_w": 450.0},
                2: {"restores": restores, "found_w": 700.0},
            }
        }
        site.tick(changes)
    changes_seen = site.engine.alarms.take()
    overridden = [c for c in changes_seen if c.kind == "cap_overridden"]
    restored = [c for c in changes_seen if c.kind == "cap_restored"]
    # 100 s: at most one change each 30 s (4), where each tick used to make one or two.
    assert 1 <= len(overridden) <= 4
    assert 1 <= len(restored) <= 4
    # Nothing lost: the restores reported add up to those made, but for the last window's.
    reported = sum(g["times"] for c in restored for g in (c.data or {}).get("gpus", []))
    assert 0 < reported <= restores
    assert reported >= restores - 31
