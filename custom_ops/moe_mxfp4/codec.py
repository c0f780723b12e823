"""MXFP4 decode, the one implementation every torch path uses (model/mxfp4.py validates and re-exports it).

Layout (docs/model.md §6, compressed-tensors `mxfp4-pack-quantized`): `packed` uint8 `[..., out, in/2]` holds
element 2j in the LOW nibble and 2j+1 in the HIGH nibble; a code is the index into {0, .5, 1, 1.5, 2, 3, 4, 6}
with the sign in bit 3. `scale` uint8 `[..., out, in/32]` is the E8M0 byte: 2^(byte − 127). Decoding is exact
in fp32 (every E2M1 value times a power of two is representable, subnormals included), so decoding only the
experts a call routes to equals decoding all of them up front, bit for bit.
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # by 4-bit code


def dequantize(packed: Tensor, scale: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """packed [..., out, in/2] u8, scale [..., out, in/32] u8 -> [..., out, in] in `dtype` (no validation)."""
    table = torch.tensor(E2M1, dtype=torch.float32, device=packed.device)
    p = packed.to(torch.int64)
    vals = table[torch.stack([p & 0xF, p >> 4], dim=-1)]  # [..., out, in/2, 2], low nibble first
    vals = vals.reshape(*packed.shape[:-1], packed.shape[-1] // (BLOCK // 2), BLOCK)  # [..., out, in/32, 32]
    s = torch.exp2(scale.to(torch.float32) - 127.0)  # exact powers of two (2^-127 is an fp32 subnormal)
    return (vals * s[..., None]).reshape(*packed.shape[:-1], 2 * packed.shape[-1]).to(dtype)
