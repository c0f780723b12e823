"""Runs the Triton kernel parity tests (tests/custom_ops/kernels) under the interpreter, in a child process.

TRITON_INTERPRET=1 must be set before Triton is imported and must never be set in a process that
exports, so the interpreter lives only in the child.  The child must pass and must have run tests.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_triton_kernels_under_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    # -n 0: one process (pyproject's addopts start xdist workers); this test already runs beside the others
    proc = subprocess.run([sys.executable, "-m", "pytest", "tests/custom_ops/kernels", "-q", "-p", "no:cacheprovider",
                           "-n", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"kernel tests failed under TRITON_INTERPRET=1:\n{out}"
    passed = re.search(r"(\d+) passed", out)
    assert passed and int(passed.group(1)) > 0, f"no kernel test ran:\n{out}"
