"""Routed (latent) MoE on MXFP4-packed experts, the eager fp32 oracle. Torch-only.

Same contract as `custom_ops/moe/reference.moe` (routing, SiTU/SiLU-GLU experts, weighted sum) with the
experts packed (codec.py): w1, w3 `[E, I, L/2]` u8 + scales `[E, I, L/32]` u8, w2 `[E, L, I/2]` u8 + scale
`[E, L, I/32]` u8. Only the experts a call routes to are decoded (one at a time, fp32), so the transient
memory is one expert's dense weights; decoding is exact, so the result equals decoding every expert first and
running the dense reference, bit for bit. `activations="mxfp8"`: both expert-GEMM inputs (z and the GLU output h)
are rounded through MXFP8 first (mxfp8.fake_quantize, exact emulation), the rest of the math unchanged.
"""

from __future__ import annotations

from torch import Tensor

from ..moe.reference import check_experts, local_ids, route, routed_experts
from .codec import BLOCK, dequantize
from .mxfp8 import fake_quantize


def packed_dims(w1: Tensor, w2: Tensor) -> tuple[int, int, int]:
    """(E, I, L) from the packed w1 [E, I, L/2] and w2 [E, L, I/2]."""
    E, I, half = w1.shape
    return E, I, 2 * half


def check_shapes(x: Tensor, z: Tensor, gate_weight: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, w1_scale: Tensor,
                 w3_scale: Tensor, w2_scale: Tensor, expert_offset: Tensor | None = None) -> tuple[int, int, int]:
    """(E, I, L), or ValueError naming every shape when the packed experts do not fit x / z."""
    E, I, L = packed_dims(w1, w2)
    want = {"w3": ((E, I, L // 2), w3), "w2": ((E, L, I // 2), w2), "w1_scale": ((E, I, L // BLOCK), w1_scale),
            "w3_scale": ((E, I, L // BLOCK), w3_scale), "w2_scale": ((E, L, I // BLOCK), w2_scale)}
    bad = [n for n, (shape, t) in want.items() if tuple(t.shape) != shape]
    gate = check_experts(E, gate_weight, x.shape[-1], expert_offset)
    if gate:
        bad.append(gate)
    if bad or z.shape[-1] != L or L % BLOCK or I % BLOCK:
        raise ValueError(f"moe_mxfp4: shapes x {tuple(x.shape)} z {tuple(z.shape)} gate {tuple(gate_weight.shape)} "
                         f"w1 {tuple(w1.shape)} w3 {tuple(w3.shape)} w2 {tuple(w2.shape)} scales "
                         f"{tuple(w1_scale.shape)} {tuple(w3_scale.shape)} {tuple(w2_scale.shape)} do not fit"
                         + (f" ({', '.join(bad)})" if bad else ""))
    return E, I, L


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
        w1_scale: Tensor, w3_scale: Tensor, w2_scale: Tensor, top_k: int, routed_scaling_factor: float,
        renormalize: bool, activation: str, situ_beta: float, situ_linear_beta: float,
        expert_offset: Tensor | None = None, activations: str = "bf16") -> Tensor:
    E, _, _ = check_shapes(x, z, gate_weight, w1, w3, w2, w1_scale, w3_scale, w2_scale, expert_offset)
    ids, w = route(x, gate_weight, gate_bias, top_k, routed_scaling_factor, renormalize)
    ids = local_ids(ids, expert_offset, E)  # expert parallelism: this rank's experts only

    def weights(e: int) -> tuple[Tensor, Tensor, Tensor]:
        return dequantize(w1[e], w1_scale[e]), dequantize(w3[e], w3_scale[e]), dequantize(w2[e], w2_scale[e])

    return routed_experts(z, ids, w, E, weights, activation, situ_beta, situ_linear_beta,
                          fake_quantize if activations == "mxfp8" else None)
