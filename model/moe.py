"""Stable LatentMoE (docs/model.md §5.1; LatentMoE arXiv 2601.18089) and the plain MoE of Kimi Linear.

Axes: N tokens, d model width, L expert width (latent, or d), E experts, I expert intermediate.
- Router on the full-width x (fp32, sigmoid), top-k on scores + e_score_correction_bias, weights
  from unbiased scores; the whole routed computation is one `torch.ops.k3.moe` node.
- Experts held stacked: w1/w3 `[E, I, L]`, w2 `[E, L, I]`, so a graph's size does not grow with E.
  (Checkpoint names `experts.{e}.w1.weight` are mapped to these in checkpoint/files.py.)
- `BuildOptions.expert_format == "mxfp4"` (model/options.py): the experts stay packed as the checkpoint stores them (`PackedExperts`:
  w1/w3 `[E, I, L/2]` u8 nibbles + `w1_scale`/`w3_scale` `[E, I, L/32]` u8 E8M0, w2 `[E, L, I/2]` +
  `w2_scale` `[E, L, I/32]`, frozen uint8 parameters) and the node is `k3::moe_mxfp4`, which decodes only the
  experts a call routes to. A model (and every artifact) then holds 4.25 bits per expert weight.
  `BuildOptions.activations == "mxfp8"`: that node rounds both expert-GEMM inputs through MXFP8 (W4A8).
- LatentMoE: z = W_down x; u = RMSNorm(Σ p_j E_j(z)); y = W_up u. Shared experts on x are added.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.moe import MoEOptions, moe
from ..custom_ops.moe_mxfp4 import moe_mxfp4
from ..custom_ops.moe_mxfp4.codec import BLOCK
from .config import K3Config
from .layers import GatedMLP, RMSNorm, linear
from .options import BuildOptions


class Router(nn.Module):
    def __init__(self, d: int, E: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(E, d))
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))


class StackedExperts(nn.Module):
    def __init__(self, E: int, L: int, I: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(E, I, L))  # gate
        self.w3 = nn.Parameter(torch.empty(E, I, L))  # up
        self.w2 = nn.Parameter(torch.empty(E, L, I))  # down


class PackedExperts(nn.Module):
    def __init__(self, E: int, L: int, I: int) -> None:
        super().__init__()

        def u8(*shape: int) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=torch.uint8), requires_grad=False)

        self.w1, self.w1_scale = u8(E, I, L // 2), u8(E, I, L // BLOCK)  # gate
        self.w3, self.w3_scale = u8(E, I, L // 2), u8(E, I, L // BLOCK)  # up
        self.w2, self.w2_scale = u8(E, L, I // 2), u8(E, L, I // BLOCK)  # down


class LatentMoE(nn.Module):
    def __init__(self, cfg: K3Config, build: BuildOptions) -> None:
        super().__init__()
        c, d = cfg.moe, cfg.hidden_size
        L = cfg.expert_dim
        self.cfg, self.latent, self.latent_norm = cfg, c.latent_dim is not None, c.latent_norm
        # Kimi / DeepSeek routers renormalise only when top_k > 1: one expert keeps its raw score s
        self.options = MoEOptions(c.top_k, c.routed_scaling_factor, c.renormalize and c.top_k > 1, cfg.activation,
                                  cfg.situ_beta, cfg.situ_linear_beta)
        self.gate = Router(d, c.num_experts)
        if self.latent:
            self.routed_expert_down_proj = linear(d, L)
            self.routed_expert_up_proj = linear(L, d)
        if self.latent_norm:
            self.routed_expert_norm = RMSNorm(L, cfg.rms_norm_eps)
        self.packed, self.kernels, self.activations = build.packed, build.kernels, build.activations
        self.experts = (PackedExperts if self.packed else StackedExperts)(c.num_experts, L, c.intermediate_size)
        self.has_shared = c.num_shared_experts > 0
        if self.has_shared:
            self.shared_experts = GatedMLP(cfg, d, c.shared_intermediate_size)

    def forward(self, x: Tensor) -> Tensor:
        B, T, d = x.shape
        xf = x.reshape(B * T, d)  # [N, d]
        z = self.routed_expert_down_proj(xf) if self.latent else xf  # [N, L]
        u = self.routed(xf, z)  # [N, L]
        if self.latent_norm:
            u = self.routed_expert_norm(u)
        y = self.routed_expert_up_proj(u) if self.latent else u
        if self.has_shared:
            y = y + self.shared_experts(xf)
        return y.view(B, T, d)

    def routed(self, xf: Tensor, z: Tensor, expert_offset: Tensor | None = None) -> Tensor:
        """u = Σ_j p_j E_j(z) [N, L]: routing on the full-width xf [N, d], experts on z [N, L] (one k3 op).
        `expert_offset` (expert-parallel ranks): self.experts hold the experts from this global id on, and u is
        the sum over the pairs routed to them."""
        e, g = self.experts, self.gate
        if self.packed:
            return moe_mxfp4(xf, z, g.weight, g.e_score_correction_bias, e.w1, e.w3, e.w2, e.w1_scale, e.w3_scale,
                             e.w2_scale, options=self.options, kernels=self.kernels, expert_offset=expert_offset,
                             activations=self.activations)
        return moe(xf, z, g.weight, g.e_score_correction_bias, e.w1, e.w3, e.w2, options=self.options,
                   kernels=self.kernels, expert_offset=expert_offset)
