"""`powerd sim` fed bad input: one clear line naming the flag or key, exit 2, no traceback,
nothing written half-way."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from support.sim import scenario_dict, small_policy

from powerd.cli import build_parser
from powerd.cli import main as powerd_main

ROOT = Path(__file__).resolve().parents[1]


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """argparse's refusal of `argv` (exit 2): its message."""
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


@pytest.mark.parametrize("value", ["5", "1", "0", "-0.1", "nan", "inf"])
def test_threshold_is_a_share_of_throughput(value: str, capsys: pytest.CaptureFixture[str]) -> None:
    # `--threshold 5` meant as 5 % would let every size pass: the fit would be the largest.
    err = parse_error(["sim", "s.yaml", "--oversubscribe", "--threshold", value], capsys)
    assert "--threshold" in err
    assert "between 0 and 1" in err or "positive" in err


def test_a_threshold_below_one_is_taken() -> None:
    args = build_parser().parse_args(["sim", "s.yaml", "--threshold", "0.05"])
    assert args.threshold == 0.05


@pytest.mark.parametrize("value", ["0.5", "0.999", "0", "-1", "nan", "inf", "-inf"])
def test_a_breaker_rated_below_its_budget_is_refused(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # 0.5 was taken: a breaker tripping at half the budget powerd keeps, so every
    # comparison with uncapped judged a site against a breaker that is not there.
    err = parse_error(["sim", "s.yaml", f"--breaker-rating={value}"], capsys)
    assert err.endswith(
        f"argument --breaker-rating: must be a number of at least 1 "
        f"(a breaker rated below its budget trips under it), not {value}"
    )


def test_a_breaker_rating_that_is_no_number_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["sim", "s.yaml", "--breaker-rating", "80%"], capsys)
    assert err.endswith("argument --breaker-rating: '80%' is not a number")


@pytest.mark.parametrize("value", ["1", "1.25", "100"])
def test_a_breaker_at_or_above_its_budget_is_taken(value: str) -> None:
    args = build_parser().parse_args(["sim", "s.yaml", "--breaker-rating", value])
    assert args.breaker_rating == float(value)


def write_scenario(tmp_path: Path, **changes: Any) -> Path:
    """The small scenario (support.sim) on the small policy (8 nodes of 4 GPUs), as files."""
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump(small_policy()))
    sc = tmp_path / "scenario.yaml"
    sc.write_text(yaml.safe_dump(scenario_dict(policy=str(policy), **changes)))
    return sc


