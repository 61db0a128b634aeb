"""The admin API over real HTTP: a live controller (mock GPUs, in-process broker, SQLite)
with uvicorn on a free loopback port, and httpx as the client."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from support.live_api import POLICY, LiveApi, wait_until

from powerd.safety import TOL_W  # the planner's tolerance for float sums of caps


def gpu(c: httpx.Client, uuid: str) -> dict[str, Any]:
    items = c.get("/api/v1/allocation").json()["caps"]["items"]
    return next(i for i in items if i["uuid"] == uuid)


def test_health_and_readiness_need_no_token(live: LiveApi) -> None:
    with live.client(None) as c:
        assert c.get("/healthz").json() == {"status": "ok"}
        ready = c.get("/readyz")
        assert ready.status_code == 200
        body = ready.json()
        assert body["ready"] and body["broker_connected"] and body["store_connected"]
        assert body["last_tick_age_s"] < 5


def test_no_token_401_bad_token_401_wrong_role_403(live: LiveApi) -> None:
    with live.client(None) as c:
        r = c.get("/api/v1/fleet")
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = c.get("/api/v1/fleet", headers={"Authorization": "Bearer pwd_not-a-token"})
        assert r.status_code == 401
        r = c.get("/api/v1/fleet", headers={"Authorization": "Basic dXNlcjpwdw=="})
        assert r.status_code == 401
    with live.client("viewer") as c:
        assert c.get("/api/v1/fleet").status_code == 200
        r = c.put("/api/v1/nodes/rack-1-n1/drain", json={"reason": "x"})
        assert r.status_code == 403
        assert "operator role is required" in r.json()["detail"]
    with live.client("operator") as c:
        r = c.put("/api/v1/policy", params={"reason": "x"}, content=POLICY)
        assert r.status_code == 403
        assert c.put("/api/v1/nodes/rack-1-n1/drain", json={"reason": "x"}).status_code == 200


def test_fleet_nodes_gpus_groups(live: LiveApi) -> None:
    with live.client("viewer") as c:
        fleet = c.get("/api/v1/fleet").json()
        assert fleet["facility"]["name"] == "site" and fleet["facility"]["budget_w"] == 4000
        assert [r["name"] for r in fleet["rows"]] == ["row-1"]
        assert fleet["nodes"] == 4 and fleet["gpus"] == 8
        # Right after the start every GPU counts at its maximum until it acknowledges a
        # command of this controller (its predecessor's may still land); then the caps.
        fleet = wait_until(
            lambda: (
                (f := c.get("/api/v1/fleet").json())["facility"]["committed_w"] <= 4000 + TOL_W
                and f
            ),
            "committed caps within the facility budget",
        )
        assert fleet["policy_version"] == 1

        nodes = c.get("/api/v1/nodes", params={"rack": "rack-2"}).json()
        assert [n["name"] for n in nodes["items"]] == ["rack-2-n1", "rack-2-n2"]
        assert all(n["row"] == "row-1" and n["gpus"] == 2 for n in nodes["items"])
        assert all(n["state"] == "steered" for n in nodes["items"])

        page = c.get("/api/v1/gpus", params={"limit": 3, "offset": 2}).json()
        assert page["total"] == 8 and page["limit"] == 3 and len(page["items"]) == 3
        assert page["items"][0]["node"] == "rack-1-n2"  # fleet order: node, then index
        one = page["items"][0]
        assert 200 <= one["cap_w"] <= 700 and one["class"] == "training"

        racks = c.get("/api/v1/groups", params={"level": "rack"}).json()
        assert [g["name"] for g in racks["items"]] == ["rack-1", "rack-2"]
        assert all(g["committed_w"] <= g["budget_w"] + TOL_W for g in racks["items"])

        bad = c.get("/api/v1/gpus", params={"state": "sleepy"})
        assert bad.status_code == 422 and bad.json()["problems"][0]["path"] == "query.state"


def test_pin_takes_effect_next_tick_and_is_audited(live: LiveApi) -> None:
    with live.client("operator") as c:
        uuid = c.get("/api/v1/gpus", params={"node": "rack-1-n1"}).json()["items"][0]["uuid"]
        r = c.put(f"/api/v1/gpus/{uuid}/pin", json={"watts": 250, "reason": "INC-42"})
        assert r.status_code == 200
        after = r.json()["after_tick"]
        wait_until(
            lambda: c.get("/api/v1/allocation").json()["tick"] > after and gpu(c, uuid),
            "a tick after the pin",
        )
        assert gpu(c, uuid)["target_w"] == 250
        assert c.get("/api/v1/gpus", params={"state": "pinned"}).json()["items"][0]["uuid"] == uuid

        out_of_range = c.put(f"/api/v1/gpus/{uuid}/pin", json={"watts": 900, "reason": "x"})
        assert out_of_range.status_code == 422
        unknown = c.put("/api/v1/gpus/GPU-nope/pin", json={"watts": 300, "reason": "x"})
        assert unknown.status_code == 404
        assert c.delete(f"/api/v1/gpus/{uuid}/pin", params={"reason": "done"}).status_code == 200
        assert c.delete(f"/api/v1/gpus/{uuid}/pin", params={"reason": "again"}).status_code == 404

        audit = c.get("/api/v1/audit").json()["items"]
        assert [(a["action"], a["actor"], a["result"]) for a in audit] == [
            ("gpu.unpin", "operator-user", "refused: GPU 'GPU-test-1-000000' is not pinned"),
            ("gpu.unpin", "operator-user", "ok"),
            ("gpu.pin", "operator-user", "refused: unknown GPU 'GPU-nope'"),
            ("gpu.pin", "operator-user", "refused: 900 W is outside the GPU's limits [200, 700] W"),
            ("gpu.pin", "operator-user", "ok"),
        ]
        assert audit[-1]["reason"] == "INC-42" and audit[-1]["payload"] == {"watts": 250}


def test_temporary_budget_cut_is_obeyed_then_cleared(live: LiveApi) -> None:
    with live.client("operator") as c:
        r = c.put(
            "/api/v1/budgets/site",
            json={"budget_w": 2500, "ttl_s": 600, "reason": "grid demand response DR-7"},
        )
        assert r.status_code == 200
        after = r.json()["after_tick"]
        # Cuts go out at once; committed caps fit the new budget once the agents ack them.
        fleet = wait_until(
            lambda: (
                (f := c.get("/api/v1/fleet").json())["tick"] > after + 2
                and f["facility"]["committed_w"] <= 2500 + TOL_W
                and f
            ),
            "the facility to fit the cut",
        )
        assert fleet["facility"]["budget_w"] == 2500
        o = c.get("/api/v1/overrides").json()["budgets"]
        assert o[0]["group"] == "site" and o[0]["policy_budget_w"] == 4000
        assert o[0]["actor"] == "operator-user"

        higher = c.put("/api/v1/budgets/site", json={"budget_w": 5000, "reason": "more"})
        assert higher.status_code == 422 and "can only lower" in higher.json()["detail"]
        both = c.put(
            "/api/v1/budgets/site",
            json={"budget_w": 2000, "ttl_s": 5, "expires_at": 1e10, "reason": "x"},
        )
        assert both.status_code == 422
        assert (
            c.put("/api/v1/budgets/nowhere", json={"budget_w": 1, "reason": "x"}).status_code == 404
        )

        assert c.delete("/api/v1/budgets/site", params={"reason": "DR-7 over"}).status_code == 200
        wait_until(
            lambda: c.get("/api/v1/fleet").json()["facility"]["budget_w"] == 4000,
            "the policy budget back",
        )


def test_drain_and_class_assignment(live: LiveApi) -> None:
    with live.client("operator") as c:
        r = c.put("/api/v1/nodes/rack-2-n2/drain", json={"reason": "PSU swap"})
        assert r.status_code == 200
        r = c.post(
            "/api/v1/classes/assign",
            json={"class": "inference", "nodes": ["rack-1-n1"], "reason": "job 123 prolog"},
        )
        assert r.status_code == 200
        after = r.json()["after_tick"]  # both changes are in force from the tick after this

        def applied() -> bool:
            a = c.get("/api/v1/allocation").json()
            if a["tick"] <= after:
                return False
            drained = [g for g in a["caps"]["items"] if g["node"] == "rack-2-n2"]
            return all(g["target_w"] == 200 for g in drained)

        wait_until(applied, "the drained node at its minimum")
        inference = c.get("/api/v1/gpus", params={"class": "inference"}).json()["items"]
        assert {g["node"] for g in inference} == {"rack-1-n1"}
        assert c.get("/api/v1/nodes", params={"state": "drained"}).json()["items"][0]["name"] == (
            "rack-2-n2"
        )

        unknown = c.post(
            "/api/v1/classes/assign",
            json={"class": "gaming", "nodes": ["rack-1-n1"], "reason": "x"},
        )
        assert (
            unknown.status_code == 422 and "valid: inference, training" in unknown.json()["detail"]
        )
        empty = c.post("/api/v1/classes/assign", json={"class": "inference", "reason": "x"})
        assert empty.status_code == 422
        assert c.put("/api/v1/nodes/nope/drain", json={"reason": "x"}).status_code == 404
        assert c.put("/api/v1/nodes/rack-1-n1/drain", json={"reason": "  "}).status_code == 422
        assert (
            c.delete("/api/v1/nodes/rack-2-n2/drain", params={"reason": "done"}).status_code == 200
        )
        r = c.post("/api/v1/classes/clear", json={"nodes": ["rack-1-n1"], "reason": "epilog"})
        assert r.status_code == 200
        audit = c.get("/api/v1/audit").json()["items"]
        assert [(a["action"], a["result"].split(":")[0]) for a in audit] == [
            ("class.clear", "ok"),
            ("node.undrain", "ok"),
            ("node.drain", "refused"),  # unknown node; the blank reason never got this far
            ("class.assign", "refused"),
            ("class.assign", "ok"),
            ("node.drain", "ok"),
        ]


def test_bad_policy_refused_with_check_problems_and_running_one_kept(live: LiveApi) -> None:
    bad = POLICY.replace("budget_w: 4000", "budget_w: -5").replace("tick_s: 0.2", "tick_z: 1")
    with live.client("admin") as c:
        before = c.get("/api/v1/policy").json()
        r = c.put(
            "/api/v1/policy",
            params={"reason": "try"},
            content=bad,
            headers={"Content-Type": "application/yaml"},
        )
        assert r.status_code == 422
        paths = {p["path"] for p in r.json()["problems"]}
        assert "facility.budget_w" in paths and "control.tick_z" in paths
        assert c.get("/api/v1/policy").json() == before

        good = POLICY.replace("budget_w: 4000", "budget_w: 3900")
        r = c.put("/api/v1/policy", params={"reason": "contract change"}, content=good)
        assert r.status_code == 200 and r.json()["version"] == 2
        policy = c.get("/api/v1/policy").json()
        assert policy["version"] == 2 and "budget_w: 3900" in policy["yaml"]
        wait_until(
            lambda: c.get("/api/v1/fleet").json()["facility"]["budget_w"] == 3900,
            "the new policy in force",
        )
        audit = c.get("/api/v1/audit", params={"action": "policy.replace"}).json()["items"]
        assert [a["result"] for a in audit] == [
            "ok",
            "refused: api: invalid policy (2 problem(s))",
        ]


def test_history_events_metrics(live: LiveApi) -> None:
    with live.client("viewer") as c:
        ticks = wait_until(lambda: c.get("/api/v1/ticks", params={"limit": 5}).json(), "ticks")
        assert ticks[0]["ts"] >= ticks[-1]["ts"] and ticks[0]["gpus"] <= 8
        assert c.get("/api/v1/events", params={"severity": "alarm"}).status_code == 200
        assert c.get("/api/v1/alarms").status_code == 200
        text = c.get("/metrics").text
    samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples["powerd_group_budget_watts"].value > 0
    assert "DCGM_FI_DEV_POWER_USAGE" in samples
    assert samples["powerd_tick_duration_seconds_count"].value >= 1
    with live.client(None) as c:
        assert c.get("/metrics").status_code == 401


def test_ticks_come_from_memory_without_a_store(tmp_path: Path) -> None:
    api = LiveApi(tmp_path, with_store=False).start()
    try:
        with api.client("viewer") as c:
            ticks = wait_until(
                lambda: [t for t in c.get("/api/v1/ticks").json() if t["gpus"] == 8], "ticks"
            )
            assert api.controller is not None
            last = api.controller.last_tick
            assert last is not None
            newest = c.get("/api/v1/ticks", params={"limit": 1}).json()[0]
            assert newest["tick"] >= last.tick >= ticks[0]["tick"]
            assert newest["budget_w"] == float(last.group_budget_w[0])
            assert newest["gpus"] == 8 and newest["gpus_stale"] == 0
            assert newest["committed_w"] > 0 and newest["draw_w"] > 0
            events = c.get("/api/v1/events")
            assert events.status_code == 503
            assert "without a store" in events.text
    finally:
        api.close()


def test_openapi_lists_every_endpoint(live: LiveApi) -> None:
    with live.client(None) as c:
        spec = c.get("/openapi.json").json()
    paths = set(spec["paths"])
    for p in (
        "/healthz",
        "/readyz",
        "/metrics",
        "/api/v1/fleet",
        "/api/v1/nodes",
        "/api/v1/gpus",
        "/api/v1/allocation",
        "/api/v1/ticks",
        "/api/v1/events",
        "/api/v1/audit",
        "/api/v1/budgets/{group}",
        "/api/v1/policy",
        "/api/v1/classes/assign",
        "/api/v1/gpus/{uuid}/pin",
        "/api/v1/nodes/{node}/drain",
    ):
        assert p in paths, p
    assert spec["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
