"""The daemons and the demo: `powerd controller`, `agent`, `bmc-agent`, `coordinator` and
`demo`.

Each handler builds the process settings from its flags (a settings file and the environment
below them), then runs the daemon until it stops.
"""

from __future__ import annotations

import argparse
import signal
import sys
from collections.abc import Awaitable, Coroutine
from typing import Any, TypeVar

from powerd.argtypes import PORT, SEED, positive_float
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from powerd.cli.extras import require

# powerd.agent.kubelet.DEFAULT_SOCKET, not imported for a parser every command builds.
T = TypeVar("T")

KUBELET_SOCKET = "/var/lib/kubelet/pod-resources/kubelet.sock"


def cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from powerd.demo import load_demo_policy, run_demo

    policy = load_demo_policy(args.policy)
    if args.ui:
        try:
            _bind_once("127.0.0.1", args.ui)
        except OSError as exc:
            print(
                f"powerd demo: --ui {args.ui}: cannot serve on 127.0.0.1:{args.ui}: "
                f"{exc.strerror or exc} (give another port, or 0 for a free one)",
                file=sys.stderr,
            )
            return EXIT_BAD_INPUT
    if args.nodes is not None and not 1 <= args.nodes <= len(policy.node_names()):
        print(
            f"powerd demo: --nodes must be between 1 and {len(policy.node_names())} for "
            f"{policy.source}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    demo = run_demo(
        policy,
        duration_s=args.duration,
        nodes=args.nodes,
        broker=args.broker,
        db_url=args.db,
        as_json=args.json,
        seed=args.seed,
        ui_port=args.ui,
    )
    terminated: list[int] = []
    try:
        result = asyncio.run(_cancelled_by_sigterm(demo, terminated))
    except asyncio.CancelledError:
        if terminated:
            return 128 + signal.SIGTERM
        raise
    return EXIT_OK if result["ticks_committed_over_budget"] == 0 else EXIT_FAILED