def run_sim(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = powerd_main(["sim", *argv, "--policies", "fast", "--baselines", "none", "--jobs", "1"])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_a_workload_that_gets_no_node_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 5 % of 8 nodes rounds to none: the run would simulate a mix without that workload.
    workloads = scenario_dict()["workloads"][:2]
    workloads[0]["share"], workloads[1]["share"] = 0.95, 0.05
    rc, err = run_sim([str(write_scenario(tmp_path, workloads=workloads))], capsys)
    assert rc == 2
    assert "workloads[1].share" in err
    assert "no node" in err


def test_more_training_jobs_than_nodes_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # train has 3 of the 8 nodes: a fourth job would hold no GPU.
    workloads = scenario_dict()["workloads"]
    workloads[1]["jobs"] = 4
    rc, err = run_sim([str(write_scenario(tmp_path, workloads=workloads))], capsys)
    assert rc == 2
    assert "workloads[1].jobs" in err
    assert "at most 3 jobs" in err


@pytest.mark.parametrize(
    ("feed_w", "said"),
    [("1", "runs no node, even at device minimums"), ("1e12", "up to 100,000 nodes")],
)
def test_a_search_feed_outside_what_a_site_can_be_is_refused_before_any_run(
    feed_w: str, said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: 1 W ran the comparison, then crashed rendering an empty search; 1e12 W grew
    # sites of hundreds of millions of nodes (a search that never ended).
    sc = write_scenario(tmp_path)
    rc, err = run_sim([str(sc), "--oversubscribe", "--points", "2", "--feed-w", feed_w], capsys)
    assert rc == 2
    assert err.startswith("--feed-w: invalid argument")
    assert said in err


def test_an_out_that_is_a_file_is_refused_before_any_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: the whole simulation ran, then FileExistsError came out as a traceback.
    in_the_way = tmp_path / "results"
    in_the_way.write_text("not a folder")
    rc, err = run_sim([str(write_scenario(tmp_path)), "--out", str(in_the_way)], capsys)
    assert rc == 2
    assert (
        err.strip()
        == f"--out {in_the_way}: cannot write there: a file is in the way (give a folder)"
    )
    assert in_the_way.read_text() == "not a folder"


def test_outputs_are_written_whole_or_not_at_all(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "out"
    sc = str(write_scenario(tmp_path, duration_h=0.25))
    assert run_sim([sc, "--out", str(out)], capsys)[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert {"report.html", "results.json", "power.png"} <= set(before)

    def broken(*_: object) -> None:
        raise RuntimeError("the plot failed half-way")

    # Before: power.png of the new run was already over the old one when this raised.
    monkeypatch.setattr("powerd.sim.report.plot_throughput", broken)
    with pytest.raises(RuntimeError):
        run_sim([sc, "--seed", "8", "--out", str(out)], capsys)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


@pytest.mark.parametrize(
    ("flag", "value", "said"),
    [
        ("--jobs", "0", "must be from 1 to"),
        ("--jobs", "-1", "must be from 1 to"),
        ("--jobs", str((os.cpu_count() or 1) + 1), "this machine's CPUs"),
        ("--points", "1", "must be from 2 to 1,000"),
        ("--points", "1000000000", "must be from 2 to 1,000"),
        ("--points", "eight", "'eight' is not a whole number"),
    ],
)
def test_jobs_and_points_are_bounded(
    flag: str, value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: --jobs 0 and -1 ran as 1 without a word; --jobs 1000 let a search start a
    # process per grid size; --points 1e9 built a grid of a billion sizes (never returned).
    err = parse_error(["sim", "s.yaml", flag, value], capsys)
    assert f"argument {flag}: " in err and said in err


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("0.1:2:0.000000001", "1,900,000,001 feeds; at most 100"),
        ("0.1:inf:0.1", "give shares of nameplate"),
        (",".join(["0.5"] * 101), "101 feeds; at most 100"),
    ],
)
def test_a_budget_sweep_is_a_bounded_list_of_feeds(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a tiny STEP built a list of two billion shares (memory, never returned); an
    # infinite STOP was an OverflowError traceback.
    err = parse_error(["sim", "s.yaml", "--budget-sweep", value], capsys)
    assert "argument --budget-sweep: " in err and said in err


def test_from_db_reads_and_never_creates_a_database(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a mistyped SQLite path was created (an empty database beside the real one)
    # and the error was SQLAlchemy's, SQL statement and all, over four lines.
    sc = str(write_scenario(tmp_path))
    typo = tmp_path / "powerd.dbb"
    rc, err = run_sim([sc, "--from-db", f"sqlite:///{typo}"], capsys)
    assert rc == 2
    assert f"at <top>: no such SQLite file ({typo})" in err
    assert not typo.exists()


def test_from_db_errors_name_the_flag_and_hide_the_password(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = str(write_scenario(tmp_path))
    url = "postgresql://powerd:s3cret@127.0.0.1:9/powerd"  # nothing listens on port 9
    rc, err = run_sim([sc, "--from-db", url], capsys)
    assert rc == 2
    assert err.startswith("--from-db postgresql://powerd:***@127.0.0.1:9/powerd: invalid trace")
    assert "cannot read the recording: OperationalError" in err
    assert "s3cret" not in err and "SELECT" not in err


def test_from_db_refuses_a_reversed_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    sc = str(write_scenario(tmp_path))
    db = tmp_path / "rec.db"
    db.touch()
    argv = ["--from-db", f"sqlite:///{db}", "--since", "2000", "--until", "1000"]
    rc, err = run_sim([sc, *argv], capsys)
    assert rc == 2
    assert "--until must be after --since" in err


@pytest.mark.parametrize("stamp", ["nan", "inf", "-inf"])
def test_a_trace_time_that_is_no_number_names_its_line(stamp: str, tmp_path: Path) -> None:
    # Before: float() took them; the file failed later as "sampled every nan s".
    from powerd.sim.traces import TraceError, read_nvidia_smi_csv

    csv = tmp_path / "gpu.csv"
    csv.write_text(f"timestamp, power.draw [W]\n1000, 100 W\n{stamp}, 200 W\n")
    with pytest.raises(TraceError) as err:
        read_nvidia_smi_csv(csv)
    assert err.value.problems == [
        (
            "line 3, column 'timestamp'",
            f"'{stamp}' is not a time (nvidia-smi writes YYYY/MM/DD HH:MM:SS.mmm)",
        )
    ]


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(x) for x in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.skipif(
    (os.cpu_count() or 1) < 2 or not Path("/proc/self/task").exists(),
    reason="two worker processes, read from Linux's /proc",
)
@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stopped_sim_leaves_no_worker_running(signum: int, tmp_path: Path) -> None:
    # Before: SIGINT to the command (not its process group) waited for every running run to
    # finish (minutes); SIGTERM left the workers running as orphans until their runs ended.
    sc = write_scenario(tmp_path, duration_h=24, tick_s=1)
    argv = ["sim", str(sc), "--policies", "fast,uniform", "--baselines", "none"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "powerd.cli", *argv, "--jobs", "2", "--progress", "never"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # signals reach the command alone, as `kill PID` sends them
    )
    workers: list[int] = []
    try:
        deadline = time.monotonic() + 60
        while len(workers := _children(proc.pid)) < 2 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2
        time.sleep(1.0)  # both inside their runs
        proc.send_signal(signum)
        rc = proc.wait(timeout=15)
        assert rc == (130 if signum == signal.SIGINT else -signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not [w for w in workers if _alive(w)]
    finally:
        for pid in {proc.pid, *workers, *_children(proc.pid)}:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        proc.wait()


def test_a_scenario_key_given_twice_is_refused_with_both_lines(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: YAML kept the last `tick_s` silently and the run took 30 s ticks.
    sc = write_scenario(tmp_path)
    sc.write_text(sc.read_text().replace("tick_s: 60\n", "tick_s: 60\ntick_s: 30\n"))
    rc, err = run_sim([str(sc)], capsys)
    assert rc == 2
    line = sc.read_text().splitlines().index("tick_s: 30") + 1
    assert f"at line {line}, column 1: malformed YAML: duplicate key 'tick_s'" in err
    assert f"(first given on line {line - 1})" in err


def test_a_budget_given_twice_in_a_policy_is_refused() -> None:
    # The same loader reads policies: a group with two budgets ran on the last one.
    from powerd.policy import PolicyError, load_policy_text

    text = (ROOT / "policies" / "example.yaml").read_text()
    assert "  budget_w: 250000" in text
    doubled = text.replace("  budget_w: 250000", "  budget_w: 250000\n  budget_w: 400000", 1)
    with pytest.raises(PolicyError) as err:
        load_policy_text(doubled, "doubled.yaml")
    assert "duplicate key 'budget_w'" in str(err.value)
    load_policy_text(text, "example.yaml")  # merge keys and the rest still load


def test_a_feed_below_the_device_minimums_is_the_scenarios_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: every steered run went over the budget and the command exited 1, the code for
    # a bug in powerd, for a feed no policy can keep.
    sc = write_scenario(tmp_path, site={"feed_fraction": 0.1}, duration_h=0.25)
    rc, err = run_sim([str(sc)], capsys)
    assert rc == 2
    assert "at site: " in err
    assert "below its GPUs at their device minimums plus overhead" in err


def test_a_schedule_window_after_the_end_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: a window past the end (a scenario run with a shorter --duration-h) was
    # silently never simulated, and the report read as if the schedule had been kept.
    schedule = [{"fraction": 0.8, "start_h": 0.5, "end_h": 0.75}]
    sc = write_scenario(tmp_path, schedule=schedule)
    rc, err = run_sim([str(sc), "--duration-h", "0.25"], capsys)
    assert rc == 0
    assert (
        "powerd sim: schedule[0] (0.5 to 0.75 h) starts after the simulation ends (0.25 h): "
        "not simulated" in err
    )


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("5:0", "SECONDS input should be greater than 0"),
        ("1e9:30", "PCT input should be less than or equal to 100"),
        ("nan:30", "PCT input should be a finite number"),
        ("5:30:80", "TARGET input should be less than or equal to 50"),
        ("5:30:1:2:3", "more than three ':'"),
        ("5:30:1:-1", "RISE input should be greater than or equal to 0"),
    ],
)
def test_an_overload_out_of_range_says_which_and_the_range(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "... 1 validation error for Overload", naming neither the part nor its range.
    err = parse_error(["sim", "s.yaml", "--overload", value], capsys)
    assert err.endswith(f"RISE s lent, default 30): {said}")


@pytest.mark.parametrize(
    ("value", "target", "rise"),
    [("5:30", 3.0, 30.0), ("5:30:1", 1.0, 30.0), ("5:30:0", 0.0, 30.0), ("5:30:1:0", 1.0, 0.0)],
)
def test_an_overload_takes_the_draw_target_as_the_policy_does(
    value: str, target: float, rise: float
) -> None:
    args = build_parser().parse_args(["sim", "s.yaml", "--overload", value])
    assert (args.overload.pct, args.overload.for_s) == (5.0, 30.0)
    assert args.overload.target_pct == target
    assert args.overload.rise_s == rise  # the policy's default unless given


@pytest.mark.parametrize(
    ("flag", "value", "path"),
    [
        ("--seed", "-5", "seed"),
        ("--tick-s", "0.5", "tick_s"),
        ("--duration-h", "9000", "duration_h"),
    ],
)
def test_an_override_out_of_range_names_its_flag(
    flag: str, value: str, path: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "at seed: ..." under the scenario file's name: the operator looked in the file.
    rc, err = run_sim([str(write_scenario(tmp_path)), flag, value], capsys)
    assert rc == 2
    assert f"  at {path} (from {flag}): " in err


def test_an_inner_budget_below_its_minimums_points_at_the_site_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # 64 GPUs on a node whose budget was drawn for 4: raising the feed would not help.
    sc = write_scenario(tmp_path, site={"gpus_per_node": 64}, duration_h=0.25)
    rc, err = run_sim([str(sc)], capsys)
    assert rc == 2
    assert "at site (group '" in err
    assert "give the site fewer nodes or GPUs per node, or this group a larger budget" in err


def test_the_text_points_at_the_search_only_when_it_was_not_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: "(how many GPUs ...: --oversubscribe)" printed under the search's own answer.
    hint = "(how many GPUs the feed runs within a loss threshold: --oversubscribe)"
    sc = str(write_scenario(tmp_path, duration_h=0.25))
    argv = [sc, "--policies", "fast,static", "--baselines", "none", "--jobs", "1"]
    assert powerd_main(["sim", *argv]) == 0
    assert hint in capsys.readouterr().out
    assert powerd_main(["sim", *argv, "--oversubscribe", "--points", "2"]) == 0
    out = capsys.readouterr().out
    assert "--oversubscribe at 3.0% loss: fast fits" in out
    assert hint not in out
