"""The admin API fuzzed against its own OpenAPI document with schemathesis (test_api_schema,
test_jobs_api): the checks every response must pass, and one operation fuzzed."""

from __future__ import annotations

import os
from typing import Any

from hypothesis import HealthCheck, given, settings
from schemathesis import Case, GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.schemas import APIOperation
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = int(os.environ.get("POWERD_SCHEMATHESIS_EXAMPLES", "15"))


CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_headers_conformance,
    response_schema_conformance,
]


def fuzz(
    operation: APIOperation,
    mode: GenerationMode,
    url: str,
    headers: dict[str, str],
    checks: list[Any],
) -> None:
    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    def call(case: Case) -> None:
        case.call_and_validate(base_url=url, headers=headers, checks=checks)

    call()
