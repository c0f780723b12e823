"""`k3::moe` — schema, fake impl, shape rule, limits and the kernel dispatch. Torch-only; Triton is imported lazily.

    k3::moe(x [N, d], z [N, L], gate_weight [E, d], gate_bias [E], w1 [E_local, I, L], w3 [E_local, I, L],
            w2 [E_local, L, I], top_k, routed_scaling_factor, renormalize, activation, situ_beta,
            situ_linear_beta, kernels, expert_offset [1] int32 = None) -> u [N, L]
Same contract as `reference.moe` (docs/model.md §5.1 steps 1–6): routing, experts, weighted sum.
`expert_offset` (expert parallelism): the global id of w1/w3/w2's first expert; routing is over all E
experts of gate_weight, only the (token, slot) pairs whose expert is in [offset, offset + E_local) are
computed, and u is this rank's partial sum. None (single GPU): offset 0 and E_local = E, the whole sum.
A tensor, not an attribute, so EP ranks differ in data only and one trace serves them all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor

from ..kernels import Kernels, require_kernels
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


@torch.library.custom_op("k3::moe", mutates_args=())
def _moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
         top_k: int, routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
         situ_linear_beta: float, kernels: str, expert_offset: Optional[Tensor] = None) -> Tensor:
    args = (x, z, gate_weight, gate_bias, w1, w3, w2, top_k, routed_scaling_factor, renormalize, activation,
            situ_beta, situ_linear_beta, expert_offset)
    if require_kernels("k3::moe", kernels, x, z, gate_weight, w1) is Kernels.TRITON:
        from . import triton

        return triton.moe(*args)
    return reference.moe(*args)


@_moe.register_fake
def _(x, z, gate_weight, gate_bias, w1, w3, w2, top_k, routed_scaling_factor, renormalize, activation,
      situ_beta, situ_linear_beta, kernels, expert_offset=None):
    return z.new_empty(moe_output_shape(z.shape))


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, *,
        options: MoEOptions, kernels: Kernels = Kernels.REFERENCE, expert_offset: Tensor | None = None) -> Tensor:
    return torch.ops.k3.moe(x, z, gate_weight, gate_bias, w1, w3, w2, *options.args(), Kernels(kernels).value,
                            expert_offset)
