"""The admin API over real HTTP: a live controller (mock GPUs, in-process broker, SQLite)
with uvicorn on a free loopback port, and httpx as the client."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.api.app import create_app
from powerd.api.server import ApiServer
from powerd.auth import TokenStore, new_token_entry
from powerd.backends.mock import GpuFleetModel, MockBackend, Workload
from powerd.clock import SystemClock
from powerd.controller.build import StartState, build_controller
from powerd.controller.controller import Controller
from powerd.controller.hooks import metrics_hook
from powerd.controller.leadership import for_daemon
from powerd.controller.opstate import StateFile
from powerd.metrics import ControllerMetrics
from powerd.policy import load_policy_text
from powerd.store import Store, StoreWriter, WriterLimits, upgrade
from powerd.transport import MemoryBroker, MqttConfig, MqttTransport, Transport

# 1 row × 2 racks × 2 nodes × 2 GPUs; 8 × 700 W installed under a 4 kW feed, fast ticks.
POLICY = """
version: 1
facility:
  name: site
  budget_w: 4000
  rows:
    - name: row-1
      budget_w: 3800
      racks:
        - name: "rack-{1..2}"
          budget_w: 2000
          nodes:
            - name: "{rack}-n{1..2}"
              budget_w: 1500
              overhead_w: 100
              gpus: 2
profiles:
  flat:
    points: [[200, 0.4], [400, 0.8], [700, 1.0]]
classes:
  training: {weight: 1.0, profile: flat}
  inference: {weight: 4.0, floor_w: 300, profile: flat}
defaults:
  class: training
  failsafe_w: 200
  gpu: {min_cap_w: 200, max_cap_w: 700}
control:
  tick_s: 0.2
  lease_s: 2.0
  stale_after_s: 1.0
