"""The Grafana dashboard (docs/grafana/powerd.json) asks only for series powerd exports, with
labels those series carry; its provisioning files are valid YAML that point at it.

The exported series come from powerd's own registries, filled the way the controller and the
agent fill them (every update method called), not from a list written here."""

from __future__ import annotations

import inspect
import json
import math
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from powerd.controller.meters import MeterView
from powerd.metrics import ControllerMetrics, GpuSnapshot, Leadership, exposition
from powerd.node_metrics import AgentMetrics
from powerd.wire import GpuTelemetry

GRAFANA = Path(__file__).resolve().parents[1] / "docs" / "grafana"
DASHBOARD = GRAFANA / "powerd.json"

FUNCTIONS_AND_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}


def exported() -> dict[str, set[str]]:
    """Every sample name the controller's and the agent's registries expose, with its labels."""
    called: set[str] = set()

    def call(obj: Any, name: str, **kw: Any) -> None:
        getattr(obj, name)(**kw)
        called.add(f"{type(obj).__name__}.{name}")

    def snap(**extra: Any) -> GpuSnapshot:
        return GpuSnapshot(
            uuids=["GPU-a0", "GPU-a1"],
            nodes=["a", "a"],
            index=[0, 1],
            power_w=[400.0, 300.0],
            cap_w=[500.0, 400.0],
            energy_j=[1.0, 2.0],
            temp_c=[60.0, 61.0],
            models=["H100", "H100"],
            throttle=[["sw_power_cap"], []],
            **extra,
        )

    reg = CollectorRegistry()
    c = ControllerMetrics(reg)
    call(
        c,
        "update_gpus",
        snap=snap(
            committed_w=[500.0, 400.0],
            target_w=[480.0, 390.0],
            set_w=np.array([500.0, 400.0]),
            restores=[0.0, 1.0],
        ),
    )
    call(
        c,
        "update_groups",
        names=["site", "row-1"],
        levels=["facility", "row"],
        budget_w=[1000.0, math.inf],
        committed_w=[900.0, 900.0],
        draw_w=[700.0, 700.0],
    )
    call(
        c,
        "observe_tick",
        duration_s=0.01,
        solve_s=0.005,
        status="optimal",
        ts=1.7e9,
        throughput={"training": 1.0},
        unused_w=100.0,
    )
    call(
        c,
        "update_counters",
        received={"telemetry": 1},
        dropped={"bad": 1},
        caps_sent=2,
        acks=2,
        ack_ticks=1,
    )
    call(c, "update_fleet", gpus={"fresh": 2}, nodes={"steered": 1})
    call(c, "alarm_raised", kind="x")
    call(c, "set_active_alarms", active={"x": 1})
    call(
        c,
        "update_learning",
        samples={"training": 10.0},
        in_use={"training": 1.0},
        fit_error={"training": 0.01},
    )
    call(
        c,
        "update_leadership",
        leadership=Leadership("site", "c1", True, 3, "c1", 1, 1, 0, 0, 0),
    )
    meter = MeterView(
        group="r1", state="fresh", reading_w=9000.0, age_s=1.0, nodes_w=8800.0, gap_w=200.0,
        bound_w=500.0, overhead_w=400.0, overhead_learned_w=600.0, overhead_error_w=20.0,
        readings=9, error=None, overhead_unseen_w=200.0,
    )  # fmt: skip
    call(c, "update_meters", views=[meter], rejected={("r1", "nan"): 1})
    agent_reg = CollectorRegistry()
    a = AgentMetrics(agent_reg, "a")
    gpu = {"name": "H100", "min_cap_w": 200.0, "max_cap_w": 700.0, "default_cap_w": 700.0}
    gpu |= {"power_w": 400.0, "cap_w": 500.0, "energy_j": 1.0, "temp_c": 60.0}
    gpu |= {"util_pct": 90.0, "sm_clock_mhz": 1800.0, "set_w": 500.0, "restores": 1}
    gpus = [GpuTelemetry(uuid=f"GPU-a{i}", index=i, **gpu) for i in range(2)]
    call(a, "update_gpus", gpus=gpus)
    call(a, "update_counters", commands=1, rejected={"stale": 1}, caps_applied=2, failsafe=False)
    # Every way the two fill their registries was used: a family added later is seen here.
    for cls in (ControllerMetrics, AgentMetrics):
        public = {
            f"{cls.__name__}.{n}"
            for n, f in inspect.getmembers(cls, inspect.isfunction)
            if not n.startswith("_")
        }
        assert public <= called, f"call these too: {sorted(public - called)}"

    out: dict[str, set[str]] = {}
    for r in (reg, agent_reg):
        for family in text_string_to_metric_families(exposition(r).decode()):
            for s in family.samples:
                out.setdefault(s.name, set()).update(s.labels)
    return out


