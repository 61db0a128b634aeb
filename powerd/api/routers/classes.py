"""Workload classes as the allocator steers them: weight, bounds, the profile in force and
what online learning knows (docs/allocator.md, "Profiles learned online")."""

from __future__ import annotations

from fastapi import APIRouter

from powerd.api.bodies import ClassOut, LearningOut
from powerd.api.deps import V1, ControllerDep, Viewer
from powerd.api.errors import AUTH_ERRORS

router = APIRouter(prefix=V1, tags=["classes"])


@router.get("/classes", response_model=list[ClassOut], responses=AUTH_ERRORS)
async def classes(_: Viewer, controller: ControllerDep) -> list[ClassOut]:
    """Every class of the policy with the curve the allocator steers it by now: the
    policy's profile, or the one learned from reported perf once the data support it."""
    engine = controller.engine
    policy = engine.policy
    table = engine.targets.classes
    learner = engine.targets.learner
    states = {s.key: s for s in learner.states()} if learner is not None else {}
    out = []
    for c, name in enumerate(table.names):
        spec = policy.classes[name]
        prof = table.profiles[c]
        st = states.get(name)
        out.append(
            ClassOut(
                name=name,
                weight=spec.weight,
                floor_w=spec.floor_w,
                ceiling_w=spec.ceiling_w,
                profile=spec.profile,
                profile_in_use="learned" if st is not None and st.in_use else "policy",
                points=[
                    (x, y)
                    for x, y in zip(prof.power_w.tolist(), prof.throughput.tolist(), strict=True)
                ],
                learning=None
                if st is None
                else LearningOut(
                    enabled=st.enabled,
                    in_use=st.in_use,
                    reason=st.reason,
                    samples=st.samples,
                    bins=st.bins,
                    span_w=st.span_w,
                    fit_error=st.fit_error,
                    learned_points=[tuple(p) for p in st.points],
                    fitted_at=st.fitted_at,
                ),
            )
        )
    return out
