"""The layers of docs/architecture.md, checked: what may import what.

Every `import` in powerd/ (at module level or inside a function) must stay in its layer or
below, and the core imports no I/O library. tests/test_engine.py checks the same at run
time: importing the tick engine in a fresh interpreter loads no I/O library.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "powerd"

# Lowest first. A module belongs to the first layer with a prefix that matches its name.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    (
        "core",
        (
            "powerd",  # the package root itself (its version only), not what is below it
            "powerd.wire",
            "powerd.policy",
            "powerd.topology",
            "powerd.allocator",
            "powerd.safety",
            "powerd.snapshot",
            "powerd.profile",
            "powerd.clock",
            "powerd.input_errors",
            "powerd.numeric",
            "powerd.argtypes",
            "powerd.data",  # the embedded example policy (a file, no code)
            "powerd.alarms",
            "powerd.ramp",
            "powerd.backends.base",
            "powerd.controller.tick",
            "powerd.controller.budgets",
            "powerd.controller.targets",
            "powerd.controller.shape",
            "powerd.controller.obedience",
            "powerd.controller.input_alarms",
            "powerd.controller.report",
            "powerd.controller.fleet",
            "powerd.controller.overrides",
            "powerd.controller.jobs",
            "powerd.controller.why",
            "powerd.controller.demand",
            "powerd.controller.churn",
            "powerd.controller.deadband",
            "powerd.controller.meters",
        ),
    ),
    (
        "adapters",
        (
            "powerd.transport",
            "powerd.store",
            "powerd.backends",
            "powerd.metrics",
            "powerd.node_metrics",
            "powerd.sdnotify",
            "powerd.auth",
            "powerd.logs",
            "powerd.outputs",
            "powerd.controller.opstate",
            "powerd.bmc.redfish",
            "powerd.bmc.backend",
            "powerd.bmc.metrics",
        ),
    ),
    (
        "daemons",
        (
            "powerd.settings",
            "powerd.agent",
            "powerd.bmc",
            "powerd.controller",
            "powerd.api",
            "powerd.coordinator",
        ),
    ),
    (
        "tools",
        (
            "powerd.cli",
            "powerd.demo",
            "powerd.profilefit",
            "powerd.sim",
            "powerd.pilot",
            "powerd.chaos",
            "powerd.testing",
        ),
    ),
]
# Libraries that do I/O (network, database, HTTP, GPU driver): never in the core, checked
# here by its imports and in tests/test_engine.py by what importing it loads.
IO_LIBRARIES = (
    "sqlalchemy",
    "alembic",
    "psycopg",
    "aiomqtt",
    "paho",
    "fastapi",
    "starlette",
    "uvicorn",
    "httpx",
    "prometheus_client",
    "pynvml",
    "grpc",
)


def layer_of(module: str) -> int:
    best, best_len = -1, -1
    for rank, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            below = p != "powerd" and module.startswith(p + ".")
            if (module == p or below) and len(p) > best_len:
                best, best_len = rank, len(p)
    if best < 0:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS and the docs")
    return best


def modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports_of(module: str, path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
    return found


def test_every_import_stays_in_its_layer_or_below() -> None:
    mods = modules()
    wrong = []
    for module, path in sorted(mods.items()):
        mine = layer_of(module)
        for name in sorted(imports_of(module, path)):
            if name.split(".")[0] in IO_LIBRARIES and mine == 0:
                wrong.append(f"{module} (core) imports the I/O library {name}")
            if name.startswith("powerd.") and name in mods and layer_of(name) > mine:
                wrong.append(
                    f"{module} ({LAYERS[mine][0]}) imports {name} ({LAYERS[layer_of(name)][0]})"
                )
    assert not wrong, "\n".join(wrong)
