"""Attacks on metered groups (docs/operations.md, "Metered groups"): meters that answer
what no meter should, policies that name meters badly, reloads while readings are in
flight, credentials that change, against the real reader over real HTTP."""

from __future__ import annotations

import json

import pytest
from test_meters import vector

from powerd.controller.meters import MeterRejected, prometheus_watts, redfish_watts


def test_an_integer_too_large_for_a_float_is_rejected_not_raised() -> None:
    """JSON holds integers of any size; one past 1e308 overflowed float() and escaped the
    parsers as an OverflowError (logged with a traceback every poll, never counted)."""
    huge = json.loads("1" + "0" * 400)
    for doc, parse in (
        (vector(huge), prometheus_watts),
        ({"status": "success", "data": {"resultType": "scalar", "result": [1, huge]}},
         prometheus_watts),
        ({"PowerWatts": {"Reading": huge}}, redfish_watts),
    ):  # fmt: skip
        with pytest.raises(MeterRejected) as info:
            parse(doc)
        assert info.value.reason == "absurd"
