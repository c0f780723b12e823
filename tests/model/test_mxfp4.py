"""MXFP4 codec: the compressed-tensors layout, known bytes, round trip within the format's error."""

from __future__ import annotations

import pytest
import torch

from k3x.model import mxfp4


def test_known_bytes_low_nibble_is_even_element():
    w = torch.zeros(1, 32)
    w[0, :3] = torch.tensor([3.0, -0.5, 1.0])
    packed, scale = mxfp4.quantize(w)
    # amax 3 -> power of two 2 -> E8M0 byte 127 + 1 - 2 = 126 (scale 0.5); codes 6.0 -> 7, -1.0 -> 0b1010, 2.0 -> 4
    assert scale.tolist() == [[126]]
    assert packed[0, :2].tolist() == [7 | (10 << 4), 4]
    assert mxfp4.dequantize(packed, scale)[0, :4].tolist() == [3.0, -0.5, 1.0, 0.0]


def test_decode_table():
    packed = torch.tensor([[0x10 * c + c for c in range(16)]], dtype=torch.uint8)  # each code in both nibbles
    scale = torch.tensor([[127]], dtype=torch.uint8)  # scale 1
    vals = mxfp4.dequantize(packed, scale)[0, 0::2].tolist()
    assert vals == [0, .5, 1, 1.5, 2, 3, 4, 6, -0.0, -.5, -1, -1.5, -2, -3, -4, -6]


def test_scale_rounding_uses_half_ulp_rule():
    w = torch.zeros(2, 32)
    w[0, 0], w[1, 0] = 1.7, 1.8  # 1.7 stays at 2^0, 1.8 rounds up to 2^1 (mantissa >= 1.75)
    _, scale = mxfp4.quantize(w)
    assert scale[:, 0].tolist() == [125, 126]


def test_round_trip_error_bounded():
    w = torch.randn(16, 128)
    d = mxfp4.dequantize(*mxfp4.quantize(w))
    blocks = (w - d).abs().reshape(16, 4, 32).amax(-1) / w.abs().reshape(16, 4, 32).amax(-1)
    assert blocks.max() < 0.3  # E2M1 with a saturating power-of-two scale
    assert torch.equal(mxfp4.dequantize(*mxfp4.quantize(d)), d)  # grid values are fixed points


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4.quantize(torch.randn(2, 40))
    with pytest.raises(ValueError, match="weight_scale"):
        mxfp4.dequantize(torch.zeros(2, 16, dtype=torch.uint8), torch.zeros(2, 2, dtype=torch.uint8))
