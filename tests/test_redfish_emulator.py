"""The Redfish BMC and PDU emulator (powerd/testing/redfish.py): sessions and basic auth,
the GPU limits backed by the mock physics, its faults, HTTPS with a test CA, and the DMTF's
own `redfish-service-validator` run against it."""

from __future__ import annotations

import base64
import json
import re
import shutil
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from powerd.backends.mock import Workload
from powerd.clock import ManualClock
from powerd.testing.redfish import (
    ROOT,
    SYSTEM_ID,
    EmulatorServer,
    Faults,
    Json,
    RedfishService,
    Response,
    TestCa,
    gpu_control_uri,
    gpu_sensor_uri,
)

CSDL = Path(__file__).parent / "data" / "redfish-csdl"
GPU1 = f"{ROOT}/Systems/{SYSTEM_ID}/Processors/GPU_SXM_1"
METRICS1 = f"{GPU1}/EnvironmentMetrics"


def basic(user: str, password: str) -> dict[str, str]:
    return {"authorization": "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()}


def set_point(watts: float) -> bytes:
    return json.dumps({"PowerLimitWatts": {"SetPoint": watts}}).encode()


def body(r: Response) -> Json:
    assert isinstance(r.body, dict)
    return r.body


def login(service: RedfishService, password: str = "pw") -> str:
    doc = json.dumps({"UserName": "admin", "Password": password}).encode()
    r = service.handle("POST", f"{ROOT}/SessionService/Sessions", {}, doc)
    assert r.status == 201, r.body
    return r.headers["X-Auth-Token"]


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(100.0)


@pytest.fixture
def hgx(clock: ManualClock) -> RedfishService:
    return RedfishService.hgx(
        8, Workload.steady(650.0), password="pw", clock=clock, meter_overhead_w=400.0
    )


def test_sessions_and_basic_auth(hgx: RedfishService) -> None:
    assert hgx.handle("GET", ROOT, {}, b"").status == 200  # the root needs no log-in
    assert hgx.handle("GET", GPU1, {}, b"").status == 401
    assert hgx.handle("GET", GPU1, basic("admin", "wrong"), b"").status == 401
    assert hgx.handle("GET", GPU1, basic("admin", "pw"), b"").status == 200
    token = login(hgx)
    r = hgx.handle("GET", GPU1, {"x-auth-token": token}, b"")
    assert r.status == 200 and body(r)["ProcessorType"] == "GPU"
    bad = json.dumps({"UserName": "admin", "Password": "nope"}).encode()
    assert hgx.handle("POST", f"{ROOT}/SessionService/Sessions", {}, bad).status == 401
    # Log out: the session's resource is deleted and its token refused from then on.
    sid = hgx.sessions[token]
    r = hgx.handle("DELETE", f"{ROOT}/SessionService/Sessions/{sid}", {"x-auth-token": token}, b"")
    assert r.status == 204
    assert hgx.handle("GET", GPU1, {"x-auth-token": token}, b"").status == 401
    token = login(hgx)
    hgx.drop_sessions()  # a BMC reboot
    assert hgx.handle("GET", GPU1, {"x-auth-token": token}, b"").status == 401


def test_the_tree_names_gpus_and_their_limits(hgx: RedfishService) -> None:
    auth = basic("admin", "pw")
    members = body(hgx.handle("GET", f"{ROOT}/Systems/{SYSTEM_ID}/Processors", auth, b""))
    ids = [m["@odata.id"].rsplit("/", 1)[1] for m in members["Members"]]
    assert ids == [f"GPU_SXM_{i}" for i in range(1, 9)]
    proc = body(hgx.handle("GET", GPU1, auth, b""))
    assert re.fullmatch(
        r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}", proc["UUID"]
    )
    m = body(hgx.handle("GET", METRICS1, auth, b""))
    assert m["PowerLimitWatts"] == {
        "SetPoint": 700.0,
        "AllowableMin": 200.0,
        "AllowableMax": 700.0,
        "DefaultSetPoint": 700.0,
    }
    assert m["PowerWatts"]["Reading"] == pytest.approx(650.0, rel=0.01)


def test_a_patched_limit_changes_what_the_gpu_draws(
    hgx: RedfishService, clock: ManualClock
) -> None:
    auth = basic("admin", "pw")
    r = hgx.handle("PATCH", METRICS1, auth, b'{"PowerLimitWatts": {"SetPoint": 300}}')
    assert r.status == 200 and body(r)["PowerLimitWatts"]["SetPoint"] == 300.0
    clock.advance(5.0)  # 25 lags: the draw has settled under the new limit
    m = body(hgx.handle("GET", METRICS1, auth, b""))
    assert m["PowerLimitWatts"]["SetPoint"] == 300.0
    assert m["PowerWatts"]["Reading"] == pytest.approx(300.0, rel=0.01)
    other = body(hgx.handle("GET", METRICS1.replace("SXM_1", "SXM_2"), auth, b""))
    assert other["PowerWatts"]["Reading"] == pytest.approx(650.0, rel=0.01)
    # The PDU meters the true draw of its GPUs plus its overhead.
    pdu = body(hgx.handle("GET", f"{ROOT}/PowerEquipment/RackPDUs/1/Metrics", auth, b""))
    assert pdu["PowerWatts"]["Reading"] == pytest.approx(300 + 7 * 650 + 400, rel=0.01)


