"""Read-only NVML check for a real GPU node. Never sets anything.

Prints, for every GPU, what the nvml backend reports (static info and one reading), which
NVML calls the GPU answered NOT_SUPPORTED to, the raw management limit next to the enforced
one (they differ when another tool holds a limit), and how long one read of all GPUs takes.

    .venv/bin/python bench/nvml_probe.py [--reads 50] [--json]

Exit status: 0 all GPUs read, 1 some GPU failed, 2 NVML did not start.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from dataclasses import asdict
from importlib.metadata import version
from typing import Any

import pynvml

from powerd.backends.base import BackendError, DriverNotLoaded
from powerd.backends.nvml import NvmlBackend


def _raw(name: str, *args: Any) -> Any:
    """A direct pynvml call for context only; its failure is shown, not raised."""
    try:
        return getattr(pynvml, name)(*args)
    except Exception as err:  # context only: a failure here must not stop the probe
        return f"<{type(err).__name__}: {err}>"


def _time_reads(backend: NvmlBackend, uuids: list[str], reads: int) -> list[float]:
    """Wall time, in ms, of each read of all GPUs."""
    times_ms = []
    for _ in range(reads):
        start = time.perf_counter()
        for uuid in uuids:
            # A failing GPU was reported above; its attempt still counts in the timing.
            with contextlib.suppress(BackendError):
                backend.read(uuid)
        times_ms.append((time.perf_counter() - start) * 1000.0)
    return times_ms


def probe(backend: NvmlBackend, reads: int) -> tuple[dict[str, Any], bool]:
    report: dict[str, Any] = {
        "nvidia_ml_py": version("nvidia-ml-py"),
        "driver": _raw("nvmlSystemGetDriverVersion"),
        "nvml": _raw("nvmlSystemGetNVMLVersion"),
        "gpus": [],
    }
    all_ok = True
    infos = backend.gpus()
    for info in infos:
        entry: dict[str, Any] = {"info": asdict(info)}
        start = time.perf_counter()
        try:
            entry["reading"] = asdict(backend.read(info.uuid))
        except BackendError as err:
            all_ok = False
            entry["error"] = {"type": type(err).__name__, "code": str(err.code), "msg": str(err)}
        # The first read finds out which calls are unsupported, so it may be slower.
        entry["first_read_ms"] = (time.perf_counter() - start) * 1000.0
        entry["unsupported_calls"] = sorted(backend.unsupported(info.uuid))
        handle = _raw("nvmlDeviceGetHandleByUUID", info.uuid)
        entry["raw_mw"] = {
            "management_limit": _raw("nvmlDeviceGetPowerManagementLimit", handle),
            "enforced_limit": _raw("nvmlDeviceGetEnforcedPowerLimit", handle),
            "power_usage": _raw("nvmlDeviceGetPowerUsage", handle),
        }
        report["gpus"].append(entry)

    times_ms = _time_reads(backend, [i.uuid for i in infos], reads)
    report["read_all_gpus_ms"] = {
        "gpus": len(infos),
        "reads": len(times_ms),
        "min": min(times_ms, default=0.0),
        "median": statistics.median(times_ms) if times_ms else 0.0,
        "max": max(times_ms, default=0.0),
    }
    return report, all_ok


def print_report(report: dict[str, Any]) -> None:
    print(
        f"nvidia-ml-py {report['nvidia_ml_py']}  driver {report['driver']}  NVML {report['nvml']}"
    )
    for entry in report["gpus"]:
        info = entry["info"]
        print(f"\nGPU {info['index']}  {info['uuid']}  {info['name']}")
        print(
            f"  limits: min {info['min_cap_w']} W  max {info['max_cap_w']} W"
            f"  default {info['default_cap_w']} W"
        )
        for key, value in entry.get("reading", {}).items():
            print(f"  {key:>14}: {value}")
        if "error" in entry:
            print(f"  ERROR {entry['error']}")
        print(f"  unsupported calls: {', '.join(entry['unsupported_calls']) or 'none'}")
        print(f"  raw (mW): {entry['raw_mw']}")
        print(f"  first read: {entry['first_read_ms']:.2f} ms")
    t = report["read_all_gpus_ms"]
    print(
        f"\nread of all {t['gpus']} GPUs, {t['reads']} times: min {t['min']:.2f} ms,"
        f" median {t['median']:.2f} ms, max {t['max']:.2f} ms"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reads", type=int, default=50, help="timed reads of all GPUs")
    parser.add_argument("--json", action="store_true", help="print one JSON document")
    args = parser.parse_args()
    try:
        backend = NvmlBackend()
    except DriverNotLoaded as err:
        print(f"NVML did not start: {err}", file=sys.stderr)
        return 2
    try:
        report, all_ok = probe(backend, args.reads)
    finally:
        backend.close()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print_report(report)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
