"""The `powerd` command line. Each subcommand builds its settings and parts, then runs them.

Exit status: 0 success, 1 runtime failure, 2 bad input (policy, snapshot, arguments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from powerd import __version__
from powerd.api.client import add_commands as add_api_commands
from powerd.argtypes import positive_float
from powerd.errors import InputError
from powerd.logs import configure_logging
from powerd.policy import LEVELS, Policy, load_policy, subtree_totals
from powerd.profilefit import add_profile_parser
from powerd.sim.cli import add_sim_parser

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_BAD_INPUT = 2

DEFAULT_DB_URL = "sqlite:///powerd.db"

Handler = Callable[[argparse.Namespace], int]


def _fmt_w(watts: float) -> str:
    return "unlimited" if watts == float("inf") else f"{watts:,.0f} W"


def policy_summary(policy: Policy) -> dict[str, Any]:
    """Levels, sizes, budgets and how the failsafe caps fit each level's tightest group."""
    groups = policy.groups
    per_node_failsafe = [
        g.gpus * g.failsafe_w + g.overhead_w if g.level == 3 else 0.0 for g in groups
    ]
    failsafe = subtree_totals(groups, per_node_failsafe)
    tdp = policy.defaults.gpu.max_cap_w
    per_node_tdp = [g.gpus * tdp + g.overhead_w if g.level == 3 else 0.0 for g in groups]
    installed = subtree_totals(groups, per_node_tdp)
    levels = []
    for level, name in enumerate(LEVELS):
        idx = [i for i, g in enumerate(groups) if g.level == level]
        budgeted = [i for i in idx if groups[i].budget_w != float("inf")]
        entry: dict[str, Any] = {"level": name, "groups": len(idx), "budgeted": len(budgeted)}
        if budgeted:
            tight = min(budgeted, key=lambda i: groups[i].budget_w - failsafe[i])
            entry |= {
                "tightest": groups[tight].name,
                "failsafe_w": failsafe[tight],
                "budget_w": groups[tight].budget_w,
                "margin_w": groups[tight].budget_w - failsafe[tight],
            }
        levels.append(entry)
    root = groups[0]
    return {
        "source": policy.source,
        "facility": root.name,
        "budget_w": root.budget_w if root.budget_w != float("inf") else None,
        "nodes": sum(1 for g in groups if g.level == 3),
        "gpus": sum(g.gpus for g in groups if g.level == 3),
        "installed_tdp_w": installed[0],
        "failsafe_total_w": failsafe[0],
        "classes": {
            name: {
                "weight": c.weight,
                "floor_w": c.floor_w,
                "ceiling_w": c.ceiling_w,
                "profile": c.profile,
            }
            for name, c in policy.classes.items()
        },
        "levels": levels,
    }


def _print_policy_summary(s: dict[str, Any]) -> None:
    budget = s["budget_w"]
    print(f"{s['source']}: OK")
    shown_budget = _fmt_w(budget if budget is not None else float("inf"))
    print(f"  facility {s['facility']}: budget {shown_budget}")
    plural = {"facility": "facilities", "row": "rows", "rack": "racks", "node": "nodes"}
    counts = ", ".join(
        f"{lv['groups']} {lv['level'] if lv['groups'] == 1 else plural[lv['level']]}"
        for lv in s["levels"]
    )
    print(f"  tree: {counts}, {s['gpus']} GPUs expected")
    line = f"  installed at full TDP: {_fmt_w(s['installed_tdp_w'])}"
    if budget:
        line += f" ({s['installed_tdp_w'] / budget:.0%} of the facility budget)"
    print(line)
    classes = []
    for name, c in s["classes"].items():
        extra = "".join(
            [
                f", floor {c['floor_w']:g} W" if c["floor_w"] else "",
                f", ceiling {c['ceiling_w']:g} W" if c["ceiling_w"] else "",
            ]
        )
        classes.append(f"{name} (weight {c['weight']:g}{extra}, profile {c['profile']})")
    print("  classes: " + "; ".join(classes))
    print("  failsafe caps + overhead against budgets (tightest group of each level):")
    print(
        f"    {'level':<9}{'groups':>7}{'budgeted':>9}  {'tightest':<24}{'failsafe':>13}"
        f"{'budget':>13}{'margin':>12}"
    )
    for lv in s["levels"]:
        if "tightest" in lv:
            print(
                f"    {lv['level']:<9}{lv['groups']:>7}{lv['budgeted']:>9}  {lv['tightest']:<24}"
                f"{_fmt_w(lv['failsafe_w']):>13}{_fmt_w(lv['budget_w']):>13}"
                f"{_fmt_w(lv['margin_w']):>12}"
            )
        else:
            head = f"    {lv['level']:<9}{lv['groups']:>7}{lv['budgeted']:>9}"
            print(f"{head}  (no budgets at this level)")


