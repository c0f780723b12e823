"""File helpers every writer and reader of k3x shares: one sha256, one rule for permissions, one rule for
which files of a folder may be read.

- `sha256(path)`: streamed, for artifacts, checkpoints and engines alike.
- `normal_permissions(path)`: what a plain `open`/`mkdir` would have given under the user's umask.
  `tempfile.mkstemp`/`mkdtemp` create 0600/0700 files and folders; k3x writes through them (to rename
  whole files into place), so every file and folder it hands over gets this.
- `confined(folder, name)`: the one confinement rule for every file k3x reads out of a folder it was given
  (checkpoint files of every kind, export artifacts, rank folders): `name` is a bare file name and the
  path, symlinks followed, is an entry directly in `folder`. A symlink to a sibling is fine; one that
  leaves the folder (a private file elsewhere) is refused. One exception, the Hugging Face hub cache's
  own layout: in a folder that is a hub snapshot (`.../models--ORG--NAME/snapshots/<commit>/`, the folder
  as resolved), a file may also resolve to an entry directly in that repository's `blobs/` (the hub
  stores each file there under its hash and links `../../blobs/<hash>` from the snapshot); nothing may
  resolve anywhere else, inside `models--ORG--NAME/` or out of it.
- `copy_file(src, dst)`: a copy whose permissions are the normal rule narrowed by the source's, so a
  private (0600) file never becomes world-readable by being copied.
- `write_output(path, data, flag=...)`: the one rule for every file k3x writes where the user named it
  (`--json`, `--save-state`, `logits --out`): an existing path must be a regular file (then replaced whole,
  by a rename); a device, FIFO, socket, folder, `/dev/fd/N` or anything under /dev, /proc, /sys is refused;
  so is one of the command's inputs (`inputs`), the `manifest.json` of an export folder and any file its
  manifest lists; a missing or read-only folder is one line. `-` and `/dev/stdout` are written as a stream
  where the flag allows it (`stream=True`). `check_output` applies the rule without writing (commands call it
  before any work, so a bad path costs nothing). Errors are `OutputError`, one line naming the flag.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterable


class OutsideFolderError(ValueError):
    """A file name that is not a bare name, or a path that resolves outside the folder it was read from."""


def safe_file_name(name: Any) -> bool:
    """A bare file name: no folder part, not `.`/`..`, no NUL, not hidden staging names."""
    return (isinstance(name, str) and 0 < len(name) <= 255 and "/" not in name and "\\" not in name
            and "\x00" not in name and name not in (".", "..") and not name.startswith(".tmp-"))


def confined(folder: str | Path, name: Any, *, error: type[Exception] = OutsideFolderError,
             what: str = "folder") -> Path:
    """`folder / name`, refused (`error`, one line) unless `name` is a bare file name and the path resolves
    (symlinks followed) to an entry directly in `folder`. `what` names the folder in the message."""
    if not safe_file_name(name):
        raise error(f"{folder}: {str(name)[:80]!r} is not a bare file name; a path outside the {what} is refused")
    p = Path(folder) / name
    try:
        real = p.resolve()
    except (OSError, RuntimeError) as e:  # a symlink loop
        raise error(f"{p}: cannot be resolved ({e}); refused") from None
    home = Path(folder).resolve()
    if real.parent != home and real.parent != hub_blobs(home):
        hub = "" if hub_blobs(home) is None else f" and its hub repository's {hub_blobs(home)}"
        raise error(f"{p}: resolves to {real}, outside the {what}{hub}; refused")
    return p


def hub_blobs(folder: Path) -> Path | None:
    """`models--ORG--NAME/blobs` when the (resolved) `folder` is a Hugging Face hub snapshot
    (`models--ORG--NAME/snapshots/<commit>`), else None."""
    repo = folder.parent.parent
    if folder.parent.name == "snapshots" and repo.name.startswith("models--") and len(repo.name) > len("models--"):
        return repo / "blobs"
    return None


def sha256(path: str | Path, *, h=None) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks; `h`: continue an existing hash object instead."""
    h = hashlib.sha256() if h is None else h
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def normal_permissions(path: str | Path) -> None:
    """chmod to 0666 (files) or 0777 (folders) less the process umask."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, (0o777 if Path(path).is_dir() else 0o666) & ~umask)


def copy_file(src: str | Path, dst: str | Path) -> None:
    """Copy `src`'s bytes to `dst` (created); its mode is the normal rule narrowed by `src`'s own mode."""
    import shutil

    shutil.copyfile(src, dst)
    normal_permissions(dst)
    os.chmod(dst, os.stat(dst).st_mode & os.stat(src).st_mode & 0o777)


class OutputError(ValueError):
    """A path the user named for k3x to write that it will not write (the message names the flag)."""


STDOUT_NAMES = ("-", "/dev/stdout")
_SYSTEM_TREES = ("/dev", "/proc", "/sys")
_KINDS = ((stat.S_ISDIR, "a folder"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_MANIFEST_BYTES = 16 << 20  # an export's manifest is kilobytes; a larger one is not read to find its files


def is_stdout(path: str | Path) -> bool:
    """`-` or /dev/stdout: the output is written to standard output as a stream."""
    return str(path) in STDOUT_NAMES


def check_output(path: str | Path, *, flag: str, inputs: Iterable[tuple[str, str | Path | None]] = (),
                 stream: bool = False) -> Path | None:
    """The real path `write_output` would replace (None: standard output, where `stream` allows it), or
    OutputError naming `flag`. `inputs`: (flag, path) of the command's own files and folders: OUT may not be
    one of them, nor an existing file inside an input folder."""
    where = f"{flag} {str(path) or repr('')}"
    if is_stdout(path):
        if stream:
            return None
        raise OutputError(f"{where}: this flag writes a file; standard output is not one")
    if not str(path):
        raise OutputError(f"{where}: an empty name; name a file")
    real = Path(os.path.realpath(path))
    if any(str(real) == t or str(real).startswith(t + "/") for t in _SYSTEM_TREES) \
            or any(str(Path(path).absolute()).startswith(t + "/") for t in _SYSTEM_TREES):
        raise OutputError(f"{where}: a device or system path, not a file k3x may replace; name a regular file")
    if not real.parent.is_dir():
        raise OutputError(f"{where}: the folder {real.parent} does not exist")
    try:
        st = os.stat(real)
    except FileNotFoundError:
        st = None
    except OSError as e:
        raise OutputError(f"{where}: cannot be examined ({e.strerror or e})") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = next((k for test, k in _KINDS if test(st.st_mode)), "not a regular file")
        raise OutputError(f"{where}: is {kind}; k3x replaces only regular files")
    for what, given in inputs:
        if given is not None and _same_or_inside(real, st, Path(given)):
            raise OutputError(f"{where}: is {what} {given}, an input of this command; name another file")
    listed = _export_files(real.parent)
    if real.name in listed:
        raise OutputError(f"{where}: is a file of the export in {real.parent} ({listed[real.name]}); "
                          "name a file outside its manifest")
    if not os.access(real.parent, os.W_OK | os.X_OK):
        raise OutputError(f"{where}: the folder {real.parent} is not writable")
    return real


def _same_or_inside(real: Path, st: os.stat_result | None, given: Path) -> bool:
    """`real` is the file `given` (the same inode, or the same path), or an existing file inside the folder."""
    try:
        g = os.stat(given)
    except OSError:
        return real == Path(os.path.realpath(given))
    if st is not None and (st.st_dev, st.st_ino) == (g.st_dev, g.st_ino):
        return True
    return st is not None and stat.S_ISDIR(g.st_mode) and Path(os.path.realpath(given)) in real.parents


def _export_files(folder: Path) -> dict[str, str]:
    """{name: what it is} of an export folder's own files: manifest.json and every file its manifest lists
    ({} in a folder without a manifest)."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        return {}
    found = {"manifest.json": "its manifest"}
    try:
        with open(manifest, "rb") as f:
            data = json.loads(f.read(_MANIFEST_BYTES))
        for name, art in data["artifacts"].items():
            found |= {str(e["path"]): f"artifact {name}" for e in art["files"]}
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass  # an unreadable manifest: its own name is still refused
    return found


def write_output(path: str | Path, data: bytes, *, flag: str, inputs: Iterable[tuple[str, str | Path | None]] = (),
                 stream: bool = False) -> None:
    """`data` to the user's `path` under `check_output`'s rule: written under a temporary name beside it and
    renamed into place (nothing half-written; the rule checked again just before the rename), or to standard
    output (`-`, /dev/stdout) where `stream` allows it. OutputError (one line) on any refusal or failure."""
    inputs = list(inputs)
    real = check_output(path, flag=flag, inputs=inputs, stream=stream)
    if real is None:
        sys.stdout.write(data.decode("utf-8"))  # a stream is text (JSON)
        sys.stdout.flush()
        return
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{real.name}-", dir=real.parent)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        normal_permissions(tmp)  # mkstemp creates 0600
        check_output(path, flag=flag, inputs=inputs)  # nothing else put there meanwhile
        os.replace(tmp, real)
    except OSError as e:
        raise OutputError(f"{flag} {path}: cannot write it ({e.strerror or e}); nothing was written") from None
    finally:
        if tmp is not None and os.path.lexists(tmp):
            os.unlink(tmp)
