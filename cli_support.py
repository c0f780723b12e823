"""Helpers of the k3x CLI (cli.py): one-line errors, the global-flag position, bounded `.npy` input and
stage progress with elapsed time, and the export-folder helpers `run` / `verify` share.

Notable choices:
- `fail` cuts messages to MAX_ERROR characters (an error once printed 7.9 MB); it and `echo` escape control
  characters (`printable`): a config's name or a path may carry terminal escape sequences.
- Every command registered on `App` maps the library's typed input errors to one line (`one_line_errors`).
- `-v` may follow the command (`_App` moves it before the command; click only accepts it there).
- `load_ids_npy` reads the `.npy` header first: no `.npz`, no pickles, no header promising more bytes than
  the file holds (a header claiming 8 TiB is refused before numpy allocates).
"""

from __future__ import annotations

import functools
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import typer


class App(typer.Typer):
    """`k3x CMD ... -v` works like `k3x -v CMD ...`: the global flag is moved before the command; every
    command's typed input errors are one line (`one_line_errors`)."""

    def __call__(self, *args, **kwargs):
        if not args and "args" not in kwargs:
            kwargs["args"] = hoist_global_flags(sys.argv[1:])
        return super().__call__(*args, **kwargs)

    def command(self, *args, **kwargs):
        register = super().command(*args, **kwargs)
        return lambda f: register(one_line_errors(f))


def input_errors() -> tuple[type[Exception], ...]:
    """The library's typed errors for bad input: each message names the file or field."""
    from .checkpoint.files import CheckpointError
    from .export.engine import EngineBuildError
    from .folder.artifacts import ManifestError
    from .folder.staging import FolderError
    from .model.config import ConfigError
    from .runtime.runners import RunnerError
    from .text.tokenizer import TokenizerError

    return ConfigError, TokenizerError, CheckpointError, ManifestError, FolderError, EngineBuildError, RunnerError


def one_line_errors(command: Callable[..., Any]) -> Callable[..., Any]:
    """`command` with the library's typed input errors (`input_errors`) turned into one `fail` line, wherever
    in the command they are raised (the one mapping; no per-command try/except needed for them)."""
    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except input_errors() as e:  # evaluated only when an exception propagates
            fail(str(e))

    return wrapper


def hoist_global_flags(argv: list[str]) -> list[str]:
    flags = [a for a in argv if a in ("-v", "--verbose")]
    return flags + [a for a in argv if a not in ("-v", "--verbose")]


MAX_ERROR = 2000


# C0 / C1 control characters but newline and tab, and the bidi overrides that reorder what a terminal shows
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """`text` with control characters shown escaped (`\\x1b`): a name or path from a config can hold
    terminal escape sequences, which must never reach the terminal raw."""
    return _CONTROL.sub(lambda m: ascii(m[0])[1:-1], text)


def echo(text: str, err: bool = False) -> None:
    """typer.echo of text that may hold user strings (config names, paths), control characters escaped."""
    typer.echo(printable(text), err=err)


def fail(message: str) -> None:
    """Print an error that names the bad input and exit 1 (cut to MAX_ERROR characters, control characters
    escaped)."""
    if len(message) > MAX_ERROR:
        message = message[:MAX_ERROR] + f"... ({len(message)} characters in all)"
    typer.secho(f"error: {printable(message)}", fg=typer.colors.RED, err=True)
    raise typer.Exit(code=1)


def one_line(e: BaseException) -> str:
    """`Type: first line of the message` (a runtime's own errors can be pages long)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:300] if lines else ''}"


def load_ids_npy(path: Path):
    """A .npy integer array [B, T], its header checked before any data is read (no .npz, no pickles,
    no header promising more bytes than the file holds)."""
    import numpy as np

    try:
        with open(path, "rb") as f:
            if f.read(4).startswith(b"PK"):
                fail(f"{path}: a .npz archive; --batch-file takes one .npy array [B, T] (np.save, not np.savez)")
            f.seek(0)
            version = np.lib.format.read_magic(f)
            shape, fortran, dtype = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                                     else np.lib.format.read_array_header_2_0)(f)
            header_end = f.tell()
        size = path.stat().st_size
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read a .npy array ({str(e)[:200]})")
    if len(shape) != 2 or dtype.kind not in "iu":
        fail(f"{path}: expected an integer array [B, T], got {dtype} {list(shape)}")
    if shape[0] * shape[1] * dtype.itemsize != size - header_end:
        fail(f"{path}: the header says {dtype} {list(shape)} ({shape[0] * shape[1] * dtype.itemsize:,} bytes), the "
             f"file holds {size - header_end:,}")
    try:
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        fail(f"{path}: cannot read a .npy array ({str(e)[:200]})")


class Progress:
    """`[stage] ...` / `[stage] done in S s`, plus `[stage] still running, S s` every TICK_S seconds of a long stage."""

    TICK_S = 15.0

    def __call__(self, stage: str, seconds: float | None) -> None:
        with self.lock:
            self.stage, self.start = (stage, time.perf_counter()) if seconds is None else (None, 0.0)
        typer.echo(f"[{stage}] " + ("..." if seconds is None else f"done in {seconds:.1f} s"))

    def _tick(self) -> None:
        while not self.stop.wait(self.TICK_S):
            with self.lock:
                if self.stage is not None:
                    typer.echo(f"[{self.stage}] still running, {time.perf_counter() - self.start:.0f} s")

    def __enter__(self) -> Progress:
        self.lock, self.stop, self.stage, self.start = threading.Lock(), threading.Event(), None, 0.0
        self.thread = threading.Thread(target=self._tick, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def export_folder(export_dir: Path):
    from .folder.artifacts import ExportFolder, ManifestError

    try:
        folder = ExportFolder.open(export_dir)
        folder.config()  # the recorded config must build
        return folder
    except ManifestError as e:
        fail(f"{export_dir}: not a k3x export folder ({e})")


def parse_ids(text: str, what: str) -> list[int]:
    try:
        ids = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        fail(f"{what}={text!r}: expected comma-separated integers, e.g. 1,2,3")
    if not ids:
        fail(f"{what}: no token ids given")
    return ids


def save_npy_atomic(path: Path, array) -> None:
    """`array` as a .npy file, renamed into place (nothing half-written)."""
    import io

    import numpy as np

    from .folder.artifacts import atomic_write_bytes

    buf = io.BytesIO()
    np.save(buf, array)
    atomic_write_bytes(path, buf.getvalue())
