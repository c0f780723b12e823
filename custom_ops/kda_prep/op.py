"""`k3::kda_prep` — everything a KDA layer of the serving step does between its projections and the recurrence,
over B sequences packed end to end: the short causal conv from each sequence's conv-pool row, SiLU, q/k L2
norm, the decay gate and beta (one node instead of ~40 small ones per layer). Torch-only; Triton is
imported lazily.

    k3::kda_prep(qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots, kernels,
                 gate_lower_bound) -> (q, k, v, g, beta, new_conv)
    qkv [N, C] pre-conv inputs, C = 2·H·K + H·V (q | k | v channels, head-major); f [N, H, K] decay-gate
    pre-activation; b [N, H] beta logits (all qkv's dtype); conv_weight [C, W]; A_log [H'] fp32 (H' >= H, the
    first H used); dt_bias [H·K] fp32; conv_pool [S, C, W-1] fp32; cu_seqlens [B+1] int32 (sequence b = rows
    cu_seqlens[b]:cu_seqlens[b+1]); slots [B] int32 (distinct).
    q, k [N, H, K] (L2-normalised, eps 1e-6), v [N, H, V]: SiLU(conv) in qkv's dtype; g [N, H, K] fp32 (K3's
    lb·σ(e^A (f + dt_bias)), or Kimi Linear's −e^A·softplus(f + dt_bias) when gate_lower_bound = 0);
    beta [N, H] fp32 = σ(b); new_conv [B, C, W-1] fp32: sequence b's last W-1 inputs (its old state's last
    columns where it has fewer rows).
Row t of sequence b reads its inputs t-W+1..t: this step's rows, or conv_pool[slots[b]] before its first row.
Pure: the pool is read, never written (the runtime writes new_conv back to the pool rows). The outputs are
k3::kda_packed's inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from ..kda.op import check_config as _kda_check_config
from . import reference


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::kda_prep cannot run `cfg` (None if it can): k3::kda's limits (the same head dims)."""
    reason = _kda_check_config(cfg, kernels=kernels)
    return None if reason is None else reason.replace("k3::kda", "k3::kda_prep")


def kda_prep_output_shapes(qkv_shape, f_shape, conv_pool_shape, slots_shape):
    """One shape rule for the fake impl and the TensorRT plugin: dims in, dims out (only + - * //, a dim on the
    left: TensorRT's QDP shape expressions have no reflected operators)."""
    N, C = qkv_shape
    _, H, K = f_shape
    V = (C - H * K * 2) // H
    B = slots_shape[0]
    return (N, H, K), (N, H, K), (N, H, V), (N, H, K), (N, H), (B, conv_pool_shape[1], conv_pool_shape[2])


SIGNATURE = Signature(
    "kda_prep", "KDAPrep",
    inputs=(TensorPort("qkv", "T"), TensorPort("f", "T", "qkv"), TensorPort("b", "T", "qkv"),
            TensorPort("conv_weight", "W"), TensorPort("A_log", "F"), TensorPort("dt_bias", "F"),
            TensorPort("conv_pool", "S"), TensorPort("cu_seqlens", "I"), TensorPort("slots", "I")),
    outputs=(TensorPort("q", "T", "qkv"), TensorPort("k", "T", "qkv"), TensorPort("v", "T", "qkv"),
             TensorPort("g", "F"), TensorPort("beta", "F"), TensorPort("new_conv", "S")),
    attrs=(Attr("num_heads", int, op=False), Attr("head_dim", int, op=False), Attr("value_dim", int, op=False),
           Attr("conv_kernel", int, op=False), KERNELS, Attr("gate_lower_bound", float, 0.0)),
    shapes=lambda s: kda_prep_output_shapes(s[0], s[1], s[6], s[8]),
    doc="KDA's pre-recurrence over packed sequences: short causal conv from conv_pool[slots[b]], SiLU, q/k L2 "
        "norm, decay gate, beta. qkv [N, 2HK+HV]; f [N, H, K]; b [N, H]; conv_weight [C, W]; A_log [>=H] fp32; "
        "dt_bias [H*K] fp32; conv_pool [S, C, W-1] fp32; cu_seqlens [B+1] int32; slots [B] int32 -> q, k "
        "[N, H, K], v [N, H, V], g [N, H, K] fp32, beta [N, H] fp32, new_conv [B, C, W-1] fp32. Same contract "
        "as torch.ops.k3.kda_prep. The pool is not written.",
)


@SIGNATURE.define
def _kda_prep(qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
              conv_pool: Tensor, cu_seqlens: Tensor, slots: Tensor, kernels: str,
              gate_lower_bound: float = 0.0) -> tuple[Tensor, ...]:
    tensors = (qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots)
    if require_kernels("k3::kda_prep", kernels, *tensors) is Kernels.TRITON:
        from . import triton

        return triton.kda_prep(*tensors, gate_lower_bound=gate_lower_bound)
    return reference.kda_prep(*tensors, gate_lower_bound=gate_lower_bound)


@dataclass
class KDAPrepOutput:
    q: Tensor  # [N, H, K], L2-normalised
    k: Tensor  # [N, H, K], L2-normalised
    v: Tensor  # [N, H, V]
    g: Tensor  # [N, H, K] fp32 log-decay
    beta: Tensor  # [N, H] fp32
    conv: Tensor  # [B, C, W-1] fp32, the sequences' new conv states


def kda_prep(qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
             conv_pool: Tensor, cu_seqlens: Tensor, slots: Tensor, *, kernels: Kernels = Kernels.REFERENCE,
             gate_lower_bound: float | None = None) -> KDAPrepOutput:
    lb = 0.0 if gate_lower_bound is None else float(gate_lower_bound)
    out = torch.ops.k3.kda_prep(qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots,
                                Kernels(kernels).value, lb)
    return KDAPrepOutput(*out)
