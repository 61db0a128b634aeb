"""`powerd demo`: a controller and simulated GPU nodes in one process, on embedded defaults.

Every part is the real one — agents, safety planner, allocator, store — except the GPUs
(the mock's physical model) and, unless `--broker` is given, the broker (in-process).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import statistics
import sys
import tempfile
from dataclasses import dataclass, field, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import numpy as np

from powerd.agent.agent import Agent
from powerd.agent.settings import AgentSettings
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.clock import Clock, SystemClock
from powerd.controller.build import ControllerOptions, build_controller
from powerd.controller.controller import Controller
from powerd.controller.report import TickReport
from powerd.numeric import finite_or_none
from powerd.policy import Policy, load_policy, load_policy_text
from powerd.store import Store, StoreWriter, upgrade
from powerd.transport import MemoryBroker, MqttConfig, MqttTransport, Transport

if TYPE_CHECKING:
    from powerd.allocator.kernel import WarmUp
    from powerd.api.server import ApiServer

EMBEDDED_POLICY = "example.yaml"


def default_policy() -> Policy:
    """The example policy shipped inside the package (the same as policies/example.yaml)."""
    text = resources.files("powerd.data").joinpath(EMBEDDED_POLICY).read_text(encoding="utf-8")
    return load_policy_text(text, f"<embedded {EMBEDDED_POLICY}>")


def workload_mix(policy: Policy, node_index: int, tick_s: float) -> Workload:
    """A mixed site: per 10 nodes, 3 serve inference, 5 train (two jobs), 1 batch, 1 idle.

    Classes and profiles come from the policy when it has them, so the GPUs' throughput
    follows the same curves the allocator steers by.
    """
    slot = node_index % 10

    def profile(cls: str, fallback: Workload) -> Workload:
        if cls in policy.classes:
            return replace(fallback, name=cls, profile=policy.class_profile(cls))
        return fallback

    if slot < 3:
        # A compressed "day" so the demo shows load swinging, with bursts.
        return profile(
            "inference",
            Workload.inference(
                day_s=120.0, phase_s=30.0 * slot, burst_prob=0.15, burst_slot_s=tick_s
            ),
        )
    if slot < 8:
        job_phase = 0.0 if slot < 6 else 3.3
        return profile("training", Workload.training(period_s=8.0, phase_s=job_phase))
    if slot == 8:
        return profile("batch", Workload.steady(level_w=620.0))
    return Workload.idle()


@dataclass
class DemoStats:
    """What the demo counts. A tick with a *settling* group is apart (start-up): until a GPU
    acknowledges a first cap of this controller it counts at its maximum (docs/safety.md,
    "Restart"), so committed sits above budgets there without any cap sent above one, and
    the GPUs, booted at their default limits, may still draw them."""

    ticks: int = 0
    over_budget_ticks: int = 0  # committed caps above a budget, settling groups aside (must stay 0)
    draw_over_ticks: int = 0  # measured draw above a budget, start-up ticks aside
    max_committed_frac: float = 0.0  # after start-up
    max_draw_frac: float = 0.0  # after start-up
    # Start-up (ticks where any group settles): how many, how long, how high.
    startup_ticks: int = 0
    startup_s: float = 0.0  # from the first such tick to the first tick after them
    startup_open: bool = False  # the last tick still settled
    startup_max_committed_frac: float = 0.0
    startup_max_committed_group: str | None = None  # the group of that highest ratio
    startup_max_draw_frac: float = 0.0
    startup_draw_over_ticks: int = 0
    solve_ms: list[float] = field(default_factory=list)
    tick_ms: list[float] = field(default_factory=list)
    throughput: list[float] = field(default_factory=list)
    # What the same GPUs would have delivered uncapped (each at its demand): per GPU, the
    # measure of what static provisioning's GPUs deliver.
    uncapped_per_gpu: list[float] = field(default_factory=list)
    # Per tick, the mean draw of a GPU of this mix provisioned at TDP (its demand).
    uncapped_draw_w: list[float] = field(default_factory=list)
    draw_w: list[float] = field(default_factory=list)
    statuses: dict[str, int] = field(default_factory=dict)
    _last_ts: float | None = None

    def add(self, r: TickReport) -> None:
        self.ticks += 1
        budget = r.group_budget_w
        finite = np.isfinite(budget)
        if r.group_over.any():  # the controller's own count: settling groups are not over
            self.over_budget_ticks += 1
        if self.startup_open and self._last_ts is not None:
            self.startup_s += r.ts - self._last_ts
        self._last_ts = r.ts
        self.startup_open = bool(r.group_settling.any())
        committed = _max_ratio(r.group_committed_w, budget, finite)
        draw = _max_ratio(r.group_draw_w, budget, finite)
        draw_over = bool(np.any(r.group_draw_w[finite] > budget[finite] + 1e-6))
        if self.startup_open:
            self.startup_ticks += 1
            if committed > self.startup_max_committed_frac:
                self.startup_max_committed_frac = committed
                ratio = np.where(finite, r.group_committed_w / np.where(finite, budget, 1.0), 0)
                self.startup_max_committed_group = r.group_names[int(np.argmax(ratio))]
            self.startup_max_draw_frac = max(self.startup_max_draw_frac, draw)
            self.startup_draw_over_ticks += draw_over
        else:
            self.max_committed_frac = max(self.max_committed_frac, committed)
            self.max_draw_frac = max(self.max_draw_frac, draw)
            self.draw_over_ticks += draw_over
        self.solve_ms.append(r.solve_ms)
        self.tick_ms.append(r.duration_ms)
        self.throughput.append(r.throughput_total)
        self.draw_w.append(float(r.group_draw_w[0]))
        self.statuses[r.status] = self.statuses.get(r.status, 0) + 1


def _max_ratio(value_w: np.ndarray[Any, Any], budget_w: np.ndarray[Any, Any], finite: Any) -> float:
    return float(np.max(value_w[finite] / budget_w[finite])) if finite.any() else 0.0


@dataclass(frozen=True)
class Boot:
    """How the simulated GPUs start: at their default power limit, held by their agents at
    the failsafe cap until a first command, counted by the controller at their maximum."""

    default_cap_w: float
    failsafe_w: float
    max_cap_w: float


class StartupNotes:
    """The console's lines about start-up: what it is at its first tick, when it ends."""

    def __init__(self, boot: Boot) -> None:
        self.boot = boot
        self.said = False
        self.settling = False
        self.ticks = 0
        self.since: float | None = None

    def after(self, r: TickReport) -> list[str]:
        settling = bool(r.group_settling.any())
        lines: list[str] = []
        if settling and not self.said:
            self.said = True
            b = self.boot
            lines += [
                f"  ^ START-UP: GPUs boot at their default limit ({b.default_cap_w:.0f} W); their "
                f"agents hold them at the failsafe cap ({b.failsafe_w:.0f} W)",
                "    until a first command. Until a GPU acknowledges a cap of this controller, it "
                f"counts at its maximum ({b.max_cap_w:.0f} W),",
                "    since an earlier controller's commands could still land (docs/safety.md, "
                '"Restart"): that is the committed',
                "    above budget here. Nothing is raised meanwhile; the summary counts these "
                "ticks apart.",
            ]
        if settling:
            self.ticks += 1
            self.since = r.ts if self.since is None else self.since
        elif self.settling and self.since is not None:
            lines.append(
                f"  start-up over after {self.ticks} tick{'s' if self.ticks != 1 else ''} "
                f"({r.ts - self.since:.1f} s): every GPU has acknowledged a cap"
            )
            self.ticks, self.since = 0, None
        self.settling = settling
        return lines


