"""A linear projection on 8-bit block-quantised weights and activations, the eager oracle, and the quantiser.
Torch-only.

    x       [..., K]         fp32 activations (fp64 gives an fp64 oracle)
    weight  [N, KB, BLOCK]   uint8: each row's K weights in KB = ceil(K / BLOCK) blocks, zero-padded at the end
    scales  [N, KB]          fp32, one per block
Weight (n, k) = (weight[n, k // BLOCK, k % BLOCK] - 128) * scales[n, k // BLOCK]: symmetric absmax quantisation
(codes 1..255, 128 is zero), the layout and the default zero point of ONNX Runtime's `com.microsoft::MatMulNBits`
with bits=8 and no zero_points input, so the export hands it the bytes as they are.
The op is what MatMulNBits computes at accuracy_level 4 (the level the export sets: docs/model.md §6.1): each
row of x is quantised too, per block of BLOCK along K: scale = absmax / 127, code = round(x / scale) (half to
even); each block's dot product of codes is an integer (at most 32 * 127 * 127: exact in fp32) scaled by
the two blocks' scales and summed over the blocks. ONNX Runtime's MatMulNBits (the function body) and the
kernel library's ort_kernel.cc both give this to fp32 rounding (tests/custom_ops/test_linear_q8.py,
tests/runtime/test_ort_kernel_linear_q8.py), so an int8-trunk export is checked against its own model as tightly as
an fp32 one; what the 8-bit rounding costs against the fp32 model is the trunk's tolerance (runtime/tolerances.py).
"""

from __future__ import annotations

import torch
from torch import Tensor

BLOCK = 32  # weights per scale along K (docs/model.md "CPU trunks": 32 measured against 64 and 128)
ZERO = 128  # the code of 0: MatMulNBits' default zero point for 8 bits


def check_shapes(x: Tensor, weight: Tensor, scales: Tensor) -> None:
    """ValueError naming every shape and dtype when they do not make an 8-bit block-quantised linear."""
    ok = (x.dtype in (torch.float32, torch.float64) and weight.dtype == torch.uint8 and weight.dim() == 3
          and scales.dtype == torch.float32 and tuple(scales.shape) == tuple(weight.shape[:2]) and x.dim() >= 1
          and (weight.shape[1] - 1) * weight.shape[2] < x.shape[-1] <= weight.shape[1] * weight.shape[2])
    if not ok:
        raise ValueError(f"linear_q8: x {tuple(x.shape)} {x.dtype}, weight {tuple(weight.shape)} {weight.dtype} and "
                         f"scales {tuple(scales.shape)} {scales.dtype} do not fit: expected x float32 [..., K], "
                         "weight uint8 [N, ceil(K / block), block] and scales float32 [N, ceil(K / block)]")


def dequantize(weight: Tensor, scales: Tensor, k: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """weight [N, KB, BLOCK] uint8, scales [N, KB] -> [N, k] of `dtype`."""
    w = (weight.to(torch.int16) - ZERO).to(dtype) * scales.to(dtype)[..., None]
    return w.flatten(1)[:, :k]


def quantize(w: Tensor, block: int = BLOCK) -> tuple[Tensor, Tensor]:
    """w [N, K] float -> (weight uint8 [N, ceil(K / block), block], scales fp32 [N, ceil(K / block)]): per block
    the scale is absmax / 127 and each weight rounds to the nearest code (a zero block: scale 0, codes 128)."""
    n, k = w.shape
    kb = -(-k // block)
    padded = torch.zeros(n, kb * block, dtype=torch.float32, device=w.device)
    padded[:, :k] = w.to(torch.float32)
    blocks = padded.view(n, kb, block)
    scales = blocks.abs().amax(-1) / 127
    codes = torch.where(scales[..., None] > 0, blocks / scales.clamp(min=torch.finfo(torch.float32).tiny)[..., None],
                        torch.zeros((), device=w.device))
    return (codes.round().clamp(-127, 127).to(torch.int16) + ZERO).to(torch.uint8), scales


def quantize_activations(x: Tensor, blocks: int, block: int) -> tuple[Tensor, Tensor]:
    """x [..., K] -> (codes [..., blocks, block] in x's dtype, integers in -127..127; scales [..., blocks]):
    per block absmax / 127, each value divided by it and rounded half to even (a zero block: scale 0, codes 0)."""
    padded = torch.zeros(*x.shape[:-1], blocks * block, dtype=x.dtype, device=x.device)
    padded[..., : x.shape[-1]] = x
    xb = padded.unflatten(-1, (blocks, block))
    scale = xb.abs().amax(-1) / 127
    codes = torch.where(scale[..., None] > 0, xb / scale.clamp(min=torch.finfo(x.dtype).tiny)[..., None],
                        torch.zeros((), dtype=x.dtype))  # x / scale, as MLAS divides (not x * (127 / absmax))
    return torch.round(codes).clamp(-127, 127), scale


def linear_q8(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    check_shapes(x, weight, scales)
    n, blocks, block = weight.shape
    codes, x_scales = quantize_activations(x, blocks, block)
    w = (weight.to(torch.int16) - ZERO).to(x.dtype)
    out = torch.zeros(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    for b in range(blocks):  # one block at a time: [..., block] x [block, N], never [..., N, blocks] at once
        out += (codes[..., b, :] @ w[:, b, :].T) * x_scales[..., b, None] * scales[:, b].to(x.dtype)
    return out
