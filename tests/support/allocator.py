"""Synthetic policies for the allocator's property tests, parsed once per shape
(test_allocator, test_scope_split)."""

from __future__ import annotations

from functools import lru_cache

from powerd.policy import Policy, parse_policy
from powerd.testing.synthetic import policy_dict


@lru_cache(maxsize=64)
def policy_for(
    shape: tuple[int, int, int, int],
    fractions: tuple[float, float, float, float],
    damping: float,
    slew_w: float | None,
    leftover: str,
) -> Policy:
    data = policy_dict(*shape, fractions=fractions, damping=damping, slew_w=slew_w)
    data["control"]["leftover"] = leftover
    return parse_policy(data, "<synthetic>")
