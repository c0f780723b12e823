"""Absorbed MLA attention over a paged latent pool, in key blocks: the CPU implementation of `k3::mla_paged`
(what the pt2 serving runner and eager serving run when the kernels are "reference"). Torch-only.

Same contract as `reference.mla_paged` (the simple oracle, which scores every row of a sequence against its
whole context at once). Here sequence b's keys are visited in blocks of `key_block` positions with an online
(flash-style) softmax: a running max m, sum l and [H, T, C] accumulator per query row, rescaled by
exp(m_old - m_new) as each block arrives, o = acc / l at the end. The past positions of a block are gathered
from the pool through the block table for that block only (whole pool blocks: the key block is a multiple of
the pool's block size), so no tensor ever spans the whole context; past keys are visible to every row of the
step (no mask). This step's own latents come last, in blocks too: the step block starting at s0 scores only
the rows t >= s0 (earlier rows see none of it), masked causally (key s visible from row t iff s <= t).
Every processed (row, block) pair sees at least one key, so the running max is finite after a row's first
block and the rescale never meets inf - inf.

Temporaries are bounded by the step's rows x heads x key block, never by the context: `working_bytes` states
them from the shapes (`k3x inspect` prints it for a chunk size; tests/custom_ops/test_mla_paged_blocked.py
holds a measurement of the live bytes under it).
"""

from __future__ import annotations

import torch
from torch import Tensor

KEY_BLOCK = 512  # key positions per block (rounded down to a multiple of the pool's block size, at least one)


def key_block_for(block_size: int, key_block: int | None = None) -> int:
    """Positions per key block for a pool of `block_size`: `key_block` (default KEY_BLOCK, read at call time)
    rounded down to whole pool blocks, at least one pool block."""
    kb = KEY_BLOCK if key_block is None else key_block
    return max(block_size, kb // block_size * block_size)


def working_bytes(rows: int, heads: int, kv_lora_rank: int, rope_dim: int, block_size: int,
                  key_block: int | None = None, item_bytes: int = 4) -> int:
    """Upper bound of the temporaries `mla_paged` holds at once for one step of `rows` packed rows (the
    attention of one MLA layer; layers run one after another), from the shapes, with T = rows (one sequence
    may own the whole step): the fp32 queries [rows, H, C+R] and a sequence's contiguous copy [H, T, C+R], its
    step latents widened to fp32 [T, C+R], the output [rows, H, C] in fp32 and as cast (`item_bytes`); a
    sequence's state (accumulator [H, T, C] and a block's product with the values, max and sum [H, T] and
    three [H, T] updates); one key block's work (scores [H, T, KB] exponentiated in place, its keys [KB, C+R]
    as gathered (`item_bytes`) and widened, the causal mask [T, KB] bool, its aranges and the block ids)."""
    kb, L, f = key_block_for(block_size, key_block), kv_lora_rank + rope_dim, 4
    step = rows * heads * (2 * L + kv_lora_rank) * f + rows * L * f + rows * heads * kv_lora_rank * item_bytes
    state = heads * rows * (2 * kv_lora_rank + 5) * f
    block = heads * rows * kb * f + kb * L * (item_bytes + f) + rows * kb + (kb + rows) * 8 + kb // block_size * 8
    return step + state + block


def mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
              past_lens: Tensor, cu_seqlens: Tensor, scale: float, key_block: int | None = None) -> Tensor:
    """o [N, H, C] in q_latent's dtype: see the module docstring (fp64 inputs accumulate in fp64)."""
    N, H, C = q_latent.shape
    acc = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    kb = key_block_for(latent_pool.shape[1], key_block)
    q = torch.cat([q_latent, q_rope], dim=-1).to(acc).transpose(0, 1)  # [H, N, L] (a view of [N, H, L])
    o = q_latent.new_empty(N, H, C, dtype=acc)
    bounds, pasts = cu_seqlens.tolist(), past_lens.tolist()
    for b, past in enumerate(pasts):
        start, end = bounds[b], bounds[b + 1]
        qb = q[:, start:end].contiguous()  # [H, T, L]
        state = Online(H, end - start, C, acc, q.device)
        for k0 in range(0, past, kb):
            state.add(qb, past_keys(latent_pool, block_table[b], k0, min(k0 + kb, past)).to(acc), scale)
        step = latent[start:end].to(acc)
        for s0 in range(0, end - start, kb):
            state.add(qb, step[s0:s0 + kb], scale, step_from=s0)
        o[start:end] = state.result().transpose(0, 1)
    return o.to(q_latent.dtype)


def past_keys(latent_pool: Tensor, blocks: Tensor, k0: int, k1: int) -> Tensor:
    """Past positions k0..k1-1 of one sequence (k0 on a pool-block boundary) through its block-table row
    `blocks` [MB] -> [k1 - k0, L]: whole pool blocks gathered, the last one cut."""
    bs = latent_pool.shape[1]
    ids = blocks[k0 // bs:-(-k1 // bs)].long()
    return latent_pool.index_select(0, ids).flatten(0, 1)[:k1 - k0]


class Online:
    """The running softmax of T query rows x H heads: max m, sum l [H, T] and accumulator [H, T, C]."""

    def __init__(self, heads: int, rows: int, C: int, dtype: torch.dtype, device: torch.device) -> None:
        self.m = torch.full((heads, rows), float("-inf"), dtype=dtype, device=device)
        self.l = torch.zeros(heads, rows, dtype=dtype, device=device)
        self.acc = torch.zeros(heads, rows, C, dtype=dtype, device=device)

    def add(self, q: Tensor, keys: Tensor, scale: float, step_from: int | None = None) -> None:
        """One key block `keys` [KB, L] for the queries q [H, T, L]. step_from None: past keys, seen by every
        row; else the keys are this step's rows step_from.., seen by rows t >= step_from, key step_from + j
        from row t iff j <= t - step_from."""
        C = self.acc.shape[-1]
        rows = slice(step_from or 0, None)
        s = torch.matmul(q[:, rows], keys.T).mul_(scale)  # [H, T', KB]
        if step_from is not None:
            pos = lambda n: torch.arange(n, device=s.device)  # noqa: E731
            hidden = pos(keys.shape[0])[None, :] > pos(s.shape[1])[:, None]  # [T', KB]
            s.masked_fill_(hidden, float("-inf"))
        m_old, l, acc = self.m[:, rows], self.l[:, rows], self.acc[:, rows]
        m_new = torch.maximum(m_old, s.amax(-1))
        alpha = torch.exp(m_old - m_new)
        s.sub_(m_new.unsqueeze(-1)).exp_()
        l.mul_(alpha).add_(s.sum(-1))
        acc.mul_(alpha.unsqueeze(-1)).add_(torch.matmul(s, keys[:, :C]))
        m_old.copy_(m_new)

    def result(self) -> Tensor:
        return self.acc / self.l.unsqueeze(-1)
