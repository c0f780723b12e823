"""The MXFP8 quantizer (custom_ops/moe_mxfp4/mxfp8.py) against an independent emulation of OCP MX v1.0: E4M3
decoded field by field from each of the 256 codes, the block scale from `math.frexp` of the block's amax, and
each element's code picked by brute force as the nearest finite E4M3 value with ties to the even code (which
gives saturation to ±448 for free) — bit for bit on every code, every tie and its neighbours, saturation,
subnormals, zero blocks, clamped and extreme scales, amax at and just below powers of two, NaN/Inf blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3x.custom_ops.moe_mxfp4.mxfp8 import dequantize, fake_quantize, quantize, round_e4m3


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


def check(x: torch.Tensor) -> None:
    q, scale = quantize(x)
    want_codes, want_scale = emulate(x)
    assert np.array_equal(scale.numpy(), want_scale), np.argwhere(scale.numpy() != want_scale)[:5]
    ok = np.repeat(want_scale != 0xFF, 32, axis=-1)
    got = q.view(torch.uint8).numpy()
    bad = np.argwhere((got != want_codes) & ok)
    assert not len(bad), [(tuple(i), float(x[tuple(i)]), hex(got[tuple(i)]), hex(want_codes[tuple(i)]))
                          for i in bad[:5]]
    back = dequantize(q, scale).double().numpy()
    want = np.array([decode_e4m3(int(c)) for c in want_codes.reshape(-1)]).reshape(x.shape) * np.repeat(
        2.0 ** (want_scale.astype(np.float64) - 127), 32, axis=-1)
    assert np.array_equal(np.isnan(back), ~ok)  # a NaN / Inf block decodes to 32 NaNs, nothing else is NaN
    assert np.array_equal(back[ok], want[ok]) and np.array_equal(np.signbit(back[ok]), np.signbit(want[ok]))


def test_decoder_is_the_e4m3fn_standard():
    """The test-side decoder of all 256 codes agrees with torch's float8_e4m3fn (NaN at 0x7F / 0xFF only)."""
    ref = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double().tolist()
    mine = [decode_e4m3(c) for c in range(256)]
    assert [math.isnan(v) for v in mine] == [math.isnan(v) for v in ref] and sum(map(math.isnan, mine)) == 2
    assert all(a == b and math.copysign(1, a) == math.copysign(1, b) for a, b in zip(mine, ref) if not math.isnan(a))
    assert max(MAGNITUDES) == 448.0 and min(MAGNITUDES[1:]) == 2.0 ** -9


def grid_values() -> np.ndarray:
    """Element values t = V/X: every E4M3 magnitude, every midpoint between neighbours (the ties), saturation
    (448 .. 512), the subnormal ties 2^-10 (-> 0) and 3·2^-10 (-> 2^-8), each with both signs."""
    m = MAGNITUDES
    mids = (m[1:] + m[:-1]) / 2
    extra = np.array([449.0, 463.0, 464.0, 479.0, 480.0, 500.0, 511.0, 2.0 ** -10, 3 * 2.0 ** -10, 2.0 ** -11,
                      5 * 2.0 ** -11, 2.0 ** -12])
    t = np.concatenate([m, mids, extra])
    return np.concatenate([t, -t])


@pytest.mark.parametrize("s", [-127, -126, -119, -60, -9, 0, 7, 64, 119])
def test_every_code_tie_and_saturation_at_scale(s):
    """Blocks of 31 grid values plus an anchor 511·2^s (amax in [2^(s+8), 2^(s+9)): scale exactly 2^s); the ties
    exactly, and one fp32 step above and below each (nextafter of V, not of t)."""
    t = grid_values()
    v = (t * 2.0 ** s).astype(np.float32)
    assert np.array_equal(v.astype(np.float64) / 2.0 ** s, t)  # exact in fp32 at this scale
    up, down = np.nextafter(v, np.float32(np.inf)), np.nextafter(v, np.float32(-np.inf))
    vals = np.concatenate([v, up, down])
    vals = np.concatenate([vals, np.zeros(-len(vals) % 31, np.float32)]).reshape(-1, 31)
    anchor = np.full((len(vals), 1), 511 * 2.0 ** s, np.float32)
    check(torch.from_numpy(np.concatenate([anchor, vals], axis=1)).reshape(-1, 64))


def test_saturation_happens_before_the_fp8_cast():
    """The rounding saturates by itself (no reliance on how a float8 cast treats 480 .. 512)."""
    y = torch.tensor([464.0, 480.0, 496.0, 511.0, -500.0, 447.0, -0.0])
    assert round_e4m3(y).tolist() == [448.0, 448.0, 448.0, 448.0, -448.0, 448.0, -0.0]


def test_scale_choice_at_and_below_powers_of_two_and_clamps():
    """amax exactly 2^k and one fp32 step below, for k over the whole fp32 range (subnormals included: those
    scales clamp to 2^-127), the largest finite fp32 (scale 2^119, saturating), zero and -0 blocks."""
    rows = []
    for k in range(-149, 128):
        p = np.float32(2.0 ** k)
        for amax in (p, np.nextafter(p, np.float32(0))):
            if amax == 0:
                continue
            rng = np.random.default_rng(k + 200)
            row = (rng.uniform(-1, 1, 32) * amax).astype(np.float32)
            row[rng.integers(32)] = -amax if k % 2 else amax
            rows.append(row)
    big = np.float32(np.finfo(np.float32).max)
    rows += [np.full(32, big), np.linspace(-big, big, 32, dtype=np.float32), np.zeros(32, np.float32),
             np.full(32, -0.0, np.float32)]
    check(torch.from_numpy(np.stack(rows)))


def test_nan_and_inf_blocks_get_the_nan_scale():
    x = torch.randn(4, 96)
    x[0, 3], x[1, 40], x[2, 95] = float("nan"), float("inf"), float("-inf")
    check(x)
    q, scale = quantize(x)
    assert scale[0].tolist() == [0xFF, *scale[0, 1:].tolist()] and scale[1, 1] == 0xFF and scale[2, 2] == 0xFF
    assert (scale[3] != 0xFF).all()


@pytest.mark.parametrize("sigma", [1e-30, 1e-3, 1.0, 1e4, 1e30])
def test_random_activations(sigma):
    g = torch.Generator().manual_seed(int(math.log10(sigma)) + 40)
    x = torch.randn(64, 256, generator=g) * sigma
    x[::7] *= torch.rand(256, generator=g) ** 8  # heavy tails inside blocks
    check(x)


def test_fake_quantize_keeps_dtype_and_bf16_is_exact():
    x = torch.randn(8, 128) * 10
    assert torch.equal(fake_quantize(x), dequantize(*quantize(x)))
    xb = x.bfloat16()
    yb = fake_quantize(xb)
    assert yb.dtype == torch.bfloat16 and torch.equal(yb.float(), fake_quantize(xb.float()))
    with pytest.raises(ValueError, match="not a multiple of 32"):
        quantize(torch.ones(2, 48))
