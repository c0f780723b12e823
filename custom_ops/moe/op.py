"""`k3::moe` — schema, fake impl, shape rule, limits and the kernel dispatch. Torch-only; Triton is imported lazily.

    k3::moe(x [N, d], z [N, L], gate_weight [E, d], gate_bias [E], w1 [E_local, I, L], w3 [E_local, I, L],
            w2 [E_local, L, I], top_k, routed_scaling_factor, renormalize, activation, situ_beta,
            situ_linear_beta, kernels, expert_offset [1] int32 = None) -> u [N, L]
Same contract as `reference.moe` (docs/model.md §5.1 steps 1–6): routing, experts, weighted sum.
`expert_offset` (expert parallelism): the global id of w1/w3/w2's first expert; routing is over all E
experts of gate_weight, only the (token, slot) pairs whose expert is in [offset, offset + E_local) are
computed, and u is this rank's partial sum. None (single GPU): offset 0 and E_local = E, the whole sum.
A tensor, not an attribute, so EP ranks differ in data only and one trace serves them all.
On CUDA the op runs the candidate `candidates.py` picks for its shape class (the Triton plan, or
torch._grouped_mm experts where a table measured on this GPU kind says so); one graph node either way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from . import reference


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::moe cannot run `cfg` (None if it can); the reference and the kernels share this limit (the
    activation, 'situ' or 'silu', is validated with the model config)."""
    m = cfg.moe
    if not 0 < m.top_k <= m.num_experts:
        return f"moe.top_k={m.top_k}: k3::moe needs 1 <= top_k <= moe.num_experts ({m.num_experts})"
    return None


def moe_output_shape(z_shape):
    """One shape rule for the fake impl and the TensorRT plugin: u has z's shape [N, L]."""
    return tuple(z_shape)


@dataclass(frozen=True)
class MoEOptions:
    top_k: int
    routed_scaling_factor: float = 1.0
    renormalize: bool = True
    activation: str = "situ"  # "situ" | "silu"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0

    def args(self) -> tuple:
        return (self.top_k, float(self.routed_scaling_factor), self.renormalize, self.activation,
                float(self.situ_beta), float(self.situ_linear_beta))


SIGNATURE = Signature(
    "moe", "MoE",
    inputs=(TensorPort("x", "T"), TensorPort("z", "T", "x"), TensorPort("gate_weight", "G"),
            TensorPort("gate_bias", "F"), TensorPort("w1", "W"), TensorPort("w3", "W", "w1"),
            TensorPort("w2", "W", "w1"), TensorPort("expert_offset", "O", optional=True)),
    outputs=(TensorPort("u", "T", "z"),),
    attrs=(Attr("top_k", int), Attr("routed_scaling_factor", float), Attr("renormalize", bool),
           Attr("activation", str), Attr("situ_beta", float), Attr("situ_linear_beta", float),
           *(Attr(n, int, op=False) for n in ("num_experts", "hidden_size", "expert_dim", "intermediate_size")),
           KERNELS),
    shapes=lambda s: [moe_output_shape(s[1])],
    doc="Routed MoE: sigmoid router on x [N, d] (gate_weight [EG, d]), top_k on scores + gate_bias [EG], weights "
        "from unbiased scores (renormalised, x routed_scaling_factor); experts w1, w3 [E, I, L], w2 [E, L, I] on "
        "z [N, L] with SiTU-GLU or SiLU-GLU -> u [N, L], summed over the pairs routed to experts "
        "[expert_offset, expert_offset + E) (expert parallelism; EG = E, offset 0 on one GPU). Same contract as "
        "torch.ops.k3.moe.",
)


@SIGNATURE.define
def _moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
         top_k: int, routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
         situ_linear_beta: float, kernels: str, expert_offset: Optional[Tensor] = None) -> Tensor:
    args = (x, z, gate_weight, gate_bias, w1, w3, w2, top_k, routed_scaling_factor, renormalize, activation,
            situ_beta, situ_linear_beta, expert_offset)
    if require_kernels("k3::moe", kernels, x, z, gate_weight, w1) is Kernels.TRITON:
        from . import candidates  # the candidate picked for this shape class (custom_ops/dispatch.py)

        return candidates.moe(*args)
    return reference.moe(*args)


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, *,
        options: MoEOptions, kernels: Kernels = Kernels.REFERENCE, expert_offset: Tensor | None = None) -> Tensor:
    return torch.ops.k3.moe(x, z, gate_weight, gate_bias, w1, w3, w2, *options.args(), Kernels(kernels).value,
                            expert_offset)
