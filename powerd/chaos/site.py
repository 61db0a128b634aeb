"""A small site of real processes, and the faults it can suffer.

Mosquitto (`LocalMosquitto`), one `powerd controller` (SQLite, or PostgreSQL through a
loopback proxy) or a standby pair on PostgreSQL (`pair`), and an agent per node
(`python -m powerd.chaos.agent`: `powerd agent` with a wall clock to step) with mock GPUs
that journal every cap in force, each agent reaching the broker through its own loopback
proxy (to partition it). Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
import yaml
from sqlalchemy.engine import make_url

import powerd
from powerd.auth import Role, new_token_entry
from powerd.chaos.agent import write_limits, write_offset
from powerd.chaos.proxy import LOOPBACK, TcpProxy
from powerd.chaos.watcher import Watcher
from powerd.policy import Policy, load_policy
from powerd.testing.mosquitto import LocalMosquitto, free_port
from powerd.testing.synthetic import TRAIN_AND_INFER
from powerd.transport import MqttConfig, MqttTransport
from powerd.wire import Topics

HUGE_TICK = 100000000000000000000000000000
NODE_OVERHEAD_W = 100.0
# The processes run the powerd this harness imports (a worktree's, not an installed one).
_SOURCE = str(Path(powerd.__file__).resolve().parents[1])


@dataclass(frozen=True)
class SiteConfig:
    """racks × nodes × GPUs (200–700 W mock GPUs) with budgets tight at every level:
    per GPU the node allows 625 W, the rack 550 W and the facility 500 W (so 16 GPUs at
    their 700 W maximum would overshoot by 3,600 W: any cap left unguarded shows)."""

    racks: int = 2
    nodes_per_rack: int = 2
    gpus: int = 4
    tick_s: float = 0.5
    lease_s: float = 3.0
    period_s: float = 0.5  # agents' telemetry period, also how often they check the lease
    failsafe_w: float = 250.0
    db: Literal["sqlite", "postgresql"] = "sqlite"
    pg_url: str | None = None  # an empty database of the site's own, for "postgresql"
    reconnect_max_s: float = 2.0  # the daemons' reconnect backoff cap (default 30 s)
    # Two controllers on the one PostgreSQL store, each with its own policy file and wall
    # clock (python -m powerd.chaos.controller): the leader and a standby.
    pair: bool = False

    def __post_init__(self) -> None:
        if self.pair and self.db != "postgresql":
            raise ValueError("a standby pair needs db=postgresql (SQLite is for one controller)")

    @property
    def nodes(self) -> list[str]:
        return [
            f"rack-{r}-n{n}"
            for r in range(1, self.racks + 1)
            for n in range(1, self.nodes_per_rack + 1)
        ]

    def policy(self) -> dict[str, Any]:
        per_rack = self.nodes_per_rack * self.gpus
        return {
            "version": 1,
            "facility": {
                "name": "dc",
                "budget_w": 500 * self.racks * per_rack,
                "rows": [
                    {
                        "name": "row",
                        "racks": [
                            {
                                "name": f"rack-{r}",
                                "budget_w": 550 * per_rack,
                                "nodes": [
                                    {
                                        "name": f"rack-{r}-n{{1..{self.nodes_per_rack}}}",
                                        "budget_w": 625 * self.gpus,
                                        "overhead_w": NODE_OVERHEAD_W,
                                    }
                                ],
                            }
                            for r in range(1, self.racks + 1)
                        ],
                    }
                ],
            },
            **TRAIN_AND_INFER,
            "defaults": {
                "class": "training",
                "failsafe_w": self.failsafe_w,
                "gpus_per_node": self.gpus,
            },
            "control": {
                "tick_s": self.tick_s,
                "lease_s": self.lease_s,
                "stale_after_s": 3 * self.tick_s,
            },
        }


def gpu_uuids(node: str, gpus: int) -> list[str]:
    """The mock backend's uuids of a node's GPUs (seed 0)."""
    return [f"GPU-{node}-0-{i:06d}" for i in range(gpus)]


class Proc:
    """One process with a log file per life."""

    def __init__(self, name: str, workdir: Path) -> None:
        self.name = name
        self.workdir = workdir
        self.lives = 0
        self.popen: subprocess.Popen[bytes] | None = None

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        self.lives += 1
        with self.log_file.open("wb") as out:
            self.popen = subprocess.Popen(
                argv,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": _SOURCE, **env},
            )

    @property
    def log_file(self) -> Path:
        return self.workdir / f"{self.name}.{self.lives}.log"

    @property
    def alive(self) -> bool:
        return self.popen is not None and self.popen.poll() is None

    def signal(self, sig: int) -> None:
        if self.popen is not None:
            self.popen.send_signal(sig)

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGTERM, as an operator stops a unit; SIGKILL if it does not end in time."""
        if self.popen is not None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
            self.popen = None

    def kill(self) -> None:
        """SIGKILL: no failsafe on the way out, no clean goodbye to the broker."""
        if self.popen is not None:
            self.popen.kill()
            self.popen.wait()
            self.popen = None

    def tail(self, lines: int = 20) -> str:
        text = self.log_file.read_text(errors="replace") if self.log_file.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


