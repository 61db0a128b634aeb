"""Why a cap: explanations read off what the tick engine computed (controller/why.py), and
their storage with each stored cap change, on SQLite and PostgreSQL."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support.honest import NODES, HonestNode
from support.honest import policy_dict as honest_policy_dict
from support.pg import BACKENDS, pg_database

from powerd.clock import ManualClock
from powerd.controller.report import TickReport
from powerd.controller.tick import TickEngine
from powerd.controller.why import tightest_groups
from powerd.policy import parse_policy
from powerd.safety import SafePlan
from powerd.store import Store, StoreWriter, WriterLimits, upgrade
from powerd.store.reasons import reason_doc

WALL0 = 1_700_000_000.0


def policy_dict(*args: Any, **kwargs: Any) -> dict[str, Any]:
    """The honest site's policy with demand from the last sample (`control.demand.window_s:
    0`): these tests read the explanations of GPUs held back by their cap, which then want
    their maximum at once (docs/allocator.md, "Demand")."""
    data = honest_policy_dict(*args, **kwargs)
    data.setdefault("control", {})["demand"] = {"window_s": 0.0}
    return data


class Site:
    """The honest site (tests/honest.py) driven tick by tick; `mute` nodes do not ack."""

    def __init__(self, policy: dict[str, Any]) -> None:
        self.engine = TickEngine(parse_policy(policy))
        self.nodes = {n: HonestNode(n) for n in NODES}
        self.t = 0
        self.mute: set[str] = set()  # these nodes' agents do not ack
        self.silent: set[str] = set()  # these nodes send no telemetry

    def tick(self) -> tuple[TickReport, SafePlan]:
        now, wall = float(self.t), WALL0 + self.t
        self.t += 1
        for name, node in self.nodes.items():
            if name not in self.silent:
                assert self.engine.on_telemetry(node.sample(wall), now)
        report, plan = self.engine.step(now, wall)
        for cmd in plan.commands:
            if cmd.node in self.mute:
                continue
            ack = self.nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
            if ack is not None:
                assert self.engine.on_ack(cmd.node, ack)
        return report, plan

    def run(self, ticks: int) -> TickReport:
        for _ in range(ticks):
            report, _ = self.tick()
        return report

    def why(self, report: TickReport, uuid: str) -> dict[str, Any]:
        assert report.why is not None
        doc = report.why.explain_uuid(uuid)
        assert doc is not None
        return doc


def test_the_tightest_budget_is_the_binding_one_with_its_shadow_price() -> None:
    policy = policy_dict()
    policy["facility"]["rows"][0]["racks"][0]["budget_w"] = 2000  # r1, r2 (8 GPUs each) bind
    site = Site(policy)
    report = site.run(6)
    assert report.why is not None
    r1 = site.why(report, "GPU-r1-n1-0")
    assert r1["decided_by"] == ["budget"]
    b = r1["budget"]
    assert b["group"] == "r1" and b["level"] == "rack" and b["budget_w"] == 2000
    assert b["price_per_kw"] > 0 and b["committed_w"] == pytest.approx(2000, abs=1e-3)
    assert r1["target_w"] == pytest.approx(250, abs=1e-3)  # 2000 W over 8 GPUs
    assert r1["sent_w"] == pytest.approx(r1["target_w"]) and r1["planner"] is None
    # The other rack by its own budget; the facility (4000 W of 7000 committed) does not bind.
    r2 = site.why(report, "GPU-r2-n1-0")
    assert r2["budget"]["group"] == "r2" and r2["budget"]["price_per_kw"] > 0
    assert report.why.group_price[report.group_names.index("dc")] == 0.0  # type: ignore[index]
    # The price is the allocator's own: the rack's multiplier, as the solver returned it.
    g = report.group_names.index("r1")
    assert b["price_per_kw"] == report.why.group_price[g]  # type: ignore[index]
    # Vectorised over the fleet, the same tightest group as each explanation names.
    tight = tightest_groups(report.why)
    for i, u in enumerate(report.uuids):
        assert report.group_names[int(tight[i])] == site.why(report, u)["budget"]["group"]
    assert "the budget of r1" in r1["summary"]
    # The sample behind the demand estimate: this tick's, the node's seq.
    d = r1["demand"]
    assert d["sample_seq"] == site.nodes["r1-n1"].seq and d["sample_age_s"] == 0.0
    assert d["power_w"] == pytest.approx(250, abs=1e-3) and d["cap_limited"] is True
    assert d["demand_w"] == 700.0  # cap-limited: its maximum


def test_pinned_and_drained() -> None:
    site = Site(policy_dict())
    site.run(3)
    site.engine.overrides.pins["GPU-r1-n1-0"] = 333.0
    site.engine.overrides.drained.add("r2-n2")
    report = site.run(3)
    pinned = site.why(report, "GPU-r1-n1-0")
    assert pinned["decided_by"] == ["pinned"] and pinned["pin_w"] == 333.0
    assert pinned["target_w"] == pytest.approx(333.0) and pinned["sent_w"] == pytest.approx(333.0)
    assert pinned["bounds"]["lo_w"] == pinned["bounds"]["hi_w"] == pytest.approx(333.0)
    drained = site.why(report, "GPU-r2-n2-3")
    assert drained["decided_by"] == ["drained"] and drained["drained"] is True
    assert drained["pin_w"] is None and drained["sent_w"] == pytest.approx(200.0)
    free = site.why(report, "GPU-r1-n2-0")
    assert free["decided_by"] == ["budget"] and not free["drained"] and free["pin_w"] is None


def test_a_class_floor_holds_a_low_priority_gpu_up() -> None:
    policy = policy_dict()
    policy["classes"]["low"] = {"weight": 0.1, "profile": "p", "floor_w": 450}
    site = Site(policy)
    site.engine.overrides.node_classes["r1-n1"] = "low"
    report = site.run(6)
    low = site.why(report, "GPU-r1-n1-0")
    # The facility's price is above what a watt is worth to the low class: it sits at its
    # floor, held there by the floor against the budget.
    assert low["decided_by"] == ["floor", "budget"]
    assert low["target_w"] == pytest.approx(450, abs=1e-3)
    assert low["class"] == {
        "name": "low",
        "weight": 0.1,
        "floor_w": 450.0,
        "ceiling_w": None,
        "floor_dropped": False,
    }
    assert low["bounds"]["lo_w"] == pytest.approx(450)


def test_slew_limits_a_raise() -> None:
    policy = policy_dict()
    policy["control"]["slew_w"] = 50
    site = Site(policy)
    site.run(2)  # the first ack: caps known at their failsafe 200 W
    report, _ = site.tick()
    doc = site.why(report, "GPU-r1-n1-0")
    assert doc["decided_by"][0] == "slew"
    assert doc["slew"]["limited"] == "up" and doc["slew"]["slew_w"] == 50
    assert doc["target_w"] == pytest.approx(doc["slew"]["from_w"] + 50)
    assert doc["bounds"]["hi_w"] == pytest.approx(doc["target_w"])
    assert "slew limit" in doc["summary"]


def test_a_raise_held_back_names_the_acks_it_waits_for() -> None:
    """r1-n1's GPUs are cut (a low class) and its agent does not ack: the raises the cut
    pays for wait, and their explanation names the group and the unacked cuts."""
    policy = policy_dict()
    policy["classes"]["low"] = {"weight": 0.1, "profile": "p"}
    site = Site(policy)
    site.run(6)
    site.engine.overrides.node_classes["r1-n1"] = "low"
    site.mute.add("r1-n1")
    report, plan = site.tick()
    cut_tick = report.tick
    cut = site.why(report, "GPU-r1-n1-0")
    assert cut["sent_w"] == pytest.approx(cut["target_w"])  # cuts go at once
    assert cut["sent_w"] < 300
    raised = site.why(report, "GPU-r2-n1-0")
    assert raised["decided_by"][-1] == "held_back"
    p = raised["planner"]
    assert p["reason"] == "awaiting_acks" and p["group"] == "dc"
    assert p["held_back_w"] == pytest.approx(raised["target_w"] - raised["sent_w"])
    assert p["held_back_w"] > 1.0
    assert {a["node"] for a in p["awaiting"]} == {"r1-n1"}
    assert {a["since_tick"] for a in p["awaiting"]} == {cut_tick}
    assert all(a["committed_w"] > a["sent_w"] for a in p["awaiting"])
    assert "acks from r1-n1" in raised["summary"]
    # The ack arrives: the next tick raises as wanted, and nothing waits.
    site.mute.clear()
    for cmd in plan.commands:
        if cmd.node == "r1-n1":
            ack = site.nodes["r1-n1"].apply_caps(cmd.tick, cmd.caps_w)
            assert ack is not None and site.engine.on_ack("r1-n1", ack)
    report, _ = site.tick()
    after = site.why(report, "GPU-r2-n1-0")
    assert after["planner"] is None and "held_back" not in after["decided_by"]
    assert after["sent_w"] == pytest.approx(after["target_w"])


def test_a_stale_gpu_is_not_raised_and_says_so() -> None:
    site = Site(policy_dict())
    site.run(4)
    # r2-n2 stops reporting: its samples age past stale_after_s (3 s).
    site.silent.add("r2-n2")
    report = site.run(5)
    doc = site.why(report, "GPU-r2-n2-0")
    assert doc["demand"]["stale"] is True and doc["demand"]["sample_age_s"] > 3.0
    assert doc["decided_by"][0] == "stale"
    assert doc["target_w"] <= doc["demand"]["reported_cap_w"] + 0.5


def test_a_gpus_job_is_named_when_the_fleet_has_one() -> None:
    site = Site(policy_dict())
    report = site.run(2)
    frame = report.why
    assert frame is not None
    assert site.why(report, "GPU-r1-n1-0")["job"] is None  # the engine gives no jobs yet
    jobs = np.full(len(frame.uuids), -1, dtype=np.int64)
    jobs[frame.index["GPU-r1-n1-0"]] = 1
    with_jobs = dataclasses.replace(frame, job_index=jobs, job_names=("a", "train-42"))
    assert with_jobs.explain_uuid("GPU-r1-n1-0")["job"] == "train-42"  # type: ignore[index]
    assert with_jobs.explain_uuid("GPU-r1-n1-1")["job"] is None  # type: ignore[index]


def test_a_failed_solve_explains_the_failsafe_caps() -> None:
    site = Site(policy_dict())
    site.engine.targets.solver = "no-such-solver"  # every allocation raises: failsafe caps
    report = site.run(3)
    assert report.status == "fallback"
    doc = site.why(report, "GPU-r1-n1-0")
    assert doc["decided_by"] == ["fallback"] and doc["status"] == "fallback"
    assert doc["target_w"] == 200.0  # the node's failsafe cap
    assert doc["bounds"]["lo_w"] is None and doc["budget"]["price_per_kw"] is None
    assert doc["summary"].startswith("target 200 W, sent 200 W: the solver failed")


# ---- storage: one explanation per stored cap change, on both backends ----


@pytest.fixture(params=BACKENDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'powerd.db'}"
        upgrade(url)
        s = Store(url)
        yield s
        s.close()
    else:
        with pg_database() as url:
            upgrade(url)
            s = Store(url)
            yield s
            s.close()


def _submit(writer: StoreWriter, report: TickReport, plan: SafePlan) -> None:
    by_node = {cmd.node: dict(cmd.caps_w) for cmd in plan.commands}
    writer.submit_caps(report.tick, report.ts, by_node, report.why)


def test_explanations_are_stored_with_cap_changes_and_read_back_at_a_time(
    store: Store,
) -> None:
    site = Site(policy_dict())
    clock = ManualClock(start=0.0, wall_offset=WALL0)
    writer = StoreWriter(store, limits=WriterLimits(cap_interval_s=0.0), clock=clock)
    reports = []
    for _ in range(4):
        report, plan = site.tick()
        _submit(writer, report, plan)
        reports.append(report)
    site.engine.overrides.pins["GPU-r1-n1-0"] = 333.0
    for _ in range(3):
        report, plan = site.tick()
        _submit(writer, report, plan)
        reports.append(report)
    assert writer.flush()
    uuid = "GPU-r1-n1-0"
    changes = store.cap_changes(uuid)
    # One explanation per stored cap change: same ticks, same caps.
    reasons = [store.cap_reason_at(uuid, c.ts) for c in changes]
    assert [r.tick for r in reasons if r is not None] == [c.tick for c in changes]
    assert all(r is not None and r.sent_w == c.new_w for r, c in zip(reasons, changes, strict=True))
    # Steady caps store nothing new: fewer rows than ticks.
    assert 2 <= len(changes) < len(reports)
    now = store.cap_reason_at(uuid)
    assert now is not None and now.decided_by == "pinned" and now.sent_w == pytest.approx(333.0)
    assert reason_doc(now)["pin_w"] == 333.0 and now.budget_group
    before_pin = store.cap_reason_at(uuid, reports[3].ts)
    assert before_pin is not None and before_pin.decided_by != "pinned"
    # Stored in columns and a small document, read back exactly as it was explained.
    frame = next(r.why for r in reports if r.tick == before_pin.tick)
    assert frame is not None
    assert reason_doc(before_pin) == frame.explain_uuid(uuid)
    assert store.cap_reason_at(uuid, WALL0 - 1) is None
    # Retention: reasons go with the cap changes.
    pruned = store.prune(WALL0 + 8 * 86_400, keep_minutes_days=30, keep_ticks_days=7)
    assert pruned.cap_reasons == pruned.cap_changes > 0
    assert store.cap_reason_at(uuid) is None


def test_explanations_that_fail_cost_only_themselves(store: Store) -> None:
    site = Site(policy_dict())
    clock = ManualClock(start=0.0, wall_offset=WALL0)
    writer = StoreWriter(store, limits=WriterLimits(cap_interval_s=0.0), clock=clock)
    report, plan = site.tick()
    report, plan = site.tick()
    assert report.why is not None
    broken = report.why.__class__(
        **{f: getattr(report.why, f) for f in report.why.__dataclass_fields__}
        | {"targets_w": np.zeros(1)}  # too short: explaining this tick raises
    )
    by_node = {cmd.node: dict(cmd.caps_w) for cmd in plan.commands}
    writer.submit_caps(report.tick, report.ts, by_node, broken)
    assert writer.flush()
    # The cap changes themselves are stored; their explanations are lost, nothing else.
    assert len(store.cap_changes("GPU-r2-n2-3")) == 1
    assert store.cap_reason_at("GPU-r2-n2-3") is None
    site.engine.overrides.pins["GPU-r2-n2-3"] = 300.0
    report, plan = site.tick()
    _submit(writer, report, plan)
    assert writer.flush()
    stored = store.cap_reason_at("GPU-r2-n2-3")
    assert stored is not None and stored.decided_by == "pinned"
