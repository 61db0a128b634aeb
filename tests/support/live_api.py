"""The controller process in a thread of the test, minus real GPUs: its admin API served by
uvicorn on a free loopback port, mock agents on an in-process broker (or a real one at
`broker_url`), SQLite or PostgreSQL behind it; tests talk to it over real HTTP. It needs
nothing outside the test process, so the tests that use it are quick."""

from __future__ import annotations

import argparse
import asyncio
import io
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.api.app import create_app
from powerd.api.server import ApiServer
from powerd.auth import TokenStore, new_token_entry
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.cli.admin import add_parser
from powerd.clock import SystemClock
from powerd.controller.build import StartState, build_controller
from powerd.controller.controller import Controller
from powerd.controller.hooks import metrics_hook
from powerd.controller.leadership import for_daemon
from powerd.controller.opstate import StateFile
from powerd.metrics import ControllerMetrics
from powerd.policy import load_policy_text
from powerd.settings import ApiTls
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
        tls: ApiTls | None = None,
    ) -> None:
        self.workdir = workdir
        self.tls = tls  # HTTPS (then `url` is https://; `client` does not know the CA)
        self.limits = limits
        self.leadership = leadership  # lead the store's lease, alone (SQLite), as main() does
        self.state_file = state_file
        self.policy_text = policy_text
        self.with_store = with_store
        # A real broker (Mosquitto) at this URL; None: the in-process one.
        self.broker_url = broker_url
        self.db_url = db_url or f"sqlite:///{workdir / 'powerd.db'}"
        self.model: SimulatedGpus | None = None
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

        model = self.model = SimulatedGpus(
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
        app = create_app(controller, tokens, registry=registry)
        server = ApiServer(app, "127.0.0.1", 0, tls=self.tls)
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


def run(argv: list[str]) -> tuple[int, str]:
    """`powerd <argv>`, the API client's commands, in this process: exit code and output."""
    parser = argparse.ArgumentParser(prog="powerd")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    out = io.StringIO()
    return args.handler(args, out), out.getvalue()
