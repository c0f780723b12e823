"""`k3::kda_decode` — one fused KDA decode step per layer on the serving pools: for B sequences of
one token each, the short causal conv with its conv-state update, the decay gate (K3's lower-bounded gate or
Kimi Linear's), the gated delta-rule update from the slot's recurrent state, and the gated output norm.
Torch-only; Triton is imported lazily.

    k3::kda_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool, slots,
                   scale, eps, kernels, gate_lower_bound) -> (o, new_conv, new_state)
    qkv [B, C] pre-conv inputs, C = 2·H·K + H·V (q | k | v channels, head-major); f [B, H, K] decay-gate
    pre-activation; b [B, H] beta logits; gate [B, H, V] output-gate pre-activation (all qkv's dtype);
    conv_weight [C, W]; A_log [H'] fp32 (H' >= H, the first H used); dt_bias [H·K] fp32; norm_weight [V] fp32;
    conv_pool [S, C, W-1] fp32; state_pool [S, H, K, V] fp32; slots [B] int32 (distinct).
    o [B, H, V] = RMSNorm(S_newᵀ q)·norm_weight·σ(gate) in qkv's dtype; new_conv [B, C, W-1] fp32 (the last W-1
    inputs); new_state [B, H, K, V] fp32.
Pure (the serving contract: pools are read-only, the runtime writes new rows to pool[slots[b]]).
`kda_decode_` is the in-place form for eager torch callers: the same step writing the pools' slot rows
directly (`k3::kda_decode_`, mutates conv_pool and state_pool), returning o only.
`gate_lower_bound` as in k3::kda (0.0 = unbounded Kimi Linear gate).
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
    """Why k3::kda_decode cannot run `cfg` (None if it can): k3::kda's limits (the same head dims)."""
    reason = _kda_check_config(cfg, kernels=kernels)
    return None if reason is None else reason.replace("k3::kda", "k3::kda_decode")


def kda_decode_output_shapes(qkv_shape, gate_shape, conv_pool_shape, state_pool_shape):
    """One shape rule for the fake impl and the TensorRT plugin: dims in, dims out (only + * //)."""
    B, H, V = gate_shape
    return (B, H, V), (B, conv_pool_shape[1], conv_pool_shape[2]), (B, *state_pool_shape[1:])


INPUTS = ("qkv", "f", "b", "gate", "conv_weight", "A_log", "dt_bias", "norm_weight", "conv_pool", "state_pool",
          "slots")

SIGNATURE = Signature(
    "kda_decode", "KDADecode",
    inputs=(TensorPort("qkv", "T"), TensorPort("f", "T", "qkv"), TensorPort("b", "T", "qkv"),
            TensorPort("gate", "T", "qkv"), TensorPort("conv_weight", "W"), TensorPort("A_log", "F"),
            TensorPort("dt_bias", "F"), TensorPort("norm_weight", "F"), TensorPort("conv_pool", "S"),
            TensorPort("state_pool", "S"), TensorPort("slots", "I")),
    outputs=(TensorPort("o", "T", "qkv"), TensorPort("new_conv", "S"), TensorPort("new_state", "S")),
    attrs=(Attr("scale", float), Attr("eps", float), Attr("num_heads", int, op=False),
           Attr("head_dim", int, op=False), Attr("value_dim", int, op=False), Attr("conv_kernel", int, op=False),
           KERNELS, Attr("gate_lower_bound", float, 0.0)),
    shapes=lambda s: kda_decode_output_shapes(s[0], s[3], s[8], s[9]),
    doc="Fused KDA decode step (one token per sequence): short conv + conv state, decay gate, gated delta rule "
        "from state_pool[slots[b]], gated RMSNorm. qkv [B, 2HK+HV]; f [B, H, K]; b [B, H]; gate [B, H, V]; "
        "conv_weight [C, W]; A_log [>=H] fp32; dt_bias [H*K] fp32; norm_weight [V] fp32; conv_pool [S, C, W-1] "
        "fp32; state_pool [S, H, K, V] fp32; slots [B] int32 -> o [B, H, V], new_conv [B, C, W-1] fp32, "
        "new_state [B, H, K, V] fp32. Same contract as torch.ops.k3.kda_decode. The pools are not written.",
)


