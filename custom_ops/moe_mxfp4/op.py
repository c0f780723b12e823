"""`k3::moe_mxfp4` — the routed MoE on MXFP4-packed experts: schema, fake impl, shape rule, limits, dispatch.

    k3::moe_mxfp4(x [N, d], z [N, L], gate_weight [E, d], gate_bias [E], w1 [E, I, L/2] u8, w3 [E, I, L/2] u8,
                  w2 [E, L, I/2] u8, w1_scale [E, I, L/32] u8, w3_scale [E, I, L/32] u8, w2_scale [E, L, I/32] u8,
                  top_k, routed_scaling_factor, renormalize, activation, situ_beta, situ_linear_beta, kernels,
                  activations = "bf16", expert_offset [1] int32 = None) -> u [N, L]
(`expert_offset`: expert parallelism, as in `k3::moe`: E above is E_local for the expert tensors.)
`activations` (`BuildOptions.activations`): "bf16" feeds the expert GEMMs the activations as computed; "mxfp8"
rounds both GEMM inputs (z for gate/up, the GLU output h for down) through MXFP8 (mxfp8.py: E4M3, one E8M0
scale per 32 along K) first — W4A8, K3's trained numerics. A node attribute and plugin field too.
A variant of `k3::moe` (same routing and expert math, `custom_ops/moe`): its `SIGNATURE` is moe's with the
packed expert ports; its own family so every stage (ONNX node, TensorRT plugin with uint8 ports, op counts)
handles it through the registry; still one graph node per MoE layer. The model picks it when `BuildOptions.expert_format == "mxfp4"`. Torch-only; Triton lazily.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import Attr, TensorPort
from ..moe.op import SIGNATURE as MOE, MoEOptions, check_config as moe_limits
from . import reference
from .codec import BLOCK
from .mxfp8 import ACTIVATIONS

WEIGHTS = ("w1", "w3", "w2")


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::moe_mxfp4 cannot run `cfg` (None if it can; asked only for packed experts): k3::moe's limits plus
    MXFP4's block of 32 along both expert reduction widths."""
    if not cfg.moe_layers:
        return None
    for what, n in (("expert input width (moe latent_dim or hidden_size)", cfg.expert_dim),
                    ("moe.intermediate_size", cfg.moe.intermediate_size)):
        if n % BLOCK:
            return f"{what}={n}: MXFP4 experts need a multiple of {BLOCK} (expert_format='dense' has no such limit)"
    return moe_limits(cfg, kernels=kernels)


SIGNATURE = replace(
    MOE, name="moe_mxfp4", node="MoEMXFP4",
    inputs=MOE.inputs[:4] + tuple(TensorPort(n, "U") for n in (*WEIGHTS, *(f"{w}_scale" for w in WEIGHTS)))
    + MOE.inputs[-1:],  # expert_offset
    attrs=MOE.attrs + (Attr("activations", str, "bf16"),),
    doc="k3::MoE with MXFP4-packed experts: w1, w3 [E, I, L/2] uint8 (element 2j in the low nibble), w2 "
        "[E, L, I/2] uint8, and E8M0 scale bytes w1_scale, w3_scale [E, I, L/32], w2_scale [E, L, I/32] "
        "(scale 2^(byte-127) per 32 elements), expert_offset as k3::MoE's; activations 'bf16' (as computed) or "
        "'mxfp8' (both expert-GEMM inputs rounded through OCP MXFP8 E4M3, one E8M0 scale per 32 along K). Same "
        "contract as torch.ops.k3.moe_mxfp4.",
)


@SIGNATURE.define
def _moe_mxfp4(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
               w1_scale: Tensor, w3_scale: Tensor, w2_scale: Tensor, top_k: int, routed_scaling_factor: float,
               renormalize: bool, activation: str, situ_beta: float, situ_linear_beta: float, kernels: str,
               activations: str = "bf16", expert_offset: Optional[Tensor] = None) -> Tensor:
    check_activations(activations)
    args = (x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale, top_k, routed_scaling_factor,
            renormalize, activation, situ_beta, situ_linear_beta, expert_offset, activations)
    if require_kernels("k3::moe_mxfp4", kernels, x, z, gate_weight, w1) is Kernels.TRITON:
        from . import triton

        return triton.moe(*args)
    return reference.moe(*args)


def moe_mxfp4(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
              w1_scale: Tensor, w3_scale: Tensor, w2_scale: Tensor, *, options: MoEOptions,
              kernels: Kernels = Kernels.REFERENCE, expert_offset: Tensor | None = None,
              activations: str = "bf16") -> Tensor:
    return torch.ops.k3.moe_mxfp4(x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                                  *options.args(), Kernels(kernels).value, activations, expert_offset)


def check_activations(activations: str) -> None:
    if activations not in ACTIVATIONS:
        raise ValueError(f"moe_mxfp4: activations={activations!r}: expected one of {list(ACTIVATIONS)}")
