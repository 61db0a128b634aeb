"""Scenario files: the site, the workload mix over time and how long to simulate it.

A scenario is YAML validated by pydantic, like a policy. It names a policy (the power tree,
classes and profiles), optionally reshapes its site (nodes, GPUs per node, the feed), and
says what every GPU runs: inference with a daily load curve and bursts, training jobs whose
GPUs swing in step, steady batch work, idle periods. Errors name the file, the path inside
it and what would be valid (`ScenarioError`). Schema: docs/simulator.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from powerd.input_errors import InputError, parse_yaml, read_text, validation_problems
from powerd.policy import Policy, ProfileSpec, RampRates

Watts = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegWatts = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Share = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
HOUR_S = 3600.0
# Demand that changes within a tick is integrated piece by piece (powerd.backends.mock):
# at most this many swings or slots per tick keep that cheap.
MAX_SWINGS_PER_TICK = 500
MAX_TICKS = 10_000_000
MAX_SCHEDULE = 64  # windows in one scenario, as many as a controller keeps
MAX_NODES = 100_000  # a site's nodes, the scenario's or a search's


if TYPE_CHECKING:
    from powerd.sim.recorded import Recording
    from powerd.sim.traces import GpuTrace


class ScenarioError(InputError):
    """A scenario that cannot be used, with where and why."""

    kind = "scenario"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class IdleWindow(_Strict):
    """Hours (from the start of the simulation) during which the workload's GPUs sit idle."""

    start_h: float = Field(ge=0, allow_inf_nan=False)
    end_h: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _ordered(self) -> IdleWindow:
        if self.end_h <= self.start_h:
            raise ValueError(f"end_h ({self.end_h:g}) must be after start_h ({self.start_h:g})")
        return self


class Bursts(_Strict):
    """Extra load on top of the daily curve: in every slot each GPU bursts with a probability."""

    extra_w: NonNegWatts = 150.0
    probability: float = Field(default=0.1, ge=0, le=1)
    slot_s: Watts = 60.0


class Surges(_Strict):
    """Load on top of the daily curve that every GPU of a service takes at once: in every
    slot the service surges with a probability (a burst of requests reaching all replicas)."""

    extra_w: NonNegWatts = 150.0
    probability: float = Field(default=0.1, ge=0, le=1)
    slot_s: Watts = 60.0


class Checkpoint(_Strict):
    """A training job's checkpoints: every `every_min` minutes, for `duration_s`, every GPU
    of the job drops to `level_w` and does no training work (each job at its own phase)."""

    every_min: Watts
    duration_s: Watts
    level_w: NonNegWatts = 100.0

    @model_validator(mode="after")
    def _fits(self) -> Checkpoint:
        if self.duration_s >= self.every_min * 60:
            raise ValueError(
                f"duration_s ({self.duration_s:g}) must be shorter than every_min "
                f"({self.every_min:g} min)"
            )
        return self


class JobRun(_Strict):
    """When a training job runs (hours from the start); outside its runs its GPUs idle. A job
    starting or ending is a step of all its GPUs at once."""

    job: int | None = Field(default=None, ge=1)  # 1-based; default: every job
    start_h: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    end_h: float | None = Field(default=None, gt=0, allow_inf_nan=False)  # default: never

    @model_validator(mode="after")
    def _ordered(self) -> JobRun:
        if self.end_h is not None and self.end_h <= self.start_h:
            raise ValueError(f"end_h ({self.end_h:g}) must be after start_h ({self.start_h:g})")
        return self


Pattern = Literal["inference", "training", "steady", "idle", "trace"]


class WorkloadSpec(_Strict):
    """A share of the site's nodes running one kind of work (whole nodes, as jobs are placed)."""

    name: str = Field(min_length=1)
    class_: str = Field(alias="class")
    share: Share
    # Given `traces`, the pattern is "trace" (and may be left out).
    pattern: Pattern | None = None
    # Recorded GPUs to replay (nvidia-smi CSV files or globs, relative to the scenario file;
    # docs/simulator.md, "Recorded traces"): each GPU replays one, round robin.
    traces: list[str] = Field(default_factory=list, max_length=1000)
    # Replay every node from the same moment of its trace (default: a seeded offset each).
    lockstep: bool = False
    # The GPUs' true throughput curve: a profile of the policy by name, or points of its own.
    # Default: the class's profile (the allocator steers by the class's profile either way).
    profile: str | ProfileSpec | None = None
    high_w: Watts = 650.0
    low_w: NonNegWatts = 250.0
    # training
    jobs: int = Field(default=1, ge=1, le=10_000)
    period_s: Watts = 1800.0
    duty: float = Field(default=0.8, gt=0, le=1)
    checkpoint: Checkpoint | None = None
    runs: list[JobRun] = Field(default_factory=list, max_length=1000)
    # inference
    peak_hour: float = Field(default=14.0, ge=0, lt=24)
    day_h: Watts = 24.0
    bursts: Bursts | None = None
    services: int = Field(default=1, ge=1, le=10_000)
    surges: Surges | None = None
    idle: list[IdleWindow] = Field(default_factory=list)

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    @model_validator(mode="after")
    def _levels(self) -> WorkloadSpec:
        if self.low_w > self.high_w:
            raise ValueError(f"low_w ({self.low_w:g}) must not exceed high_w ({self.high_w:g})")
        if self.traces and self.pattern not in (None, "trace"):
            raise ValueError(f"a workload with traces replays them: pattern {self.pattern!r}")
        if self.traces and self.idle:
            raise ValueError("idle windows apply to patterns; a trace has its idle times")
        if not self.traces and self.pattern in (None, "trace"):
            raise ValueError("give a pattern (inference, training, steady, idle) or traces")
        return self

    @property
    def kind(self) -> Pattern:
        return "trace" if self.traces else (self.pattern or "steady")


