"""`k3::attn_res` — schema, fake impl, shape rule, limits and the kernel dispatch. Torch-only; Triton is imported lazily.

    k3::attn_res(prefix [..., d], bank [..., N, d], norm_weight [d], proj_weight [d], eps, kernels) -> [..., d]
Same contract as `reference.attn_res` (docs/model.md §4.2): RMSNorm-score-softmax-mix over N + 1 sources.
On CUDA the kernel runs with the launch entry `candidates.py` picks for its shape class (one graph node).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from . import reference
from .limits import KERNEL_MAX_BANK


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::attn_res cannot run `cfg` (None if it can); `kernels`: also the Triton kernel limits."""
    if cfg.attn_res is None or not kernels:
        return None
    n = len(cfg.block_starts())  # the bank grows by one entry per block
    if n > KERNEL_MAX_BANK:
        return (f"attn_res.block_size={cfg.attn_res.block_size}: {n} bank entries for {cfg.num_layers} layers; "
                f"the Triton k3::attn_res kernel (and the TensorRT plugin) hold at most {KERNEL_MAX_BANK}")
    return None


def attn_res_output_shape(prefix_shape):
    """One shape rule for the fake impl and the TensorRT plugin: the output has prefix's shape."""
    return tuple(prefix_shape)


SIGNATURE = Signature(
    "attn_res", "AttnRes",
    inputs=(TensorPort("prefix", "T"), TensorPort("bank", "T", "prefix"), TensorPort("norm_weight", "N"),
            TensorPort("proj_weight", "W")),
    outputs=(TensorPort("out", "T", "prefix"),),
    attrs=(Attr("eps", float), Attr("hidden_size", int, op=False), KERNELS),
    shapes=lambda s: [attn_res_output_shape(s[0])],
    doc="Block Attention Residuals mixer: prefix [..., d], bank [..., N, d], norm_weight [d], proj_weight [d] "
        "-> [..., d]; softmax over N + 1 RMS-normalised sources, in fp32. Same contract as torch.ops.k3.attn_res.",
)


@SIGNATURE.define
def _attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
              kernels: str) -> Tensor:
    if require_kernels("k3::attn_res", kernels, prefix, bank, norm_weight, proj_weight) is Kernels.TRITON:
        from . import candidates  # the launch entry picked for this shape class (custom_ops/dispatch.py)

        return candidates.attn_res(prefix, bank, norm_weight, proj_weight, eps)
    return reference.attn_res(prefix, bank, norm_weight, proj_weight, eps)


def attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, *, eps: float,
             kernels: Kernels = Kernels.REFERENCE) -> Tensor:
    return torch.ops.k3.attn_res(prefix, bank, norm_weight, proj_weight.reshape(-1), float(eps),
                                 Kernels(kernels).value)
