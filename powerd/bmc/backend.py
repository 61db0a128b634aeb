"""A BMC-managed node's GPUs as a `GpuBackend`: the node agent's code runs unchanged on it.

The agent calls its backend synchronously; a BMC answers in 100–500 ms. So every node's
agent runs in a thread of its own (powerd/bmc/agent.py) and its backend hands the HTTP
work to one shared event loop (`IoLoop`), where every BMC's `RedfishClient` lives: the
GPUs of a node are read concurrently (one round trip per sample, not one per GPU), many
BMCs are in flight at once, each within its own connection cap.

- Discovery walks the standard tree: `Systems` → each system's `Processors` → those with
  `ProcessorType: GPU` and an `EnvironmentMetrics` whose `PowerLimitWatts` has a
  `SetPoint` and `AllowableMin`/`AllowableMax`. Where none has (or where the node's
  `limits` say so), it walks `Chassis` → each chassis's `Controls` → those with
  `ControlType: Power` for a GPU (`PhysicalContext: GPU`, or a `RelatedItem` that is a GPU
  Processor) with a `SetPoint`, `AllowableMin`/`AllowableMax`, and a `Sensor` excerpt whose
  `Reading` is the draw. A GPU found either way has the same name on the wire (its
  Processor's `UUID`, where the Control links it).
- `read`: one sample of every GPU of the node, shared by the reads of one telemetry period
  (`max_age_s`); a failed sample fails every read until it is that old, so a BMC that does
  not answer costs one timeout per period, not one per GPU.
- `set_power_limit_w`: `PATCH` `PowerLimitWatts.SetPoint` (the Control's `SetPoint`), then
  read it back from the resource the answer carries (or a `GET` where it carries none):
  what the BMC enforces, as the agent acks it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import structlog

from powerd.backends.base import (
    BackendError,
    GpuBackend,
    GpuInfo,
    GpuLost,
    GpuReading,
    InvalidArgument,
    NoPermission,
    NotSupported,
    UnknownGpu,
)
from powerd.bmc.redfish import Json, RedfishClient, RedfishError
from powerd.wire import CAP_TOLERANCE_W, MAX_GPUS_PER_NODE, MAX_SANE_WATTS

log = structlog.get_logger(__name__)
T = TypeVar("T")
# Members read of one collection (an HGX board lists ~60 Chassis, a few dozen Processors).
MAX_MEMBERS = 256
# A Control's RelatedItem links read to find its GPU's Processor.
MAX_RELATED = 8
# Where a BMC's GPU limits are: "processors" (EnvironmentMetrics' PowerLimitWatts),
# "controls" (Chassis Controls of type Power), "auto" (processors, else controls).
LimitsAt = Literal["auto", "processors", "controls"]


class IoLoop:
    """An event loop in a thread of its own, for every BMC's requests. `run` waits for a
    coroutine from any other thread."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="bmc-io", daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        """The coroutine's result; TimeoutError (it is cancelled) after `timeout_s`."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        if not self._thread.is_alive():
            self.loop.close()


@dataclass(frozen=True)
class BmcGpu:
    """A GPU found on a BMC: what does not change, and the one resource that holds its draw
    and its limit: an `EnvironmentMetrics` (`via="metrics"`) or a `Control`."""

    info: GpuInfo
    uri: str
    via: Literal["metrics", "control"] = "metrics"


@dataclass
class _Sample:
    at: float  # monotonic
    readings: dict[str, GpuReading]
    error: BackendError | None = None