@pytest.mark.parametrize(
    ("patch", "status"),
    [
        (b'{"PowerLimitWatts": {"SetPoint": 150}}', 400),  # below AllowableMin
        (b'{"PowerLimitWatts": {"SetPoint": 701}}', 400),
        (b'{"PowerLimitWatts": {"SetPoint": "300"}}', 400),
        (b'{"PowerLimitWatts": {"SetPoint": 300, "AllowableMax": 900}}', 400),
        (b"not json", 400),
    ],
)
def test_bad_patches_change_nothing(hgx: RedfishService, patch: bytes, status: int) -> None:
    auth = basic("admin", "pw")
    assert hgx.handle("PATCH", METRICS1, auth, patch).status == status
    m = body(hgx.handle("GET", METRICS1, auth, b""))
    assert m["PowerLimitWatts"]["SetPoint"] == 700.0


def test_failing_and_lying_variants(hgx: RedfishService, clock: ManualClock) -> None:
    auth = basic("admin", "pw")
    hgx.faults.patch_status = 403
    assert (
        hgx.handle("PATCH", METRICS1, auth, b'{"PowerLimitWatts": {"SetPoint": 300}}').status == 403
    )
    assert body(hgx.handle("GET", METRICS1, auth, b""))["PowerLimitWatts"]["SetPoint"] == 700.0
    hgx.faults = Faults(lie_limit_w=250.0, lie_draw_factor=0.5)
    assert (
        hgx.handle("PATCH", METRICS1, auth, b'{"PowerLimitWatts": {"SetPoint": 600}}').status == 200
    )
    clock.advance(5.0)
    m = body(hgx.handle("GET", METRICS1, auth, b""))
    assert m["PowerLimitWatts"]["SetPoint"] == 250.0  # what it says
    assert m["PowerWatts"]["Reading"] == pytest.approx(300.0, rel=0.01)  # half of 600
    assert hgx.gpus is not None
    assert hgx.gpus.enforced_limit_w(hgx.gpus.gpus()[0].uuid) == 600.0  # the truth
    hgx.faults = Faults(status=503)
    assert hgx.handle("GET", ROOT, {}, b"").status == 503


def test_controls_variant_serves_limits_as_chassis_controls(clock: ManualClock) -> None:
    """With `limits="controls"` the Processors' EnvironmentMetrics carry the draw but no
    limit; each GPU's limit is a Control of type Power under its chassis, and a PATCH of its
    SetPoint changes what the GPU draws."""
    hgx = RedfishService.hgx(
        8, Workload.steady(650.0), password="pw", clock=clock, limits="controls"
    )
    auth = basic("admin", "pw")
    assert body(hgx.handle("GET", ROOT, auth, b""))["Chassis"] == {"@odata.id": f"{ROOT}/Chassis"}
    chassis = body(hgx.handle("GET", f"{ROOT}/Chassis", auth, b""))
    assert chassis["Members@odata.count"] == 8
    first = body(hgx.handle("GET", chassis["Members"][0]["@odata.id"], auth, b""))
    controls = body(hgx.handle("GET", first["Controls"]["@odata.id"], auth, b""))
    assert [m["@odata.id"] for m in controls["Members"]] == [gpu_control_uri(0)]
    assert "PowerLimitWatts" not in body(hgx.handle("GET", METRICS1, auth, b""))
    c = body(hgx.handle("GET", gpu_control_uri(0), auth, b""))
    assert c["ControlType"] == "Power" and c["PhysicalContext"] == "GPU"
    assert (c["SetPoint"], c["AllowableMin"], c["AllowableMax"]) == (700.0, 200.0, 700.0)
    assert c["RelatedItem"] == [{"@odata.id": GPU1}]
    assert c["Sensor"]["Reading"] == pytest.approx(650.0, rel=0.01)
    assert c["Sensor"]["DataSourceUri"] == gpu_sensor_uri(0)
    r = hgx.handle("PATCH", gpu_control_uri(0), auth, b'{"SetPoint": 300}')
    assert r.status == 200 and body(r)["SetPoint"] == 300.0
    clock.advance(5.0)
    c = body(hgx.handle("GET", gpu_control_uri(0), auth, b""))
    assert c["Sensor"]["Reading"] == pytest.approx(300.0, rel=0.01)
    sensor = body(hgx.handle("GET", gpu_sensor_uri(0), auth, b""))
    assert sensor["Reading"] == c["Sensor"]["Reading"] and sensor["ReadingUnits"] == "W"
    assert body(hgx.handle("GET", gpu_control_uri(1), auth, b""))["SetPoint"] == 700.0
    # The EnvironmentMetrics are not where the limit is set here; bad patches change nothing.
    assert hgx.handle("PATCH", METRICS1, auth, set_point(250)).status == 405
    for bad in (b'{"SetPoint": 150}', b'{"SetPoint": 300, "AllowableMax": 900}', b'{"X": 1}'):
        assert hgx.handle("PATCH", gpu_control_uri(0), auth, bad).status == 400
    assert hgx.handle("GET", f"{ROOT}/Chassis/HGX_GPU_SXM_9", auth, b"").status == 404
    assert hgx.gpus is not None
    assert hgx.gpus.enforced_limit_w(hgx.gpus.gpus()[0].uuid) == 300.0


