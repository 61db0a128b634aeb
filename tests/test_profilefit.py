"""`powerd profile fit` as a user runs it: a CSV sweep in, policy YAML (and a PNG) out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from support.cli import EXAMPLE, powerd

from powerd.policy import parse_policy

# A noisy sweep: 175 W lies under its neighbours' chord, 300 W dips after the peak at 250 W.
SWEEP = [(100, 50.0), (150, 80.0), (175, 82.0), (200, 90.0), (250, 95.0), (300, 92.0)]

pytestmark = pytest.mark.process  # every test runs `python -m powerd.cli`


def write_csv(path: Path, header: str, rows: list[str]) -> Path:
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def fitted(out: str) -> dict[str, Any]:
    data = yaml.safe_load(out)
    assert set(data) == {"profiles", "classes"}
    return data


def test_a_sweep_becomes_a_normalised_concave_envelope_with_its_error(tmp_path: Path) -> None:
    csv = write_csv(tmp_path / "a100.csv", "limit_w,tokens_s", [f"{p},{t}" for p, t in SWEEP])
    out = powerd("profile", "fit", str(csv), "--power", "limit_w", "--throughput", "tokens_s")
    assert out.returncode == 0, out.stderr
    data = fitted(out.stdout)
    (name,) = data["profiles"]
    assert name == "a100"
    points = np.array(data["profiles"][name]["points"])
    # The hull drops 175 W (under the chord 150→200) and everything after the peak.
    assert points[:, 0].tolist() == [100, 150, 200, 250]
    best = 95.0
    expect = [t / best for p, t in SWEEP if p in (100, 150, 200, 250)]
    assert points[:, 1] == pytest.approx(expect, abs=5e-5)
    slopes = np.diff(points[:, 1]) / np.diff(points[:, 0])
    assert np.all(np.diff(slopes) < 0)  # concave
    # Worst point: 175 W, where the envelope says 85 and 82 was measured (3.5 %).
    worst = (85.0 - 82.0) / 85.0
    assert f"up to {100 * worst:.1f} % below the envelope" in out.stdout
    assert data["classes"][name] == {"weight": 1.0, "profile": name}


def test_the_output_pastes_into_a_policy(tmp_path: Path) -> None:
    rows = [f"llama,{p},{t}" for p, t in SWEEP] + [
        f"bert,{p},{t}" for p, t in [(100, 3.0), (150, 4.0), (200, 4.2)]
    ]
    csv = write_csv(tmp_path / "sweep.csv", "model,power,throughput", rows)
    out = powerd(
        "profile", "fit", str(csv), "--power", "power", "--throughput", "throughput",
        "--group", "model", "--weight", "2",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = fitted(out.stdout)
    assert set(data["profiles"]) == {"llama", "bert"}
    policy_data = yaml.safe_load(EXAMPLE.read_text())
    policy_data["profiles"] |= data["profiles"]
    policy_data["classes"] |= data["classes"]
    policy = parse_policy(policy_data, "pasted")
    bert = policy.class_profile("bert")
    assert policy.classes["bert"].weight == 2.0
    assert bert.peak_w == 200.0
    assert bert.value([100, 150, 200]) == pytest.approx([3.0 / 4.2, 4.0 / 4.2, 1.0], abs=5e-5)
    assert policy.class_profile("llama").peak_w == 250.0


def test_numeric_group_values_stay_names(tmp_path: Path) -> None:
    # Grouped by batch size alone: "64" must stay a name, not become the number 64.
    rows = [f"{b},{p},{t * b / 64}" for b in (64, 128) for p, t in SWEEP]
    csv = write_csv(tmp_path / "odd: name #1.csv", "batch_size,power,tput", rows)
    out = powerd(
        "profile", "fit", str(csv), "--power", "power", "--throughput", "tput",
        "--group", "batch_size",
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = fitted(out.stdout)
    assert set(data["profiles"]) == {"64", "128"}
    assert data["classes"]["64"]["profile"] == "64"
    assert data["profiles"]["64"]["description"].startswith("fitted from odd: name #1.csv")
    policy_data = yaml.safe_load(EXAMPLE.read_text())
    policy_data["profiles"] |= data["profiles"]
    policy_data["classes"] |= data["classes"]
    assert parse_policy(policy_data, "pasted").class_profile("128").peak_w == 250.0


def test_time_per_unit_of_work_is_inverted_and_the_png_is_written(tmp_path: Path) -> None:
    # Zeus's power traces give seconds per epoch: throughput is its inverse.
    rows = [f"resnet,{p},{1.0 / t}" for p, t in SWEEP] + [
        f"ncf,{p},{s}" for p, s in [(100, 7.0), (150, 7.0), (200, 7.1)]
    ]
    csv = write_csv(tmp_path / "zeus.csv", "network,power_limit,time_per_epoch", rows)
    png = tmp_path / "fit.png"
    out = powerd(
        "profile", "fit", str(csv), "--power", "power_limit", "--time", "time_per_epoch",
        "--group", "network", "--png", str(png),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    data = fitted(out.stdout)
    resnet = np.array(data["profiles"]["resnet"]["points"])
    assert resnet[:, 0].tolist() == [100, 150, 200, 250]
    # A workload that does not speed up with power peaks at its lowest limit.
    assert data["profiles"]["ncf"]["points"] == [[100, 1]]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("header", "rows", "args", "message"),
    [
        ("watts,tput", ["1,1", "2,2"], ["--power", "pw"], "no column 'pw'; columns: watts, tput"),
        ("power,tput", ["100,1", "200,fast"], [], "row 3: column 'tput': 'fast' is not a number"),
        ("power,tput", ["100,1", "nan,2"], [], "row 3: column 'power': nan is not a finite number"),
        ("power,tput", ["100,1", "200,-2"], [], "row 3: column 'tput': -2 must be >= 0"),
        ("power,tput", ["100,1", "100,2"], [], "1 distinct power value(s); a sweep needs"),
        ("power,tput", [], [], "no data rows"),
        ("power,tput", ["100,0", "200,0"], [], "every throughput is 0"),
        ("power,tput,job", ["1,1,a", "2,2,a", "1,1,b"], ["--group", "job"], "group job=b: 1 "),
        ("power,tput", ["100,1", "200"], [], "row 3: column 'tput': '' is not a number"),
    ],
)  # fmt: skip
def test_bad_sweeps_exit_2_saying_where_and_why(
    tmp_path: Path, header: str, rows: list[str], args: list[str], message: str
) -> None:
    csv = write_csv(tmp_path / "bad.csv", header, rows)
    base = {"--power": "power", "--throughput": "tput"}
    for flag, value in zip(args[::2], args[1::2], strict=True):
        base[flag] = value
    flags = [x for kv in base.items() for x in kv]
    out = powerd("profile", "fit", str(csv), *flags)
    assert out.returncode == 2
    assert message in out.stderr
    assert "Traceback" not in out.stderr
    assert out.stdout == ""


def test_empty_or_missing_files_and_bad_flags_exit_2(tmp_path: Path) -> None:
    empty = tmp_path / "empty.csv"
    empty.write_text("", encoding="utf-8")
    out = powerd("profile", "fit", str(empty), "--power", "p", "--throughput", "t")
    assert out.returncode == 2 and "the file is empty" in out.stderr
    out = powerd("profile", "fit", str(tmp_path / "nope.csv"), "--power", "p", "--time", "t")
    assert out.returncode == 2 and "cannot read the file" in out.stderr
    both = powerd("profile", "fit", str(empty), "--power", "p", "--throughput", "t", "--time", "t")
    assert both.returncode == 2 and "not allowed with argument" in both.stderr