class RedfishBackend(GpuBackend):
    """One node's GPUs behind its BMC. `discover()` first (BackendError if the BMC cannot
    be walked); then the `GpuBackend` calls, each bounded by the client's timeouts."""

    keeps_limits = True  # a BMC holds the last limit set when powerd dies

    def __init__(
        self,
        node_id: str,
        client: RedfishClient,
        io: IoLoop,
        max_age_s: float,
        limits: LimitsAt = "auto",
    ) -> None:
        self.node_id = node_id
        self.client = client
        self.limits = limits
        self.io = io
        self.max_age_s = max_age_s
        self.found: dict[str, BmcGpu] = {}
        self._sample: _Sample | None = None
        # The longest one request may take with its retries, and a margin for the loop.
        per_request = client.timeout_s * (client.retries + 1) + 1.0
        self._bound_s = per_request * 3  # a log-in, the request, a log-in again
        self.log = log.bind(node=node_id, bmc=client.base_url)

    # -- discovery -----------------------------------------------------------------------

    def discover(self) -> list[GpuInfo]:
        """Walk the BMC's tree for GPUs with a settable power limit; BackendError if the
        walk fails (the BMC does not answer, refuses the credentials, ...)."""
        found = self._call(self._discover(), "discovery", bound_s=self._bound_s * 4)
        self.found = {g.info.uuid: g for g in found}
        self.log.info("bmc_gpus_found", gpus=len(found), uris=[g.uri for g in found])
        return [g.info for g in found]

    async def _discover(self) -> list[BmcGpu]:
        root = await self.client.get("/redfish/v1")
        gpus: list[BmcGpu] = []
        if self.limits != "controls":
            await self._discover_processors(root, gpus)
        if not gpus and self.limits != "processors":
            await self._discover_controls(root, gpus)
        return gpus

    async def _discover_processors(self, root: Json, gpus: list[BmcGpu]) -> None:
        c = self.client
        systems_uri = _link(root, "Systems")
        if systems_uri is None:
            return
        for member in _members(await c.get(systems_uri)):
            system = await c.get(member)
            processors_uri = _link(system, "Processors")
            if processors_uri is None:
                continue
            procs = await asyncio.gather(*(c.get(p) for p in _members(await c.get(processors_uri))))
            candidates = [
                (p, uri)
                for p in procs
                if p.get("ProcessorType") == "GPU" and (uri := _link(p, "EnvironmentMetrics"))
            ]
            metrics = await asyncio.gather(*(c.get(uri) for _, uri in candidates))
            for (proc, uri), m in zip(candidates, metrics, strict=True):
                bounds = _limit_bounds(m.get("PowerLimitWatts"))
                if bounds is None:
                    where = "processors" if self.limits == "processors" else "controls next"
                    self.log.info(
                        "bmc_gpu_without_limit", processor=proc.get("@odata.id"), then=where
                    )
                    continue
                uuid = _gpu_uuid(self.node_id, str(system.get("Id", "")), proc)
                self._add(gpus, BmcGpu(self._info(uuid, len(gpus), proc, bounds), uri, "metrics"))

    async def _discover_controls(self, root: Json, gpus: list[BmcGpu]) -> None:
        c = self.client
        chassis_uri = _link(root, "Chassis")
        if chassis_uri is None:
            return
        for member in _members(await c.get(chassis_uri)):
            chassis = await c.get(member)
            controls_uri = _link(chassis, "Controls")
            if controls_uri is None:
                continue
            members = _members(await c.get(controls_uri))
            controls = await asyncio.gather(*(c.get(u) for u in members))
            # A Control is steered where it was read, whatever its `@odata.id` says: a BMC
            # naming another GPU's Control there would have our PATCHes change that GPU.
            power = [
                (control, uri)
                for control, uri in zip(controls, members, strict=True)
                if control.get("ControlType") == "Power"
            ]
            related = await asyncio.gather(*(self._related_gpu(ctl) for ctl, _ in power))
            for (control, uri), (proc, system_id) in zip(power, related, strict=True):
                if proc is None and control.get("PhysicalContext") != "GPU":
                    continue  # a chassis's or a node's power limit, not a GPU's
                bounds = _limit_bounds(control)
                if bounds is None or _number(control.get("Sensor")) is None:
                    self.log.warning("bmc_gpu_control_unusable", control=uri)
                    continue
                if proc is not None:
                    uuid = _gpu_uuid(self.node_id, system_id, proc)
                else:
                    uuid = _gpu_uuid(self.node_id, str(chassis.get("Id", "")), control)
                named = proc or control
                self._add(gpus, BmcGpu(self._info(uuid, len(gpus), named, bounds), uri, "control"))

    async def _related_gpu(self, control: Json) -> tuple[Json | None, str]:
        """The GPU Processor a Control's `RelatedItem` links, and its system's Id; (None, "")
        if none does (or it cannot be read: then the Control is a GPU's by its context)."""
        items = control.get("RelatedItem")
        # A few: each one looked at is a request, in turn (a GPU's Control links one or two).
        for item in items[:MAX_RELATED] if isinstance(items, list) else []:
            uri = item.get("@odata.id") if isinstance(item, dict) else None
            if not isinstance(uri, str) or "/Processors/" not in uri:
                continue
            try:
                proc = await self.client.get(uri)
            except RedfishError as exc:
                self.log.info("bmc_related_item_unreadable", uri=uri[:200], error=str(exc))
                continue
            if proc.get("ProcessorType") == "GPU":
                system_id = (
                    uri.split("/Systems/", 1)[-1].split("/", 1)[0] if "/Systems/" in uri else ""
                )
                return proc, system_id
        return None, ""

    def _info(
        self, uuid: str, index: int, named: Json, bounds: tuple[float, float, float]
    ) -> GpuInfo:
        lo, hi, default = bounds
        return GpuInfo(
            uuid=uuid,
            index=index,
            name=str(named.get("Model") or named.get("Name") or "GPU")[:128],
            min_cap_w=lo,
            max_cap_w=hi,
            default_cap_w=default,
        )

    def _add(self, gpus: list[BmcGpu], gpu: BmcGpu) -> None:
        if len(gpus) >= MAX_GPUS_PER_NODE or any(g.info.uuid == gpu.info.uuid for g in gpus):
            self.log.warning(
                "bmc_gpu_skipped",
                uri=gpu.uri,
                reason="a uuid named twice"
                if len(gpus) < MAX_GPUS_PER_NODE
                else f"over {MAX_GPUS_PER_NODE} GPUs",
            )
            return
        gpus.append(gpu)

    # -- GpuBackend ----------------------------------------------------------------------

    def gpus(self) -> list[GpuInfo]:
        return [g.info for g in self.found.values()]

    @property
    def answering(self) -> bool:
        """Whether the latest sample of the node was answered (False before the first)."""
        sample = self._sample
        return sample is not None and sample.error is None

    def read(self, uuid: str) -> GpuReading:
        gpu = self._gpu(uuid)
        sample = self._sample
        if sample is None or time.monotonic() - sample.at >= self.max_age_s:
            sample = self._sample = self._sample_all()
        if sample.error is not None:
            raise type(sample.error)(str(sample.error), uuid)
        reading = sample.readings.get(uuid)
        if reading is None:
            raise GpuLost(f"the BMC gave no metrics for {gpu.uri}", uuid)
        return reading

    def enforced_limit_w(self, uuid: str) -> float:
        """The limit of the latest sample, or of the latest set's read-back (whatever its
        age): a command checks it before each set (the agent's `_found_above`), and a round
        trip there would add one to every command. A limit raised out of band since then is
        still found, by the next sample's check (the agent's `_guard`)."""
        self._gpu(uuid)
        sample = self._sample
        if sample is None or sample.error is not None or uuid not in sample.readings:
            return self.read(uuid).cap_w
        return sample.readings[uuid].cap_w

    def set_power_limit_w(self, uuid: str, watts: float) -> float:
        gpu = self._gpu(uuid)
        _check_bounds(gpu.info, watts)
        reading = self._call(self._set(gpu, watts), f"setting {uuid}", uuid=uuid)
        self._remember(reading)
        return reading.cap_w

    def set_power_limits_w(
        self, targets: Sequence[tuple[str, float]]
    ) -> list[float | BackendError]:
        """Every target at once (the agent passes only decreases, or only raises): one
        PATCH and one GET per GPU, all in flight together within the BMC's connection cap,
        so a command costs two round trips per phase, not two per GPU."""
        out: list[float | BackendError | None] = [None] * len(targets)
        work: list[tuple[int, BmcGpu, float]] = []
        for k, (uuid, watts) in enumerate(targets):
            try:
                gpu = self._gpu(uuid)
                _check_bounds(gpu.info, watts)
            except BackendError as exc:
                out[k] = exc
                continue
            work.append((k, gpu, watts))
        if work:
            try:
                results = self.io.run(self._set_many(work), self._bound_s * 2)
            except TimeoutError:
                results = [BackendError("the BMC took too long", g.info.uuid) for _, g, _ in work]
            for (k, _gpu, _), result in zip(work, results, strict=True):
                if isinstance(result, GpuReading):
                    self._remember(result)
                    out[k] = result.cap_w
                else:
                    out[k] = result
        return [r if r is not None else BackendError("not set") for r in out]

    async def _set_many(
        self, work: list[tuple[int, BmcGpu, float]]
    ) -> list[GpuReading | BackendError]:
        done = await asyncio.gather(*(self._set(g, w) for _, g, w in work), return_exceptions=True)
        out: list[GpuReading | BackendError] = []
        for (_, gpu, _), result in zip(work, done, strict=True):
            uuid = gpu.info.uuid
            if isinstance(result, GpuReading):
                out.append(result)
            elif isinstance(result, RedfishError):
                out.append(_backend_error(result, f"setting {uuid}", uuid))
            elif isinstance(result, ValueError | TypeError | KeyError):
                out.append(BackendError(f"setting {uuid}: unusable answer ({result})", uuid))
            elif isinstance(result, BaseException):
                raise result
        return out

    def _remember(self, reading: GpuReading) -> None:
        if self._sample is not None and self._sample.error is None:
            self._sample.readings[reading.uuid] = reading

    def close(self) -> None:
        with contextlib.suppress(TimeoutError, RuntimeError):
            self.io.run(self.client.close(), timeout_s=self.client.timeout_s + 1.0)

    # -- inside --------------------------------------------------------------------------

    async def _set(self, gpu: BmcGpu, watts: float) -> GpuReading:
        # Whole watts: BMCs take SetPoint as an integer (Redfish lets them); the agent
        # clamps to [AllowableMin, AllowableMax] first, which are whole watts too.
        set_point: float | int = round(watts) if abs(watts - round(watts)) < 1e-9 else watts
        body: Json = {"SetPoint": set_point}
        after = await self.client.patch(
            gpu.uri, body if gpu.via == "control" else {"PowerLimitWatts": body}
        )
        # The read-back: the resource the PATCH's answer carries (Redfish answers 200 with
        # it, or 204), else a GET of it; one round trip a set, not two, where a BMC gives it.
        answered: GpuReading | None = None
        if after is not None and _names(after, gpu.uri):
            with contextlib.suppress(ValueError, TypeError):
                answered = _reading(gpu, after)
        if answered is not None and answered.cap_w >= watts - CAP_TOLERANCE_W:
            return answered
        got = _reading(gpu, await self.client.get(gpu.uri))
        if answered is not None and answered.cap_w > got.cap_w:
            # An answer below what was asked may show the resource before the change (a
            # BMC that applies after it answers): the higher of the two is acked, never a
            # limit lower than one the BMC may enforce.
            return dataclasses.replace(got, cap_w=answered.cap_w)
        return got

    def _sample_all(self) -> _Sample:
        at = time.monotonic()
        try:
            readings = self._call(self._read_all(), "sample")
        except BackendError as exc:
            self.log.warning("bmc_sample_failed", error=str(exc))
            return _Sample(at, {}, exc)
        return _Sample(at, readings)

    async def _read_all(self) -> dict[str, GpuReading]:
        gpus = list(self.found.values())
        docs = await asyncio.gather(*(self.client.get(g.uri) for g in gpus), return_exceptions=True)
        out: dict[str, GpuReading] = {}
        for gpu, doc in zip(gpus, docs, strict=True):
            if isinstance(doc, BaseException):
                if not isinstance(doc, RedfishError):
                    raise doc
                if len(gpus) == 1 or all(isinstance(d, BaseException) for d in docs):
                    raise doc
                continue  # one GPU's metrics missing: that read raises GpuLost
            out[gpu.info.uuid] = _reading(gpu, doc)
        return out

    def _call(
        self,
        coro: Coroutine[Any, Any, T],
        what: str,
        uuid: str | None = None,
        bound_s: float | None = None,
    ) -> T:
        try:
            return self.io.run(coro, bound_s or self._bound_s)
        except RedfishError as exc:
            raise _backend_error(exc, what, uuid) from None
        except TimeoutError:
            raise BackendError(f"{what}: the BMC took too long", uuid) from None
        except BackendError:
            raise
        except (ValueError, TypeError, KeyError) as exc:  # a malformed document
            raise BackendError(f"{what}: unusable answer ({exc})", uuid) from None

    def _gpu(self, uuid: str) -> BmcGpu:
        gpu = self.found.get(uuid)
        if gpu is None:
            raise UnknownGpu(f"no GPU {uuid} on BMC {self.client.base_url}", uuid)
        return gpu


