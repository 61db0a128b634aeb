"""Attacks on the bmc-agent's Controls surface, each against the Redfish emulator over HTTPS
(a lying variant where one is needed): what a broken or hostile BMC answers must never
raise past the backend, never let a GPU enforce more than the agent acks, and never send
our credentials to another host."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Iterator
from contextlib import contextmanager

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from support.bmc import scripted_client

from powerd.backends.base import BackendError
from powerd.backends.mock import Workload
from powerd.bmc.backend import IoLoop, RedfishBackend
from powerd.bmc.redfish import BmcTrust, RedfishClient, RedfishError
from powerd.testing.redfish import (
    EmulatorServer,
    Json,
    RedfishService,
    Response,
    TestCa,
    gpu_control_uri,
)
from powerd.wire import CAP_TOLERANCE_W, MAX_SANE_WATTS, GpuTelemetry

NODE = "bmc-1"


def backend_for(server: EmulatorServer, io: IoLoop, ca: TestCa) -> RedfishBackend:
    client = RedfishClient(
        server.url(), "admin", "pw", trust=BmcTrust(ca_file=ca.ca_file), timeout_s=2.0
    )
    return RedfishBackend(NODE, client, io, max_age_s=0.0)


@contextmanager
def serving(bmc: RedfishService, io: IoLoop, ca: TestCa) -> Iterator[RedfishBackend]:
    """`bmc` served over HTTPS, and a backend for it, closed on the way out."""
    with EmulatorServer([bmc], ca) as server:
        backend = backend_for(server, io, ca)
        try:
            yield backend
        finally:
            backend.close()


def truth(bmc: RedfishService) -> list[float]:
    assert bmc.gpus is not None
    return [bmc.gpus.enforced_limit_w(g.uuid) for g in bmc.gpus.gpus()]


def controls_bmc(cls: type[RedfishService], n: int = 2) -> RedfishService:
    gpus = RedfishService.hgx(n, Workload.steady(650.0), node=NODE).gpus
    return cls(gpus=gpus, password="pw", limits="controls")


# -- a link no URL can hold --------------------------------------------------------------


class _ControlNamedUnsendable(RedfishService):
    """GPU 0's Control names itself with a control character in its `@odata.id`."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        if i == 0:
            doc["@odata.id"] = gpu_control_uri(0) + "\t"
        return doc


class _MemberUnsendable(RedfishService):
    """The Chassis collection lists a member whose link holds a control character."""

    def _chassis_collection(self) -> Json:
        doc = super()._chassis_collection()
        doc["Members"].append({"@odata.id": "/redfish/v1/Chassis/\x00"})
        return doc


def test_a_link_no_url_can_hold_is_a_redfish_error_not_an_exception() -> None:
    """httpx refuses to build a request for a path with a control character
    (`httpx.InvalidURL`, no `HTTPError`): a BMC naming one must fail that request like
    any other bad answer, not raise past the backend (the node's thread would end)."""
    hosts: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        hosts.append(request.url.host)
        return httpx.Response(200, json={})

    async def go() -> None:
        client = scripted_client(handler)
        with pytest.raises(RedfishError, match="not a path"):
            await client.get("/redfish/v1/\tx")
        await client.close()

    asyncio.run(go())
    assert hosts == []


def test_a_member_link_no_url_can_hold_fails_discovery_as_a_backend_error(
    io: IoLoop, ca: TestCa
) -> None:
    bmc = controls_bmc(_MemberUnsendable)
    with serving(bmc, io, ca) as backend, pytest.raises(BackendError):
        backend.discover()


def test_a_control_named_with_an_unsendable_link_is_steered_where_it_was_found(
    io: IoLoop, ca: TestCa
) -> None:
    bmc = controls_bmc(_ControlNamedUnsendable)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        assert len(found) == 2
        assert backend.read(found[0].uuid).cap_w == truth(bmc)[0]
        assert backend.set_power_limit_w(found[0].uuid, 300.0) == 300.0
        assert truth(bmc)[0] == 300.0


# -- a Control naming another ----------------------------------------------------------


