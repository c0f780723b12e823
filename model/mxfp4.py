"""MXFP4 (OCP Microscaling, E2M1 elements + E8M0 scale per 32-element block), compressed-tensors layout.

Spec §6.1–6.2: `weight_packed` uint8 `[out, in/2]` holds element 2j in the LOW nibble and 2j+1 in the
HIGH nibble; a code is the index into {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign in bit 3.
`weight_scale` uint8 `[out, in/32]` is the E8M0 byte: scale = 2^(byte − 127).
Scale choice (compressed-tensors `generate_mx_scales`): round the block amax to a power of two at
E2M1's mantissa precision (add half an ulp, keep sign+exponent), then byte = 127 + exponent − 2.
Decoding is `custom_ops/moe_mxfp4/codec.dequantize` (the one decoder, shared with the packed-expert op);
this module adds the checks a checkpoint needs and the encoder.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..custom_ops.moe_mxfp4.codec import BLOCK, dequantize as _decode

_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """packed [out, in/2] u8, scale [out, in/32] u8 -> [out, in] in `dtype`."""
    out, half = packed.shape
    if scale.shape != (out, 2 * half // BLOCK):
        raise ValueError(f"mxfp4: weight_scale {tuple(scale.shape)} does not fit weight_packed {tuple(packed.shape)}")
    if (scale == 0xFF).any():
        raise ValueError("mxfp4: weight_scale holds 0xFF, the E8M0 NaN encoding")
    return _decode(packed, scale, dtype)


def quantize(w: Tensor) -> tuple[Tensor, Tensor]:
    """w [out, in] (in % 32 == 0) -> (packed [out, in/2] u8, scale [out, in/32] u8)."""
    out, n = w.shape
    if n % BLOCK:
        raise ValueError(f"mxfp4: input width {n} is not a multiple of {BLOCK}")
    blocks = w.float().reshape(out, n // BLOCK, BLOCK)
    amax = blocks.abs().amax(-1)  # [out, nb]
    bits = (amax.view(torch.int32) + (1 << 21)) & 0x7F800000  # round amax to a power of two
    exp = (bits >> 23) - 127
    byte = torch.where(amax > 0, (exp - 2 + 127).clamp(0, 254), torch.zeros_like(exp))
    x = blocks / torch.exp2(byte.float() - 127.0)[..., None]
    idx = torch.bucketize(x.abs().clamp(max=6.0), _MIDPOINTS)  # nearest E2M1 magnitude, saturating
    codes = (idx | ((x < 0).to(torch.int64) << 3)).reshape(out, n)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return packed, byte.to(torch.uint8)