def _check_bounds(info: GpuInfo, watts: float) -> None:
    if not info.min_cap_w <= watts <= info.max_cap_w:
        raise InvalidArgument(
            f"{watts:g} W is outside [{info.min_cap_w:g}, {info.max_cap_w:g}] W", info.uuid
        )


def _backend_error(exc: RedfishError, what: str, uuid: str | None) -> BackendError:
    message = f"{what}: {exc}"
    if exc.status in (401, 403):
        return NoPermission(message, uuid)
    if exc.status in (405, 501):
        return NotSupported(message, uuid)
    if exc.status == 400:
        return InvalidArgument(message, uuid)
    if exc.status == 404:
        return GpuLost(message, uuid)
    return BackendError(message, uuid)


def _reading(gpu: BmcGpu, m: Json) -> GpuReading:
    """EnvironmentMetrics (or a Control) as a reading; ValueError if the draw or the limit
    is missing."""
    if gpu.via == "control":  # the draw is the Sensor excerpt's; no energy, no temperature
        limit: object = m
        power = _number(m.get("Sensor"))
        where = "Sensor.Reading or SetPoint"
    else:
        limit = m.get("PowerLimitWatts")
        power = _number(m.get("PowerWatts"))
        where = "PowerWatts.Reading or PowerLimitWatts.SetPoint"
    set_point = limit.get("SetPoint") if isinstance(limit, dict) else None
    if power is None or not isinstance(set_point, int | float) or isinstance(set_point, bool):
        raise ValueError(f"{gpu.uri}: no {where}")
    # A BMC is untrusted: a draw or a limit the wire would refuse (not a number, negative,
    # beyond MAX_SANE_WATTS) is no reading at all, as if the BMC had not answered.
    for what, value in (("the draw", power), ("the SetPoint", set_point)):
        if not 0 <= value <= MAX_SANE_WATTS:  # False for NaN too
            raise ValueError(f"{gpu.uri}: {what} {value!r} is outside [0, {MAX_SANE_WATTS:g}] W")
    energy = _number(m.get("EnergyJoules"))
    temp = _number(m.get("TemperatureCelsius"))
    return GpuReading(
        uuid=gpu.info.uuid,
        index=gpu.info.index,
        power_w=power,
        energy_j=energy if energy is not None and 0 <= energy < math.inf else 0.0,
        cap_w=float(set_point),
        temp_c=temp if temp is not None and -50 <= temp <= 200 else 0.0,
        util_pct=0.0,  # not in EnvironmentMetrics
        sm_clock_mhz=0.0,
    )


