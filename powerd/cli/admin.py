"""`powerd status`, `powerd gpus`, `powerd why ...`, `powerd budget ...`, `powerd pin ...`,
`powerd job ...`: the admin API's commands, over `powerd.api.client.Client`.

`add_parser(subparsers)` registers the subcommands on the `powerd` parser; each handler
returns the CLI's exit status (0 done, 1 failed or refused access, 2 rejected input).
`--url`/`--token` default to $POWERD_URL and $POWERD_TOKEN; `--ca` (an https:// API's
CA), `--cert`/`--key` (mutual TLS) to $POWERD_CA, $POWERD_CERT and $POWERD_KEY.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, TextIO

import httpx

from powerd.api.client import DEFAULT_URL, ApiError, Client
from powerd.auth import Role, new_token_entry
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK
from powerd.numeric import kw_text


def table(headers: Sequence[str], rows: Sequence[Sequence[str]], out: TextIO) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True))
    print(line.rstrip(), file=out)
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip(), file=out)


LEVELS = ("facility", "row", "rack", "node")


def _use(g: dict[str, Any]) -> list[str]:
    budget = g["budget_w"]
    share = f"{g['committed_w'] / budget:.0%}" if budget else "-"
    # A budget with a shadow price binds: it is what holds the GPUs under it back (`why`).
    flag = "OVER" if g["over"] else "binding" if (g.get("price_per_kw") or 0) > 0 else ""
    indent = "  " * LEVELS.index(g["level"]) if g.get("level") in LEVELS else ""
    return [
        indent + g["name"],
        kw_text(budget),
        kw_text(g["committed_w"]),
        share,
        kw_text(g["draw_w"]),
        flag,
    ]


def print_status(
    fleet: dict[str, Any],
    overrides: dict[str, Any],
    alarms: list[dict[str, Any]],
    out: TextIO,
    groups: list[dict[str, Any]] | None = None,
) -> None:
    """The fleet, then its groups (`groups`, in the tree's order, indented by level; None:
    the facility and its rows from the fleet summary), operator changes and alarms."""
    lead = fleet.get("leadership")
    if lead:
        print_leadership(lead, out)
    if fleet["tick"] is None:
        print(f"policy {fleet['policy_source']}: no tick yet", file=out)
        return
    when = datetime.fromtimestamp(fleet["ts"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    version = fleet["policy_version"]
    print(
        f"tick {fleet['tick']} at {when}: {fleet['status']} ({fleet['solver']}, solve "
        f"{fleet['solve_ms']:.1f} ms); policy {fleet['policy_source']}"
        + (f" v{version}" if version else ""),
        file=out,
    )
    states = ", ".join(f"{n} {s}" for s, n in sorted(fleet["nodes_by_state"].items()))
    print(
        f"nodes {fleet['nodes']} ({states}); GPUs {fleet['gpus']} ({fleet['gpus_stale']} stale)",
        file=out,
    )
    by_class = ", ".join(f"{c} {v:.1f}" for c, v in sorted(fleet["throughput_by_class"].items()))
    print(f"throughput {fleet['throughput'] or 0:.1f} ({by_class})\n", file=out)
    if groups is None:
        groups = ([fleet["facility"]] if fleet["facility"] else []) + fleet["rows"]
    table(["group", "budget", "committed", "use", "draw", ""], [_use(g) for g in groups], out)
    if overrides["budgets"]:
        print("\ntemporary budgets", file=out)
        table(
            ["group", "budget", "policy", "until", "by", "reason"],
            [
                [
                    b["group"],
                    kw_text(b["budget_w"]),
                    kw_text(b["policy_budget_w"]),
                    "cleared"
                    if b["expires_at"] is None
                    else datetime.fromtimestamp(b["expires_at"], tz=UTC).strftime("%H:%M:%S UTC"),
                    b["actor"],
                    b["reason"],
                ]
                for b in overrides["budgets"]
            ],
            out,
        )
    if overrides.get("schedules"):
        print("\nscheduled budgets", file=out)
        table(
            ["id", "group", "budget", "start", "end", "state"],
            [
                [
                    s["id"],
                    s["group"],
                    kw_text(s["budget_w"]),
                    _utc(s["start"]),
                    _utc(s["end"]) if s["end"] is not None else "cancelled",
                    s["state"],
                ]
                for s in overrides["schedules"]
            ],
            out,
        )
    if overrides["pins_w"] or overrides["drained"]:
        pins = ", ".join(f"{u} {w:g} W" for u, w in sorted(overrides["pins_w"].items()))
        print(
            f"\npinned: {pins or '-'}; drained: {', '.join(overrides['drained']) or '-'}", file=out
        )
    print("\nalarms: " + ("none" if not alarms else ""), file=out)
    for a in alarms:
        print(f"  {a['kind']}: {a['message']}", file=out)


def print_leadership(lead: dict[str, Any], out: TextIO) -> None:
    """`scope hall-1: leader ctl-a (epoch 7); standbys ctl-b; ...` (and who answered)."""
    standbys = ", ".join(lead["standbys"]) or "none"
    leader = lead["leader"] or "none (the lease lapsed)"
    line = (
        f"scope {lead['scope']}: leader {leader} (epoch {lead['epoch']}); standbys {standbys}; "
        f"takeovers {lead['takeovers']}, fenced commands {lead['fenced']}"
    )
    if lead["role"] != "leader":
        line += f" [answered by standby {lead['controller']}]"
    if lead["last_error"]:
        line += f"; lease store failing ({lead['db_failures']}x): {lead['last_error']}"
    if lead.get("outage_s") is not None:
        line += f"; steering through a database outage for {lead['outage_s']:.0f} s"
    print(line, file=out)
    authority = lead.get("authority")
    if authority:
        print(
            f"  authority: site {authority['site']}, store {authority['store']}, "
            f"domain {authority['domain']}; policy version {lead.get('policy_version') or '-'}",
            file=out,
        )
    if lead.get("policy_differs"):
        print(f"  policy differs: {lead['policy_differs']}", file=out)


def _w(x: float | None) -> str:
    return "-" if x is None else f"{x:.0f} W"


def print_why(doc: dict[str, Any], out: TextIO) -> None:
    """`powerd why UUID`: the caps, what decided them, and the numbers behind each reason."""
    when = datetime.fromtimestamp(doc["ts"], tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    source = "last tick" if doc["source"] == "live" else "stored cap change"
    print(f"{doc['uuid']} on {doc['node']}, tick {doc['tick']} at {when} ({source})", file=out)
    print(f"  {doc['summary']}", file=out)
    print(f"  decided by: {', '.join(doc['decided_by'])}", file=out)
    b = doc["budget"]
    price = "-" if b["price_per_kw"] is None else f"{b['price_per_kw']:.4g}/kW"
    print(
        f"  tightest budget: {b['level']} {b['group']}: budget {kw_text(b['budget_w'])}, "
        f"committed {kw_text(b['committed_w'])}, shadow price {price}",
        file=out,
    )
    d = doc["demand"]
    age = "-" if d["sample_age_s"] is None else f"{d['sample_age_s']:.1f} s"
    print(
        f"  demand: {_w(d['demand_w'])}{' (cap-limited)' if d['cap_limited'] else ''}, "
        f"profile peak {_w(d['peak_w'])}; sample: draw {_w(d['power_w'])}, cap "
        f"{_w(d['reported_cap_w'])}, age {age}, seq {d['sample_seq']}"
        + (" (stale)" if d["stale"] else ""),
        file=out,
    )
    c = doc["class"]
    print(
        f"  class {c['name']} (weight {c['weight']:g}): floor {_w(c['floor_w'])}"
        + (" (dropped)" if c["floor_dropped"] else "")
        + f", ceiling {_w(c['ceiling_w'])}; job {doc['job'] or '-'}",
        file=out,
    )
    bounds = doc["bounds"]
    print(
        f"  bounds {_w(bounds['lo_w'])} .. {_w(bounds['hi_w'])} (device "
        f"{_w(bounds['min_cap_w'])} .. {_w(bounds['max_cap_w'])}); pin {_w(doc['pin_w'])}; "
        f"drained {'yes' if doc['drained'] else 'no'}",
        file=out,
    )
    if doc["slew"]:
        s = doc["slew"]
        print(
            f"  slew {_w(s['slew_w'])} from {_w(s['from_w'])}"
            + (f": limited {s['limited']}" if s["limited"] else ""),
            file=out,
        )
    p = doc["planner"]
    if p:
        line = f"  planner: {p['reason']}"
        if p["held_back_w"] is not None:
            line += f", {_w(p['held_back_w'])} of the raise held back"
        if p["group"]:
            line += f" in {p['group']}"
        print(line, file=out)
        for a in p["awaiting"]:
            print(
                f"    awaiting ack from {a['node']}: {a['uuid']} cut to {_w(a['sent_w'])} "
                f"(committed {_w(a['committed_w'])}) since tick {a['since_tick']}",
                file=out,
            )
        if p["awaiting_more"]:
            print(f"    and {p['awaiting_more']} more", file=out)


# ---- command handlers ----


def parse_duration(text: str) -> float:
    """`90`, `90s`, `15m`, `2h`, `1d` → seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhd]?)\s*", text)
    if not m:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (e.g. 900, 15m, 2h)")
    return float(m.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}[m.group(2)]


