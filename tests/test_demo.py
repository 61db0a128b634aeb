"""`powerd demo` as a new operator meets it: the start-up over-commit shown and counted apart,
the solver ready before the first tick, and the printed `export POWERD_URL=… POWERD_TOKEN=…`
driving the command line against the running demo (an operator's token, so writes work)."""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import threading
from typing import Any

import httpx
import pytest
from support.cli import ROOT
from support.live_api import run, wait_until

from powerd.allocator.kernel import WarmUp
from powerd.cli.exits import EXIT_OK
from powerd.cli.policy import warm_text
from powerd.demo import default_policy, print_summary, run_demo

NODE = "row-1-rack-1-node-01"


class Console(io.TextIOBase):
    """What the demo prints, readable from the test's thread while the demo's writes it."""

    def __init__(self) -> None:
        self._parts: list[str] = []
        self._lock = threading.Lock()

    def write(self, s: str) -> int:
        with self._lock:
            self._parts.append(s)
        return len(s)

    def text(self) -> str:
        with self._lock:
            return "".join(self._parts)


class DemoRun:
    """The demo on the example's first 4 nodes (32 GPUs) with its API, in a thread."""

    def __init__(self, duration_s: float) -> None:
        self.duration_s = duration_s
        self.console = Console()
        self.summary: dict[str, Any] = {}
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="demo")

    def _main(self) -> None:
        try:
            self.summary = asyncio.run(
                run_demo(
                    default_policy(),
                    nodes=4,
                    duration_s=self.duration_s,
                    ui_port=0,
                    out=self.console,
                )
            )
        except BaseException as exc:  # handed to the test by done()
            self.error = exc

    def done(self) -> dict[str, Any]:
        self.thread.join(120)
        assert not self.thread.is_alive(), "the demo did not end"
        if self.error is not None:
            raise self.error
        return self.summary


def test_the_first_hour(monkeypatch: pytest.MonkeyPatch) -> None:
    """One run (10 s): the command line against it while it runs, then its summary."""
    demo = DemoRun(duration_s=10)
    demo.thread.start()
    try:
        commands_from_the_printed_exports(demo, monkeypatch)
    finally:
        summary = demo.done()
    start_up_labelled_and_counted_apart(summary, demo.console.text())


def commands_from_the_printed_exports(demo: DemoRun, monkeypatch: pytest.MonkeyPatch) -> None:
    found = wait_until(
        lambda: re.search(
            r"^  export POWERD_URL=(\S+) POWERD_TOKEN=(\S+)$", demo.console.text(), re.M
        ),
        "the export line",
    )
    url, token = found.groups()
    viewer = re.search(r"^live page: (\S+)/ui#token=(\S+)$", demo.console.text(), re.M)
    assert viewer is not None and viewer.group(1) == url  # the page's link stays
    monkeypatch.setenv("POWERD_URL", url)
    monkeypatch.setenv("POWERD_TOKEN", token)
    # No --url, no --token: every command reads them from the environment.
    code, out = wait_until(
        lambda: (r := run(["status"]))[0] == EXIT_OK and r[1].startswith("tick ") and r, "a tick"
    )
    assert "\n    row-1-rack-1 " in out  # racks, under their row
    code, out = run(["gpus", "--node", NODE])
    assert code == EXIT_OK
    assert len(out.splitlines()) == 1 + 8 and all(NODE in line for line in out.splitlines()[1:])
    # The operator's token writes: a cut well above what 4 nodes draw, and a drain.
    code, out = run(["budget", "set", "dc1", "200000", "--ttl", "1m", "--reason", "first hour"])
    assert code == EXIT_OK, out
    assert run(["drain", "row-1-rack-1-node-02", "--reason", "first hour"])[0] == EXIT_OK
    assert run(["undrain", "row-1-rack-1-node-02", "--reason", "first hour"])[0] == EXIT_OK
    # ...the page's token only reads.
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {viewer.group(2)}"}) as c:
        assert c.get("/api/v1/fleet").status_code == 200
        denied = c.put(f"/api/v1/nodes/{NODE}/drain", json={"reason": "viewer"})
        assert denied.status_code == 403


