"""Prometheus metrics without numpy: a node agent's own /metrics, and what the controller's
(powerd/metrics.py) shares with it.

The agent runs on every GPU node from the base install, which carries no numpy
(docs/operations.md, "Install"); one node's few GPUs need no arrays. The per-GPU families
are named once here, after NVIDIA dcgm-exporter's fields where it has one (same names, same
`gpu`/`UUID`/`device`/`modelName`/`Hostname` labels), and both exporters use them.
"""

from __future__ import annotations

import math
import socket
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from powerd.backends.base import throttle_mask
from powerd.wire import CAP_TOLERANCE_W, GpuTelemetry

GPU_LABELS = ("gpu", "UUID", "device", "modelName", "Hostname")


def gpu_labels(index: int, uuid: str, model: str, host: str) -> dict[str, str]:
    """One GPU's labels, as dcgm-exporter gives them."""
    return {
        "gpu": str(index),
        "UUID": uuid,
        "device": f"nvidia{index}",
        "modelName": model,
        "Hostname": host,
    }


@dataclass(frozen=True)
class GpuFamily:
    """A per-GPU family: its name, help text and type."""

    name: str
    doc: str
    typ: str = "gauge"

    @property
    def sample(self) -> str:
        """The samples' name: a counter's carries `_total`."""
        return self.name + "_total" if self.typ == "counter" else self.name


POWER = GpuFamily("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).")
ENFORCED = GpuFamily(
    "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "Enforced power limit, read back from the device (in W)."
)
ENERGY = GpuFamily(  # in mJ, as dcgm-exporter's: energy_j * 1000
    "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION",
    "Total energy consumption since the driver loaded (in mJ).",
    "counter",
)
TEMP = GpuFamily("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).")
CLOCK_EVENTS = GpuFamily(
    "DCGM_FI_DEV_CLOCKS_EVENT_REASONS",
    "Current reasons for clock events (NVML throttle bitmask; 0x4 power cap).",
)
COMMITTED = GpuFamily(
    "powerd_gpu_cap_watts",
    "Committed cap: the highest cap that may be in force, counting commands not yet"
    " acknowledged (in W).",
)
TARGET = GpuFamily(
    "powerd_gpu_target_watts",
    "This tick's allocation for the GPU, before the safety planner (in W).",
)
OVERRIDDEN = GpuFamily(
    "powerd_gpu_cap_overridden",
    "1 while the GPU's enforced limit differs from the one powerd set (another"
    " tool, an out-of-band limit), 0 while it matches.",
)
RESTORES = GpuFamily(
    "powerd_gpu_cap_restores",
    "Limits found above the one powerd set (a GPU reset, a driver reload, another"
    " tool) and set back by the agent, since it started.",
    "counter",
)


def overridden(cap_w: float, set_w: float) -> float:
    """`powerd_gpu_cap_overridden`'s value: 1.0 where the limit in force is not the one set."""
    return float(abs(cap_w - set_w) > CAP_TOLERANCE_W)


def family(
    name: str, doc: str, typ: str, sample: str, rows: Iterable[tuple[dict[str, str], float]]
) -> Metric:
    m = Metric(name, doc, typ)
    m.samples = [Sample(sample, labels, value) for labels, value in rows]
    return m


