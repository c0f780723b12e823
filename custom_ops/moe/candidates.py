"""k3::moe's CUDA candidates and their pick (plan/dispatch.py): what runs inside the op's `triton` kernels.

One dispatched op, `moe.experts`, classes by dtype and N tokens (<= 1, 16, 64, 256, 1024, 4096, 8192, more):
- `k3x`: the whole Triton plan (routing, align, the two grouped GEMMs with the GLU fused, weighted sum);
- `grouped_mm`: the same Triton routing (so the same routing decisions), then `torch._grouped_mm` (cuBLAS
  grouped GEMM) for gate, up and down over the pairs sorted by local expert, the GLU and the weighted sum in
  torch (fp32). No host synchronisation: pairs routed to other ranks' experts sort last, past the final group
  offset, and are masked out of the sum, so the step stays capturable in a CUDA graph.
Default order (no table): `k3x` only. Shape classes carry the dtype: tables are measured in bf16, so an fp32
call finds no entry and takes the default order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.dispatch import Candidate, bucket
from ...plan.dtypes import dtype_name
from ..dispatch import DISPATCH
from . import triton
from .reference import glu

EXPERTS = "moe.experts"
TOKENS = (1, 16, 64, 256, 1024, 4096, 8192)


def shape_class(N: int, dtype: torch.dtype) -> str:
    return f"{dtype_name(dtype)}-{bucket(N, TOKENS, 'tokens')}"


def grouped_mm_experts(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor,
                       w2: Tensor, top_k: int, routed_scaling_factor: float, renormalize: bool, activation: str,
                       situ_beta: float, situ_linear_beta: float, expert_offset: Tensor | None = None) -> Tensor:
    """k3::moe with torch._grouped_mm experts (see the module docstring)."""
    E, I, L = w1.shape
    N = z.shape[0]
    ids, wts = triton.route(x, gate_weight, gate_bias, top_k, routed_scaling_factor, renormalize)
    local = ids.reshape(-1)
    if expert_offset is not None:
        local = local - expert_offset.reshape(()).to(local.dtype)
    valid = (local >= 0) & (local < E)
    key = torch.where(valid, local, E)  # other ranks' pairs sort last, in no group
    pairs = torch.argsort(key, stable=True)
    counts = torch.zeros(E + 1, dtype=torch.int32, device=z.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32))
    offs = counts[:E].cumsum(0).to(torch.int32)
    tok = pairs // top_k
    a = z[tok]

    def grouped(rows: Tensor, w: Tensor) -> Tensor:
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)

    h = glu(grouped(a, w1), grouped(a, w3), activation, situ_beta, situ_linear_beta).to(z.dtype)
    y = grouped(h, w2).float() * wts.reshape(-1)[pairs, None].float()
    y = torch.where(valid[pairs, None], y, 0.0)
    return torch.zeros(N, L, dtype=torch.float32, device=z.device).index_add_(0, tok, y).to(z.dtype)


CANDIDATES = (Candidate("k3x", triton.moe), Candidate("grouped_mm", grouped_mm_experts))
DEFAULT = ("k3x",)


def moe(*args) -> Tensor:
    """k3::moe on CUDA tensors (the op's arguments, kernels excluded): the picked candidate for this class."""
    z = args[1]
    return DISPATCH.pick(EXPERTS, shape_class(z.shape[0], z.dtype), CANDIDATES, DEFAULT).run(*args)