class _ControlNamedAsNext(RedfishService):
    """Each GPU's Control (found at its own URI) says it is the next GPU's (`@odata.id`):
    a PATCH sent where the body says would change another GPU's limit."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        assert self.gpus is not None
        doc["@odata.id"] = gpu_control_uri((i + 1) % len(self._gpu_infos))
        return doc


def test_a_control_is_steered_at_the_uri_it_was_found_not_the_one_it_names(
    io: IoLoop, ca: TestCa
) -> None:
    bmc = controls_bmc(_ControlNamedAsNext)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        acked = backend.set_power_limit_w(found[0].uuid, 300.0)
        assert truth(bmc) == [300.0, 700.0]
        assert acked >= truth(bmc)[0]


# -- the PATCH's answer ------------------------------------------------------------------


class _StaleAnswer(RedfishService):
    """A BMC that applies a PATCH after it answered: the answer shows the Control as it
    was before (a raise not yet in it)."""

    def _patch(self, path: str, body: bytes) -> Response:
        i = self._control_of(path)
        before = None if i is None else self._control(i)
        r = super()._patch(path, body)
        return Response(200, before) if r.status == 200 and before is not None else r


class _OtherResourceAnswer(RedfishService):
    """A BMC answering a PATCH with another resource: GPU 1's Control, whatever was set."""

    def _patch(self, path: str, body: bytes) -> Response:
        r = super()._patch(path, body)
        return Response(200, self._control(1)) if r.status == 200 else r


def test_an_answer_below_the_set_point_asked_is_not_acked_below_what_is_enforced(
    io: IoLoop, ca: TestCa
) -> None:
    bmc = controls_bmc(_StaleAnswer)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        cut = backend.set_power_limit_w(found[0].uuid, 300.0)
        assert cut >= truth(bmc)[0] == 300.0  # the old 700 W: more than enforced, safe
        raised = backend.set_power_limit_w(found[0].uuid, 600.0)
        assert truth(bmc)[0] == 600.0
        assert raised >= 600.0  # the answer's 300 W would have the controller count less


def test_an_answer_for_another_resource_is_not_taken_as_the_gpus(io: IoLoop, ca: TestCa) -> None:
    bmc = controls_bmc(_OtherResourceAnswer)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        assert backend.set_power_limit_w(found[1].uuid, 250.0) == 250.0
        # GPU 0 set to 600: the answer is GPU 1's Control, at 250 W
        assert backend.set_power_limit_w(found[0].uuid, 600.0) == 600.0 == truth(bmc)[0]


class _OddAnswer(RedfishService):
    """A BMC whose PATCH answers (200) are odd: `answer` is the body given instead of the
    Control; GETs tell the truth."""

    answer: Json | str | None = None

    def _patch(self, path: str, body: bytes) -> Response:
        r = super()._patch(path, body)
        if r.status != 200:
            return r
        if isinstance(self.answer, dict):
            return Response(200, {**r.body, **self.answer} if isinstance(r.body, dict) else r.body)
        return Response(200, self.answer)


@pytest.mark.parametrize(
    "answer",
    [None, "<html>OK</html>", {"SetPoint": math.nan}, {"SetPoint": -5}, {"SetPoint": 1e308}],
    ids=["no-body", "not-json", "nan", "negative", "1e308"],
)
def test_an_odd_patch_answer_is_read_back_with_a_get(
    io: IoLoop, ca: TestCa, answer: Json | str | None
) -> None:
    """Held: an answer without a body, not JSON, or with a SetPoint the wire refuses is no
    read-back; the GET's is acked."""
    bmc = controls_bmc(_OddAnswer)
    bmc.answer = answer
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        before = bmc.requests["GET"]
        assert backend.set_power_limit_w(found[0].uuid, 450.0) == 450.0 == truth(bmc)[0]
        assert bmc.requests["GET"] - before == 1


class _Vanishing(RedfishService):
    """Controls that answer 404 once `gone` (a BMC whose Controls went away after
    discovery, a firmware update say)."""

    gone = False

    def _chassis_resource(self, path: str) -> Json | None:
        return None if self.gone and "/Controls" in path else super()._chassis_resource(path)

    def _patch(self, path: str, body: bytes) -> Response:
        if self.gone:
            return Response(404, {"error": {"message": "gone"}})
        return super()._patch(path, body)


