"""Kimi Delta Attention layer (docs/model.md §2.2; Kimi Linear, arXiv 2510.26692).

- q/k/v: Linear -> depthwise causal conv (kernel 4, no bias) -> SiLU; the three convs run as one
  grouped conv over the concatenated channels, with one conv state `[B, 3P, W-1]` (the last W-1
  pre-conv inputs, fp32) so prefill and decode share one code path.
- q, k L2-normalised (eps 1e-6); decay gate: K3 safe gate `lb·σ(exp(A_log)(f + dt_bias))` or the
  Kimi Linear gate `−exp(A_log)·softplus(f + dt_bias)`; β = σ(b_proj x). Gates and β stay fp32.
- Core recurrence through `torch.ops.k3.kda` only; state `[B, H, K, V]` fp32.
- Output: per-head RMSNorm ⊙ σ(output gate), full rank (K3) or low rank (Kimi Linear), then o_proj.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..custom_ops.common import cast
from ..custom_ops.kda import kda
from ..custom_ops.kda.reference import kda_gate, l2norm
from ..plan.kernels import Kernels
from .config import K3Config
from .layers import RMSNorm, linear


class KimiDeltaAttention(nn.Module):
    def __init__(self, cfg: K3Config, kernels: Kernels = Kernels.REFERENCE) -> None:
        super().__init__()
        c = cfg.kda
        d, P, H, D, W = cfg.hidden_size, c.proj_dim, c.num_heads, c.head_dim, c.conv_kernel
        self.cfg, self.kernels, self.H, self.D, self.W = cfg, kernels, H, D, W
        self.q_proj, self.k_proj, self.v_proj = linear(d, P), linear(d, P), linear(d, P)
        self.q_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.k_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.v_conv1d = nn.Conv1d(P, P, W, groups=P, bias=False)
        self.f_a_proj, self.f_b_proj = linear(d, D), linear(D, P)  # low rank through head_dim
        self.b_proj = linear(d, H)
        self.A_log = nn.Parameter(torch.zeros(H, dtype=torch.float32))
        self.dt_bias = nn.Parameter(torch.zeros(P, dtype=torch.float32))
        if c.full_rank_output_gate:
            self.g_proj = linear(d, P)
        else:
            self.g_a_proj, self.g_b_proj = linear(d, D), linear(D, P)  # low rank through head_dim
        self.full_rank_gate = c.full_rank_output_gate
        self.o_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.o_proj = linear(P, d)

    def forward(self, x: Tensor, conv_state: Tensor, recurrent_state: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [B, T, d]; conv_state [B, 3P, W-1] fp32; recurrent_state [B, H, K, V] fp32."""
        B, T, _ = x.shape
        H, D, W = self.H, self.D, self.W
        qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [B, T, 3P]
        xx = torch.cat([cast(conv_state, qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # [B, 3P, W-1+T]
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # [3P, 1, W]
        y = F.silu(F.conv1d(xx, cast(w, xx.dtype), groups=w.shape[0]))  # [B, 3P, T]
        new_conv = cast(xx[:, :, xx.shape[-1] - (W - 1):], torch.float32)  # [B, 3P, W-1]
        q, k, v = y.transpose(1, 2).reshape(B, T, 3, H, D).unbind(2)  # 3 x [B, T, H, D]
        q, k = l2norm(q), l2norm(k)
        f = self.f_b_proj(self.f_a_proj(x)).view(B, T, H, D)
        g = kda_gate(f, self.A_log, self.dt_bias, self.cfg.kda.gate_lower_bound)  # [B, T, H, D] fp32
        beta = torch.sigmoid(cast(self.b_proj(x), torch.float32))  # [B, T, H]
        out = kda(q, k, v, g, beta, recurrent_state, scale=D ** -0.5, kernels=self.kernels,
                  gate_lower_bound=self.cfg.kda.gate_lower_bound)
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = self.o_norm(out.output)  # [B, T, H, D]
        o = o * cast(torch.sigmoid(cast(gate, torch.float32).view(B, T, H, D)), o.dtype)
        return self.o_proj(o.reshape(B, T, H * D)), new_conv, out.final_state
