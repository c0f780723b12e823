"""Serving-step cases over a paged latent pool (k3::mla_paged tests): each sequence's past latents are made
contiguous first (the dense truth), then scattered into a pool through a random block table, so an oracle
that never reads the pool can check everything that does."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass
class PagedCase:
    history: list[Tensor]  # per sequence: its past latents [past_b, L], contiguous (the truth)
    latent: Tensor  # this step's latents [N, L], packed
    pool: Tensor  # [NB, BS, L] holding every history through block_table
    block_table: Tensor  # [B, MB] int32 (may be a non-contiguous view)
    past_lens: Tensor  # [B] int32
    cu_seqlens: Tensor  # [B + 1] int32

    @property
    def paged(self) -> tuple[Tensor, ...]:
        return self.pool, self.block_table, self.past_lens, self.cu_seqlens


def paged_case(seqs: list[tuple[int, int]], block_size: int, L: int, *, dtype=torch.float32, spare_blocks: int = 3,
               strided: bool = False, gen: torch.Generator | None = None) -> PagedCase:
    """seqs: (past, T) per sequence. Blocks are handed out in a random order from a pool with `spare_blocks`
    never used (filled with garbage); unused block-table entries are random valid ids; `strided` makes the
    block table a non-contiguous view."""
    gen = gen or torch.Generator().manual_seed(0)
    need = [-(-(p + t) // block_size) for p, t in seqs]  # blocks each sequence needs, incl. this step's rows
    MB, NB = max(need), sum(need) + spare_blocks
    pool = torch.randn(NB, block_size, L, generator=gen, dtype=torch.float64).to(dtype) * 50  # garbage everywhere
    order = torch.randperm(NB, generator=gen)
    table = torch.randint(0, NB, (len(seqs), MB), generator=gen, dtype=torch.int32)
    history, used = [], 0
    for b, ((past, _), n) in enumerate(zip(seqs, need)):
        table[b, :n] = order[used:used + n].to(torch.int32)
        used += n
        h = torch.randn(past, L, generator=gen, dtype=torch.float64).to(dtype)
        for p in range(past):
            pool[table[b, p // block_size], p % block_size] = h[p]
        history.append(h)
    if strided:
        wide = torch.zeros(len(seqs), 2 * MB, dtype=torch.int32)
        wide[:, ::2] = table
        table = wide[:, ::2]
    T = torch.tensor([t for _, t in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), T.cumsum(0)]).to(torch.int32)
    latent = torch.randn(int(T.sum()), L, generator=gen, dtype=torch.float64).to(dtype)
    past_lens = torch.tensor([p for p, _ in seqs], dtype=torch.int32)
    return PagedCase(history, latent, pool, table, past_lens, cu)
