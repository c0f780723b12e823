"""The suite on pytest-xdist workers (pyproject addopts: `-n 2 --dist loadfile --no-loadscope-reorder`;
`pytest -n 0` runs it in one process, e.g. with --pdb).

- `--dist loadfile`: each test file runs whole on one worker, in its own order, so a module-scoped fixture
  (or a module's own cache) is built once. (`--dist loadgroup` would spread finer, but pytest-xdist 3.8 tags
  groups through `Item._nodeid`, which pytest 9 no longer reads: under pytest 9 every test is its own unit.)
- `slow_first` (tests/conftest.py's collection hook): under xdist the files holding a test marked `slow` are
  queued first (`--no-loadscope-reorder` keeps this order), so the long files start at once instead of
  leaving one worker running the last of them while the other idles.
- `share_cores` (tests/conftest.py's configure hook): each worker's torch gets its share of the cores (one
  each for two workers on two cores), and so do the processes it starts (OMP_NUM_THREADS, unless set). Two
  workers each running torch's OpenMP pool over every core oversubscribe them, and the pools' spinning
  barriers wait on threads the other worker holds: tests/model took 47 s that way, 19 s with a core each.
- `build_once`: a session fixture's folder, built by the first worker of the run that needs it, in the run's
  shared temp root under a file lock; the other workers wait for it and read it. Without xdist: the session's
  own temp root.
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest


def on_worker(config: pytest.Config) -> bool:
    """True in an xdist worker (not in the controller, nor in a plain or `-n 0` run)."""
    return hasattr(config, "workerinput")


def share_cores(config: pytest.Config) -> None:
    """On an xdist worker: torch's intra-op threads (and, through OMP_NUM_THREADS unless the caller set it, its
    child processes') = the machine's cores over the worker count, at least one."""
    if not on_worker(config):
        return
    import torch

    share = max(1, (os.cpu_count() or 1) // int(config.workerinput["workercount"]))
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def slow_first(config: pytest.Config, items: list[pytest.Item]) -> None:
    if on_worker(config):
        slow = {item.path for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: item.path not in slow)  # stable, whole files: the same order on every worker


def build_once(request: pytest.FixtureRequest, name: str, build: Callable[[Path], None]) -> Path:
    """The folder `name` of this test run, filled by `build(folder)` once (a failed build is retried by the next
    worker that asks, so its error shows in every test that needs it)."""
    base = request.getfixturevalue("tmp_path_factory").getbasetemp()
    root = base.parent if on_worker(request.config) else base  # xdist: <run's basetemp>/popen-gwN
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # what a failed build left
            folder.mkdir()
            build(folder)
            done.touch()
    return folder
