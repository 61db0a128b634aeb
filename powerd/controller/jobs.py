"""Jobs as the tick sees them: which GPU is in which job, the class each job steers as, and
the policy the allocator gets (docs/operations.md, "Jobs").

A job without a profile steers as its class. A job with its own profile steers as a class
made for it: its class's weight, floor and ceiling with the job's profile, named
`job:<class>:<10 hex digits of the profile's hash>`; jobs of one class with the same profile
share it (a site whose jobs bring a few curves gets a few classes, not one per job). The
allocator gets the policy with those classes added (`JobView.policy`); reports, metrics and
the API show the job's class, not the made one. The view is compiled when the jobs or the
policy change, and the per-GPU index when the GPU set changes too: a tick with neither
change does no work for jobs but one `np.where`. The index costs Python work per GPU only
when the GPU set changes (`GpuPlaces`); a job write costs it per node and uuid the jobs
name, then numpy over the GPUs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np
import structlog
from numpy.typing import NDArray

from powerd.allocator import ClassTable, class_names
from powerd.controller.overrides import Jobs
from powerd.policy import ClassSpec, Policy, ProfileSpec
from powerd.profile import Profile
from powerd.topology import N_LEVELS, Topology

log = structlog.get_logger(__name__)

IntArray = NDArray[np.int64]

JOB_CLASS_PREFIX = "job:"
Points = tuple[tuple[float, float], ...]
# Profiles built from jobs' points, by their points: a job's curve is built once, not at
# every compile (a compile follows every job write). Checked at the write already.
_CURVES: dict[Points, tuple[str, ProfileSpec, Profile]] = {}
_CURVES_MAX = 4096


def job_class_name(cls: str, points: Points) -> str:
    """The class made for jobs of class `cls` with their own profile `points`."""
    return f"{JOB_CLASS_PREFIX}{cls}:{_curve(points)[0]}"


def _curve(points: Points) -> tuple[str, ProfileSpec, Profile]:
    """(digest, spec, profile) of a job's points."""
    found = _CURVES.get(points)
    if found is None:
        if len(_CURVES) >= _CURVES_MAX:
            _CURVES.clear()
        digest = hashlib.sha256(repr(points).encode()).hexdigest()[:10]
        spec = ProfileSpec.model_construct(points=list(points), description="a job's profile")
        profile = Profile.from_points("job", [list(p) for p in points])
        found = _CURVES[points] = (digest, spec, profile)
    return found


@dataclass(frozen=True, eq=False)
class GpuPlaces:
    """Where each GPU of one fleet shape sits, for the job index: built when the GPU set
    changes (Python work per GPU once), used at every job change."""

    uuid_pos: dict[str, int]  # uuid → position in the tick's arrays
    node_group: IntArray  # per GPU: its node's group in the topology
    group_of_node: dict[str, int]  # node name → its group

    @classmethod
    def build(cls, uuids: Sequence[str], topology: Topology) -> GpuPlaces:
        nodes = np.flatnonzero(topology.level == N_LEVELS - 1).tolist()
        return cls(
            uuid_pos={u: i for i, u in enumerate(uuids)},
            node_group=np.ascontiguousarray(topology.gpu_groups[:, N_LEVELS - 1]),
            group_of_node={topology.names[g]: g for g in nodes},
        )


@dataclass(frozen=True, eq=False)
class JobView:
    """The jobs compiled against one policy."""

    jobs: Jobs
    names: tuple[str, ...]  # job index → name (GpuArrays.job_names)
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
            if job.profile is None:
                job_class[j] = index[job.class_]
                continue
            digest, curve_spec, curve = _curve(job.profile)
            own = f"{JOB_CLASS_PREFIX}{job.class_}:{digest}"
            if own not in index:
                index[own] = len(labels)
                labels.append(job.class_)
                extra_specs[own], extra_profiles[own] = curve_spec, curve
                extra_classes[own] = spec.model_copy(update={"profile": own})
            job_class[j] = index[own]
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

    def index(self, places: GpuPlaces) -> IntArray | None:
        """Per GPU, its job's index in `names` (-1: none); None when no GPU is in a job.
        A job naming a GPU's uuid wins over one holding its node."""
        if not self.names:
            return None
        position = {name: j for j, name in enumerate(self.names)}
        by_group = np.full(len(places.node_group) and int(places.node_group.max()) + 1, -1)
        group_of = places.group_of_node
        for node, job in self.jobs.node_job.items():
            g = group_of.get(node)
            if g is not None and g < len(by_group):
                by_group[g] = position[job]
        out = by_group[places.node_group] if len(by_group) else np.full(0, -1)
        out = out.astype(np.int64, copy=False)
        uuid_pos = places.uuid_pos
        for uuid, job in self.jobs.uuid_job.items():
            i = uuid_pos.get(uuid)
            if i is not None:
                out[i] = position[job]
        return out if (out >= 0).any() else None


