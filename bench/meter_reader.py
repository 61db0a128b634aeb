"""What many meters cost the controller's meter reader: N Prometheus meters against one
local query server (uvicorn, in a subprocess), polled every `--poll` seconds.

    PYTHONPATH=. .venv/bin/python bench/meter_reader.py --meters 1000 --seconds 20

Prints, every two seconds, how many meters read within the last two poll periods, the
process's open file descriptors and the reader thread's CPU seconds (from /proc).
Figures: docs/performance.md, "Metered groups".
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import structlog

from powerd.clock import SystemClock
from powerd.controller.meter_reader import MeterReader
from powerd.controller.meters import MeterBook
from powerd.policy import MeterSpec

APP = """
import json, random
async def app(scope, receive, send):
    if scope["type"] != "http":
        return
    value = str(5000 + random.random())  # a live meter: a new value each answer
    doc = {"status": "success",
           "data": {"resultType": "vector", "result": [{"metric": {}, "value": [1, value]}]}}
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def thread_cpu_s(native_id: int) -> float:
    fields = Path(f"/proc/self/task/{native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--meters", type=int, default=1000)
    ap.add_argument("--poll", type=float, default=2.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "promapp.py").write_text(textwrap.dedent(APP))
        server = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", "promapp:app", "--port", str(port),
             "--log-level", "warning", "--no-access-log"],
            cwd=tmp,
        )  # fmt: skip
        try:
            deadline = time.monotonic() + 20
            while True:
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the query server did not start"
                    time.sleep(0.1)
            measure(args.meters, args.poll, args.seconds, f"http://127.0.0.1:{port}")
        finally:
            server.terminate()
            server.wait()


def measure(n: int, poll_s: float, seconds: float, url: str) -> None:
    book, clock = MeterBook(), SystemClock()
    reader = MeterReader(book, clock)
    specs = {
        f"g{i}": (
            MeterSpec.model_validate(
                {
                    "prometheus": {"url": url, "query": f"q{i}"},
                    "poll_s": poll_s,
                    "timeout_s": min(1.0, poll_s / 2),
                    "fresh_s": 5 * poll_s,
                }
            ),
            f"g{i}",
        )
        for i in range(n)
    }
    t0 = time.monotonic()
    reader.start(specs)
    thread = reader._thread
    assert thread is not None and thread.native_id is not None
    try:
        while time.monotonic() - t0 < seconds:
            time.sleep(2.0)
            now = clock.monotonic()
            read = sum(1 for s in book.latest().values() if now - s.at <= 2 * poll_s)
            print(
                f"t={time.monotonic() - t0:5.1f} s  read: {read:5d}/{n}  "
                f"fds: {len(os.listdir('/proc/self/fd')):5d}  "
                f"reader CPU: {thread_cpu_s(thread.native_id):6.1f} s",
                flush=True,
            )
    finally:
        reader.stop()


if __name__ == "__main__":
    main()
