"""A Redfish BMC and PDU emulator over HTTPS, backed by the mock GPU physics.

What it serves (DMTF schema names, checked by the DMTF's `redfish-service-validator` in
tests/test_redfish_emulator.py; docs/decisions/0005-redfish-client.md):

- `/redfish/v1` (ServiceRoot), `$metadata`, `odata`;
- `SessionService` with `Sessions`: `POST` {UserName, Password} → 201, `X-Auth-Token` and
  `Location`; `DELETE` of the session logs out; HTTP basic auth is accepted too;
- with GPUs: `Systems/HGX_Baseboard_0` → `Processors/GPU_SXM_1..n` (`ProcessorType: GPU`)
  → `EnvironmentMetrics` with `PowerWatts.Reading`, `EnergyJoules.Reading`,
  `TemperatureCelsius.Reading` and `PowerLimitWatts` {`SetPoint`, `AllowableMin`,
  `AllowableMax`, `DefaultSetPoint`}; a `PATCH` of `PowerLimitWatts.SetPoint` sets the
  GPU's limit in the model (`MockBackend` over `SimulatedGpus`), so the draw follows it;
- with GPUs whose limits are `Control` resources (`limits="controls"`): the same Processors,
  whose `EnvironmentMetrics` then carry no `PowerLimitWatts`, and `Chassis/HGX_GPU_SXM_1..n`
  → `Controls/TotalGPU_Power_0` (`ControlType: Power`, `SetPoint`, `AllowableMin/Max`,
  `DefaultSetPoint`, a `Sensor` excerpt whose `Reading` is the draw, `RelatedItem` → the
  Processor) and `Sensors/HGX_GPU_SXM_n_Power_0`; a `PATCH` of the Control's `SetPoint`
  sets the limit in the model;
- with a PDU: `PowerEquipment/RackPDUs/1` → `Metrics` with `PowerWatts.Reading`: the draw
  of the GPUs it meters plus `overhead_w`.

`Faults` make a BMC slow (`latency_s`), failing (`status`, `hang`, `patch_status`) or
lying (`lie_limit_w`, `lie_draw_factor`); they can be changed while it serves. One
`EmulatorServer` serves any number of services, one port each, on one event loop in a
thread (a bench serves hundreds).
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import ipaddress
import json
import random
import secrets
import socket
import threading
import time
import uuid as uuidlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from powerd.backends.base import BackendError, GpuBackend, GpuInfo
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.clock import Clock, SystemClock

ROOT = "/redfish/v1"
SYSTEM_ID = "HGX_Baseboard_0"
PDU_ID = "1"
# Schema versions the emulator's resources claim (Redfish-Publications 2025.4).
SCHEMAS = {
    "ServiceRoot": "v1_20_0",
    "ComputerSystem": "v1_27_0",
    "Processor": "v1_22_0",
    "EnvironmentMetrics": "v1_5_0",
    "SessionService": "v1_2_0",
    "Session": "v1_8_0",
    "PowerEquipment": "v1_2_3",
    "PowerDistribution": "v1_6_0",
    "PowerDistributionMetrics": "v1_4_0",
    "Chassis": "v1_28_0",
    "Control": "v1_7_0",
    "Sensor": "v1_12_0",
}
COLLECTIONS = (
    "ComputerSystemCollection",
    "ProcessorCollection",
    "SessionCollection",
    "PowerDistributionCollection",
    "ChassisCollection",
    "ControlCollection",
    "SensorCollection",
)
COPYRIGHT_FREE_NAME = "powerd Redfish emulator"

Json = dict[str, Any]


def _type(schema: str) -> str:
    return f"#{schema}.{SCHEMAS[schema]}.{schema}"


def _link(path: str) -> Json:
    return {"@odata.id": path}


def gpu_processor_id(i: int) -> str:
    """The Processor Id of GPU i (0-based) on an H100 HGX baseboard: GPU_SXM_1..8."""
    return f"GPU_SXM_{i + 1}"


def gpu_chassis_id(i: int) -> str:
    """The Chassis Id of GPU i (0-based) where limits are Controls: HGX_GPU_SXM_1..8."""
    return f"HGX_{gpu_processor_id(i)}"


GPU_CONTROL_ID = "TotalGPU_Power_0"


def gpu_control_uri(i: int) -> str:
    """The URI of GPU i's power limit `Control` (with `limits="controls"`)."""
    return f"{ROOT}/Chassis/{gpu_chassis_id(i)}/Controls/{GPU_CONTROL_ID}"


