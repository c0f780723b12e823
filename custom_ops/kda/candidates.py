"""k3::kda's CUDA candidates and their pick (plan/dispatch.py): what runs inside the op's `triton` kernels.

Two dispatched ops, each with its shape classes (the tune section of bench/gpu_check.py times K3's shapes in
every class and writes the table custom_ops/dispatch.py reads):
- `kda.prefill` (T > RECURRENT_MAX_T), classes by B·T tokens (<= 1K, 4K, 16K, more): `k3x` (the chunked pair,
  state kernel entry chosen from its compiled resources), `k3x-state-BVxWxS` (the same with the state kernel's
  entry named: every entry that runs right, `triton.state_config_runs_right`), `fla-chunk` (fla-core's
  `chunk_kda`, safe-gate kernels when the op's gate bound allows them).
- `kda.decode` (T <= RECURRENT_MAX_T), classes by B·T rows (<= 1, 8, 64, 256, more): `k3x` (the recurrent
  kernel), `fla-recurrent` (fla-core's `fused_recurrent_kda`).
Shape classes carry the dtype. Default order (no table): the project's kernels only, so an op never runs fla
unless a table measured on this GPU kind says fla won there. Every candidate has the op's contract: (o in v's dtype, final_state fp32).
"""

from __future__ import annotations

from torch import Tensor

from ...plan.dispatch import Candidate, bucket
from ...plan.dtypes import dtype_name
from ..dispatch import DISPATCH
from . import triton

PREFILL, DECODE = "kda.prefill", "kda.decode"
PREFILL_TOKENS = (1024, 4096, 16384)
DECODE_ROWS = (1, 8, 64, 256)
FLA = "fla"  # fla-core


def shape_class(op: str, B: int, T: int, dtype) -> str:
    """'bf16-tokens<=4096' (prefill), 'bf16-rows<=64' (decode): the dtype first, since tables are measured in bf16
    and an fp32 call must not take a bf16 pick."""
    rows = bucket(B * T, PREFILL_TOKENS, "tokens") if op == PREFILL else bucket(B * T, DECODE_ROWS, "rows")
    return f"{dtype_name(dtype)}-{rows}"


def _k3x_chunked(entry: tuple[int, int, int] | None):
    def run(q, k, v, g, beta, scale, h0, lb):
        return triton.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=h0, gate_lower_bound=lb,
                                  state_entry=entry)
    return run


def _fla_chunk(q, k, v, g, beta, scale, h0, lb):
    from fla.ops.kda import chunk_kda

    bounded = {"safe_gate": True, "lower_bound": float(lb)} if triton.safe_gate(lb) else {}
    o, s = chunk_kda(q, k, v, g, beta, scale=scale, initial_state=h0.float().contiguous(), output_final_state=True,
                     **bounded)
    return o.to(v.dtype), s.float()


def _k3x_recurrent(q, k, v, g, beta, scale, h0, lb):
    return triton.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=h0)


def _fla_recurrent(q, k, v, g, beta, scale, h0, lb):
    from fla.ops.kda import fused_recurrent_kda

    o, s = fused_recurrent_kda(q, k, v, g, beta, scale=scale, initial_state=h0.float().contiguous(),
                               output_final_state=True)
    return o.to(v.dtype), s.float()


def entry_name(key: tuple[int, int, int]) -> str:
    return "k3x-state-{}x{}x{}".format(*key)


CANDIDATES = {
    PREFILL: (Candidate("k3x", _k3x_chunked(None)),
              *(Candidate(entry_name(key), _k3x_chunked(key)) for key in triton.STATE_RESOURCES_SM90
                if triton.state_config_runs_right(key)),
              Candidate("fla-chunk", _fla_chunk, requires=FLA, interprets=False)),  # its intra kernel needs a GPU
    DECODE: (Candidate("k3x", _k3x_recurrent), Candidate("fla-recurrent", _fla_recurrent, requires=FLA)),
}
DEFAULT = {PREFILL: ("k3x",), DECODE: ("k3x",)}


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, initial_state: Tensor,
        gate_lower_bound: float | None) -> tuple[Tensor, Tensor]:
    """k3::kda on CUDA tensors: the picked candidate for this op and shape class."""
    B, T = q.shape[:2]
    op = DECODE if T <= triton.RECURRENT_MAX_T else PREFILL
    c = DISPATCH.pick(op, shape_class(op, B, T, q.dtype), CANDIDATES[op], DEFAULT[op])
    return c.run(q, k, v, g, beta, scale, initial_state, gate_lower_bound)
