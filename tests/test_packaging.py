"""The package as installed: every sub-package listed, migrations and example shipped; the
base install (the node agent and the CLI client) without the extras' libraries."""

from __future__ import annotations

import contextlib
import fnmatch
import importlib.metadata
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import httpx
import pytest

from powerd.cli.extras import EXTRAS
from powerd.testing.mosquitto import LocalMosquitto, free_port

ROOT = Path(__file__).resolve().parents[1]


def test_every_subpackage_is_listed_in_pyproject() -> None:
    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    on_disk = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "powerd").rglob("__init__.py")
    }
    assert on_disk <= listed, f"add to [tool.setuptools].packages: {sorted(on_disk - listed)}"
    assert {"powerd._migrations", "powerd._migrations.versions"} <= listed


def test_embedded_example_policy_is_the_shipped_file() -> None:
    embedded = ROOT / "powerd" / "data" / "example.yaml"
    assert embedded.read_text() == (ROOT / "policies" / "example.yaml").read_text()


def test_the_live_page_ships_as_package_data() -> None:
    # A wheel holds a package's non-Python files only where package-data names them.
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    patterns = data["package-data"]["powerd.api"]
    files = [p for p in (ROOT / "powerd" / "api" / "ui").iterdir() if p.is_file()]
    assert {"index.html", "app.js", "app.css"} <= {p.name for p in files}
    for p in files:
        rel = p.relative_to(ROOT / "powerd" / "api").as_posix()
        assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), f"{rel} would not ship"


@pytest.mark.process
def test_the_command_line_and_the_allocator_load_numba_only_to_solve() -> None:
    """Agents start through powerd.cli and never solve: numba (~0.5 s, ~75 MB) must load
    with the first solve only."""
    code = (
        "import sys\n"
        "import powerd.cli, powerd.agent.main, powerd.allocator\n"
        "assert 'numba' not in sys.modules, 'imported'\n"
        "from powerd.allocator import kernel\n"
        "assert 'numba' in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.mark.process
def test_commands_run_blas_single_threaded_unless_told_otherwise() -> None:
    """powerd sets OpenBLAS and MKL to one thread before numpy loads (powerd/__init__.py):
    with two BLAS threads on a busy two-core host a Newton system of 400 groups took 94 ms
    instead of 2 and a tick 8.5 s. A value in the environment wins."""
    import os

    code = (
        "import sys, powerd.cli, numpy, os; "
        "print(os.environ['OPENBLAS_NUM_THREADS'], os.environ['MKL_NUM_THREADS'])"
    )
    env = {k: v for k, v in os.environ.items() if not k.endswith("_NUM_THREADS")}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    assert out.stdout.split() == ["1", "1"]
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "OPENBLAS_NUM_THREADS": "4"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout.split() == ["4", "1"]


# --- the base install: the node agent and the admin API's client ------------------------------

# What the base install must neither install nor load (the list, with the libraries
# that come with them): every GPU node runs the agent.
HEAVY = (
    "numpy",
    "numba",
    "llvmlite",
    "scipy",
    "cvxpy",
    "clarabel",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "fastapi",
    "starlette",
    "uvicorn",
    "matplotlib",
)


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _name(requirement: str) -> str:
    """A requirement's distribution name, normalised (PEP 503), without extras or versions."""
    name = re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0]
    return re.sub(r"[-_.]+", "-", name).lower()


def _requirements(extra: str) -> list[str]:
    """An extra's requirements, the extras it names (`powerd[a,b]`) resolved."""
    out = []
    for req in _pyproject()["optional-dependencies"][extra]:
        if _name(req) == "powerd":
            inner = req[req.index("[") + 1 : req.index("]")]
            out += [r for e in inner.split(",") for r in _requirements(e.strip())]
        else:
            out.append(req)
    return out


def test_the_base_install_requires_none_of_the_extras_libraries() -> None:
    base = {_name(r) for r in _pyproject()["dependencies"]}
    assert "nvidia-ml-py" in base  # the agent's NVML
    assert base.isdisjoint({*HEAVY, "psycopg-binary"}), base & {*HEAVY}


def test_each_extra_installs_the_modules_the_cli_checks_for() -> None:
    """powerd/cli/extras.py names each extra's modules (a command checks them before it
    starts): they are the import names of what pyproject.toml's extra installs."""
    provides: dict[str, set[str]] = {}
    for module, dists in importlib.metadata.packages_distributions().items():
        for dist in dists:
            provides.setdefault(_name(dist), set()).add(module)
    for extra, modules in EXTRAS.items():
        installed = set().union(*(provides[_name(r)] for r in _requirements(extra)))
        assert set(modules) <= installed, f"{extra}: {set(modules) - installed}"
        for req in _requirements(extra):  # each requirement is checked through a module
            assert provides[_name(req)] & set(modules), f"{extra}: {req} has no module listed"
    assert {_name(r) for r in _requirements("all")} >= {_name(r) for r in _requirements("sim")}
    test = {_name(r) for r in _requirements("test")}
    assert {_name(r) for r in _requirements("all")} <= test


