"""k3::linear_q8: the quantiser's codes and scales (rounding within half a step, padding, zero blocks), the
reference against the formula, the op's shape and dtype errors, and the op through torch.export -> ONNX -> ONNX
Runtime's MatMulNBits (the `ort` flavor's body) against the reference within the bound of its int8 activations;
the `trt` flavor refuses the node (a CPU-only family: no plugin)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_onnx import export_k3, ort_flavor_session

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.linear_q8 import linear_q8
from k3x.custom_ops.linear_q8.reference import BLOCK, ZERO, dequantize, quantize


def _weights(N: int, K: int, seed: int) -> torch.Tensor:
    return torch.randn(N, K, generator=torch.Generator().manual_seed(seed)) / K ** 0.5


@pytest.mark.parametrize("N,K", [(1, 1), (7, 32), (19, 37), (5, 100), (3, 257)])
def test_quantize_rounds_within_half_a_step(N, K):
    w = _weights(N, K, seed=N + K)
    q, s = quantize(w)
    kb = -(-K // BLOCK)
    assert q.dtype == torch.uint8 and q.shape == (N, kb, BLOCK) and s.dtype == torch.float32 and s.shape == (N, kb)
    assert int(q.min()) >= ZERO - 127 and int(q.max()) <= ZERO + 127  # symmetric: code 0 never used
    blocks = torch.nn.functional.pad(w, (0, kb * BLOCK - K)).view(N, kb, BLOCK)
    torch.testing.assert_close(s, blocks.abs().amax(-1) / 127)
    step = s.repeat_interleave(BLOCK, dim=1)[:, :K]
    assert ((dequantize(q, s, K) - w).abs() <= step / 2 * (1 + 1e-6)).all()
    assert (q.flatten(1)[:, K:] == ZERO).all()  # the last block's padding is zero


def test_a_zero_block_has_scale_zero_and_code_zero():
    w = _weights(2, 64, seed=1)
    w[1, :32] = 0
    q, s = quantize(w)
    assert s[1, 0] == 0 and (q[1, 0] == ZERO).all() and torch.isfinite(dequantize(q, s, 64)).all()


def _formula(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The spec in fp64, element by element of each block: x's block scale absmax / 127 and codes round(x / scale),
    the weight's codes q - 128 and scales s; y = sum over blocks of (x codes . w codes) * x scale * w scale."""
    K, kb = x.shape[-1], q.shape[1]
    xb = torch.nn.functional.pad(x.double(), (0, kb * BLOCK - K)).unflatten(-1, (kb, BLOCK))
    xs = xb.abs().amax(-1) / 127
    xq = torch.round(xb / torch.where(xs > 0, xs, 1)[..., None])
    dots = torch.einsum("...kb,nkb->...nk", xq, q.double() - ZERO)
    return (dots * xs[..., None, :] * s.double()).sum(-1)


@pytest.mark.parametrize("shape,N", [((1, 1), 1), ((3, 37), 19), ((2, 5, 64), 33), ((130, 100), 7)])
def test_reference_is_the_formula(shape, N):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(N))
    x[..., :3] = 0  # a block's zeros stay zero (and a 1-wide x: a zero block, scale 0)
    q, s = quantize(_weights(N, shape[-1], seed=N))
    y = linear_q8(x, q, s)
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], N)
    torch.testing.assert_close(y.double(), _formula(x, q, s), rtol=1e-5, atol=1e-5)
    fp32_weights = x.double() @ dequantize(q, s, shape[-1]).double().T  # the activations' rounding shows
    assert N == 1 or not torch.allclose(y.double(), fp32_weights, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(1, 37), (2, 1, 37), (3, 17, 37)])
def test_opcheck(shape):
    """Schema, fake impl against the op, dispatch under aot_autograd with dynamic shapes."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-2]))
    q, s = quantize(_weights(19, 37, seed=2))
    torch.library.opcheck(torch.ops.k3.linear_q8.default, (x, q, s),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


Q, S = quantize(_weights(4, 40, seed=3))  # [4, 2, 32], [4, 2]


@pytest.mark.parametrize("x,q,s,message", [
    (torch.zeros(2, 80), Q, S, r"x \(2, 80\) .* weight \(4, 2, 32\)"),  # K past the blocks
    (torch.zeros(2, 32), Q, S, r"x \(2, 32\)"),  # a whole block of padding
    (torch.zeros(2, 40), Q.to(torch.int8), S, r"weight \(4, 2, 32\) torch.int8"),
    (torch.zeros(2, 40), Q, S.double(), r"scales \(4, 2\) torch.float64"),
    (torch.zeros(2, 40), Q, S[:, :1], r"scales \(4, 1\)"),
    (torch.zeros(2, 40, dtype=torch.bfloat16), Q, S, r"x \(2, 40\) torch.bfloat16"),
])
def test_op_names_the_bad_input(x, q, s, message):
    with pytest.raises(ValueError, match=message):
        linear_q8(x, q, s)


class Tiny(torch.nn.Module):
    """Two 8-bit projections, as the int8 trunk's would be (K of 37: a padded last block)."""

    def __init__(self, K: int, H: int, N: int) -> None:
        super().__init__()
        self.up_q, self.up_s = (torch.nn.Parameter(t, requires_grad=False) for t in quantize(_weights(H, K, 4)))
        self.down_q, self.down_s = (torch.nn.Parameter(t, requires_grad=False) for t in quantize(_weights(N, H, 5)))

    def forward(self, x):
        return linear_q8(torch.relu(linear_q8(x, self.up_q, self.up_s)), self.down_q, self.down_s)


@pytest.fixture(scope="module")
def exported():
    """Tiny(37, 45, 19) through torch.export (batch and sequence dynamic) and torch.onnx, k3 nodes bare."""
    model = Tiny(37, 45, 19)
    return model, export_k3(model, torch.randn(2, 5, 37))


def test_export_to_onnx_runs_matmulnbits_on_onnx_runtime(exported):
    model, onnx_model = exported
    k3 = [n for n in onnx_model.graph if n.domain == "k3"]
    assert [n.op_type for n in k3] == ["LinearQ8"] * 2
    assert [(n.attributes["K"].value, n.attributes["N"].value, n.attributes["block_size"].value) for n in k3] == \
        [(37, 45, BLOCK), (45, 19, BLOCK)]
    proto, sess = ort_flavor_session(onnx_model)
    assert any(n.op_type == "MatMulNBits" and n.domain == "com.microsoft" for f in proto.functions for n in f.node)
    for shape in ((1, 1, 37), (3, 17, 37), (1, 130, 37)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
        (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            h = torch.relu(linear_q8(x, model.up_q, model.up_s))
            want = linear_q8(h, model.down_q, model.down_s)
        assert y.shape == (*shape[:-1], 19) and not np.allclose(y, 0)
        torch.testing.assert_close(torch.from_numpy(y), want, rtol=2e-4, atol=2e-5)  # verify's fp32 tolerance


def test_trt_flavor_refuses_the_node(exported):
    import onnx_ir as ir

    from k3x.exporter.onnx_flavors import trt_pass

    copy = ir.serde.deserialize_model(ir.serde.serialize_model(exported[1]))
    with pytest.raises(ValueError, match=r"k3::LinearQ8.*no TensorRT plugin; export the ort flavor"):
        trt_pass(copy)
