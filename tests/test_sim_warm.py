"""`powerd sim`'s warm-up (powerd/sim/run.py `warm_up`): the kernels every run of the
command uses are compiled or loaded in the parent, before any worker starts, and it says so
when numba compiles."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numba
import pytest

from powerd.allocator import kernel

ROOT = Path(__file__).resolve().parents[1]

# In a fresh process: the warm-up, then every kind of run the command makes (the policies,
# static provisioning, both baselines) on a small site. Prints the numba signatures the runs
# added to powerd's kernels after the warm-up (each one a compile, or a load from the cache,
# in a worker that would have no notice of it).
SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numba.core.dispatcher
    from support.sim import scenario_dict, small_policy
    from powerd.allocator import kernel as allocator_kernel
    from powerd.backends import mock_kernel
    from powerd.policy import parse_policy
    from powerd.sim import kernel as sim_kernel
    from powerd.sim.baselines import run_baseline
    from powerd.sim.run import simulate, warm_up
    from powerd.sim.scenario import parse_scenario
    from powerd.sim.site import build_mix, site_for

    def signatures():
        out = {}
        for module in (allocator_kernel, sim_kernel, mock_kernel):
            for name, f in vars(module).items():
                if isinstance(f, numba.core.dispatcher.Dispatcher):
                    out[f"{module.__name__}.{name}"] = {str(s) for s in f.signatures}
        return out

    policy = parse_policy(small_policy())
    scenario = parse_scenario(scenario_dict(duration_h=0.25), "small.yaml")
    site = site_for(scenario, policy)
    notices = []
    warm_up(scenario, site, lambda: notices.append(1))
    before = signatures()
    mix = build_mix(scenario, site)
    for name in ("fast", "static"):
        simulate(scenario, site, mix, name)
    for name in ("uncapped", "oracle"):
        run_baseline(name, scenario, site, mix)
    after = signatures()
    added = {k: sorted(v - before.get(k, set())) for k, v in after.items()}
    print(json.dumps({k: v for k, v in added.items() if v}))
    """
)


@pytest.mark.process
def test_after_the_warm_up_no_run_compiles_or_loads_a_kernel() -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "tests"), str(ROOT)])}
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {}


def test_the_compile_watch_tells_a_compile_once_and_not_a_load_or_another_module() -> None:
    calls: list[str] = []

    @numba.njit(cache=False)
    def twice(x: float) -> float:
        return 2.0 * x

    # This module is not under `powerd`: its compile is not powerd's.
    with kernel.watch_compiles(lambda: calls.append("powerd"), prefix="powerd"):
        assert twice(2.0) == 4.0
    with kernel.watch_compiles(lambda: calls.append("tests"), prefix=__name__):
        assert twice(2.5) == 5.0  # compiled already for float: nothing to tell
        assert twice(3) == 6.0  # a new signature (int): compiled, told once
        assert twice(4) == 8.0
        twice.recompile()
    assert calls == ["tests"]
