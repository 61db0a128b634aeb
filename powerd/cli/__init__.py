"""The `powerd` command line: one module per group of commands, each with its `add_parser`.

`policy` (policy check, solve, warm), `daemons` (demo, agent, controller, coordinator), the
admin API's commands (`admin`: status, gpus, why, budget, pin, drain, handover, class, job,
token), `sim`, `profile` (`powerd.profilefit`), `db` and `pilot` (`pilot report`). Each
subcommand builds its settings and parts, then runs them; its handler returns the exit
status (`exits`).

Building the parser loads none of the controller's libraries (numpy, SQLAlchemy, FastAPI...):
the base install, on every GPU node, has none of them. A command that needs an extra names
it (`needs`, `extras.py`) and is refused with one line when it is missing.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from powerd import __version__
from powerd.cli import admin, daemons, db, pilot, policy, profile, sim
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from powerd.cli.extras import MissingExtra, extra_of, require
from powerd.input_errors import InputError
from powerd.logs import configure_logging

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
    parser.set_defaults(needs=None)  # the extra a command needs beyond the base install
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    policy.add_parser(sub)
    daemons.add_parser(sub)
    admin.add_parser(sub)
    sim.add_parser(sub)
    profile.add_parser(sub)
    db.add_parser(sub)
    pilot.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except MissingExtra as exc:  # a flag whose value the extra's libraries check
        print(exc, file=sys.stderr)
        return EXIT_BAD_INPUT
    quiet = args.command in ("demo", "sim", "solve", "warm")  # their own output is the point
    configure_logging(args.log_format, args.log_level or ("warning" if quiet else "info"))
    return _run(args)


def _action(args: argparse.Namespace) -> list[str]:
    """A command group's action (`policy check`, `db upgrade`): its `<command>_command`."""
    action = getattr(args, f"{args.command}_command", None)
    return [action] if isinstance(action, str) else []


def _run(args: argparse.Namespace) -> int:
    """The command's handler, with what it raises as the exit status and one line."""
    handler: Handler = args.handler
    command = " ".join(["powerd", args.command, *_action(args)])
    try:
        if args.needs is not None:
            require(command, args.needs)
        return handler(args)
    except (InputError, MissingExtra) as exc:
        print(str(exc), file=sys.stderr)
        return EXIT_BAD_INPUT
    except ModuleNotFoundError as exc:  # a library a command imports beyond its extra's
        extra = extra_of(exc.name)
        if extra is None:  # not an extra's: a broken install, shown whole
            raise
        print(MissingExtra(command, extra, [str(exc.name)]), file=sys.stderr)
        return EXIT_BAD_INPUT
    except ValueError as exc:  # e.g. a malformed broker URL, caught before anything started
        print(f"powerd {args.command}: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `powerd ... | head`: the reader left; not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
