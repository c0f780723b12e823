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


def check_packing(N: int, S: int, cu_seqlens: list[int], slots: list[int]) -> None:
    """ValueError naming the bad input unless cu_seqlens / slots describe B sequences over N rows of S slots."""
    if len(cu_seqlens) != len(slots) + 1:
        raise ValueError(f"kda_packed: cu_seqlens has {len(cu_seqlens)} entries, expected B+1 = {len(slots) + 1}")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != N or any(a > b for a, b in zip(cu_seqlens, cu_seqlens[1:])):
        raise ValueError(f"kda_packed: cu_seqlens {cu_seqlens} must rise from 0 to N={N}")
    if any(not 0 <= s < S for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"kda_packed: slots {slots} must be distinct and in [0, {S})")


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
