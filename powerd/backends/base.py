"""The GPU backend interface: telemetry in, power limits out, errors in our own terms.

Backends translate vendor errors (pynvml.NVMLError, ...) into `BackendError` subclasses in
one place; nothing vendor-specific leaks upward. Units are in the names.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from powerd.wire import AckError

# Clock event ("throttle") reason bits from nvml.h, by the names agents report in telemetry
# (the legacy ClocksThrottleReasons call uses the same bits; tests check them against pynvml's
# nvmlClocksEventReason* constants). The metrics export the bitmask, as DCGM does.
THROTTLE_REASON_BITS: Mapping[str, int] = {
    "gpu_idle": 0x001,
    "applications_clocks": 0x002,
    "sw_power_cap": 0x004,
    "hw_slowdown": 0x008,
    "sync_boost": 0x010,
    "sw_thermal": 0x020,
    "hw_thermal": 0x040,
    "hw_power_brake": 0x080,
    "display_clocks": 0x100,
    "board_limit": 0x200,
    "reliability": 0x400,
}
_KNOWN_REASON_BITS = sum(THROTTLE_REASON_BITS.values())
_UNKNOWN = "unknown_0x"


def throttle_reasons(bits: int) -> list[str]:
    """Readable names for a clock event reason bit mask; unknown bits are kept, in hex."""
    names = [name for name, bit in THROTTLE_REASON_BITS.items() if bits & bit]
    unknown = bits & ~_KNOWN_REASON_BITS
    if unknown:
        names.append(f"{_UNKNOWN}{unknown:x}")
    return names


def throttle_mask(reasons: Iterable[str]) -> int:
    """The bit mask of reason names (the inverse of `throttle_reasons`): `unknown_0x..`
    names keep their hex bits, anything else is ignored."""
    mask = 0
    for r in reasons:
        bit = THROTTLE_REASON_BITS.get(r)
        if bit is not None:
            mask |= bit
        elif r.startswith(_UNKNOWN):
            with contextlib.suppress(ValueError):
                mask |= int(r[len(_UNKNOWN) :], 16)
    return mask


class BackendError(Exception):
    """A GPU operation failed. `code` is what an ack or telemetry reports for it."""

    code: AckError = AckError.SET_FAILED

    def __init__(self, message: str, uuid: str | None = None) -> None:
        self.uuid = uuid
        super().__init__(message)


class NoPermission(BackendError):
    code = AckError.NO_PERMISSION


class NotSupported(BackendError):
    code = AckError.NOT_SUPPORTED


class GpuLost(BackendError):
    code = AckError.GPU_LOST


class DriverNotLoaded(BackendError):
    code = AckError.GPU_LOST


class InvalidArgument(BackendError):
    code = AckError.SET_FAILED


class UnknownGpu(BackendError):
    code = AckError.UNKNOWN_GPU


@dataclass(frozen=True)
class GpuInfo:
    """What does not change while the agent runs."""

    uuid: str
    index: int
    name: str
    min_cap_w: float
    max_cap_w: float
    default_cap_w: float


@dataclass(frozen=True)
class GpuReading:
    """One sample of one GPU."""

    uuid: str
    index: int
    power_w: float
    energy_j: float
    cap_w: float  # enforced limit (nvmlDeviceGetEnforcedPowerLimit), not only the requested one
    temp_c: float
    util_pct: float
    sm_clock_mhz: float
    throttle: list[str] = field(default_factory=list)
    perf: float | None = None  # application throughput, when the workload reports one
    workload: str | None = None
    # The limit requested through the driver (nvmlDeviceGetPowerManagementLimit): where a
    # lower one another holds (a BMC's out-of-band cap) keeps `cap_w` under it, the limit the
    # GPU goes back to when that one lifts. None: not known (a BMC's reading).
    requested_w: float | None = None


class GpuBackend(ABC):
    """Access to the GPUs of one node."""

    # The limits it sets stay when the agent dies (a BMC's), where NVML's go back to the
    # default with the driver: the agent says so in its status (docs/safety.md).
    keeps_limits: bool = False

    @abstractmethod
    def gpus(self) -> list[GpuInfo]:
        """The GPUs present, by index. May raise DriverNotLoaded."""

    @abstractmethod
    def read(self, uuid: str) -> GpuReading:
        """Sample one GPU. Raises GpuLost, UnknownGpu, ..."""

    @abstractmethod
    def set_power_limit_w(self, uuid: str, watts: float) -> float:
        """Set the power limit, then read back and return the *enforced* limit in watts.

        The caller clamps to the device's limits first; a backend raises InvalidArgument
        for values outside them rather than clamping silently.
        """

    def set_power_limits_w(
        self, targets: Sequence[tuple[str, float]]
    ) -> list[float | BackendError]:
        """Set several limits, as `set_power_limit_w` each: per target the enforced limit
        read back, or the error. The agent passes only decreases, or only raises, so their
        order among themselves does not matter; a backend whose calls are slow (a BMC) sets
        them concurrently. Default: one by one, in the order given."""
        out: list[float | BackendError] = []
        for uuid, watts in targets:
            try:
                out.append(self.set_power_limit_w(uuid, watts))
            except BackendError as exc:
                out.append(exc)
        return out

    def enforced_limit_w(self, uuid: str) -> float:
        """The limit the GPU enforces now (watts): a cheaper read than `read` where the
        backend has one. Raises as `read` does."""
        return self.read(uuid).cap_w

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the library (nvmlShutdown, ...)."""