async def _cancelled_by_sigterm(main: Awaitable[T], came: list[int]) -> T:
    """`main`, cancelled by SIGTERM as asyncio.run cancels it on Ctrl-C: through its cleanup
    (the demo's temporary store, the writer's last flush, the summary), instead of the
    process ending where it stands. `came` says whether it did."""
    import asyncio

    loop = asyncio.get_running_loop()
    task = asyncio.current_task()
    assert task is not None

    def on_term() -> None:
        came.append(signal.SIGTERM)
        task.cancel()

    loop.add_signal_handler(signal.SIGTERM, on_term)
    try:
        return await main
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def _bind_once(host: str, port: int) -> None:
    """OSError if `port` cannot be served on `host` now (in use, not allowed): said in one
    line before the demo starts its threads, rather than as a traceback after."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ApiServer binds
        sock.bind((host, port))


def cmd_agent(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from powerd.agent.main import run_agent_process
    from powerd.agent.restore import AgentRunning
    from powerd.agent.settings import AgentSettings
    from powerd.backends import BackendError

    settings = AgentSettings.load(
        Path(args.config) if args.config else None,
        node_id=args.node_id,
        broker=args.broker,
        backend=args.backend,
        mock_gpus=args.mock_gpus,
        mock_workload=args.mock_workload,
        mock_seed=args.mock_seed,
        mock_journal=args.mock_journal,
        record=args.record,
        period_s=args.period,
        failsafe_w=args.failsafe_w,
        metrics_port=args.metrics_port,
        perf_url=args.perf_url,
        perf_metric=args.perf_metric,
        perf_labels=dict(args.perf_label) if args.perf_label else None,
        perf_gpu_label=args.perf_gpu_label,
        perf_file=args.perf_file,
        perf_kind=args.perf_kind,
        kube_socket=args.kube_socket,
        kube_job_label=args.kube_job_label,
        kube_class_label=args.kube_class_label,
        kube_api_url=args.kube_api_url,
    )
    if settings.backend == "mock":  # simulated GPUs: a physical model in numpy
        require("powerd agent --backend mock", "sim", ["numpy"])
    try:
        if args.restore_defaults:
            from powerd.agent.restore import restore_node

            return restore_node(
                settings, force=args.force, out=sys.stdout, err=sys.stderr, settle_s=args.settle_s
            )
        asyncio.run(run_agent_process(settings))
    except (BackendError, AgentRunning) as exc:
        print(f"powerd agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_bmc_agent(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from powerd.bmc.agent import run_bmc_agent_process
    from powerd.bmc.settings import BmcAgentSettings

    settings = BmcAgentSettings.load(Path(args.config), broker=args.broker)
    asyncio.run(run_bmc_agent_process(settings))
    return EXIT_OK


def _run_daemon(name: str, main: Coroutine[Any, Any, None]) -> int:
    """Run a daemon until it stops; what keeps it from starting is printed, exit 1."""
    import asyncio

    from powerd.controller.leadership import StartRefused

    try:
        asyncio.run(main)
    except (OSError, StartRefused) as exc:  # the API port is taken, the store is held, ...
        print(f"powerd {name}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def cmd_controller(args: argparse.Namespace) -> int:
    from pathlib import Path

    from powerd.controller.main import run_controller
    from powerd.controller.settings import ControllerSettings

    settings = ControllerSettings.load(
        Path(args.config) if args.config else None,
        policy=args.policy,
        broker=args.broker,
        db=args.db,
        state_file=args.state_file,
        solver=args.solver,
        controller_id=args.controller_id,
        leadership=args.leadership,
        scope=args.scope,
        shadow=args.shadow or None,
        record_db=args.record_db,
        leader_lease_s=args.leader_lease_s,
        learn_s=args.learn_s,
        api_port=args.api_port,
        api_host=args.api_host,
        tokens_file=args.tokens_file,
        dev=args.dev or None,
    )
    return _run_daemon("controller", run_controller(settings))


def cmd_coordinator(args: argparse.Namespace) -> int:
    from pathlib import Path

    from powerd.coordinator.main import CoordinatorSettings, run_coordinator

    settings = CoordinatorSettings.load(
        Path(args.config) if args.config else None,
        policy=args.policy,
        broker=args.broker,
        db=args.db,
        coordinator_id=args.coordinator_id,
        scope_level=args.scope_level,
        leadership=args.leadership,
        state_file=args.state_file,
        api_port=args.api_port,
        api_host=args.api_host,
        tokens_file=args.tokens_file,
        dev=args.dev or None,
    )
    return _run_daemon("coordinator", run_coordinator(settings))


def add_parser(sub: Any) -> None:
    """Register `powerd demo`, `agent`, `bmc-agent`, `controller` and `coordinator`, in
    that order."""
    _add_demo_parser(sub)
    _add_agent_parser(sub)
    _add_bmc_agent_parser(sub)
    _add_controller_parser(sub)
    _add_coordinator_parser(sub)


def _add_demo_parser(sub: Any) -> None:
    demo = sub.add_parser(
        "demo", help="run a controller and simulated GPU nodes in one process (no services needed)"
    )
    demo.add_argument(
        "--duration", type=positive_float, default=30.0, help="seconds to run (default %(default)s)"
    )
    demo.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="simulate only the first N nodes of the policy (default: all)",
    )
    demo.add_argument(
        "--policy",
        default=None,
        help="policy file (default: the embedded example, policies/example.yaml)",
    )
    demo.add_argument(
        "--broker",
        default=None,
        help="run through a real MQTT broker, e.g. mqtt://127.0.0.1:1883 (default: in-process)",
    )
    demo.add_argument(
        "--db",
        default=None,
        help="SQLAlchemy URL to keep the history in (default: a temporary SQLite file)",
    )
    demo.add_argument(
        "--json", action="store_true", help="one JSON object per tick, then a summary"
    )
    demo.add_argument(
        "--seed", type=SEED, default=0, help="seed of the simulated workloads (0 to 2^63-1)"
    )
    demo.add_argument(
        "--ui",
        type=PORT,
        metavar="PORT",
        default=None,
        help="also serve the live page on 127.0.0.1:PORT (0: a free port); prints its link",
    )
    demo.set_defaults(handler=cmd_demo, needs="sim")


def _add_bmc_agent_parser(sub: Any) -> None:
    bmc = sub.add_parser(
        "bmc-agent",
        help="run the node agent of BMC-managed nodes: their GPUs steered through Redfish",
    )
    bmc.add_argument(
        "--config",
        required=True,
        help="settings file (.toml or .yaml) listing the nodes and their BMCs "
        '(docs/operations.md, "BMC-managed nodes"); passwords are read from files it names',
    )
    bmc.add_argument("--broker", help="mqtt://HOST:PORT or mqtts://... ($POWERD_BROKER)")
    bmc.set_defaults(handler=cmd_bmc_agent)


def _add_agent_parser(sub: Any) -> None:
    agent = sub.add_parser("agent", help="run the node agent (telemetry, caps, failsafe)")
    agent.add_argument("--node-id", help="this node's name in the policy ($POWERD_NODE_ID)")
    agent.add_argument("--broker", help="mqtt://HOST:PORT or mqtts://... ($POWERD_BROKER)")
    agent.add_argument("--backend", choices=("nvml", "mock"), help="GPU backend (default nvml)")
    agent.add_argument("--mock-gpus", type=int, help="GPUs of the mock backend (default 8)")
    agent.add_argument(
        "--mock-workload",
        choices=("steady", "training", "inference", "idle"),
        help="demand pattern of the mock GPUs",
    )
    agent.add_argument("--mock-seed", type=SEED, help="seed of the mock GPUs")
    agent.add_argument(
        "--record",
        help="append every telemetry sample to this file as nvidia-smi CSV (a trace for "
        "powerd sim: docs/simulator.md)",
    )
    agent.add_argument(
        "--mock-journal",
        help="append every change of a mock GPU's cap to this file ($POWERD_MOCK_JOURNAL)",
    )
    agent.add_argument("--period", type=positive_float, help="telemetry period, s (default 1)")
    agent.add_argument(
        "--failsafe-w",
        type=positive_float,
        help="failsafe cap per GPU before the first command (default: device min)",
    )
    agent.add_argument(
        "--metrics-port",
        type=int,
        help="serve this node's Prometheus metrics on 127.0.0.1:PORT (default off)",
    )
    _add_perf_arguments(agent)
    _add_kube_arguments(agent)
    agent.add_argument("--config", help="settings file (.toml or .yaml); flags win over it")
    agent.add_argument(
        "--restore-defaults",
        action="store_true",
        help="do not run: set every GPU back to its default power limit, read it back, "
        "report, exit 0 (all at their defaults) or 1 (refused while an agent of this node "
        "runs); docs/operations.md, 'Rolling back'",
    )
    agent.add_argument(
        "--force",
        action="store_true",
        help="--restore-defaults even if an agent seems to run, or the broker cannot be told",
    )
    agent.add_argument(
        "--settle-s",
        type=float,
        default=10.0,
        metavar="S",
        help="--restore-defaults: seconds between announcing the node offline (a controller "
        "then counts its GPUs at their maximum) and raising its limits (default 10)",
    )
    agent.set_defaults(handler=cmd_agent)


def _add_perf_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's flags for where it reads workload perf (docs/operations.md)."""
    parser.add_argument(
        "--perf-url",
        help="read workload perf from this Prometheus endpoint, e.g. a serving engine's "
        "http://127.0.0.1:8000/metrics (docs/operations.md, 'Workload perf')",
    )
    parser.add_argument("--perf-metric", help="the counter (or gauge) to read at --perf-url")
    parser.add_argument(
        "--perf-label",
        type=_label_pair,
        action="append",
        metavar="KEY=VALUE",
        help="only series with this label value (repeatable)",
    )
    parser.add_argument(
        "--perf-gpu-label", help="label naming each series' GPU (index or uuid); else shared"
    )
    parser.add_argument("--perf-file", help="read workload perf from a file the job writes")
    parser.add_argument(
        "--perf-kind", choices=("counter", "gauge"), help="counter: rate of its deltas (default)"
    )


