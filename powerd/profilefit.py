"""`powerd profile fit`: a power-limit sweep (CSV) turned into policy profiles.

A sweep measures one workload's throughput at several power limits. The profile a policy
needs is the upper concave envelope of those points (powerd.profile), normalised like the
policy's profiles (throughput relative to the best measured, power in W), together with how
far the measurements lie below it: the allocator steers by the envelope, so a point far
below it is throughput the envelope promises and the workload does not deliver.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import yaml

from powerd.input_errors import InputError
from powerd.profile import FloatArray, Profile, ProfileError, concave_envelope

# Two distinct power limits are the least that says how throughput moves with power.
MIN_POWER_LEVELS = 2
_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.:-]+")


class SweepError(InputError):
    """A sweep file that cannot be fitted: where, and what would be valid."""

    kind = "sweep"


@dataclass(frozen=True)
class Sweep:
    """One workload's measurements: (power W, throughput) per row of the CSV."""

    name: str
    power_w: FloatArray
    throughput: FloatArray


@dataclass(frozen=True)
class Fit:
    """A sweep's envelope, normalised to its best throughput, and its fit error.

    `max_below`/`rms_below`: how far measured points lie below the envelope at their power,
    relative to the envelope there (0.02: 2 % less throughput than the envelope promises).
    """

    sweep: Sweep
    points: tuple[tuple[float, float], ...]  # envelope (W, relative throughput), to the peak
    peak_w: float
    best: float  # the best measured throughput (the unit the points are relative to)
    max_below: float
    rms_below: float

    @property
    def profile(self) -> Profile:
        return Profile.from_points(self.sweep.name, self.points)

    @property
    def name(self) -> str:
        return self.sweep.name


def profile_name(text: str) -> str:
    """A policy name (letters, digits, `. _ : -`, starting with a letter or digit)."""
    name = _NAME_CHARS.sub("-", text.strip()).strip("-_.:")
    return name or "profile"


def read_sweeps(
    path: str | Path,
    *,
    power: str,
    throughput: str | None = None,
    time: str | None = None,
    group: Sequence[str] = (),
) -> list[Sweep]:
    """The sweeps of a CSV file, one per value of the `group` columns (all rows: one).

    Throughput is the `throughput` column, or 1 / the `time` column (a duration per unit of
    work, e.g. seconds per epoch). Raises SweepError naming the row and column of every
    problem found (up to 20)."""
    if (throughput is None) == (time is None):
        raise ValueError("give exactly one of throughput and time")
    source = str(path)
    value_col = throughput if throughput is not None else time
    assert value_col is not None
    rows = _read_rows(source, [power, value_col, *group])
    problems: list[tuple[str, str]] = []
    by_group: dict[tuple[str, ...], list[tuple[float, float]]] = {}
    for i, row in enumerate(rows, start=2):  # row 1 is the header
        p = _number(row.get(power, ""), f"row {i}", power, problems, positive=True)
        v = _number(
            row.get(value_col, ""), f"row {i}", value_col, problems, positive=time is not None
        )
        if p is not None and v is not None:
            key = tuple(row.get(c, "") for c in group)
            by_group.setdefault(key, []).append((p, 1.0 / v if time is not None else v))
        elif len(problems) >= 20:
            break
    if problems:
        raise SweepError(source, problems)
    if not by_group:
        raise SweepError(source, [("", "no data rows (only a header)")])
    sweeps = []
    for key, pts in by_group.items():
        where = ", ".join(f"{c}={k}" for c, k in zip(group, key, strict=True))
        label = "-".join(key) if key else Path(source).stem
        problem = _unfit(np.asarray(pts, dtype=np.float64))
        if problem is not None:
            problems.append((f"group {where}" if group else "", problem))
        else:
            arr = np.asarray(pts, dtype=np.float64)
            sweeps.append(Sweep(profile_name(label), arr[:, 0].copy(), arr[:, 1].copy()))
    if problems:
        raise SweepError(source, problems)
    names = [s.name for s in sweeps]
    if len(set(names)) != len(names):
        # Group values that differ only in characters a name cannot hold.
        sweeps = [Sweep(f"{s.name}-{i + 1}", s.power_w, s.throughput) for i, s in enumerate(sweeps)]
    return sweeps