def _number(excerpt: object) -> float | None:
    """A sensor excerpt's `Reading`, if it is a number."""
    if not isinstance(excerpt, dict):
        return None
    value = excerpt.get("Reading")
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _limit_bounds(limit: object) -> tuple[float, float, float] | None:
    """(AllowableMin, AllowableMax, default) of a PowerLimitWatts excerpt or a Control, if
    settable."""
    if not isinstance(limit, dict):
        return None
    values = [limit.get(k) for k in ("SetPoint", "AllowableMin", "AllowableMax")]
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in values):
        return None
    lo, hi = float(limit["AllowableMin"]), float(limit["AllowableMax"])
    if not 0 < lo <= hi <= MAX_SANE_WATTS:  # the wire's bounds (False for NaN)
        return None
    default = limit.get("DefaultSetPoint")
    if not isinstance(default, int | float) or isinstance(default, bool) or math.isnan(default):
        default = hi  # NaN would pass the clamp below, and the wire refuses it
    return lo, hi, min(max(float(default), lo), hi)


def _names(doc: Json, uri: str) -> bool:
    """Whether a document says it is the resource at `uri` (an answer for another resource,
    or one that names none, says nothing of this one's limit)."""
    named = doc.get("@odata.id")
    return isinstance(named, str) and named.rstrip("/") == uri.rstrip("/")


