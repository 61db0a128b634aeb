"""The NVML adapter, call by call, against an autospec double of `pynvml` (no GPU needed).

Autospec keeps the real signatures, so a call with the wrong arguments fails here as it
would on a GPU node. Errors are real `pynvml.NVMLError` instances.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import pynvml
import pytest
from structlog.testing import capture_logs

from powerd.backends import nvml as nvml_module
from powerd.backends.base import (
    BackendError,
    DriverNotLoaded,
    GpuInfo,
    GpuLost,
    InvalidArgument,
    NoPermission,
    NotSupported,
    UnknownGpu,
    throttle_reasons,
)
from powerd.backends.nvml import NvmlBackend
from powerd.clock import ManualClock
from powerd.wire import AckError

H0 = mock.sentinel.handle0
H1 = mock.sentinel.handle1
UUID0 = "GPU-00000000-1111-2222-3333-444444444444"
UUID1 = "GPU-99999999-8888-7777-6666-555555555555"


def answers(by_handle: dict[object, object]) -> Callable[..., object]:
    """A side effect answering per device handle; an exception in the table is raised."""

    def answer(handle: object, *args: object) -> object:
        value = by_handle[handle]
        if isinstance(value, BaseException):
            raise value
        return value

    return answer


def per_gpu(fn: mock.MagicMock, gpu0: object, gpu1: object) -> None:
    fn.side_effect = answers({H0: gpu0, H1: gpu1})


@pytest.fixture
def nvml(monkeypatch: pytest.MonkeyPatch) -> Iterator[mock.MagicMock]:
    """pynvml with every function an autospec double; two healthy GPUs behind it."""
    fake = mock.create_autospec(pynvml)
    # Codes, enums and the exception class stay NVML's own: they are data, not behaviour.
    for name, value in vars(pynvml).items():
        if isinstance(value, int) and not name.startswith("_"):
            setattr(fake, name, value)
    fake.NVMLError = pynvml.NVMLError

    fake.nvmlDeviceGetCount.return_value = 2
    fake.nvmlDeviceGetHandleByIndex.side_effect = [H0, H1].__getitem__
    by_uuid = {UUID0: H0, UUID1: H1}
    fake.nvmlDeviceGetHandleByUUID.side_effect = lambda u: by_uuid[u]
    # Older nvidia-ml-py hands back bytes, newer str: one GPU each.
    per_gpu(fake.nvmlDeviceGetUUID, UUID0, UUID1.encode())
    per_gpu(fake.nvmlDeviceGetName, "NVIDIA H100 80GB HBM3", b"NVIDIA A100-SXM4-40GB")
    per_gpu(
        fake.nvmlDeviceGetPowerManagementLimitConstraints, [200_000, 700_000], [100_000, 400_000]
    )
    per_gpu(fake.nvmlDeviceGetPowerManagementDefaultLimit, 700_000, 400_000)
    per_gpu(fake.nvmlDeviceGetEnforcedPowerLimit, 650_000, 350_000)
    per_gpu(fake.nvmlDeviceGetPowerManagementLimit, 650_000, 350_000)
    per_gpu(fake.nvmlDeviceGetPowerUsage, 350_123, 120_000)
    per_gpu(fake.nvmlDeviceGetTotalEnergyConsumption, 123_456_789, 5_000)
    per_gpu(fake.nvmlDeviceGetTemperatureV, 65, 40)
    per_gpu(fake.nvmlDeviceGetTemperature, 99, 99)  # legacy: must not be used when V works
    per_gpu(
        fake.nvmlDeviceGetUtilizationRates,
        pynvml.c_nvmlUtilization_t(gpu=87, memory=30),
        pynvml.c_nvmlUtilization_t(gpu=3, memory=1),
    )
    per_gpu(fake.nvmlDeviceGetClockInfo, 1755, 210)
    per_gpu(
        fake.nvmlDeviceGetCurrentClocksEventReasons,
        pynvml.nvmlClocksEventReasonSwPowerCap | pynvml.nvmlClocksEventReasonHwThermalSlowdown,
        pynvml.nvmlClocksEventReasonGpuIdle,
    )
    per_gpu(fake.nvmlDeviceGetCurrentClocksThrottleReasons, 0x8, 0x8)
    monkeypatch.setattr(nvml_module, "pynvml", fake)
    yield fake


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def backend(nvml: mock.MagicMock, clock: ManualClock) -> Iterator[NvmlBackend]:
    b = NvmlBackend(clock=clock)
    yield b
    b.close()


def not_supported() -> pynvml.NVMLError:
    return pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)


# --- start and stop ---------------------------------------------------------------------------


def test_init_starts_nvml_and_close_shuts_it_down_once(nvml: mock.MagicMock) -> None:
    backend = NvmlBackend()
    nvml.nvmlInit.assert_called_once_with()
    nvml.nvmlShutdown.assert_not_called()
    backend.close()
    backend.close()
    nvml.nvmlShutdown.assert_called_once_with()


@pytest.mark.parametrize(
    ("code", "hint"),
    [
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, "NVIDIA driver loaded"),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, "libnvidia-ml.so.1"),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, "reboot"),
    ],
)
def test_init_without_driver_raises_driver_not_loaded(
    nvml: mock.MagicMock, code: int, hint: str
) -> None:
    nvml.nvmlInit.side_effect = pynvml.NVMLError(code)
    with pytest.raises(DriverNotLoaded, match=hint) as caught:
        NvmlBackend()
    assert caught.value.code == AckError.GPU_LOST
    assert "nvmlInit" in str(caught.value)


def test_close_does_not_raise_when_shutdown_fails(nvml: mock.MagicMock) -> None:
    nvml.nvmlShutdown.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_UNINITIALIZED)
    backend = NvmlBackend()
    with capture_logs() as logs:
        backend.close()
    assert [e["event"] for e in logs] == ["nvml_shutdown_failed"]


def test_calls_after_close_raise_driver_not_loaded(backend: NvmlBackend) -> None:
    backend.close()
    with pytest.raises(DriverNotLoaded):
        backend.gpus()


# --- discovery --------------------------------------------------------------------------------


def test_gpus_reports_identity_and_limits_in_watts(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    assert backend.gpus() == [
        GpuInfo(UUID0, 0, "NVIDIA H100 80GB HBM3", 200.0, 700.0, 700.0),
        GpuInfo(UUID1, 1, "NVIDIA A100-SXM4-40GB", 100.0, 400.0, 400.0),
    ]
    assert nvml.nvmlDeviceGetHandleByIndex.call_args_list == [mock.call(0), mock.call(1)]
    nvml.nvmlDeviceGetPowerManagementLimitConstraints.assert_any_call(H1)


def test_handles_are_looked_up_once(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    backend.gpus()
    backend.read(UUID0)
    backend.read(UUID1)
    backend.set_power_limit_w(UUID0, 500.0)
    backend.gpus()
    nvml.nvmlDeviceGetCount.assert_called_once_with()
    assert nvml.nvmlDeviceGetHandleByIndex.call_count == 2
    assert nvml.nvmlDeviceGetUUID.call_count == 2


def test_default_limit_not_supported_falls_back_to_max(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetPowerManagementDefaultLimit, not_supported(), 400_000)
    assert backend.gpus()[0].default_cap_w == 700.0


def test_gpu_without_settable_limit_gets_a_fixed_cap(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetPowerManagementLimitConstraints, not_supported(), [1, 2])
    info = backend.gpus()[0]
    assert (info.min_cap_w, info.max_cap_w, info.default_cap_w) == (650.0, 650.0, 650.0)


def test_gpu_lost_during_discovery_is_skipped_not_fatal(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetUUID, pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST), UUID1)
    with capture_logs() as logs:
        assert [g.uuid for g in backend.gpus()] == [UUID1]
    assert logs[0]["event"] == "nvml_gpu_skipped"
    assert logs[0]["index"] == 0
    assert backend.read(UUID1).power_w == 120.0


def test_driver_gone_during_discovery_is_raised(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    per_gpu(nvml.nvmlDeviceGetName, pynvml.NVMLError(pynvml.NVML_ERROR_DRIVER_NOT_LOADED), "x")
    with pytest.raises(DriverNotLoaded):
        backend.gpus()


def test_unknown_uuid(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    with pytest.raises(UnknownGpu) as caught:
        backend.read("GPU-not-here")
    assert caught.value.uuid == "GPU-not-here"
    with pytest.raises(UnknownGpu):
        backend.set_power_limit_w("GPU-not-here", 300.0)
    nvml.nvmlDeviceSetPowerManagementLimit.assert_not_called()


# --- reading ----------------------------------------------------------------------------------


def test_read_converts_units_and_calls_nvml_as_documented(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    r = backend.read(UUID0)
    assert r.uuid == UUID0
    assert r.index == 0
    assert r.power_w == pytest.approx(350.123)  # mW -> W
    assert r.energy_j == pytest.approx(123_456.789)  # mJ -> J
    assert r.cap_w == 650.0  # the enforced limit, not the default or management one
    assert r.requested_w == 650.0  # the management limit: what a lower limit lifts to
    assert r.temp_c == 65.0
    assert r.util_pct == 87.0
    assert r.sm_clock_mhz == 1755.0
    assert r.throttle == ["sw_power_cap", "hw_thermal"]
    nvml.nvmlDeviceGetEnforcedPowerLimit.assert_called_with(H0)
    nvml.nvmlDeviceGetPowerManagementLimit.assert_called_with(H0)
    nvml.nvmlDeviceGetTemperatureV.assert_called_once_with(H0, pynvml.NVML_TEMPERATURE_GPU)
    nvml.nvmlDeviceGetTemperature.assert_not_called()
    nvml.nvmlDeviceGetClockInfo.assert_called_once_with(H0, pynvml.NVML_CLOCK_SM)
    nvml.nvmlDeviceGetCurrentClocksThrottleReasons.assert_not_called()
    assert backend.unsupported(UUID0) == frozenset()


def test_read_of_one_gpu_touches_only_its_handle(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    backend.gpus()
    nvml.reset_mock()
    backend.read(UUID1)
    handles = {c.args[0] for c in nvml.method_calls if c.args}
    assert handles == {H1}


@pytest.mark.parametrize(
    ("name", "bit"),
    [
        ("gpu_idle", pynvml.nvmlClocksEventReasonGpuIdle),
        ("applications_clocks", pynvml.nvmlClocksEventReasonApplicationsClocksSetting),
        ("sw_power_cap", pynvml.nvmlClocksEventReasonSwPowerCap),
        ("hw_slowdown", pynvml.nvmlClocksEventReasonHwSlowdown),
        ("sync_boost", pynvml.nvmlClocksEventReasonSyncBoost),
        ("sw_thermal", pynvml.nvmlClocksEventReasonSwThermalSlowdown),
        ("hw_thermal", pynvml.nvmlClocksEventReasonHwThermalSlowdown),
        ("hw_power_brake", pynvml.nvmlClocksEventReasonHwPowerBrakeSlowdown),
        ("display_clocks", pynvml.nvmlClocksEventReasonDisplayClockSetting),
        ("board_limit", pynvml.nvmlClocksThrottleReasonBoardLimit),
        ("reliability", pynvml.nvmlClocksThrottleReasonReliability),
    ],
)
def test_throttle_reason_bits_match_pynvml(name: str, bit: int) -> None:
    assert throttle_reasons(bit) == [name]


def test_throttle_reasons_keep_unknown_bits() -> None:
    assert throttle_reasons(0) == []
    assert throttle_reasons(0x4 | 0x8000) == ["sw_power_cap", "unknown_0x8000"]


def test_throttle_falls_back_to_legacy_call_on_old_driver(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    nvml.nvmlDeviceGetCurrentClocksEventReasons.side_effect = pynvml.NVMLError(
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND
    )
    assert backend.read(UUID0).throttle == ["hw_slowdown"]
    assert backend.read(UUID0).throttle == ["hw_slowdown"]
    nvml.nvmlDeviceGetCurrentClocksEventReasons.assert_called_once_with(H0)
    assert nvml.nvmlDeviceGetCurrentClocksThrottleReasons.call_count == 2


def test_calls_missing_from_nvidia_ml_py_fall_back(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    # Older nvidia-ml-py lacks the new names; a future one drops the deprecated ones.
    del nvml.nvmlDeviceGetCurrentClocksEventReasons
    del nvml.nvmlDeviceGetTemperatureV
    r = backend.read(UUID0)
    assert r.throttle == ["hw_slowdown"]
    assert r.temp_c == 99.0
    assert backend.unsupported(UUID0) == {
        "nvmlDeviceGetCurrentClocksEventReasons",
        "nvmlDeviceGetTemperatureV",
    }


OPTIONAL_CALLS = (
    "nvmlDeviceGetTotalEnergyConsumption",
    "nvmlDeviceGetTemperatureV",
    "nvmlDeviceGetTemperature",
    "nvmlDeviceGetUtilizationRates",
    "nvmlDeviceGetClockInfo",
    "nvmlDeviceGetCurrentClocksEventReasons",
    "nvmlDeviceGetCurrentClocksThrottleReasons",
)


def test_unsupported_fields_degrade_and_are_not_asked_again(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    for call in OPTIONAL_CALLS:
        per_gpu(getattr(nvml, call), not_supported(), not_supported())
    with capture_logs() as logs:
        first = backend.read(UUID0)
        second = backend.read(UUID0)
    for r in (first, second):
        assert (r.temp_c, r.util_pct, r.sm_clock_mhz, r.throttle) == (0.0, 0.0, 0.0, [])
        assert r.power_w == pytest.approx(350.123)
        assert r.cap_w == 650.0
    for call in OPTIONAL_CALLS:
        assert getattr(nvml, call).call_count == 1, call
    assert backend.unsupported(UUID0) == set(OPTIONAL_CALLS)
    assert backend.unsupported(UUID1) == frozenset()  # remembered per GPU
    assert sorted(e["call"] for e in logs if e["event"] == "nvml_call_unsupported") == sorted(
        OPTIONAL_CALLS
    )


def test_energy_is_integrated_from_power_without_a_counter(
    backend: NvmlBackend, nvml: mock.MagicMock, clock: ManualClock
) -> None:
    nvml.nvmlDeviceGetTotalEnergyConsumption.side_effect = not_supported()
    energies = []
    for power_mw, dt_s in [(200_000, 0.0), (300_000, 2.0), (300_000, 1.0), (0, 4.0)]:
        clock.advance(dt_s)
        nvml.nvmlDeviceGetPowerUsage.side_effect = None
        nvml.nvmlDeviceGetPowerUsage.return_value = power_mw
        energies.append(backend.read(UUID0).energy_j)
    # Trapezoids: (200+300)/2*2 = 500, +300*1 = 800, +(300+0)/2*4 = 1400.
    assert energies == pytest.approx([0.0, 500.0, 800.0, 1400.0])


def test_power_not_supported_counts_as_drawing_the_cap(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetPowerUsage, not_supported(), 120_000)
    assert backend.read(UUID0).power_w == 650.0


def test_enforced_limit_not_supported_reads_as_max(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    backend.gpus()
    per_gpu(nvml.nvmlDeviceGetEnforcedPowerLimit, not_supported(), 350_000)
    assert backend.read(UUID0).cap_w == 700.0


def test_lost_gpu_fails_its_own_reading_only(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    per_gpu(nvml.nvmlDeviceGetPowerUsage, 350_000, lost)
    per_gpu(nvml.nvmlDeviceSetPowerManagementLimit, None, lost)
    with pytest.raises(GpuLost) as caught:
        backend.read(UUID1)
    assert caught.value.uuid == UUID1
    with pytest.raises(GpuLost):
        backend.set_power_limit_w(UUID1, 300.0)
    assert backend.read(UUID0).power_w == 350.0
    assert backend.set_power_limit_w(UUID0, 500.0) == 650.0
    assert [g.uuid for g in backend.gpus()] == [UUID0, UUID1]


def test_a_gpu_back_under_a_new_handle_is_found_by_its_uuid(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    """A reset or re-attach: the old handle answers GPU_IS_LOST, NVML knows the UUID under
    a new handle, and the GPU is read and set through that one (limit back at default)."""
    backend.gpus()
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    h2 = mock.sentinel.handle2
    for name, old, new in [
        ("nvmlDeviceGetEnforcedPowerLimit", lost, 400_000),
        ("nvmlDeviceGetPowerUsage", lost, 90_000),
        ("nvmlDeviceSetPowerManagementLimit", lost, None),
        ("nvmlDeviceGetPowerManagementLimit", lost, 400_000),
    ]:
        getattr(nvml, name).side_effect = answers({H0: 650_000, H1: old, h2: new})
    for name in ("nvmlDeviceGetTotalEnergyConsumption", "nvmlDeviceGetTemperatureV"):
        getattr(nvml, name).side_effect = answers({H0: 1, H1: lost, h2: 2})
    nvml.nvmlDeviceGetUtilizationRates.side_effect = answers(
        {H1: lost, h2: pynvml.c_nvmlUtilization_t(gpu=5, memory=1)}
    )
    nvml.nvmlDeviceGetClockInfo.side_effect = answers({H1: lost, h2: 300})
    nvml.nvmlDeviceGetCurrentClocksEventReasons.side_effect = answers({H1: lost, h2: 0})
    nvml.nvmlDeviceGetHandleByUUID.side_effect = {UUID1: h2}.__getitem__
    reading = backend.read(UUID1)
    assert (reading.cap_w, reading.power_w, reading.requested_w) == (400.0, 90.0, 400.0)
    nvml.nvmlDeviceGetHandleByUUID.assert_called_once_with(UUID1)
    assert backend.set_power_limit_w(UUID1, 300.0) == 400.0  # the mock's enforced limit
    nvml.nvmlDeviceSetPowerManagementLimit.assert_called_with(h2, 300_000)
    assert backend.enforced_limit_w(UUID1) == 400.0
    assert nvml.nvmlDeviceGetHandleByUUID.call_count == 1  # the new handle is kept


def test_a_gpu_nvml_no_longer_knows_stays_lost(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    backend.gpus()
    lost = pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)
    per_gpu(nvml.nvmlDeviceGetEnforcedPowerLimit, 650_000, lost)
    nvml.nvmlDeviceGetHandleByUUID.side_effect = pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
    with pytest.raises(GpuLost):
        backend.read(UUID1)
    with pytest.raises(GpuLost):
        backend.enforced_limit_w(UUID1)


# --- setting the limit ------------------------------------------------------------------------


def test_set_sends_milliwatts_then_returns_enforced_limit(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    backend.gpus()
    nvml.reset_mock()
    nvml.nvmlDeviceGetEnforcedPowerLimit.side_effect = None
    nvml.nvmlDeviceGetEnforcedPowerLimit.return_value = 350_500
    assert backend.set_power_limit_w(UUID0, 350.5) == 350.5
    assert nvml.method_calls == [
        mock.call.nvmlDeviceSetPowerManagementLimit(H0, 350_500),
        mock.call.nvmlDeviceGetEnforcedPowerLimit(H0),
    ]
    sent = nvml.nvmlDeviceSetPowerManagementLimit.call_args.args[1]
    assert type(sent) is int


def test_set_returns_enforced_limit_when_another_tool_overrides(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetEnforcedPowerLimit, 300_000, 350_000)
    assert backend.set_power_limit_w(UUID0, 600.0) == 300.0
    nvml.nvmlDeviceSetPowerManagementLimit.assert_called_once_with(H0, 600_000)


@pytest.mark.parametrize("watts", [199.999, 700.001, 0.0, -1.0, math.nan, math.inf])
def test_set_outside_constraints_is_rejected_before_nvml(
    backend: NvmlBackend, nvml: mock.MagicMock, watts: float
) -> None:
    with pytest.raises(InvalidArgument) as caught:
        backend.set_power_limit_w(UUID0, watts)
    assert caught.value.uuid == UUID0
    nvml.nvmlDeviceSetPowerManagementLimit.assert_not_called()


@pytest.mark.parametrize(("watts", "milliwatts"), [(200.0, 200_000), (700.0, 700_000)])
def test_set_accepts_the_constraint_bounds(
    backend: NvmlBackend, nvml: mock.MagicMock, watts: float, milliwatts: int
) -> None:
    backend.set_power_limit_w(UUID0, watts)
    nvml.nvmlDeviceSetPowerManagementLimit.assert_called_once_with(H0, milliwatts)


def test_constraints_are_per_gpu(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    with pytest.raises(InvalidArgument):
        backend.set_power_limit_w(UUID1, 500.0)  # fine on GPU 0, above GPU 1's 400 W
    backend.set_power_limit_w(UUID1, 100.0)
    nvml.nvmlDeviceSetPowerManagementLimit.assert_called_once_with(H1, 100_000)


# --- error translation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "expected", "ack"),
    [
        (pynvml.NVML_ERROR_NO_PERMISSION, NoPermission, AckError.NO_PERMISSION),
        (pynvml.NVML_ERROR_NOT_SUPPORTED, NotSupported, AckError.NOT_SUPPORTED),
        (pynvml.NVML_ERROR_FUNCTION_NOT_FOUND, NotSupported, AckError.NOT_SUPPORTED),
        (pynvml.NVML_ERROR_GPU_IS_LOST, GpuLost, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_UNKNOWN, GpuLost, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_RESET_REQUIRED, GpuLost, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_DRIVER_NOT_LOADED, DriverNotLoaded, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_LIBRARY_NOT_FOUND, DriverNotLoaded, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_UNINITIALIZED, DriverNotLoaded, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_LIB_RM_VERSION_MISMATCH, DriverNotLoaded, AckError.GPU_LOST),
        (pynvml.NVML_ERROR_INVALID_ARGUMENT, InvalidArgument, AckError.SET_FAILED),
        (pynvml.NVML_ERROR_TIMEOUT, BackendError, AckError.SET_FAILED),
        (pynvml.NVML_ERROR_IN_USE, BackendError, AckError.SET_FAILED),
        (pynvml.NVML_ERROR_INSUFFICIENT_POWER, BackendError, AckError.SET_FAILED),
    ],
)
def test_every_nvml_error_becomes_a_project_error(
    backend: NvmlBackend,
    nvml: mock.MagicMock,
    code: int,
    expected: type[BackendError],
    ack: AckError,
) -> None:
    vendor = pynvml.NVMLError(code)
    nvml.nvmlDeviceSetPowerManagementLimit.side_effect = vendor
    with pytest.raises(BackendError) as caught:
        backend.set_power_limit_w(UUID0, 300.0)
    err = caught.value
    assert type(err) is expected
    assert not isinstance(err, pynvml.NVMLError)
    assert err.code == ack
    assert err.uuid == UUID0
    assert f"nvmlDeviceSetPowerManagementLimit on {UUID0}: {vendor}" in str(err)
    nvml.nvmlDeviceGetEnforcedPowerLimit.assert_not_called()  # no read-back after a failure


def test_no_permission_says_what_is_needed(backend: NvmlBackend, nvml: mock.MagicMock) -> None:
    nvml.nvmlDeviceSetPowerManagementLimit.side_effect = pynvml.NVMLError(
        pynvml.NVML_ERROR_NO_PERMISSION
    )
    with pytest.raises(NoPermission, match="root or CAP_SYS_ADMIN"):
        backend.set_power_limit_w(UUID0, 300.0)


def test_errors_while_reading_are_translated_too(
    backend: NvmlBackend, nvml: mock.MagicMock
) -> None:
    per_gpu(nvml.nvmlDeviceGetClockInfo, pynvml.NVMLError(pynvml.NVML_ERROR_TIMEOUT), 210)
    with pytest.raises(BackendError, match="nvmlDeviceGetClockInfo") as caught:
        backend.read(UUID0)
    assert type(caught.value) is BackendError


# --- the read-only probe in bench/ (run on real GPUs later; here it must simply work) ---------


def test_probe_reads_everything_and_sets_nothing(
    backend: NvmlBackend,
    nvml: mock.MagicMock,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    path = Path(__file__).parents[1] / "bench" / "nvml_probe.py"
    spec = importlib.util.spec_from_file_location("nvml_probe", path)
    assert spec is not None and spec.loader is not None
    probe_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(probe_module)
    monkeypatch.setattr(probe_module, "pynvml", nvml)
    per_gpu(nvml.nvmlDeviceGetClockInfo, 1755, not_supported())
    nvml.nvmlDeviceGetHandleByUUID.side_effect = {UUID0: H0, UUID1: H1}.__getitem__
    nvml.nvmlDeviceGetPowerManagementLimit.side_effect = answers({H0: 700_000, H1: 400_000})

    report, all_ok = probe_module.probe(backend, reads=3)

    assert all_ok
    assert [g["reading"]["power_w"] for g in report["gpus"]] == [350.123, 120.0]
    assert [g["unsupported_calls"] for g in report["gpus"]] == [[], ["nvmlDeviceGetClockInfo"]]
    assert report["gpus"][1]["raw_mw"]["management_limit"] == 400_000
    assert report["read_all_gpus_ms"]["reads"] == 3
    nvml.nvmlDeviceSetPowerManagementLimit.assert_not_called()
    assert not [c for c in nvml.method_calls if "Set" in c[0]]
    probe_module.print_report(report)
    out = capsys.readouterr().out
    assert UUID1 in out
    assert "unsupported calls: nvmlDeviceGetClockInfo" in out
