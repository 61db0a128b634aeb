"""`powerd policy check`, `powerd solve` and `powerd warm`: check a policy file, solve one
snapshot offline, compile the solver ahead of its first use."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import TYPE_CHECKING, Any, TextIO

from powerd.cli.admin import table
from powerd.cli.exits import EXIT_FAILED, EXIT_OK
from powerd.numeric import kw_text

if TYPE_CHECKING:
    from powerd.allocator import Allocation
    from powerd.allocator.kernel import WarmUp
    from powerd.policy import Policy
    from powerd.snapshot import Snapshot


def _fmt_w(watts: float) -> str:
    return "unlimited" if watts == float("inf") else f"{watts:,.0f} W"


def policy_summary(policy: Policy) -> dict[str, Any]:
    """Levels, sizes, budgets and how the failsafe caps fit each level's tightest group."""
    from powerd.policy import LEVELS, subtree_totals

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
    from powerd.policy import load_policy

    policy = load_policy(args.file)
    summary = policy_summary(policy)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_policy_summary(summary)
    return EXIT_OK


def cmd_solve(args: argparse.Namespace) -> int:
    from powerd.allocator import allocate, kernel
    from powerd.policy import load_policy
    from powerd.snapshot import load_snapshot

    policy = load_policy(args.policy)
    snapshot = load_snapshot(args.snapshot, policy)
    # The allocator's compiled code loads once per process (numba's cache; every solver
    # repairs and scores caps with it), as the controller loads it before its first tick:
    # load_ms, apart from solve_ms.
    start = time.perf_counter()
    kernel.warm_up(lambda _: print(COMPILING, file=sys.stderr, flush=True))
    load_ms = (time.perf_counter() - start) * 1000.0
    allocation = allocate(snapshot, policy, solver=args.solver)
    if args.json or args.pretty:
        out = allocation.to_json()  # full precision: a program reads it
        out["load_ms"] = load_ms
        print(json.dumps(out, indent=2 if args.pretty else None))
    else:
        print_allocation(allocation, snapshot, policy, load_ms, sys.stdout)
    return EXIT_OK


COMPILING = "compiling the allocator's kernels (once per install: numba caches them) ..."


def print_allocation(
    a: Allocation, snapshot: Snapshot, policy: Policy, load_ms: float, out: TextIO
) -> None:
    """The allocation for people: the outcome, then every GPU's cap in whole watts (the
    solver's caps carry rounding such as 499.9999999998924 W; `--json` keeps them)."""
    caps = a.caps()
    print(
        f"{a.status} ({a.solver}): {len(caps)} GPUs, caps {kw_text(sum(caps.values()))}, "
        f"unused {a.unused_w:.0f} W; objective {a.objective:.4f}",
        file=out,
    )
    print(
        f"solve {a.solve_ms:.1f} ms (the compiled code loaded first in {load_ms:.0f} ms, "
        "not counted)",
        file=out,
    )
    for label, items in (
        ("floors dropped", a.dropped_floors),
        ("budgets below device minimums", a.infeasible_groups),
        ("jobs split", a.split_jobs),
    ):
        if items:
            print(f"{label}: {', '.join(items)}", file=out)
    default = policy.defaults.class_
    rows = [
        [
            g.uuid,
            g.node,
            g.workload or default,
            g.job or "-",
            f"{g.power_w:.0f} W",
            f"{g.cap_w:.0f} W",
            f"{caps[g.uuid]:.0f} W",
        ]
        for g in snapshot.gpus
    ]
    print(file=out)
    table(["gpu", "node", "class", "job", "draw", "cap now", "cap"], rows, out)


def cmd_warm(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Compile the allocator's kernels into numba's cache (or load them from it) and say
    what it took; exit 1 where nothing could be cached (every start would compile)."""
    out = sys.stdout if out is None else out
    from powerd.allocator import kernel

    def compiling(cache_dir: str | None) -> None:
        if not args.json:
            where = f" in {cache_dir}" if cache_dir else ""
            print(
                f"compiling the allocator's kernels (once per install; numba caches them{where})"
                " ...",
                file=out,
                flush=True,
            )

    done = kernel.warm_up(compiling)
    if args.json:
        print(json.dumps(warm_json(done)), file=out)
    else:
        print(warm_text(done), file=out)
    return EXIT_OK if done.cached else EXIT_FAILED


def warm_json(w: WarmUp) -> dict[str, Any]:
    return {
        "seconds": w.seconds,
        "compiled": w.compiled,
        "loaded": w.loaded,
        "cache_dir": w.cache_dir,
        "cached": w.cached,
        "jit": w.jit,
    }


def warm_text(w: WarmUp) -> str:
    """`solver ready in 10.6 s: 17 kernels compiled, cached in DIR` (and the other cases)."""
    head = f"solver ready in {w.seconds:.1f} s: "
    if not w.jit:
        return head + "the compiler is off (NUMBA_DISABLE_JIT): plain Python, nothing to cache"
    if not w.cached:
        return head + (
            f"{w.compiled} kernels compiled, NOT cached: numba found no writable cache "
            "directory, so every start compiles again; set NUMBA_CACHE_DIR"
        )
    if w.compiled:
        return head + f"{w.compiled} kernels compiled, cached in {w.cache_dir}"
    if w.loaded:
        return head + f"{w.loaded} kernels loaded from numba's cache in {w.cache_dir}"
    return head + "already loaded in this process"


def add_parser(sub: Any) -> None:
    """Register `powerd policy` and `powerd solve` on the top-level subparsers."""
    policy = sub.add_parser("policy", help="work with policy files")
    policy_sub = policy.add_subparsers(dest="policy_command", metavar="ACTION", required=True)
    check = policy_sub.add_parser("check", help="validate a policy file and summarise it")
    check.add_argument("file", help="policy YAML file")
    check.add_argument("--json", action="store_true", help="print the summary as JSON")
    check.set_defaults(handler=cmd_policy_check, needs="controller")

    solve = sub.add_parser(
        "solve", help="compute one allocation for a snapshot of the fleet and print its caps"
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
    solve.add_argument(
        "--json", action="store_true", help="print the allocation as JSON (full precision)"
    )
    solve.add_argument("--pretty", action="store_true", help="the JSON, indented")
    solve.set_defaults(handler=cmd_solve, needs="controller")

    warm = sub.add_parser(
        "warm",
        help="compile the allocator's kernels into numba's cache before a controller needs "
        "them (systemd's ExecStartPre, an image's build)",
        description="Compile (or load) every kernel of the allocator on a tiny problem and "
        "report the time. numba keeps the machine code in $NUMBA_CACHE_DIR (else next to "
        "the package, else the user's cache directory); a controller started later loads it "
        "in ~0.3 s instead of compiling it (~20 s on two cores). Exit 1 if no cache "
        "directory was writable.",
    )
    warm.add_argument("--json", action="store_true", help="print the result as JSON")
    warm.set_defaults(handler=cmd_warm, needs="controller")
