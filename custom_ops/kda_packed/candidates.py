"""k3::kda_packed's CUDA candidates and their pick (plan/dispatch.py): what runs inside the serving step's KDA.

One dispatched op, `kda_packed.step`. Classes by dtype and step: `short-B<=n` when no sequence can have more than
RECURRENT_MAX_T rows (decode steps; B = sequences), else `tokens<=n` (steps with a prefill chunk; N rows).
- `k3x`: the family's plan (recurrent kernel for the short sequences, the chunked pair for the long ones);
- `fla-recurrent-varlen` (short steps): fla-core's `fused_recurrent_kda` over the packed rows (cu_seqlens), from
  the pool rows gathered by slot (the op is pure: fla's in-pool state indexing would write the pool);
- `fla-chunk-varlen` (steps with a prefill chunk): fla-core's `chunk_kda` over the packed rows, the same gather.
Default order (no table): `k3x`. fla's varlen kernels read cu_seqlens on the host, so a step running them is
not capturable in a CUDA graph: the tune section times them with events where capture fails, and says so.
"""

from __future__ import annotations

from torch import Tensor

from ...plan.dispatch import Candidate, bucket
from ...plan.dtypes import dtype_name
from ..dispatch import DISPATCH
from ..kda.triton import RECURRENT_MAX_T, safe_gate
from . import triton

STEP = "kda_packed.step"
BATCH, TOKENS = (1, 8, 64, 256), (1024, 4096, 16384)
FLA = "fla"


def short(N: int, B: int) -> bool:
    return N <= B + RECURRENT_MAX_T - 1


def shape_class(N: int, B: int, dtype) -> str:
    rows = f"short-{bucket(B, BATCH, 'B')}" if short(N, B) else bucket(N, TOKENS, "tokens")
    return f"{dtype_name(dtype)}-{rows}"


def _k3x(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale, lb):
    return triton.kda_packed(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale=scale, gate_lower_bound=lb)


def _fla(chunked: bool):
    def run(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale, lb):
        from fla.ops.kda import chunk_kda, fused_recurrent_kda

        h0 = state_pool.index_select(0, slots.long()).contiguous()
        kw = {"safe_gate": True, "lower_bound": float(lb)} if chunked and safe_gate(lb) else {}
        fn = chunk_kda if chunked else fused_recurrent_kda
        o, s = fn(q[None], k[None], v[None], g[None], beta[None].to(q.dtype), scale=scale, initial_state=h0,
                  output_final_state=True, cu_seqlens=cu_seqlens.long(), **kw)
        return o[0].to(v.dtype), s.float()
    return run


SHORT = (Candidate("k3x", _k3x), Candidate("fla-recurrent-varlen", _fla(False), requires=FLA))
MIXED = (Candidate("k3x", _k3x), Candidate("fla-chunk-varlen", _fla(True), requires=FLA, interprets=False))
DEFAULT = ("k3x",)


def kda_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cu_seqlens: Tensor,
               slots: Tensor, scale: float, gate_lower_bound: float | None) -> tuple[Tensor, Tensor]:
    """k3::kda_packed on CUDA tensors: the picked candidate for this step's class."""
    N, B = q.shape[0], slots.shape[0]
    cands = SHORT if short(N, B) else MIXED
    c = DISPATCH.pick(STEP, shape_class(N, B, q.dtype), cands, DEFAULT)
    return c.run(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale, gate_lower_bound)
