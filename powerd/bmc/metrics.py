"""The bmc-agent's own Prometheus metrics: per BMC, its requests (attempts, failures, a
latency histogram), the GPUs found on it and whether its latest sample answered.

Read at scrape time from the clients' plain counters (`RequestStats`), from the metrics
server's thread: nothing is added to a request's path but a few additions.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Protocol

from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from powerd.bmc.redfish import LATENCY_BUCKETS_S, RequestStats


class BmcView(Protocol):
    """What the metrics read of one node: its id, its client's stats, its GPUs, its state."""

    @property
    def node_id(self) -> str: ...

    @property
    def stats(self) -> RequestStats: ...

    @property
    def gpus_found(self) -> int: ...

    @property
    def answering(self) -> bool: ...


class BmcMetrics(Collector):
    """Families `powerd_bmc_*`, one series per node (label `node`)."""

    def __init__(self, nodes: Sequence[BmcView]) -> None:
        self.nodes = list(nodes)

    def collect(self) -> Iterator[Metric]:
        attempts = Metric("powerd_bmc_requests", "Redfish requests sent (attempts).", "counter")
        failed = Metric(
            "powerd_bmc_request_failures",
            "Redfish requests without an answer (timeout, connection) or answered with an "
            "error status.",
            "counter",
        )
        latency = Metric(
            "powerd_bmc_request_seconds",
            "Time from sending a Redfish request to its answer read (or giving up).",
            "histogram",
        )
        gpus = Metric("powerd_bmc_gpus", "GPUs with a settable limit found on the BMC.", "gauge")
        up = Metric("powerd_bmc_up", "1 if the BMC's latest sample answered.", "gauge")
        for node in self.nodes:
            label = {"node": node.node_id}
            st = node.stats
            attempts.samples.append(Sample("powerd_bmc_requests_total", label, st.attempts))
            failed.samples.append(Sample("powerd_bmc_request_failures_total", label, st.failed))
            cumulative = 0
            bounds = [*LATENCY_BUCKETS_S, math.inf]
            for bound, count in zip(bounds, list(st.buckets), strict=True):
                cumulative += count
                le = "+Inf" if bound == math.inf else repr(bound)
                latency.samples.append(
                    Sample("powerd_bmc_request_seconds_bucket", {**label, "le": le}, cumulative)
                )
            latency.samples.append(Sample("powerd_bmc_request_seconds_count", label, cumulative))
            latency.samples.append(Sample("powerd_bmc_request_seconds_sum", label, st.seconds_sum))
            gpus.samples.append(Sample("powerd_bmc_gpus", label, node.gpus_found))
            up.samples.append(Sample("powerd_bmc_up", label, 1.0 if node.answering else 0.0))
        yield from (attempts, failed, latency, gpus, up)
