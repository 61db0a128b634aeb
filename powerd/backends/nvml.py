"""The real GPU backend: NVIDIA's NVML through the `pynvml` module of nvidia-ml-py.

NVML speaks milliwatts and millijoules; everything this module returns is watts and joules.
Every pynvml call goes through `_call`, so an `NVMLError` is always turned into one of the
project's `BackendError`s by `translate_nvml_error` and never leaves this module.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import pynvml
import structlog

from powerd.backends.base import (
    BackendError,
    DriverNotLoaded,
    GpuBackend,
    GpuInfo,
    GpuLost,
    GpuReading,
    InvalidArgument,
    NoPermission,
    NotSupported,
    UnknownGpu,
    throttle_reasons,
)
from powerd.clock import Clock, SystemClock

log = structlog.get_logger(__name__)

_DRIVER_HINT = "is the NVIDIA driver loaded? check with nvidia-smi"

# NVML return code -> (our exception, what an operator should know). Anything not listed
# becomes a plain BackendError carrying NVML's own message.
_ERRORS: dict[int, tuple[type[BackendError], str]] = {
    pynvml.NVML_ERROR_NO_PERMISSION: (NoPermission, "needs root or CAP_SYS_ADMIN"),
    pynvml.NVML_ERROR_NOT_SUPPORTED: (NotSupported, "not supported on this GPU"),
    # A driver older than this nvidia-ml-py lacks the entry point: unsupported, for us.
    pynvml.NVML_ERROR_FUNCTION_NOT_FOUND: (NotSupported, "not in this driver's NVML"),
    pynvml.NVML_ERROR_GPU_IS_LOST: (GpuLost, "the GPU fell off the bus"),
    # NVML answers UNKNOWN when the device vanished under the call.
    pynvml.NVML_ERROR_UNKNOWN: (GpuLost, "the GPU is gone or unresponsive"),
    pynvml.NVML_ERROR_RESET_REQUIRED: (GpuLost, "the GPU needs a reset"),
    pynvml.NVML_ERROR_DRIVER_NOT_LOADED: (DriverNotLoaded, _DRIVER_HINT),
    pynvml.NVML_ERROR_LIBRARY_NOT_FOUND: (
        DriverNotLoaded,
        "libnvidia-ml.so.1 not found: is the NVIDIA driver installed?",
    ),
    pynvml.NVML_ERROR_UNINITIALIZED: (DriverNotLoaded, "NVML is not initialised"),
    # Typical after a driver upgrade without a reboot: the kernel module is the old one.
    pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH: (
        DriverNotLoaded,
        "NVML library and kernel driver versions differ: reload the driver or reboot",
    ),
    pynvml.NVML_ERROR_INVALID_ARGUMENT: (InvalidArgument, "NVML rejected the value"),
}

# Preferred call first; the later ones serve drivers (or nvidia-ml-py versions) without it.
_TEMPERATURE_CALLS = ("nvmlDeviceGetTemperatureV", "nvmlDeviceGetTemperature")
_REASON_CALLS = (
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)


def translate_nvml_error(err: Exception, what: str, uuid: str | None = None) -> BackendError:
    """The project's exception for a pynvml.NVMLError raised by `what` (a call name)."""
    code: int = getattr(err, "value", -1)
    cls, hint = _ERRORS.get(code, (BackendError, ""))
    where = f" on {uuid}" if uuid else ""
    return cls(f"{what}{where}: {err} ({hint})" if hint else f"{what}{where}: {err}", uuid=uuid)


def _call(name: str, *args: Any, uuid: str | None = None) -> Any:
    """pynvml.<name>(*args), failing only with BackendErrors."""
    fn = getattr(pynvml, name, None)
    if fn is None:  # deprecated calls leave nvidia-ml-py; new ones are not in old releases
        raise NotSupported(f"{name}: not in this nvidia-ml-py", uuid=uuid)
    try:
        return fn(*args)
    except pynvml.NVMLError as err:
        raise translate_nvml_error(err, name, uuid) from err


def _text(value: str | bytes) -> str:
    # nvidia-ml-py decodes strings since 11.x; older releases hand back bytes.
    return value.decode() if isinstance(value, bytes) else value


def _watts(milliwatts: int) -> float:
    return int(milliwatts) / 1000.0


