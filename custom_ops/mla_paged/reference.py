"""Absorbed MLA attention over a paged latent pool, the eager fp32 oracle. Torch-only; never imports a kernel.

Contract (`k3::mla_paged`, docs/architecture.md; the serving step):
    q_latent    [N, H, C]      queries taken into the latent space (q_nope @ W_uk), packed rows
    q_rope      [N, H, R]      the queries' rope/extra part (R may be 0)
    latent      [N, C + R]     this step's latents (normed c_KV | shared extra part), packed like the queries
    latent_pool [NB, BS, C+R]  the paged cache; position p of sequence b is row p % BS of block
                               block_table[b, p // BS]
    block_table [B, MB] int32, past_lens [B] int32, cu_seqlens [B + 1] int32 (sequence b = rows
    cu_seqlens[b]:cu_seqlens[b+1], its first token at position past_lens[b])
Token t of sequence b attends to b's past positions 0..past_lens[b]-1 (from the pool) and this step's latents
of b at 0..t: score = (q_latent . key[:C] + q_rope . key[C:]) * scale, softmax in fp32 (fp64 for fp64 inputs),
o = sum p * key[:C]. Returns o [N, H, C] in q_latent's dtype. The pool is read, never written.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gather_past(latent_pool: Tensor, blocks: Tensor, past: int) -> Tensor:
    """Positions 0..past-1 of one sequence from the pool through its block-table row `blocks` [MB] -> [past, L]."""
    pos = torch.arange(past, device=latent_pool.device)
    block_size = latent_pool.shape[1]
    return latent_pool[blocks[pos // block_size].long(), pos % block_size]


def mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
              past_lens: Tensor, cu_seqlens: Tensor, scale: float) -> Tensor:
    N, H, C = q_latent.shape
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    q = torch.cat([q_latent, q_rope], dim=-1).to(acc)  # [N, H, C + R]
    o = q_latent.new_empty(N, H, C, dtype=acc)
    bounds, pasts = cu_seqlens.tolist(), past_lens.tolist()
    for b, past in enumerate(pasts):
        start, end = bounds[b], bounds[b + 1]
        T = end - start
        keys = torch.cat([gather_past(latent_pool, block_table[b], past), latent[start:end]]).to(acc)  # [P+T, L]
        scores = torch.einsum("thl,sl->hts", q[start:end], keys) * scale  # [H, T, P + T]
        visible = torch.arange(past + T, device=q.device)[None, :] <= past + torch.arange(T, device=q.device)[:, None]
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        o[start:end] = torch.einsum("hts,sc->thc", probs, keys[:, :C])
    return o.to(q_latent.dtype)
