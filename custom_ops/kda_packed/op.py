"""`k3::kda_packed` — KDA over B sequences packed end to end, each starting from a row of a slot-indexed
state pool (the serving step). Torch-only; Triton is imported lazily.

    k3::kda_packed(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale, kernels, gate_lower_bound)
        -> (o, final_state)
    q, k [N, H, K] (L2-normalised); v [N, H, V]; g [N, H, K] fp32 log-decay; beta [N, H] fp32;
    state_pool [S, H, K, V] fp32; cu_seqlens [B+1] int32 (sequence b = rows cu_seqlens[b]:cu_seqlens[b+1],
    each >= 1 row); slots [B] int32 (distinct). o [N, H, V] (v's dtype), final_state [B, H, K, V] fp32.
Sequence b starts from state_pool[slots[b]] and runs the gated delta rule of k3::kda over its rows;
final_state[b] is its state after its last row. Pure: the pool is read, never written (the runtime writes
final_state back to the pool rows). `gate_lower_bound` as in k3::kda.
On CUDA the op runs the candidate `candidates.py` picks for the step's class (one graph node either way).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from ..kda.op import check_config as _kda_check_config
from . import reference


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::kda_packed cannot run `cfg` (None if it can): k3::kda's limits (the same kernels)."""
    reason = _kda_check_config(cfg, kernels=kernels)
    return None if reason is None else reason.replace("k3::kda", "k3::kda_packed")


def kda_packed_output_shapes(q_shape, v_shape, slots_shape):
    """One shape rule for the fake impl and the TensorRT plugin: dims in, dims out (only + * //)."""
    N, H, K = q_shape
    V = v_shape[2]
    B = slots_shape[0]
    return (N, H, V), (B, H, K, V)


SIGNATURE = Signature(
    "kda_packed", "KDAPacked",
    inputs=(TensorPort("q", "T"), TensorPort("k", "T", "q"), TensorPort("v", "T", "q"), TensorPort("g", "F"),
            TensorPort("beta", "F"), TensorPort("state_pool", "S"), TensorPort("cu_seqlens", "I"),
            TensorPort("slots", "I")),
    outputs=(TensorPort("o", "T", "v"), TensorPort("final_state", "S")),
    attrs=(Attr("scale", float), Attr("num_heads", int, op=False), Attr("head_dim", int, op=False),
           Attr("value_dim", int, op=False), KERNELS, Attr("gate_lower_bound", float, 0.0)),
    shapes=lambda s: kda_packed_output_shapes(s[0], s[2], s[7]),
    doc="Kimi Delta Attention over packed sequences. q, k [N, H, K] L2-normalised; v [N, H, V]; g [N, H, K] "
        "fp32 log-decay; beta [N, H] fp32; state_pool [S, H, K, V] fp32; cu_seqlens [B+1] int32; slots [B] "
        "int32 -> o [N, H, V], final_state [B, H, K, V] fp32: sequence b (rows cu_seqlens[b]:cu_seqlens[b+1]) "
        "starts from state_pool[slots[b]]. Same contract as torch.ops.k3.kda_packed. The pool is not written.",
)


@SIGNATURE.define
def _kda_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor,
                cu_seqlens: Tensor, slots: Tensor, scale: float, kernels: str,
                gate_lower_bound: float = 0.0) -> tuple[Tensor, Tensor]:
    tensors = (q, k, v, g, beta, state_pool, cu_seqlens, slots)
    if require_kernels("k3::kda_packed", kernels, *tensors) is Kernels.TRITON:
        from . import candidates  # the candidate picked for this step's class (custom_ops/dispatch.py)

        return candidates.kda_packed(*tensors, scale, gate_lower_bound or None)
    return reference.kda_packed(*tensors, scale=scale)


@dataclass
class KDAPackedOutput:
    output: Tensor  # [N, H, V]
    final_state: Tensor  # [B, H, K, V] fp32


def kda_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cu_seqlens: Tensor,
               slots: Tensor, *, scale: float | None = None, kernels: Kernels = Kernels.REFERENCE,
               gate_lower_bound: float | None = None) -> KDAPackedOutput:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lb = 0.0 if gate_lower_bound is None else float(gate_lower_bound)
    o, s = torch.ops.k3.kda_packed(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale,
                                   Kernels(kernels).value, lb)
    return KDAPackedOutput(o, s)
