"""The suite on pytest-xdist workers (pyproject addopts: `-n 2 --dist loadgroup --no-loadscope-reorder`;
`pytest -n 0` runs it in one process, e.g. with --pdb).

- `arrange` (tests/conftest.py's collection hook): a test that uses a module- or class-scoped fixture joins an
  xdist_group named for its module, so that fixture is built on one worker only; a test that already names a
  group keeps it (tests/onnx_mini_folder.py's users share one); every other test is scheduled on its own.
  Under xdist the test files holding a test marked `slow` are queued first (whole files, so a file's tests stay
  together): the long units start at once instead of leaving one worker running the last of them while the
  other idles.
- `build_once`: a session fixture's folder, built by the first worker of the run that needs it, in the run's
  shared temp root under a file lock; the other workers wait for it and read it. Without xdist: the session's
  own temp root.
"""

from __future__ import annotations

import fcntl
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

BUILT_PER_PROCESS = {"module", "class"}  # fixture scopes that each worker would build again


def on_worker(config: pytest.Config) -> bool:
    """True in an xdist worker (not in the controller, nor in a plain or `-n 0` run)."""
    return hasattr(config, "workerinput")


def _scopes(item: pytest.Item) -> set[str]:
    info = getattr(item, "_fixtureinfo", None)  # the closure of the fixtures the test uses
    return {defs[-1].scope for defs in info.name2fixturedefs.values() if defs} if info else set()


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def arrange(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker("xdist_group") is None and _scopes(item) & BUILT_PER_PROCESS:
            item.add_marker(pytest.mark.xdist_group(_file(item)))
    if on_worker(config):
        slow = {_file(item) for item in items if item.get_closest_marker("slow")}
        items.sort(key=lambda item: _file(item) not in slow)  # stable: the same order on every worker


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
