"""The admin API: FastAPI app served from the controller's own event loop.

Handlers that read or change the controller's memory are `async` and run on that loop, so
they never interleave with a tick half-way (a tick is synchronous from snapshot to plan).
Handlers that only read the database are plain functions: FastAPI runs them in its thread
pool, where a slow database delays nobody else. `/metrics` renders in that pool too.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Annotated, Any, Literal, NoReturn

import numpy as np
import structlog
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CollectorRegistry
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from sqlalchemy.exc import SQLAlchemyError

from powerd import __version__
from powerd.api.models import (
    AlarmOut,
    AllocationOut,
    AuditOut,
    BudgetIn,
    BudgetOut,
    ClassAssignIn,
    ClassClearIn,
    ErrorOut,
    EventOut,
    FleetSummary,
    GpuCap,
    GpuOut,
    GroupUse,
    Liveness,
    NodeOut,
    OverridesOut,
    Page,
    PinIn,
    PolicyOut,
    PolicyReplaced,
    Problem,
    Readiness,
    ReasonIn,
    TickOut,
    WriteOut,
    WriteRefused,
)
from powerd.auth import Principal, Role, TokenStore
from powerd.controller.admin import WriteFailed, WriteOutcome
from powerd.controller.controller import Controller
from powerd.controller.engine import TickReport
from powerd.controller.overrides import NotFound, OverrideError
from powerd.errors import InputError
from powerd.metrics import exposition
from powerd.policy import LEVELS, Policy

log = structlog.get_logger(__name__)

MAX_POLICY_BYTES = 4 * 1024 * 1024
V1 = "/api/v1"

Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=10_000_000)]
ReasonQuery = Annotated[str, Query(min_length=1, max_length=500, pattern=r"\S")]
NameQuery = Annotated[str | None, Query(max_length=128)]


def _err(description: str, model: type[ErrorOut] = ErrorOut) -> dict[str, Any]:
    return {"model": model, "description": description}


# Every operation declares its error bodies (ErrorOut), 422 included: FastAPI would
# otherwise document its own validation error shape, which the handler below replaces.
AUTH_ERRORS: dict[int | str, dict[str, Any]] = {
    401: _err("No bearer token, or an unknown one"),
    403: _err("The token's role may not do this"),
    422: _err("Invalid request; nothing changed"),
}
WRITE_ERRORS: dict[int | str, dict[str, Any]] = {
    **AUTH_ERRORS,
    400: _err("The body is not valid JSON"),
    404: _err("Unknown group, node or GPU; not applied, audited", WriteRefused),
    422: _err("Invalid request; nothing changed (a refused change is audited)", WriteRefused),
    503: _err(
        "The state file could not be written: the change (which does not only lower "
        "power) was rolled back, not applied",
        WriteRefused,
    ),
}
STORE_ERRORS: dict[int | str, dict[str, Any]] = {
    **AUTH_ERRORS,
    503: _err("The controller runs without a store, or the database is unreachable now"),
}


_bearer = HTTPBearer(auto_error=False, description="A token from /etc/powerd/tokens.toml")


def _require(role: Role) -> Callable[..., Awaitable[Principal]]:
    async def check(
        request: Request,
        cred: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
    ) -> Principal:
        if cred is None:
            raise HTTPException(401, "missing bearer token", headers={"WWW-Authenticate": "Bearer"})
        tokens: TokenStore = request.app.state.tokens
        principal = tokens.authenticate(cred.credentials)
        if principal is None:
            log.warning("api_unauthorized", path=request.url.path)
            raise HTTPException(
                401, "unknown or revoked token", headers={"WWW-Authenticate": "Bearer"}
            )
        if principal.role < role:
            raise HTTPException(
                403,
                f"the {role.label} role is required; '{principal.name}' is {principal.role.label}",
            )
        return principal

    return check


Viewer = Annotated[Principal, Depends(_require(Role.VIEWER))]
Operator = Annotated[Principal, Depends(_require(Role.OPERATOR))]
Admin = Annotated[Principal, Depends(_require(Role.ADMIN))]


def finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


@dataclass(frozen=True)
class _Places:
    """Row and rack of every node of one policy."""

    row: dict[str, str]
    rack: dict[str, str]

    @classmethod
    def of(cls, policy: Policy) -> _Places:
        row: dict[str, str] = {}
        rack: dict[str, str] = {}
        groups = policy.groups
        for g in groups:
            if g.level != len(LEVELS) - 1:
                continue
            p = g.parent
            while p >= 0:
                parent = groups[p]
                if LEVELS[parent.level] == "rack":
                    rack[g.name] = parent.name
                elif LEVELS[parent.level] == "row":
                    row[g.name] = parent.name
                p = parent.parent
        return cls(row, rack)


class _Views:
    """Lookups rebuilt only when the policy or the last tick changes, not per request."""

    def __init__(self, controller: Controller) -> None:
        self.c = controller
        self._places: tuple[Policy, _Places] | None = None
        self._tick: tuple[TickReport, dict[str, int], dict[str, int]] | None = None

    def places(self) -> _Places:
        policy = self.c.policy
        if self._places is None or self._places[0] is not policy:
            self._places = (policy, _Places.of(policy))
        return self._places[1]

    def tick_index(self) -> tuple[dict[str, int], dict[str, int]]:
        """(uuid → position in the last tick, group name → position) for the last tick."""
        report = self.c.last_tick
        if report is None:
            return {}, {}
        if self._tick is None or self._tick[0] is not report:
            gpus = {u: i for i, u in enumerate(report.uuids)}
            groups = {n: i for i, n in enumerate(report.group_names)}
            self._tick = (report, gpus, groups)
        return self._tick[1], self._tick[2]


def _group_use(r: TickReport, g: int) -> GroupUse:
    return GroupUse(
        name=r.group_names[g],
        level=LEVELS[int(r.group_levels[g])],
        budget_w=finite(float(r.group_budget_w[g])),
        committed_w=float(r.group_committed_w[g]),
        draw_w=float(r.group_draw_w[g]),
        over=bool(r.group_over[g]),
    )


def _page(items: Sequence[Any], limit: int, offset: int) -> dict[str, Any]:
    return {
        "items": list(items[offset : offset + limit]),
        "total": len(items),
        "limit": limit,
        "offset": offset,
    }


def _nan_none(x: float) -> float | None:
    return None if math.isnan(x) else float(x)


def create_app(
    controller: Controller,
    tokens: TokenStore,
    *,
    registry: CollectorRegistry | None = None,
    metrics_public: bool = False,
) -> FastAPI:
    """The admin API over `controller`. `registry`: what `/metrics` serves (none: 404).

    `/healthz`, `/readyz` are open (for load balancers and systemd-style probes);
    `/metrics` needs a viewer token unless `metrics_public` (Prometheus on a trusted net).
    """
    app = FastAPI(
        title="powerd admin API",
        version=__version__,
        description="Look at the fleet and change the power picture. Every write takes "
        "effect on the next tick and is written to the audit log. Auth: `Authorization: "
        "Bearer <token>`; roles viewer < operator < admin.",
    )
    app.state.tokens = tokens
    views = _Views(controller)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        body = exc.detail if isinstance(exc.detail, dict) else {"detail": str(exc.detail)}
        return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(SQLAlchemyError)
    async def store_error(request: Request, exc: SQLAlchemyError) -> JSONResponse:
        # A read of history while the database is down: say so, not a 500.
        log.warning("api_store_unreachable", path=request.url.path, error=type(exc).__name__)
        body = ErrorOut(detail=f"the database is unreachable now ({type(exc).__name__})")
        return JSONResponse(body.model_dump(), status_code=503)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = [
            Problem(
                path=".".join(str(p) for p in e.get("loc", ()) if p != "body"),
                message=str(e.get("msg", "")),
            )
            for e in exc.errors()
        ]
        body = ErrorOut(detail="invalid request; nothing changed", problems=problems)
        return JSONResponse(body.model_dump(), status_code=422)

    def rejected(status: int, detail: str, problems: Sequence[tuple[str, str]] = ()) -> NoReturn:
        body = ErrorOut(detail=detail, problems=[Problem(path=p, message=m) for p, m in problems])
        raise HTTPException(status, body.model_dump())

    def done(action: str, target: str, outcome: WriteOutcome) -> WriteOut:
        return WriteOut(
            action=action,
            target=target,
            after_tick=controller.tick_no or None,
            applied=outcome.applied,
            durable=outcome.durable,
            audited=outcome.audited,
            detail=outcome.detail,
        )

    # ---- health (no auth) ----

    @app.get("/healthz", response_model=Liveness, tags=["health"])
    async def healthz() -> Liveness:
        """Liveness: the process and its event loop answer."""
        return Liveness()

    @app.get(
        "/readyz",
        response_model=Readiness,
        tags=["health"],
        responses={503: {"model": Readiness, "description": "Not ready"}},
    )
    async def readyz(response: Response) -> Readiness:
        """Readiness: broker connected, store reachable (if any), a recent tick."""
        h = controller.health()
        # The writer reports "connected" only after its first flush; until a write fails,
        # the store counts as reachable (last_error is kept until a write succeeds again).
        store_ok = None if h.store is None else h.store.last_error is None
        ready = h.ready and store_ok is not False
        if not ready:
            response.status_code = 503
        return Readiness(
            ready=ready,
            broker_connected=h.broker_connected,
            store_connected=store_ok,
            store_backlog=None if h.store is None else h.store.backlog,
            store_error=None if h.store is None else h.store.last_error,
            last_tick_age_s=h.last_tick_age_s,
        )

    if registry is not None:
        text_plain: dict[int | str, dict[str, Any]] = {
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
        }

        def metrics_public_route() -> Response:
            return Response(exposition(registry), media_type=CONTENT_TYPE_LATEST)

        def metrics_route(_: Viewer) -> Response:
            return metrics_public_route()

        app.add_api_route(
            "/metrics",
            metrics_public_route if metrics_public else metrics_route,
            methods=["GET"],
            tags=["metrics"],
            response_class=Response,
            responses=text_plain if metrics_public else {**text_plain, **AUTH_ERRORS},
            summary="Prometheus text format",
        )

    # ---- reads from memory ----

    @app.get(f"{V1}/fleet", response_model=FleetSummary, tags=["fleet"], responses=AUTH_ERRORS)
    async def fleet(_: Viewer) -> FleetSummary:
        """Budgets, committed caps, draw and throughput, facility and per row."""
        r = controller.last_tick
        nodes = controller.policy.node_names()
        states: dict[str, int] = {}
        for name in nodes:
            rec = controller.fleet.nodes.get(name)
            state = "unseen" if rec is None or rec.seen_at is None else str(rec.state)
            states[state] = states.get(state, 0) + 1
        return FleetSummary(
            tick=None if r is None else r.tick,
            ts=None if r is None else r.ts,
            status=None if r is None else r.status,
            solver=None if r is None else r.solver,
            solve_ms=None if r is None else r.solve_ms,
            duration_ms=None if r is None else r.duration_ms,
            policy_version=controller.policy_version,
            policy_source=controller.policy.source,
            facility=None if r is None or not r.group_names else _group_use(r, 0),
            rows=[]
            if r is None
            else [_group_use(r, int(g)) for g in np.flatnonzero(r.group_levels == 1)],
            nodes=len(nodes),
            nodes_by_state=states,
            gpus=len(controller.fleet.gpus) if r is None else len(r.uuids),
            gpus_stale=0 if r is None else int(r.stale.sum()),
            throughput=None if r is None else finite(r.throughput_total),
            throughput_by_class={}
            if r is None
            else {k: v for k, v in r.throughput_by_class().items() if math.isfinite(v)},
            alarms=sorted(controller.alarms),
        )

    @app.get(f"{V1}/groups", response_model=Page[GroupUse], tags=["fleet"], responses=AUTH_ERRORS)
    async def groups(
        _: Viewer,
        level: Literal["facility", "row", "rack", "node"] | None = None,
        over: bool | None = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        """Every budgeted group of the last tick (facility, rows, racks, nodes)."""
        r = controller.last_tick
        if r is None:
            return _page([], limit, offset)
        idx = list(range(len(r.group_names)))
        if level is not None:
            idx = np.flatnonzero(r.group_levels == LEVELS.index(level)).tolist()
        if over is not None:
            idx = [g for g in idx if bool(r.group_over[g]) == over]
        items = [_group_use(r, g) for g in idx[offset : offset + limit]]
        return {"items": items, "total": len(idx), "limit": limit, "offset": offset}

    @app.get(f"{V1}/nodes", response_model=Page[NodeOut], tags=["fleet"], responses=AUTH_ERRORS)
    async def nodes(
        _: Viewer,
        row: NameQuery = None,
        rack: NameQuery = None,
        class_: Annotated[str | None, Query(alias="class", max_length=128)] = None,
        state: Literal["unseen", "starting", "steered", "failsafe", "offline", "drained"]
        | None = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        """The policy's nodes, in policy order, with last tick's use; filters combine."""
        places = views.places()
        r = controller.last_tick
        group_at = views.tick_index()[1]
        now = controller.clock.monotonic()
        by_node: dict[str, list[int]] = {}
        if r is not None:
            for i, n in enumerate(r.nodes):
                by_node.setdefault(n, []).append(i)
        out: list[NodeOut] = []
        for name in controller.policy.node_names():
            if row is not None and places.row.get(name) != row:
                continue
            if rack is not None and places.rack.get(name) != rack:
                continue
            rec = controller.fleet.nodes.get(name)
            node_state = "unseen" if rec is None or rec.seen_at is None else str(rec.state)
            drained = name in controller.overrides.drained
            if state is not None and (not drained if state == "drained" else node_state != state):
                continue
            classes = sorted({r.classes[i] for i in by_node.get(name, [])}) if r else []
            if class_ is not None and class_ not in classes:
                continue
            g = group_at.get(name)
            out.append(
                NodeOut(
                    name=name,
                    row=places.row.get(name),
                    rack=places.rack.get(name),
                    state=node_state,
                    drained=drained,
                    assigned_class=controller.overrides.node_classes.get(name),
                    classes=classes,
                    gpus=len(by_node.get(name, [])),
                    last_seen_age_s=None
                    if rec is None or rec.seen_at is None
                    else max(0.0, now - rec.seen_at),
                    budget_w=None if r is None or g is None else finite(float(r.group_budget_w[g])),
                    committed_w=None if r is None or g is None else float(r.group_committed_w[g]),
                    draw_w=None if r is None or g is None else float(r.group_draw_w[g]),
                )
            )
        return _page(out, limit, offset)

    @app.get(f"{V1}/gpus", response_model=Page[GpuOut], tags=["fleet"], responses=AUTH_ERRORS)
    async def gpus(
        _: Viewer,
        node: NameQuery = None,
        row: NameQuery = None,
        rack: NameQuery = None,
        class_: Annotated[str | None, Query(alias="class", max_length=128)] = None,
        state: Literal["ok", "stale", "pinned", "drained"] | None = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        """Every known GPU in the fleet's order (node, then index); filters combine."""
        places = views.places()
        r = controller.last_tick
        gpu_at, _groups = views.tick_index()
        fleet = controller.fleet
        over = controller.overrides
        stale_after = controller.policy.control.stale_after_s
        now = controller.clock.monotonic()
        selected = []
        for uuid in fleet.ordered_uuids():
            rec = fleet.gpus[uuid]
            if node is not None and rec.node != node:
                continue
            if row is not None and places.row.get(rec.node) != row:
                continue
            if rack is not None and places.rack.get(rec.node) != rack:
                continue
            i = gpu_at.get(uuid)
            cls = r.classes[i] if r is not None and i is not None else None
            if class_ is not None and cls != class_:
                continue
            age = max(0.0, now - rec.seen_at)
            stale = age > stale_after or rec.error is not None
            if (
                state is not None
                and not {
                    "ok": not stale,
                    "stale": stale,
                    "pinned": uuid in over.pins,
                    "drained": rec.node in over.drained,
                }[state]
            ):
                continue
            selected.append((rec, i, cls, stale, age))
        out = []
        for rec, i, cls, stale, age in selected[offset : offset + limit]:
            tick = r if r is not None and i is not None else None
            out.append(
                GpuOut(
                    uuid=rec.uuid,
                    node=rec.node,
                    row=places.row.get(rec.node),
                    rack=places.rack.get(rec.node),
                    index=rec.index,
                    name=rec.name,
                    class_=cls,
                    state="stale" if stale else "ok",
                    pinned_w=over.pins.get(rec.uuid),
                    drained=rec.node in over.drained,
                    power_w=rec.power_w,
                    cap_w=rec.cap_w,
                    target_w=None if tick is None else _nan_none(float(tick.targets_w[i])),
                    sent_w=None if tick is None else _nan_none(float(tick.sent_w[i])),
                    committed_w=None if tick is None else _nan_none(float(tick.committed_w[i])),
                    min_cap_w=rec.min_cap_w,
                    max_cap_w=rec.max_cap_w,
                    temp_c=rec.temp_c,
                    util_pct=rec.util_pct,
                    throttle=list(rec.throttle),
                    age_s=age,
                )
            )
        return {"items": out, "total": len(selected), "limit": limit, "offset": offset}

    @app.get(
        f"{V1}/allocation",
        response_model=AllocationOut,
        tags=["fleet"],
        responses={**AUTH_ERRORS, 404: _err("No tick yet")},
    )
    async def allocation(
        _: Viewer,
        node: NameQuery = None,
        limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
        offset: Offset = 0,
    ) -> AllocationOut:
        """The last tick's allocation: target, cap sent and committed cap of every GPU."""
        r = controller.last_tick
        if r is None:
            rejected(404, "no tick yet")
        idx = [i for i, n in enumerate(r.nodes) if node is None or n == node]
        caps = [
            GpuCap(
                uuid=r.uuids[i],
                node=r.nodes[i],
                class_=r.classes[i],
                target_w=float(r.targets_w[i]),
                sent_w=_nan_none(float(r.sent_w[i])),
                committed_w=float(r.committed_w[i]),
            )
            for i in idx[offset : offset + limit]
        ]
        return AllocationOut(
            tick=r.tick,
            ts=r.ts,
            status=r.status,
            solver=r.solver,
            objective=finite(r.objective),
            solve_ms=r.solve_ms,
            caps=Page[GpuCap](items=caps, total=len(idx), limit=limit, offset=offset),
        )

    @app.get(f"{V1}/alarms", response_model=list[AlarmOut], tags=["events"], responses=AUTH_ERRORS)
    async def alarms(_: Viewer) -> list[AlarmOut]:
        """Alarms active now (raised and not cleared)."""
        return [AlarmOut(kind=k, message=m) for k, m in sorted(controller.alarms.items())]

    @app.get(
        f"{V1}/overrides", response_model=OverridesOut, tags=["overrides"], responses=AUTH_ERRORS
    )
    async def overrides(_: Viewer) -> OverridesOut:
        """Temporary budgets, pins, drained nodes and class assignments in force."""
        o = controller.overrides
        policy_budgets = {g.name: g.budget_w for g in controller.policy.groups}
        return OverridesOut(
            budgets=[
                BudgetOut(
                    group=b.group,
                    budget_w=b.budget_w,
                    policy_budget_w=finite(policy_budgets.get(b.group, math.inf)),
                    expires_at=b.expires_at,
                    reason=b.reason,
                    actor=b.actor,
                    created_at=b.created_at,
                )
                for b in o.budgets.values()
            ],
            pins_w=dict(o.pins),
            drained=sorted(o.drained),
            gpu_classes=dict(o.gpu_classes),
            node_classes=dict(o.node_classes),
        )

    # ---- reads from the store (thread pool) ----

    def store_or_503() -> Any:
        if controller.store is None:
            rejected(503, "the controller runs without a store: no history, events or audit log")
        return controller.store

    @app.get(f"{V1}/ticks", response_model=list[TickOut], tags=["history"], responses=AUTH_ERRORS)
    def ticks(
        _: Viewer,
        limit: Limit = 100,
        since: Annotated[float | None, Query(ge=0, le=1e11)] = None,
    ) -> list[TickOut]:
        """Recent ticks, newest first: from the store when there is one (it outlives
        restarts; writes lag a second or so), else from memory."""
        if controller.store is not None:
            return [
                TickOut(
                    tick=t.tick,
                    ts=t.ts,
                    status=t.status,
                    solver=t.solver,
                    solve_ms=t.solve_ms,
                    budget_w=finite(t.budget_w),
                    committed_w=t.committed_w,
                    draw_w=t.draw_w,
                    throughput=t.throughput,
                    gpus=t.n_gpus,
                    gpus_stale=t.n_stale,
                )
                for t in controller.store.recent_ticks(limit=limit, since=since)
            ]
        history = list(controller.history)  # a copy: the loop appends meanwhile
        return [
            TickOut(**(asdict(r) | {"budget_w": finite(r.budget_w)}))  # the same fields
            for r in reversed(history)
            if since is None or r.ts >= since
        ][:limit]

    @app.get(f"{V1}/events", response_model=Page[EventOut], tags=["events"], responses=STORE_ERRORS)
    def events(
        _: Viewer,
        severity: Literal["info", "warning", "alarm"] | None = None,
        active: bool = False,
        kind: NameQuery = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        """Events and alarms, newest first; `active`: alarms not cleared yet."""
        page = store_or_503().events(
            severity=severity, active_only=active, kind=kind, limit=limit, offset=offset
        )
        items = [
            EventOut(
                id=e.id,
                ts=e.ts,
                kind=e.kind,
                severity=e.severity,
                message=e.message,
                data=e.data,
                cleared_at=e.cleared_at,
            )
            for e in page.items
        ]
        return {"items": items, "total": page.total, "limit": limit, "offset": offset}

    @app.get(f"{V1}/audit", response_model=Page[AuditOut], tags=["events"], responses=STORE_ERRORS)
    def audit(
        _: Viewer,
        actor: NameQuery = None,
        action: Annotated[str | None, Query(max_length=64)] = None,
        limit: Limit = 100,
        offset: Offset = 0,
    ) -> dict[str, Any]:
        """The audit log of admin actions, newest first."""
        page = store_or_503().audit_log(actor=actor, action=action, limit=limit, offset=offset)
        items = [
            AuditOut(
                id=a.id,
                ts=a.ts,
                actor=a.actor,
                role=a.role,
                action=a.action,
                target=a.target,
                reason=a.reason,
                payload=a.payload,
                result=a.result,
            )
            for a in page.items
        ]
        return {"items": items, "total": page.total, "limit": limit, "offset": offset}

    @app.get(f"{V1}/policy", response_model=PolicyOut, tags=["policy"], responses=AUTH_ERRORS)
    def policy(_: Viewer) -> PolicyOut:
        """The policy in force, with its text when the store keeps it (or when the API
        replaced it and the database is down)."""
        active = None
        if controller.store is not None and controller.policy_version is not None:
            try:
                active = controller.store.active_policy()
            except SQLAlchemyError as exc:
                log.warning("api_store_unreachable", path="policy", error=type(exc).__name__)
        api = controller.ledger.api_policy
        if active is None and api is not None and controller.policy.source == "api":
            return PolicyOut(
                version=controller.policy_version,
                source="api",
                sha256=api.sha256,
                activated_at=api.ts,
                yaml=api.text,
            )
        return PolicyOut(
            version=controller.policy_version,
            source=controller.policy.source,
            sha256=None if active is None else active.sha256,
            activated_at=None if active is None else active.ts,
            yaml=None if active is None else active.yaml_text,
        )

    # ---- writes: validated and applied on the loop (effective next tick), then made
    # durable and audited by the controller's ledger in worker threads (controller/admin.py)

    async def refuse(
        p: Principal,
        action: str,
        target: str,
        reason: str,
        status: int,
        detail: str,
        problems: Sequence[tuple[str, str]] = (),
    ) -> NoReturn:
        """Answer `status` and audit the refusal: who tried what is as telling as what was
        done. (Requests that fail authentication or schema validation are only logged.)"""
        log.info("admin_action_refused", actor=p.name, action=action, target=target, why=detail)
        audited = await controller.ledger.refused(
            p.name, p.role.label, action, target, reason, detail
        )
        body = WriteRefused(
            detail=detail,
            problems=[Problem(path=path, message=m) for path, m in problems],
            audited=audited,
        )
        raise HTTPException(status, body.model_dump())

    def failed(exc: WriteFailed) -> NoReturn:
        detail = f"not applied: {exc.outcome.detail}"
        body = WriteRefused(detail=detail, audited=exc.outcome.audited)
        raise HTTPException(503, body.model_dump())

    async def write(
        p: Principal,
        action: str,
        target: str,
        reason: str,
        change: Callable[[], object],
        field: str | None = None,
        *,
        lowers_power: bool = False,
    ) -> WriteOut:
        """Apply one change through the controller, which validates it: what it does not know
        is a 404, what it refuses a 422 (naming `field`), and either is audited. Then the
        ledger makes it durable; the answer says what happened (`WriteOut`)."""
        try:
            outcome = await controller.ledger.commit(change, lowers_power=lowers_power)
        except NotFound as exc:
            await refuse(p, action, target, reason, 404, str(exc))
        except OverrideError as exc:
            problems = [(field, str(exc))] if field else []
            await refuse(p, action, target, reason, 422, str(exc), problems)
        except WriteFailed as exc:
            failed(exc)
        return done(action, target, outcome)

    @app.put(
        f"{V1}/budgets/{{group}}",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def set_budget(group: str, body: BudgetIn, p: Operator) -> WriteOut:
        """Lower a group's budget for a while (a grid demand-response event). A temporary
        budget can only lower: the policy's budget is the breaker or contract rating."""
        expires_at = body.expires_at
        if body.ttl_s is not None:
            expires_at = controller.clock.wall() + body.ttl_s
        return await write(
            p,
            "budget.set",
            group,
            body.reason,
            lambda: controller.set_budget(
                group,
                body.budget_w,
                expires_at=expires_at,
                actor=p.name,
                reason=body.reason,
                role=p.role.label,
            ),
            field="budget_w",
            # Applied even when the state file fails, if it lowers what is in force now.
            lowers_power=body.budget_w <= controller.budget_in_force_w(group),
        )

    @app.delete(
        f"{V1}/budgets/{{group}}",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def clear_budget(group: str, reason: ReasonQuery, p: Operator) -> WriteOut:
        """End a temporary budget now (the policy's applies from the next tick)."""
        return await write(
            p,
            "budget.clear",
            group,
            reason,
            lambda: controller.clear_budget(group, actor=p.name, reason=reason, role=p.role.label),
        )

    @app.post(
        f"{V1}/classes/assign",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def assign_class(body: ClassAssignIn, p: Operator) -> WriteOut:
        """Steer GPUs or whole nodes as a workload class (a scheduler's job prolog)."""
        target = ",".join(body.uuids + body.nodes)
        return await write(
            p,
            "class.assign",
            target,
            body.reason,
            lambda: controller.assign_class(
                body.class_,
                uuids=body.uuids,
                nodes=body.nodes,
                actor=p.name,
                reason=body.reason,
                role=p.role.label,
            ),
        )

    @app.post(
        f"{V1}/classes/clear",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def clear_class(body: ClassClearIn, p: Operator) -> WriteOut:
        """Drop class assignments (the job epilog): the workload's own report applies again."""
        return await write(
            p,
            "class.clear",
            ",".join(body.uuids + body.nodes),
            body.reason,
            lambda: controller.clear_class(
                uuids=body.uuids,
                nodes=body.nodes,
                actor=p.name,
                reason=body.reason,
                role=p.role.label,
            ),
        )

    @app.put(
        f"{V1}/gpus/{{uuid}}/pin",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def pin(uuid: str, body: PinIn, p: Operator) -> WriteOut:
        """Hold one GPU at a fixed cap (within its limits) until unpinned."""
        return await write(
            p,
            "gpu.pin",
            uuid,
            body.reason,
            lambda: controller.pin(
                uuid, body.watts, actor=p.name, reason=body.reason, role=p.role.label
            ),
            field="watts",
        )

    @app.delete(
        f"{V1}/gpus/{{uuid}}/pin",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def unpin(uuid: str, reason: ReasonQuery, p: Operator) -> WriteOut:
        return await write(
            p,
            "gpu.unpin",
            uuid,
            reason,
            lambda: controller.unpin(uuid, actor=p.name, reason=reason, role=p.role.label),
        )

    @app.put(
        f"{V1}/nodes/{{node}}/drain",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def drain(node: str, body: ReasonIn, p: Operator) -> WriteOut:
        """Hold every GPU of a node at its minimum (maintenance, a suspect PSU)."""
        return await write(
            p,
            "node.drain",
            node,
            body.reason,
            lambda: controller.drain(node, actor=p.name, reason=body.reason, role=p.role.label),
            lowers_power=True,
        )

    @app.delete(
        f"{V1}/nodes/{{node}}/drain",
        response_model=WriteOut,
        tags=["overrides"],
        responses=WRITE_ERRORS,
    )
    async def undrain(node: str, reason: ReasonQuery, p: Operator) -> WriteOut:
        return await write(
            p,
            "node.undrain",
            node,
            reason,
            lambda: controller.undrain(node, actor=p.name, reason=reason, role=p.role.label),
        )

    @app.put(
        f"{V1}/policy",
        response_model=PolicyReplaced,
        tags=["policy"],
        responses={**WRITE_ERRORS, 413: _err("Policy text too large")},
        openapi_extra={
            "requestBody": {
                "required": True,
                "description": "The whole policy file (docs/policy.md).",
                "content": {"application/yaml": {"schema": {"type": "string"}}},
            }
        },
    )
    async def replace_policy(request: Request, reason: ReasonQuery, p: Admin) -> PolicyReplaced:
        """Replace the policy. It is validated first: a bad one is refused with the same
        problems as `powerd policy check`, and the running policy stays."""
        raw = await request.body()
        if len(raw) > MAX_POLICY_BYTES:
            rejected(413, f"policy text over {MAX_POLICY_BYTES} bytes")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            why = "the policy is not UTF-8 text"
            await refuse(p, "policy.replace", "api", reason, 422, why, [("", why)])
        try:
            outcome = await controller.ledger.replace_policy(
                text, actor=p.name, reason=reason, role=p.role.label
            )
        except InputError as exc:
            why = str(exc).splitlines()[0]
            await refuse(p, "policy.replace", "api", reason, 422, why, exc.problems)
        except WriteFailed as exc:
            failed(exc)
        return PolicyReplaced(
            **done("policy.replace", "api", outcome).model_dump(),
            version=outcome.policy_version,
        )

    return app
