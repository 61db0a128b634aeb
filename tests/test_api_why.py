"""`GET /api/v1/gpus/{uuid}/why` and `powerd why` over real HTTP, on SQLite and PostgreSQL:
the last tick's explanation, the one stored for a past time (`?at=`), and bad input."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.live_api import LiveApi, run, wait_until
from support.pg import BACKENDS, pg_database

from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from powerd.store import WriterLimits

# Every cap move stored (the default keeps one a GPU a minute), written every 0.2 s.
LIMITS = WriterLimits(cap_interval_s=0.0, flush_interval_s=0.2)


@pytest.fixture(params=BACKENDS)
def live(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveApi]:
    if request.param == "sqlite":
        api = LiveApi(tmp_path, limits=LIMITS).start()
        try:
            yield api
        finally:
            api.close()
    else:
        with pg_database() as url:
            api = LiveApi(tmp_path, db_url=url, limits=LIMITS).start()
            try:
                yield api
            finally:
                api.close()


def iso(ts: float) -> str:
    return datetime.fromtimestamp(ts, tz=UTC).isoformat()


def why(c: httpx.Client, uuid: str, at: float | None = None) -> httpx.Response:
    params = {} if at is None else {"at": iso(at)}
    return c.get(f"/api/v1/gpus/{uuid}/why", params=params)


def stored_now(c: httpx.Client, uuid: str) -> dict[str, Any] | None:
    r = why(c, uuid, time.time())
    return r.json() if r.status_code == 200 else None


def test_why_now_and_at_a_past_time(live: LiveApi) -> None:
    with live.client("viewer") as c:
        gpus = c.get("/api/v1/gpus").json()["items"]
        uuid = gpus[0]["uuid"]
        r = why(c, uuid)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert doc["uuid"] == uuid and doc["node"] == gpus[0]["node"]
        assert doc["source"] == "live" and doc["decided_by"]
        items = c.get("/api/v1/groups").json()["items"]
        groups = {g["name"] for g in items}
        assert doc["budget"]["group"] in groups
        # The allocator's shadow prices, per group (8 × 700 W under a 4 kW feed: one binds).
        assert all(g["price_per_kw"] is not None and g["price_per_kw"] >= 0 for g in items)
        assert any(g["price_per_kw"] > 0 for g in items)
        assert doc["class"]["name"] == "training" and doc["job"] is None
        assert doc["summary"].startswith("target ")
        assert doc["demand"]["sample_seq"] is not None

        # Stored with its cap change: answers for a time once the writer has it.
        first = wait_until(lambda: stored_now(c, uuid), "a stored explanation")
        assert first["source"] == "stored" and first["uuid"] == uuid
        before_pin = time.time()

        with live.client("operator") as op:
            r = op.put(f"/api/v1/gpus/{uuid}/pin", json={"watts": 250, "reason": "why test"})
            assert r.status_code == 200, r.text
        wait_until(lambda: why(c, uuid).json()["decided_by"] == ["pinned"], "pinned, live")
        live_doc = why(c, uuid).json()
        assert live_doc["pin_w"] == 250.0 and live_doc["target_w"] == pytest.approx(250.0)
        pinned = wait_until(
            lambda: (d := stored_now(c, uuid)) is not None and d["decided_by"] == ["pinned"] and d,
            "the pinned explanation stored",
        )
        assert pinned["sent_w"] == pytest.approx(250.0) and pinned["ts"] > before_pin

        # Yesterday's question: the explanation in force then, not now.
        past = why(c, uuid, before_pin)
        assert past.status_code == 200, past.text
        then = past.json()
        assert then["source"] == "stored" and then["ts"] <= before_pin
        assert "pinned" not in then["decided_by"] and then["pin_w"] is None

        # Before anything was stored, and unknown GPUs: 404 that says why.
        r = why(c, uuid, 946_684_800.0)  # 2000-01-01
        assert r.status_code == 404 and "no explanation" in r.json()["detail"]
        r = why(c, "GPU-none")
        assert r.status_code == 404 and "unknown GPU 'GPU-none'" in r.json()["detail"]
        assert why(c, "GPU-none", time.time()).status_code == 404

        # Bad input: a uuid no GPU can have, a time without a zone, not a time.
        assert c.get("/api/v1/gpus/-bad/why").status_code == 422
        r = c.get(f"/api/v1/gpus/{uuid}/why", params={"at": "2026-12-01T10:00:00"})
        assert r.status_code == 422 and r.json()["problems"][0]["path"] == "query.at"
        assert c.get(f"/api/v1/gpus/{uuid}/why", params={"at": "yesterday"}).status_code == 422

    with live.client(None) as anon:
        assert why(anon, uuid).status_code == 401


def test_powerd_why_on_the_command_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    live = LiveApi(tmp_path, limits=LIMITS).start()
    try:
        viewer = ["--url", live.url, "--token", live.tokens["viewer"]]
        with live.client("viewer") as c:
            uuid = c.get("/api/v1/gpus").json()["items"][0]["uuid"]
            wait_until(lambda: stored_now(c, uuid), "a stored explanation")
        t = time.time()
        code, out = run(["why", uuid, *viewer])
        assert code == EXIT_OK
        lines = out.splitlines()
        assert lines[0].startswith(f"{uuid} on rack-1-n1, tick ") and "(last tick)" in lines[0]
        assert lines[1].strip().startswith("target ")
        assert any(line.startswith("  decided by: ") for line in lines)
        assert any(line.startswith("  tightest budget: ") for line in lines)
        assert any(line.startswith("  class training (weight 1)") for line in lines)

        code, out = run(["why", uuid, "--at", iso(t), *viewer])
        assert code == EXIT_OK and "(stored cap change)" in out.splitlines()[0]
        code, out = run(["why", uuid, "--json", *viewer])
        assert code == EXIT_OK and json.loads(out)["uuid"] == uuid

        capsys.readouterr()
        assert run(["why", "GPU-none", *viewer])[0] == EXIT_BAD_INPUT
        assert "unknown GPU 'GPU-none'" in capsys.readouterr().err
    finally:
        live.close()
