"""The command-line client against the live API: readable tables, writes, exit codes."""

from __future__ import annotations

import argparse
import json
import tomllib

import pytest
from support.live_api import LiveApi, run, wait_until

from powerd.auth import Principal, Role, TokenStore
from powerd.cli.admin import parse_duration
from powerd.cli.exits import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK


def test_status_prints_budget_table(live: LiveApi) -> None:
    with live.client("viewer") as c:  # the first ticks may carry a start-up alarm
        wait_until(lambda: c.get("/api/v1/alarms").json() == [], "no alarms")
    code, out = run(["status", "--url", live.url, "--token", live.tokens["viewer"]])
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].startswith("tick ") and "policy test-policy.yaml v1" in lines[0]
    assert "nodes 4 (4 steered); GPUs 8" in out
    header = next(i for i, line in enumerate(lines) if line.startswith("group"))
    assert lines[header].split() == ["group", "budget", "committed", "use", "draw"]
    assert lines[header + 1].startswith("site   4.0 kW")
    assert lines[header + 2].startswith("row-1  3.8 kW")
    assert "alarms: none" in out

    code, out = run(["status", "--json", "--url", live.url, "--token", live.tokens["viewer"]])
    assert code == EXIT_OK and json.loads(out)["fleet"]["nodes"] == 4


def test_writes_and_their_exit_codes(live: LiveApi, capsys: pytest.CaptureFixture[str]) -> None:
    op = ["--url", live.url, "--token", live.tokens["operator"]]
    code, out = run(["budget", "set", "site", "3000", "--ttl", "15m", "--reason", "DR", *op])
    assert code == EXIT_OK and out.startswith("budget.set site: done, in force from tick ")
    # This controller has no state file: the client says the change would not outlive it.
    assert "note: no state file: the change ends with this process" in out
    code, out = run(["status", *op])
    assert "temporary budgets" in out and "3.0 kW" in out and "operator-user" in out

    assert run(["drain", "rack-1-n1", "--reason", "PSU", *op])[0] == EXIT_OK
    assert (
        run(["class", "assign", "inference", "--node", "rack-2-n1", "--reason", "j1", *op])[0]
        == EXIT_OK
    )
    assert run(["undrain", "rack-1-n1", "--reason", "fixed", *op])[0] == EXIT_OK
    assert run(["budget", "clear", "site", "--reason", "DR over", *op])[0] == EXIT_OK

    capsys.readouterr()
    assert run(["pin", "GPU-none", "300", "--reason", "x", *op])[0] == EXIT_BAD_INPUT
    assert "unknown GPU 'GPU-none' (HTTP 404)" in capsys.readouterr().err
    assert run(["budget", "set", "site", "9000", "--reason", "x", *op])[0] == EXIT_BAD_INPUT
    assert "at budget_w:" in capsys.readouterr().err
    viewer = ["--url", live.url, "--token", live.tokens["viewer"]]
    assert run(["drain", "rack-1-n1", "--reason", "x", *viewer])[0] == EXIT_FAILED
    assert "(HTTP 403)" in capsys.readouterr().err
    dead = ["--url", "http://127.0.0.1:9", "--token", "x"]
    assert run(["status", *dead])[0] == EXIT_FAILED
    assert "cannot reach the API" in capsys.readouterr().err


def test_token_new_prints_a_usable_entry() -> None:
    code, out = run(["token", "new", "--name", "scheduler", "--role", "operator"])
    assert code == EXIT_OK
    token = out.splitlines()[1].removeprefix("# ")
    store = TokenStore.from_config(tomllib.loads(out))
    assert store.authenticate(token) == Principal("scheduler", Role.OPERATOR)


def test_durations() -> None:
    assert [parse_duration(t) for t in ("90", "90s", "15m", "2h", "1d")] == [
        90,
        90,
        900,
        7200,
        86400,
    ]
    with pytest.raises(argparse.ArgumentTypeError):
        parse_duration("soon")
