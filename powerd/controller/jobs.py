"""Jobs as the tick sees them: which GPU is in which job, the class each job steers as, and
the policy the allocator gets (docs/operations.md, "Jobs").

A job without a profile steers as its class. A job with its own profile steers as a class
made for it, `job:<name>`: its class's weight, floor and ceiling with the job's profile. The
allocator gets the policy with those classes added (`JobView.policy`); reports, metrics and
the API show the job's class, not the made one. The view is compiled when the jobs or the
policy change, and the per-GPU index when the GPU set changes too: a tick with neither
change does no per-GPU Python work for jobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator import ClassTable, class_names
from powerd.controller.overrides import Jobs
from powerd.policy import ClassSpec, Policy, ProfileSpec
from powerd.profile import Profile

log = structlog.get_logger(__name__)

IntArray = NDArray[np.int64]

JOB_CLASS_PREFIX = "job:"


def job_class_name(job: str) -> str:
    """The class made for a job with its own profile."""
    return f"{JOB_CLASS_PREFIX}{job}"


@dataclass(frozen=True, eq=False)
class JobView:
    """The jobs compiled against one policy."""

    jobs: Jobs
    names: tuple[str, ...]  # job index → name (Fleet.job_names)
    job_class: IntArray  # job index → class index in `classes`
    policy: Policy  # the policy with the jobs' own classes added (the allocator's)
    classes: ClassTable  # of `policy`: the policy's classes first, in their order
    labels: tuple[str, ...]  # class index → the class shown (a job's own: its class)

    @classmethod
    def compile(cls, policy: Policy, jobs: Jobs) -> JobView:
        base = class_names(policy)
        index = {name: i for i, name in enumerate(base)}
        default = index[policy.defaults.class_]
        names = tuple(jobs.by_name)
        extra_classes: dict[str, ClassSpec] = {}
        extra_specs: dict[str, ProfileSpec] = {}
        extra_profiles: dict[str, Profile] = {}
        labels = list(base)
        job_class = np.empty(len(names), dtype=np.int64)
        for j, name in enumerate(names):
            job = jobs.by_name[name]
            spec = policy.classes.get(job.class_)
            if spec is None:  # the policy changed since: steer as the default class
                log.warning("job_class_gone", job=name, cls=job.class_)
                job_class[j] = default
                continue
            own = job_class_name(name)
            if job.profile is None or own in index:
                job_class[j] = index[job.class_]
                continue
            points = [list(p) for p in job.profile]
            extra_specs[own] = ProfileSpec(points=[(p, t) for p, t in job.profile])
            extra_profiles[own] = Profile.from_points(own, points)
            extra_classes[own] = spec.model_copy(update={"profile": own})
            job_class[j] = len(labels)
            labels.append(job.class_)
        effective = policy
        if extra_classes:
            spec_ = policy.spec.model_copy(
                update={
                    "classes": {**policy.spec.classes, **extra_classes},
                    "profiles": {**policy.spec.profiles, **extra_specs},
                }
            )
            effective = Policy(
                spec=spec_,
                source=policy.source,
                groups=policy.groups,
                profiles={**policy.profiles, **extra_profiles},
            )
        return cls(
            jobs=jobs,
            names=names,
            job_class=job_class,
            policy=effective,
            classes=ClassTable.from_policy(effective),
            labels=tuple(labels),
        )

    def index(self, uuids: Sequence[str], nodes: Sequence[str]) -> IntArray | None:
        """Per GPU, its job's index in `names` (-1: none); None when no GPU is in a job."""
        if not self.names:
            return None
        position = {name: j for j, name in enumerate(self.names)}
        by_uuid, by_node = self.jobs.uuid_job, self.jobs.node_job
        out = np.fromiter(
            (
                position[job] if (job := by_uuid.get(u) or by_node.get(n)) is not None else -1
                for u, n in zip(uuids, nodes, strict=True)
            ),
            dtype=np.int64,
            count=len(uuids),
        )
        return out if (out >= 0).any() else None
