"""The package as installed: every sub-package listed, migrations and example shipped."""

from __future__ import annotations

import tomllib
from pathlib import Path

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
