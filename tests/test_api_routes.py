"""The admin API's route table: every operation of the OpenAPI document, its operationId,
tag, inputs, the role it needs and the error bodies it documents, pinned here.

Clients (the CLI, schedulers' job prologs, generated clients) rely on these; an operation
added, removed or changed fails this test. If the change is intended, update OPERATIONS
below and docs/api.md in the same commit. The role each operation needs is checked against
the app itself: no token is a 401, a token of the role below a 403.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from support.live_api import POLICY

from powerd.api.app import create_app
from powerd.auth import TokenStore, new_token_entry
from powerd.clock import ManualClock
from powerd.controller.build import build_controller
from powerd.policy import load_policy_text
from powerd.transport import MemoryBroker

# Documented error statuses → the body's schema, per kind of operation (powerd.api.errors).
READ = {"401": "ErrorOut", "403": "ErrorOut", "422": "ErrorOut"}
STORE_READ = READ | {"503": "ErrorOut"}
WRITE = READ | {
    "400": "ErrorOut",
    "404": "WriteRefused",
    "409": "ErrorOut",
    "413": "ErrorOut",
    "422": "WriteRefused",
    "503": "WriteRefused",
}


@dataclass(frozen=True)
class Op:
    method: str
    path: str
    operation_id: str
    tag: str
    role: str | None  # None: open, no token
    errors: dict[str, str]
    inputs: tuple[str, ...] = ()  # "in:name", required ones with a trailing "*"
    body: str | None = None  # "media type:schema"


V1 = "/api/v1"
OPERATIONS = [
    Op("GET", "/healthz", "healthz_healthz_get", "health", None, {}),
    Op("GET", "/readyz", "readyz_readyz_get", "health", None, {"503": "Readiness"}),
    Op("GET", "/metrics", "metrics_route_metrics_get", "metrics", "viewer", READ),
    Op("GET", f"{V1}/fleet", "fleet_api_v1_fleet_get", "fleet", "viewer", READ),
    Op(
        "GET",
        f"{V1}/leadership",
        "leadership_api_v1_leadership_get",
        "fleet",
        "viewer",
        READ | {"404": "ErrorOut"},
    ),
    Op(
        "GET",
        f"{V1}/groups",
        "groups_api_v1_groups_get",
        "fleet",
        "viewer",
        READ,
        ("query:level", "query:over", "query:limit", "query:offset"),
    ),
    Op(
        "GET",
        f"{V1}/nodes",
        "nodes_api_v1_nodes_get",
        "fleet",
        "viewer",
        READ,
        ("query:row", "query:rack", "query:class", "query:state", "query:limit", "query:offset"),
    ),
    Op(
        "GET",
        f"{V1}/gpus",
        "gpus_api_v1_gpus_get",
        "fleet",
        "viewer",
        READ,
        (
            "query:node",
            "query:row",
            "query:rack",
            "query:class",
            "query:state",
            "query:job",
            "query:limit",
            "query:offset",
        ),
    ),
    Op(
        "GET",
        f"{V1}/allocation",
        "allocation_api_v1_allocation_get",
        "fleet",
        "viewer",
        READ | {"404": "ErrorOut"},
        ("query:node", "query:limit", "query:offset"),
    ),
    Op("GET", f"{V1}/alarms", "alarms_api_v1_alarms_get", "events", "viewer", READ),
    Op(
        "GET",
        f"{V1}/ticks",
        "ticks_api_v1_ticks_get",
        "history",
        "viewer",
        READ,
        ("query:limit", "query:since"),
    ),
    Op(
        "GET",
        f"{V1}/history/facility",
        "facility_history_api_v1_history_facility_get",
        "history",
        "viewer",
        STORE_READ,
        ("query:window_s", "query:points"),
    ),
    Op(
        "GET",
        f"{V1}/events",
        "events_api_v1_events_get",
        "events",
        "viewer",
        STORE_READ,
        ("query:severity", "query:active", "query:kind", "query:limit", "query:offset"),
    ),
    Op(
        "GET",
        f"{V1}/audit",
        "audit_api_v1_audit_get",
        "events",
        "viewer",
        STORE_READ,
        ("query:actor", "query:action", "query:limit", "query:offset"),
    ),
    Op("GET", f"{V1}/overrides", "overrides_api_v1_overrides_get", "overrides", "viewer", READ),
    Op(
        "PUT",
        f"{V1}/budgets/{{group}}",
        "set_budget_api_v1_budgets__group__put",
        "overrides",
        "operator",
        WRITE,
        ("path:group*",),
        "application/json:BudgetIn",
    ),
    Op(
        "DELETE",
        f"{V1}/budgets/{{group}}",
        "clear_budget_api_v1_budgets__group__delete",
        "overrides",
        "operator",
        WRITE,
        ("path:group*", "query:reason*"),
    ),
    Op("GET", f"{V1}/schedules", "schedules_api_v1_schedules_get", "overrides", "viewer", READ),
    Op(
        "POST",
        f"{V1}/budgets/{{group}}/schedule",
        "schedule_budget_api_v1_budgets__group__schedule_post",
        "overrides",
        "operator",
        WRITE,
        ("path:group*",),
        "application/json:ScheduleIn",
    ),
    Op(
        "DELETE",
        f"{V1}/schedules/{{schedule_id}}",
        "cancel_schedule_api_v1_schedules__schedule_id__delete",
        "overrides",
        "operator",
        WRITE,
        ("path:schedule_id*", "query:reason*"),
    ),
    Op(
        "POST",
        f"{V1}/classes/assign",
        "assign_class_api_v1_classes_assign_post",
        "overrides",
        "operator",
        WRITE,
        (),
        "application/json:ClassAssignIn",
    ),
    Op(
        "POST",
        f"{V1}/classes/clear",
        "clear_class_api_v1_classes_clear_post",
        "overrides",
        "operator",
        WRITE,
        (),
        "application/json:ClassClearIn",
    ),
    Op(
        "GET",
        f"{V1}/gpus/{{uuid}}/why",
        "why_api_v1_gpus__uuid__why_get",
        "fleet",
        "viewer",
        STORE_READ | {"404": "ErrorOut"},
        ("path:uuid*", "query:at"),
    ),
    Op(
        "PUT",
        f"{V1}/gpus/{{uuid}}/pin",
        "pin_api_v1_gpus__uuid__pin_put",
        "overrides",
        "operator",
        WRITE,
        ("path:uuid*",),
        "application/json:PinIn",
    ),
    Op(
        "DELETE",
        f"{V1}/gpus/{{uuid}}/pin",
        "unpin_api_v1_gpus__uuid__pin_delete",
        "overrides",
        "operator",
        WRITE,
        ("path:uuid*", "query:reason*"),
    ),
    Op(
        "PUT",
        f"{V1}/nodes/{{node}}/drain",
        "drain_api_v1_nodes__node__drain_put",
        "overrides",
        "operator",
        WRITE,
        ("path:node*",),
        "application/json:ReasonIn",
    ),
    Op(
        "DELETE",
        f"{V1}/nodes/{{node}}/drain",
        "undrain_api_v1_nodes__node__drain_delete",
        "overrides",
        "operator",
        WRITE,
        ("path:node*", "query:reason*"),
    ),
    Op(
        "PUT",
        f"{V1}/handover",
        "hand_over_api_v1_handover_put",
        "overrides",
        "admin",
        WRITE,
        (),
        "application/json:HandoverIn",
    ),
    Op(
        "DELETE",
        f"{V1}/handover",
        "cancel_handover_api_v1_handover_delete",
        "overrides",
        "admin",
        WRITE,
        ("query:reason*",),
    ),
    Op(
        "GET",
        f"{V1}/jobs",
        "jobs_api_v1_jobs_get",
        "jobs",
        "viewer",
        READ,
        ("query:limit", "query:offset"),
    ),
    Op(
        "GET",
        f"{V1}/jobs/{{job}}",
        "get_job_api_v1_jobs__job__get",
        "jobs",
        "viewer",
        READ | {"404": "ErrorOut"},
        ("path:job*",),
    ),
    Op(
        "PUT",
        f"{V1}/jobs/{{job}}",
        "put_job_api_v1_jobs__job__put",
        "jobs",
        "operator",
        WRITE | {"409": "WriteRefused"},
        ("path:job*",),
        "application/json:JobIn",
    ),
    Op(
        "DELETE",
        f"{V1}/jobs/{{job}}",
        "delete_job_api_v1_jobs__job__delete",
        "jobs",
        "operator",
        WRITE | {"409": "WriteRefused"},
        ("path:job*", "query:reason*"),
    ),
    Op("GET", f"{V1}/policy", "policy_api_v1_policy_get", "policy", "viewer", READ),
    Op("GET", f"{V1}/classes", "classes_api_v1_classes_get", "classes", "viewer", READ),
    Op(
        "PUT",
        f"{V1}/policy",
        "replace_policy_api_v1_policy_put",
        "policy",
        "admin",
        WRITE,
        ("query:reason*",),
        "application/yaml:",
    ),
]
ROLES = ["viewer", "operator", "admin"]


@dataclass
class Api:
    app: FastAPI
    tokens: dict[str, str]


def build(tmp_path: Path, **kwargs: Any) -> Api:
    """The app over a controller that is not running: enough for its schema and its auth."""
    tokens: dict[str, str] = {}
    entries = []
    for role in ROLES:
        tokens[role], entry = new_token_entry(f"{role}-user", role)
        entries.append(entry)
    (tmp_path / "tokens.toml").write_text("\n".join(entries))
    controller = build_controller(
        load_policy_text(POLICY, "test-policy.yaml"),
        MemoryBroker().client("controller"),
        ManualClock(),
    )
    app = create_app(controller, TokenStore.from_file(tmp_path / "tokens.toml"), **kwargs)
    return Api(app, tokens)


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Api:
    return build(tmp_path_factory.mktemp("routes"), registry=CollectorRegistry())


def operations(spec: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for path, methods in spec["paths"].items():
        for method, op in methods.items():
            yield method.upper(), path, op


def ref_name(schema: dict[str, Any]) -> str:
    return str(schema.get("$ref", "")).rsplit("/", 1)[-1]


def test_the_schema_has_exactly_the_operations_listed_here(api: Api) -> None:
    listed = {(o.method, o.path) for o in OPERATIONS}
    served = {(m, p) for m, p, _ in operations(api.app.openapi())}
    assert served == listed, (
        f"operations not listed in OPERATIONS: {sorted(served - listed)}; "
        f"listed but not served: {sorted(listed - served)} (see this file's docstring)"
    )


@pytest.mark.parametrize("op", OPERATIONS, ids=lambda o: f"{o.method} {o.path}")
def test_each_operation_keeps_its_id_inputs_auth_and_error_bodies(api: Api, op: Op) -> None:
    doc = api.app.openapi()["paths"][op.path][op.method.lower()]
    assert doc["operationId"] == op.operation_id
    assert doc["tags"] == [op.tag]
    assert ("security" in doc) == (op.role is not None)
    if op.role is not None:
        assert doc["security"] == [{"HTTPBearer": []}]
    inputs = tuple(
        f"{p['in']}:{p['name']}{'*' if p.get('required') else ''}"
        for p in doc.get("parameters", [])
    )
    assert inputs == op.inputs
    body = doc.get("requestBody")
    if op.body is None:
        assert body is None
    else:
        assert body["required"] is True
        ((media, content),) = body["content"].items()
        assert f"{media}:{ref_name(content['schema'])}" == op.body
    errors = {
        status: ref_name(r["content"]["application/json"]["schema"])
        for status, r in doc["responses"].items()
        if status != "200"
    }
    assert errors == op.errors
    assert all(r.get("description") for r in doc["responses"].values())


@pytest.mark.parametrize(
    "op", [o for o in OPERATIONS if o.role is not None], ids=lambda o: f"{o.method} {o.path}"
)
async def test_each_operation_needs_its_role(api: Api, op: Op) -> None:
    # Auth is checked before the request is read or the controller touched, so a role too
    # low is refused on a controller that is not even running.
    path = op.path.replace("{group}", "site").replace("{uuid}", "GPU-x").replace("{node}", "n")
    transport = httpx.ASGITransport(app=api.app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        r = await client.request(op.method, path)
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        assert r.json()["detail"] == "missing bearer token"
        assert op.role is not None
        below = ROLES.index(op.role) - 1
        if below >= 0:
            token = api.tokens[ROLES[below]]
            r = await client.request(op.method, path, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 403, r.text
            assert f"the {op.role} role is required" in r.json()["detail"]


def test_metrics_is_open_when_public_and_absent_without_a_registry(tmp_path: Path) -> None:
    public = build(tmp_path, registry=CollectorRegistry(), metrics_public=True).app.openapi()
    doc = public["paths"]["/metrics"]["get"]
    assert doc["operationId"] == "metrics_public_route_metrics_get"
    assert "security" not in doc and set(doc["responses"]) == {"200"}
    assert "/metrics" not in build(tmp_path).app.openapi()["paths"]
