"""A Redfish client whose HTTP answers a test writes itself (httpx's own transport for
tests), for what no honest BMC or emulator would answer: bodies that never end, redirects,
links with control characters."""

from __future__ import annotations

from collections.abc import Callable

import httpx

from powerd.bmc.redfish import BmcTrust, RedfishClient


def scripted_client(handler: Callable[[httpx.Request], httpx.Response]) -> RedfishClient:
    """A client of https://bmc.example with basic auth and no retries, every request
    answered by `handler`."""
    return RedfishClient(
        "https://bmc.example",
        "admin",
        "pw",
        trust=BmcTrust(),
        auth="basic",
        retries=0,
        transport=httpx.MockTransport(handler),
    )
