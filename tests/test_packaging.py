"""The package as installed: every sub-package listed, migrations and example shipped."""

from __future__ import annotations

import fnmatch
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

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
