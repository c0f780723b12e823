"""Scratch folders for builds cached for a whole test process (`functools.lru_cache`): `scratch_dir` makes one
and `remove_all` (conftest's `pytest_unconfigure`, in every xdist worker) deletes them when the process's
tests are done, so runs leave nothing in the system's temp folder."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

_MADE: list[Path] = []


def scratch_dir(prefix: str) -> Path:
    root = Path(tempfile.mkdtemp(prefix=prefix))
    _MADE.append(root)
    return root


def remove_all() -> None:
    while _MADE:
        shutil.rmtree(_MADE.pop(), ignore_errors=True)