def _add_kube_arguments(parser: argparse.ArgumentParser) -> None:
    """The agent's flags for jobs from Kubernetes (docs/operations.md)."""
    parser.add_argument(
        "--kube-socket",
        nargs="?",
        const=KUBELET_SOCKET,
        metavar="PATH",
        help="report each GPU's job from the kubelet's PodResources socket (alone: "
        f"{KUBELET_SOCKET}; needs the kubernetes extra; docs/operations.md, "
        "'Jobs from Kubernetes')",
    )
    parser.add_argument(
        "--kube-job-label",
        metavar="LABEL",
        help="the pod label naming the job, e.g. batch.kubernetes.io/job-name (default: "
        "the pod is the job)",
    )
    parser.add_argument(
        "--kube-class-label", metavar="LABEL", help="the pod label naming the class to steer as"
    )
    parser.add_argument(
        "--kube-api-url",
        metavar="URL",
        help="where pod labels are read (default in a pod: the cluster's API server)",
    )


def _label_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=VALUE")
    return key, value


def _add_controller_parser(sub: Any) -> None:
    ctl = sub.add_parser("controller", help="run the central controller (the steering loop)")
    ctl.add_argument("--policy", help="policy YAML file ($POWERD_POLICY)")
    ctl.add_argument("--broker", help="mqtt://HOST:PORT or mqtts://... ($POWERD_BROKER)")
    ctl.add_argument("--db", help="SQLAlchemy URL ($POWERD_DB, default sqlite:///powerd.db)")
    ctl.add_argument(
        "--state-file",
        help="operators' changes in force ($POWERD_STATE_FILE; default powerd-state.json "
        "next to a SQLite database, else in the working directory)",
    )
    ctl.add_argument("--solver", choices=("fast", "cvxpy", "uniform", "priority-bands"))
    ctl.add_argument(
        "--controller-id",
        help="name in the controller status, commands and lease: distinct for each "
        "controller of a standby pair, stable across restarts",
    )
    ctl.add_argument(
        "--shadow",
        action="store_true",
        help="decide every tick as if steering, store what would be commanded, send nothing "
        "(use its own --db)",
    )
    ctl.add_argument(
        "--record-db",
        metavar="URL",
        help="with --shadow: record what the fleet does (draw, perf, caps in force, each "
        "budget's draw) into this database of its own, a pilot's baseline "
        "(`powerd pilot report`)",
    )
    ctl.add_argument(
        "--scope",
        help="steer only the subtree under this row or rack of the policy, under the "
        "budget a `powerd coordinator` gives it",
    )
    ctl.add_argument(
        "--leadership",
        choices=("auto", "lease", "alone"),
        help="lease: command only under the database's lease (standbys take over); alone: "
        "the only controller, steering through database outages; auto (default): alone "
        "on SQLite, lease otherwise",
    )
    ctl.add_argument(
        "--leader-lease-s",
        type=positive_float,
        help="the leader's lease in seconds (default 0.4 x the policy's lease_s)",
    )
    ctl.add_argument(
        "--learn-s",
        type=float,
        help="seconds to listen before the first tick (default: stale_after_s)",
    )
    ctl.add_argument("--api-host", help="admin API address (default 127.0.0.1)")
    ctl.add_argument("--api-port", type=int, help="admin API port (default: no API)")
    ctl.add_argument("--tokens-file", help="admin API tokens (hashed), see docs/api.md")
    ctl.add_argument("--dev", action="store_true", help="development mode: allow weak tokens")
    ctl.add_argument("--config", help="settings file (.toml or .yaml); flags win over it")
    ctl.set_defaults(handler=cmd_controller, needs="controller")


