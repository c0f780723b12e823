"""Helpers of the hostile-input suite: the CLI in-process, and manifest edits as an attacker makes them."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

from typer.testing import CliRunner

from k3x.cli import app
from k3x.folder.artifacts import MANIFEST, sha256

cli = CliRunner()


def k3x(*args: str):
    """Run the CLI in-process; (exit code, stdout + stderr)."""
    r = cli.invoke(app, [str(a) for a in args])
    crash = "" if r.exception is None or isinstance(r.exception, SystemExit) else f"\nCRASH {r.exception!r}"
    return r.exit_code, r.output + crash


def edit_manifest(folder: Path, change) -> dict:
    """Apply `change(manifest)` (in place) and write it back as the attacker would."""
    m = json.loads((folder / MANIFEST).read_text())
    change(m)
    (folder / MANIFEST).write_text(json.dumps(m))
    return m


def rehash(folder: Path, artifact: str) -> None:
    """Record the current bytes of an artifact's files in the manifest (an attacker controls both)."""
    def change(m):
        for f in m["artifacts"][artifact]["files"]:
            p = folder / f["path"]
            f["bytes"], f["sha256"] = p.stat().st_size, sha256(p)
    edit_manifest(folder, change)


class Payload:
    """Unpickling it writes `marker`: the proof that a file ran code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').write('pwned')",)


_RELEASER = """
import os, sys, time
path, marker, after = sys.argv[1], sys.argv[2], float(sys.argv[3])
time.sleep(after)
while True:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # succeeds only while a reader has it open
        open(marker, "w").close()  # before the close: the reader sees its end of file after this
        os.close(fd)
    except OSError:
        pass
    time.sleep(0.05)
"""


@contextlib.contextmanager
def released_fifo(path: Path, after: float = 4.0) -> Iterator[Callable[[], bool]]:
    """A FIFO at `path` that cannot hang the suite: a reader blocked on it is released after `after` seconds
    by another process (a writer opens it and closes it empty; a process, because the blocked call may hold
    this one's GIL). Yields `waited()`: whether a reader had to be released (the code under test opened the
    FIFO and waited on it)."""
    os.mkfifo(path)
    marker = Path(f"{path}.released")
    child = subprocess.Popen([sys.executable, "-c", _RELEASER, str(path), str(marker), str(after)])
    try:
        yield marker.exists
    finally:
        child.kill()
        child.wait()