def test_a_control_gone_after_discovery_fails_its_sets_and_reads_as_lost(
    io: IoLoop, ca: TestCa
) -> None:
    """Held: the GPU is lost (GpuLost, a BackendError), nothing else is raised, and the
    limit the GPU enforces is unchanged."""
    from powerd.backends.base import GpuLost

    bmc = controls_bmc(_Vanishing)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
        bmc.gone = True
        with pytest.raises(GpuLost):
            backend.set_power_limit_w(found[0].uuid, 300.0)
        results = backend.set_power_limits_w([(g.uuid, 300.0) for g in found])
        assert all(isinstance(r, GpuLost) for r in results)
        with pytest.raises(BackendError):
            backend.read(found[0].uuid)
        assert truth(bmc) == [700.0, 700.0]


# -- discovery's numbers -----------------------------------------------------------------


class _DefaultNaN(RedfishService):
    """Controls whose `DefaultSetPoint` is NaN (Python's json reads the bare `NaN`)."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        doc["DefaultSetPoint"] = math.nan
        return doc


class _BadBounds(RedfishService):
    """GPU 0: AllowableMin above AllowableMax; GPU 1: a negative AllowableMin."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        if i == 0:
            doc["AllowableMin"], doc["AllowableMax"] = 700, 200
        elif i == 1:
            doc["AllowableMin"] = -100
        return doc


def test_a_nan_default_is_no_default(io: IoLoop, ca: TestCa) -> None:
    """A NaN default would be in every telemetry message (the wire refuses NaN): the GPU's
    default falls back to its AllowableMax, as when the BMC gives none."""
    bmc = controls_bmc(_DefaultNaN)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
    assert [g.default_cap_w for g in found] == [g.max_cap_w for g in found]
    for g in found:  # the wire takes it (a NaN would fail every telemetry message)
        GpuTelemetry(
            uuid=g.uuid,
            index=g.index,
            name=g.name,
            power_w=0.0,
            energy_j=0.0,
            cap_w=g.max_cap_w,
            min_cap_w=g.min_cap_w,
            max_cap_w=g.max_cap_w,
            default_cap_w=g.default_cap_w,
            temp_c=0.0,
            util_pct=0.0,
            sm_clock_mhz=0.0,
        )


def test_controls_with_bounds_that_cannot_hold_are_not_steered(io: IoLoop, ca: TestCa) -> None:
    bmc = controls_bmc(_BadBounds, n=3)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
    assert [g.uuid for g in found] == [f"GPU-{bmc.processor_uuid(2)}"]


# -- huge collections ---------------------------------------------------------------------


class _TenThousandControls(RedfishService):
    """GPU 0's chassis lists 10,000 Controls: its own, then 9,999 other links (each a
    valid URI, a query apart) to the same Control."""

    def _chassis_resource(self, path: str) -> Json | None:
        doc = super()._chassis_resource(path)
        if doc is not None and path == gpu_control_uri(0).rsplit("/", 1)[0]:
            uri = gpu_control_uri(0)
            doc["Members"] = [{"@odata.id": uri}] + [
                {"@odata.id": f"{uri}?n={k}"} for k in range(1, 10_000)
            ]
        return doc


def test_a_collection_of_ten_thousand_members_is_read_in_part(io: IoLoop, ca: TestCa) -> None:
    """Read whole (10,000 GETs) discovery ran past its bound every time: no GPU of the
    node was ever steered. At most MAX_MEMBERS are read, the GPUs are found."""
    from powerd.bmc.backend import MAX_MEMBERS

    bmc = controls_bmc(_TenThousandControls)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
    assert len(found) == 2
    assert bmc.requests["GET"] < 2 * MAX_MEMBERS + 50  # each Control and its Processor


class _EndlessRelated(RedfishService):
    """GPU 0's Control links 20,000 RelatedItems that are no Processor (each a 404)
    before its GPU's."""

    def _control(self, i: int) -> Json:
        doc = super()._control(i)
        if i == 0:
            base = "/redfish/v1/Systems/HGX_Baseboard_0/Processors/Nothing_"
            doc["RelatedItem"] = [{"@odata.id": f"{base}{k}"} for k in range(20_000)] + doc[
                "RelatedItem"
            ]
        return doc