def _run(tensors: tuple, scale: float, eps: float, kernels: str, gate_lower_bound: float, *,
         in_place: bool) -> tuple[Tensor, Tensor, Tensor]:
    if require_kernels("k3::kda_decode", kernels, *tensors) is Kernels.TRITON:
        from . import triton

        return triton.kda_decode(*tensors, scale=scale, eps=eps, gate_lower_bound=gate_lower_bound,
                                 in_place=in_place)
    o, conv, state = reference.kda_decode(*tensors, scale=scale, eps=eps, gate_lower_bound=gate_lower_bound)
    if in_place:
        sl = tensors[-1].to(torch.int64)
        tensors[8].index_copy_(0, sl, conv.to(tensors[8].dtype))
        tensors[9].index_copy_(0, sl, state.to(tensors[9].dtype))
    return o, conv, state


@SIGNATURE.define
def _kda_decode(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor,
                dt_bias: Tensor, norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor,
                scale: float, eps: float, kernels: str, gate_lower_bound: float = 0.0) -> tuple[Tensor, Tensor, Tensor]:
    tensors = (qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool, slots)
    return _run(tensors, scale, eps, kernels, gate_lower_bound, in_place=False)


@torch.library.custom_op("k3::kda_decode_", mutates_args=("conv_pool", "state_pool"))
def _kda_decode_(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor,
                 dt_bias: Tensor, norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor,
                 scale: float, eps: float, kernels: str, gate_lower_bound: float = 0.0) -> Tensor:
    tensors = (qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool, slots)
    return _run(tensors, scale, eps, kernels, gate_lower_bound, in_place=True)[0]


@_kda_decode_.register_fake
def _kda_decode_fake(qkv, f, b, gate, *args, **kwargs) -> Tensor:
    return qkv.new_empty(gate.shape)


@dataclass
class KDADecodeOutput:
    output: Tensor  # [B, H, V], gated and normed
    conv: Tensor  # [B, C, W-1] fp32
    state: Tensor  # [B, H, K, V] fp32


def _attrs(K: int, scale: float | None, kernels: Kernels, gate_lower_bound: float | None) -> tuple:
    lb = 0.0 if gate_lower_bound is None else float(gate_lower_bound)
    return (K ** -0.5 if scale is None else float(scale)), Kernels(kernels).value, lb


def kda_decode(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
               norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor, *, eps: float,
               scale: float | None = None, kernels: Kernels = Kernels.REFERENCE,
               gate_lower_bound: float | None = None) -> KDADecodeOutput:
    """The pure step: new rows out (pools untouched)."""
    scale, kernels, lb = _attrs(f.shape[-1], scale, kernels, gate_lower_bound)
    o, conv, state = torch.ops.k3.kda_decode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool,
                                             state_pool, slots, scale, float(eps), kernels, lb)
    return KDADecodeOutput(o, conv, state)


def kda_decode_(qkv: Tensor, f: Tensor, b: Tensor, gate: Tensor, conv_weight: Tensor, A_log: Tensor,
                dt_bias: Tensor, norm_weight: Tensor, conv_pool: Tensor, state_pool: Tensor, slots: Tensor, *,
                eps: float, scale: float | None = None, kernels: Kernels = Kernels.REFERENCE,
                gate_lower_bound: float | None = None) -> Tensor:
    """The in-place step: writes conv_pool[slots[b]] and state_pool[slots[b]]; returns o [B, H, V]."""
    scale, kernels, lb = _attrs(f.shape[-1], scale, kernels, gate_lower_bound)
    return torch.ops.k3.kda_decode_(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool,
                                    state_pool, slots, scale, float(eps), kernels, lb)
