"""`k3::moe` — schema, fake impl and the backend dispatch. Torch-only; Triton is imported lazily.

    k3::moe(x [N, d], z [N, L], gate_weight [E, d], gate_bias [E], w1 [E, I, L], w3 [E, I, L],
            w2 [E, L, I], top_k, routed_scaling_factor, renormalize, activation, situ_beta,
            situ_linear_beta, backend) -> u [N, L]
Same contract as `reference.moe` (spec §5.1 steps 1–6): routing, experts, weighted sum.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..backend import Backend, require_backend
from . import reference


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
         situ_linear_beta: float, backend: str) -> Tensor:
    args = (x, z, gate_weight, gate_bias, w1, w3, w2, top_k, routed_scaling_factor, renormalize, activation,
            situ_beta, situ_linear_beta)
    if require_backend("k3::moe", backend, x, z, gate_weight, w1) is Backend.TRITON:
        from . import triton as kernels

        return kernels.moe(*args)
    return reference.moe(*args)


@_moe.register_fake
def _(x, z, gate_weight, gate_bias, w1, w3, w2, top_k, routed_scaling_factor, renormalize, activation,
      situ_beta, situ_linear_beta, backend):
    return z.new_empty(moe_output_shape(z.shape))


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, *,
        options: MoEOptions, backend: Backend = Backend.REFERENCE) -> Tensor:
    return torch.ops.k3.moe(x, z, gate_weight, gate_bias, w1, w3, w2, *options.args(), Backend(backend).value)