@dataclass
class _Gpu:
    info: GpuInfo
    handle: Any
    # NVML calls this GPU answered NOT_SUPPORTED to: never asked again.
    unsupported: set[str] = field(default_factory=set)
    # Energy integrated from power samples, for GPUs without an energy counter (pre-Volta).
    energy_j: float = 0.0
    last_sample: tuple[float, float] | None = None  # (monotonic s, power W)


class NvmlBackend(GpuBackend):
    """The GPUs of this node through NVML. Raises DriverNotLoaded when NVML cannot start."""

    def __init__(self, clock: Clock | None = None) -> None:
        self._clock: Clock = clock or SystemClock()
        self._gpus: dict[str, _Gpu] | None = None
        self._closed = False
        _call("nvmlInit")

    def gpus(self) -> list[GpuInfo]:
        return [gpu.info for gpu in self._discovered().values()]

    def read(self, uuid: str) -> GpuReading:
        gpu = self._gpu(uuid)
        try:
            return self._read(gpu)
        except GpuLost:
            if not self._look_up_again(gpu):
                raise
            return self._read(gpu)

    def _read(self, gpu: _Gpu) -> GpuReading:
        uuid = gpu.info.uuid
        enforced_mw = self._optional(gpu, "nvmlDeviceGetEnforcedPowerLimit")
        # Unknown values err high: the cap could be the maximum, the GPU could draw its cap.
        cap_w = _watts(enforced_mw) if enforced_mw is not None else gpu.info.max_cap_w
        requested_mw = self._optional(gpu, "nvmlDeviceGetPowerManagementLimit")
        power_mw = self._optional(gpu, "nvmlDeviceGetPowerUsage")
        power_w = _watts(power_mw) if power_mw is not None else cap_w
        temp_c = self._first_supported(gpu, _TEMPERATURE_CALLS, pynvml.NVML_TEMPERATURE_GPU)
        util = self._optional(gpu, "nvmlDeviceGetUtilizationRates")
        sm_clock = self._optional(gpu, "nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM)
        reason_bits = self._first_supported(gpu, _REASON_CALLS)
        return GpuReading(
            uuid=uuid,
            index=gpu.info.index,
            power_w=power_w,
            energy_j=self._energy_j(gpu, power_w),
            cap_w=cap_w,
            temp_c=float(temp_c) if temp_c is not None else 0.0,
            util_pct=float(util.gpu) if util is not None else 0.0,
            sm_clock_mhz=float(sm_clock) if sm_clock is not None else 0.0,
            throttle=throttle_reasons(int(reason_bits)) if reason_bits is not None else [],
            requested_w=_watts(requested_mw) if requested_mw is not None else None,
        )

    def set_power_limit_w(self, uuid: str, watts: float) -> float:
        gpu = self._gpu(uuid)
        lo, hi = gpu.info.min_cap_w, gpu.info.max_cap_w
        if not (math.isfinite(watts) and lo <= watts <= hi):
            raise InvalidArgument(f"{watts} W is outside [{lo}, {hi}] W for {uuid}", uuid=uuid)
        try:
            return self._set(gpu, watts)
        except GpuLost:
            if not self._look_up_again(gpu):
                raise
            return self._set(gpu, watts)

    @staticmethod
    def _set(gpu: _Gpu, watts: float) -> float:
        uuid = gpu.info.uuid
        _call("nvmlDeviceSetPowerManagementLimit", gpu.handle, round(watts * 1000), uuid=uuid)
        # Another tool (nvidia-smi, a BMC, a DCGM policy) may hold a lower limit: report what
        # the GPU enforces, not what we asked for.
        return _watts(_call("nvmlDeviceGetEnforcedPowerLimit", gpu.handle, uuid=uuid))

    def enforced_limit_w(self, uuid: str) -> float:
        gpu = self._gpu(uuid)
        return _watts(_call("nvmlDeviceGetEnforcedPowerLimit", gpu.handle, uuid=uuid))

    def _look_up_again(self, gpu: _Gpu) -> bool:
        """A GPU NVML called lost: its handle again, by UUID, once per call (a GPU back from
        a reset or a re-attach is reached through the handle NVML has for it now). False
        if NVML does not know the UUID (still gone): the caller's GpuLost stands."""
        try:
            handle = _call("nvmlDeviceGetHandleByUUID", gpu.info.uuid, uuid=gpu.info.uuid)
        except BackendError:
            return False
        gpu.handle = handle
        log.debug("nvml_handle_looked_up_again", uuid=gpu.info.uuid)
        return True

    def unsupported(self, uuid: str) -> frozenset[str]:
        """The NVML calls this GPU has answered NOT_SUPPORTED to so far."""
        return frozenset(self._gpu(uuid).unsupported)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            _call("nvmlShutdown")
        except BackendError as err:
            # Nothing useful to do about it at shutdown; the process is leaving NVML anyway.
            log.warning("nvml_shutdown_failed", error=str(err))

    def _discovered(self) -> dict[str, _Gpu]:
        if self._closed:
            raise DriverNotLoaded("the NVML backend is closed")
        if self._gpus is None:
            found: dict[str, _Gpu] = {}
            for index in range(int(_call("nvmlDeviceGetCount"))):
                try:
                    gpu = self._probe(index)
                except DriverNotLoaded:
                    raise
                except BackendError as err:
                    # One broken GPU must not hide the healthy ones.
                    log.warning("nvml_gpu_skipped", index=index, code=err.code, error=str(err))
                    continue
                found[gpu.info.uuid] = gpu
            self._gpus = found
        return self._gpus

    def _probe(self, index: int) -> _Gpu:
        handle = _call("nvmlDeviceGetHandleByIndex", index)
        uuid = _text(_call("nvmlDeviceGetUUID", handle))
        name = _text(_call("nvmlDeviceGetName", handle, uuid=uuid))
        min_w, max_w, default_w = self._limits_w(handle, uuid)
        info = GpuInfo(
            uuid=uuid,
            index=index,
            name=name,
            min_cap_w=min_w,
            max_cap_w=max_w,
            default_cap_w=default_w,
        )
        return _Gpu(info=info, handle=handle)

    @staticmethod
    def _limits_w(handle: Any, uuid: str) -> tuple[float, float, float]:
        try:
            min_mw, max_mw = _call(
                "nvmlDeviceGetPowerManagementLimitConstraints", handle, uuid=uuid
            )
        except NotSupported:
            # No settable limit: the GPU is still powered and counted, at a fixed cap.
            fixed_w = _watts(_call("nvmlDeviceGetEnforcedPowerLimit", handle, uuid=uuid))
            log.warning("nvml_limit_not_settable", uuid=uuid, cap_w=fixed_w)
            return fixed_w, fixed_w, fixed_w
        try:
            default_mw = _call("nvmlDeviceGetPowerManagementDefaultLimit", handle, uuid=uuid)
        except NotSupported:
            default_mw = max_mw
        return _watts(min_mw), _watts(max_mw), _watts(default_mw)

    def _gpu(self, uuid: str) -> _Gpu:
        gpu = self._discovered().get(uuid)
        if gpu is None:
            raise UnknownGpu(f"no GPU with UUID {uuid} on this node", uuid=uuid)
        return gpu

    def _optional(self, gpu: _Gpu, call: str, *args: Any) -> Any:
        """NVML's answer, or None when this GPU (or this NVML) does not support `call`."""
        if call in gpu.unsupported:
            return None
        try:
            return _call(call, gpu.handle, *args, uuid=gpu.info.uuid)
        except NotSupported:
            gpu.unsupported.add(call)
            log.info("nvml_call_unsupported", uuid=gpu.info.uuid, call=call)
            return None

    def _first_supported(self, gpu: _Gpu, calls: tuple[str, ...], *args: Any) -> Any:
        for call in calls:
            value = self._optional(gpu, call, *args)
            if value is not None:
                return value
        return None

    def _energy_j(self, gpu: _Gpu, power_w: float) -> float:
        energy_mj = self._optional(gpu, "nvmlDeviceGetTotalEnergyConsumption")
        if energy_mj is not None:
            return int(energy_mj) / 1000.0
        # No counter: integrate the sampled power (trapezoids) on the monotonic clock.
        now = self._clock.monotonic()
        if gpu.last_sample is not None:
            then, then_w = gpu.last_sample
            gpu.energy_j += (then_w + power_w) / 2.0 * max(0.0, now - then)
        gpu.last_sample = (now, power_w)
        return gpu.energy_j
