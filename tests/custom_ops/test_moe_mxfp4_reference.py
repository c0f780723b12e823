"""k3::moe_mxfp4 reference: decodes only the routed experts and equals, bit for bit in fp32, the dense
reference on every expert decoded up front; the op dispatches, traces (fake impl) and refuses bad shapes."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.moe import reference as dense
from k3x.custom_ops.moe.op import MoEOptions
from k3x.custom_ops.moe_mxfp4 import moe_mxfp4, reference
from k3x.custom_ops.moe_mxfp4.codec import dequantize


def packed_inputs(N=11, d=24, L=64, I=32, E=6, hot=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)
    gw, gb = torch.randn(E, d, generator=g) * d ** -0.5, torch.randn(E, generator=g) * 0.1
    if hot is not None:
        gb[hot] = 100.0
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    sc = lambda *s: torch.randint(117, 127, s, generator=g, dtype=torch.uint8)  # noqa: E731
    return [x, z, gw, gb, u8(E, I, L // 2), u8(E, I, L // 2), u8(E, L, I // 2), sc(E, I, L // 32),
            sc(E, I, L // 32), sc(E, L, I // 32)]


@pytest.mark.parametrize("k, act, hot", [(2, "situ", None), (1, "silu", 4), (6, "situ", None)])
def test_packed_reference_equals_dense_on_decoded_experts_bitwise(k, act, hot):
    x, z, gw, gb, w1, w3, w2, s1, s3, s2 = packed_inputs(hot=hot)
    hyper = [k, 1.5, True, act, 4.0, 25.0]
    out = reference.moe(x, z, gw, gb, w1, w3, w2, s1, s3, s2, *hyper)
    want = dense.moe(x, z, gw, gb, dequantize(w1, s1), dequantize(w3, s3), dequantize(w2, s2), *hyper)
    assert out.dtype == torch.float32 and torch.equal(out, want)


def test_only_routed_experts_are_decoded(monkeypatch):
    args = packed_inputs(N=5, E=6, hot=2)  # top-1 with every token on expert 2
    decoded = []
    real = reference.dequantize
    monkeypatch.setattr(reference, "dequantize", lambda p, s: decoded.append(p.data_ptr()) or real(p, s))
    reference.moe(*args, 1, 1.0, True, "situ", 4.0, 25.0)
    w1, w3, w2 = args[4:7]
    assert decoded == [w1[2].data_ptr(), w3[2].data_ptr(), w2[2].data_ptr()]


def test_op_dispatch_and_fake_impl():
    args = packed_inputs(N=4)
    opts = MoEOptions(2, 1.0, True, "situ", 4.0, 25.0)
    out = moe_mxfp4(*args, options=opts)
    assert torch.equal(out, reference.moe(*args, *opts.args()))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = moe_mxfp4(*(mode.from_tensor(t) for t in args), options=opts)
    assert fake.shape == (4, 64)


def test_bad_packed_shapes_are_named():
    args = packed_inputs()
    args[8] = args[8][:, :, :1].contiguous().expand(6, 32, 1)[:, :16]  # w3_scale [E, 16, 2] -> wrong rows
    with pytest.raises(ValueError, match=r"moe_mxfp4: shapes.*\(w3_scale\)"):
        reference.moe(*args, 2, 1.0, True, "situ", 4.0, 25.0)


def test_mxfp8_activations_are_the_emulation_on_both_gemm_inputs():
    """activations='mxfp8': the dense math on MXFP8-rounded z and MXFP8-rounded GLU output h, bit for bit (an
    independent spelling of the expert loop), through the op too; not the bf16 result; a bad format is named."""
    from k3x.custom_ops.moe.reference import glu, route
    from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize

    x, z, gw, gb, w1, w3, w2, s1, s3, s2 = args = packed_inputs(hot=None)
    z = z * 3
    args[1] = z
    hyper = [2, 1.5, True, "situ", 4.0, 25.0]
    out = reference.moe(*args, *hyper, activations="mxfp8")
    ids, w = route(x, gw, gb, 2, 1.5, True)
    want = torch.zeros_like(z)
    zq = fake_quantize(z)
    for e in range(w1.shape[0]):  # ascending experts, as the reference accumulates
        tok, slot = (ids == e).nonzero(as_tuple=True)
        if len(tok):
            h = glu(zq[tok] @ dequantize(w1[e], s1[e]).t(), zq[tok] @ dequantize(w3[e], s3[e]).t(), "situ", 4.0, 25.0)
            want.index_add_(0, tok, (fake_quantize(h) @ dequantize(w2[e], s2[e]).t()) * w[tok, slot, None])
    assert torch.equal(out, want)
    assert not torch.allclose(out, reference.moe(*args, *hyper), atol=1e-3)
    opts = MoEOptions(*hyper)
    assert torch.equal(moe_mxfp4(*args, options=opts, activations="mxfp8"), out)
    with pytest.raises(ValueError, match="activations='fp8'"):
        moe_mxfp4(*args, options=opts, activations="fp8")