def _link(doc: Json, name: str) -> str | None:
    value = doc.get(name)
    if isinstance(value, dict) and isinstance(value.get("@odata.id"), str):
        return str(value["@odata.id"])
    return None


def _members(collection: Json) -> list[str]:
    """A collection's member links, each once, at most MAX_MEMBERS of them: every one is a
    request, and a BMC listing thousands would have discovery run past its bound each time
    (never steering the GPUs it does have) and hold a discovery slot while it does."""
    members = collection.get("Members")
    if not isinstance(members, list):
        return []
    links = dict.fromkeys(
        str(m["@odata.id"]) for m in members if isinstance(m, dict) and "@odata.id" in m
    )
    if len(links) > MAX_MEMBERS:
        log.warning(
            "bmc_collection_truncated",
            collection=str(collection.get("@odata.id", ""))[:200],
            members=len(links),
            read=MAX_MEMBERS,
        )
    return list(links)[:MAX_MEMBERS]


def _gpu_uuid(node_id: str, system_id: str, proc: Json) -> str:
    """The GPU's name on the wire: NVML's form (`GPU-<UUID>`) where the Processor has a
    UUID, else `<node>.<system>.<processor Id>` (unique on the node, and stable)."""
    uuid = proc.get("UUID")
    name = (
        f"GPU-{uuid.lower()}"
        if isinstance(uuid, str) and uuid
        else f"{node_id}.{system_id}.{proc.get('Id', '')}"
    )
    # The wire's UUID_PATTERN: ASCII letters, digits and _.:- only, at most 128.
    safe = (ch if ch.isascii() and (ch.isalnum() or ch in "_.:-") else "_" for ch in name)
    return "".join(safe)[:128]
