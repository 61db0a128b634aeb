"""systemd integration: the notify/watchdog protocol on a real socket, and the unit files."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import structlog

from powerd.sdnotify import Notifier

REPO = Path(__file__).resolve().parent.parent
UNITS = ["powerd-controller.service", "powerd-agent.service", "powerd-bmc-agent.service"]


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A datagram socket bound where systemd would put NOTIFY_SOCKET."""
    path = tmp_path / "notify"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(path))
    sock.settimeout(5)
    try:
        yield sock, str(path)
    finally:
        sock.close()


def test_ready_status_watchdog_stopping_arrive_as_datagrams(
    notify_socket: tuple[socket.socket, str],
) -> None:
    sock, path = notify_socket
    n = Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000"})
    assert n.enabled
    assert n.watchdog_s == 5.0  # half of WatchdogSec=10

    assert n.ready("steering 8 GPUs")
    assert sock.recv(4096) == b"READY=1\nSTATUS=steering 8 GPUs"
    assert n.status("tick 42")
    assert sock.recv(4096) == b"STATUS=tick 42"
    assert n.watchdog()
    assert sock.recv(4096) == b"WATCHDOG=1"
    assert n.stopping()
    assert sock.recv(4096) == b"STOPPING=1"
    n.close()


def test_abstract_namespace_socket() -> None:
    name = f"powerd-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.settimeout(5)
    try:
        n = Notifier({"NOTIFY_SOCKET": "@" + name})
        assert n.ready()
        assert sock.recv(4096) == b"READY=1"
    finally:
        sock.close()


def test_no_op_outside_systemd() -> None:
    n = Notifier({})
    assert not n.enabled
    assert n.watchdog_s is None
    assert n.ready() is False
    assert n.watchdog() is False


def test_watchdog_off_without_usec_and_for_another_pid(
    notify_socket: tuple[socket.socket, str],
) -> None:
    _, path = notify_socket
    assert Notifier({"NOTIFY_SOCKET": path}).watchdog() is False
    assert Notifier({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "0"}).watchdog_s is None
    other = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "4000000", "WATCHDOG_PID": "1"}
    assert Notifier(other).watchdog_s is None
    mine = {**other, "WATCHDOG_PID": str(os.getpid())}
    assert Notifier(mine).watchdog_s == 2.0


def test_vanished_socket_is_logged_not_raised(tmp_path: Path) -> None:
    n = Notifier({"NOTIFY_SOCKET": str(tmp_path / "gone"), "WATCHDOG_USEC": "1000000"})
    with structlog.testing.capture_logs() as logs:
        assert n.watchdog() is False
    assert [e["event"] for e in logs] == ["sd_notify_failed"]


# ---- unit files ----


def _verify_copy(unit: str, tmp_path: Path) -> Path:
    """A copy of the unit that `systemd-analyze verify` can check on a build machine.

    verify checks that ExecStart's binary exists; /usr/bin/powerd is installed only on real
    hosts, so the copy points ExecStart (and ExecReload) at this venv's entry point or, before
    `pip install -e`, at python itself. Nothing else in the unit changes.
    """
    venv_powerd = REPO / ".venv" / "bin" / "powerd"
    binary = venv_powerd if venv_powerd.exists() else Path(shutil.which("python3") or "/bin/true")
    text = (REPO / "systemd" / unit).read_text()
    assert "/usr/bin/powerd" in text
    out = tmp_path / unit
    out.write_text(text.replace("/usr/bin/powerd", str(binary)))
    return out


@pytest.mark.process
@pytest.mark.parametrize("unit", UNITS)
def test_unit_passes_systemd_analyze_verify(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    path = _verify_copy(unit, tmp_path)
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(path)],
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, "SYSTEMD_LOG_LEVEL": "notice"},
    )
    # verify also complains about the host's own units it loads along the way (a container
    # without a running systemd lacks some); only lines about our unit count.
    ours = [line for line in proc.stderr.splitlines() if unit in line]
    assert ours == [], proc.stderr
    assert proc.returncode == 0, proc.stderr


# `systemd-analyze security` scores exposure from 0 (locked down) to 10 (unprotected); the
# threshold is in tenths. The agent scores worse by design: uid 0, CAP_SYS_ADMIN, GPU devices.
EXPOSURE_LIMIT = {
    "powerd-controller.service": 20,
    "powerd-agent.service": 30,
    "powerd-bmc-agent.service": 20,
}


