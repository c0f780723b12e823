"""Kimi Delta Attention layer (docs/model.md §2.2; Kimi Linear, arXiv 2510.26692).

- q/k/v: Linear -> depthwise causal conv (kernel 4, no bias) -> SiLU; the three convs run as one
  grouped conv over the concatenated channels, with one conv state `[B, 3P, W-1]` (the last W-1
  pre-conv inputs, fp32) so prefill and decode share one code path.
- q, k L2-normalised (eps 1e-6); decay gate: K3 safe gate `lb·σ(exp(A_log)(f + dt_bias))` or the
  Kimi Linear gate `−exp(A_log)·softplus(f + dt_bias)`; β = σ(b_proj x). Gates and β stay fp32.
- Core recurrence through `torch.ops.k3.kda` only; state `[B, H, K, V]` fp32.
- Output: per-head RMSNorm ⊙ σ(output gate), full rank (K3) or low rank (Kimi Linear), then o_proj.
- `forward_packed`: one serving step over B sequences packed end to end, states read from slot-indexed
  pools: conv, SiLU, q/k norm, gate and beta through `torch.ops.k3.kda_prep`, the recurrence through
  `torch.ops.k3.kda_packed`.
- `forward_decode`: the same step when every sequence has one token: conv, gate, recurrence and gated norm
  in one op, `torch.ops.k3.kda_decode` (one Triton kernel per layer with kernels=triton).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..custom_ops.common import cast
from ..custom_ops.kda import kda
from ..custom_ops.kda.reference import kda_gate, l2norm
from ..custom_ops.kda_decode import kda_decode
from ..custom_ops.kda_packed import kda_packed
from ..custom_ops.kda_prep import kda_prep
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
        W = self.W
        qkv = self._qkv(x)  # [B, T, 3P]
        xx = torch.cat([cast(conv_state, qkv.dtype), qkv.transpose(1, 2)], dim=-1)  # [B, 3P, W-1+T]
        w = self._conv_weight(xx.dtype)  # [3P, 1, W]
        y = F.conv1d(xx, w, groups=w.shape[0]).transpose(1, 2)  # [B, T, 3P]
        new_conv = cast(xx[:, :, xx.shape[-1] - (W - 1):], torch.float32)  # [B, 3P, W-1]
        q, k, v, g, beta = self._heads(x, y)
        out = kda(q, k, v, g, beta, recurrent_state, scale=self.D ** -0.5, kernels=self.kernels,
                  gate_lower_bound=self.cfg.kda.gate_lower_bound)
        return self._output(x, out.output), new_conv, out.final_state

    def forward_packed(self, x: Tensor, conv_pool: Tensor, rec_pool: Tensor, cu_seqlens: Tensor, slots: Tensor, *,
                       kernels: Kernels) -> tuple[Tensor, Tensor, Tensor]:
        """One serving step: x [N, d] packs B sequences (rows cu_seqlens[b]:cu_seqlens[b+1], int32 [B+1]);
        sequence b's state is row slots[b] (int32 [B]) of conv_pool [S, 3P, W-1] and rec_pool [S, H, K, V]
        (fp32, read only). Returns y [N, d], new conv [B, 3P, W-1] fp32, new recurrent [B, H, K, V] fp32."""
        H, D, lb = self.H, self.D, self.cfg.kda.gate_lower_bound
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (H, D))
        pre = kda_prep(self._qkv(x), f, self.b_proj(x), self._conv_weight(x.dtype)[:, 0], self.A_log, self.dt_bias,
                       conv_pool, cu_seqlens, slots, kernels=kernels, gate_lower_bound=lb)
        out = kda_packed(pre.q, pre.k, pre.v, pre.g, pre.beta, rec_pool, cu_seqlens, slots, scale=D ** -0.5,
                         kernels=kernels, gate_lower_bound=lb)
        return self._output(x, out.output), pre.conv, out.final_state

    def forward_decode(self, x: Tensor, conv_pool: Tensor, rec_pool: Tensor, slots: Tensor, *,
                       kernels: Kernels) -> tuple[Tensor, Tensor, Tensor]:
        """`forward_packed` for a step of one token per sequence (x [B, d], cu_seqlens = 0..B): the mixer in one
        fused op from the pools (read only). Returns y [B, d], new conv [B, 3P, W-1], new recurrent [B, H, K, V]."""
        H, D = self.H, self.D
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (H, D))
        out = kda_decode(self._qkv(x), f, self.b_proj(x), self._gate(x).unflatten(-1, (H, D)),
                         self._conv_weight(x.dtype)[:, 0], self.A_log, self.dt_bias, self.o_norm.weight, conv_pool,
                         rec_pool, slots, eps=self.o_norm.eps, scale=D ** -0.5, kernels=kernels,
                         gate_lower_bound=self.cfg.kda.gate_lower_bound)
        return self.o_proj(out.output.flatten(-2)), out.conv, out.state

    def _gate(self, x: Tensor) -> Tensor:
        """The output gate's pre-activation [..., P]: full rank (K3) or low rank (Kimi Linear)."""
        return self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))

    def _qkv(self, x: Tensor) -> Tensor:
        return torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)  # [..., 3P] pre-conv

    def _conv_weight(self, dtype: torch.dtype) -> Tensor:
        w = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])  # [3P, 1, W]
        return cast(w, dtype)

    def _heads(self, x: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        """x [..., d], y [..., 3P] (conv out, pre-SiLU) -> q, k, v [..., H, D]; g [..., H, D] fp32; beta [..., H]."""
        H, D = self.H, self.D
        q, k, v = F.silu(y).unflatten(-1, (3, H, D)).unbind(-3)  # 3 x [..., H, D]
        q, k = l2norm(q), l2norm(k)
        f = self.f_b_proj(self.f_a_proj(x)).unflatten(-1, (H, D))
        g = kda_gate(f, self.A_log, self.dt_bias, self.cfg.kda.gate_lower_bound)  # [..., H, D] fp32
        beta = torch.sigmoid(cast(self.b_proj(x), torch.float32))  # [..., H]
        return q, k, v, g, beta

    def _output(self, x: Tensor, core: Tensor) -> Tensor:
        """x [..., d], core [..., H, D] (the recurrence's output) -> [..., d]."""
        gate = self._gate(x)
        o = self.o_norm(core)
        o = o * cast(torch.sigmoid(cast(gate, torch.float32).unflatten(-1, (self.H, self.D))), o.dtype)
        return self.o_proj(o.flatten(-2))
