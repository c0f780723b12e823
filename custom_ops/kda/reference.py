"""Kimi Delta Attention, the eager fp32 oracle (docs/model.md §2.1, §2.4). Torch-only; never imports a kernel.

Contract (= fla's naive functions):
    q, k  [B, T, H, K]   already L2-normalised (no norm inside)
    v     [B, T, H, V]
    g     [B, T, H, K]   log-decay, already activated (<= 0)
    beta  [B, T, H]      after sigmoid
    scale                default K ** -0.5
    initial_state [B, H, K, V] fp32 (zeros when None)
Returns (o [B, T, H, V] in v's dtype, final_state [B, H, K, V] fp32). With fp64 `v` everything is
computed (and the state returned) in fp64: the oracle for kernel error budgets.

Two levels: `kda_recurrent` is the token-by-token definition; `kda_chunked` is the chunkwise (WY/UT)
form checked against it. The chunked form never factorises exp(Γ_r − Γ_c) over a chunk: it takes
the exponent pairwise on the masked lower triangle, so every factor is <= 1 and nothing overflows
for gates down to -5 (or any gate, for the unbounded Kimi Linear form).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..common import cast


def _prepare(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None,
             initial_state: Tensor | None) -> tuple[Tensor, ...]:
    B, T, H, K = q.shape
    V = v.shape[-1]
    if k.shape != q.shape or g.shape != q.shape:
        raise ValueError(f"kda: q {tuple(q.shape)}, k {tuple(k.shape)}, g {tuple(g.shape)} must match")
    if v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"kda: v {tuple(v.shape)} / beta {tuple(beta.shape)} do not match q {tuple(q.shape)}")
    scale = K ** -0.5 if scale is None else scale
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32  # fp64 in: an fp64 oracle
    if initial_state is None:
        state = q.new_zeros(B, H, K, V, dtype=acc)
    else:
        if initial_state.shape != (B, H, K, V):
            raise ValueError(f"kda: initial_state {tuple(initial_state.shape)}, expected {(B, H, K, V)}")
        state = initial_state.to(acc).clone()
    # [B, T, H, *] -> [B, H, T, *], fp32 (fp64 for fp64 inputs)
    q, k, v, g = (x.to(acc).transpose(1, 2) for x in (q, k, v, g))
    beta = beta.to(acc).transpose(1, 2)
    return q * scale, k, v, g, beta, state


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    out_dtype = v.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    T = q.shape[2]
    o = torch.empty_like(v)  # [B, H, T, V]
    for t in range(T):
        S = S * g[:, :, t].exp()[..., None]  # decay rows: [B, H, K, V]
        kt = k[:, :, t]  # [B, H, K]
        err = v[:, :, t] - torch.einsum("bhk,bhkv->bhv", kt, S)  # [B, H, V]
        S = S + torch.einsum("bhk,bhv->bhkv", kt, beta[:, :, t, None] * err)
        o[:, :, t] = torch.einsum("bhk,bhkv->bhv", q[:, :, t], S)  # read after the write
    return o.transpose(1, 2).contiguous().to(out_dtype), S


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    out_dtype = v.dtype
    q, k, v, g, beta, S = _prepare(q, k, v, g, beta, scale, initial_state)
    B, H, T, K = q.shape
    C = chunk_size
    pad = (-T) % C
    if pad:  # zero k/v/beta and zero log-decay: padded steps leave the state untouched
        q, k, v, g = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v, g))
        beta = torch.nn.functional.pad(beta, (0, pad))
    n = (T + pad) // C
    # [B, H, n*C, *] -> [B, H, n, C, *]
    q, k, v, g = (x.reshape(B, H, n, C, x.shape[-1]) for x in (q, k, v, g))
    beta = beta.reshape(B, H, n, C)
    G = g.cumsum(-2)  # within-chunk cumulative log-decay Γ: [B, H, n, C, K]
    r = torch.arange(C, device=q.device)
    incl = r[:, None] >= r[None, :]  # [C, C] causal incl. diagonal
    strict = r[:, None] > r[None, :]
    eye = torch.eye(C, device=q.device, dtype=q.dtype)
    o = torch.empty_like(v)
    for i in range(n):
        Gi, qi, ki, vi, bi = G[:, :, i], q[:, :, i], k[:, :, i], v[:, :, i], beta[:, :, i]
        # pairwise decay exp(Γ_r − Γ_c) on c <= r only: [B, H, C, C, K], all entries <= 1
        D = Gi[:, :, :, None, :] - Gi[:, :, None, :, :]
        E = torch.where(incl[:, :, None], D, torch.full_like(D, float("-inf"))).exp()
        Akk = torch.einsum("bhrd,bhcd,bhrcd->bhrc", ki, ki, E) * strict * bi[..., None]  # L: [B, H, C, C]
        Aqk = torch.einsum("bhrd,bhcd,bhrcd->bhrc", qi, ki, E)  # [B, H, C, C], masked by E
        # UT transform: T = (I + L)^-1 Diag(β)
        Tm = torch.linalg.solve_triangular(eye + Akk, torch.diag_embed(bi), upper=False, unitriangular=True)
        W = Tm @ (ki * Gi.exp())  # [B, H, C, K]
        U = Tm @ vi  # [B, H, C, V]
        Vp = U - W @ S  # [B, H, C, V]
        o[:, :, i] = (qi * Gi.exp()) @ S + Aqk @ Vp
        Glast = Gi[:, :, -1:, :]  # [B, H, 1, K]
        S = Glast.transpose(-1, -2).exp() * S + (ki * (Glast - Gi).exp()).transpose(-1, -2) @ Vp
    o = o.reshape(B, H, n * C, -1)[:, :, :T]
    return o.transpose(1, 2).contiguous().to(out_dtype), S


def kda_gate(f: Tensor, A_log: Tensor, dt_bias: Tensor, lower_bound: float | None) -> Tensor:
    """Decay-gate activation (docs/model.md §2.2 step 4). f [..., H, D]; A_log [H]; dt_bias [H*D]. fp32 out.

    lower_bound set (K3 safe gate): g = lb * sigmoid(exp(A_log) * (f + dt_bias)), in (lb, 0).
    lower_bound None (Kimi Linear):  g = -exp(A_log) * softplus(f + dt_bias).
    """
    H, D = f.shape[-2:]
    x = cast(f, torch.float32) + cast(dt_bias, torch.float32).reshape(H, D)
    a = cast(A_log, torch.float32)[:H].exp()[:, None]  # [H, 1]
    if lower_bound is None:
        return -a * torch.nn.functional.softplus(x)
    return lower_bound * torch.sigmoid(a * x)


def l2norm(x: Tensor, eps: float = 1e-6) -> Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim, in fp32 (fla's in-kernel q/k norm)."""
    xf = cast(x, torch.float32)
    return cast(xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + eps), x.dtype)