def test_a_control_linking_endless_related_items_costs_a_few_requests(
    io: IoLoop, ca: TestCa
) -> None:
    """Every RelatedItem was read in turn until a GPU's: 20,000 requests for one Control.
    A few are looked at; past them the Control is a GPU's by its PhysicalContext."""
    bmc = controls_bmc(_EndlessRelated)
    with serving(bmc, io, ca) as backend:
        found = backend.discover()
    assert len(found) == 2
    assert bmc.requests["GET"] < 100


# -- the metrics port --------------------------------------------------------------------


def test_idle_connections_to_the_metrics_port_hold_a_bounded_number_of_threads() -> None:
    """The metrics server starts a thread per connection: connections that never send a
    request held one each, for ever, so a peer could exhaust the process's tasks (then
    no node's thread, nor the shared loop's helpers, could start). At most
    MAX_SCRAPE_CONNECTIONS are served at once, and a scrape works once they are gone."""
    import socket
    import threading
    import time
    import urllib.request

    from prometheus_client import CollectorRegistry

    from powerd.node_metrics import MAX_SCRAPE_CONNECTIONS, start_metrics_server

    server = start_metrics_server(CollectorRegistry(), "127.0.0.1", 0)
    before = threading.active_count()
    idle = [
        socket.create_connection(("127.0.0.1", server.port), timeout=5)
        for _ in range(3 * MAX_SCRAPE_CONNECTIONS)
    ]
    try:
        time.sleep(0.5)  # the server accepts them (and starts what threads it will)
        assert threading.active_count() - before <= MAX_SCRAPE_CONNECTIONS
    finally:
        for s in idle:
            s.close()
    deadline = time.monotonic() + 10
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{server.port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as r:
        assert r.status == 200
    server.close()


# -- the read-back rule, as a property ---------------------------------------------------


class _Answers:
    """A client whose PATCH answers `answer` and whose GET tells `truth` (the limit the
    GPU enforces), counting GETs."""

    def __init__(self, uri: str, answer: Json | None, truth_w: float) -> None:
        self.base_url = "https://bmc.example"
        self.timeout_s = 1.0
        self.retries = 0
        self.uri = uri
        self.answer = answer
        self.truth_w = truth_w
        self.gets = 0

    async def patch(self, path: str, doc: Json) -> Json | None:
        return self.answer

    async def get(self, path: str) -> Json:
        self.gets += 1
        return {"@odata.id": self.uri, "SetPoint": self.truth_w, "Sensor": {"Reading": 100.0}}


watts = st.integers(200, 700).map(float)


@settings(max_examples=200, deadline=None)
@given(
    asked=watts,
    truth_w=watts,
    answer_w=watts | st.sampled_from([math.nan, -1.0, 1e308]),
    named=st.sampled_from(["self", "other", "none"]),
    body=st.booleans(),
)
def test_a_set_never_acks_below_what_the_gpu_enforces_unless_told_what_was_asked(
    asked: float, truth_w: float, answer_w: float, named: str, body: bool
) -> None:
    """Whatever a PATCH answers, the ack is at least the limit the GPU enforces, except
    where the BMC's own answer for that resource says what was asked (or more): then the
    set costs one round trip, and the next sample checks it (the agent's guard)."""
    from powerd.backends.base import GpuInfo
    from powerd.bmc.backend import BmcGpu

    uri = gpu_control_uri(0)
    answer: Json = {"SetPoint": answer_w, "Sensor": {"Reading": 100.0}}
    if named != "none":
        answer["@odata.id"] = uri if named == "self" else gpu_control_uri(1)
    client = _Answers(uri, answer if body else None, truth_w)
    io = IoLoop()
    try:
        backend = RedfishBackend(NODE, client, io, max_age_s=1.0)  # type: ignore[arg-type]
        info = GpuInfo("GPU-0", 0, "GPU", 200.0, 700.0, 700.0)
        gpu = BmcGpu(info, uri, "control")
        backend.found = {info.uuid: gpu}
        acked = backend.set_power_limit_w(info.uuid, asked)
    finally:
        io.close()
    sane = 0 <= answer_w <= MAX_SANE_WATTS  # False for NaN
    trusted = body and named == "self" and sane and answer_w >= asked - CAP_TOLERANCE_W
    if trusted:
        assert client.gets == 0 and acked == answer_w
    else:
        assert client.gets == 1 and acked >= truth_w
