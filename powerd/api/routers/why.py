"""Why a GPU has its cap: the last tick's explanation from memory, or the one stored with
the cap change in force at a past time (`?at=`), from the store (docs/api.md, "Why a cap")."""

from __future__ import annotations

import asyncio
from typing import Annotated

from fastapi import APIRouter, Path, Query
from pydantic import AwareDatetime

from powerd.api.bodies import WhyOut
from powerd.api.deps import V1, ControllerDep, Viewer, store_or_503
from powerd.api.errors import AUTH_ERRORS, error_doc, rejected
from powerd.store.reasons import reason_doc
from powerd.wire import UUID_PATTERN

router = APIRouter(prefix=V1, tags=["fleet"])


@router.get(
    "/gpus/{uuid}/why",
    response_model=WhyOut,
    responses={
        **AUTH_ERRORS,
        404: error_doc("Unknown GPU, or no explanation of its cap (at that time)"),
        503: error_doc("`at` needs the store: none, or the database is unreachable now"),
    },
)
async def why(
    _: Viewer,
    controller: ControllerDep,
    uuid: Annotated[str, Path(pattern=UUID_PATTERN)],
    at: Annotated[
        AwareDatetime | None,
        Query(description="ISO 8601 time with a zone: the explanation in force then."),
    ] = None,
) -> WhyOut:
    """The cap the allocator wanted for this GPU and the cap sent, and what decided them:
    the tightest budget on its path (with its shadow price), its demand estimate and the
    sample behind it, its class's floor and ceiling, job, pin or drain, slew, and any raise
    the safety planner holds back and for whose acknowledgements. Without `at`: the last
    tick; with `at`: the explanation stored with the GPU's cap change in force then."""
    if at is None:
        report = controller.last_tick
        frame = None if report is None else report.why
        doc = None if frame is None else frame.explain_uuid(uuid)
        if doc is not None:
            return WhyOut(**doc, source="live")
        if controller.store is None:
            rejected(404, f"unknown GPU '{uuid}' (not in the last tick)")
        # Not steered now (or the tick failed): the latest stored explanation, if any.
        row = await asyncio.to_thread(controller.store.cap_reason_at, uuid, None)
        if row is None:
            rejected(404, f"unknown GPU '{uuid}': not in the last tick, nothing stored")
        return WhyOut(**reason_doc(row), source="stored")
    store = store_or_503(controller)
    when = at.timestamp()
    row = await asyncio.to_thread(store.cap_reason_at, uuid, when)
    if row is None:
        rejected(
            404,
            f"no explanation of GPU '{uuid}' stored at or before {at.isoformat()} "
            "(unknown GPU, or older than the retention)",
        )
    return WhyOut(**reason_doc(row), source="stored")
