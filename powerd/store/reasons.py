"""An explanation (powerd/controller/why.py) as a `cap_reasons` row, and back.

The numbers an operator asks about most (the caps, the tightest budget, the demand and its
sample, the bounds) get columns of their own; the rest goes in a small JSON document with
absent meaning none (null, false). The one-line summary is not stored: it is made again
from the rest on the way out. That keeps a row at a few hundred bytes (docs/storage.md,
"Cap reasons"), where the API's document is over a kilobyte.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from powerd.controller.why import summary
from powerd.store.tables import CapReason

# (column, section of the explanation or None for its top level, key there)
_COLUMNS = (
    ("sent_w", None, "sent_w"),
    ("target_w", None, "target_w"),
    ("committed_w", None, "committed_w"),
    ("budget_group", "budget", "group"),
    ("budget_w", "budget", "budget_w"),
    ("limit_w", "budget", "limit_w"),
    ("group_committed_w", "budget", "committed_w"),
    ("price_per_kw", "budget", "price_per_kw"),
    ("demand_w", "demand", "demand_w"),
    ("power_w", "demand", "power_w"),
    ("reported_cap_w", "demand", "reported_cap_w"),
    ("sample_age_s", "demand", "sample_age_s"),
    ("sample_seq", "demand", "sample_seq"),
    ("lo_w", "bounds", "lo_w"),
    ("hi_w", "bounds", "hi_w"),
)
# What the JSON document keeps, with the value its absence stands for.
_MORE_TOP = {"job": None, "pin_w": None, "drained": False, "refused": False}
_MORE_TOP |= {"slew": None, "planner": None}
_CLASS = {"name": "", "weight": 1.0, "floor_w": None, "ceiling_w": None, "floor_dropped": False}


def reason_row(cap_row: Mapping[str, Any], doc: Mapping[str, Any]) -> dict[str, Any]:
    """The `cap_reasons` row of one stored cap change (`cap_row`) and its explanation."""
    row: dict[str, Any] = {
        "ts": cap_row["ts"],
        "tick": cap_row["tick"],
        "gpu_uuid": cap_row["gpu_uuid"],
        "node": cap_row["node"],
        "decided_by": ",".join(doc["decided_by"])[:128],
    }
    for column, section, key in _COLUMNS:
        row[column] = (doc if section is None else doc[section])[key]
    more: dict[str, Any] = {
        "status": doc["status"],
        "solver": doc["solver"],
        "level": doc["budget"]["level"],
        "peak_w": doc["demand"]["peak_w"],
        "min_cap_w": doc["bounds"]["min_cap_w"],
        "max_cap_w": doc["bounds"]["max_cap_w"],
        "class": {k: v for k, v in doc["class"].items() if v != _CLASS[k] or k == "name"},
    }
    if doc["demand"]["cap_limited"]:
        more["cap_limited"] = True
    if doc["demand"]["stale"]:
        more["stale"] = True
    more |= {k: doc[k] for k, absent in _MORE_TOP.items() if doc[k] != absent}
    row["more"] = more
    return row


def reason_doc(row: CapReason) -> dict[str, Any]:
    """The explanation a stored row holds, as `explain` made it (summary included)."""
    more = row.more
    doc: dict[str, Any] = {
        "uuid": row.gpu_uuid,
        "node": row.node,
        "tick": row.tick,
        "ts": row.ts,
        "status": more.get("status", ""),
        "solver": more.get("solver", ""),
        "decided_by": [r for r in row.decided_by.split(",") if r],
        "budget": {"level": more.get("level", "facility")},
        "demand": {
            "cap_limited": bool(more.get("cap_limited", False)),
            "peak_w": more.get("peak_w"),
            "stale": bool(more.get("stale", False)),
        },
        "class": _CLASS | more.get("class", {}),
        "bounds": {"min_cap_w": more.get("min_cap_w"), "max_cap_w": more.get("max_cap_w")},
    }
    doc |= {k: more.get(k, absent) for k, absent in _MORE_TOP.items()}
    for column, section, key in _COLUMNS:
        (doc if section is None else doc[section])[key] = getattr(row, column)
    b = doc["budget"]
    limit, committed = b["limit_w"], b["committed_w"]
    b["slack_w"] = None if limit is None or committed is None else limit - committed
    doc["summary"] = summary(doc)
    return doc
