"""Routed (latent) MoE, the eager fp32 oracle (docs/model.md §5.1–5.2). Torch-only.

Axes: N tokens, d model width, L expert width (latent 3584 in K3, = d without latent), E experts,
I expert intermediate, k = top_k.

    x            [N, d]      router input (full width)
    z            [N, L]      expert input (W_down x for LatentMoE, x itself otherwise)
    gate_weight  [E, d]      router; logits in fp32, scores s = sigmoid(logits)
    gate_bias    [E]         e_score_correction_bias: selection only, never in the weights
    w1, w3       [E, I, L]   gate / up projections;  w2 [E, L, I] down projection
    expert_offset [1] int    expert parallelism: w1/w3/w2 hold E_local experts starting at this global id
Returns u [N, L] in z's dtype: Σ_{j ∈ top_k(s + bias)} p_j · E_j(z), with
p_j = s_j / (Σ_top s + 1e-20) · routed_scaling_factor (renormalize) or s_j · factor; with an offset, the
sum runs over the pairs whose expert is local only (routing, weights and renormalisation stay global).
The latent RMSNorm, the up projection and the shared experts are ordinary layers outside this op.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ..common import cast


def glu(a: Tensor, b: Tensor, activation: str, beta: float, linear_beta: float) -> Tensor:
    """Gated activation in fp32 (fp64 for fp64 inputs). 'situ': [β1 tanh(a/β1) σ(a)] ⊙ [β2 tanh(b/β2)];
    'silu': a σ(a) ⊙ b."""
    if a.dtype != torch.float64:
        a, b = cast(a, torch.float32), cast(b, torch.float32)
    if activation == "situ":
        return (beta * torch.tanh(a / beta) * torch.sigmoid(a)) * (linear_beta * torch.tanh(b / linear_beta))
    if activation == "silu":
        return torch.nn.functional.silu(a) * b
    raise ValueError(f"activation={activation!r}: expected 'situ' or 'silu'")


def route(x: Tensor, gate_weight: Tensor, gate_bias: Tensor, top_k: int, routed_scaling_factor: float,
          renormalize: bool) -> tuple[Tensor, Tensor]:
    """(topk_ids [N, k] int64, topk_weights [N, k] fp32, fp64 for fp64 x)."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    s = torch.sigmoid(x.to(acc) @ gate_weight.to(acc).t())  # [N, E]
    ids = torch.topk(s + gate_bias.to(acc), top_k, dim=-1).indices  # selection on biased scores
    w = s.gather(-1, ids)  # weights from unbiased scores
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return ids, w * routed_scaling_factor


def check_experts(E: int, gate_weight: Tensor, d: int, expert_offset: Tensor | None) -> str | None:
    """Why gate_weight [E_all, d] and `expert_offset` do not fit E local experts (None when they do)."""
    E_all = gate_weight.shape[0]
    if gate_weight.shape[1] != d or (E_all != E if expert_offset is None else E_all < E):
        return f"gate {tuple(gate_weight.shape)} for {E} expert(s) of width {d}"
    if expert_offset is not None and (expert_offset.numel() != 1 or expert_offset.dtype not in (torch.int32,
                                                                                                 torch.int64)):
        return f"expert_offset {tuple(expert_offset.shape)} {expert_offset.dtype}: expected one int32/int64 value"
    return None


def local_ids(ids: Tensor, expert_offset: Tensor | None, E: int) -> Tensor:
    """Global expert ids -> ids of this rank's E experts (first one = expert_offset); -1 for pairs routed to
    experts elsewhere (matched by no local expert, so never computed)."""
    if expert_offset is None:
        return ids
    local = ids - expert_offset.reshape(()).to(device=ids.device, dtype=ids.dtype)
    return torch.where((local >= 0) & (local < E), local, -1)


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
        top_k: int, routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
        situ_linear_beta: float, expert_offset: Tensor | None = None) -> Tensor:
    E, I, L = w1.shape
    bad = check_experts(E, gate_weight, x.shape[-1], expert_offset)
    if z.shape[-1] != L or w3.shape != w1.shape or w2.shape != (E, L, I) or bad:
        raise ValueError(f"moe: shapes x {tuple(x.shape)} z {tuple(z.shape)} gate {tuple(gate_weight.shape)} "
                         f"w1 {tuple(w1.shape)} w3 {tuple(w3.shape)} w2 {tuple(w2.shape)} do not fit"
                         + (f" ({bad})" if bad else ""))
    ids, w = route(x, gate_weight, gate_bias, top_k, routed_scaling_factor, renormalize)
    ids = local_ids(ids, expert_offset, E)
    return routed_experts(z, ids, w, E, lambda e: (w1[e], w3[e], w2[e]), activation, situ_beta, situ_linear_beta)


def routed_experts(z: Tensor, ids: Tensor, w: Tensor, E: int, weights: Callable[[int], tuple[Tensor, Tensor, Tensor]],
                   activation: str, situ_beta: float, situ_linear_beta: float,
                   quantize: Callable[[Tensor], Tensor] | None = None) -> Tensor:
    """u [N, L] = Σ_j w[n, j] · E_{ids[n, j]}(z[n]); `weights(e)` gives expert e's (w1 [I, L], w3, w2 [L, I]) and
    is called only for the experts some token is routed to, in ascending order (the accumulation order).
    `quantize`: applied row-wise to both GEMM inputs, z and the GLU output h (MXFP8 activations)."""
    acc = torch.float64 if z.dtype == torch.float64 else torch.float32  # fp64 in: an fp64 oracle
    q = quantize or (lambda t: t)
    zf, w = q(z.to(acc)), w.to(acc)
    out = torch.zeros(z.shape[0], z.shape[-1], dtype=acc, device=z.device)
    for e in range(E):
        tok, slot = (ids == e).nonzero(as_tuple=True)  # tokens routed to expert e
        if tok.numel() == 0:
            continue
        w1, w3, w2 = (t.to(acc) for t in weights(e))
        h = glu(zf[tok] @ w1.t(), zf[tok] @ w3.t(), activation, situ_beta, situ_linear_beta)
        out.index_add_(0, tok, (q(h.to(acc)) @ w2.t()) * w[tok, slot, None])
    return out.to(z.dtype)
