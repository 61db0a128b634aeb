"""Bench: what each install costs a host, on disk and in memory.

Builds the wheel (python -m build), installs it into fresh virtual environments as a site
does (`pip install -c constraints.txt WHEEL[EXTRA]`: the base install for GPU nodes,
`[controller]`, `[sim]`) and reports each one's site-packages (pip and setuptools left
out). Then runs `powerd agent` from the base install against a private Mosquitto for
`--duration` seconds and reads its resident memory (VmRSS, and VmHWM: the peak), beside the
same agent with the mock backend (numpy) from the controller install.

There is no GPU here: the base install's agent runs its NVML backend with pynvml's
functions answered by a small stand-in of `--gpus` H100s (NVML_STAND_IN below). The NVIDIA
driver's own library (libnvidia-ml, loaded by nvmlInit) is not in the figure.

    .venv/bin/python bench/install.py [--duration 20] [--gpus 8] [--extras base,controller,sim]

The controller's memory is bench/loop.py's (docs/performance.md, "Steering loop").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from powerd.testing.mosquitto import LocalMosquitto

ROOT = Path(__file__).resolve().parents[1]
NOT_POWERD = {"pip", "setuptools", "_distutils_hack", "distutils-precedence.pth"}

# Run by the base install's python: the agent's NVML backend over a stand-in for pynvml's
# functions (the real module's constants and exception class), then `powerd agent ARGS`.
NVML_STAND_IN = """
import sys
import pynvml
from powerd.backends import nvml

GPUS = int(sys.argv.pop(1))


class StandIn:
    NVMLError = pynvml.NVMLError

    def __init__(self):
        self.limit_mw = [700_000] * GPUS

    def __getattr__(self, name):  # constants only: a function not below is not supported
        if name.startswith("NVML_") or name.startswith("nvmlClocks"):
            return getattr(pynvml, name)
        raise AttributeError(name)

    def nvmlInit(self): pass
    def nvmlShutdown(self): pass
    def nvmlDeviceGetCount(self): return GPUS
    def nvmlDeviceGetHandleByIndex(self, i): return i
    def nvmlDeviceGetHandleByUUID(self, uuid): return int(uuid[-12:])
    def nvmlDeviceGetUUID(self, h): return f"GPU-00000000-0000-0000-0000-{h:012d}"
    def nvmlDeviceGetName(self, h): return "NVIDIA H100 80GB HBM3"
    def nvmlDeviceGetPowerManagementLimitConstraints(self, h): return [200_000, 700_000]
    def nvmlDeviceGetPowerManagementDefaultLimit(self, h): return 700_000
    def nvmlDeviceGetEnforcedPowerLimit(self, h): return self.limit_mw[h]
    def nvmlDeviceSetPowerManagementLimit(self, h, mw): self.limit_mw[h] = mw
    def nvmlDeviceGetPowerUsage(self, h): return min(self.limit_mw[h], 450_000)
    def nvmlDeviceGetTotalEnergyConsumption(self, h): return 10**9
    def nvmlDeviceGetTemperatureV(self, h, *sensor): return 60
    def nvmlDeviceGetUtilizationRates(self, h): return pynvml.c_nvmlUtilization_t(gpu=90, memory=30)
    def nvmlDeviceGetClockInfo(self, h, clock): return 1755
    def nvmlDeviceGetCurrentClocksEventReasons(self, h): return 0


nvml.pynvml = StandIn()
from powerd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def site_packages_mb(venv: Path) -> float:
    (site,) = venv.glob("lib/python3*/site-packages")
    total = 0
    for entry in site.iterdir():
        if entry.name in NOT_POWERD or entry.name.startswith(("pip-", "setuptools-")):
            continue
        files = [entry] if entry.is_file() else [p for p in entry.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total / 1e6


# The installs see nothing of this checkout or of this interpreter's environment.
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def build_wheel(out: Path) -> Path:
    """python -m build --wheel; the build's leftovers in the checkout are removed."""
    leftovers = [p for p in (ROOT / "build", ROOT / "powerd.egg-info") if not p.exists()]
    cmd = [sys.executable, "-m", "build", "--wheel", "--outdir", str(out), str(ROOT)]
    try:
        subprocess.run(cmd, check=True, capture_output=True)
    finally:
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
    (wheel,) = out.glob("powerd-*.whl")
    return wheel


def install(venv: Path, wheel: Path, extra: str) -> dict[str, float]:
    start = time.monotonic()
    subprocess.run(["python3", "-m", "venv", str(venv)], check=True, env=CLEAN_ENV)
    target = str(wheel) if extra == "base" else f"{wheel}[{extra}]"
    pip = [str(venv / "bin" / "pip"), "install", "-q", "-c", str(ROOT / "constraints.txt")]
    subprocess.run([*pip, target], check=True, capture_output=True, env=CLEAN_ENV)
    mb = round(site_packages_mb(venv), 1)
    return {"site_packages_mb": mb, "install_s": round(time.monotonic() - start, 1)}


def memory_kb(pid: int) -> dict[str, int]:
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    fields = dict(line.split(":", 1) for line in status)
    return {k: int(fields[k].split()[0]) for k in ("VmRSS", "VmHWM")}


def run_agent(cmd: list[str], duration_s: float, log: Path) -> dict[str, float]:
    """The agent for duration_s (it connects, samples and publishes each period), then its
    memory; stopped with SIGTERM as systemd stops it."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, cwd=log.parent, env=CLEAN_ENV
        )
        try:
            time.sleep(duration_s)
            if proc.poll() is not None:
                raise SystemExit(f"the agent stopped: {log.read_text()[-2000:]}")
            mem = memory_kb(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=30)
    return {"rss_mb": round(mem["VmRSS"] / 1024, 1), "peak_rss_mb": round(mem["VmHWM"] / 1024, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=20.0, help="seconds each agent runs")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--extras", default="base,controller,sim")
    ap.add_argument("--wheel", help="a built wheel (default: python -m build here)")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="powerd-install-"))
    try:
        wheel = Path(args.wheel).resolve() if args.wheel else build_wheel(work)
        result: dict[str, object] = {"wheel": wheel.name, "wheel_kb": wheel.stat().st_size // 1024}
        extras = args.extras.split(",")
        for extra in extras:
            result[extra] = install(work / extra, wheel, extra)
        broker = LocalMosquitto(work / "mosquitto")
        broker.start()
        try:
            common = ["agent", "--node-id", "n01", "--broker", broker.url, "--period", "1"]
            python = str(work / "base" / "bin" / "python")
            nvml = [python, "-c", NVML_STAND_IN, str(args.gpus), "--log-format", "json", *common]
            result["agent_nvml_base"] = run_agent(nvml, args.duration, work / "nvml.log")
            if "controller" in extras:
                powerd = str(work / "controller" / "bin" / "powerd")
                mock = [powerd, "--log-format", "json", *common, "--backend", "mock"]
                mock += ["--mock-gpus", str(args.gpus)]
                result["agent_mock_controller"] = run_agent(mock, args.duration, work / "mock.log")
        finally:
            broker.kill()
        print(json.dumps(result, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