def counter(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    return family(
        name,
        doc,
        "counter",
        name + "_total",
        (({label: k}, float(v)) for k, v in sorted(values.items())),
    )


def gauges(name: str, doc: str, label: str, values: Mapping[str, float]) -> Metric:
    return family(
        name, doc, "gauge", name, (({label: k}, float(v)) for k, v in sorted(values.items()))
    )


def scalar(name: str, doc: str, typ: str, value: float) -> Metric:
    return family(
        name, doc, typ, name + "_total" if typ == "counter" else name, [({}, float(value))]
    )


class NodeGpus(Collector):
    """One node's GPUs, from the agent's latest sample (the controller's GpuCollector gives
    the same families for a fleet, from arrays)."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self._gpus: Sequence[GpuTelemetry] = ()

    def update(self, gpus: Sequence[GpuTelemetry]) -> None:
        self._gpus = list(gpus)  # replaced whole: a scrape in another thread sees one sample

    def collect(self) -> Iterator[Metric]:
        gpus = self._gpus
        if not gpus:
            return
        labels = [gpu_labels(g.index, g.uuid, g.name, self.node_id) for g in gpus]

        def rows(f: GpuFamily, values: Iterable[float | None]) -> Metric:
            kept = (
                (lb, v)
                for lb, v in zip(labels, values, strict=True)
                if v is not None and not math.isnan(v)
            )
            return family(f.name, f.doc, f.typ, f.sample, kept)

        yield rows(POWER, (g.power_w for g in gpus))
        yield rows(ENFORCED, (g.cap_w for g in gpus))
        yield rows(ENERGY, (g.energy_j * 1000.0 for g in gpus))
        yield rows(TEMP, (g.temp_c for g in gpus))
        yield rows(CLOCK_EVENTS, (float(throttle_mask(g.throttle)) for g in gpus))
        yield rows(
            OVERRIDDEN, (None if g.set_w is None else overridden(g.cap_w, g.set_w) for g in gpus)
        )
        yield rows(RESTORES, (float(g.restores) for g in gpus))


class AgentMetrics:
    """What one node's agent exports about its own GPUs and its command handling."""

    def __init__(self, registry: CollectorRegistry, node_id: str) -> None:
        self.node_id = node_id
        self.gpus = NodeGpus(node_id)
        self._f = _AgentFamilies()
        registry.register(self.gpus)
        registry.register(self._f)

    def update_gpus(self, gpus: Sequence[GpuTelemetry]) -> None:
        """This node's GPUs, from its latest sample."""
        self.gpus.update(gpus)

    def update_counters(
        self,
        *,
        commands: float,
        rejected: Mapping[str, float],
        caps_applied: float,
        failsafe: bool,
    ) -> None:
        self._f.values = {
            "commands": commands,
            "rejected": dict(rejected),
            "caps_applied": caps_applied,
            "failsafe": failsafe,
        }


class _AgentFamilies(Collector):
    def __init__(self) -> None:
        self.values: dict[str, Any] = {}

    def collect(self) -> Iterator[Metric]:
        v = self.values
        if not v:
            return
        yield scalar("powerd_agent_commands", "Cap commands accepted.", "counter", v["commands"])
        yield counter(
            "powerd_agent_commands_rejected",
            "Cap commands rejected, by reason.",
            "reason",
            v["rejected"],
        )
        yield scalar(
            "powerd_agent_caps_applied", "Per-GPU caps applied.", "counter", v["caps_applied"]
        )
        yield scalar(
            "powerd_agent_failsafe",
            "1 while the lease has run out and failsafe caps hold.",
            "gauge",
            float(v["failsafe"]),
        )


@dataclass
class MetricsServer:
    """A registry served over HTTP from a background thread (prometheus-client's server)."""

    host: str
    port: int
    _server: Any
    _thread: threading.Thread

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


# Connections served at once (a scrape is one), and how long one may stay silent: every
# connection is a thread, and idle ones held them for ever (a peer could open thousands).
MAX_SCRAPE_CONNECTIONS = 16
SCRAPE_IDLE_S = 10.0


class _QuietHandler(WSGIRequestHandler):
    timeout = SCRAPE_IDLE_S  # StreamRequestHandler sets it on the connection's socket

    def log_message(self, format: str, *args: Any) -> None:
        """Scrapes are not logged."""


class _BoundedServer(ThreadingMixIn, WSGIServer):
    """A thread per connection, at most MAX_SCRAPE_CONNECTIONS of them: one more is closed
    at once (its scraper tries again at its next interval)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[WSGIRequestHandler]) -> None:
        self.address_family = socket.getaddrinfo(*address, type=socket.SOCK_STREAM)[0][0]
        self._slots = threading.BoundedSemaphore(MAX_SCRAPE_CONNECTIONS)
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A connection that timed out or broke is no error of ours (no traceback)."""


def start_metrics_server(
    registry: CollectorRegistry, host: str = "127.0.0.1", port: int = 9400
) -> MetricsServer:
    """Serve `registry` at http://host:port/metrics (port 0: any free port).

    The agent's option: threads of its own, so a scrape never delays telemetry; at most
    MAX_SCRAPE_CONNECTIONS at once, each closed after SCRAPE_IDLE_S silent. 9400 is
    dcgm-exporter's port; pick another when both run on a node. OSError if it cannot
    serve there.
    """
    server = make_server(
        host, port, make_wsgi_app(registry), _BoundedServer, handler_class=_QuietHandler
    )
    thread = threading.Thread(target=server.serve_forever, name="metrics", daemon=True)
    thread.start()
    return MetricsServer(host, int(server.server_address[1]), server, thread)