def _kw(w: float) -> str:
    return "  ∞  " if not math.isfinite(w) else f"{w / 1000:6.1f}"


def live_line(r: TickReport) -> str:
    rows = " ".join(
        f"{name}:{committed / budget:4.0%}" if math.isfinite(budget) else f"{name}:-"
        for name, budget, committed, _ in r.level_totals(1)
    )
    by_class = " ".join(f"{c[:5]}={v:6.1f}" for c, v in sorted(r.throughput_by_class().items()))
    flag = " OVER" if r.group_over.any() else ""
    if r.group_settling.any():
        flag += " START-UP"  # GPUs counted at their maximum until their first ack
    return (
        f"tick {r.tick:4d} | budget {_kw(r.group_budget_w[0])} kW"
        f" | committed {_kw(r.group_committed_w[0])} kW"
        f" | draw {_kw(r.group_draw_w[0])} kW | rows {rows} | throughput {r.throughput_total:7.1f}"
        f" ({by_class}) | solve {r.solve_ms:5.1f} ms | {r.status}{flag}"
    )


def summary(
    stats: DemoStats,
    policy: Policy,
    n_gpus: int,
    db_url: str | None,  # None: a temporary store, removed at exit
    solver: WarmUp | None = None,
) -> dict[str, Any]:
    def pct(xs: list[float], q: float) -> float:
        return float(np.percentile(xs, q)) if xs else math.nan

    installed = n_gpus * policy.defaults.gpu.max_cap_w
    overhead = sum(g.overhead_w for g in policy.groups if g.level == 3)
    budget = policy.groups[0].budget_w
    # Static provisioning reserves every GPU's TDP (and the overhead beside it) in the feed.
    static_gpus = (
        min(n_gpus, math.floor(n_gpus * budget / (installed + overhead)))
        if math.isfinite(budget)
        else n_gpus
    )
    return {
        "ticks": stats.ticks,
        "gpus": n_gpus,
        "facility_budget_w": finite_or_none(budget),
        "gpu_tdp_installed_w": installed,
        "gpus_static_provisioning": static_gpus,
        "ticks_committed_over_budget": stats.over_budget_ticks,
        "ticks_draw_over_budget": stats.draw_over_ticks,
        "max_committed_over_budget_ratio": stats.max_committed_frac,
        "max_draw_over_budget_ratio": stats.max_draw_frac,
        # Start-up, apart from the figures above (DemoStats).
        "startup_ticks": stats.startup_ticks,
        "startup_s": stats.startup_s,
        "startup_settled": not stats.startup_open,
        "startup_max_committed_ratio": stats.startup_max_committed_frac,
        "startup_max_committed_group": stats.startup_max_committed_group,
        "startup_max_draw_ratio": stats.startup_max_draw_frac,
        "startup_ticks_draw_over_budget": stats.startup_draw_over_ticks,
        "mean_draw_w": statistics.fmean(stats.draw_w) if stats.draw_w else math.nan,
        "mean_throughput": statistics.fmean(stats.throughput) if stats.throughput else math.nan,
        # The same mix on the GPUs static provisioning powers, each at full speed.
        "static_throughput": static_gpus * statistics.fmean(stats.uncapped_per_gpu)
        if stats.uncapped_per_gpu
        else math.nan,
        # ...and what they draw there, with their nodes' overhead (the energy it costs).
        "static_mean_draw_w": static_gpus * statistics.fmean(stats.uncapped_draw_w)
        + overhead * static_gpus / max(n_gpus, 1)
        if stats.uncapped_draw_w
        else math.nan,
        "solve_ms_p50": pct(stats.solve_ms, 50),
        "solve_ms_p99": pct(stats.solve_ms, 99),
        "tick_ms_p50": pct(stats.tick_ms, 50),
        "tick_ms_p99": pct(stats.tick_ms, 99),
        # Compiling (or loading) the solver before the first tick: not in solve_ms.
        "solver_ready_s": None if solver is None else solver.seconds,
        "solver_kernels_compiled": None if solver is None else solver.compiled,
        "statuses": stats.statuses,
        "db": db_url,
    }


