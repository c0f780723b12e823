"""An independent emulation of OCP MX v1.0 MXFP8 (E4M3 elements, E8M0 block scale) and the hard cases it is
checked on, shared by the quantizer test (tests/custom_ops/test_mxfp8.py) and the Triton prologue test: E4M3
decoded field by field from each of the 256 codes, the block scale from `math.frexp` of the block's amax, each
element's code picked by brute force as the nearest finite E4M3 value with ties to the even code (which gives
saturation to ±448 for free). Written apart from the implementation (custom_ops/moe_mxfp4/mxfp8.py), which
works on fp32 bit fields."""

from __future__ import annotations

import math

import numpy as np
import torch


def decode_e4m3(code: int) -> float:
    """OCP FP8 E4M3 (e4m3fn): sign bit 7, exponent bits 6..3 (bias 7), mantissa bits 2..0; S.1111.111 is NaN,
    exponent 0 is subnormal (m/8 · 2^-6); no infinities."""
    sign = -1.0 if code & 0x80 else 1.0
    e, m = (code >> 3) & 0xF, code & 0x7
    if e == 0xF and m == 0x7:
        return math.nan
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


MAGNITUDES = np.array([decode_e4m3(c) for c in range(0x7F)])  # codes 0x00 .. 0x7E: every finite magnitude


def emulate_element(t: np.ndarray) -> np.ndarray:
    """Codes (uint8) of t (float64, finite): nearest finite E4M3 magnitude, an exact tie to the even code."""
    dist = np.abs(np.abs(t)[:, None] - MAGNITUDES[None, :])  # [n, 127]
    best = dist == dist.min(axis=1, keepdims=True)
    even = best & (np.arange(0x7F) % 2 == 0)[None, :]
    code = np.where(even.any(axis=1), even.argmax(axis=1), best.argmax(axis=1))
    return (code | np.where(np.signbit(t), 0x80, 0)).astype(np.uint8)


def emulate(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """(codes [rows, K] uint8, scale bytes [rows, K/32] uint8); NaN blocks: scale 0xFF, codes unspecified (0)."""
    v = x.double().numpy().reshape(-1, 32)
    codes, scales = np.zeros(v.shape, np.uint8), np.zeros(len(v), np.uint8)
    for i, block in enumerate(v):
        if not np.isfinite(block).all():
            scales[i] = 0xFF
            continue
        amax = float(np.abs(block).max())
        s = -127 if amax == 0 else max(-127, math.frexp(amax)[1] - 1 - 8)  # frexp: amax = m 2^e, m in [.5, 1)
        scales[i] = s + 127
        codes[i] = emulate_element(block / 2.0 ** s)  # exact in float64
    return codes.reshape(x.shape), scales.reshape(*x.shape[:-1], -1)


def grid_values() -> np.ndarray:
    """Element values t = V/X: every E4M3 magnitude, every midpoint between neighbours (the ties), saturation
    (448 .. 512), the subnormal ties 2^-10 (-> 0) and 3·2^-10 (-> 2^-8), each with both signs."""
    m = MAGNITUDES
    mids = (m[1:] + m[:-1]) / 2
    extra = np.array([449.0, 463.0, 464.0, 479.0, 480.0, 500.0, 511.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                      5 * 2.0 ** -11, 2.0 ** -12])
    t = np.concatenate([m, mids, extra])
    return np.concatenate([t, -t])


def scale_blocks(s: int) -> np.ndarray:
    """fp32 blocks [n, 32] of scale exactly 2^s: an anchor 511·2^s (amax in [2^(s+8), 2^(s+9))) and 31 grid
    values V = t·2^s each (exact in fp32), with one fp32 step above and below each (nextafter of V, not t)."""
    t = grid_values()
    v = (t * 2.0 ** s).astype(np.float32)
    assert np.array_equal(v.astype(np.float64) / 2.0 ** s, t)  # exact in fp32 at this scale
    up, down = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))
    vals = np.concatenate([v, up, down])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 31, np.float32)]).reshape(-1, 31)
    anchor = np.full((len(vals), 1), 511 * 2.0 ** s, np.float32)
    return np.concatenate([anchor, vals], axis=1)
