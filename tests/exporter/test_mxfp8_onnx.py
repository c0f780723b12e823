"""MXFP8 activations in the ONNX Runtime body (custom_ops/moe_mxfp4/onnx.mxfp8): the standard-op rounding equals
the torch quantizer bit for bit on the hard cases (every E4M3 value, tie and neighbour at several scales, amax at
and below powers of two across fp32, saturation, zero and NaN/Inf blocks), and a whole k3::MoEMXFP4 node with
activations="mxfp8" run by ONNX Runtime's CPU provider equals the reference within the fp32 tolerance (save tokens
whose GLU output lies at an MXFP8 rounding boundary, `moe_models.ambiguous_tokens`)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize
from k3x.custom_ops.moe_mxfp4.onnx import mxfp8
from k3x.plan.onnx_node import Body
from moe_models import ambiguous_tokens
from mxfp8_cases import scale_blocks

ort = pytest.importorskip("onnxruntime")


def _hard_rows() -> torch.Tensor:
    rows = [scale_blocks(s) for s in (-127, -126, -60, -9, 0, 7, 119)]
    p2 = []
    for k in range(-149, 128, 3):
        p = np.float32(2.0 ** k)
        for amax in (p, np.nextafter(p, np.float32(0))):
            row = (np.random.default_rng(k + 300).uniform(-1, 1, 32) * amax).astype(np.float32)
            row[k % 32] = amax
            p2.append(row)
    big = np.finfo(np.float32).max
    extra = [np.zeros(32, np.float32), np.full(32, -0.0, np.float32), np.full(32, big, np.float32),
             (np.linspace(-1, 1, 32) * float(big)).astype(np.float32)]
    x = np.concatenate(rows + [np.stack(p2 + extra)]).astype(np.float32)
    x = np.concatenate([x, np.zeros((-len(x) % 4, 32), np.float32)]).reshape(-1, 128)
    x[0, 5], x[1, 70] = np.nan, -np.inf
    return torch.from_numpy(x)


def test_body_mxfp8_is_the_quantizer_bit_for_bit():
    x = _hard_rows()
    b = Body("MXFP8")
    out = mxfp8(b, "x")
    graph = helper.make_graph(
        b.nodes + [helper.make_node("Identity", [out], ["y"])], "mxfp8",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (y,) = sess.run(None, {"x": x.numpy()})
    want = fake_quantize(x).numpy()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(y), nan) and nan.sum() == 64  # the two NaN / Inf blocks, nothing else
    bad = np.argwhere((y.view(np.uint32) != want.view(np.uint32)) & ~nan)
    assert not len(bad), [(tuple(i), float(x[tuple(i)]), float(y[tuple(i)]), float(want[tuple(i)])) for i in bad[:5]]


def _moe_session(w: dict[str, torch.Tensor], top_k: int, activations: str):
    """One k3::MoEMXFP4 node (packed experts as uint8 initializers) over the `ort` pass; x, z fp32 inputs."""
    from moe_models import mxfp4_model

    return ort.InferenceSession(mxfp4_model(w, top_k, activations).SerializeToString(),
                                providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("activations", ["bf16", "mxfp8"])
def test_moe_mxfp4_node_runs_the_activation_format_in_onnxruntime(activations):
    from k3x.custom_ops.moe_mxfp4.reference import moe
    from tolerances import assert_close

    E, k, d, L, I = 6, 2, 24, 64, 32  # I: few h elements per token, few near a boundary
    g = torch.Generator().manual_seed(5)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    sc = lambda *s: torch.randint(118, 126, s, generator=g, dtype=torch.uint8)  # noqa: E731
    w = {"gate_weight": torch.randn(E, d, generator=g) * d ** -0.5, "gate_bias": torch.randn(E, generator=g) * 0.1,
         "w1": u8(E, I, L // 2), "w3": u8(E, I, L // 2), "w2": u8(E, L, I // 2), "w1_scale": sc(E, I, L // 32),
         "w3_scale": sc(E, I, L // 32), "w2_scale": sc(E, L, I // 32)}
    sess = _moe_session(w, k, activations)
    for N in (1, 19, 40):
        x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g) * 4
        (u,) = sess.run(None, {"x": x.numpy(), "z": z.numpy()})
        u = torch.from_numpy(u)
        want = moe(x, z, *w.values(), k, 1.5, True, "situ", 4.0, 25.0, activations=activations)
        keep = ~ambiguous_tokens(x, z, w, k) if activations == "mxfp8" else torch.ones(N, dtype=torch.bool)
        assert keep.float().mean() >= 0.8, f"{int((~keep).sum())} of {N} tokens near a rounding boundary"
        assert_close(u[keep], want[keep], torch.float32, f"{activations} N={N}")
        other = moe(x, z, *w.values(), k, 1.5, True, "situ", 4.0, 25.0,
                    activations="bf16" if activations == "mxfp8" else "mxfp8")
        assert not torch.allclose(u, other, atol=1e-3)  # the format is honoured
