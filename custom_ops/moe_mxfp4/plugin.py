"""`k3::MoEMXFP4` TensorRT plugin: the routed MoE reading MXFP4-packed experts (uint8 ports) over the launch
plan of `triton.py` (k3::MoE's eight launches with the packed GEMMs).

    MoEMXFP4(x [N, d], z [N, L] (one dtype, fp32|fp16|bf16), gate_weight [E, d] (fp32|fp16|bf16), gate_bias [E]
             fp32, w1, w3 [E, I, L/2], w2 [E, L, I/2], w1_scale, w3_scale [E, I, L/32], w2_scale [E, L, I/32]
             (bytes: int8 as TensorRT passes them, which has no UINT8 plugin formats; uint8 for the JIT path),
             expert_offset [1] int32 (as k3::MoE's: E local experts, gate over all); k3::MoE's fields and
             activations "bf16" | "mxfp8" (the expert-GEMM input format: with "mxfp8" both GEMMs quantize
             their activation tiles to MXFP8 in the prologue, block-scaled MMAs on both operands on sm_100+))
             -> u [N, L] (z's dtype).
The engine keeps the experts packed (4.25 bits per weight); nothing is decoded outside the GEMM registers.
LINEAR only; N dynamic, d/L/E/I static. QDP (TensorRT 11): `impl` only, as k3::MoE.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec, dims_match
from ..moe import plugin as dense
from . import triton as kt
from .codec import BLOCK
from .mxfp8 import ACTIVATIONS
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    """k3::MoE's check on the dense shapes the packed ones stand for, plus the packed and scale shapes."""
    if attrs.get("activations") not in (None, *ACTIVATIONS):
        return f"field activations={attrs.get('activations')!r}: expected one of {list(ACTIVATIONS)}"
    x, z, gw, gb, w1, w3, w2, s1, s3, s2, off = (list(s) for s in shapes)
    if [len(s) for s in (w1, w3, w2, s1, s3, s2)] != [3] * 6:
        return f"packed expert ranks {[len(s) for s in (w1, w3, w2, s1, s3, s2)]}, expected all 3"
    E, I, half = w1
    L = None if half is None else 2 * half
    dense_w = lambda o, i: [E, o, i]  # noqa: E731
    reason = dense.check([x, z, gw, gb, dense_w(I, L), dense_w(I, L), dense_w(L, I), off], attrs)
    if reason:
        return reason
    if L is not None and (L % BLOCK or (I is not None and I % BLOCK)):
        return f"L={L}, I={I}: MXFP4 experts need multiples of {BLOCK}"
    want = {"w3": ([E, I, half], w3), "w2": ([E, L, None if I is None else I // 2], w2),
            "w1_scale": ([E, I, None if L is None else L // BLOCK], s1),
            "w3_scale": ([E, I, None if L is None else L // BLOCK], s3),
            "w2_scale": ([E, L, None if I is None else I // BLOCK], s2)}
    for name, (w, got) in want.items():
        if not dims_match(got, w):
            return f"{name} has shape {got}, expected {w} (w1 {w1})"
    return None


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan,
    notes="IPluginV3 aot: 8 cubins (router, top-k, align count/scan/scatter, packed GEMM1, packed GEMM2, sum); "
          "QDP: impl only",
)
