"""The explicit backend choice every k3 custom op takes (no silent fallback, no environment probing)."""

from __future__ import annotations

from enum import Enum

import torch


class Backend(str, Enum):
    REFERENCE = "reference"  # pure PyTorch, fp32 accumulation; any device
    TRITON = "triton"  # Triton kernels; CUDA tensors only


def check_backend(op: str, backend: str, *tensors: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for running `op` with `backend` on these tensors."""
    try:
        b = Backend(backend)
    except ValueError:
        return False, f"{op}: backend={backend!r} is not one of {[x.value for x in Backend]}"
    if b is Backend.TRITON:
        bad = [t.device.type for t in tensors if t.device.type != "cuda"]
        if bad:
            return False, f"{op}: backend='triton' needs CUDA tensors, got {bad[0]} (use backend='reference' on CPU)"
    return True, ""


def require_backend(op: str, backend: str, *tensors: torch.Tensor) -> Backend:
    ok, reason = check_backend(op, backend, *tensors)
    if not ok:
        raise ValueError(reason)
    return Backend(backend)