@pytest.mark.process
@pytest.mark.parametrize("unit", UNITS)
def test_unit_exposure_stays_low(unit: str, tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (.ci/run installs the systemd package)")
    path = _verify_copy(unit, tmp_path)
    proc = subprocess.run(
        [
            analyze,
            "security",
            "--offline=yes",
            "--no-pager",
            f"--threshold={EXPOSURE_LIMIT[unit]}",
            str(path),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr


def _directives(unit: str) -> dict[str, list[str]]:
    values: dict[str, list[str]] = {}
    for line in (REPO / "systemd" / unit).read_text().splitlines():
        m = re.match(r"^([A-Za-z]+)=(.*)$", line.strip())
        if m:
            values.setdefault(m.group(1), []).append(m.group(2))
    return values


@pytest.mark.parametrize("unit", UNITS)
def test_units_notify_watchdog_restart_and_hardening(unit: str) -> None:
    d = _directives(unit)
    assert d["Type"] == ["notify"]
    # The bmc-agent always: while it is down nothing lowers its BMCs' limits (see the unit).
    assert d["Restart"] == ["always" if unit == "powerd-bmc-agent.service" else "on-failure"]
    assert int(d["WatchdogSec"][0].rstrip("s")) > 0
    assert d["StateDirectory"][0].startswith("powerd")
    for key in ("NoNewPrivileges", "ProtectHome", "PrivateTmp", "ProtectKernelModules"):
        assert d[key] == ["yes"], key
    assert d["ProtectSystem"] == ["strict"]
    assert any("--log-format json" in line for line in d["ExecStart"])
    assert any(e.startswith("-/etc/powerd/") for e in d["EnvironmentFile"])


def test_controller_compiles_the_solver_before_it_starts() -> None:
    """`powerd warm` fills the unit's numba cache first (tolerated if the cache cannot be
    written: the controller then compiles for itself); agents never load the solver."""
    d = _directives("powerd-controller.service")
    assert d["ExecStartPre"] == ["-/usr/bin/powerd warm"]
    assert d["CacheDirectory"] == ["powerd"]
    assert "NUMBA_CACHE_DIR=%C/powerd/numba" in d["Environment"]
    assert "ExecStartPre" not in _directives("powerd-agent.service")


def test_controller_runs_as_its_own_user_without_capabilities() -> None:
    d = _directives("powerd-controller.service")
    assert d["User"] == ["powerd"]
    assert d["CapabilityBoundingSet"] == [""]
    assert d["PrivateDevices"] == ["yes"]


def test_agent_keeps_only_cap_sys_admin_and_nvidia_devices() -> None:
    d = _directives("powerd-agent.service")
    assert d["CapabilityBoundingSet"] == ["CAP_SYS_ADMIN"]
    assert "User" not in d  # the driver checks the capability; see the unit
    assert "PrivateDevices" not in d  # it would hide /dev/nvidia*
    assert d["DevicePolicy"] == ["closed"]
    assert "/dev/nvidiactl rw" in d["DeviceAllow"]
    assert "char-nvidia* rw" in d["DeviceAllow"]


def test_example_agent_settings_and_tokens_load() -> None:
    from powerd.agent.settings import AgentSettings
    from powerd.auth import Role, TokenStore

    etc = REPO / "systemd" / "etc-powerd"
    agent = AgentSettings.load(etc / "agent.toml")
    assert agent.node_id == agent.username  # the ACL's %u patterns rely on it
    assert agent.mqtt_config().tls
    tokens = TokenStore.from_file(etc / "tokens.toml")
    assert [(e.name, e.role) for e in tokens.entries] == [
        ("grafana", Role.VIEWER),
        ("slurm-prolog", Role.OPERATOR),
    ]


def test_bmc_agent_runs_unprivileged_and_reads_its_secrets_as_credentials() -> None:
    d = _directives("powerd-bmc-agent.service")
    assert d["DynamicUser"] == ["yes"] and d["CapabilityBoundingSet"] == [""]
    assert "LoadCredential" in d and all(
        c.split(":", 1)[1].startswith("/etc/powerd/") for c in d["LoadCredential"]
    )
    assert "--config ${CREDENTIALS_DIRECTORY}/bmc-agent.toml" in d["ExecStart"][0]
    from powerd.bmc.settings import BmcAgentSettings

    example = BmcAgentSettings.load(REPO / "systemd" / "etc-powerd" / "bmc-agent.toml")
    assert example.mqtt_config().tls
    assert str(example.state_dir) == "/var/lib/" + d["StateDirectory"][0]
    credentials = Path("/run/credentials/powerd-bmc-agent.service")
    # The service's dynamic user reads no file in /etc/powerd: every file the settings name
    # is one of /etc/powerd/bmc/, loaded as the credential bmc_<file>.
    assert example.tls_ca_file is not None
    assert Path(example.tls_ca_file).parent == credentials
    for node in example.nodes:
        assert node.password_file.parent == credentials
        assert node.password_file.name == f"bmc_{node.node_id}"
        assert node.ca_file is not None and node.ca_file.parent == credentials


def test_units_read_the_example_config_files() -> None:
    etc = {p.name for p in (REPO / "systemd" / "etc-powerd").iterdir()}
    for unit in UNITS:
        text = (REPO / "systemd" / unit).read_text()
        named = set(re.findall(r"/etc/powerd/([\w-]+\.[a-z]+)", text)) - {"policy.yaml"}
        assert named <= etc, named - etc
