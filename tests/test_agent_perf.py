"""Workload perf sources of the agent (powerd/agent/perf.py): a real HTTP server on 127.0.0.1
serving Prometheus text, and files a job writes."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from powerd.agent import Agent, AgentSettings, SettingsError
from powerd.agent.perf import PerfConfig, PerfSource, parse_file, parse_prometheus
from powerd.backends.base import BackendError, GpuReading
from powerd.backends.mock import MockBackend, SimulatedGpus, Workload
from powerd.clock import ManualClock
from powerd.transport import MemoryBroker
from powerd.wire import AckError, CapCommand

GPUS = {"GPU-a": 0, "GPU-b": 1, "GPU-c": 2, "GPU-d": 3}


class Exporter:
    """A tiny Prometheus endpoint on 127.0.0.1 whose text the test sets; `delay_s` makes
    it slow (a hung serving engine)."""

    def __init__(self) -> None:
        self.text = ""
        self.delay_s = 0.0
        self.requests = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                outer.requests += 1
                time.sleep(outer.delay_s)
                body = outer.text.encode()
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def exporter() -> Iterator[Exporter]:
    e = Exporter()
    try:
        yield e
    finally:
        e.close()


def tokens(per_gpu: dict[str, float], model: str = "llama") -> str:
    lines = [
        "# HELP vllm:generation_tokens Generated tokens.",
        "# TYPE vllm:generation_tokens counter",
    ]
    for gpu, v in per_gpu.items():
        lines.append(f'vllm:generation_tokens_total{{model="{model}",gpu="{gpu}"}} {v}')
    lines.append('vllm:generation_tokens_total{model="other",gpu="0"} 1e6')
    return "\n".join(lines) + "\n"


class Ticker:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_counter_rates_per_gpu_label_with_a_label_filter(exporter: Exporter) -> None:
    clock = Ticker()
    src = PerfSource(
        PerfConfig(
            url=exporter.url,
            metric="vllm:generation_tokens",
            labels={"model": "llama"},
            gpu_label="gpu",
        ),
        GPUS,
        clock,
    )
    exporter.text = tokens({"0": 1000, "1": 500, "GPU-c": 0})
    src.poll()
    assert src.value("GPU-a") is None  # a first reading: no rate yet
    clock.t += 10
    exporter.text = tokens({"0": 3000, "1": 1500, "GPU-c": 700})
    src.poll()
    # Deltas over 10 s; the "other" model's series is not ours; GPU-c named by its uuid.
    assert src.value("GPU-a") == pytest.approx(200.0)
    assert src.value("GPU-b") == pytest.approx(100.0)
    assert src.value("GPU-c") == pytest.approx(70.0)
    assert src.value("GPU-d") is None
    # A reset (the engine restarted): that interval is skipped, the next has a rate again.
    clock.t += 10
    exporter.text = tokens({"0": 50, "1": 1600, "GPU-c": 800})
    src.poll()
    assert src.dropped["counter_reset"] == 1
    assert src.value("GPU-b") == pytest.approx(10.0)
    assert src.value("GPU-a") == pytest.approx(200.0)  # the last rate, still fresh
    clock.t += 10
    exporter.text = tokens({"0": 450, "1": 1700, "GPU-c": 900})
    src.poll()
    assert src.value("GPU-a") == pytest.approx(40.0)
    # Too old: not sent.
    clock.t += 31
    assert src.value("GPU-a") is None


def test_a_node_total_is_shared_by_the_gpus_listed(exporter: Exporter) -> None:
    clock = Ticker()
    src = PerfSource(
        PerfConfig(url=exporter.url, metric="samples_per_second", kind="gauge", gpus=(0, 1)),
        GPUS,
        clock,
    )
    exporter.text = "# TYPE samples_per_second gauge\nsamples_per_second 800\n"
    src.poll()
    assert src.value("GPU-a") == src.value("GPU-b") == pytest.approx(400.0)
    assert src.value("GPU-c") is None


@pytest.mark.parametrize(
    ("text", "gpu_label", "why"),
    [
        ("# TYPE r gauge\nr NaN\n", None, "not_finite_or_negative"),
        ("# TYPE r gauge\nr -5\n", None, "not_finite_or_negative"),
        ("# TYPE r gauge\nr 1e15\n", None, "above_max"),
        ('# TYPE r gauge\nr{gpu="9"} 5\n', "gpu", "unknown_gpu"),
    ],
)
def test_bad_values_are_dropped(
    exporter: Exporter, text: str, gpu_label: str | None, why: str
) -> None:
    src = PerfSource(
        PerfConfig(url=exporter.url, metric="r", kind="gauge", gpu_label=gpu_label),
        GPUS,
        Ticker(),
    )
    exporter.text = text
    src.poll()
    assert src.dropped == {why: 1} if why != "above_max" else src.dropped == {why: 4}
    assert all(src.value(u) is None for u in GPUS)


def test_unreachable_slow_or_garbage_endpoints_never_raise(exporter: Exporter) -> None:
    src = PerfSource(
        PerfConfig(url="http://127.0.0.1:9/metrics", metric="r", timeout_s=0.5), GPUS, Ticker()
    )
    src.poll()
    assert src.errors == 1
    exporter.text = "this is { not prometheus\n"
    bad = PerfSource(PerfConfig(url=exporter.url, metric="r"), GPUS, Ticker())
    bad.poll()
    assert bad.errors == 1
    exporter.delay_s = 2.0
    slow = PerfSource(PerfConfig(url=exporter.url, metric="r", timeout_s=0.3), GPUS, Ticker())
    t0 = time.monotonic()
    slow.poll()
    assert slow.errors == 1 and time.monotonic() - t0 < 1.5


def test_files_a_number_or_json_per_gpu(tmp_path: Path) -> None:
    f = tmp_path / "perf.json"
    clock = Ticker()
    src = PerfSource(PerfConfig(file=f, kind="gauge"), GPUS, clock)
    f.write_text("123.5\n")
    src.poll()
    assert src.value("GPU-d") == pytest.approx(123.5 / 4)
    f.write_text(json.dumps({"gpus": {"0": 10, "GPU-b": 20, "x": 5}}))
    src.poll()
    assert src.value("GPU-a") == 10 and src.value("GPU-b") == 20
    assert src.dropped["unknown_gpu"] == 1
    # A file nobody has written for longer than max_age_s: the job is gone.
    old = time.time() - 120
    os.utime(f, (old, old))
    errors = src.errors
    src.poll()
    assert src.errors == errors + 1
    assert parse_file('{"perf": 7}') == [("", 7.0)]
    for bad in ("true", "[1, 2]", '{"gpus": 3}', "twelve"):
        with pytest.raises(Exception, match=r"want|neither|boolean"):
            parse_file(bad)


def test_prometheus_parsing_sums_matching_series_without_a_gpu_label() -> None:
    text = tokens({"0": 10, "1": 20})
    assert parse_prometheus(text, "vllm:generation_tokens_total", {"model": "llama"}, None) == [
        ("", 30.0)
    ]


def test_settings_need_one_source_and_a_metric() -> None:
    with pytest.raises(SettingsError, match="perf_metric"):
        AgentSettings.load(node_id="n1", perf_url="http://127.0.0.1:1/metrics")
    with pytest.raises(SettingsError, match="not both"):
        AgentSettings.load(
            node_id="n1", perf_url="http://127.0.0.1:1/m", perf_metric="x", perf_file="/tmp/x"
        )
    with pytest.raises(SettingsError):
        AgentSettings.load(node_id="n1", perf_url="file:///etc/passwd", perf_metric="x")
    s = AgentSettings.load(
        node_id="n1", perf_url="http://127.0.0.1:1/m", perf_metric="x", perf_labels={"a": "b"}
    )
    cfg = s.perf_config()
    assert cfg is not None and cfg.metric == "x" and dict(cfg.labels) == {"a": "b"}
    assert AgentSettings.load(node_id="n1").perf_config() is None


async def test_the_agent_sends_the_sources_perf_and_its_loop_never_waits_on_it(
    exporter: Exporter,
) -> None:
    clock = ManualClock()
    model = SimulatedGpus(2, [Workload.steady(level_w=400.0)] * 2, seed=1, uuid_prefix="GPU-p")
    broker = MemoryBroker()
    settings = AgentSettings(node_id="n1", backend="mock", period_s=1.0)
    agent = Agent(settings, MockBackend(model, clock, 0, 2), broker.client("a"), clock)
    gpus = {u: g.index for u, g in agent.gpus.items()}
    exporter.text = "# TYPE tps gauge\ntps 900\n"
    exporter.delay_s = 0.5  # a slow exporter: the poller waits, the agent does not
    source = PerfSource(
        PerfConfig(url=exporter.url, metric="tps", kind="gauge", period_s=0.05), gpus
    )
    agent.perf_source = source
    source.start()
    try:
        t0 = time.monotonic()
        first = agent._sample()
        assert time.monotonic() - t0 < 0.3
        assert all(g.perf is None for g in first)  # nothing read yet: no perf sent
        for _ in range(60):
            await asyncio.sleep(0.05)
            if source.value(first[0].uuid) is not None:
                break
        sampled = agent._sample()
        assert [g.perf for g in sampled] == [pytest.approx(450.0)] * 2
    finally:
        source.stop()


def test_an_endpoint_that_drips_forever_is_cut_at_the_timeout() -> None:
    """A body sent a byte at a time, each within the socket timeout, forever: the poll
    gives up after about its timeout, not after MAX_READ_BYTES reads (weeks)."""
    stop = threading.Event()

    class Drip(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/plain")
            self.end_headers()
            while not stop.is_set():
                try:
                    self.wfile.write(b"#")
                    self.wfile.flush()
                except OSError:
                    return
                time.sleep(0.05)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/metrics"
        src = PerfSource(PerfConfig(url=url, metric="r", timeout_s=0.5), GPUS, Ticker())
        poller = threading.Thread(target=src.poll, daemon=True)
        t0 = time.monotonic()
        poller.start()
        poller.join(timeout=5.0)
        assert not poller.is_alive(), "poll still reading a dripping endpoint after 5 s"
        assert src.errors == 1 and time.monotonic() - t0 < 5.0
    finally:
        stop.set()
        server.shutdown()
        server.server_close()


def test_a_reading_out_of_bounds_never_becomes_the_cap_a_failed_sample_reports() -> None:
    """A limit read back as NaN is reported as `invalid_reading`; a later failed read reports
    the last limit that passed the wire's bounds, not the NaN (which would fail again)."""
    clock = ManualClock()
    model = SimulatedGpus(1, [Workload.steady(level_w=400.0)], seed=1, uuid_prefix="GPU-r")

    class Flaky(MockBackend):
        mode = "ok"

        def read(self, uuid: str) -> GpuReading:
            if self.mode == "fail":
                raise BackendError("unreachable", uuid)
            r = super().read(uuid)
            return replace(r, cap_w=float("nan")) if self.mode == "nan" else r

    backend = Flaky(model, clock, 0, 1)
    agent = Agent(
        AgentSettings(node_id="n1", backend="mock"), backend, MemoryBroker().client("a"), clock
    )
    good = agent._sample()[0]
    assert good.error is None and good.cap_w > 0
    backend.mode = "nan"
    bad = agent._sample()[0]
    assert bad.error == "invalid_reading" and bad.cap_w == good.cap_w
    backend.mode = "fail"
    failed = agent._sample()[0]
    assert failed.error is not None and failed.cap_w == good.cap_w


def test_a_limit_read_back_out_of_bounds_acks_set_failed_and_keeps_nothing() -> None:
    """A backend whose read-back after a set is NaN (a lying BMC, a driver fault): the ack
    says `set_failed`, the command loop goes on, the cap kept is the last valid one."""
    clock = ManualClock()
    model = SimulatedGpus(1, [Workload.steady(level_w=400.0)], seed=1, uuid_prefix="GPU-s")

    class Lying(MockBackend):
        def set_power_limit_w(self, uuid: str, watts: float) -> float:
            super().set_power_limit_w(uuid, watts)
            return float("nan")

    agent = Agent(
        AgentSettings(node_id="n1", backend="mock"),
        Lying(model, clock, 0, 1),
        MemoryBroker().client("a"),
        clock,
    )
    uuid = next(iter(agent.gpus))
    before = agent._sample()[0].cap_w
    ack = agent._apply(
        CapCommand(node_id="n1", tick=1, lease_s=30.0, caps={uuid: 300.0}, failsafe_w={})
    )
    assert ack.gpus[uuid].error is AckError.SET_FAILED and ack.gpus[uuid].enforced_w is None
    assert agent.caps_w[uuid] == before