def parse_time(text: str) -> float:
    """Epoch seconds or an ISO 8601 time with a zone (`2026-07-01T18:00:00+02:00`)."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a time: {text!r}") from None
    if t.tzinfo is None:
        raise argparse.ArgumentTypeError(f"{text!r} needs a time zone, e.g. +00:00")
    return t.timestamp()


def _run(args: argparse.Namespace, action: Callable[[Client], Any], out: TextIO) -> int:
    client = Client(args.url, args.token, ca_file=args.ca, cert_file=args.cert, key_file=args.key)
    try:
        result = action(client)
    except httpx.HTTPError as exc:
        print(f"powerd: cannot reach the API at {args.url}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except ApiError as exc:
        print(f"powerd: {exc.body.get('detail', exc)} (HTTP {exc.status})", file=sys.stderr)
        for p in exc.body.get("problems") or []:
            print(f"  at {p['path'] or '<top>'}: {p['message']}", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.status in (400, 404, 413, 422) else EXIT_FAILED
    finally:
        client.close()
    if isinstance(result, dict) and "action" in result:
        tick = result.get("after_tick")
        print(
            f"{result['action']} {result['target']}: done, in force from tick "
            f"{tick + 1 if tick else 'the first'}",
            file=out,
        )
        if result.get("detail"):  # not durable, or its audit row queued: say so
            print(f"  note: {result['detail']}", file=out)
    return EXIT_OK


def cmd_status(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out

    def show(c: Client) -> None:
        fleet, overrides, alarms = c.fleet(), c.overrides(), c.alarms()
        deepest = LEVELS.index(args.level)
        groups = [g for g in c.groups() if LEVELS.index(g["level"]) <= deepest]
        if args.json:
            doc = {"fleet": fleet, "groups": groups, "overrides": overrides, "alarms": alarms}
            print(json.dumps(doc), file=out)
        else:
            print_status(fleet, overrides, alarms, out, groups)

    return _run(args, show, out)


def _gpu_state(g: dict[str, Any]) -> str:
    flags = [g["state"]]
    if g["pinned_w"] is not None:
        flags.append(f"pinned {g['pinned_w']:.0f} W")
    if g["drained"]:
        flags.append("drained")
    return ", ".join(flags)


def print_gpus(gpus: list[dict[str, Any]], out: TextIO) -> None:
    """One line a GPU: where it is, what it runs, its cap (read back from the GPU) and draw,
    in whole watts."""
    table(
        ["gpu", "node", "idx", "class", "job", "cap", "draw", "state"],
        [
            [
                g["uuid"],
                g["node"],
                str(g["index"]),
                g["class"] or "-",
                g["job"] or "-",
                _w(g["cap_w"]),
                _w(g["power_w"]),
                _gpu_state(g),
            ]
            for g in gpus
        ],
        out,
    )


def cmd_gpus(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out

    def show(c: Client) -> None:
        gpus = c.gpus(
            node=args.node,
            rack=args.rack,
            row=args.row,
            class_=args.cls,
            job=args.job,
            state=args.state,
        )
        if args.json:
            print(json.dumps(gpus), file=out)
        elif not gpus:
            print("no GPU heard matches" if _filtered(args) else "no GPU heard yet", file=out)
        else:
            print_gpus(gpus, out)

    return _run(args, show, out)


def _filtered(args: argparse.Namespace) -> bool:
    return any(v is not None for v in (args.node, args.rack, args.row, args.cls, args.job))


def cmd_why(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out

    def show(c: Client) -> None:
        doc = c.why(args.uuid, args.at)
        if args.json:
            print(json.dumps(doc), file=out)
        else:
            print_why(doc, out)

    return _run(args, show, out)


def cmd_budget_set(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    until = args.until if args.until is not None else args.end
    if args.start is not None:
        # A window: ramped in by its start and out from its end (a schedule).
        end = until if args.ttl is None else args.start + args.ttl
        return _run(
            args,
            lambda c: c.schedule_budget(
                args.group, args.watts, args.reason, start=args.start, end=end
            ),
            out,
        )
    return _run(
        args,
        lambda c: c.set_budget(
            args.group, args.watts, args.reason, ttl_s=args.ttl, expires_at=until
        ),
        out,
    )


def _utc(t: float | None) -> str:
    if t is None:
        return "-"
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def cmd_budget_schedules(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out

    def show(c: Client) -> None:
        items = c.schedules()
        if args.json:
            print(json.dumps(items), file=out)
            return
        if not items:
            print("no scheduled budgets", file=out)
            return
        table(
            ["id", "group", "budget", "ramp from", "start", "end", "state", "by", "reason"],
            [
                [
                    s["id"],
                    s["group"],
                    kw_text(s["budget_w"]),
                    _utc(s["ramp_from"]),
                    _utc(s["start"]),
                    _utc(s["end"]) if s["end"] is not None else "cancelled",
                    s["state"],
                    s["actor"],
                    s["reason"],
                ]
                for s in items
            ],
            out,
        )

    return _run(args, show, out)


def cmd_budget_cancel(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.cancel_schedule(args.id, args.reason), out)


def cmd_budget_clear(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.clear_budget(args.group, args.reason), out)


def cmd_pin(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.pin(args.uuid, args.watts, args.reason), out)


def cmd_unpin(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.unpin(args.uuid, args.reason), out)


def cmd_handover(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    if args.cancel:
        return _run(args, lambda c: c.cancel_handover(args.reason), out)
    if not args.domain:
        print("powerd handover: name --domain (repeatable), or --cancel", file=sys.stderr)
        return EXIT_BAD_INPUT
    to = [{"site": args.site, "store": args.store, "domain": d} for d in args.domain]
    return _run(args, lambda c: c.hand_over(to, args.reason), out)


def cmd_drain(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.drain(args.node, args.reason), out)


def cmd_undrain(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.undrain(args.node, args.reason), out)


def cmd_class_assign(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(
        args,
        lambda c: c.assign_class(args.cls, args.reason, uuids=args.gpu, nodes=args.node),
        out,
    )


def cmd_class_clear(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.clear_class(args.reason, uuids=args.gpu, nodes=args.node), out)


def split_list(text: str) -> list[str]:
    """`a,b, c` → [a, b, c] (empty parts dropped)."""
    return [part.strip() for part in text.split(",") if part.strip()]


def load_profile_points(path: str) -> list[list[float]]:
    """A profile file: a list of [power_w, throughput] points, or a mapping with `points`
    (a policy profile's entry), in YAML or JSON."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read profile {path}: {exc}") from None
    if isinstance(data, dict):
        data = data.get("points")
    if not isinstance(data, list) or not all(
        isinstance(p, list) and len(p) == 2 and all(isinstance(v, int | float) for v in p)
        for p in data
    ):
        raise argparse.ArgumentTypeError(
            f"{path}: a profile is a list of [power_w, throughput] points "
            "(or `points:` holding one)"
        )
    return [[float(p), float(t)] for p, t in data]


def cmd_job_put(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    uuids, nodes = split_list(args.gpus or ""), split_list(args.nodes or "")
    if not uuids and not nodes:
        print("powerd job put: give --gpus or --nodes (or both)", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        profile = None if args.profile is None else load_profile_points(args.profile)
    except argparse.ArgumentTypeError as exc:
        print(f"powerd job put: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    reason = args.reason or f"job {args.name}"

    def put(c: Client) -> dict[str, Any]:
        result = c.put_job(args.name, args.cls, reason, uuids=uuids, nodes=nodes, profile=profile)
        job = result["job"]
        if result["replaced"]:
            print(f"job {args.name}: replaced the job of that name", file=out)
        print(
            f"job {args.name}: {len(job['uuids'])} GPUs by uuid, {len(job['nodes'])} nodes, "
            f"class {job['class']}{', own profile' if job['profile'] else ''}; "
            f"{job['gpus_seen']} GPUs heard now",
            file=out,
        )
        if job["unseen_uuids"]:
            print(
                "  not heard yet (they join when they report): " + ", ".join(job["unseen_uuids"]),
                file=out,
            )
        return result

    return _run(args, put, out)


def cmd_job_list(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out

    def show(c: Client) -> None:
        jobs = c.jobs()
        if args.json:
            print(json.dumps(jobs), file=out)
            return
        if not jobs:
            print("no jobs", file=out)
            return
        table(
            ["job", "class", "profile", "uuids", "nodes", "heard", "by", "since", "reason"],
            [
                [
                    j["name"],
                    j["class"],
                    "own" if j["profile"] else "class",
                    str(len(j["uuids"])),
                    str(len(j["nodes"])),
                    str(j["gpus_seen"]),
                    j["actor"],
                    datetime.fromtimestamp(j["created_at"], tz=UTC).strftime("%Y-%m-%d %H:%M"),
                    j["reason"],
                ]
                for j in jobs
            ],
            out,
        )

    return _run(args, show, out)


def cmd_job_delete(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    return _run(args, lambda c: c.delete_job(args.name, args.reason or f"job {args.name}"), out)


def cmd_token_new(args: argparse.Namespace, out: TextIO | None = None) -> int:
    out = sys.stdout if out is None else out
    token, entry = new_token_entry(args.name, args.role)
    print(
        f"# token for {args.name} ({args.role}); hand it out, it is not stored anywhere:", file=out
    )
    print(f"# {token}", file=out)
    print("# append to /etc/powerd/tokens.toml, then restart the controller:", file=out)
    print(entry, file=out, end="")
    return EXIT_OK


def add_parser(sub: Any) -> None:
    """Register the client's subcommands on `powerd`'s subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("POWERD_URL", DEFAULT_URL),
        help="admin API base URL ($POWERD_URL, default %(default)s)",
    )
    common.add_argument(
        "--token",
        default=os.environ.get("POWERD_TOKEN"),
        help="bearer token ($POWERD_TOKEN)",
    )
    common.add_argument(
        "--ca",
        default=os.environ.get("POWERD_CA"),
        help="an https:// API's certificate must be signed by this CA (PEM; $POWERD_CA; "
        "default: the system's trust store)",
    )
    common.add_argument(
        "--cert",
        default=os.environ.get("POWERD_CERT"),
        help="client certificate (PEM) for an API that requires one ($POWERD_CERT)",
    )
    common.add_argument(
        "--key",
        default=os.environ.get("POWERD_KEY"),
        help="its key, if not in --cert ($POWERD_KEY)",
    )
    why = argparse.ArgumentParser(add_help=False)
    why.add_argument("--reason", required=True, help="why (written to the audit log)")

    _add_read_commands(sub, common)

    explain = sub.add_parser(
        "why", parents=[common], help="why a GPU has its cap (now, or at a past time)"
    )
    explain.add_argument("uuid")
    explain.add_argument("--at", type=parse_time, help="when: epoch seconds or ISO 8601")
    explain.add_argument("--json", action="store_true", help="print the raw JSON")
    explain.set_defaults(handler=cmd_why)

    _add_budget_commands(sub, common, why)

    pin = sub.add_parser("pin", parents=[common, why], help="hold a GPU at a fixed cap")
    pin.add_argument("uuid")
    pin.add_argument("watts", type=float)
    pin.set_defaults(handler=cmd_pin)
    unpin = sub.add_parser("unpin", parents=[common, why], help="release a pinned GPU")
    unpin.add_argument("uuid")
    unpin.set_defaults(handler=cmd_unpin)

    handover = sub.add_parser(
        "handover",
        parents=[common, why],
        help="hand this controller's nodes to other authorities, without a failsafe gap",
        description="Name successors in every command (docs/operations.md, 'Handing nodes "
        "over'): --site and --store default to this site and store ids; --domain is the "
        "successor's lease domain (the policy's root, or its --scope), repeatable.",
    )
    handover.add_argument("--site", required=False, default="", help="the site (policy `site`)")
    handover.add_argument("--store", default="", help="the successor's store (`powerd db id`)")
    handover.add_argument("--domain", action="append", default=[], help="a successor's domain")
    handover.add_argument("--cancel", action="store_true", help="stop naming successors")
    handover.set_defaults(handler=cmd_handover)

    drain = sub.add_parser("drain", parents=[common, why], help="hold a node at its minimum")
    drain.add_argument("node")
    drain.set_defaults(handler=cmd_drain)
    undrain = sub.add_parser("undrain", parents=[common, why], help="release a drained node")
    undrain.add_argument("node")
    undrain.set_defaults(handler=cmd_undrain)

    cls = sub.add_parser("class", help="workload class assignments (scheduler prolog/epilog)")
    cls_sub = cls.add_subparsers(dest="class_command", metavar="ACTION", required=True)
    assign = cls_sub.add_parser("assign", parents=[common, why], help="steer GPUs/nodes as CLASS")
    assign.add_argument("cls", metavar="CLASS")
    assign.add_argument("--gpu", action="append", default=[], help="GPU uuid (repeatable)")
    assign.add_argument("--node", action="append", default=[], help="node (repeatable)")
    assign.set_defaults(handler=cmd_class_assign)
    clear = cls_sub.add_parser("clear", parents=[common, why], help="drop class assignments")
    clear.add_argument("--gpu", action="append", default=[], help="GPU uuid (repeatable)")
    clear.add_argument("--node", action="append", default=[], help="node (repeatable)")
    clear.set_defaults(handler=cmd_class_clear)

    _add_job_commands(sub, common)

    token = sub.add_parser("token", help="admin API tokens")
    token_sub = token.add_subparsers(dest="token_command", metavar="ACTION", required=True)
    new = token_sub.add_parser("new", help="make a token and the hashed entry for tokens.toml")
    new.add_argument("--name", required=True, help="who (the actor in the audit log)")
    new.add_argument("--role", required=True, choices=[r.label for r in Role])
    new.set_defaults(handler=cmd_token_new)


def _add_read_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    status = sub.add_parser("status", parents=[common], help="fleet summary from the API")
    status.add_argument(
        "--level",
        choices=LEVELS,
        default="rack",
        help="show the budgets down to this level (default %(default)s)",
    )
    status.add_argument("--json", action="store_true", help="print the raw JSON")
    status.set_defaults(handler=cmd_status)

    gpus = sub.add_parser(
        "gpus", parents=[common], help="list GPUs: node, class, job, cap and draw"
    )
    gpus.add_argument("--node", help="only this node's")
    gpus.add_argument("--rack", help="only this rack's")
    gpus.add_argument("--row", help="only this row's")
    gpus.add_argument("--class", dest="cls", metavar="CLASS", help="only GPUs steered as CLASS")
    gpus.add_argument("--job", help="only this job's")
    gpus.add_argument(
        "--state",
        choices=("ok", "stale", "pinned", "drained"),
        help="only GPUs in this state",
    )
    gpus.add_argument("--json", action="store_true", help="print the raw JSON (every field)")
    gpus.set_defaults(handler=cmd_gpus)


def _add_budget_commands(
    sub: Any, common: argparse.ArgumentParser, why: argparse.ArgumentParser
) -> None:
    budget = sub.add_parser("budget", help="temporary budgets (grid events)")
    budget_sub = budget.add_subparsers(dest="budget_command", metavar="ACTION", required=True)
    bset = budget_sub.add_parser(
        "set", parents=[common, why], help="lower a group's budget for a while"
    )
    bset.add_argument("group", help="facility, row, rack or node name from the policy")
    bset.add_argument("watts", type=float, help="the budget in W (at most the policy's)")
    until = bset.add_mutually_exclusive_group()
    until.add_argument("--ttl", type=parse_duration, help="how long: 900, 15m, 2h")
    until.add_argument("--until", type=parse_time, help="end: epoch seconds or ISO 8601")
    until.add_argument("--end", type=parse_time, help="the same as --until")
    bset.add_argument(
        "--start",
        type=parse_time,
        help="schedule it: the budget ramps down to WATTS by this time (epoch seconds or "
        "ISO 8601) and back up from its end, at the policy's control.ramp_w_per_s",
    )
    bset.set_defaults(handler=cmd_budget_set)
    blist = budget_sub.add_parser(
        "schedules", parents=[common], help="list scheduled budgets (grid windows)"
    )
    blist.add_argument("--json", action="store_true", help="print the raw JSON")
    blist.set_defaults(handler=cmd_budget_schedules)
    bcancel = budget_sub.add_parser(
        "cancel", parents=[common, why], help="cancel a scheduled budget by its id"
    )
    bcancel.add_argument("id", help="the id `budget set --start` printed (s-...)")
    bcancel.set_defaults(handler=cmd_budget_cancel)
    bclear = budget_sub.add_parser("clear", parents=[common, why], help="end a temporary budget")
    bclear.add_argument("group")
    bclear.set_defaults(handler=cmd_budget_clear)


def _add_job_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    job = sub.add_parser("job", help="jobs: GPUs that share one cap (scheduler prolog/epilog)")
    job_sub = job.add_subparsers(dest="job_command", metavar="ACTION", required=True)
    reason = argparse.ArgumentParser(add_help=False)
    reason.add_argument("--reason", help="why (the audit log; default: 'job NAME')")
    jput = job_sub.add_parser(
        "put", parents=[common, reason], help="add a job, or replace the job of that name"
    )
    jput.add_argument("name", metavar="NAME", help="the scheduler's job id")
    jput.add_argument("--gpus", help="GPU uuids, comma-separated")
    jput.add_argument("--nodes", help="nodes (all their GPUs), comma-separated")
    jput.add_argument("--class", dest="cls", required=True, metavar="CLASS", help="policy class")
    jput.add_argument(
        "--profile", metavar="FILE", help="the job's own profile: [[power_w, throughput], ...]"
    )
    jput.set_defaults(handler=cmd_job_put)
    jlist = job_sub.add_parser("list", parents=[common], help="the jobs in force")
    jlist.add_argument("--json", action="store_true", help="print the raw JSON")
    jlist.set_defaults(handler=cmd_job_list)
    jdel = job_sub.add_parser("delete", parents=[common, reason], help="end a job")
    jdel.add_argument("name", metavar="NAME")
    jdel.set_defaults(handler=cmd_job_delete)