def cmd_policy_check(args: argparse.Namespace) -> int:
    policy = load_policy(args.file)
    summary = policy_summary(policy)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_policy_summary(summary)
    return EXIT_OK


def cmd_solve(args: argparse.Namespace) -> int:
    from powerd.allocator import allocate, kernel
    from powerd.snapshot import load_snapshot

    policy = load_policy(args.policy)
    snapshot = load_snapshot(args.snapshot, policy)
    # The allocator's compiled code loads once per process (numba's cache; every solver
    # repairs and scores caps with it), as the controller loads it before its first tick:
    # load_ms, apart from solve_ms.
    start = time.perf_counter()
    kernel.warm_up()
    load_ms = (time.perf_counter() - start) * 1000.0
    allocation = allocate(snapshot, policy, solver=args.solver)
    out = allocation.to_json()
    out["load_ms"] = load_ms
    print(json.dumps(out, indent=2 if args.pretty else None))
    return EXIT_OK


def cmd_db_id(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from powerd.store import Store

    try:
        store_id = Store(args.db).store_id()
    except SQLAlchemyError as exc:
        print(
            f"powerd db id: {args.db}: {exc.__class__.__name__}: {str(exc).splitlines()[0]}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if store_id is None:
        print(f"powerd db id: {args.db} has no id yet: run `powerd db upgrade`", file=sys.stderr)
        return EXIT_FAILED
    print(store_id)
    return EXIT_OK


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from sqlalchemy.exc import SQLAlchemyError

    from powerd.store import current_revision, head_revision, upgrade

    try:
        before = current_revision(args.db)
        upgrade(args.db)
        after = current_revision(args.db)
    except SQLAlchemyError as exc:
        print(
            f"powerd db upgrade: cannot migrate {args.db}: {exc.__class__.__name__}: "
            f"{str(exc).splitlines()[0]}",
            file=sys.stderr,
        )
        return EXIT_FAILED
    if before == after:
        print(f"{args.db}: already at {after} (head {head_revision()})")
    else:
        print(f"{args.db}: migrated {before or 'empty'} -> {after}")
    return EXIT_OK


def cmd_demo(args: argparse.Namespace) -> int:
    import asyncio

    from powerd.demo import load_demo_policy, run_demo

    policy = load_demo_policy(args.policy)
    if args.nodes is not None and not 1 <= args.nodes <= len(policy.node_names()):
        print(
            f"powerd demo: --nodes must be between 1 and {len(policy.node_names())} for "
            f"{policy.source}",
            file=sys.stderr,
        )
        return EXIT_BAD_INPUT
    result = asyncio.run(
        run_demo(
            policy,
            duration_s=args.duration,
            nodes=args.nodes,
            broker=args.broker,
            db_url=args.db,
            as_json=args.json,
            seed=args.seed,
            ui_port=args.ui,
        )
    )
    return EXIT_OK if result["ticks_committed_over_budget"] == 0 else EXIT_FAILED


def _label_pair(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r}: want KEY=VALUE")
    return key, value


def cmd_agent(args: argparse.Namespace) -> int:
    import asyncio
    from pathlib import Path

    from powerd.agent.main import run_agent_process
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
    )
    try:
        asyncio.run(run_agent_process(settings))
    except BackendError as exc:
        print(f"powerd agent: {exc}", file=sys.stderr)
        return EXIT_FAILED
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
        leader_lease_s=args.leader_lease_s,
        learn_s=args.learn_s,
        api_port=args.api_port,
        api_host=args.api_host,
        tokens_file=args.tokens_file,
        dev=args.dev or None,
    )
    return _run_daemon("controller", run_controller(settings))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="powerd",
        description="Power steering for GPU AI factories: more GPUs under the same feed, "
        "no budget ever exceeded.",
    )
    parser.add_argument("--version", action="version", version=f"powerd {__version__}")
    parser.add_argument(
        "--log-format",
        choices=("auto", "json", "console"),
        default=os.environ.get("POWERD_LOG_FORMAT", "auto"),
        help="log lines on stderr: JSON under systemd or without a terminal (auto), or as chosen",
    )
    parser.add_argument(
        "--log-level",
        default=os.environ.get("POWERD_LOG_LEVEL"),
        choices=("debug", "info", "warning", "error"),
        help="default: info; warning for the demo, whose live view is the output",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    policy = sub.add_parser("policy", help="work with policy files")
    policy_sub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    check = policy_sub.add_parser("check", help="validate a policy file and summarise it")
    check.add_argument("file", help="policy YAML file")
    check.add_argument("--json", action="store_true", help="print the summary as JSON")
    check.set_defaults(handler=cmd_policy_check)

    solve = sub.add_parser(
        "solve", help="compute one allocation for a snapshot of the fleet and print it as JSON"
    )
    solve.add_argument("--policy", required=True, help="policy YAML file")
    solve.add_argument("--snapshot", required=True, help="snapshot JSON file (docs/snapshot.md)")
    solve.add_argument(
        "--solver",
        default="fast",
        choices=("fast", "cvxpy", "uniform", "priority-bands"),
        help="fast: exact tree solver (default); cvxpy: reference formulation; "
        "uniform / priority-bands: baselines",
    )
    solve.add_argument("--pretty", action="store_true", help="indent the JSON")
    solve.set_defaults(handler=cmd_solve)

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
    demo.add_argument("--seed", type=int, default=0, help="seed of the simulated workloads")
    demo.add_argument(
        "--ui",
        type=int,
        metavar="PORT",
        default=None,
        help="also serve the live page on 127.0.0.1:PORT (0: a free port); prints its link",
    )
    demo.set_defaults(handler=cmd_demo)

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
    agent.add_argument("--mock-seed", type=int, help="seed of the mock GPUs")
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
    agent.add_argument(
        "--perf-url",
        help="read workload perf from this Prometheus endpoint, e.g. a serving engine's "
        "http://127.0.0.1:8000/metrics (docs/operations.md, 'Workload perf')",
    )
    agent.add_argument("--perf-metric", help="the counter (or gauge) to read at --perf-url")
    agent.add_argument(
        "--perf-label",
        type=_label_pair,
        action="append",
        metavar="KEY=VALUE",
        help="only series with this label value (repeatable)",
    )
    agent.add_argument(
        "--perf-gpu-label", help="label naming each series' GPU (index or uuid); else shared"
    )
    agent.add_argument("--perf-file", help="read workload perf from a file the job writes")
    agent.add_argument(
        "--perf-kind", choices=("counter", "gauge"), help="counter: rate of its deltas (default)"
    )
    agent.add_argument("--config", help="settings file (.toml or .yaml); flags win over it")
    agent.set_defaults(handler=cmd_agent)

    _add_controller_parser(sub)
    _add_coordinator_parser(sub)

    add_api_commands(sub)
    add_sim_parser(sub)
    add_profile_parser(sub)

    db = sub.add_parser("db", help="database maintenance")
    db_sub = db.add_subparsers(dest="db_command", metavar="ACTION", required=True)
    up = db_sub.add_parser("upgrade", help="run the migrations up to the newest schema")
    up.add_argument(
        "--db",
        default=os.environ.get("POWERD_DB", DEFAULT_DB_URL),
        help="SQLAlchemy URL, e.g. sqlite:///powerd.db or postgresql://user@host/db "
        "(default: $POWERD_DB or %(default)s)",
    )
    up.set_defaults(handler=cmd_db_upgrade)
    ident = db_sub.add_parser(
        "id", help="print the store's id (an authority's `store`, for `powerd handover`)"
    )
    ident.add_argument("--db", default=os.environ.get("POWERD_DB", DEFAULT_DB_URL))
    ident.set_defaults(handler=cmd_db_id)
    return parser


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
    co.set_defaults(handler=cmd_coordinator)


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
    ctl.set_defaults(handler=cmd_controller)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet = args.command in ("demo", "sim")  # their own output is the point
    configure_logging(args.log_format, args.log_level or ("warning" if quiet else "info"))
    handler: Handler = args.handler
    try:
        return handler(args)
    except InputError as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:  # e.g. a malformed broker URL, caught before anything started
        print(f"powerd {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `powerd ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK

