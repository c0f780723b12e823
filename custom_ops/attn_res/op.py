"""`k3::attn_res` — schema, fake impl and the backend dispatch. Torch-only; Triton is imported lazily.

    k3::attn_res(prefix [..., d], bank [..., N, d], norm_weight [d], proj_weight [d], eps, backend) -> [..., d]
Same contract as `reference.attn_res` (spec §4.2): RMSNorm-score-softmax-mix over N + 1 sources.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..backend import Backend, require_backend
from . import reference


def attn_res_output_shape(prefix_shape):
    """One shape rule for the fake impl and the TensorRT plugin: the output has prefix's shape."""
    return tuple(prefix_shape)


@torch.library.custom_op("k3::attn_res", mutates_args=())
def _attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
              backend: str) -> Tensor:
    if require_backend("k3::attn_res", backend, prefix, bank, norm_weight, proj_weight) is Backend.TRITON:
        from . import triton as kernels

        return kernels.attn_res(prefix, bank, norm_weight, proj_weight, eps)
    return reference.attn_res(prefix, bank, norm_weight, proj_weight, eps)


@_attn_res.register_fake
def _(prefix, bank, norm_weight, proj_weight, eps, backend):
    return prefix.new_empty(attn_res_output_shape(prefix.shape))


def attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, *, eps: float,
             backend: Backend = Backend.REFERENCE) -> Tensor:
    return torch.ops.k3.attn_res(prefix, bank, norm_weight, proj_weight.reshape(-1), float(eps),
                                 Backend(backend).value)
