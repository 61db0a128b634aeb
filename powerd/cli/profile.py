"""`powerd profile fit`: profiles for a policy from a power-limit sweep (powerd.profilefit)."""

from __future__ import annotations

import argparse
from typing import Any

from powerd.argtypes import positive_float


def cmd_fit(args: argparse.Namespace) -> int:
    from powerd.profilefit import cmd_fit as fit

    return fit(args)


def add_parser(sub: Any) -> None:
    """Register `powerd profile fit` on the top-level subparsers."""
    profile = sub.add_parser("profile", help="throughput-vs-power profiles for a policy")
    psub = profile.add_subparsers(dest="profile_command", metavar="ACTION", required=True)
    f = psub.add_parser(
        "fit",
        help="fit profiles to a power-limit sweep (CSV) and print them as policy YAML",
        description="Fit the upper concave envelope of (power, throughput) per workload, "
        "normalised to its best throughput, and print `profiles:` and `classes:` YAML for a "
        "policy with each fit's error (docs/policy.md, 'Profiles from measurements').",
    )
    f.add_argument("file", help="CSV file with a header row")
    f.add_argument("--power", required=True, help="column: the power limit (W) of each run")
    what = f.add_mutually_exclusive_group(required=True)
    what.add_argument("--throughput", help="column: throughput (any unit; higher is better)")
    what.add_argument(
        "--time", help="column: time per unit of work (e.g. s per epoch); throughput = 1/time"
    )
    f.add_argument(
        "--group",
        help="column(s), comma-separated: fit one profile per distinct value (e.g. a workload)",
    )
    f.add_argument("--png", help="write a plot of the points and envelopes to this PNG file")
    f.add_argument(
        "--weight", type=positive_float, default=1.0, help="class weight printed (default 1)"
    )
    f.set_defaults(handler=cmd_fit, needs="sim")
