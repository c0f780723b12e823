"""The k3x.fused::KDAShortConv ONNX Runtime CPU kernel (custom_ops/kda_prep/ort_kernel.cc) against its function body
(custom_ops/fused.py, ONNX Runtime's own ops: what every runtime without the kernel runs). The kernel runs on a node
with no function beside it (so only the kernel can run it). Decode rows (T = 1: the conv summed in pairs, a row's
heads over tasks, the last task's fewer) and
prefill chunks (T = 2, 5, 130: more rows than a task, windows reaching into the past state or not), B > 1, conv
widths 2..4, head dims off any vector width, no batch rows, large magnitudes (the norm's squares near fp32's top);
the conv and the new state are bit-identical, q, k, v within fp32 rounding; shapes that do not fit, named in one
error."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from ort_kernel_models import session

PORTS = [("x", TensorProto.FLOAT), ("state", TensorProto.FLOAT), ("w", TensorProto.FLOAT), ("b", TensorProto.FLOAT),
         ("heads", TensorProto.INT64), ("eps", TensorProto.FLOAT)]
OUTS = ("q", "k", "v", "conv")


def _model(channels: int, body: bool, weight: np.ndarray | None = None):
    """The call alone; `weight`: w as an initializer (a constant the kernel reads once), else a graph input."""
    from k3x.custom_ops.fused import kda_short_conv_function

    node = helper.make_node("KDAShortConv", [n for n, _ in PORTS], list(OUTS), domain="k3x.fused")
    inputs = [helper.make_tensor_value_info(n, t, None) for n, t in PORTS if weight is None or n != "w"]
    init = [] if weight is None else [numpy_helper.from_array(weight, "w")]
    graph = helper.make_graph([node], "kda_conv", inputs,
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in OUTS], init)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3x.fused", 1)],
                             ir_version=10, functions=[kda_short_conv_function(20, channels)] if body else [])


def _inputs(B: int, T: int, H: int, D: int, W: int, scale: float, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    C = 3 * H * D
    return {"x": scale * rng.standard_normal((B, T, C), dtype=np.float32),
            "state": scale * rng.standard_normal((B, C, W - 1), dtype=np.float32),
            "w": rng.standard_normal((C, 1, W), dtype=np.float32), "b": rng.standard_normal(C, dtype=np.float32),
            "heads": np.array([3, H, D], np.int64), "eps": np.array(1e-6, np.float32)}


@pytest.mark.parametrize("B, T, H, D, W, scale", [
    (1, 1, 8, 128, 4, 1.0),  # a k3-bench decode step
    (3, 1, 2, 20, 4, 1.0),  # several sequences, a head dim off the vector width
    (2, 2, 3, 7, 4, 1.0),  # a window half in the past state
    (2, 5, 4, 16, 3, 1.0),
    (1, 130, 2, 24, 4, 1.0),  # more rows than a task, split over threads
    (2, 5, 1, 9, 2, 1.0),
    (2, 1, 3, 5, 3, 1.0),  # decode, an odd width: its last tap carried up a level
    (2, 1, 6, 16, 4, 1.0),  # decode over tasks of heads: 4 and 2 of each of q, k, v (and their new state)
    (0, 3, 2, 16, 4, 1.0),  # no batch rows
    (2, 3, 2, 16, 4, 1e18),  # squares near fp32's largest, still finite
])
def test_kernel_matches_its_body(kernels, B, T, H, D, W, scale):
    feeds = _inputs(B, T, H, D, W, scale, seed=B * 1000 + T * 10 + W)
    C = 3 * H * D
    got = session(_model(C, body=False), kernels).run(None, feeds)
    want = session(_model(C, body=True)).run(None, feeds)
    for name, g, w in zip(OUTS, got, want):
        assert g.shape == w.shape, name
        assert np.isfinite(g).all() and np.isfinite(w).all(), name
    q, k, v, conv = got
    assert (conv == want[3]).all()  # a copy of the window's last W-1 columns
    # v is SiLU(conv): the conv bit for bit, the sigmoid within a few ulp of ONNX Runtime's
    np.testing.assert_allclose(v, want[2], rtol=2e-6, atol=1e-30 + 1e-6 * scale)
    for g, w in ((q, want[0]), (k, want[1])):  # unit rows: fp32 rounding of the norm and the sigmoid
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=2e-6)
    if B * T:
        assert np.allclose(np.linalg.norm(q.astype(np.float64), axis=-1), 1, atol=1e-5)


def test_the_conv_is_the_body_s_conv_bit_for_bit(kernels):
    """With SiLU and the norm's rounding set aside: v's pre-activation read back through SiLU's inverse is not
    exact, so the conv is checked on its own, against the body's Conv ops on inputs where SiLU is the identity
    to the bit (x·σ(x) for large x is x)."""
    for T in (1, 4):
        feeds = _inputs(2, T, 2, 8, 4, 1.0, seed=T)
        feeds["b"] = np.full_like(feeds["b"], 1e4)  # every conv output near 1e4: σ = 1 exactly
        got = session(_model(48, body=False), kernels).run(None, feeds)[2]
        want = session(_model(48, body=True)).run(None, feeds)[2]
        assert (got == want).all()


@pytest.mark.parametrize("T", [1, 6])
def test_a_constant_weight_gives_what_a_fed_one_gives(kernels, T):
    """The kernel transposes a constant weight once, when it is made; the values are the same."""
    feeds = _inputs(2, T, 2, 8, 4, 1.0, seed=T)
    fed = session(_model(48, body=False), kernels).run(None, feeds)
    weight = feeds.pop("w")
    constant = session(_model(48, body=False, weight=weight), kernels)
    for _ in range(2):  # and again: the weight made once serves every call
        for g, w in zip(constant.run(None, feeds), fed):
            assert (g == w).all()


def test_shapes_that_do_not_fit_are_named(kernels):
    feeds = _inputs(1, 2, 2, 8, 4, 1.0, seed=0)
    feeds["heads"] = np.array([3, 2, 7], np.int64)  # 3 * 2 * 7 != 48 channels
    with pytest.raises(Exception, match=r"k3x.fused::KDAShortConv: x \[1, 2, 48\], state \[1, 48, 3\], w \[48, 1, 4\], "
                                        r"b \[48\] and heads \[3, 2, 7\]: expected"):
        session(_model(48, body=False), kernels).run(None, feeds)
    feeds = _inputs(1, 2, 2, 8, 4, 1.0, seed=0)
    feeds["state"] = feeds["state"][:, :, :2]  # a state of W-2 columns
    with pytest.raises(Exception, match=r"KDAShortConv: .*state \[1, 48, 2\]"):
        session(_model(48, body=False), kernels).run(None, feeds)
