"""A fleet written down for one allocation: every GPU, its limits, draw and cap.

The input of `powerd solve` and `powerd.allocator.allocate`, read from a JSON file
(docs/snapshot.md) or built by the synthetic fleets of the benchmarks and tests. The
controller does not use it: its tick builds the allocator's arrays from telemetry directly
(controller/fleet.py). Validation against the policy happens here, so the allocator only
ever sees consistent input.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from powerd.input_errors import InputError, validation_problems
from powerd.policy import Policy

Watts = Annotated[float, Field(ge=0, allow_inf_nan=False)]


class SnapshotError(InputError):
    kind = "snapshot"


class GpuState(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    uuid: str = Field(min_length=1, max_length=128)
    node: str = Field(min_length=1)
    min_cap_w: Watts
    max_cap_w: Watts
    power_w: Watts
    cap_w: Watts  # cap in force (the previous allocation's, as enforced)
    workload: str | None = None  # a class name; None → the policy's default class
    # A stale GPU is never raised; a pinned GPU gets exactly this cap.
    stale: bool = False
    pinned_w: Watts | None = None
    # GPUs naming one job get one cap (they share its class); None: in no job.
    job: str | None = Field(default=None, min_length=1, max_length=128)

    @model_validator(mode="after")
    def _ordered(self) -> GpuState:
        if self.min_cap_w > self.max_cap_w:
            raise ValueError(
                f"min_cap_w ({self.min_cap_w:g}) must not exceed max_cap_w ({self.max_cap_w:g})"
            )
        return self


class Snapshot(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: list[GpuState]
    tick: int | None = None


def check_snapshot(snapshot: Snapshot, policy: Policy, source: str = "<snapshot>") -> None:
    """Raise SnapshotError if the GPUs do not fit the policy (unknown node/class, duplicates)."""
    nodes = set(policy.node_names())
    classes = policy.classes
    problems: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    job_class: dict[str, tuple[str, int]] = {}  # job → (its class, the GPU that set it)
    for i, g in enumerate(snapshot.gpus):
        if g.uuid in seen:
            problems.append(
                (f"gpus[{i}].uuid", f"duplicate uuid '{g.uuid}' (also gpus[{seen[g.uuid]}])")
            )
        else:
            seen[g.uuid] = i
        if g.node not in nodes:
            problems.append((f"gpus[{i}].node", f"node '{g.node}' is not in the policy's tree"))
        if g.workload is not None and g.workload not in classes:
            valid = ", ".join(sorted(classes))
            problems.append(
                (f"gpus[{i}].workload", f"unknown class '{g.workload}'; valid: {valid}")
            )
        if g.pinned_w is not None and not g.min_cap_w <= g.pinned_w <= g.max_cap_w:
            problems.append((f"gpus[{i}].pinned_w", "must lie within [min_cap_w, max_cap_w]"))
        if g.job is not None:
            cls = g.workload or policy.defaults.class_
            first = job_class.setdefault(g.job, (cls, i))
            if first[0] != cls:
                problems.append(
                    (
                        f"gpus[{i}].workload",
                        f"job '{g.job}' steers as one class: gpus[{first[1]}] is '{first[0]}', "
                        f"this GPU '{cls}'",
                    )
                )
        if len(problems) >= 50:
            problems.append(("", "... more problems not shown"))
            break
    if problems:
        raise SnapshotError(source, problems)


def parse_snapshot(data: Any, policy: Policy, source: str = "<snapshot>") -> Snapshot:
    try:
        snapshot = Snapshot.model_validate(data)
    except ValidationError as exc:
        raise SnapshotError(source, validation_problems(exc)) from None
    check_snapshot(snapshot, policy, source)
    return snapshot


def load_snapshot(path: str | Path, policy: Policy) -> Snapshot:
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise SnapshotError(
            str(p), [("", f"cannot read the file: {exc.strerror or exc}")]
        ) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SnapshotError(str(p), [("", f"not valid JSON: {exc}")]) from None
    return parse_snapshot(data, policy, str(p))