"""
NODES = ["rack-1-n1", "rack-1-n2", "rack-2-n1", "rack-2-n2"]
GPUS_PER_NODE = 2


class LiveApi:
    """The whole controller process, minus real GPUs and (without `broker_url`) a real
    broker, in a thread of its own with its own event loop; tests use synchronous HTTP
    clients against `url`."""

    def __init__(
        self,
        workdir: Path,
        policy_text: str = POLICY,
        *,
        with_store: bool = True,
        state_file: Path | None = None,
        broker_url: str | None = None,
        db_url: str | None = None,
        leadership: bool = False,
        limits: WriterLimits | None = None,
    ) -> None:
        self.workdir = workdir
        self.limits = limits
        self.leadership = leadership  # lead the store's lease, alone (SQLite), as main() does
        self.state_file = state_file
        self.policy_text = policy_text
        self.with_store = with_store
        # A real broker (Mosquitto) at this URL; None: the in-process one.
        self.broker_url = broker_url
        self.db_url = db_url or f"sqlite:///{workdir / 'powerd.db'}"
        self.model: GpuFleetModel | None = None
        self.tokens: dict[str, str] = {}
        entries = []
        for role in ("viewer", "operator", "admin"):
            token, entry = new_token_entry(f"{role}-user", role)
            self.tokens[role] = token
            entries.append(entry)
        (workdir / "tokens.toml").write_text("\n".join(entries))
        self.url = ""
        self.controller: Controller | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, name="live-api", daemon=True)

    def start(self) -> LiveApi:
        self._thread.start()
        if not self._ready.wait(60) or self._error is not None:
            raise RuntimeError(f"live API did not start: {self._error!r}")
        return self

    def close(self) -> None:
        if self._loop is not None and self._stop is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)
        if self._error is not None:
            raise self._error

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` in the controller's event loop (where the agents read the GPU model)."""
        assert self._loop is not None

        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result(10)

    def client(self, role: str | None = "admin") -> httpx.Client:
        headers = {} if role is None else {"Authorization": f"Bearer {self.tokens[role]}"}
        return httpx.Client(base_url=self.url, headers=headers, timeout=10)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self._error = exc
            self._ready.set()

    async def _main(self) -> None:
        clock = SystemClock()
        policy = load_policy_text(self.policy_text, "test-policy.yaml")
        store: Store | None = None
        writer: StoreWriter | None = None
        version: int | None = None  # the policy's, as stored
        if self.with_store:
            await asyncio.to_thread(upgrade, self.db_url)
            store = Store(self.db_url)
            writer = (
                StoreWriter(store)
                if self.limits is None
                else StoreWriter(store, limits=self.limits)
            )
            writer.start()
            version = store.record_policy_version(
                self.policy_text, source="test-policy.yaml", author="test", reason="start"
            )
        broker = MemoryBroker()

        def transport(client_id: str) -> Transport:
            if self.broker_url is None:
                return broker.client(client_id)
            return MqttTransport(
                MqttConfig.from_url(self.broker_url, client_id=client_id, reconnect_max_s=0.3)
            )

        model = self.model = GpuFleetModel(
            GPUS_PER_NODE * len(NODES),
            [Workload.steady(level_w=650.0), Workload.training(period_s=4.0)] * len(NODES),
            seed=1,
            start_s=clock.monotonic(),
            uuid_prefix="GPU-test",
        )
        agents = [
            Agent(
                AgentSettings(node_id=name, backend="mock", period_s=0.2, failsafe_w=200.0),
                MockBackend(model, clock, k * GPUS_PER_NODE, GPUS_PER_NODE),
                transport(f"agent-{name}"),
                clock,
            )
            for k, name in enumerate(NODES)
        ]
        leadership = None
        if self.leadership:
            assert self.with_store
            leadership = for_daemon(
                self.db_url,
                scope=policy.groups[0].name,
                holder="ctl-test",
                control=policy.control,
                lease_s=None,
                mode="alone",
            )
        controller = build_controller(
            policy,
            transport("controller"),
            clock,
            store=store,
            writer=writer,
            state_file=None if self.state_file is None else StateFile(self.state_file),
            leadership=leadership,
            start=StartState(policy_version=version),
        )
        if leadership is not None:
            await leadership.claim_alone()
        registry = CollectorRegistry()
        controller.on_tick.append(metrics_hook(controller, ControllerMetrics(registry)))
        tokens = TokenStore.from_file(self.workdir / "tokens.toml")
        server = ApiServer(create_app(controller, tokens, registry=registry), "127.0.0.1", 0)
        self.url = server.url
        self.controller = controller
        self._loop = asyncio.get_running_loop()
        self._stop = stop = asyncio.Event()

        def first_full_tick(r: Any) -> None:
            if len(r.uuids) == GPUS_PER_NODE * len(NODES):
                self._ready.set()

        controller.on_tick.append(first_full_tick)
        try:
            async with asyncio.TaskGroup() as tg:
                for agent in agents:
                    tg.create_task(agent.run(stop), name=f"agent-{agent.node_id}")
                tg.create_task(controller.run(stop, learn_s=0.2), name="controller")
                tg.create_task(controller.ledger.run(stop), name="ledger")
                tg.create_task(server.serve(stop), name="api")
                if controller.leadership is not None:
                    lead = controller.leadership.run(stop, controller.epoch_to_overtake)
                    tg.create_task(lead, name="leadership")
        finally:
            if writer is not None and store is not None:
                await asyncio.to_thread(writer.stop)
                store.close()


def wait_until(cond: Callable[[], Any], what: str) -> Any:
    """Poll (real time, generously: 20 s) until cond() is truthy; fail the test otherwise."""
    for _ in range(400):
        value = cond()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path).start()
    try:
        yield api
    finally:
        api.close()


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
            lambda: (f := c.get("/api/v1/fleet").json())["facility"]["committed_w"] <= 4000 and f,
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
        assert all(g["committed_w"] <= g["budget_w"] for g in racks["items"])

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
                and f["facility"]["committed_w"] <= 2500
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
