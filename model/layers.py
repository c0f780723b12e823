"""Small building blocks shared by every layer: RMSNorm and the gated MLP (dense FFN, shared experts).

Precision plan: norms and activations compute in fp32 and cast back once; norm weights are stored fp32.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.common import cast
from ..custom_ops.moe.reference import glu
from .config import K3Config


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    xf = cast(x, torch.float32)
    return cast(xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * cast(weight, torch.float32), x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)


def linear(d_in: int, d_out: int) -> nn.Linear:
    return nn.Linear(d_in, d_out, bias=False)


class GatedMLP(nn.Module):
    """down(act(gate(x), up(x))): dense layer-0 FFN and the merged shared experts (docs/model.md §5.1 step 9)."""

    def __init__(self, cfg: K3Config, dim: int, intermediate: int) -> None:
        super().__init__()
        self.act = (cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)
        self.gate_proj = linear(dim, intermediate)
        self.up_proj = linear(dim, intermediate)
        self.down_proj = linear(intermediate, dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(cast(glu(self.gate_proj(x), self.up_proj(x), *self.act), x.dtype))
