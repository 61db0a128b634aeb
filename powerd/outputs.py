"""Files a command writes into a folder (`--out`): checked before the work, and written all
or none, so a failure leaves neither half a file nor half of a new report beside an old one.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from powerd.input_errors import InputError

STAGE_PREFIX = ".powerd-out-"


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


@contextmanager
def staged(out: Path, flag: str = "--out") -> Iterator[Path]:
    """A staging folder inside `out` to write the files into. When the block ends normally
    each file is renamed into `out` (atomic per file, same file system); when it raises,
    the staging folder goes and `out` is as it was."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        stage = Path(tempfile.mkdtemp(dir=out, prefix=STAGE_PREFIX))
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
