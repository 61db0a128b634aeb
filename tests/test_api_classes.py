"""GET /api/v1/classes over real HTTP: each class's curve in force and what online learning
knows, with the learning metrics, on the live controller of test_api (mock agents whose
GPUs report perf from their true curves)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.live_api import POLICY, LiveApi, wait_until

LEARNING = (
    POLICY
    + """  learn:
    enabled: true
    buffer: 400
    window_s: 20
    refit_ticks: 5
    min_samples: 20
    bin_w: 10
    min_bins: 2
    min_span_w: 20
"""
)


@pytest.fixture
def live_learning(tmp_path: Path) -> Iterator[LiveApi]:
    api = LiveApi(tmp_path, LEARNING, with_store=False).start()
    try:
        yield api
    finally:
        api.close()


def test_classes_show_the_curve_in_force_and_the_learning_state(
    live_learning: LiveApi,
) -> None:
    with live_learning.client("viewer") as c:

        def fitted() -> list[dict[str, Any]] | None:
            body: list[dict[str, Any]] = c.get("/api/v1/classes").json()
            training = next(x for x in body if x["name"] == "training")
            ok = training["learning"]["samples"] >= 20 and training["learning"]["fitted_at"]
            return body if ok else None

        body = wait_until(fitted, "a fit of the training class")
        by_name = {x["name"]: x for x in body}
        assert set(by_name) == {"training", "inference"}
        training = by_name["training"]
        learning = training["learning"]
        assert learning["enabled"] is True and learning["reason"]
        if learning["in_use"]:
            assert training["profile_in_use"] == "learned"
            assert training["points"] == learning["learned_points"]
        else:
            assert training["profile_in_use"] == "policy"
            assert training["points"] == [[200.0, 0.4], [400.0, 0.8], [700.0, 1.0]]
        assert training["weight"] == 1.0 and training["profile"] == "flat"
        assert by_name["inference"]["floor_w"] == 300.0

        def learning_metrics() -> str | None:
            text = c.get("/metrics").text
            return text if "powerd_learn_samples" in text else None

        text = wait_until(learning_metrics, "learning metrics")
    samples = {
        (s.name, s.labels.get("class")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples[("powerd_learn_samples", "training")] > 0
    assert samples[("powerd_learn_in_use", "training")] in (0.0, 1.0)
    with live_learning.client(None) as c:
        assert c.get("/api/v1/classes").status_code == 401


def test_classes_without_learning_have_no_learning_block(tmp_path: Path) -> None:
    api = LiveApi(tmp_path, with_store=False).start()
    try:
        with api.client("viewer") as c:
            body = c.get("/api/v1/classes").json()
        assert {x["name"]: x["learning"] for x in body} == {"training": None, "inference": None}
        assert all(x["profile_in_use"] == "policy" for x in body)
    finally:
        api.close()
