"""The MXFP8 quantizer (custom_ops/moe_mxfp4/mxfp8.py) against the independent emulation in tests/mxfp8_cases.py,
bit for bit: every E4M3 code, every tie and its fp32 neighbours, saturation, subnormals, zero blocks, clamped and
extreme scales, amax at and just below powers of two, NaN/Inf blocks."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from k3x.custom_ops.moe_mxfp4.mxfp8 import dequantize, fake_quantize, quantize, round_e4m3
from mxfp8_cases import MAGNITUDES, decode_e4m3, emulate, scale_blocks


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


@pytest.mark.parametrize("s", [-127, -126, -119, -60, -9, 0, 7, 64, 119])
def test_every_code_tie_and_saturation_at_scale(s):
    """Blocks of 31 grid values plus an anchor 511·2^s (amax in [2^(s+8), 2^(s+9)): scale exactly 2^s); the ties
    exactly, and one fp32 step above and below each (nextafter of V, not of t)."""
    check(torch.from_numpy(scale_blocks(s)).reshape(-1, 64))


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
    rows += [np.full(32, big), (np.linspace(-1, 1, 32) * float(big)).astype(np.float32), np.zeros(32, np.float32),
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