def gpu_sensor_uri(i: int) -> str:
    return f"{ROOT}/Chassis/{gpu_chassis_id(i)}/Sensors/{gpu_chassis_id(i)}_Power_0"


@dataclass
class Faults:
    """What is wrong with a BMC; change the fields while it serves.

    - `latency_s`: each answer waits uniformly in [lo, hi] seconds;
    - `status`: every request (log-in included) gets this HTTP status (e.g. 503);
    - `hang`: requests are never answered (the client's timeout decides);
    - `patch_status`: a PATCH of a limit gets this status and changes nothing (e.g. 403);
    - `lie_limit_w`: GETs report this `SetPoint` whatever the GPU enforces;
    - `lie_draw_factor`: GETs report the draw times this.
    """

    latency_s: tuple[float, float] = (0.0, 0.0)
    status: int | None = None
    hang: bool = False
    patch_status: int | None = None
    lie_limit_w: float | None = None
    lie_draw_factor: float = 1.0


@dataclass
class Meter:
    """What a PDU measures: the GPUs of these backends plus a constant overhead."""

    backends: Sequence[GpuBackend]
    overhead_w: float = 0.0


@dataclass
class Response:
    status: int
    body: Json | str | None = None
    headers: dict[str, str] = field(default_factory=dict)


class RedfishService:
    """One BMC (with `gpus`) or PDU (with `meter`), or both: requests in, responses out.

    `gpus`: the node's GPUs as a `MockBackend` (see `RedfishService.hgx`); `limits`: where
    their limits are set, the Processors' `EnvironmentMetrics` or Chassis `Controls`.
    Credentials are one account (`username`, `password`). `requests` counts requests by
    method.
    """

    def __init__(
        self,
        *,
        gpus: MockBackend | None = None,
        meter: Meter | None = None,
        username: str = "admin",
        password: str = "",
        faults: Faults | None = None,
        name: str = COPYRIGHT_FREE_NAME,
        limits: Literal["processors", "controls"] = "processors",
    ) -> None:
        self.gpus = gpus
        self.limits = limits
        self.meter = meter
        self.username = username
        self.password = password or secrets.token_urlsafe(12)
        self.faults = faults or Faults()
        self.name = name
        self.uuid = str(uuidlib.uuid4())
        self.sessions: dict[str, str] = {}  # token → session id
        self._next_session = 1
        self.requests: dict[str, int] = {}
        self._gpu_infos: list[GpuInfo] = [] if gpus is None else gpus.gpus()
        self._lock = threading.Lock()  # tests read and set from other threads

    @classmethod
    def hgx(
        cls,
        n: int = 8,
        workload: Workload | None = None,
        *,
        seed: int = 0,
        node: str = "bmc",
        meter_overhead_w: float | None = None,
        clock: Clock | None = None,
        **kwargs: Any,
    ) -> RedfishService:
        """An HGX node of `n` mock GPUs (training by default) on `clock` (the system's by
        default); with `meter_overhead_w`, also a PDU metering them (plus that overhead)."""
        clock = clock or SystemClock()
        fleet = SimulatedGpus(
            n,
            workload or Workload.training(),
            seed=seed,
            start_s=clock.monotonic(),
            uuid_prefix=f"GPU-{node}",
        )
        backend = MockBackend(fleet, clock)
        meter = None if meter_overhead_w is None else Meter([backend], meter_overhead_w)
        return cls(gpus=backend, meter=meter, **kwargs)

    @classmethod
    def pdu(cls, meter: Meter, **kwargs: Any) -> RedfishService:
        """A rack PDU metering `meter`."""
        return cls(meter=meter, **kwargs)

    def drop_sessions(self) -> None:
        """Forget every session (a BMC reboot, a session timeout): tokens get 401."""
        with self._lock:
            self.sessions.clear()

    def processor_uuid(self, i: int) -> str:
        """The `UUID` Processor i reports: a standard UUID derived from the mock GPU's."""
        assert self.gpus is not None
        return str(uuidlib.uuid5(uuidlib.NAMESPACE_OID, self._gpu_infos[i].uuid))

    # -- requests ------------------------------------------------------------------------

    def handle(self, method: str, path: str, headers: dict[str, str], body: bytes) -> Response:
        """Answer one request (faults other than latency and hang applied here)."""
        with self._lock:
            self.requests[method] = self.requests.get(method, 0) + 1
            if self.faults.status is not None:
                return _error(self.faults.status, "Base.1.0.GeneralError", "injected fault")
            path = path.split("?", 1)[0].rstrip("/") or "/"
            try:
                return self._route(method, path, headers, body)
            except BackendError as exc:
                return _error(500, "Base.1.0.InternalError", str(exc))

    def _route(  # noqa: PLR0911 - a router
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> Response:
        if path == "/redfish":
            return _get_only(method, lambda: {"v1": ROOT + "/"})
        if path == ROOT:
            return _get_only(method, self._service_root)
        if path == f"{ROOT}/$metadata":
            return _get_only(method, self._metadata)
        if path == f"{ROOT}/odata":
            return _get_only(method, self._odata)
        sessions = f"{ROOT}/SessionService/Sessions"
        if path == sessions and method == "POST":
            return self._login(body)
        user = self._authenticated(headers)
        if user is None:
            return Response(
                401,
                _error_body("Base.1.0.NoValidSession", "log in first"),
                {"WWW-Authenticate": 'Basic realm="Redfish"'},
            )
        if path.startswith(sessions + "/") and method == "DELETE":
            return self._logout(path.rsplit("/", 1)[1])
        if method == "PATCH":
            return self._patch(path, body)
        if method not in ("GET", "HEAD"):
            return _error(405, "Base.1.0.OperationNotAllowed", f"{method} {path}")
        resource = self._resource(path)
        if resource is None:
            return _error(404, "Base.1.0.ResourceMissingAtURI", path)
        return Response(200, resource)

    def _authenticated(self, headers: dict[str, str]) -> str | None:
        token = headers.get("x-auth-token")
        if token is not None:
            return self.username if token in self.sessions else None
        auth = headers.get("authorization", "")
        if auth.lower().startswith("basic "):
            try:
                user, _, password = base64.b64decode(auth[6:]).decode().partition(":")
            except (ValueError, UnicodeDecodeError):
                return None
            if secrets.compare_digest(user, self.username) and secrets.compare_digest(
                password, self.password
            ):
                return user
        return None

    def _login(self, body: bytes) -> Response:
        try:
            doc = json.loads(body or b"{}")
        except ValueError:
            return _error(400, "Base.1.0.MalformedJSON", "the body is not JSON")
        if not isinstance(doc, dict):
            return _error(400, "Base.1.0.MalformedJSON", "the body is not an object")
        user, password = str(doc.get("UserName", "")), str(doc.get("Password", ""))
        if not (
            secrets.compare_digest(user, self.username)
            and secrets.compare_digest(password, self.password)
        ):
            return _error(401, "Base.1.0.NoValidSession", "wrong user name or password")
        token = secrets.token_hex(16)
        sid = str(self._next_session)
        self._next_session += 1
        self.sessions[token] = sid
        location = f"{ROOT}/SessionService/Sessions/{sid}"
        return Response(201, self._session(sid), {"X-Auth-Token": token, "Location": location})

    def _logout(self, sid: str) -> Response:
        for token, s in list(self.sessions.items()):
            if s == sid:
                del self.sessions[token]
                return Response(204)
        return _error(404, "Base.1.0.ResourceMissingAtURI", sid)

    def _patch(self, path: str, body: bytes) -> Response:  # noqa: PLR0911 - each refusal
        if self.limits == "controls":
            i = self._control_of(path)
            field, what = None, "SetPoint"
        else:
            i = self._gpu_of(path, "/EnvironmentMetrics")
            field, what = "PowerLimitWatts", "PowerLimitWatts.SetPoint"
        if i is None:
            if self._resource(path) is None:
                return _error(404, "Base.1.0.ResourceMissingAtURI", path)
            return _error(405, "Base.1.0.OperationNotAllowed", f"{path} cannot be changed")
        try:
            doc = json.loads(body or b"{}")
            inner = doc if field is None else doc[field]
            set_point = inner["SetPoint"]
        except (ValueError, KeyError, TypeError):
            return _error(400, "Base.1.0.PropertyMissing", what)
        if set(doc) != {field or "SetPoint"} or set(inner) != {"SetPoint"}:
            return _error(400, "Base.1.0.PropertyNotWritable", f"only {what}")
        if isinstance(set_point, bool) or not isinstance(set_point, int | float):
            return _error(400, "Base.1.0.PropertyValueTypeError", "SetPoint must be a number")
        if self.faults.patch_status is not None:
            return _error(self.faults.patch_status, "Base.1.0.InsufficientPrivilege", "refused")
        assert self.gpus is not None
        info = self._gpu_infos[i]
        if not info.min_cap_w <= set_point <= info.max_cap_w:
            return _error(
                400,
                "Base.1.0.PropertyValueOutOfRange",
                f"SetPoint {set_point} is outside [{info.min_cap_w:g}, {info.max_cap_w:g}]",
            )
        self.gpus.set_power_limit_w(info.uuid, float(set_point))
        if field is None:
            return Response(200, self._control(i))
        return Response(200, self._environment_metrics(i))

    # -- resources -----------------------------------------------------------------------

    def _gpu_of(self, path: str, suffix: str) -> int | None:
        prefix = f"{ROOT}/Systems/{SYSTEM_ID}/Processors/GPU_SXM_"
        if self.gpus is None or not (path.startswith(prefix) and path.endswith(suffix)):
            return None
        number = path[len(prefix) : len(path) - len(suffix)]
        if not number.isdigit() or not 1 <= int(number) <= len(self._gpu_infos):
            return None
        return int(number) - 1

    def _chassis_of(self, path: str) -> tuple[int, str] | None:
        """(GPU i, the rest of the path) of `Chassis/HGX_GPU_SXM_<i+1>[/rest]`, where
        limits are Controls."""
        prefix = f"{ROOT}/Chassis/{gpu_chassis_id(0).removesuffix('1')}"
        if self.gpus is None or self.limits != "controls" or not path.startswith(prefix):
            return None
        number, _, rest = path[len(prefix) :].partition("/")
        if not number.isdigit() or not 1 <= int(number) <= len(self._gpu_infos):
            return None
        i = int(number) - 1
        return (i, rest) if path.startswith(f"{ROOT}/Chassis/{gpu_chassis_id(i)}") else None

    def _control_of(self, path: str) -> int | None:
        found = self._chassis_of(path)
        return found[0] if found is not None and found[1] == f"Controls/{GPU_CONTROL_ID}" else None

    def _resource(self, path: str) -> Json | None:
        fixed: dict[str, Callable[[], Json]] = {
            f"{ROOT}/SessionService": self._session_service,
            f"{ROOT}/SessionService/Sessions": self._session_collection,
        }
        if self.gpus is not None:
            fixed[f"{ROOT}/Systems"] = self._systems
            fixed[f"{ROOT}/Systems/{SYSTEM_ID}"] = self._system
            fixed[f"{ROOT}/Systems/{SYSTEM_ID}/Processors"] = self._processors
            if self.limits == "controls":
                fixed[f"{ROOT}/Chassis"] = self._chassis_collection
        if self.meter is not None:
            fixed[f"{ROOT}/PowerEquipment"] = self._power_equipment
            fixed[f"{ROOT}/PowerEquipment/RackPDUs"] = self._rack_pdus
            fixed[f"{ROOT}/PowerEquipment/RackPDUs/{PDU_ID}"] = self._rack_pdu
            fixed[f"{ROOT}/PowerEquipment/RackPDUs/{PDU_ID}/Metrics"] = self._pdu_metrics
        make = fixed.get(path)
        if make is not None:
            return make()
        if path.startswith(f"{ROOT}/SessionService/Sessions/"):
            sid = path.rsplit("/", 1)[1]
            return self._session(sid) if sid in self.sessions.values() else None
        i = self._gpu_of(path, "/EnvironmentMetrics")
        if i is not None:
            return self._environment_metrics(i)
        i = self._gpu_of(path, "")
        if i is not None:
            return self._processor(i)
        return self._chassis_resource(path)

    def _chassis_resource(self, path: str) -> Json | None:
        found = self._chassis_of(path)
        if found is None:
            return None
        i, rest = found
        base = f"{ROOT}/Chassis/{gpu_chassis_id(i)}"
        sensor = gpu_sensor_uri(i).removeprefix(base + "/")
        make: dict[str, Callable[[], Json]] = {
            "": lambda: self._chassis(i),
            "Controls": lambda: _collection(
                "ControlCollection",
                f"{base}/Controls",
                f"GPU {i + 1} Controls",
                [gpu_control_uri(i)],
            ),
            f"Controls/{GPU_CONTROL_ID}": lambda: self._control(i),
            "Sensors": lambda: _collection(
                "SensorCollection", f"{base}/Sensors", f"GPU {i + 1} Sensors", [gpu_sensor_uri(i)]
            ),
            sensor: lambda: self._sensor(i),
        }
        return make[rest]() if rest in make else None

    def _service_root(self) -> Json:
        doc: Json = {
            "@odata.id": ROOT,
            "@odata.type": _type("ServiceRoot"),
            "Id": "RootService",
            "Name": self.name,
            "RedfishVersion": "1.22.0",
            "UUID": self.uuid,
            "SessionService": _link(f"{ROOT}/SessionService"),
            "Links": {"Sessions": _link(f"{ROOT}/SessionService/Sessions")},
        }
        if self.gpus is not None:
            doc["Systems"] = _link(f"{ROOT}/Systems")
            if self.limits == "controls":
                doc["Chassis"] = _link(f"{ROOT}/Chassis")
        if self.meter is not None:
            doc["PowerEquipment"] = _link(f"{ROOT}/PowerEquipment")
        return doc

    def _odata(self) -> Json:
        names = ["Systems", "Chassis", "SessionService", "PowerEquipment"]
        root = self._service_root()
        return {
            "@odata.context": f"{ROOT}/$metadata",
            "value": [
                {"name": n, "kind": "Singleton", "url": root[n]["@odata.id"]}
                for n in names
                if n in root
            ],
        }

    def _metadata(self) -> str:
        refs = [
            f'  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/{s}_v1.xml">\n'
            f'    <edmx:Include Namespace="{s}"/>\n'
            f'    <edmx:Include Namespace="{s}.{v}"/>\n'
            "  </edmx:Reference>\n"
            for s, v in SCHEMAS.items()
        ]
        refs += [
            f'  <edmx:Reference Uri="http://redfish.dmtf.org/schemas/v1/{c}_v1.xml">\n'
            f'    <edmx:Include Namespace="{c}"/>\n'
            "  </edmx:Reference>\n"
            for c in COLLECTIONS
        ]
        return (
            '<?xml version="1.0" encoding="UTF-8"?>\n'
            '<edmx:Edmx xmlns:edmx="http://docs.oasis-open.org/odata/ns/edmx" Version="4.0">\n'
            + "".join(refs)
            + "  <edmx:DataServices>\n"
            '    <Schema xmlns="http://docs.oasis-open.org/odata/ns/edm" Namespace="Service">\n'
            '      <EntityContainer Name="Service" '
            f'Extends="ServiceRoot.{SCHEMAS["ServiceRoot"]}.ServiceContainer"/>\n'
            "    </Schema>\n"
            "  </edmx:DataServices>\n"
            "</edmx:Edmx>\n"
        )

    def _session_service(self) -> Json:
        return {
            "@odata.id": f"{ROOT}/SessionService",
            "@odata.type": _type("SessionService"),
            "Id": "SessionService",
            "Name": "Session Service",
            "ServiceEnabled": True,
            "SessionTimeout": 1800,
            "Sessions": _link(f"{ROOT}/SessionService/Sessions"),
        }

    def _session_collection(self) -> Json:
        return _collection(
            "SessionCollection",
            f"{ROOT}/SessionService/Sessions",
            "Sessions",
            [f"{ROOT}/SessionService/Sessions/{s}" for s in sorted(self.sessions.values())],
        )

    def _session(self, sid: str) -> Json:
        return {
            "@odata.id": f"{ROOT}/SessionService/Sessions/{sid}",
            "@odata.type": _type("Session"),
            "Id": sid,
            "Name": f"Session {sid}",
            "UserName": self.username,
            "Password": None,
        }

    def _systems(self) -> Json:
        return _collection(
            "ComputerSystemCollection",
            f"{ROOT}/Systems",
            "Computer Systems",
            [f"{ROOT}/Systems/{SYSTEM_ID}"],
        )

    def _system(self) -> Json:
        return {
            "@odata.id": f"{ROOT}/Systems/{SYSTEM_ID}",
            "@odata.type": _type("ComputerSystem"),
            "Id": SYSTEM_ID,
            "Name": "HGX Baseboard",
            "SystemType": "Physical",
            "Status": {"State": "Enabled", "Health": "OK"},
            "Processors": _link(f"{ROOT}/Systems/{SYSTEM_ID}/Processors"),
        }

    def _processors(self) -> Json:
        return _collection(
            "ProcessorCollection",
            f"{ROOT}/Systems/{SYSTEM_ID}/Processors",
            "Processors",
            [
                f"{ROOT}/Systems/{SYSTEM_ID}/Processors/{gpu_processor_id(i)}"
                for i in range(len(self._gpu_infos))
            ],
        )

    def _processor(self, i: int) -> Json:
        info = self._gpu_infos[i]
        path = f"{ROOT}/Systems/{SYSTEM_ID}/Processors/{gpu_processor_id(i)}"
        return {
            "@odata.id": path,
            "@odata.type": _type("Processor"),
            "Id": gpu_processor_id(i),
            "Name": f"GPU {i + 1}",
            "ProcessorType": "GPU",
            "Manufacturer": "NVIDIA",
            "Model": info.name,
            "UUID": self.processor_uuid(i),
            "SerialNumber": info.uuid,
            "Status": {"State": "Enabled", "Health": "OK"},
            "EnvironmentMetrics": _link(f"{path}/EnvironmentMetrics"),
        }

    def _environment_metrics(self, i: int) -> Json:
        assert self.gpus is not None
        info = self._gpu_infos[i]
        reading = self.gpus.read(info.uuid)
        limit = reading.cap_w if self.faults.lie_limit_w is None else self.faults.lie_limit_w
        path = f"{ROOT}/Systems/{SYSTEM_ID}/Processors/{gpu_processor_id(i)}"
        doc: Json = {
            "@odata.id": f"{path}/EnvironmentMetrics",
            "@odata.type": _type("EnvironmentMetrics"),
            "Id": "EnvironmentMetrics",
            "Name": f"GPU {i + 1} Environment Metrics",
            "PowerWatts": {"Reading": round(reading.power_w * self.faults.lie_draw_factor, 2)},
            "EnergyJoules": {"Reading": round(reading.energy_j, 1)},
            "TemperatureCelsius": {"Reading": round(reading.temp_c, 1)},
            "PowerLimitWatts": {
                "SetPoint": limit,
                "AllowableMin": info.min_cap_w,
                "AllowableMax": info.max_cap_w,
                "DefaultSetPoint": info.default_cap_w,
            },
        }
        if self.limits == "controls":  # the limit is the Control's, not here
            del doc["PowerLimitWatts"]
        return doc

    def _chassis_collection(self) -> Json:
        return _collection(
            "ChassisCollection",
            f"{ROOT}/Chassis",
            "Chassis",
            [f"{ROOT}/Chassis/{gpu_chassis_id(i)}" for i in range(len(self._gpu_infos))],
        )

    def _chassis(self, i: int) -> Json:
        path = f"{ROOT}/Chassis/{gpu_chassis_id(i)}"
        return {
            "@odata.id": path,
            "@odata.type": _type("Chassis"),
            "Id": gpu_chassis_id(i),
            "Name": f"GPU {i + 1}",
            "ChassisType": "Module",
            "Status": {"State": "Enabled", "Health": "OK"},
            "Controls": _link(f"{path}/Controls"),
            "Sensors": _link(f"{path}/Sensors"),
        }

    def _control(self, i: int) -> Json:
        assert self.gpus is not None
        info = self._gpu_infos[i]
        reading = self.gpus.read(info.uuid)
        limit = reading.cap_w if self.faults.lie_limit_w is None else self.faults.lie_limit_w
        processor = f"{ROOT}/Systems/{SYSTEM_ID}/Processors/{gpu_processor_id(i)}"
        return {
            "@odata.id": gpu_control_uri(i),
            "@odata.type": _type("Control"),
            "Id": GPU_CONTROL_ID,
            "Name": f"GPU {i + 1} Power Limit",
            "ControlType": "Power",
            "ControlMode": "Automatic",
            "SetPointType": "Single",
            "SetPointUnits": "W",
            "SetPoint": limit,
            "AllowableMin": info.min_cap_w,
            "AllowableMax": info.max_cap_w,
            "DefaultSetPoint": info.default_cap_w,
            "PhysicalContext": "GPU",
            "Implementation": "Direct",
            "Sensor": {
                "Reading": self._drawn_w(i),
                "DataSourceUri": gpu_sensor_uri(i),
            },
            "RelatedItem": [_link(processor)],
            "Status": {"State": "Enabled", "Health": "OK"},
        }

    def _sensor(self, i: int) -> Json:
        return {
            "@odata.id": gpu_sensor_uri(i),
            "@odata.type": _type("Sensor"),
            "Id": f"{gpu_chassis_id(i)}_Power_0",
            "Name": f"GPU {i + 1} Power",
            "ReadingType": "Power",
            "ReadingUnits": "W",
            "Reading": self._drawn_w(i),
            "PhysicalContext": "GPU",
            "Status": {"State": "Enabled", "Health": "OK"},
        }

    def _drawn_w(self, i: int) -> float:
        """What GPU i is said to draw (the truth times `lie_draw_factor`)."""
        assert self.gpus is not None
        power = self.gpus.read(self._gpu_infos[i].uuid).power_w
        return round(power * self.faults.lie_draw_factor, 2)

    def metered_w(self) -> float:
        """What the PDU measures now: its GPUs' true draw plus its overhead."""
        assert self.meter is not None
        total = self.meter.overhead_w
        for backend in self.meter.backends:
            for info in backend.gpus():
                total += backend.read(info.uuid).power_w
        return total

    def _power_equipment(self) -> Json:
        return {
            "@odata.id": f"{ROOT}/PowerEquipment",
            "@odata.type": _type("PowerEquipment"),
            "Id": "PowerEquipment",
            "Name": "Power Equipment",
            "Status": {"State": "Enabled", "Health": "OK"},
            "RackPDUs": _link(f"{ROOT}/PowerEquipment/RackPDUs"),
        }

    def _rack_pdus(self) -> Json:
        return _collection(
            "PowerDistributionCollection",
            f"{ROOT}/PowerEquipment/RackPDUs",
            "Rack PDUs",
            [f"{ROOT}/PowerEquipment/RackPDUs/{PDU_ID}"],
        )

    def _rack_pdu(self) -> Json:
        path = f"{ROOT}/PowerEquipment/RackPDUs/{PDU_ID}"
        return {
            "@odata.id": path,
            "@odata.type": _type("PowerDistribution"),
            "Id": PDU_ID,
            "Name": "Rack PDU 1",
            "EquipmentType": "RackPDU",
            "Model": "Emulated PDU",
            "Status": {"State": "Enabled", "Health": "OK"},
            "Metrics": _link(f"{path}/Metrics"),
        }

    def _pdu_metrics(self) -> Json:
        return {
            "@odata.id": f"{ROOT}/PowerEquipment/RackPDUs/{PDU_ID}/Metrics",
            "@odata.type": _type("PowerDistributionMetrics"),
            "Id": "Metrics",
            "Name": "Rack PDU 1 Metrics",
            "PowerWatts": {"Reading": round(self.metered_w() * self.faults.lie_draw_factor, 1)},
        }


def _collection(kind: str, path: str, name: str, members: list[str]) -> Json:
    return {
        "@odata.id": path,
        "@odata.type": f"#{kind}.{kind}",
        "Name": name,
        "Members": [_link(m) for m in members],
        "Members@odata.count": len(members),
    }


def _error_body(message_id: str, message: str) -> Json:
    return {
        "error": {
            "code": message_id,
            "message": message,
            "@Message.ExtendedInfo": [{"MessageId": message_id, "Message": message}],
        }
    }


def _error(status: int, message_id: str, message: str) -> Response:
    return Response(status, _error_body(message_id, message))


def _get_only(method: str, make: Callable[[], Json | str]) -> Response:
    if method not in ("GET", "HEAD"):
        return _error(405, "Base.1.0.OperationNotAllowed", method)
    return Response(200, make())


# -- HTTPS ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class TestCa:
    """A self-signed CA and a server certificate for 127.0.0.1 and localhost, as PEM files
    in `directory` (made with `cryptography`, no openssl process)."""

    ca_file: Path
    cert_file: Path
    key_file: Path

    __test__ = False  # not a pytest class

    @classmethod
    def make(cls, directory: Path, name: str = "powerd test BMC CA") -> TestCa:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        now = dt.datetime.now(dt.UTC)
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        ca = (
            x509.CertificateBuilder()
            .subject_name(ca_name)
            .issuer_name(ca_name)
            .public_key(ca_key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False
            )
            .sign(ca_key, hashes.SHA256())
        )
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bmc")]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - dt.timedelta(minutes=5))
            .not_valid_after(now + dt.timedelta(days=2))
            .add_extension(
                x509.SubjectAlternativeName(
                    [
                        x509.DNSName("localhost"),
                        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
                    ]
                ),
                critical=False,
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.ExtendedKeyUsage([x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            )
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        directory.mkdir(parents=True, exist_ok=True)
        made = cls(directory / "ca.crt", directory / "bmc.crt", directory / "bmc.key")
        made.ca_file.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        made.cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        made.key_file.write_bytes(
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            )
        )
        made.key_file.chmod(0o600)
        return made


Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


class EmulatorServer:
    """Serves `services` over HTTPS (with `tls`; plain HTTP without), one loopback port
    each, from one event loop in a thread. Use as a context manager; `url(i)` is the i-th
    service's base URL."""

    def __init__(self, services: Sequence[RedfishService], tls: TestCa | None) -> None:
        self.services = list(services)
        self.tls = tls
        self._socks: list[socket.socket] = []
        for _ in self.services:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # Inherited by every accepted connection: uvicorn writes a response's head and
            # body apart, and Nagle's algorithm would hold the body for the client's delayed
            # ACK (40 ms a request).
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.bind(("127.0.0.1", 0))
            sock.listen(128)
            sock.setblocking(False)
            self._socks.append(sock)
        self.ports = [s.getsockname()[1] for s in self._socks]
        self._by_port = dict(zip(self.ports, self.services, strict=True))
        self._thread: threading.Thread | None = None
        self._server: Any = None
        self._started = threading.Event()

    def url(self, i: int = 0) -> str:
        scheme = "http" if self.tls is None else "https"
        return f"{scheme}://127.0.0.1:{self.ports[i]}"

    def __enter__(self) -> EmulatorServer:
        import uvicorn

        options: dict[str, Any] = {}
        if self.tls is not None:
            options = {"ssl_certfile": self.tls.cert_file, "ssl_keyfile": self.tls.key_file}
        config = uvicorn.Config(
            self._app,
            log_config=None,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=1,
            server_header=False,
            interface="asgi3",
            proxy_headers=False,
            backlog=1024,
            **options,
        )
        self._server = uvicorn.Server(config)
        self._server.install_signal_handlers = lambda: None  # uvicorn < 0.29
        self._thread = threading.Thread(target=self._run, name="redfish-emulator", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._server.started:
            if time.monotonic() > deadline or not self._thread.is_alive():
                raise RuntimeError("the Redfish emulator did not start")
            time.sleep(0.01)
        return self

    def _run(self) -> None:
        async def serve() -> None:
            import contextlib

            server = self._server
            server.capture_signals = contextlib.nullcontext  # the test owns signals
            await server.serve(sockets=self._socks)

        asyncio.run(serve())

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
        for sock in self._socks:
            sock.close()

    async def _app(self, scope: dict[str, Any], receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        service = self._by_port[scope["server"][1]]
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        faults = service.faults
        lo, hi = faults.latency_s
        if hi > 0:
            await asyncio.sleep(random.uniform(lo, hi))
        # Until the fault is lifted or the client gives up (a test flips a plain flag).
        while faults.hang:  # noqa: ASYNC110
            await asyncio.sleep(0.05)
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        response = service.handle(scope["method"], scope["path"], headers, body)
        if isinstance(response.body, str):
            payload, ctype = response.body.encode(), "application/xml"
        elif response.body is None:
            payload, ctype = b"", "application/json"
        else:
            payload, ctype = json.dumps(response.body).encode(), "application/json"
        out = [
            (b"content-type", f"{ctype}; charset=utf-8".encode()),
            (b"odata-version", b"4.0"),
            (b"content-length", str(len(payload)).encode()),
        ]
        out += [(k.lower().encode(), v.encode()) for k, v in response.headers.items()]
        await send({"type": "http.response.start", "status": response.status, "headers": out})
        await send(
            {"type": "http.response.body", "body": b"" if scope["method"] == "HEAD" else payload}
        )
