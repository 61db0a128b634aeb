"""Schemathesis against the live API's /openapi.json, over real HTTP: for every operation,
generated requests (valid and invalid) get no 5xx and no response that is off the schema
(status code, content type, headers, body).

Examples per operation and mode are bounded (POWERD_SCHEMATHESIS_EXAMPLES, default 15) to
keep the run inside the normal test suite. (schemathesis' own pytest loader `from_fixture`
does not work with pytest 9, so the test drives its Hypothesis strategies directly.)
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from schemathesis import GenerationMode
from support.live_api import LiveApi
from support.schema import CHECKS, fuzz


@pytest.fixture(scope="module")
def live_api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveApi]:
    api = LiveApi(Path(tmp_path_factory.mktemp("schemathesis"))).start()
    try:
        yield api
    finally:
        api.close()


@pytest.mark.slow  # seconds of CPU: every operation fuzzed
@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_operation_conforms_to_the_schema(live_api: LiveApi, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{live_api.url}/openapi.json")
    # Admin token: every operation is reachable; test_api.py covers the other roles.
    auth = {"Authorization": f"Bearer {live_api.tokens['admin']}"}
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 20
    assert "/api/v1/history/facility" in {o.path for o in operations}  # the live page's chart
    assert "/api/v1/gpus/{uuid}/why" in {op.path for op in operations}
    tested = 0
    for operation in operations:
        inputs = len(operation.query) + len(operation.path_parameters) + len(operation.body)
        if mode is GenerationMode.NEGATIVE and inputs == 0:
            continue  # nothing to make invalid
        # /readyz answers 503 by design while not ready; it is not a server error there.
        checks = CHECKS[1:] if operation.path == "/readyz" else CHECKS
        fuzz(operation, mode, live_api.url, auth, checks)
        tested += 1
    assert tested >= 15