def start_up_labelled_and_counted_apart(s: dict[str, Any], text: str) -> None:
    # GPUs count at their maximum until their first ack: tick 1 is over its node budgets
    # (8 × 700 W + 1 kW against 6.5 kW), labelled, explained, and its end announced.
    first = next(line for line in text.splitlines() if line.startswith("tick    1 |"))
    assert first.endswith("START-UP")
    assert "  ^ START-UP: GPUs boot at their default limit (700 W)" in text
    assert re.search(r"^  start-up over after \d+ ticks? \(\d+\.\d s\)", text, re.M)
    assert s["startup_ticks"] >= 1 and s["startup_settled"]
    assert s["startup_max_committed_ratio"] > 1.0
    assert s["startup_s"] > 0
    # ...and not as a breach: after start-up no committed cap exceeded a budget.
    assert s["ticks_committed_over_budget"] == 0
    assert s["max_committed_over_budget_ratio"] <= 1.0 + 1e-6
    assert s["ticks"] > s["startup_ticks"]
    summary = text[text.index("\nsummary\n") :]
    assert "  start-up: " in summary
    assert "  ticks after start-up with committed caps over any budget: 0" in summary
    # The solver was made ready before the first tick and said how, apart from solve times.
    assert s["solver_ready_s"] is not None and s["solver_kernels_compiled"] is not None
    assert "before the first tick, not in the solve times" in summary
    per_facility_joule_beside_facility_energy(s)


def per_facility_joule_beside_facility_energy(s: dict[str, Any]) -> None:
    """The headline's gain per joule is on the energy printed beside it: the facility's
    draw (GPUs plus overhead), as `static_mean_draw_w` counts it. This run's feed holds all
    its GPUs at TDP (no headline), so the summary is shown as for a feed that holds half."""
    work, energy = 1.35, 1.26
    half = {
        **s,
        "gpus_static_provisioning": s["gpus"] // 2,
        "static_throughput": s["mean_throughput"] / work,
        "static_mean_draw_w": s["mean_draw_w"] / energy,
    }
    out = io.StringIO()
    print_summary(half, out)
    line = next(x for x in out.getvalue().splitlines() if "provisioned at full TDP" in x)
    assert line.endswith(
        f"({work - 1:+.0%} throughput and {energy - 1:+.0%} energy under the same feed, "
        f"{work / energy - 1:+.0%} work per facility joule)"
    )


@pytest.mark.process
def test_no_tick_waits_for_the_compiler() -> None:
    """After the demo's warm-up, its ticks compile nothing (no kernel gains a signature):
    the solve times it prints are the solver's. In a fresh process, so that no other test
    has compiled anything."""
    script = """
import asyncio, io, json, numba
from powerd.allocator import kernel
from powerd.demo import default_policy, run_demo

def signatures():
    return {n: len(f.signatures) for n, f in vars(kernel).items()
            if isinstance(f, numba.core.dispatcher.Dispatcher)}

ready = kernel.warm_up()
before = signatures()
s = asyncio.run(run_demo(default_policy(), nodes=8, duration_s=4, out=io.StringIO()))
print(json.dumps({"before": before, "after": signatures(), "ticks": s["ticks"]}))
"""
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=ROOT,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.splitlines()[-1])
    assert result["ticks"] >= 2
    assert sum(result["before"].values()) >= 17  # every kernel Python calls, and its helpers
    assert result["after"] == result["before"]


def test_warm_says_what_it_did() -> None:
    cached = WarmUp(10.6, 17, 0, "/var/cache/powerd/numba/x", jit=True)
    assert warm_text(cached) == (
        "solver ready in 10.6 s: 17 kernels compiled, cached in /var/cache/powerd/numba/x"
    )
    loaded = WarmUp(0.3, 0, 17, "/c", jit=True)
    assert warm_text(loaded) == "solver ready in 0.3 s: 17 kernels loaded from numba's cache in /c"
    nowhere = WarmUp(10.6, 17, 0, None, jit=True)
    assert not nowhere.cached and "NOT cached" in warm_text(nowhere)
    assert "NUMBA_CACHE_DIR" in warm_text(nowhere)
    plain = WarmUp(0.01, 0, 0, None, jit=False)
    assert plain.cached and "NUMBA_DISABLE_JIT" in warm_text(plain)
