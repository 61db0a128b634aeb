"""Waiting on the store's leases in real time (test_leadership, test_authority)."""

from __future__ import annotations

import asyncio

import pytest

from powerd.store.leases import Leases


async def until_lapsed(leases: Leases) -> None:
    """Wait (10 s at most) until the lease of scope `dc` lapses or is gone."""
    for _ in range(200):
        lease = leases.current("dc")
        if lease is None or lease.lapsed:
            return
        await asyncio.sleep(0.05)
    pytest.fail("the lease never lapsed")
