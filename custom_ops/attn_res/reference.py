"""Block Attention Residuals mixer, the eager fp32 oracle (docs/model.md §4.2). Torch-only.

    prefix       [..., d]      the running partial block sum (the last, "current" source)
    bank         [..., N, d]   completed block representations b_0 .. b_{N-1} (N >= 1)
    norm_weight  [d]           RMSNorm weight of the keys
    proj_weight  [d]           pseudo-query (Linear d -> 1 without bias, flattened)
Returns [..., d] in prefix's dtype:
    V = [bank..., prefix];  K = V / sqrt(mean(V^2) + eps);  s = K · (norm_weight ⊙ proj_weight)
    out = Σ softmax(s) · V      (all in fp32; the raw sources are mixed, not the normalised keys)
"""

from __future__ import annotations

import torch
from torch import Tensor


def attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float) -> Tensor:
    if bank.shape[:-2] != prefix.shape[:-1] or bank.shape[-1] != prefix.shape[-1]:
        raise ValueError(f"attn_res: bank {tuple(bank.shape)} does not match prefix {tuple(prefix.shape)}")
    acc = torch.float64 if prefix.dtype == torch.float64 else torch.float32  # fp64 in: an fp64 oracle
    V = torch.cat([bank, prefix.unsqueeze(-2)], dim=-2).to(acc)  # [..., N+1, d]
    K = V * torch.rsqrt(V.pow(2).mean(-1, keepdim=True) + eps)
    query = norm_weight.to(acc) * proj_weight.to(acc).reshape(-1)  # effective query [d]
    p = torch.softmax(K @ query, dim=-1)  # [..., N+1]
    return (p.unsqueeze(-1) * V).sum(-2).to(prefix.dtype)


def working_bytes(rows: int, sources: int, width: int, item_bytes: int = 4) -> int:
    """Upper bound of what `attn_res` holds at once (its output included) for `rows` rows mixing `sources`
    = N + 1 sources of `width` d, from the shapes (fp32 work f): the stacked sources V [rows, N+1, d] (as
    concatenated, `item_bytes`, and widened), two more [rows, N+1, d] at once (V^2 then the keys K, then the
    weighted sources), five [rows, N+1] (mean, its sum and rsqrt, scores, softmax) and the mixed output
    [rows, d] in fp32 and as cast."""
    f, n = 4, rows * sources
    stacked = n * width * (item_bytes + (f if item_bytes != f else 0) + 2 * f)
    return stacked + 5 * n * f + rows * width * (f + item_bytes)
