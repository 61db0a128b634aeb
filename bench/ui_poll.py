"""Bench: what the live page (/ui) asks of the controller, per refresh, in a real browser.

Runs `powerd demo --ui 0` (the example site, or its first `--nodes`), opens the page's link
in headless Chromium (Debian's chromium and chromium-driver) with every rack open and then
with every rack closed, lets it refresh for `--seconds`, and reads the browser's Resource
Timing entries of the API calls: per refresh the requests, the bytes of JSON and the
slowest call's time (what the page waits for), median over the refreshes.

    .venv/bin/python bench/ui_poll.py [--nodes 64] [--seconds 20]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service

ROOT = Path(__file__).resolve().parents[1]
ENTRIES_JS = """
return performance.getEntriesByType('resource')
  .filter((e) => e.name.includes('/api/v1/'))
  .map((e) => ({name: e.name, start: e.startTime, ms: e.duration, bytes: e.encodedBodySize}));
"""


def per_refresh(entries: list[dict[str, Any]]) -> tuple[float, float, float]:
    """Requests, kB and slowest call (ms) per refresh: a refresh starts with /fleet."""
    refreshes: list[list[dict[str, Any]]] = []
    for e in sorted(entries, key=lambda e: e["start"]):
        if e["name"].endswith("/api/v1/fleet") or not refreshes:
            refreshes.append([])
        refreshes[-1].append(e)
    steady = refreshes[2:] or refreshes  # the first ones also learn the tree and the chart
    return (
        statistics.median(len(r) for r in steady),
        statistics.median(sum(e["bytes"] for e in r) / 1e3 for r in steady),
        statistics.median(max(e["ms"] for e in r) for r in steady),
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    cmd = [sys.executable, "-m", "powerd.cli", "demo", "--nodes", str(args.nodes)]
    cmd += ["--duration", str(3 * args.seconds + 60), "--ui", "0"]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT
    )
    assert proc.stdout is not None
    link = next(ln for ln in proc.stdout if ln.startswith("live page: ")).split(": ", 1)[1]
    threading.Thread(target=proc.stdout.read, daemon=True).start()
    options = Options()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=options)
    try:
        print(f"powerd demo --nodes {args.nodes}: one refresh of the live page (median)")
        for racks in ("open", "closed"):
            driver.get("about:blank")
            driver.get(link.strip() + f"&racks={racks}")
            time.sleep(args.seconds)
            n, kb, ms = per_refresh(driver.execute_script(ENTRIES_JS))
            print(f"  racks {racks:6s}: {n:4.0f} requests, {kb:7.1f} kB JSON, slowest {ms:6.1f} ms")
    finally:
        driver.quit()
        proc.terminate()
        proc.wait(30)


if __name__ == "__main__":
    main()
