"""Files a command writes into a folder (`--out`): checked before the work, and written all
or none, so a failure leaves neither half a file nor half of a new report beside an old one.

A staging folder's name says who writes it: `.powerd-out-HOST-BOOT-PID-START-random` (a
hash of the host name and pid namespace, the kernel's boot id, the process id and its start
time in clock ticks since boot). A process killed outright (SIGKILL, the OOM killer, a power
cut) cannot remove its own; the next run into the same folder removes those whose process is
gone: same host, and another boot, or no process of that id started at that time (a pid
reused by a later process does not keep a dead run's folder). Folders of another host or
container (a shared file system), or whose owner cannot be told (named before this rule),
are left alone.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

from powerd.input_errors import InputError

STAGE_PREFIX = ".powerd-out-"
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")
# HOST-BOOT-PID-START-random, as _owner() writes it.
_STAGE_NAME = re.compile(
    re.escape(STAGE_PREFIX) + r"([0-9a-f]{8})-([0-9a-f]{12})-([0-9]+)-([0-9]+)-[^/]+"
)

log = structlog.get_logger(__name__)


class OutputError(InputError):
    """A folder that cannot take a command's files: the flag, the folder and why."""

    kind = "output folder"

    def __str__(self) -> str:  # one problem, one line: `--out DIR: cannot write there: why`
        return "; ".join(f"{self.source}: {msg}" for _, msg in self.problems)


def _refused(flag: str, out: Path, exc: OSError) -> OutputError:
    why = exc.strerror or str(exc)
    if isinstance(exc, FileExistsError | NotADirectoryError):
        why = "a file is in the way (give a folder)"
    return OutputError(f"{flag} {out}", [("", f"cannot write there: {why}")])


def check_out_dir(out: Path, flag: str = "--out") -> None:
    """`out` is a folder this process can write into, or one it can make (nothing is made
    here): OutputError if not, before hours of work are spent on files that cannot be kept."""
    there = out
    while not there.exists() and there != there.parent:
        there = there.parent
    if not there.is_dir():
        raise _refused(flag, out, NotADirectoryError(str(there)))
    if not os.access(there, os.W_OK | os.X_OK):
        raise _refused(flag, out, PermissionError(13, "permission denied", str(there)))


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot), None if there is none."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
        # Field 22, counted after the command name, which may hold spaces and parentheses.
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def _this_host() -> tuple[str, str] | None:
    """(host, boot) as staging names carry them; None where there is no /proc."""
    try:
        boot = BOOT_ID.read_text(encoding="ascii").strip().replace("-", "")[:12]
    except OSError:
        return None
    try:  # containers sharing a host name and a volume do not see each other's pids
        pids = os.readlink("/proc/self/ns/pid")
    except OSError:
        pids = ""
    host = hashlib.sha256(f"{socket.gethostname()}\0{pids}".encode()).hexdigest()[:8]
    return (host, boot) if re.fullmatch(r"[0-9a-f]{12}", boot) else None


def _owner() -> str:
    """This process's part of a staging folder's name (empty where it cannot be told)."""
    here, start = _this_host(), _start_ticks(os.getpid())
    if here is None or start is None:
        return ""
    return f"{here[0]}-{here[1]}-{os.getpid()}-{start}-"


def _is_stale(name: str, here: tuple[str, str]) -> bool:
    """A staging folder of this host whose process is gone (or is another by now)."""
    m = _STAGE_NAME.fullmatch(name)
    if m is None or m[1] != here[0]:
        return False
    return m[2] != here[1] or _start_ticks(int(m[3])) != int(m[4])


def remove_stale_stages(out: Path) -> list[str]:
    """Remove the staging folders in `out` left by runs that died; their names."""
    here = _this_host()
    if here is None:
        return []
    try:
        names = sorted(p.name for p in out.glob(STAGE_PREFIX + "*") if p.is_dir())
    except OSError:
        return []
    gone = [n for n in names if _is_stale(n, here)]
    for name in gone:
        shutil.rmtree(out / name, ignore_errors=True)
    if gone:
        log.warning(
            "out_stale_staging_removed",
            out=str(out),
            folders=gone,
            why="left by runs killed before they finished (their process is gone)",
        )
    return gone


@contextmanager
def staged(out: Path, flag: str = "--out") -> Iterator[Path]:
    """A staging folder inside `out` to write the files into. When the block ends normally
    each file is renamed into `out` (atomic per file, same file system); when it raises,
    the staging folder goes and `out` is as it was. Staging folders of runs that died
    are removed first (see the module's doc)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        remove_stale_stages(out)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=STAGE_PREFIX + _owner()))
    except OSError as exc:
        raise _refused(flag, out, exc) from None
    try:
        yield stage
        files = sorted(stage.iterdir())
        for path in files:  # all checked before any moves: none, or all of them
            if (out / path.name).is_dir():
                raise IsADirectoryError(21, f"{path.name} is a folder there", str(out))
        for path in files:
            os.replace(path, out / path.name)
    except OSError as exc:
        raise _refused(flag, out, exc) from None
    finally:
        shutil.rmtree(stage, ignore_errors=True)
