"""Policy files: expansion of the compact tree, validation errors that say where and why."""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import pytest
import yaml

from powerd.policy import PolicyError, expand_name, load_policy, load_policy_text, parse_policy

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "example.yaml"


def small_policy() -> dict[str, Any]:
    return {
        "facility": {
            "name": "dc",
            "budget_w": 20000,
            "rows": [
                {
                    "name": "row-{1..2}",
                    "budget_w": 12000,
                    "racks": [
                        {
                            "name": "{row}-k{1..2}",
                            "nodes": [
                                {
                                    "name": "{rack}-n{01..02}",
                                    "budget_w": 3000,
                                    "overhead_w": 200,
                                    "gpus": 4,
                                }
                            ],
                        }
                    ],
                }
            ],
        },
        "profiles": {"p": {"points": [[200, 0.4], [400, 0.8], [700, 1.0]]}},
        "classes": {
            "train": {"weight": 1, "profile": "p"},
            "infer": {"weight": 3, "floor_w": 300, "profile": "p"},
        },
        "defaults": {"class": "train", "failsafe_w": 250},
    }


def problems_of(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(PolicyError) as info:
        parse_policy(data, "test.yaml")
    return info.value.problems


def test_example_policy_expands_to_the_documented_site() -> None:
    policy = load_policy(EXAMPLE)
    levels = [sum(1 for g in policy.groups if g.level == lv) for lv in range(4)]
    assert levels == [1, 2, 8, 64]
    assert sum(g.gpus for g in policy.groups if g.level == 3) == 512
    assert policy.node_names()[0] == "row-1-rack-1-node-01"
    assert policy.node_names()[-1] == "row-2-rack-4-node-08"
    # Parents always come before their children.
    assert all(g.parent < i for i, g in enumerate(policy.groups))


def test_compact_names_expand_with_padding_and_parent_names() -> None:
    assert expand_name("n{01..03}") == ["n01", "n02", "n03"]
    assert expand_name("r{1..2}-k{1..2}") == ["r1-k1", "r1-k2", "r2-k1", "r2-k2"]
    assert expand_name("plain") == ["plain"]
    policy = parse_policy(small_policy())
    assert policy.node_names() == [
        "row-1-k1-n01",
        "row-1-k1-n02",
        "row-1-k2-n01",
        "row-1-k2-n02",
        "row-2-k1-n01",
        "row-2-k1-n02",
        "row-2-k2-n01",
        "row-2-k2-n02",
    ]
    racks = [g for g in policy.groups if g.level == 2]
    assert all(math.isinf(r.budget_w) for r in racks), "omitted budgets are unconstrained"


def test_backwards_range_is_an_error_naming_the_path() -> None:
    data = small_policy()
    data["facility"]["rows"][0]["name"] = "row-{3..1}"
    ((path, msg),) = problems_of(data)
    assert path == "facility.rows[0].name"
    assert "backwards" in msg


@pytest.mark.parametrize(
    ("mutate", "path", "fragment"),
    [
        (
            lambda d: d["facility"].__setitem__("budget_w", -1),
            "facility.budget_w",
            "greater than 0",
        ),
        (
            lambda d: d["classes"]["train"].__setitem__("profile", "nope"),
            "classes.train.profile",
            "valid: p",
        ),
        (
            lambda d: d["defaults"].__setitem__("class", "gold"),
            "defaults.class",
            "valid: infer, train",
        ),
        (
            lambda d: d["facility"]["rows"][0].__setitem__("budgett_w", 1),
            "facility.rows[0].budgett_w",
            "unknown key",
        ),
        (
            lambda d: d["classes"]["infer"].__setitem__("ceiling_w", 100),
            "classes.infer",
            "must not exceed ceiling_w",
        ),
        (
            lambda d: d["profiles"]["p"].__setitem__("points", [[200, -1]]),
            "profiles.p.points[0][1]",
            "greater than or equal to 0",
        ),
        (
            lambda d: (
                d["control"] if False else d.__setitem__("control", {"tick_s": 5, "lease_s": 6})
            ),
            "control",
            "at least two ticks",
        ),
    ],
)
def test_bad_values_name_the_path_and_what_is_valid(mutate: Any, path: str, fragment: str) -> None:
    data = small_policy()
    mutate(data)
    problems = problems_of(data)
    assert any(p == path and fragment in m for p, m in problems), problems


def test_duplicate_names_are_rejected_with_both_places() -> None:
    data = small_policy()
    racks = data["facility"]["rows"][0]["racks"]
    racks.append(copy.deepcopy(racks[0]))
    problems = problems_of(data)
    assert any(
        "duplicate rack name 'row-1-k1'" in m and "first declared at" in m for _, m in problems
    )


def test_failsafe_caps_must_fit_every_budget() -> None:
    data = small_policy()
    data["defaults"]["failsafe_w"] = 750  # 4 × 750 + 200 > 3000 per node
    problems = problems_of(data)
    node_problems = [m for p, m in problems if p.endswith("nodes[0].budget_w")]
    assert node_problems and "failsafe caps plus overhead (3,200 W) exceed" in node_problems[0]


def test_malformed_yaml_reports_line_and_column() -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text("facility: [\n  a: b", "x.yaml")
    ((path, msg),) = info.value.problems
    assert path.startswith("line 2")
    assert "malformed YAML" in msg
    assert str(info.value).startswith("x.yaml: invalid policy")


def test_non_mapping_and_unreadable_files(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="a policy is a mapping"):
        load_policy_text("- 1\n- 2\n")
    with pytest.raises(PolicyError, match="cannot read the file"):
        load_policy(tmp_path / "missing.yaml")
    binary = tmp_path / "bin.yaml"
    binary.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(PolicyError, match="not UTF-8"):
        load_policy(binary)


def test_round_trip_through_yaml_text() -> None:
    text = yaml.safe_dump(small_policy())
    policy = load_policy_text(text, "inline")
    assert policy.source == "inline"
    assert policy.control.lease_s == 10.0
    assert policy.class_profile("infer").peak_w == 700


def test_leftover_is_peak_by_default_and_only_peak_or_max() -> None:
    data = small_policy()
    assert parse_policy(data).control.leftover == "peak"
    assert parse_policy(data | {"control": {"leftover": "max"}}).control.leftover == "max"
    problems = problems_of(data | {"control": {"leftover": "all"}})
    assert problems[0][0] == "control.leftover"
    assert "'peak' or 'max'" in problems[0][1]
