"""File helpers every writer and reader of k3x shares: one sha256, one rule for permissions.

- `sha256(path)`: streamed, for artifacts, checkpoints and engines alike.
- `normal_permissions(path)`: what a plain `open`/`mkdir` would have given under the user's umask.
  `tempfile.mkstemp`/`mkdtemp` create 0600/0700 files and folders; k3x writes through them (to rename
  whole files into place), so every file and folder it hands over gets this.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


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