# Runs the agent as `powerd agent` does (the command line, its settings, the NVML backend,
# the broker, its /metrics) with pynvml's functions answered by an autospec double of one
# H100, as tests/test_backend_nvml.py does; prints what it loaded once SIGTERM stops it.
AGENT = """
import json, sys
from unittest import mock
import pynvml
from powerd.backends import nvml

fake = mock.create_autospec(pynvml)
for name, value in vars(pynvml).items():
    if isinstance(value, int) and not name.startswith("_"):
        setattr(fake, name, value)
fake.NVMLError = pynvml.NVMLError
fake.nvmlDeviceGetCount.return_value = 1
fake.nvmlDeviceGetUUID.return_value = "GPU-00000000-1111-2222-3333-444444444444"
fake.nvmlDeviceGetName.return_value = "NVIDIA H100 80GB HBM3"
fake.nvmlDeviceGetPowerManagementLimitConstraints.return_value = [200_000, 700_000]
fake.nvmlDeviceGetPowerManagementDefaultLimit.return_value = 700_000
fake.nvmlDeviceGetEnforcedPowerLimit.return_value = 700_000
fake.nvmlDeviceGetPowerUsage.return_value = 350_000
fake.nvmlDeviceGetTotalEnergyConsumption.return_value = 123_456_789
fake.nvmlDeviceGetTemperatureV.return_value = 60
fake.nvmlDeviceGetUtilizationRates.return_value = pynvml.c_nvmlUtilization_t(gpu=90, memory=30)
fake.nvmlDeviceGetClockInfo.return_value = 1755
fake.nvmlDeviceGetCurrentClocksEventReasons.return_value = 0
fake.nvmlDeviceSetPowerManagementLimit.side_effect = (
    lambda handle, mw: setattr(fake.nvmlDeviceGetEnforcedPowerLimit, "return_value", mw)
)
nvml.pynvml = fake

from powerd.cli import main
for help_of in (["--help"], ["agent", "--help"], ["status", "--help"]):
    try:
        main(help_of)
    except SystemExit:
        pass
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "loaded": sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)}))
"""


@pytest.mark.process
@pytest.mark.broker
def test_a_running_agent_and_the_clients_help_load_none_of_the_extras_libraries(
    mosquitto: LocalMosquitto, tmp_path: Path
) -> None:
    """`powerd --help`, `agent --help`, `status --help`, then `powerd agent` itself, through
    a real broker, its telemetry loop and its /metrics, in a fresh interpreter: none of the
    controller's or the simulator's libraries is loaded (sys.modules)."""
    port = free_port()
    args = ["agent", "--node-id", "n01", "--broker", mosquitto.url, "--period", "0.2"]
    proc = subprocess.Popen(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{AGENT}", *args, "--metrics-port", str(port)],
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        text = ""
        deadline = time.monotonic() + 60
        while "DCGM_FI_DEV_POWER_USAGE{" not in text and time.monotonic() < deadline:
            time.sleep(0.1)
            with contextlib.suppress(httpx.TransportError):
                text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        assert 'DCGM_FI_DEV_POWER_USAGE{Hostname="n01"' in text
        assert "DCGM_FI_DEV_ENFORCED_POWER_LIMIT{" in text
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert result == {"rc": 0, "loaded": []}


# A base install simulated in a fresh interpreter: the extras' libraries cannot be imported.
WITHOUT_EXTRAS = """
import sys
for name in HEAVY:
    sys.modules[name] = None  # `import` fails, find_spec answers None: as if not installed
from powerd.cli import main
sys.exit(main(sys.argv[1:]))
"""


def _without_extras(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", f"HEAVY = {HEAVY!r}\n{WITHOUT_EXTRAS}", *args],
        cwd=cwd,
        env=os.environ | {"PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.mark.process
@pytest.mark.parametrize(
    ("args", "what", "extra"),
    [
        (["controller", "--policy", "p.yaml"], "powerd controller", "controller"),
        (["coordinator", "--policy", "p.yaml"], "powerd coordinator", "controller"),
        (["db", "upgrade", "--db", "sqlite:///x.db"], "powerd db upgrade", "controller"),
        (["policy", "check", "p.yaml"], "powerd policy check", "controller"),
        (["solve", "--policy", "p.yaml", "--snapshot", "s.json"], "powerd solve", "controller"),
        (["demo"], "powerd demo", "sim"),
        (["sim", "s.yaml"], "powerd sim", "sim"),
        (["sim", "s.yaml", "--overload", "5:30"], "powerd sim", "sim"),
        (
            ["profile", "fit", "x.csv", "--power", "w", "--throughput", "t"],
            "powerd profile fit",
            "sim",
        ),
        (["agent", "--node-id", "n01", "--backend", "mock"], "powerd agent --backend mock", "sim"),
        (
            [
                *("pilot", "report", "--db", "sqlite:///x.db"),
                *("--baseline", "2026-11-02T00:00Z..2026-11-03T00:00Z"),
                *("--managed", "2026-11-09T00:00Z..2026-11-10T00:00Z"),
            ],
            "powerd pilot report",
            "sim",
        ),
    ],
)
def test_a_command_whose_extra_is_missing_says_which_in_one_line(
    args: list[str], what: str, extra: str, tmp_path: Path
) -> None:
    out = _without_extras(*args, cwd=tmp_path)
    assert out.returncode == 2
    assert out.stdout == ""
    assert out.stderr.startswith(f"{what}: needs the `{extra}` extra (numpy")
    assert out.stderr.count("\n") == 1  # one line, no traceback
    assert f"pip install 'powerd[{extra}]'" in out.stderr
    assert list(tmp_path.iterdir()) == []  # refused before it started: no database, no file
