"""Jobs: GPUs, possibly across nodes, racks and rows, that share one cap (a scheduler's
prolog puts one, its epilog deletes it; docs/operations.md, "Jobs").

The writes go through the same path as every override write (powerd.api.writes): validated
and applied on the loop, durable in the state file, audited. Their answers say more than
an override's: the job as now in force, and the GPUs it names that are not heard yet.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Path

from powerd.api.bodies import JobDeleted, JobIn, JobOut, JobWriteOut, Page, WriteRefused
from powerd.api.deps import V1, ControllerDep, Limit, Offset, Operator, ReasonQuery, Viewer
from powerd.api.errors import AUTH_ERRORS, WRITE_ERRORS, error_doc, rejected
from powerd.api.writes import Attempt, write
from powerd.controller.admin import JobPut
from powerd.controller.controller import Controller
from powerd.controller.overrides import JOB_NAME_PATTERN, Job

router = APIRouter(prefix=V1, tags=["jobs"])

JobName = Annotated[
    str,
    Path(
        pattern=JOB_NAME_PATTERN,
        max_length=64,
        description="The scheduler's job id: letters, digits, '_', '.', '-' (at most 64).",
    ),
]
UNSEEN_SHOWN = 100
JOB_WRITE_ERRORS = WRITE_ERRORS | {
    409: error_doc(
        "Another job holds a GPU or node named: not applied, audited, the detail names "
        "it. Or this controller stands by: send writes to the leader named in the detail",
        WriteRefused,
    )
}


def job_out(controller: Controller, job: Job) -> JobOut:
    gpus = controller.fleet.gpus
    unseen = [u for u in job.uuids if u not in gpus]
    named = set(job.uuids)
    jobs = controller.overrides.jobs
    # GPUs heard on its nodes that are its (not named by uuid, here or by another job).
    on_nodes = sum(
        1
        for n in job.nodes
        for u in controller.fleet.gpus_of(n)
        if u not in named and jobs.job_of(u, n) == job.name
    )
    return JobOut(
        name=job.name,
        class_=job.class_,
        uuids=list(job.uuids),
        nodes=list(job.nodes),
        profile=None if job.profile is None else [tuple(p) for p in job.profile],
        gpus_seen=len(job.uuids) - len(unseen) + on_nodes,
        unseen_uuids=unseen[:UNSEEN_SHOWN],
        reason=job.reason,
        actor=job.actor,
        created_at=job.created_at,
    )


@router.get("/jobs", response_model=Page[JobOut], responses=AUTH_ERRORS)
async def jobs(
    _: Viewer, controller: ControllerDep, limit: Limit = 100, offset: Offset = 0
) -> dict[str, Any]:
    """Every job in force, by name."""
    names = sorted(controller.overrides.jobs.by_name)
    by_name = controller.overrides.jobs.by_name
    items = [job_out(controller, by_name[n]) for n in names[offset : offset + limit]]
    return {"items": items, "total": len(names), "limit": limit, "offset": offset}


@router.get(
    "/jobs/{job}",
    response_model=JobOut,
    responses={**AUTH_ERRORS, 404: error_doc("No job of that name")},
)
async def get_job(job: JobName, _: Viewer, controller: ControllerDep) -> JobOut:
    """One job: its GPUs and nodes, class, profile, and which of its GPUs are heard."""
    found = controller.overrides.jobs.by_name.get(job)
    if found is None:
        rejected(404, f"no job '{job}'")
    return job_out(controller, found)


@router.put("/jobs/{job}", response_model=JobWriteOut, responses=JOB_WRITE_ERRORS)
async def put_job(job: JobName, body: JobIn, p: Operator, controller: ControllerDep) -> JobWriteOut:
    """Add a job, or replace the job of this name: every GPU it names (by uuid, or all of a
    node's) gets one cap, steered as its class (or by its own profile with the class's
    weight and bounds). A GPU belongs to at most one job: naming one another job holds is
    a 409 that names it. GPUs not heard yet are accepted (the scheduler may be ahead of
    the telemetry) and listed in `job.unseen_uuids`; they join the job when they report."""
    done: list[JobPut] = []

    def change() -> None:
        done.append(
            controller.put_job(
                job,
                body.class_,
                uuids=body.uuids,
                nodes=body.nodes,
                profile=body.profile,
                actor=p.name,
                reason=body.reason,
                role=p.role.label,
            )
        )

    out = await write(Attempt(controller, p, "job.put", job, body.reason), change, "class")
    # The job as it is now (a later write may have replaced it meanwhile: say so).
    current = controller.overrides.jobs.by_name.get(job, done[0].job)
    return JobWriteOut(
        **out.model_dump(), job=job_out(controller, current), replaced=done[0].replaced
    )


@router.delete("/jobs/{job}", response_model=JobDeleted, responses=JOB_WRITE_ERRORS)
async def delete_job(
    job: JobName, reason: ReasonQuery, p: Operator, controller: ControllerDep
) -> JobDeleted:
    """End a job (the scheduler's epilog): its GPUs are steered one by one again from the
    next tick, as their own class."""
    gone: list[Job] = []

    def change() -> None:
        gone.append(controller.delete_job(job, actor=p.name, reason=reason, role=p.role.label))

    out = await write(Attempt(controller, p, "job.delete", job, reason), change)
    return JobDeleted(**out.model_dump(), gpus=len(gone[0].uuids), nodes=len(gone[0].nodes))