def print_summary(s: dict[str, Any], out: TextIO) -> None:
    print("\nsummary", file=out)
    print(
        f"  ticks {s['ticks']}, GPUs {s['gpus']}, GPU TDP installed "
        f"{s['gpu_tdp_installed_w'] / 1000:.1f} kW under a "
        f"{(s['facility_budget_w'] or math.inf) / 1000:.1f} kW facility budget",
        file=out,
    )
    static = s["gpus_static_provisioning"]
    if static < s["gpus"] and math.isfinite(s["static_throughput"]):
        # The gain as operators judge it: work under the same feed, not GPUs alone.
        gain = s["mean_throughput"] / max(s["static_throughput"], 1e-9) - 1.0
        energy = s["mean_draw_w"] / max(s["static_mean_draw_w"], 1e-9) - 1.0
        per_j = (1.0 + gain) / (1.0 + energy) - 1.0  # facility draw: GPUs plus overhead
        print(
            f"  provisioned at full TDP, this feed would power {static} GPUs, delivering "
            f"{s['static_throughput']:.1f} GPU-equivalents of this mix at "
            f"{s['static_mean_draw_w'] / 1000:.1f} kW; powerd steered {s['gpus']} within every "
            f"budget, delivering {s['mean_throughput']:.1f} at {s['mean_draw_w'] / 1000:.1f} kW "
            f"({gain:+.0%} throughput and {energy:+.0%} energy under the same feed, "
            f"{per_j:+.0%} work per facility joule)",
            file=out,
        )
    _print_startup(s, out)
    after = " after start-up" if s["startup_ticks"] else ""
    print(
        f"  ticks{after} with committed caps over any budget: "
        f"{s['ticks_committed_over_budget']} "
        f"(highest committed/budget {s['max_committed_over_budget_ratio']:.1%})",
        file=out,
    )
    print(
        f"  ticks{after} with measured draw over any budget:  {s['ticks_draw_over_budget']} "
        f"(highest draw/budget {s['max_draw_over_budget_ratio']:.1%})",
        file=out,
    )
    print(
        f"  mean facility draw {s['mean_draw_w'] / 1000:.1f} kW, mean throughput "
        f"{s['mean_throughput']:.1f} (GPU-equivalents at full speed)",
        file=out,
    )
    if s["solver_ready_s"] is not None:
        how = (
            f"compiled ({s['solver_kernels_compiled']} kernels)"
            if s["solver_kernels_compiled"]
            else "loaded from numba's cache"
        )
        print(
            f"  solver {how} in {s['solver_ready_s']:.1f} s before the first tick, not in "
            "the solve times",
            file=out,
        )
    print(
        f"  solve p50 {s['solve_ms_p50']:.1f} ms, p99 {s['solve_ms_p99']:.1f} ms; tick p50 "
        f"{s['tick_ms_p50']:.1f} ms, p99 {s['tick_ms_p99']:.1f} ms (in-process agents share "
        "the controller's event loop)",
        file=out,
    )
    history = (
        f"history in {s['db']}"
        if s["db"]
        else "history not kept (a temporary store, removed at exit; --db URL keeps it)"
    )
    print(f"  allocation statuses: {s['statuses']}; {history}", file=out)


