"""The OpenAPI documents of both HTTP APIs, pinned whole: the controller's admin API and the
coordinator's. Generated clients and the CLI read them; a refactor must leave them as they
are, to the byte (key order included: the documents are served in that order). And the
words each API refuses a caller with, which differ between the two.

The snapshots in tests/data/ were generated from the code; when a change to an API is
intended, regenerate them (`python tests/test_api_openapi.py`) and review the diff with the
change. tests/test_api_routes.py pins each operation of the controller's API piece by piece.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
from fastapi import Depends, FastAPI
from prometheus_client import CollectorRegistry
from test_api_routes import build

from powerd.api.app import create_coordinator_app
from powerd.api.deps import CONTROLLER_AUTH, COORDINATOR_AUTH, BearerAuth
from powerd.auth import Role, TokenStore, new_token_entry
from powerd.coordinator.main import Coordinator

DATA = Path(__file__).resolve().parent / "data"
VERSION = "<powerd version>"  # the controller's document names the release: not pinned


def controller_app(tmp_path: Path) -> FastAPI:
    return build(tmp_path, registry=CollectorRegistry()).app


def coordinator_app(tmp_path: Path, entry: str | None = None) -> FastAPI:
    entry = entry or new_token_entry("v", "viewer")[1]
    (tmp_path / "coordinator-tokens.toml").write_text(entry)
    tokens = TokenStore.from_file(tmp_path / "coordinator-tokens.toml")
    # The document is built from the routes alone: no coordinator is asked anything.
    return create_coordinator_app(cast(Coordinator, None), tokens, CollectorRegistry())


def text(doc: dict[str, Any]) -> str:
    """The document as the API serves it, one key a line, in the served order."""
    return json.dumps(doc, indent=1, ensure_ascii=False) + "\n"


def controller_doc(tmp_path: Path) -> str:
    doc = controller_app(tmp_path).openapi()
    return text(doc | {"info": doc["info"] | {"version": VERSION}})


def coordinator_doc(tmp_path: Path) -> str:
    return text(coordinator_app(tmp_path).openapi())


def test_the_controllers_openapi_document_is_unchanged(tmp_path: Path) -> None:
    snapshot = (DATA / "openapi-controller.json").read_text(encoding="utf-8")
    assert controller_doc(tmp_path) == snapshot, "see this file's docstring"


def test_the_coordinators_openapi_document_is_unchanged(tmp_path: Path) -> None:
    snapshot = (DATA / "openapi-coordinator.json").read_text(encoding="utf-8")
    assert coordinator_doc(tmp_path) == snapshot, "see this file's docstring"


CONTROLLER_WORDS = [
    (401, "missing bearer token", "Bearer"),
    (401, "unknown or revoked token", "Bearer"),
    (403, "the operator role is required; 'v' is viewer", None),
]
COORDINATOR_WORDS = [
    (401, "missing or unknown bearer token", None),
    (401, "missing or unknown bearer token", None),
    (403, "the operator role is required", None),
]


@pytest.mark.parametrize(
    ("auth", "words"),
    [(CONTROLLER_AUTH, CONTROLLER_WORDS), (COORDINATOR_AUTH, COORDINATOR_WORDS)],
    ids=["controller", "coordinator"],
)
async def test_each_apis_role_check_keeps_its_words(
    auth: BearerAuth, words: list[tuple[int, str, str | None]]
) -> None:
    """The role check alone, without the gate in front (which answers most 401s itself):
    no token, a token nobody holds, a viewer's token where an operator's is needed."""
    viewer, entry = new_token_entry("v", "viewer")
    app = FastAPI()
    app.state.tokens = TokenStore.from_config(tomllib.loads(entry))

    @app.get("/write", dependencies=[Depends(auth.at_least(Role.OPERATOR))])
    async def write() -> str:
        return "written"

    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        got = []
        for token in (None, "pwd_nobody_holds_this_token", viewer):
            headers = {} if token is None else {"Authorization": f"Bearer {token}"}
            r = await client.get("/write", headers=headers)
            got.append((r.status_code, r.json()["detail"], r.headers.get("www-authenticate")))
    assert got == words


async def test_the_coordinators_api_refuses_in_its_own_words(tmp_path: Path) -> None:
    """Its answers differ from the controller's (tests/test_api_routes.py): a 403 names the
    role needed, not the caller."""
    viewer, viewer_entry = new_token_entry("v", "viewer")
    app = coordinator_app(tmp_path, viewer_entry)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://api") as client:
        body = {"budget_w": 1000, "reason": "grid event"}
        r = await client.put("/api/v1/budgets/site", json=body)
        assert (r.status_code, r.json()["detail"]) == (401, "missing bearer token")
        auth = {"Authorization": f"Bearer {viewer}"}
        r = await client.put("/api/v1/budgets/site", json=body, headers=auth)
        assert (r.status_code, r.json()) == (403, {"detail": "the operator role is required"})
        r = await client.delete("/api/v1/budgets/site?reason=x", headers=auth)
        assert (r.status_code, r.json()) == (403, {"detail": "the operator role is required"})


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        DATA.mkdir(exist_ok=True)
        (DATA / "openapi-controller.json").write_text(controller_doc(Path(tmp)), encoding="utf-8")
        (DATA / "openapi-coordinator.json").write_text(coordinator_doc(Path(tmp)), encoding="utf-8")