def test_https_with_the_test_ca(tmp_path: Path) -> None:
    ca = TestCa.make(tmp_path / "ca")
    other = TestCa.make(tmp_path / "other")
    service = RedfishService.hgx(2, password="pw")
    with EmulatorServer([service], ca) as server:
        trusted = ssl.create_default_context(cafile=str(ca.ca_file))
        r = httpx.get(f"{server.url()}{METRICS1}", verify=trusted, auth=("admin", "pw"))
        assert r.status_code == 200 and r.headers["odata-version"] == "4.0"
        assert r.json()["PowerLimitWatts"]["AllowableMax"] == 700.0
        stranger = ssl.create_default_context(cafile=str(other.ca_file))
        with pytest.raises(httpx.ConnectError, match="CERTIFICATE_VERIFY_FAILED"):
            httpx.get(f"{server.url()}{ROOT}", verify=stranger)


def validate(url: str, password: str, logdir: Path, *extra: str) -> tuple[int, dict[str, int], str]:
    """Run the DMTF's validator; its exit status, the summary's counts and its output."""
    beside = Path(sys.executable).parent / "rf_service_validator"  # in the venv, off PATH
    exe = str(beside) if beside.exists() else shutil.which("rf_service_validator")
    assert exe is not None, "redfish-service-validator is in the test extra"
    args = [exe, "--rhost", url, "-u", "admin", "-p", password, "--authtype", "Session"]
    args += ["--schema_directory", str(CSDL), "--skipschema", "--logdir", str(logdir)]
    args += ["--nooemcheck", "--timeout", "10", *extra]
    done = subprocess.run(args, capture_output=True, text=True, timeout=300, check=False)
    out = done.stdout + done.stderr
    # The summary table: | PASS | WARN | FAIL | NOT TESTED | then the counts.
    counts = re.search(r"\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|", out)
    assert counts is not None, out[-3000:]
    names = ("pass", "warn", "fail", "not_tested")
    return done.returncode, dict(zip(names, map(int, counts.groups()), strict=True)), out


@pytest.mark.process
@pytest.mark.slow
@pytest.mark.parametrize("limits", ["processors", "controls"])
def test_the_dmtf_validator_passes_the_emulator(tmp_path: Path, limits: str) -> None:
    ca = TestCa.make(tmp_path / "ca")
    service = RedfishService.hgx(
        8,
        password="pw",
        meter_overhead_w=500.0,
        limits="controls" if limits == "controls" else "processors",
    )
    with EmulatorServer([service], ca) as server:
        rc, counts, out = validate(server.url(), "pw", tmp_path / "logs")
    assert rc == 0 and counts["fail"] == 0 and counts["warn"] == 0, out[-4000:]
    walked = [METRICS1, f"{ROOT}/PowerEquipment/RackPDUs/1/Metrics", f"{ROOT}/SessionService"]
    if limits == "controls":
        walked += [gpu_control_uri(7), gpu_sensor_uri(7), f"{ROOT}/Chassis/HGX_GPU_SXM_8"]
    for path in walked:
        assert f"Validating {path}..." in out  # it walked the whole tree
    assert counts["pass"] >= 300


class _Miswritten(RedfishService):
    """A BMC whose GPU draw is a string: what the validator must catch."""

    def _environment_metrics(self, i: int) -> Json:
        doc: dict[str, Any] = super()._environment_metrics(i)
        doc["PowerWatts"] = {"Reading": "high"}
        return doc


@pytest.mark.process
@pytest.mark.slow
def test_the_validator_would_catch_a_miswritten_resource(tmp_path: Path) -> None:
    ca = TestCa.make(tmp_path / "ca")
    service = _Miswritten(gpus=RedfishService.hgx(1).gpus, password="pw")
    with EmulatorServer([service], ca) as server:
        _, counts, out = validate(
            server.url(), "pw", tmp_path / "logs", "--payload", "Single", METRICS1
        )
    assert counts["fail"] >= 1, out[-4000:]
