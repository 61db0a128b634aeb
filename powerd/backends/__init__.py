"""GPU backends: real NVML, and a mock with a physical power model."""

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
)

__all__ = [
    "BackendError",
    "DriverNotLoaded",
    "GpuBackend",
    "GpuInfo",
    "GpuLost",
    "GpuReading",
    "InvalidArgument",
    "NoPermission",
    "NotSupported",
    "UnknownGpu",
]
