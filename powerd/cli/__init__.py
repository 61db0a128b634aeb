"""The `powerd` command line: one module per group of commands, each with its `add_parser`.

`policy` (policy check, solve, warm), `daemons` (demo, agent, controller, coordinator), the
admin API's commands (`admin`: status, gpus, why, budget, pin, drain, handover, class, job,
token), `sim`, `profile` (`powerd.profilefit`) and `db`. Each subcommand builds its settings
and parts, then runs them; its handler returns the exit status (`exits`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from powerd import __version__
from powerd.cli import admin, daemons, db, policy, sim
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from powerd.input_errors import InputError
from powerd.logs import configure_logging
from powerd.profilefit import add_profile_parser

Handler = Callable[[argparse.Namespace], int]


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

    policy.add_parser(sub)
    daemons.add_parser(sub)
    admin.add_parser(sub)
    sim.add_parser(sub)
    add_profile_parser(sub)
    db.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    quiet = args.command in ("demo", "sim", "solve", "warm")  # their own output is the point
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
