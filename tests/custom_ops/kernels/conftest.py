"""Kernel parity tests: run only where Triton can run.

Two ways in: the device-free interpreter (`TRITON_INTERPRET=1` set before Triton is imported, which
`tests/custom_ops/test_triton_kernels.py` does in a child process; CPU tensors, fp32 only) or a CUDA
GPU (CUDA tensors; the `gpu`-marked bf16 cases run too).  Anywhere else every test here is skipped
with that reason.  The interpreter must never be enabled in a process that exports.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ENABLED = INTERPRET or torch.cuda.is_available()
if not ENABLED:  # the plain run reaches these through the interpreter child; do not list them as skips
    collect_ignore_glob = ["test_*.py"]
REASON = "Triton kernels need TRITON_INTERPRET=1 (run via tests/custom_ops/test_triton_kernels.py) or a CUDA GPU"


def pytest_collection_modifyitems(config, items):
    here = os.path.dirname(__file__)
    for item in items:
        if not str(item.fspath).startswith(here):
            continue
        if not ENABLED:
            item.add_marker(pytest.mark.skip(reason=REASON))
        elif item.get_closest_marker("gpu") and (INTERPRET or not torch.cuda.is_available()):
            item.add_marker(pytest.mark.skip(reason="bf16 kernel case: needs a CUDA GPU (the interpreter is fp32-only)"))


@pytest.fixture
def device() -> str:
    """CPU tensors under the interpreter, CUDA otherwise."""
    return "cpu" if INTERPRET else "cuda"


@pytest.fixture
def allow_cpu_triton(monkeypatch, device):
    """Lift the ops' 'triton needs CUDA tensors' check for this test only (CPU tensors under the interpreter)."""
    if device == "cpu":
        import k3x.plan.kernels as kernels

        monkeypatch.setattr(kernels, "check_kernels", lambda op, name, *tensors: (True, ""))