@dataclass(frozen=True, eq=False)
class ReportedJobs:
    """Jobs the nodes report per GPU (telemetry's `job`), coupled as the policy's
    `control.reported_jobs` says (docs/operations.md, "Jobs from Kubernetes").

    A node's report is untrusted. It never changes a GPU's class: a reported job steers as
    the class most of its GPUs have (ties: the policy's first), and a member of another
    class (its own workload's or an operator's assignment) steers alone. It never takes a
    GPU an operator's job holds. With scope "node" a job couples one node's GPUs only, named
    `<job>@<node>`, so a node's report reaches its own GPUs and nothing else; with "site"
    the GPUs of every node reporting one name share one cap (a name an operator's job has
    is left to the operator's)."""

    names: tuple[str, ...]  # reported job index → the name shown
    index: IntArray  # per GPU: its reported job (-1: none)

    @classmethod
    def couple(
        cls,
        reported: Sequence[str | None],
        *,
        free: NDArray[np.bool_],  # per GPU: in no operator's job
        class_index: IntArray,
        nodes: Sequence[str],  # per GPU, its node's name
        node_index: IntArray,  # per GPU, its node's position (any numbering)
        scope: str,  # "node" or "site"
        taken: Collection[str] = (),  # names of operators' jobs
    ) -> ReportedJobs:
        n = len(reported)
        index = np.full(n, -1, dtype=np.int64)
        # Codes in the order names first appear (the fleet's order: stable from tick to
        # tick); one pass of Python over the GPUs, the rest numpy.
        code_of: dict[str, int] = {}
        seen = code_of.setdefault
        code = np.fromiter(
            (-1 if r is None else seen(r, len(code_of)) for r in reported), np.int64, count=n
        )
        distinct = list(code_of)
        usable = (code >= 0) & free
        gone = [code_of[t] for t in taken if t in code_of]
        if gone:
            usable &= ~np.isin(code, gone)
        eligible = np.flatnonzero(usable)
        if not eligible.size:
            return cls((), index)
        key = code[eligible]
        if scope == "node":  # one node's GPUs only: the node is part of the key
            key = node_index[eligible].astype(np.int64) * len(distinct) + key
        classes = class_index[eligible]
        n_classes = int(classes.max()) + 1
        # Each key's class: the one most of its GPUs have, the lowest index on a tie.
        pair, count = np.unique(key * n_classes + classes, return_counts=True)
        pair_key, pair_cls = pair // n_classes, pair % n_classes
        order = np.lexsort((pair_cls, -count, pair_key))
        pair_key, pair_cls = pair_key[order], pair_cls[order]
        first = np.ones(pair_key.size, dtype=np.bool_)
        first[1:] = pair_key[1:] != pair_key[:-1]
        job_key, job_cls = pair_key[first], pair_cls[first]
        at = np.searchsorted(job_key, key)
        member = classes == job_cls[at]
        members, job_of = eligible[member], at[member]
        _, where, position = np.unique(job_of, return_index=True, return_inverse=True)
        names = []
        for i in where.tolist():  # each job's first GPU, in the jobs' order
            gpu = int(members[i])
            name = distinct[int(code[gpu])]
            names.append(f"{name}@{nodes[gpu]}" if scope == "node" else name)
        index[members] = position
        return cls(tuple(names), index)
