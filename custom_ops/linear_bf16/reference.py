"""A linear projection on bf16 weights as stored, the eager fp32 oracle. Torch-only.

    x       [..., K]   fp32 activations (fp64 gives an fp64 oracle)
    weight  [N, K]     bf16, nn.Linear's layout: the checkpoint's bytes unchanged
Returns x @ weight.float().T [..., N]: each bf16 weight widened exactly to fp32, products accumulated in fp32
(in fp64 for an fp64 x); the activations are never rounded to bf16.
"""

from __future__ import annotations

import torch
from torch import Tensor


def check_shapes(x: Tensor, weight: Tensor) -> None:
    """ValueError naming both shapes and dtypes when they do not make a bf16-weight linear."""
    ok = (x.dtype in (torch.float32, torch.float64) and weight.dtype == torch.bfloat16 and weight.dim() == 2
          and x.dim() >= 1 and x.shape[-1] == weight.shape[1])
    if not ok:
        raise ValueError(f"linear_bf16: x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype} "
                         "do not fit: expected x float32 [..., K] and weight bfloat16 [N, K]")


def linear_bf16(x: Tensor, weight: Tensor) -> Tensor:
    check_shapes(x, weight)
    return x @ weight.to(x.dtype).T