def _read_rows(source: str, wanted: Sequence[str]) -> list[dict[str, str]]:
    """The CSV's rows as {column: text}, stripped; SweepError if a wanted column is missing."""
    try:
        with open(source, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            header = [h.strip() for h in reader.fieldnames or []]
            raw = list(reader)
    except OSError as exc:
        raise SweepError(source, [("", f"cannot read the file: {exc.strerror or exc}")]) from None
    except (UnicodeDecodeError, csv.Error) as exc:
        raise SweepError(source, [("", f"not a CSV text file: {exc}")]) from None
    if not header:
        raise SweepError(source, [("", "the file is empty (a header row is needed)")])
    missing = [c for c in wanted if c not in header]
    if missing:
        raise SweepError(
            source,
            [("header", f"no column '{c}'; columns: {', '.join(header)}") for c in missing],
        )
    # Keys None: cells past the header's width; values None: cells a short row lacks.
    return [
        {(k or "").strip(): (v or "").strip() for k, v in r.items() if k is not None} for r in raw
    ]


def _unfit(pts: FloatArray) -> str | None:
    """Why these (power, throughput) points cannot make a profile, or None."""
    levels = np.unique(pts[:, 0]).size
    if levels < MIN_POWER_LEVELS:
        return (
            f"{levels} distinct power value(s); a sweep needs at least {MIN_POWER_LEVELS} "
            "(measure the workload at several power limits)"
        )
    if not np.any(pts[:, 1] > 0):
        return "every throughput is 0"
    return None


def _number(
    text: str, where: str, column: str, problems: list[tuple[str, str]], *, positive: bool
) -> float | None:
    try:
        x = float(text)
    except ValueError:
        problems.append((where, f"column '{column}': '{text[:40]}' is not a number"))
        return None
    if not math.isfinite(x):
        problems.append((where, f"column '{column}': {text[:40]} is not a finite number"))
        return None
    if x < 0 or (positive and x == 0):
        need = "> 0" if positive else ">= 0"
        problems.append((where, f"column '{column}': {x:g} must be {need}"))
        return None
    return x


def fit(sweep: Sweep) -> Fit:
    """The sweep's upper concave envelope up to its peak, normalised to its best throughput,
    and how far the measured points lie below it."""
    pts = np.column_stack([sweep.power_w, sweep.throughput])
    power, tput = concave_envelope(pts.tolist())
    best = float(tput[-1])
    rel = tput / best
    envelope = Profile(sweep.name, power, rel)
    at = envelope.value(sweep.power_w)
    measured = sweep.throughput / best
    with np.errstate(divide="ignore", invalid="ignore"):
        below = np.where(at > 0, (at - measured) / at, 0.0)
    below = np.maximum(below, 0.0)
    points = tuple((float(p), float(y)) for p, y in zip(power.tolist(), rel.tolist(), strict=True))
    return Fit(
        sweep=sweep,
        points=points,
        peak_w=float(power[-1]),
        best=best,
        max_below=float(below.max()),
        rms_below=float(np.sqrt(np.mean(below**2))),
    )


def _fmt(x: float, digits: int) -> str:
    return f"{round(x, digits):.{digits}f}".rstrip("0").rstrip(".") or "0"


def _key(name: str) -> str:
    """The name as a YAML string: quoted where YAML would read it as something else (1024)."""
    return name if isinstance(yaml.safe_load(name), str) else f'"{name}"'


def to_yaml(fits: Sequence[Fit], source: str, weight: float = 1.0) -> str:
    """`profiles:` and `classes:` sections for a policy, with each fit's error in comments."""
    lines = [f"# fitted by `powerd profile fit` from {source}", "profiles:"]
    for f in fits:
        pts = ", ".join(f"[{_fmt(p, 1)}, {_fmt(y, 4)}]" for p, y in f.points)
        about = f"fitted from {Path(source).name} (best {f.best:.6g})"
        lines += [
            f"  {_key(f.name)}:",
            f"    # {f.sweep.power_w.size} measured points; peak at {_fmt(f.peak_w, 1)} W; "
            f"measured up to {100 * f.max_below:.1f} % below the envelope "
            f"(RMS {100 * f.rms_below:.1f} %)",
            f"    description: {json.dumps(about)}",
            f"    points: [{pts}]",
        ]
    lines.append("classes:")
    for f in fits:
        name = _key(f.name)
        lines += [f"  {name}:", f"    weight: {weight:g}", f"    profile: {name}"]
    return "\n".join(lines) + "\n"


def plot(fits: Sequence[Fit], path: str | Path) -> None:
    """Measured points and envelope of every fit, one panel each, normalised, into a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(fits)
    cols = math.ceil(math.sqrt(n))
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(3.2 * cols, 2.6 * rows), squeeze=False, constrained_layout=True
    )
    for ax, f in zip(axes.flat, fits, strict=False):
        ax.scatter(
            f.sweep.power_w, f.sweep.throughput / f.best, s=12, color="0.3", label="measured"
        )
        px = [p for p, _ in f.points]
        py = [y for _, y in f.points]
        hi = float(max(f.sweep.power_w.max(), f.peak_w))
        ax.plot([*px, hi], [*py, py[-1]], color="tab:blue", lw=1.5, label="envelope")
        ax.axvline(f.peak_w, color="tab:orange", lw=0.8, ls="--")
        ax.set_title(f"{f.name}\nmax {100 * f.max_below:.1f} % below", fontsize=7)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("power limit (W)", fontsize=7)
        ax.set_ylabel("relative throughput", fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize=6)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_fit(args: argparse.Namespace) -> int:
    group = [c.strip() for c in (args.group or "").split(",") if c.strip()]
    try:
        sweeps = read_sweeps(
            args.file, power=args.power, throughput=args.throughput, time=args.time, group=group
        )
        fits = [fit(s) for s in sweeps]
    except ProfileError as exc:  # pragma: no cover - read_sweeps already refuses such points
        raise SweepError(str(args.file), [("", str(exc))]) from None
    if args.png:
        try:
            plot(fits, args.png)
        except OSError as exc:
            raise SweepError(
                args.png, [("", f"cannot write the PNG: {exc.strerror or exc}")]
            ) from None
    sys.stdout.write(to_yaml(fits, str(args.file), weight=args.weight))
    return 0