def metric_names(expr: str) -> Iterator[tuple[str, set[str]]]:
    """The series a PromQL expression selects, each with the label names it matches on."""
    expr = re.sub(r"\$\{?\w+\}?", "", expr)  # Grafana variables: $node, $__rate_interval
    matchers: dict[int, set[str]] = {}

    def keep_matchers(m: re.Match[str]) -> str:
        labels = set(re.findall(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)", m.group(0)))
        matchers[len(matchers)] = labels
        return f"\x00{len(matchers) - 1}\x00"

    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings hold no names
    expr = re.sub(r"\{[^}]*\}", keep_matchers, expr)
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # ranges: [5m]
    expr = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\x00(\d+)\x00)?(\s*\()?", expr):
        name, _, matcher, call = m.groups()
        if call is not None or name in KEYWORDS | FUNCTIONS_AND_KEYWORDS:
            continue  # a function or an aggregation
        yield name, matchers[int(matcher)] if matcher is not None else set()


def exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    def walk(panels: list[dict[str, Any]]) -> Iterator[tuple[str, str]]:
        for p in panels:
            for t in p.get("targets", []):
                yield p["title"], t["expr"]
            yield from walk(p.get("panels", []))

    yield from walk(dashboard["panels"])
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            m = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", q)
            assert m, f"variable {var['name']}: expected label_values(series, label)"
            yield f"variable {var['name']}", m.group(1)


def test_metric_names_are_found_in_promql() -> None:
    expr = (
        'histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="}", y=~"$v"}[5m]))) '
        "/ on(group) b - c offset 5m > bool 1e3 or vector(0) + time()"
    )
    assert list(metric_names(expr)) == [("a_bucket", {"x", "y"}), ("b", set()), ("c", set())]


def test_every_query_names_series_powerd_exports() -> None:
    series = exported()
    dashboard = json.loads(DASHBOARD.read_text())
    found = list(exprs(dashboard))
    assert len(found) >= 20
    used: set[str] = set()
    for title, expr in found:
        names = list(metric_names(expr))
        assert names, f"{title}: no series in {expr!r}"
        for name, labels in names:
            assert name in series, f"{title}: {name} is not a series powerd exports ({expr!r})"
            assert labels <= series[name], f"{title}: {name} has no label {labels - series[name]}"
            used.add(name)
    # The headline series are all on it.
    assert {
        "powerd_group_budget_watts",
        "powerd_group_committed_watts",
        "powerd_group_draw_watts",
        "DCGM_FI_DEV_POWER_USAGE",
        "powerd_gpu_cap_watts",
        "powerd_alarms_active",
        "powerd_leader",
    } <= used


def test_dashboard_is_provisionable() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "powerd" and dashboard["title"]
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["datasource"]["uid"] == "${datasource}", p["title"]
        used = set(re.findall(r"\$\{?(\w+)", json.dumps(p)))
        assert used - {"__rate_interval", "__interval"} <= variables, p["title"]
    provider = yaml.safe_load((GRAFANA / "provisioning/dashboards/powerd.yaml").read_text())
    assert provider["apiVersion"] == 1 and provider["providers"][0]["type"] == "file"
    assert provider["providers"][0]["options"]["path"]
    sources = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())
    assert sources["datasources"][0]["type"] == "prometheus"


@pytest.mark.parametrize(
    ("expr", "names"),
    [
        ("sum(powerd_alarms_active)", ["powerd_alarms_active"]),
        ('x{level="row"} / y{level="row"}', ["x", "y"]),
        ("count(a > b) or vector(0)", ["a", "b"]),
    ],
)
def test_metric_names_examples(expr: str, names: list[str]) -> None:
    assert [n for n, _ in metric_names(expr)] == names