def _print_startup(s: dict[str, Any], out: TextIO) -> None:
    n = s["startup_ticks"]
    if not n:
        return
    lasted = (
        f"{n} tick{'s' if n != 1 else ''} ({s['startup_s']:.1f} s)"
        if s["startup_settled"]
        else f"{n} ticks, still at the end"
    )
    print(
        f"  start-up: {lasted} until every GPU acknowledged its first cap; GPUs counted at "
        f"their maximum meanwhile: committed up to {s['startup_max_committed_ratio']:.1%} of "
        f"a budget ({s['startup_max_committed_group']}), draw up to "
        f"{s['startup_max_draw_ratio']:.1%} "
        f"({s['startup_ticks_draw_over_budget']} of those ticks with draw over a budget, "
        "GPUs still at their boot limits); expected at every start, reported apart",
        file=out,
    )


def baselines_line(
    model: SimulatedGpus, policy: Policy, gpu_nodes: list[str], start_s: float, duration_s: float
) -> str:
    """What the demo's GPUs would do without powerd, from their demand over the run (at
    most 200 samples): uncapped draw against the budgets and what a breaker rated at the
    budget makes of it, and what static TDP caps fit (docs/simulator.md, "Baselines")."""
    from powerd.sim.baselines import Breaker
    from powerd.topology import Topology

    topo = Topology.build(policy, gpu_nodes)
    times = np.linspace(start_s, start_s + duration_s, max(2, min(200, int(duration_s) + 1)))
    draw = np.array([np.minimum(model.demand_at(float(t)), model.max_cap_w) for t in times])
    finite = np.isfinite(topo.budget_w) & (topo.budget_w > 0)
    if not finite.any():
        return ""
    groups = np.array([topo.group_sums(d) for d in draw]) + topo.overhead_w
    ratio = np.where(finite, groups / np.where(finite, topo.budget_w, 1.0), 0.0)
    t_worst, g_worst = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    worst = float(ratio[t_worst, g_worst])
    over = float(np.mean((ratio > 1.0).any(axis=1)))
    trip = Breaker().trip_s(worst)
    verdict = (
        "never trips a breaker rated at the budget"
        if math.isinf(trip)
        else f"a breaker rated at the budget trips in {trip / 60:.0f} min at that load"
    )
    line = (
        f"  without powerd: uncapped, these {model.n} GPUs would draw up to {worst:.0%} of "
        f"{topo.names[g_worst]}'s budget ({over:.0%} of the time over one); {verdict}"
    )
    feed = float(topo.budget_w[0])
    node = next((g for g in policy.groups if g.level == 3), None)
    if math.isfinite(feed) and node is not None and model.n:
        nodes = int(feed // (node.gpus * float(model.max_cap_w[0]) + node.overhead_w))
        line += f"; static TDP caps fit {nodes * node.gpus} GPUs under the feed"
    return line + ". The oracle and the full comparison: powerd sim (docs/simulator.md)"


def tick_json(r: TickReport) -> dict[str, Any]:
    """One line of `powerd demo --json`: the facility and its rows at this tick."""
    return {
        "tick": r.tick,
        "budget_w": finite_or_none(r.group_budget_w[0]),
        "committed_w": r.group_committed_w[0],
        "draw_w": r.group_draw_w[0],
        "unused_w": r.unused_w,
        "throughput": r.throughput_total,
        "throughput_by_class": r.throughput_by_class(),
        "solve_ms": r.solve_ms,
        "status": r.status,
        "over_budget": bool(r.group_over.any()),
        # GPUs counted at their maximum until their first ack: committed may exceed budgets
        "startup": bool(r.group_settling.any()),
        "rows": {
            n: {"budget_w": finite_or_none(b), "committed_w": ld, "draw_w": d}
            for n, b, ld, d in r.level_totals(1)
        },
    }


def _first_nodes(policy: Policy, nodes: int | None) -> tuple[Policy, list[str]]:
    """The policy cut down to its first `nodes` nodes (None: all of them), and their names."""
    names = policy.node_names()
    if nodes is None:
        return policy, names
    if not 1 <= nodes <= len(names):
        raise ValueError(f"--nodes must be between 1 and {len(names)} for this policy")
    return policy.subset(names[:nodes]), names[:nodes]


class LiveView:
    """Each tick: counted, then printed (a line, or JSON with `as_json`), with the start-up
    notes."""

    def __init__(self, model: SimulatedGpus, policy: Policy, out: TextIO, *, as_json: bool):
        self.model = model
        self.out = out
        self.as_json = as_json
        self.stats = DemoStats()
        self.notes = StartupNotes(
            Boot(
                default_cap_w=float(model.default_cap_w.max()) if model.n else 0.0,
                failsafe_w=policy.defaults.failsafe_w,
                max_cap_w=policy.defaults.gpu.max_cap_w,
            )
        )

    def show(self, r: TickReport) -> None:
        model, stats = self.model, self.stats
        stats.add(r)
        # What the same GPUs would deliver uncapped: per GPU, what a statically provisioned
        # GPU of this mix delivers.
        stats.uncapped_per_gpu.append(float(model.uncapped_throughput().mean()) if model.n else 0.0)
        stats.uncapped_draw_w.append(float(model.demand_w.mean()) if model.n else 0.0)
        if self.as_json:
            print(json.dumps(tick_json(r)), file=self.out, flush=True)
            return
        print(live_line(r), file=self.out, flush=True)
        for line in self.notes.after(r):
            print(line, file=self.out, flush=True)


def live_page(controller: Controller, port: int, out: TextIO) -> ApiServer:
    """The API on 127.0.0.1:`port` with two fresh tokens: a viewer's in the live page's link,
    an operator's for the command line (`powerd status`, `gpus`, `budget`, `pin`, `drain`
    read $POWERD_URL and $POWERD_TOKEN). Prints both."""
    from powerd.api.app import create_app
    from powerd.api.server import ApiServer
    from powerd.auth import Role, TokenStore, generate_token

    viewer, operator = generate_token(), generate_token()
    tokens = TokenStore(
        [
            *TokenStore.single(viewer, Role.VIEWER, "demo-viewer").entries,
            *TokenStore.single(operator, Role.OPERATOR, "demo-operator").entries,
        ]
    )
    server = ApiServer(create_app(controller, tokens), "127.0.0.1", port)
    url = f"http://127.0.0.1:{server.port}"
    # The viewer's token in the fragment: the browser keeps it, no server log sees it.
    print(f"live page: {url}/ui#token={viewer}", file=out)
    print(
        "command line, as an operator (powerd status, gpus, why, budget, pin, drain), in "
        "another shell while the demo runs:",
        file=out,
    )
    print(f"  export POWERD_URL={url} POWERD_TOKEN={operator}", file=out, flush=True)
    return server


async def run_demo(
    policy: Policy,
    *,
    duration_s: float = 30.0,
    nodes: int | None = None,
    broker: str | None = None,
    db_url: str | None = None,
    as_json: bool = False,
    seed: int = 0,
    out: TextIO | None = None,  # default: sys.stdout when called, not when imported
    clock: Clock | None = None,
    ui_port: int | None = None,  # also serve the live page (/ui) there: live_page()
) -> dict[str, Any]:
    out = sys.stdout if out is None else out
    clock = clock or SystemClock()
    policy, node_names = _first_nodes(policy, nodes)
    groups = {g.name: g for g in policy.groups}
    counts = [groups[n].gpus for n in node_names]
    tick_s = policy.control.tick_s
    per_gpu = [workload_mix(policy, k, tick_s) for k, c in enumerate(counts) for _ in range(c)]
    model = SimulatedGpus(
        len(per_gpu), per_gpu, seed=seed, start_s=clock.monotonic(), uuid_prefix="GPU-demo"
    )

    tmp = None
    if db_url is None:
        tmp = tempfile.TemporaryDirectory(prefix="powerd-demo-")
        db_url = f"sqlite:///{Path(tmp.name) / 'powerd.db'}"
    upgrade(db_url)
    store = Store(db_url)
    writer = StoreWriter(store)
    writer.start()

    memory = MemoryBroker() if broker is None else None

    def transport(client_id: str) -> Transport:
        if memory is not None:
            return memory.client(client_id)
        assert broker is not None
        return MqttTransport(MqttConfig.from_url(broker, client_id=client_id))

    failsafe = policy.defaults.failsafe_w
    agents = []
    start = 0
    for name, count in zip(node_names, counts, strict=True):
        settings = AgentSettings(
            node_id=name,
            backend="mock",
            period_s=tick_s,
            failsafe_w=failsafe,
            broker=broker or "mqtt://127.0.0.1:1883",
        )
        backend = MockBackend(model, clock, start, count)
        agents.append(Agent(settings, backend, transport(f"agent-{name}"), clock))
        start += count

    controller = build_controller(
        policy,
        transport("controller"),
        clock,
        ControllerOptions(controller_id="powerd-demo"),
        store=store,
        writer=writer,
    )
    console = sys.stderr if as_json else out  # lines for people; --json keeps stdout to JSON
    if not as_json:
        print(
            f"powerd demo: {len(per_gpu)} simulated GPUs on {len(node_names)} nodes, "
            f"policy {policy.source}, {'broker ' + broker if broker else 'in-process broker'}, "
            f"{duration_s:g} s"
            + (" (--ui 0: the live page and the API)" if ui_port is None else ""),
            file=out,
            flush=True,
        )
        gpu_nodes = [n for n, c in zip(node_names, counts, strict=True) for _ in range(c)]
        line = baselines_line(model, policy, gpu_nodes, model.t, duration_s)
        if line:
            print(line, file=out, flush=True)
    server = None if ui_port is None else live_page(controller, ui_port, console)
    view = LiveView(model, policy, out, as_json=as_json)
    stats = view.stats
    controller.on_tick.append(view.show)
    solver = await ready_solver(console)
    stop = asyncio.Event()
    try:
        async with asyncio.TaskGroup() as tg:
            for agent in agents:
                tg.create_task(agent.run(stop), name=f"agent-{agent.node_id}")
            tg.create_task(controller.run(stop, learn_s=tick_s), name="controller")
            if server is not None:
                tg.create_task(server.serve(stop), name="api")
            await clock.sleep(duration_s)
            stop.set()
    finally:
        await asyncio.to_thread(writer.stop)
        # A temporary store is gone when the summary is read: no path to point at.
        result = summary(stats, policy, len(per_gpu), db_url if tmp is None else None, solver)
        if as_json:
            print(json.dumps({"summary": result}), file=out, flush=True)
        else:
            print_summary(result, out)
        if tmp is not None:
            with contextlib.suppress(OSError):
                tmp.cleanup()
    return result


async def ready_solver(console: TextIO) -> WarmUp:
    """The allocator's kernels compiled (or loaded from numba's cache) before the first tick,
    so no tick's solve time is the compiler's; says so when numba compiles (seconds)."""
    from powerd.allocator import kernel

    def compiling(cache_dir: str | None) -> None:
        where = f" in {cache_dir}" if cache_dir else ""
        print(
            f"compiling the allocator's kernels (once per install: numba caches them{where}) ...",
            file=console,
            flush=True,
        )

    ready = await asyncio.to_thread(kernel.warm_up, compiling)
    if ready.compiled:
        print(
            f"solver compiled in {ready.seconds:.1f} s"
            + ("" if ready.cached else " (not cached: no writable cache directory)"),
            file=console,
            flush=True,
        )
    return ready


def load_demo_policy(path: str | None) -> Policy:
    return default_policy() if path is None else load_policy(path)
