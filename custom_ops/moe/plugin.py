"""`k3::MoE` TensorRT plugin: the routed (latent) MoE over the launch plan of `triton.py`.

    MoE(x [N, d], z [N, L] (one dtype, fp32|fp16|bf16), gate_weight [EG, d] (fp32|fp16|bf16), gate_bias [EG] fp32,
        w1, w3 [E, I, L], w2 [E, L, I] (one dtype, fp32|fp16|bf16), expert_offset [1] int32 (the first local
        expert's global id; EG = E and 0 on one GPU); top_k, routed_scaling_factor, renormalize,
        activation, situ_beta, situ_linear_beta, num_experts, hidden_size, expert_dim, intermediate_size)
        -> u [N, L] (z's dtype).  LINEAR only; N dynamic, d/L/E/I static (weights).  Ports, fields, output
    shape and type: `SIGNATURE` (op.py) — the shape static (= z's) although the work inside is data-dependent.

Eight launches in one variant (router -> top-k -> align count / scan / scatter -> GEMM1 -> GEMM2 -> sum), the
intermediates in the TensorRT workspace, sized for the worst case so grids and workspace depend on N alone
(`get_workspace_size` evaluates them at the profile's max N); block sizes chosen at the opt shape.
Paths: IPluginV3 "aot" (cubins in the engine, launched through the CUDA driver); "jit" runs the same plan
with Triton's JIT (debugging). QDP (TensorRT 11): `impl` only — `aot_impl` carries a single kernel.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec, dims_match
from . import triton as kt
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    x, z, gw, gb, w1, w3, w2, off = (list(s) for s in shapes)
    if [len(s) for s in (x, z, gw, gb, w1, w3, w2, off)] != [2, 2, 2, 1, 3, 3, 3, 1]:
        return f"ranks {[len(s) for s in (x, z, gw, gb, w1, w3, w2, off)]}, expected [2, 2, 2, 1, 3, 3, 3, 1]"
    (N, d), L, (E, I, _), EG = x, z[1], w1, gw[0]
    if None not in (E, EG) and EG < E:
        return f"gate_weight routes over {EG} experts, fewer than w1's {E} local ones"
    want = {"z": ([N, L], z), "gate_weight": ([EG, d], gw), "gate_bias": ([EG], gb), "w1": ([E, I, L], w1),
            "w3": ([E, I, L], w3), "w2": ([E, L, I], w2), "expert_offset": ([1], off)}
    for name, (w, got) in want.items():
        if not dims_match(got, w):
            return f"{name} has shape {got}, expected {w} (x {x}, w1 {w1})"
    for f, v in (("num_experts", E), ("hidden_size", d), ("expert_dim", L), ("intermediate_size", I)):
        if not dims_match([attrs.get(f)], [v]):
            return f"field {f}={attrs.get(f)} does not match the tensors' {v}"
    if attrs.get("activation") not in (None, *kt.ACTIVATIONS):
        return f"field activation={attrs.get('activation')!r}: expected one of {sorted(kt.ACTIVATIONS)}"
    if EG is not None and "top_k" in attrs and not 1 <= attrs["top_k"] <= EG:
        return f"field top_k={attrs['top_k']} outside [1, {EG}]"
    return None


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan,
    notes="IPluginV3 aot: 8 cubins (router, top-k, align count/scan/scatter, GEMM1, GEMM2, sum); QDP: impl only",
)
