"""The allocator compiled and as plain Python give the same caps on small cases.

With NUMBA_DISABLE_JIT=1 numba leaves the kernels (powerd/allocator/kernel.py) as the
Python functions they are written as: what a reader steps through in pdb (docs/allocator.md,
"Reading the solver in plain Python") is then what the controller runs. Each side runs in a
process of its own, as the variable must be set before numba loads. fastmath lets the
compiled code reorder sums, so the caps agree to float rounding (about 1e-10 W), not to the
bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
TOL_W = 1e-6

# Small sites (2 to 144 GPUs) with slew, stale and pinned GPUs, with and without jobs.
CAPS = """
import json, sys
from powerd.allocator import allocate_arrays, kernel
from powerd.testing.synthetic import make_policy, random_fleet, with_jobs

caps = {}
for shape in [(1, 1, 1, 2), (1, 2, 2, 4), (2, 3, 3, 4), (1, 2, 3, 8)]:
    policy = make_policy(*shape, slew_w=150.0)
    for seed in range(6):
        fleet = random_fleet(
            policy, seed, stale_share=0.25 * (seed % 2), pinned_share=0.25 * (seed % 3 == 0)
        )
        for jobs in (False, True):
            alloc = allocate_arrays(with_jobs(fleet, seed) if jobs else fleet, policy)
            caps[f"{shape} seed {seed} jobs {jobs}"] = [alloc.status, alloc.caps_w.tolist()]
json.dump({"compiled": hasattr(kernel.prepare, "py_func"), "caps": caps}, sys.stdout)
"""


def caps(disable_jit: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", CAPS],
        env=os.environ | {"NUMBA_DISABLE_JIT": disable_jit},
        cwd=ROOT,  # this checkout's powerd, whatever the environment installed
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result: dict[str, Any] = json.loads(out.stdout)
    return result


@pytest.mark.process
def test_plain_python_gives_the_compiled_caps_on_small_cases() -> None:
    compiled, plain = caps("0"), caps("1")
    assert compiled["compiled"] and not plain["compiled"]  # two different runs, really
    assert compiled["caps"].keys() == plain["caps"].keys()
    assert len(compiled["caps"]) == 48
    for case, (status, caps_w) in compiled["caps"].items():
        plain_status, plain_caps_w = plain["caps"][case]
        assert plain_status == status, case
        assert np.allclose(plain_caps_w, caps_w, rtol=0, atol=TOL_W), case
