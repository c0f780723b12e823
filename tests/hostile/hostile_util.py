"""Helpers of the hostile-input suite: the CLI in-process, and manifest edits as an attacker makes them."""

from __future__ import annotations

import contextlib
import json
import os
import threading
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


@contextlib.contextmanager
def released_fifo(path: Path, after: float = 4.0) -> Iterator[Callable[[], bool]]:
    """A FIFO at `path` that cannot hang the suite: a reader blocked on it is released after `after` seconds
    (a writer opens it and closes it empty). Yields `waited()`: whether a reader had to be released (the code
    under test opened the FIFO and waited on it)."""
    os.mkfifo(path)
    stop, released = threading.Event(), []

    def writer() -> None:
        if stop.wait(after):
            return
        while not stop.wait(0.05):
            try:
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:  # no reader: nothing waits on it now
                continue
            released.append(True)
            os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        yield lambda: bool(released)
    finally:
        stop.set()
        thread.join()
