"""Attacks on metered groups (docs/operations.md, "Metered groups"): meters that answer
what no meter should, policies that name meters badly, reloads while readings are in
flight, credentials that change, against the real reader over real HTTP."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from structlog.testing import capture_logs
from support.live_api import POLICY, LiveApi, wait_until
from test_meters import (
    FACILITY_W,
    NODES,
    LyingNode,
    PromServer,
    demand_for,
    fast,
    hungry_site,
    metered_policy,
    run_ticks,
    true_draw,
    vector,
    wait_for,
)

from powerd.clock import SystemClock
from powerd.controller.leadership import Leadership
from powerd.controller.meter_reader import MeterReader, TlsContexts, redfish_setup
from powerd.controller.meters import MeterBook, MeterRejected, prometheus_watts, redfish_watts
from powerd.controller.tick import TickEngine
from powerd.policy import MeterSpec, PolicyError, RedfishMeter, parse_policy
from powerd.store import upgrade
from powerd.store.db import make_engine
from powerd.store.leases import Leases
from powerd.testing.redfish import EmulatorServer, Meter, RedfishService, TestCa


@pytest.fixture
def prom() -> Iterator[PromServer]:
    with PromServer() as s:
        yield s


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


@pytest.mark.parametrize(
    ("source", "url"),
    [
        ("prometheus", "http://prom:9090:9091"),
        ("prometheus", "http://prom:99999"),
        ("prometheus", "http://[::1"),
        ("redfish", "https://pdu:port"),
        ("redfish", "https://:443"),
    ],
)
def test_a_url_no_client_can_use_is_refused_by_its_field(source: str, url: str) -> None:
    """The URL patterns let through ports and hosts httpx refuses (InvalidURL when the
    reader builds its client): the policy says so, by the field."""
    spec: dict[str, Any] = (
        {"prometheus": {"url": url, "query": "q"}}
        if source == "prometheus"
        else {"redfish": {"url": url, "username": "u", "password_file": "/p", "pdu": "1"}}
    )
    with pytest.raises(PolicyError, match=rf"facility.meter.{source}.url"):
        parse_policy(metered_policy(spec))


def test_a_meter_that_cannot_be_built_stops_no_other(prom: PromServer) -> None:
    """One meter whose client cannot be built (InvalidURL) ended its poller with an
    exception, and the TaskGroup cancelled every other meter's: every metered group went
    stale for as long as the policy stayed. Now it fails alone, saying why."""
    good = fast(prometheus={"url": prom.url, "query": "q"})
    bad = good.model_copy(
        update={"prometheus": good.prometheus.model_copy(update={"url": "http://p:1:2"})}
    )
    book = MeterBook()
    reader = MeterReader(book, SystemClock())
    reader.start({"bad": (bad, "facility.rows[0]"), "g": (good, "facility")})
    try:
        wait_for(book, lambda s: s is not None and s.reading_w == 5000.0)
        prom.body = json.dumps(vector("4000")).encode()
        wait_for(book, lambda s: s is not None and s.reading_w == 4000.0)
        failed = book.latest()["bad"]
        assert failed.reading_w is None and failed.error is not None
        assert "facility.rows[0].meter" in failed.error
    finally:
        reader.stop()


def test_a_changed_meter_starts_without_the_old_ones_reading(prom: PromServer) -> None:
    """A policy that points a group at another meter restarts the reader; the book kept
    the old meter's last reading (fresh for `fresh_s` more, taken as the new meter's), and
    a reading in flight could still land after the restart. The new meter starts unread
    (strict until it reads) and the old reader writes nothing more."""
    spec = {"poll_s": 1.0, "timeout_s": 0.8, "fresh_s": 3.0}
    old = MeterSpec.model_validate({"prometheus": {"url": prom.url, "query": "old"}, **spec})
    book = MeterBook()
    reader = MeterReader(book, SystemClock())
    reader.start({"g": (old, "facility"), "same": (old, "facility.rows[0]")})
    retuned = old.model_copy(update={"disagree_w": 900.0})  # the same meter, other alarms
    with PromServer() as other:
        other.body, other.delay_s = json.dumps(vector("5000")).encode(), 0.5
        new = MeterSpec.model_validate({"prometheus": {"url": other.url, "query": "new"}, **spec})
        try:
            wait_for(book, lambda s: s is not None and s.reading_w == 5000.0)
            seq = book.latest()["g"].seq
            prom.body, prom.delay_s = json.dumps(vector("9000")).encode(), 0.3
            asked = len(prom.queries)
            deadline = time.monotonic() + 5
            while len(prom.queries) < asked + 2:  # both old pollers in flight
                assert time.monotonic() < deadline
                time.sleep(0.01)
            reader.stop(wait=False)
            reader.start({"g": (new, "facility"), "same": (retuned, "facility.rows[0]")})
            time.sleep(0.4)  # the old reader's answers are in by now
            moved = book.latest()["g"]
            assert moved.reading_w is None and moved.seq >= seq  # unread; seq goes on
            wait_for(book, lambda s: s is not None and s.reading_w == 5000.0)
            assert other.queries and set(other.queries) == {"new"}
            # The unchanged meter keeps its reading across the restart.
            assert book.latest()["same"].reading_w is not None
        finally:
            reader.stop()


def test_a_group_pointed_at_another_meter_learns_its_overhead_anew() -> None:
    engine, nodes = hungry_site()
    for t in range(6):
        report, _ = run_ticks(engine, nodes, t, meter_w=true_draw(nodes) + 300.0)
    assert report.meters[0].readings == 6
    engine.adopt(parse_policy(metered_policy(disagree_w=400)))  # the same meter: kept
    report, _ = run_ticks(engine, nodes, 6, meter_w=true_draw(nodes) + 300.0)
    assert report.meters[0].readings == 7
    other = {"prometheus": {"url": "http://127.0.0.1:9", "query": "sum(other_pdu_watts)"}}
    engine.adopt(parse_policy(metered_policy(other)))
    report, _ = run_ticks(engine, nodes, 7, meter_w=true_draw(nodes))
    assert report.meters[0].readings == 1
    assert report.meters[0].overhead_learned_w == pytest.approx(0.0, abs=1e-6)


def test_a_rotated_password_is_read_again_once_the_old_one_fails(
    ca: TestCa, tmp_path: Path
) -> None:
    """The password was read once, when the reader built its client: after a rotation
    (the PDU and the file both changed) every poll failed with 401 until a restart. Now a
    failed poll whose files changed rebuilds the client from them; a missing file says so."""
    pdu = RedfishService.pdu(Meter([], overhead_w=2500.0), password="first")
    pw = tmp_path / "pw"
    pw.write_text("first\n")
    book = MeterBook()
    reader = MeterReader(book, SystemClock())
    with EmulatorServer([pdu], ca) as server:
        redfish = {
            "url": server.url(),
            "username": "admin",
            "password_file": str(pw),
            "ca_file": str(ca.ca_file),
            "pdu": "1",
        }
        reader.start({"g": (fast(redfish=redfish), "facility")})
        try:
            wait_for(book, lambda s: s is not None and s.reading_w == 2500.0)
            pw.write_text("second\n")  # rotated in the file first: the session still works
            pdu.meter = Meter([], overhead_w=2600.0)
            wait_for(book, lambda s: s is not None and s.reading_w == 2600.0)
            pdu.password = "second"  # then on the PDU, its sessions ended
            pdu.drop_sessions()
            pdu.meter = Meter([], overhead_w=2700.0)
            wait_for(book, lambda s: s is not None and s.reading_w == 2700.0)
            pw.unlink()  # gone while the session works: it still reads
            pdu.meter = Meter([], overhead_w=2800.0)
            wait_for(book, lambda s: s is not None and s.reading_w == 2800.0)
            pdu.password = "third"  # rotated again with no file to read it from
            pdu.drop_sessions()
            wait_for(
                book,
                lambda s: s is not None and s.error is not None and "password_file" in s.error,
            )
        finally:
            reader.stop()


def frozen_run(frozen_s: float) -> tuple[list[bool], Any, TickEngine]:
    """Nodes reporting half their draw, half-busy, then at second 3 busy; the meter stuck
    at 1500 W (a reading of a quiet night). Per second: the draw above the budget?"""
    engine = TickEngine(parse_policy(metered_policy(frozen_s=frozen_s)))
    nodes = {n: LyingNode(n, 0.5) for n in NODES}
    over = []
    for t in range(30):
        demand_for(nodes, "half" if t < 3 else "all_max", 0)
        over.append(true_draw(nodes) > FACILITY_W + 1e-6)
        report, _ = run_ticks(engine, nodes, t, meter_w=1500.0)
    return over, report, engine


def test_a_meter_frozen_at_an_old_value_is_not_trusted_past_frozen_s() -> None:
    """A PDU whose firmware stopped measuring, or a Prometheus query whose target stopped
    being scraped (the last sample answers for five minutes), answers on time with the
    same value: fresh by arrival, it held the group on the nodes' figures for as long as
    it answered. With nodes under-reporting, the group stayed above its budget. A reading
    unchanged for `frozen_s` is now not fresh: strict budget, `meter_stale` says why."""
    over, _, _ = frozen_run(0)  # the check off: over budget as long as the nodes lie
    assert all(over[3:])
    over, report, engine = frozen_run(8)
    assert any(over) and not any(over[8 + 3 :])  # frozen_s, then the cut and its acks
    assert report.group_limit_w[0] == FACILITY_W
    assert report.meters[0].state == "frozen"
    assert "unchanged at 1,500 W" in engine.alarms.active["meter_stale"]
    nodes = {n: LyingNode(n) for n in NODES}
    # It moves again: fresh, the alarm clears.
    for t in range(40, 43):
        report, _ = run_ticks(engine, nodes, t, meter_w=true_draw(nodes) + t)
    assert report.meters[0].state == "fresh" and "meter_stale" not in engine.alarms.active
    with pytest.raises(PolicyError, match=r"frozen_s \(2\) must be at least 3 × poll_s"):
        parse_policy(metered_policy(frozen_s=2))
    assert parse_policy(metered_policy()).groups[0].meter.frozen_after_s == 60.0


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    steps=st.lists(
        st.tuples(
            st.sampled_from(["half", "all_max", "random"]),
            st.integers(0, 2**31),
            st.booleans(),  # the meter's reading this tick fresh, or already stale
        ),
        min_size=6,
        max_size=14,
    ),
    factor=st.sampled_from([0.3, 0.5, 1.0]),
)
def test_a_meter_flipping_fresh_and_stale_keeps_both_bounds(
    steps: list[tuple[str, int, bool]], factor: float
) -> None:
    """A meter whose every other reading arrives too late (fresh, stale, fresh...): each
    flip to stale cuts to the strict budget, each fresh reading lends anew. With nodes
    that under-report, the draw is never above the rating and above the budget for at
    most the tick between a jump of work and the reading that sees it."""
    policy = parse_policy(metered_policy())
    engine = TickEngine(policy)
    nodes = {n: LyingNode(n, factor) for n in NODES}
    dc = policy.groups[0]
    run = longest = 0
    for t, (kind, seed, fresh) in enumerate(steps):
        demand_for(nodes, kind, seed)
        draw = true_draw(nodes)
        assert draw <= dc.rating_w + 1e-6
        run = run + 1 if draw > dc.budget_w + 1e-6 else 0
        longest = max(longest, run)
        engine.meter_book.put("dc", draw, float(t) if fresh else float(t) - 10.0)
        report, plan = run_ticks(engine, nodes, t, meter_w=None)
        if not fresh:  # the strict budget, less any overhead learned beyond the policy's
            assert 0.9 * dc.budget_w - 1e-6 <= report.group_limit_w[0] <= dc.budget_w
        # Between a cut and its acks the committed caps are the old ones: never past the
        # rating, whatever the flips.
        assert plan.group_settling[0] or plan.group_committed_w[0] <= dc.rating_w + 1e-6
    assert longest <= 1


def test_meters_share_one_tls_context_per_trust_file(ca: TestCa, tmp_path: Path) -> None:
    """Each meter built its own SSL context (a CA bundle loaded: 10-65 ms of the reader's
    one thread), so a thousand meters read nothing for over a minute after a start
    (bench/meter_reader.py). Meters naming the same file now share one; a file that
    changes gets a new one."""
    tls = TlsContexts()
    (tmp_path / "pw").write_text("pw")
    rf = {"url": "https://pdu:443", "username": "u", "password_file": tmp_path / "pw"}
    one = RedfishMeter.model_validate({**rf, "pdu": "1", "ca_file": ca.ca_file})
    two = RedfishMeter.model_validate({**rf, "pdu": "2", "ca_file": ca.ca_file})
    _, t1 = redfish_setup(one, "a", tls)
    _, t2 = redfish_setup(two, "b", tls)
    assert t1.ssl_context() is t2.ssl_context()
    system = tls.get("ca", None)
    assert tls.get("ca", None) is system and system is not t1.ssl_context()
    moved = tmp_path / "ca.pem"
    moved.write_bytes(ca.ca_file.read_bytes())
    first = tls.get("ca", moved)
    assert tls.get("ca", moved) is first
    moved.write_bytes(ca.ca_file.read_bytes() + b"\n")  # rotated
    assert tls.get("ca", moved) is not first


def test_a_reader_whose_thread_ended_is_started_again(tmp_path: Path, prom: PromServer) -> None:
    """The reader's thread can end (an exception past every guard): its groups went stale
    (strict budget, `meter_stale`) and stayed so until the policy changed. The controller
    now starts it again within METER_RESTART_S and says so."""
    meter = (
        f"      meter: {{prometheus: {{url: '{prom.url}', query: 'sum(row_watts)'}}, "
        "poll_s: 0.2, timeout_s: 0.1, fresh_s: 2, disagree_w: 100000}\n"
    )
    policy = POLICY.replace("      budget_w: 3800\n", "      budget_w: 3800\n" + meter, 1)
    api = LiveApi(tmp_path, policy, with_store=False).start()
    try:
        controller = api.controller
        assert controller is not None
        book = controller.engine.meter_book
        wait_until(lambda: book.latest().get("row-1"), "a first reading")
        with capture_logs() as logs:
            controller.meter_reader.stop()  # its thread ends, as if it had died
            seq = book.latest()["row-1"].seq
            wait_until(
                lambda: book.latest()["row-1"].seq > seq + 2, "readings again after the restart"
            )
        assert any(e["event"] == "meter_reader_restarted" for e in logs)
        assert controller.meter_reader.running
    finally:
        api.close()


class DripServer:
    """A query server that answers `mode`: "drip" (a valid answer, one byte every 50 ms),
    "redirect" (302 to another host, with a valid answer as its body) or "html" (a 200
    page of HTML)."""

    def __init__(self, mode: str) -> None:
        body = json.dumps(vector("5000")).encode()

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with contextlib.suppress(OSError):  # the reader gave up
                    if mode == "redirect":
                        self.send_response(302)
                        self.send_header("Location", "http://203.0.113.9/api/v1/query")
                    else:
                        self.send_response(200)
                    kind = "text/html" if mode == "html" else "application/json"
                    self.send_header("Content-Type", kind)
                    page = b"<html>no</html>" if mode == "html" else body
                    self.send_header("Content-Length", str(len(page)))
                    self.end_headers()
                    if mode != "drip":
                        self.wfile.write(page)
                        return
                    for b in page:
                        self.wfile.write(bytes([b]))
                        self.wfile.flush()
                        time.sleep(0.05)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize(
    ("mode", "says"),
    [("drip", "no answer within"), ("redirect", "HTTP 302"), ("html", "not JSON")],
)
def test_a_dripping_redirecting_or_html_meter_never_reads(mode: str, says: str) -> None:
    """Attacks that held: an answer dripped a byte at a time is cut at timeout_s as a
    whole; a redirect is not followed (its body, a valid answer, is not taken); HTML is
    rejected. None gives a reading; each says why."""
    server = DripServer(mode)
    book = MeterBook()
    reader = MeterReader(book, SystemClock())
    reader.start({"g": (fast(prometheus={"url": server.url, "query": "q"}), "facility")})
    try:
        wait_for(book, lambda s: s is not None and s.error is not None and says in s.error)
        assert book.latest()["g"].reading_w is None
    finally:
        reader.stop()
        server.close()


def test_a_wall_clock_step_changes_no_meter_freshness() -> None:
    """Attack that held: readings are stamped and aged on the monotonic clock; the wall
    clock stepping an hour either way changes neither freshness nor the lending."""
    limits = []
    for step_s in (0.0, 3600.0, -3600.0):
        engine, nodes = hungry_site()
        for t in range(6):
            engine.meter_book.put("dc", true_draw(nodes), float(t))
            for node in nodes.values():
                assert engine.on_telemetry(node.sample(1e9 + t), float(t))
            wall = 1e9 + t + (step_s if t >= 3 else 0.0)
            report, plan = engine.step(float(t), wall)
            for cmd in plan.commands:
                ack = nodes[cmd.node].apply_caps(cmd.tick, cmd.caps_w)
                if ack is not None:
                    engine.on_ack(cmd.node, ack)
            assert report.meters[0].state == "fresh"
        limits.append(float(report.group_limit_w[0]))
    assert limits[0] > FACILITY_W and limits[0] == limits[1] == limits[2]


def test_a_meter_reading_absurdly_high_only_tightens_and_alarms() -> None:
    """Attack that held: a meter reading near its max_w (a wrong scale, a wrong series)
    drops the rated group to its budget at once, then at most 10 % below it once the
    overhead it implies is learned (never to the floor), and `meter_disagrees` names it
    after disagree_for_s; nothing raises."""
    engine, nodes = hungry_site(disagree_for_s=2)
    for t in range(3):
        report, _ = run_ticks(engine, nodes, t, meter_w=true_draw(nodes))
    assert report.group_limit_w[0] > FACILITY_W
    for t in range(3, 9):
        report, plan = run_ticks(engine, nodes, t, meter_w=9e8 + t)
        assert 0.9 * FACILITY_W - 1e-6 <= report.group_limit_w[0] <= FACILITY_W
    assert report.group_limit_w[0] == pytest.approx(0.9 * FACILITY_W)
    assert plan.group_committed_w[0] <= FACILITY_W + 1e-6
    assert "dc (meter 900,000,00" in engine.alarms.active["meter_disagrees"]


def test_a_controller_that_stands_by_stops_polling_its_meters(
    tmp_path: Path, prom: PromServer
) -> None:
    """A leader that stood down kept its reader polling every meter (its ticks stopped,
    its reader did not): twice the requests on each PDU, and PDUs serve few sessions. A
    standby now reads no meter; leading again, it starts the reader again."""
    meter = (
        f"      meter: {{prometheus: {{url: '{prom.url}', query: 'sum(row_watts)'}}, "
        "poll_s: 0.2, timeout_s: 0.1, fresh_s: 2, disagree_w: 100000}\n"
    )
    policy = POLICY.replace("      budget_w: 3800\n", "      budget_w: 3800\n" + meter, 1)
    api = LiveApi(tmp_path, policy, with_store=False).start()
    try:
        controller = api.controller
        assert controller is not None
        wait_until(lambda: controller.meter_reader.running and prom.queries, "polling")
        upgrade(f"sqlite:///{tmp_path / 'lease.db'}")
        lease = Leadership(
            Leases(make_engine(f"sqlite:///{tmp_path / 'lease.db'}", timeout_s=0.2)),
            scope="dc",
            holder="ctl-test",
            lease_s=2.0,
            renew_s=0.5,
            mode="lease",
            clock=time.monotonic,
            margin_s=0.25,
        )
        assert not lease.may_command()  # it never took the lease: a standby
        api.call(lambda: setattr(controller, "leadership", lease))
        wait_until(lambda: not controller.meter_reader.running, "the reader stopped")
        asked = len(prom.queries)
        time.sleep(1.0)  # five poll periods
        assert len(prom.queries) <= asked + 1  # at most one poll that was in flight
        api.call(lambda: setattr(controller, "leadership", None))  # leads again
        wait_until(lambda: len(prom.queries) > asked + 3, "polling again")
    finally:
        api.close()


def test_a_meters_error_text_cannot_forge_lines_in_alarms(prom: PromServer) -> None:
    """A Prometheus error message is the server's text: newlines and terminal escapes in it
    went as they were into the book, the API's `error`, the `meter_stale` alarm and the
    logs (a forged line: "\\nrow-2 reads fine"). They are now shown as '?'."""
    prom.status = 400
    prom.body = json.dumps(
        {"status": "error", "error": "bad\nrow-2: fresh, all is well\x1b[2J\r"}
    ).encode()
    book = MeterBook()
    reader = MeterReader(book, SystemClock())
    reader.start({"g": (fast(prometheus={"url": prom.url, "query": "q"}), "facility")})
    try:
        wait_for(book, lambda s: s is not None and s.error is not None)
        error = book.latest()["g"].error
        assert error is not None and "row-2: fresh" in error
        assert error.isprintable()
    finally:
        reader.stop()
