"""k3::kda_prep, the eager oracle: sequence by sequence, composed from the spec's pieces (docs/model.md §2.2).
Torch-only; never imports a kernel. The short conv is `F.conv1d` over each sequence's window (its pool row's
last W-1 inputs, then its rows of this step), SiLU, q/k by `kda.reference.l2norm`, the gate by
`kda.reference.kda_gate`, beta a sigmoid.

Contract (op.py): qkv [N, C] pre-conv inputs (C = 2·H·K + H·V: q | k | v channels), f [N, H, K] decay-gate
pre-activation, b [N, H] beta logits, conv_weight [C, W], A_log [H'] (H' >= H), dt_bias [H·K],
conv_pool [S, C, W-1], cu_seqlens [B+1], slots [B]. Returns (q, k [N, H, K], v [N, H, V] in qkv's dtype;
g [N, H, K] fp32; beta [N, H] fp32; new_conv [B, C, W-1] fp32: each sequence's last W-1 inputs, the old
state's columns where it has fewer rows). The conv runs in fp64 for fp64 `qkv` (the oracle for kernel
error budgets), else in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..common import cast
from ..kda.reference import kda_gate, l2norm
from ..kda_packed.reference import check_packing


def kda_prep(qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
             conv_pool: Tensor, cu_seqlens: Tensor, slots: Tensor,
             gate_lower_bound: float = 0.0) -> tuple[Tensor, ...]:
    N, C = qkv.shape
    _, H, K = f.shape
    V = (C - 2 * H * K) // H
    W = conv_weight.shape[1]
    if C != 2 * H * K + H * V or conv_weight.shape[0] != C or tuple(conv_pool.shape[1:]) != (C, W - 1):
        raise ValueError(f"kda_prep: qkv {tuple(qkv.shape)}, f {tuple(f.shape)}, conv_weight "
                         f"{tuple(conv_weight.shape)}, conv_pool {tuple(conv_pool.shape)} do not fit C = 2HK + HV")
    cu, sl = cu_seqlens.tolist(), slots.tolist()
    check_packing(N, conv_pool.shape[0], cu, sl, op="kda_prep")
    acc = torch.float64 if qkv.dtype == torch.float64 else torch.float32
    w = cast(conv_weight, acc)[:, None]  # [C, 1, W]
    y = qkv.new_empty((N, C), dtype=acc)
    new_conv = []
    for i, slot in enumerate(sl):
        a, e = cu[i], cu[i + 1]
        window = torch.cat([cast(conv_pool[slot], acc), cast(qkv[a:e], acc).T], -1)  # [C, W-1 + rows]
        if e > a:  # an empty sequence (not in a serving step) keeps its state
            y[a:e] = F.conv1d(window[None], w, groups=C)[0].T
        new_conv.append(window[:, window.shape[1] - (W - 1):])
    # SiLU per part: each output its own storage, not a view of y (a step's live bytes count storages)
    q, k = (l2norm(F.silu(y[:, j * H * K:(j + 1) * H * K]).reshape(N, H, K)) for j in (0, 1))
    v = F.silu(y[:, 2 * H * K:]).reshape(N, H, V)
    g = kda_gate(f, A_log, dt_bias, gate_lower_bound or None)  # op encoding: 0 = unbounded gate
    beta = torch.sigmoid(cast(b, torch.float32))
    conv = torch.stack(new_conv) if new_conv else conv_pool.new_zeros((0, C, W - 1))
    return (*(cast(x, qkv.dtype) for x in (q, k, v)), g, beta, cast(conv, torch.float32))
