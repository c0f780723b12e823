"""The kernel implementation choice every k3 custom op takes: `kernels=reference|triton`.

Named apart from the runner a user picks (`k3x run --backend ort|pt2|...`): this choice is an argument of
the custom op, baked into a traced `.pt2`, and set from the build options (`BuildOptions.kernels`, `k3x export
--kernels`). No silent fallback, no environment probing: an unsupported combination raises with the reason.
"""

from __future__ import annotations

from enum import Enum

import torch


class Kernels(str, Enum):
    REFERENCE = "reference"  # pure PyTorch, fp32 accumulation; any device
    TRITON = "triton"  # Triton kernels; CUDA tensors only


def check_kernels(op: str, kernels: str, *tensors: torch.Tensor) -> tuple[bool, str]:
    """(ok, reason) for running `op` with `kernels` on these tensors."""
    try:
        k = Kernels(kernels)
    except ValueError:
        return False, f"{op}: kernels={kernels!r} is not one of {[x.value for x in Kernels]}"
    if k is Kernels.TRITON:
        bad = [t.device.type for t in tensors if t.device.type != "cuda"]
        if bad:
            return False, f"{op}: kernels='triton' needs CUDA tensors, got {bad[0]} (use kernels='reference' on CPU)"
    return True, ""


def require_kernels(op: str, kernels: str, *tensors: torch.Tensor) -> Kernels:
    ok, reason = check_kernels(op, kernels, *tensors)
    if not ok:
        raise ValueError(reason)
    return Kernels(kernels)
