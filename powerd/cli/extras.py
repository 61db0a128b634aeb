"""Which of powerd's extras a command needs, and one clear line when it is not installed.

`pip install powerd` is the node agent (NVML) and the admin API's client: on every GPU node,
without numpy, numba, SciPy, cvxpy, SQLAlchemy, FastAPI or matplotlib. The rest comes with
extras (pyproject.toml; README, "Install"): `controller` for the controller, the coordinator
and the offline solver, `sim` for everything simulated (the demo, `powerd sim`, the mock GPU
backend, `profile fit`'s plots). A command names its extra (`needs`, set with its handler);
`powerd` checks it before the command starts, so a missing library is one line, not a
traceback after half a start.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence

# The modules each extra installs (import names; tests/test_packaging.py checks them
# against pyproject.toml's extras). `sim` includes `controller`.
CONTROLLER = (
    "numpy",
    "numba",
    "scipy",
    "cvxpy",
    "clarabel",
    "sqlalchemy",
    "alembic",
    "psycopg",
    "fastapi",
    "uvicorn",
)
EXTRAS: dict[str, tuple[str, ...]] = {
    "controller": CONTROLLER,
    "sim": (*CONTROLLER, "matplotlib"),
}


class MissingExtra(Exception):
    """A command needs an extra that is not installed: which, and what is missing."""

    def __init__(self, what: str, extra: str, modules: Sequence[str]) -> None:
        self.what = what
        self.extra = extra
        self.modules = list(modules)
        shown = ", ".join(self.modules[:3])
        if len(self.modules) > 3:
            shown += f" and {len(self.modules) - 3} more"
        verb = "is" if len(self.modules) == 1 else "are"
        super().__init__(
            f"{what}: needs the `{extra}` extra ({shown} {verb} not installed): "
            f"pip install 'powerd[{extra}]' (docs/operations.md, \"Install\")"
        )


def require(what: str, extra: str, modules: Sequence[str] | None = None) -> None:
    """Raise MissingExtra when a module of `extra` (or of `modules`, a part of it) is not
    installed. Looks them up without importing them."""
    missing = [m for m in modules or EXTRAS[extra] if importlib.util.find_spec(m) is None]
    if missing:
        raise MissingExtra(what, extra, missing)


def extra_of(module: str | None) -> str | None:
    """The extra that installs `module` (a dotted name: its top level counts), if any."""
    top = (module or "").partition(".")[0]
    return next((extra for extra, modules in EXTRAS.items() if top in modules), None)
