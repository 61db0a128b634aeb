"""The command-line client against the live API: readable tables, writes, exit codes."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import json
import re
import tomllib
from typing import Any

import pytest
from support.live_api import LiveApi, run, wait_until

from powerd.auth import Principal, Role, TokenStore
from powerd.cli import main as powerd_main
from powerd.cli.admin import parse_duration, print_gpus
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
    # Every level down to the racks (`why` names a rack as the binding budget), indented
    # under its parent, in the tree's order.
    rows = lines[header + 1 : header + 5]
    groups = [line[: len(line) - len(line.lstrip())] + line.split()[0] for line in rows]
    assert groups == ["site", "  row-1", "    rack-1", "    rack-2"]
    assert lines[header + 1].startswith("site        4.0 kW")
    assert lines[header + 3].startswith("    rack-1  2.0 kW")
    assert lines[header + 5] == ""
    assert "alarms: none" in out

    viewer = ["--url", live.url, "--token", live.tokens["viewer"]]
    code, out = run(["status", "--level", "node", *viewer])
    assert code == EXIT_OK and "\n      rack-1-n2  1.5 kW" in out
    code, out = run(["status", "--level", "facility", *viewer])
    assert "\nsite   4.0 kW" in out and "row-1" not in out
    code, out = run(["status", "--json", *viewer])
    doc = json.loads(out)
    assert doc["fleet"]["nodes"] == 4
    assert [g["name"] for g in doc["groups"]] == ["site", "row-1", "rack-1", "rack-2"]


def test_gpus_lists_where_each_gpu_is_and_its_cap(live: LiveApi) -> None:
    viewer = ["--url", live.url, "--token", live.tokens["viewer"]]
    code, out = wait_until(
        lambda: (r := run(["gpus", *viewer]))[1].count("\n") == 9 and r, "8 GPUs"
    )
    assert code == EXIT_OK
    lines = out.splitlines()
    assert lines[0].split() == ["gpu", "node", "idx", "class", "job", "cap", "draw", "state"]
    assert all(
        re.fullmatch(r"\S+ rack-\d-n\d [01] training - \d+ W \d+ W ok", " ".join(line.split()))
        for line in lines[1:]
    ), out
    # The same table from the JSON's GPUs (the live fleet moves between two requests).
    items = json.loads(run(["gpus", "--json", *viewer])[1])
    table = io.StringIO()
    print_gpus(items, table)
    for line, g in zip(table.getvalue().splitlines()[1:], items, strict=True):
        uuid, node, idx, cls, job, cap, w1, draw, w2, state = line.split()
        assert (uuid, node, int(idx), cls, job) == (
            g["uuid"],
            g["node"],
            g["index"],
            "training",
            "-",
        )
        assert (w1, w2, state) == ("W", "W", "ok")  # whole watts; --json keeps every digit
        assert int(cap) == round(g["cap_w"]) and int(draw) == round(g["power_w"])
    code, out = run(["gpus", "--node", "rack-2-n1", *viewer])
    assert [line.split()[1] for line in out.splitlines()[1:]] == ["rack-2-n1", "rack-2-n1"]
    assert run(["gpus", "--class", "inference", *viewer])[1] == "no GPU heard matches\n"

    # A job's GPUs, and filters that combine.
    op = ["--url", live.url, "--token", live.tokens["operator"]]
    assert run(["job", "put", "j7", "--nodes", "rack-1-n2", "--class", "training", *op])[0] == 0
    out = wait_until(
        lambda: (r := run(["gpus", "--job", "j7", *viewer])[1]).count("rack-1-n2") == 2 and r,
        "the job's GPUs",
    )
    assert all(line.split()[4] == "j7" for line in out.splitlines()[1:])
    assert run(["gpus", "--job", "j7", "--rack", "rack-2", *viewer])[1] == (
        "no GPU heard matches\n"
    )


def test_commands_read_the_url_and_token_from_the_environment(
    live: LiveApi, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("POWERD_URL", live.url)
    monkeypatch.setenv("POWERD_TOKEN", live.tokens["operator"])
    assert run(["gpus"])[0] == EXIT_OK
    assert run(["drain", "rack-1-n1", "--reason", "env"])[0] == EXIT_OK
    assert run(["status"])[1].count("drained: rack-1-n1") == 1


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


def test_commands_print_to_the_stdout_of_when_they_run(
    live: LiveApi, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before: `out: TextIO = sys.stdout` bound the stdout of import time, so capsys (or a
    # redirect made later) never saw a command's output: it went to the old stream.
    viewer = ["--url", live.url, "--token", live.tokens["viewer"]]

    def printed(text: str) -> list[Any]:  # the command's JSON, not the live API's log lines
        return [json.loads(line) for line in text.splitlines() if line.startswith(("{", "["))]

    assert powerd_main(["status", "--json", *viewer]) == EXIT_OK
    (doc,) = printed(capsys.readouterr().out)
    assert set(doc) == {"fleet", "groups", "overrides", "alarms"}
    swapped = io.StringIO()
    with contextlib.redirect_stdout(swapped):
        assert powerd_main(["gpus", "--json", *viewer]) == EXIT_OK
    (gpus,) = printed(swapped.getvalue())
    assert isinstance(gpus, list)
    assert printed(capsys.readouterr().out) == []


@pytest.mark.parametrize(
    "module",
    [
        "powerd.cli",
        "powerd.cli.admin",
        "powerd.cli.daemons",
        "powerd.cli.db",
        "powerd.cli.extras",
        "powerd.cli.pilot",
        "powerd.cli.policy",
        "powerd.cli.profile",
        "powerd.cli.sim",
        "powerd.demo",
        "powerd.profilefit",
    ],
)
def test_no_function_holds_a_stream_as_its_default(module: str) -> None:
    """A stream as a default is the one of import time: the class of fault above."""
    mod = importlib.import_module(module)
    bound = [
        f"{name}({param.name}=...)"
        for name, fn in vars(mod).items()
        if inspect.isfunction(fn) and fn.__module__ == module
        for param in inspect.signature(fn).parameters.values()
        if isinstance(param.default, io.IOBase)
    ]
    assert bound == []
