"""Discovery of many BMCs of which some hang: when is each answering node's walk done?

N emulated BMCs (2 GPUs each, HTTPS, sessions; every `--hang-every`-th one accepts
connections and never answers) are discovered as the bmc-agent does it: a thread per node,
DISCOVERY_SLOTS walks at once, one shared Redfish loop, the default timeout (0.8 s) and
retry (1). Prints when the answering nodes were found (median, last) and when the hanging
ones had failed. docs/performance.md, "BMC agent", has the figures.

    PYTHONPATH=. .venv/bin/python bench/bmc_discovery.py --nodes 200 --hang-every 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import tempfile
import threading
import time
from pathlib import Path

import structlog

from powerd.backends.base import BackendError
from powerd.backends.mock import Workload
from powerd.bmc.agent import DISCOVERY_SLOTS
from powerd.bmc.backend import IoLoop, RedfishBackend
from powerd.bmc.redfish import BmcTrust, RedfishClient
from powerd.testing.redfish import EmulatorServer, Faults, RedfishService, TestCa


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=200)
    parser.add_argument("--hang-every", type=int, default=2, help="0: none hangs")
    args = parser.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    logging.getLogger("uvicorn.error").setLevel(logging.CRITICAL)  # cancelled hangs

    def hangs(i: int) -> bool:
        return args.hang_every > 0 and i % args.hang_every == args.hang_every - 1

    ca = TestCa.make(Path(tempfile.mkdtemp()))
    services = [
        RedfishService.hgx(
            2, Workload.steady(600.0), node=f"n{i}", password="pw", faults=Faults(hang=hangs(i))
        )
        for i in range(args.nodes)
    ]
    io = IoLoop()
    slots = threading.BoundedSemaphore(DISCOVERY_SLOTS)
    found_s: dict[int, float] = {}
    failed_s: dict[int, float] = {}
    with EmulatorServer(services, ca) as server:
        backends = [
            RedfishBackend(
                f"n{i}",
                RedfishClient(server.url(i), "admin", "pw", trust=BmcTrust(ca_file=ca.ca_file)),
                io,
                max_age_s=1.0,
            )
            for i in range(args.nodes)
        ]
        started = time.monotonic()

        def walk(i: int) -> None:
            with slots:
                try:
                    backends[i].discover()
                    found_s[i] = time.monotonic() - started
                except BackendError:
                    failed_s[i] = time.monotonic() - started

        threads = [threading.Thread(target=walk, args=(i,)) for i in range(args.nodes)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for b in backends:
            b.close()
    io.close()
    good = [found_s[i] for i in range(args.nodes) if not hangs(i) and i in found_s]
    answering = sum(not hangs(i) for i in range(args.nodes))
    print(
        f"{args.nodes} BMCs, {args.nodes - answering} hanging: {len(good)}/{answering} "
        f"answering found, median {statistics.median(good):.1f} s, last {max(good):.1f} s"
        + (f"; hanging failed by {max(failed_s.values()):.1f} s" if failed_s else "")
    )


if __name__ == "__main__":
    main()