class ScheduledBudgetSpec(_Strict):
    """A grid operator's load target for a window of the simulated day: the group's budget
    lowered to `budget_w` (or `fraction` of its budget) from `start_h` to `end_h` (hours from
    the start), ramped in and out at the policy's (or the scenario's) `ramp_w_per_s`."""

    group: str | None = None  # default: the facility
    budget_w: Watts | None = None
    fraction: float | None = Field(default=None, gt=0, le=1, allow_inf_nan=False)
    start_h: float = Field(ge=0, allow_inf_nan=False)
    end_h: float = Field(gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _valid(self) -> ScheduledBudgetSpec:
        if (self.budget_w is None) == (self.fraction is None):
            raise ValueError("give budget_w or fraction (of the group's budget), one of them")
        if self.end_h <= self.start_h:
            raise ValueError(f"end_h ({self.end_h:g}) must be after start_h ({self.start_h:g})")
        return self


class SiteSpec(_Strict):
    """Reshape the policy's site: its tree grown or shrunk to `nodes`, and/or a new feed."""

    nodes: int | None = Field(default=None, ge=1, le=MAX_NODES)
    gpus_per_node: int | None = Field(default=None, ge=1, le=64)
    facility_budget_w: Watts | None = None
    # The feed as a share of the site's nameplate (every GPU at TDP plus node overhead).
    feed_fraction: float | None = Field(default=None, gt=0, le=2)
    placement: Literal["spread", "packed"] = "spread"

    @model_validator(mode="after")
    def _one_feed(self) -> SiteSpec:
        if self.facility_budget_w is not None and self.feed_fraction is not None:
            raise ValueError("give facility_budget_w or feed_fraction, not both")
        return self


class ScenarioSpec(_Strict):
    version: Literal[1] = 1
    name: str = Field(min_length=1)
    description: str = ""
    policy: str | None = None  # relative to the scenario file
    duration_h: float = Field(gt=0, le=24 * 366, allow_inf_nan=False)
    tick_s: float = Field(ge=1, le=3600, allow_inf_nan=False)
    seed: int = Field(default=0, ge=0, lt=2**63)
    site: SiteSpec = Field(default_factory=SiteSpec)
    workloads: list[WorkloadSpec] = Field(min_length=1)
    # A day's grid schedule (docs/simulator.md, "Grid schedules"), and the ramp rates that
    # shape it (default: the policy's control.ramp_w_per_s; neither: windows are steps).
    schedule: list[ScheduledBudgetSpec] = Field(default_factory=list, max_length=MAX_SCHEDULE)
    ramp_w_per_s: RampRates | None = None


@dataclass(frozen=True)
class Scenario:
    spec: ScenarioSpec
    source: str
    policy_path: Path | None  # resolved against the scenario file
    base_dir: Path = Path()  # where the scenario file is: traces are found from here
    # A controller's recording to replay instead of the workloads' demand (--from-db).
    recording: Recording | None = None

    @property
    def duration_s(self) -> float:
        return self.spec.duration_h * HOUR_S

    @property
    def ticks(self) -> int:
        return max(1, round(self.duration_s / self.spec.tick_s))

    @cached_property
    def traces(self) -> dict[int, list[GpuTrace]]:
        """The recorded GPUs of each trace workload (by index), read once: every run of a
        study replays the same samples (and warns once) even while a file still grows."""
        from powerd.sim.traces import load_traces

        return {
            i: load_traces(w.traces, self.base_dir)
            for i, w in enumerate(self.spec.workloads)
            if w.kind == "trace"
        }


def _check_patterns(i: int, w: WorkloadSpec, tick_s: float) -> list[tuple[str, str]]:
    """A workload's pattern keys: each with its pattern, jobs that exist, swings a tick
    can integrate."""
    problems: list[tuple[str, str]] = []
    for key, value, only in (
        ("checkpoint", w.checkpoint, "training"),
        ("runs", w.runs, "training"),
        ("surges", w.surges, "inference"),
        ("services", w.services != 1, "inference"),
    ):
        if value and w.kind != only:
            problems.append((f"workloads[{i}].{key}", f"applies to pattern {only}, not {w.kind}"))
    for r, run in enumerate(w.runs):
        if run.job is not None and run.job > w.jobs:
            problems.append(
                (
                    f"workloads[{i}].runs[{r}].job",
                    f"job {run.job} of {w.jobs}: jobs are numbered 1 to {w.jobs}",
                )
            )
    swings = [("period_s", w.period_s)] if w.kind == "training" else []
    if w.kind == "inference":
        swings += [("bursts.slot_s", w.bursts.slot_s)] if w.bursts else []
        swings += [("surges.slot_s", w.surges.slot_s)] if w.surges else []
    for key, every_s in swings:
        if every_s * MAX_SWINGS_PER_TICK < tick_s:
            problems.append(
                (
                    f"workloads[{i}].{key}",
                    f"{every_s:g} s is more than {MAX_SWINGS_PER_TICK} swings per tick of "
                    f"{tick_s:g} s; use {key} >= {tick_s / MAX_SWINGS_PER_TICK:g} "
                    "or a shorter tick_s",
                )
            )
    return problems


def _check(spec: ScenarioSpec) -> list[tuple[str, str]]:
    problems: list[tuple[str, str]] = []
    total = sum(w.share for w in spec.workloads)
    if abs(total - 1.0) > 1e-6:
        problems.append(
            (
                "workloads",
                f"shares add up to {total:g}; they must add up to 1 "
                "(give unused GPUs a workload with pattern: idle)",
            )
        )
    names: dict[str, int] = {}
    for i, w in enumerate(spec.workloads):
        if w.name in names:
            problems.append(
                (
                    f"workloads[{i}].name",
                    f"duplicate workload name '{w.name}' (first at workloads[{names[w.name]}])",
                )
            )
        names.setdefault(w.name, i)
        problems += _check_patterns(i, w, spec.tick_s)
    if spec.duration_h * HOUR_S / spec.tick_s > MAX_TICKS:
        problems.append(("tick_s", f"more than {MAX_TICKS:,} ticks; raise tick_s"))
    if spec.tick_s > spec.duration_h * HOUR_S:
        problems.append(("tick_s", "longer than the simulation (duration_h)"))
    return problems


def check_against_policy(scenario: Scenario, policy: Policy) -> None:
    """Class and profile names must exist in the policy the scenario runs on."""
    problems = []
    classes = sorted(policy.classes)
    profiles = sorted(policy.profiles)
    for i, w in enumerate(scenario.spec.workloads):
        if w.class_ not in policy.classes:
            problems.append(
                (
                    f"workloads[{i}].class",
                    f"unknown class '{w.class_}' in policy {policy.source}; "
                    f"valid: {', '.join(classes)}",
                )
            )
        if isinstance(w.profile, str) and w.profile not in policy.profiles:
            problems.append(
                (
                    f"workloads[{i}].profile",
                    f"unknown profile '{w.profile}' in policy {policy.source}; valid: "
                    f"{', '.join(profiles)}, or points: [[watts, throughput], ...]",
                )
            )
    if problems:
        raise ScenarioError(scenario.source, problems)


def parse_scenario(
    data: Any,
    source: str = "<scenario>",
    *,
    base_dir: Path | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Scenario:
    """Validate parsed YAML; `overrides` (e.g. tick_s from the command line) replace top-level
    keys before validation, so they are checked like the file."""
    if not isinstance(data, dict):
        raise ScenarioError(
            source,
            [("", "a scenario is a mapping with keys name, duration_h, tick_s and workloads")],
        )
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data = {**data, **given}

    def named(problems: list[tuple[str, str]]) -> list[tuple[str, str]]:
        # A value from the command line is looked for there, not in the file.
        return [
            (f"{path} (from --{path.replace('_', '-')})" if path in given else path, msg)
            for path, msg in problems
        ]

    try:
        spec = ScenarioSpec.model_validate(data)
    except ValidationError as exc:
        raise ScenarioError(source, named(validation_problems(exc))) from None
    problems = _check(spec)
    if problems:
        raise ScenarioError(source, named(problems))
    policy_path = None
    if spec.policy is not None:
        policy_path = (base_dir or Path.cwd()) / spec.policy
    return Scenario(
        spec=spec, source=source, policy_path=policy_path, base_dir=base_dir or Path.cwd()
    )


def load_scenario(path: str | Path, overrides: Mapping[str, Any] | None = None) -> Scenario:
    p = Path(path)
    data = parse_yaml(read_text(p, ScenarioError), str(p), ScenarioError)
    return parse_scenario(data, str(p), base_dir=p.parent, overrides=overrides)