class Site:
    def __init__(self, workdir: Path, config: SiteConfig | None = None) -> None:
        self.workdir = workdir
        self.config = config or SiteConfig()
        self.topics = Topics()
        workdir.mkdir(parents=True, exist_ok=True)
        self.policy_file = workdir / "policy.yaml"
        self.policy_file.write_text(yaml.safe_dump(self.config.policy()))
        self.policy: Policy = load_policy(self.policy_file)
        self.broker = LocalMosquitto(workdir / "mosquitto")
        self.nodes = self.config.nodes
        self.proxies = {n: TcpProxy(self.broker.port) for n in self.nodes}
        self.agents = {n: Proc(n, workdir) for n in self.nodes}
        self.controller = Proc("controller", workdir)
        # The pair's other member; `controller` is always the one that leads (`swap`).
        self.standby = Proc("standby", workdir) if self.config.pair else None
        self.members = [self.controller, *([self.standby] if self.standby else [])]
        # Per member (by process name, which stays with it across swaps): its own policy
        # file (a copy: a standby's file may go stale), wall clock and admin API.
        self.member_policy = {
            m.name: self.policy_file if m is self.controller else workdir / f"{m.name}.policy.yaml"
            for m in self.members
        }
        self.member_clock = {m.name: workdir / f"{m.name}.wall-offset" for m in self.members}
        self.member_port = {m.name: free_port() for m in self.members}
        self.journals = {n: workdir / f"{n}.journal" for n in self.nodes}
        self.clock_files = {n: workdir / f"{n}.wall-offset" for n in self.nodes}
        self.limits_files = {n: workdir / f"{n}.out-of-band.json" for n in self.nodes}
        self.token, entry = new_token_entry("chaos", Role.OPERATOR)
        self.tokens_file = workdir / "tokens.toml"
        self.tokens_file.write_text(entry)
        for m in self.members:
            self.member_policy[m.name].write_text(self.policy_file.read_text())
        self.db_proxy: TcpProxy | None = None
        self.db_url = f"sqlite:///{workdir / 'powerd.db'}"
        self.watcher = Watcher(self.policy, self.journals, self.broker.url, self.topics)
        self.clients = {m.name: self.client(self.member_port[m.name]) for m in self.members}
        self.intruders: list[Proc] = []  # controllers that should not be there (faults)
        self._lock_holder: asyncio.subprocess.Process | None = None

    def client(self, port: int) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            base_url=f"http://{LOOPBACK}:{port}",
            timeout=5.0,
            headers={"Authorization": f"Bearer {self.token}"},
        )

    @property
    def http(self) -> httpx.AsyncClient:
        """The admin API of the controller that leads (as last found)."""
        return self.clients[self.controller.name]

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self, timeout_s: float = 60.0) -> None:
        """Start everything, wait until every node is steered, then arm the watcher."""
        self.broker.start()
        if self.config.db == "postgresql":
            if self.config.pg_url is None:
                raise ValueError("db=postgresql needs pg_url")
            pg = make_url(self.config.pg_url)
            self.db_proxy = TcpProxy(pg.port or 5432)
            await self.db_proxy.start()
            self.db_url = pg.set(host=LOOPBACK, port=self.db_proxy.port).render_as_string(
                hide_password=False
            )
        for proxy in self.proxies.values():
            await proxy.start()
        await self.watcher.start()
        for node in self.nodes:
            self.start_agent(node)
        self.start_controller()
        t0 = time.monotonic()
        while not self.watcher.steered_since(t0):
            self.check_started()
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the site did not steer within {timeout_s:g} s")
            await asyncio.sleep(0.1)
        if self.standby is not None:
            # Once the first leads, so that the roles are known from the start.
            self.start_controller(self.standby)
            while await self.role(self.standby) != "standby":
                self.check_started()
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the standby did not stand by within {timeout_s:g} s")
                await asyncio.sleep(0.2)
        self.watcher.arm()

    def check_started(self) -> None:
        for proc in [*self.members, *self.agents.values()]:
            if proc.lives and not proc.alive:  # started (a standby starts second) and gone
                raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")

    async def close(self) -> None:
        await self.watcher.stop()
        for proc in [*self.members, *self.intruders, *self.agents.values()]:
            proc.kill()
        await self.release_db_lock()
        for proxy in [*self.proxies.values(), *([self.db_proxy] if self.db_proxy else [])]:
            await proxy.close()
        self.broker.kill()
        for client in self.clients.values():
            await client.aclose()

    # -- processes -----------------------------------------------------------------------

    def start_agent(self, node: str) -> None:
        c = self.config
        env = {
            "POWERD_NODE_ID": node,
            "POWERD_BROKER": self.proxies[node].url,
            "POWERD_BACKEND": "mock",
            "POWERD_MOCK_GPUS": str(c.gpus),
            # One node serves inference (weight 4, with a floor), the rest train.
            "POWERD_MOCK_WORKLOAD": "inference" if node == self.nodes[0] else "training",
            "POWERD_MOCK_JOURNAL": str(self.journals[node]),
            "POWERD_PERIOD_S": str(c.period_s),
            "POWERD_FAILSAFE_W": str(c.failsafe_w),
            "POWERD_RECONNECT_MAX_S": str(c.reconnect_max_s),
        }
        argv = [
            sys.executable,
            "-m",
            "powerd.chaos.agent",
            str(self.clock_files[node]),
            str(self.limits_files[node]),
        ]
        self.agents[node].start(argv, env)

    def start_controller(self, member: Proc | None = None) -> None:
        """Start a member of the site's control (default: the one that leads). Alone:
        `powerd controller` itself. A pair: `python -m powerd.chaos.controller`, the same
        controller with a wall clock the harness can step, settings from the environment."""
        proc = member or self.controller
        ident = f"chaos-ctl-{proc.lives + 1}" if not self.config.pair else None
        if ident is not None:
            argv = [
                *self.controller_argv(self.member_policy[proc.name], self.db_url, ident),
                f"--api-port={self.member_port[proc.name]}",
                f"--state-file={self.workdir / f'{proc.name}.state.json'}",
            ]
            env = {"POWERD_RECONNECT_MAX_S": str(self.config.reconnect_max_s)}
        else:
            argv = [
                sys.executable,
                "-m",
                "powerd.chaos.controller",
                str(self.member_clock[proc.name]),
            ]
            env = {
                "POWERD_POLICY": str(self.member_policy[proc.name]),
                "POWERD_BROKER": self.broker.url,
                "POWERD_DB": self.db_url,
                "POWERD_CONTROLLER_ID": f"chaos-{proc.name}-{proc.lives + 1}",
                "POWERD_LEARN_S": str(2 * self.config.tick_s),
                "POWERD_API_PORT": str(self.member_port[proc.name]),
                "POWERD_TOKENS_FILE": str(self.tokens_file),
                # Each member's state file beside its own policy: two processes never
                # share one (the store is what they share).
                "POWERD_STATE_FILE": str(self.workdir / f"{proc.name}.state.json"),
                "POWERD_RECONNECT_MAX_S": str(self.config.reconnect_max_s),
            }
        proc.start(argv, env)

    def controller_argv(self, policy: Path, db_url: str, ident: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "powerd.cli",
            "--log-format",
            "json",
            "controller",
            f"--policy={policy}",
            f"--broker={self.broker.url}",
            f"--db={db_url}",
            f"--controller-id={ident}",
            f"--learn-s={2 * self.config.tick_s}",
            f"--tokens-file={self.tokens_file}",
        ]

    def start_intruder(self, scope: str | None, api_port: int) -> Proc:
        """A `powerd controller` that should not be there: the site's policy on a SQLite
        store of its own (a copied unit without POWERD_DB), optionally with `--scope`."""
        n = len(self.intruders) + 1
        home = self.workdir / f"intruder-{n}"
        home.mkdir(exist_ok=True)
        proc = Proc(f"intruder-{n}", self.workdir)
        argv = [
            *self.controller_argv(self.policy_file, f"sqlite:///{home / 'powerd.db'}", proc.name),
            f"--api-port={api_port}",
            *([f"--scope={scope}"] if scope else []),
        ]
        proc.start(argv, {"POWERD_RECONNECT_MAX_S": str(self.config.reconnect_max_s)})
        self.intruders.append(proc)
        return proc

    # -- a pair ----------------------------------------------------------------------------

    async def role(self, member: Proc) -> str | None:
        """ "leader" or "standby" as the member's /leadership says; None: no answer."""
        if not member.alive:
            return None
        try:
            r = await self.clients[member.name].get("/api/v1/leadership")
        except httpx.HTTPError:
            return None
        return str(r.json().get("role")) if r.status_code == 200 else None

    def swap(self) -> None:
        """The standby leads now: it becomes `controller` (and its API the site's)."""
        assert self.standby is not None
        self.controller, self.standby = self.standby, self.controller

    async def follow_leader(self) -> None:
        """Swap the roles when the standby says it leads and the other does not."""
        if self.standby is None:
            return
        if await self.role(self.standby) == "leader" and await self.role(self.controller) != (
            "leader"
        ):
            self.swap()

    async def alarms(self, client: httpx.AsyncClient) -> dict[str, str]:
        """The alarms a controller's API shows active ({} when it does not answer)."""
        try:
            r = await client.get("/api/v1/alarms")
        except httpx.HTTPError:
            return {}
        return {a["kind"]: a["message"] for a in r.json()} if r.status_code == 200 else {}

    async def budget_in_force(self, client: httpx.AsyncClient, group: str) -> float | None:
        try:
            r = await client.get("/api/v1/groups", params={"limit": 1000})
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None
        return next((g["budget_w"] for g in r.json()["items"] if g["name"] == group), None)

    # -- liveness ------------------------------------------------------------------------

    async def health(self) -> tuple[bool, bool]:
        """(/healthz answers ok, /readyz says ready)."""
        try:
            live = (await self.http.get("/healthz")).status_code == 200
            ready = (await self.http.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False, False
        return live, ready

    # -- faults: processes and network ---------------------------------------------------

    def step_clock(self, node: str, offset_s: float) -> None:
        write_offset(self.clock_files[node], offset_s)

    def hold_out_of_band(self, node: str, limits_w: dict[int, float]) -> None:
        """Limits another holds on the node's GPUs, by index ({}: none: back at once)."""
        write_limits(self.limits_files[node], limits_w)

    def step_member_clock(self, member: Proc, offset_s: float) -> None:
        write_offset(self.member_clock[member.name], offset_s)

    async def partition(self, node: str) -> None:
        await self.proxies[node].cut()

    async def heal(self, node: str) -> None:
        await self.proxies[node].restore()

    # -- faults: the database ------------------------------------------------------------

    async def hold_db_lock(self) -> None:
        """Take an exclusive lock on the store from another process, until released.

        SQLite: BEGIN EXCLUSIVE (the controller's writer waits up to its busy_timeout of
        5 s, then its writes fail). PostgreSQL: the store's tables in ACCESS EXCLUSIVE
        mode (writes and reads wait)."""
        if self.config.db == "sqlite":
            code = (
                "import sqlite3, sys, time\n"
                "c = sqlite3.connect(sys.argv[1], timeout=30, isolation_level=None)\n"
                "c.execute('BEGIN EXCLUSIVE')\n"
                "print('locked', flush=True)\n"
                "time.sleep(3600)\n"
            )
            target = make_url(self.db_url).database or ""
        else:
            code = (
                "import psycopg, sys, time\n"
                "c = psycopg.connect(sys.argv[1])\n"
                "c.execute('LOCK TABLE ticks, cap_changes, events, gpu_minutes "
                "IN ACCESS EXCLUSIVE MODE')\n"
                "print('locked', flush=True)\n"
                "time.sleep(3600)\n"
            )
            assert self.config.pg_url is not None
            # Directly, not through the proxy; libpq's URL has no SQLAlchemy driver name.
            pg = make_url(self.config.pg_url).set(drivername="postgresql")
            target = pg.render_as_string(hide_password=False)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", code, target, stdout=asyncio.subprocess.PIPE
        )
        self._lock_holder = proc
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        if line.strip() != b"locked":
            raise RuntimeError("the lock holder could not take the lock")

    async def release_db_lock(self) -> None:
        proc, self._lock_holder = self._lock_holder, None
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()

    async def db_down(self) -> None:
        """The database unreachable: PostgreSQL's proxy cut; SQLite (no server to lose):
        an exclusive lock held past the writer's busy_timeout, so every write fails."""
        if self.db_proxy is not None:
            await self.db_proxy.cut()
        else:
            await self.hold_db_lock()

    async def db_up(self) -> None:
        if self.db_proxy is not None:
            await self.db_proxy.restore()
        else:
            await self.release_db_lock()

    # -- faults: operators and adversaries -----------------------------------------------

    async def cut_budget(self, group: str, budget_w: float, ttl_s: float = 3600) -> None:
        body = {"budget_w": budget_w, "ttl_s": ttl_s, "reason": "chaos: demand response"}
        r = await self.http.put(f"/api/v1/budgets/{group}", json=body)
        r.raise_for_status()
        after = r.json().get("after_tick")
        self.watcher.cut(group, budget_w, after if after is not None else -1)

    async def clear_budget(self, group: str) -> None:
        self.watcher.clear(group)
        r = await self.http.delete(f"/api/v1/budgets/{group}", params={"reason": "chaos: over"})
        r.raise_for_status()

    async def publish_raw(self, topic: str, payload: dict[str, Any], retain: bool = False) -> None:
        """Publish as an adversary would: a bare MQTT client, none of powerd's validation
        (the transport sends whatever bytes it is given)."""
        client = MqttTransport(
            MqttConfig(LOOPBACK, self.broker.port, client_id=f"chaos-raw-{time.monotonic_ns()}")
        )
        await client.connect()
        try:
            await asyncio.wait_for(client.wait_connected(), 10)
            await client.publish(topic, json.dumps(payload).encode(), qos=1, retain=retain)
        finally:
            await client.disconnect()

    def gpu_json(self, uuid: str, index: int, cap_w: float, **over: float) -> dict[str, Any]:
        g: dict[str, Any] = {
            "uuid": uuid,
            "index": index,
            "name": "Mock H200",
            "power_w": min(cap_w, 180.0),
            "energy_j": 1.0,
            "cap_w": cap_w,
            "min_cap_w": 200.0,
            "max_cap_w": 700.0,
            "default_cap_w": 700.0,
            "temp_c": 40.0,
            "util_pct": 10.0,
            "sm_clock_mhz": 900.0,
        }
        g.update(over)
        return g

    def telemetry_json(
        self, node: str, gpus: list[dict[str, Any]], ts: float | None = None
    ) -> dict[str, Any]:
        return {
            "v": 1,
            "node_id": node,
            "ts": time.time() if ts is None else ts,
            "seq": 10**6,
            "period_s": self.config.period_s,
            "gpus": gpus,
            "state": "steered",
        }
