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
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import Any


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