def _add_coordinator_parser(sub: Any) -> None:
    co = sub.add_parser(
        "coordinator",
        help="split the site's budget between scope controllers (controller --scope)",
    )
    co.add_argument("--policy", help="policy YAML file ($POWERD_POLICY)")
    co.add_argument("--broker", help="mqtt://HOST:PORT or mqtts://... ($POWERD_BROKER)")
    co.add_argument("--db", help="SQLAlchemy URL for its lease and temporary budgets ($POWERD_DB)")
    co.add_argument("--coordinator-id", help="distinct for each coordinator of a pair")
    co.add_argument("--scope-level", choices=("row", "rack"), help="the scopes' level (row)")
    co.add_argument(
        "--leadership",
        choices=("auto", "lease", "alone"),
        help="as the controller's: auto (default) is alone on SQLite, a lease otherwise",
    )
    co.add_argument("--state-file", help="temporary budgets set through its API")
    co.add_argument("--api-host", help="admin API address (default 127.0.0.1)")
    co.add_argument("--api-port", type=int, help="admin API port (default: no API)")
    co.add_argument("--tokens-file", help="admin API tokens (hashed), see docs/api.md")
    co.add_argument("--dev", action="store_true", help="development mode: allow weak tokens")
    co.add_argument("--config", help="settings file (.toml or .yaml); flags win over it")
    co.set_defaults(handler=cmd_coordinator, needs="controller")
