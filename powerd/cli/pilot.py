"""`powerd pilot report`: the A/B pilot's report from a controller's store (docs/operations.md,
"Pilot")."""

from __future__ import annotations

import argparse
import os
import sys
import time
import urllib.parse
from pathlib import Path
from typing import Any

from powerd.cli.db import DEFAULT_DB_URL
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK

WINDOW_HELP = (
    "START..END, each ISO 8601 with a time zone (2026-11-02T00:00Z, "
    "2026-11-02T00:00:00+01:00; a time without a zone is refused)"
)


def prom_url(text: str) -> str:
    """An http(s) URL with a host (and a port that exists): urllib would otherwise try FTP or
    a file, or say 'unknown url type' only after both windows were read from the store."""
    parsed = urllib.parse.urlsplit(text)
    try:
        port_ok = parsed.port is None or parsed.port > 0
    except ValueError:
        port_ok = False
    if parsed.scheme not in ("http", "https") or not parsed.hostname or not port_ok:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a Prometheus server's URL: give http://HOST:PORT or https://..."
        )
    return text


def cmd_pilot_report(args: argparse.Namespace) -> int:
    from powerd.outputs import check_out_dir
    from powerd.pilot.report import PromQuery, build, write
    from powerd.pilot.windows import PilotError, parse_window

    if (args.throughput_prom is None) != (args.query is None):
        print("powerd pilot report: --throughput-prom and --query go together", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.latency_query is not None and args.throughput_prom is None:
        print("powerd pilot report: --latency-query needs --throughput-prom", file=sys.stderr)
        return EXIT_BAD_INPUT
    progress = _Progress(args.quiet)
    try:
        baseline = parse_window("baseline", args.baseline)
        managed = parse_window("managed", args.managed)
        check_out_dir(args.out)  # before the store is read
        prom = (
            None
            if args.throughput_prom is None
            else PromQuery(args.throughput_prom, args.query, args.latency_query)
        )
        report, windows = build(
            args.db, baseline, managed, prom=prom, progress=progress, baseline_db=args.baseline_db
        )
        progress("plots")
        written = write(report, windows, args.out)
    except PilotError as exc:
        progress.done()
        print(f"powerd pilot report: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT if exc.bad_input else EXIT_FAILED
    progress.done()
    print(written.text)
    print(f"wrote {written.html_path} and {written.json_path}")
    return EXIT_OK


class _Progress:
    """One line per step on stderr, at most one a second after the first."""

    def __init__(self, quiet: bool) -> None:
        self.quiet = quiet
        self.last = -1.0e9
        self.t0 = time.monotonic()

    def __call__(self, line: str) -> None:
        now = time.monotonic()
        if self.quiet or now - self.last < 1.0:
            return
        self.last = now
        print(f"[{now - self.t0:5.1f} s] {line}", file=sys.stderr, flush=True)

    def done(self) -> None:
        pass


def add_parser(sub: Any) -> None:
    """Register `powerd pilot` and its actions on the top-level subparsers."""
    pilot = sub.add_parser("pilot", help="A/B pilot: compare a baseline window with a managed one")
    pilot_sub = pilot.add_subparsers(dest="pilot_command", metavar="ACTION", required=True)
    rep = pilot_sub.add_parser(
        "report",
        help="throughput, power and budget compliance of two windows, as HTML, JSON and text",
        description="Compare a baseline window (static caps, or another controller) with a "
        "managed window (powerd steering, more GPUs in the same envelope) from a controller's "
        "store: work delivered, GPUs and power, draw against every budget, committed against "
        "measured draw, the caps' history, latency where Prometheus gives it. Needs the `sim` "
        'extra (matplotlib). docs/operations.md, "Pilot".',
    )
    rep.add_argument("--baseline", required=True, metavar="START..END", help=WINDOW_HELP)
    rep.add_argument("--managed", required=True, metavar="START..END", help=WINDOW_HELP)
    rep.add_argument(
        "--db",
        default=os.environ.get("POWERD_DB", DEFAULT_DB_URL),
        help="the controller's store, read only: sqlite:///powerd.db or "
        "postgresql://user@host/db (default: $POWERD_DB or %(default)s)",
    )
    rep.add_argument(
        "--baseline-db",
        metavar="URL",
        help="where the baseline was recorded, if not in --db (a shadow's --record-db)",
    )
    rep.add_argument(
        "--throughput-prom",
        type=prom_url,
        metavar="URL",
        help="take work from a Prometheus server (http://prom:9090) instead of the agents' "
        "reported perf",
    )
    rep.add_argument(
        "--query",
        metavar="PROMQL",
        help="with --throughput-prom: work per second, e.g. "
        "'sum(rate(vllm:generation_tokens_total[1m]))' (series are summed)",
    )
    rep.add_argument(
        "--latency-query",
        metavar="PROMQL",
        help="with --throughput-prom: a latency to report, e.g. a histogram_quantile(0.95, "
        "...) (of several series, the largest at each step)",
    )
    rep.add_argument(
        "--out",
        type=Path,
        default=Path("pilot-report"),
        help="directory for pilot.html and pilot.json (default: %(default)s)",
    )
    rep.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    rep.set_defaults(handler=cmd_pilot_report, needs="sim")
