"""k3::kda_decode, the eager oracle: one decode token per sequence, composed from the unfused pieces the
serving step runs (docs/model.md §2.2). Torch-only; never imports a kernel. No recurrence math of its own:
the short conv is the conv state window, the gate is `kda.reference.kda_gate`, q/k are normed by
`kda.reference.l2norm`, the update is `kda.reference.kda_recurrent` from the slot's state, the output norm is
K3's RMSNorm over the head times sigmoid(gate).

Contract (op.py): qkv [B, C] pre-conv inputs (C = 2·H·K + H·V: q | k | v channels), f [B, H, K] gate
pre-activation, b [B, H] beta logits, gate [B, H, V] output-gate pre-activation, conv_weight [C, W],
A_log [H'] (H' >= H), dt_bias [H·K], norm_weight [V], conv_pool [S, C, W-1], state_pool [S, H, K, V],
slots [B]. Returns (o [B, H, V] in qkv's dtype, new_conv [B, C, W-1] fp32, new_state [B, H, K, V] fp32).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import cast
from ..kda.reference import kda_gate, kda_recurrent, l2norm


def check_slots(S: int, slots: list[int]) -> None:
    """ValueError naming slots unless they are distinct rows of a pool of S."""
    if any(not 0 <= s < S for s in slots) or len(set(slots)) != len(slots):
        raise ValueError(f"kda_decode: slots {slots} must be distinct and in [0, {S})")


def short_conv(qkv: Tensor, conv_state: Tensor, weight: Tensor) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv of one new input per sequence: qkv [B, C], conv_state [B, C, W-1] (the last W-1
    inputs), weight [C, W] -> (y [B, C] pre-activation, fp32; new state [B, C, W-1] fp32)."""
    window = torch.cat([cast(conv_state, torch.float32), cast(qkv, torch.float32)[:, :, None]], -1)  # [B, C, W]
    return (window * cast(weight, torch.float32)).sum(-1), window[:, :, 1:].contiguous()


def gated_rms_norm(o: Tensor, weight: Tensor, gate: Tensor, eps: float) -> Tensor:
    """K3's output norm: RMSNorm over the head (fp32) times weight, times sigmoid(gate)."""
    of = cast(o, torch.float32)
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps) * cast(weight, torch.float32)
    return normed * torch.sigmoid(cast(gate, torch.float32))


def kda_decode(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor,
               dt_bias: Tensor, norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor,
               scale: float, eps: float, gate_lower_bound: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    B, H, K = f.shape
    V = gate.shape[-1]
    sl = cast(slots, torch.int64)
    check_slots(state_pool.shape[0], sl.tolist())
    y, new_conv = short_conv(qkv, conv_pool.index_select(0, sl), conv_weight)
    y = F.silu(y)
    q, k = (l2norm(y[:, i * H * K:(i + 1) * H * K].view(B, 1, H, K)) for i in (0, 1))
    v = y[:, 2 * H * K:].view(B, 1, H, V)
    g = kda_gate(f[:, None], A_log, dt_bias, gate_lower_bound or None)  # op encoding: 0 = unbounded gate
    beta = torch.sigmoid(cast(b, torch.float32))[:, None]
    o, state = kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=state_pool.index_select(0, sl))
    return cast(gated_rms_norm(o[:, 0], norm_weight, gate, eps), qkv.dtype), new_conv, state
