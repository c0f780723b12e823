"""MXFP8 activations (OCP Microscaling Formats v1.0, §5 and §6.3): the one torch quantizer of the expert-GEMM
inputs when an export is built with `activations="mxfp8"` (W4A8: MXFP4 weights × MXFP8 activations).

Along the last dim, each block of 32 elements shares one E8M0 scale X = 2^s (byte s + 127) and every element is
stored as FP8 E4M3 (bias 7, 3 mantissa bits, max ±448, subnormals down to 2^-9, no infinities):
- s = floor(log2(amax)) − 8 (8 = emax of E4M3, the exponent of its largest power of two 256), clamped to
  [−127, 127] (the spec's "minimal" scale rule; a zero block, and any block with amax < 2^-119, gets 2^-127);
- P_i = V_i / X rounded to the nearest E4M3 value, ties to even, saturating to ±448 (V_i / X < 512 always);
- a block holding a NaN or an infinity gets the NaN scale 0xFF, so all 32 of its values decode as NaN (E4M3 has
  no infinity and X = 2^floor(log2(inf)) does not exist).
fp32 math (bf16/fp16 inputs are exact in fp32); every step is exact except the one rounding to E4M3: V_i / X is
a multiplication by a normal power of two, and the nearest-even step divides by the E4M3 spacing of |P_i|'s
binade (2^(e−3), 2^-9 below 2^-6), rounds with `torch.round` (half to even) and multiplies back.
The ONNX body (onnx.py) and the Triton GEMM prologue (triton.py) implement the same rule with their own ops.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .codec import BLOCK

E4M3_MAX = 448.0
EMAX = 8  # floor(log2(448)): the scale puts a block's largest power of two at 2^8
MIN_NORMAL_EXP = -6  # E4M3 normals 2^-6 .. 448; below: subnormal multiples of 2^-9
MANTISSA_BITS = 3
SCALE_NAN = 0xFF
ACTIVATIONS = ("bf16", "mxfp8")  # the expert-GEMM input formats an export can choose (bf16: as computed)


def _pow2(exponent: Tensor) -> Tensor:
    """2^exponent in fp32 for int32 exponents in [-126, 127], built from the bits (exact)."""
    return ((exponent + 127) << 23).view(torch.float32)


def _floor_log2(a: Tensor) -> Tensor:
    """floor(log2(a)) as int32 for normal positive fp32 `a` (its exponent field)."""
    return (a.view(torch.int32) >> 23) - 127


def shared_exponent(amax: Tensor) -> Tensor:
    """The block exponent s (int32, [-127, 119] for finite fp32): floor(log2(amax)) − 8, at least −127."""
    return (_floor_log2(amax.clamp(min=2.0 ** -120)) - EMAX).clamp(-127, 127)  # amax < 2^-119 -> -127 anyway


def round_e4m3(y: Tensor) -> Tensor:
    """fp32 `y` to the nearest E4M3 value (in fp32), ties to even, saturating to ±448; -0 stays -0."""
    y = y.clamp(-E4M3_MAX, E4M3_MAX)
    ulp = _pow2(_floor_log2(y.abs().clamp(min=2.0 ** MIN_NORMAL_EXP)) - MANTISSA_BITS)  # spacing in y's binade
    return torch.round(y / ulp) * ulp


def _blocks(x: Tensor) -> Tensor:
    if x.shape[-1] % BLOCK:
        raise ValueError(f"mxfp8: last dim {x.shape[-1]} is not a multiple of {BLOCK}")
    return x.float().reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def quantize(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] (K % 32 == 0) -> (elements [..., K] float8_e4m3fn, E8M0 scale bytes [..., K/32] uint8)."""
    blocks = _blocks(x)
    amax = blocks.abs().amax(-1)  # NaN if the block holds one
    finite = torch.isfinite(amax)
    s = shared_exponent(torch.where(finite, amax, 0.0))
    inv = ((127 - s) << 23).view(torch.float32)  # 2^-s, normal for s in [-127, 119]
    q = torch.where(finite[..., None], round_e4m3(blocks * inv[..., None]), float("nan"))
    scale = torch.where(finite, s + 127, SCALE_NAN).to(torch.uint8)
    return q.to(torch.float8_e4m3fn).reshape(x.shape), scale  # q is on the E4M3 grid: the cast is exact


def dequantize(elements: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """(elements [..., K] float8_e4m3fn, scale [..., K/32] uint8) -> values [..., K] in `dtype` (0xFF: NaN)."""
    q = _blocks(elements)
    x = torch.exp2(scale.to(torch.float32) - 127.0)  # exact, 2^-127 included
    x = torch.where(scale == SCALE_NAN, float("nan"), x)
    return (q * x[..., None]).reshape(elements.shape).to(dtype)


def fake_quantize(x: Tensor) -> Tensor:
    """x rounded through MXFP8 and back (in x's dtype: exact for fp32/bf16): what the expert GEMMs see."""
    return dequantize(*quantize(x), dtype=x.dtype)
