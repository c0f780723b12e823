"""k3::kda_packed, the eager oracle: k3::kda's reference run sequence by sequence (docs/model.md §2.1).
Torch-only; never imports a kernel. No math of its own: a 1-row sequence (a decode step) runs
`kda.reference.kda_recurrent`, a longer one `kda.reference.kda_chunked`, each from its pool row.

Contract (op.py): q, k [N, H, K]; v [N, H, V]; g [N, H, K]; beta [N, H]; state_pool [S, H, K, V];
cu_seqlens [B+1]; slots [B]. Returns (o [N, H, V] in v's dtype, final_state [B, H, K, V] fp32; fp64
for fp64 `v`, like k3::kda's reference).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..kda.reference import kda_chunked, kda_recurrent


def check_packing(N: int, S: int, cu_seqlens: list[int], slots: list[int], op: str = "kda_packed") -> None:
    """ValueError naming `op` and the bad input unless cu_seqlens / slots describe B sequences over N rows of
    S slots."""
    if len(cu_seqlens) != len(slots) + 1:
        raise ValueError(f"{op}: cu_seqlens has {len(cu_seqlens)} entries, expected B+1 = {len(slots) + 1}")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != N or any(a > b for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        raise ValueError(f"{op}: cu_seqlens {cu_seqlens} must rise from 0 to N={N}")
    if any(not 0 <= s < S for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"{op}: slots {slots} must be distinct and in [0, {S})")


def kda_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cu_seqlens: Tensor,
               slots: Tensor, scale: float | None = None) -> tuple[Tensor, Tensor]:
    cu, sl = cu_seqlens.tolist(), slots.tolist()
    check_packing(q.shape[0], state_pool.shape[0], cu, sl)
    acc = torch.float64 if v.dtype == torch.float64 else torch.float32
    o = v.new_empty(v.shape)
    finals = []
    for b, slot in enumerate(sl):
        a, e = cu[b], cu[b + 1]
        s0 = state_pool[slot : slot + 1]
        if e == a:  # an empty sequence (not in a serving step) keeps its state
            finals.append(s0[0].to(acc))
            continue
        run = kda_recurrent if e - a == 1 else kda_chunked
        ob, sb = run(*(x[None, a:e] for x in (q, k, v, g, beta)), scale=scale, initial_state=s0)
        o[a:e] = ob[0]
        finals.append(sb[0])
    final = torch.stack(finals) if finals else state_pool.new_zeros((0, *state_pool.shape[1:]), dtype=acc)
    return o, final


def working_bytes(rows: int, heads: int, head_dim: int, value_dim: int, sequences: int = 1,
                  chunk_size: int = 64, item_bytes: int = 4) -> int:
    """Upper bound of what `kda_packed` holds at once (its outputs included) for a step of `rows` packed rows,
    from the shapes, with T = rows (one sequence may own the whole step; sequences run one after another)
    through k3::kda's `kda_chunked`; when every sequence is one row (rows == sequences, a decode step) through
    `kda_recurrent`: the outputs, then three [H, K, V] (the state, its outer-product update and the sum)
    and eight [H, K+V] (q * scale, the decay, the products, the output rows). fp32 work (f),
    C = chunk_size, Tp = T rounded up to whole chunks:
      outputs: o [N, H, V] (`item_bytes`), the finals and their stack 2 x [B, H, K, V];
      rows: q * scale [T, H, K], the fp32 casts of q, k, v, g, beta when `item_bytes` is not 4, their padded
        copies [Tp, H, 3K+V+1] when T is not whole chunks, the cumulative gate G [Tp, H, K], the chunked
        output [Tp, H, V], its transposed copy [T, H, V] (and its cast back);
      one chunk: four [H, C, C, K] (the pairwise decay D and its exp E, with either `where`'s fill and masked
        copy or the einsum's broadcast product and its contiguous copy), eight [H, C, C] (A_kk, A_qk, their
        masked products, I + L, diag(beta), the triangular solve, a previous chunk's still bound), six
        [H, C, K+V] (W, U, V', the decayed q and k and their products, a previous chunk's still bound) and
        six [H, K, V] (the state, its decayed copy and update, the state it replaces), the masks and eye [C, C]."""
    T, H, K, V, C, f = rows, heads, head_dim, value_dim, chunk_size, 4
    Tp = -(-T // C) * C
    outputs = T * H * V * item_bytes + 2 * sequences * H * K * V * f
    if rows == sequences:
        return outputs + 3 * H * K * V * f + 8 * H * (K + V) * f
    casts = T * H * (3 * K + V + 1) * f if item_bytes != f else 0
    padded = Tp * H * (3 * K + V + 1) * f if Tp != T else 0
    per_row = T * H * (K + V) * f + Tp * H * (K + V) * f + (T * H * V * item_bytes if item_bytes != f else 0)
    chunk = H * C * C * (4 * K + 8) * f + 6 * H * C * (K + V) * f + 6 * H * K * V * f + C * C * (f + 2)
    return outputs + casts + padded + per_row + chunk
