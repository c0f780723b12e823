"""Shared by the tests that start rank processes: `launch` runs `python -m k3x ARGS` (or a script) in a
subprocess, under torch.distributed.run with `torchrun` processes or plain, with a timeout and a bounded gloo
timeout (K3X_DIST_TIMEOUT_S), so a broken launcher fails the test instead of hanging it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import k3x

LAUNCH_TIMEOUT_S = 300


def env() -> dict[str, str]:
    root = str(Path(k3x.__file__).parent.parent)  # so `-m k3x` resolves in the ranks as it does here
    return {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")]),
            "K3X_DIST_TIMEOUT_S": "90", "OMP_NUM_THREADS": "1"}


def launch(args: list[str], *, torchrun: int | None, script: Path | None = None) -> subprocess.CompletedProcess:
    """`k3x ARGS` (or `script ARGS`) in `torchrun` processes (None: one plain process)."""
    what = [str(script)] if script else ["-m", "k3x"]
    pre = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={torchrun}", *what] \
        if torchrun else [sys.executable, *what]
    try:
        return subprocess.run(pre + args, env=env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"launch timed out after {LAUNCH_TIMEOUT_S} s: {' '.join(args)}\n{(e.stdout or '')[-2000:]}")
