"""The k3x.fused::LatentAttention and LatentAttentionAppend ONNX Runtime CPU kernels (custom_ops/mla_paged/
ort_kernel.cc) against their function bodies (custom_ops/fused.py, ONNX Runtime's own ops: what every runtime
without the kernel runs). The kernel runs on a node with no function beside it (so only the kernel can run it);
the append form also writes the cache, present = Concat(past, latent), bit for bit: past rows, the new rows, none
(a prefill with no past), copied by the attending tasks (one row block) or before them (several). Decode rows (one position, every head) over
short and long caches, the long ones split over key chunks whose partial sums are merged; prefill rows of several
heads and batch elements (causal); row and column counts off the kernel's blocks of 4 rows, 8 and 16 columns; an
arbitrary mask with a row that sees no key (NaN in both, as ONNX's Softmax gives) and rows that see no key of a
whole block or chunk; and shapes that do not fit, named in one error."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ort_kernel_models import session

PORTS = [("q", TensorProto.FLOAT), ("present", TensorProto.FLOAT), ("hidden", TensorProto.BOOL),
         ("scale", TensorProto.FLOAT)]
APPEND_PORTS = [PORTS[0], ("past", TensorProto.FLOAT), ("latent", TensorProto.FLOAT), *PORTS[2:]]


def _model(body: bool, append: bool = False):
    from k3x.custom_ops.fused import latent_attention_append_function, latent_attention_function

    ports, outs = (APPEND_PORTS, ["o", "present"]) if append else (PORTS, ["o"])
    op_type = "LatentAttentionAppend" if append else "LatentAttention"
    node = helper.make_node(op_type, [n for n, _ in ports], outs, domain="k3x.fused")
    graph = helper.make_graph([node], "latent", [helper.make_tensor_value_info(n, t, None) for n, t in ports],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outs])
    function = (latent_attention_append_function if append else latent_attention_function)(20)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3x.fused", 1)],
                             ir_version=10, functions=[function] if body else [])


def _inputs(B: int, H: int, T: int, S: int, L: int, mask: str, seed: int) -> dict:
    rng = np.random.default_rng(seed)
    if mask == "causal":  # position t (the last T of S) sees keys 0..S-T+t
        hidden = np.arange(S)[None, :] > np.arange(S - T, S)[:, None]
    elif mask == "front":  # every row sees the first half of the keys only
        hidden = np.broadcast_to(np.arange(S) >= S // 2, (T, S)).copy()
    else:  # arbitrary: row 0 sees nothing, row 1 only the last key, the rest a random half
        hidden = rng.random((T, S)) < 0.5
        hidden[0], hidden[1] = True, np.arange(S) != S - 1
    return {"q": rng.standard_normal((B, H * T, L), dtype=np.float32),
            "present": rng.standard_normal((B, S, L), dtype=np.float32), "hidden": hidden,
            "scale": np.array(0.4, np.float32)}


CASES = [
    (1, 8, 1, 1, 24, "causal"),  # the first decode step: one key
    (1, 8, 1, 100, 24, "causal"),  # one key chunk (fewer than two of 64 keys)
    (1, 8, 1, 129, 288, "causal"),  # k3-bench's decode at 128 positions: two chunks of 65 keys, merged
    (1, 8, 1, 300, 576, "causal"),  # a decode step of kimi-linear-mid's MLA (L = 512 + 64), four key chunks
    (1, 8, 1, 1100, 26, "causal"),  # over eight key chunks, merged; L past a multiple of 8 and of 16
    (2, 3, 1, 1700, 20, "causal"),  # 3 rows per batch element (one short row block), eight chunks each
    (2, 3, 7, 12, 26, "causal"),  # a prefill chunk after a 5-key past: 21 rows, blocks across heads
    (1, 2, 5, 140, 16, "arbitrary"),  # rows that see no key of a whole key block (128), one that sees none
    (1, 2, 3, 1300, 8, "arbitrary"),  # the same over key chunks: a chunk a row sees nothing of
]


@pytest.mark.parametrize("B,H,T,S,L,mask", CASES)
def test_latent_attention_kernel_matches_the_body(kernels, B, H, T, S, L, mask):
    x = _inputs(B, H, T, S, L, mask, seed=B * 1000 + S + L)
    (want,) = session(_model(body=True)).run(None, x)
    (got,) = session(_model(body=False), kernels).run(None, x)
    assert got.shape == want.shape == (B, H * T, L)
    # fp32 dot products over L in other orders, weighed through a sharp softmax: ~1e-5 of outputs of size ~1
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, equal_nan=True)
    if mask == "arbitrary":  # row 0 of every head sees no key: NaN in both, the rest finite
        assert np.isnan(got[:, ::T]).all() and np.isfinite(np.delete(got, np.s_[::T], axis=1)).all()


@pytest.mark.parametrize("B,H,T,S,L,mask", CASES + [(1, 8, 1, 2049, 288, "causal"),  # k3-bench at 2,048
                                                    (2, 3, 9, 9, 24, "causal"),  # a prefill, no past
                                                    (1, 2, 3, 700, 8, "front")])  # chunks no row sees
def test_latent_attention_append_kernel_writes_the_cache_and_matches_the_body(kernels, B, H, T, S, L, mask):
    x = _inputs(B, H, T, S, L, mask, seed=B * 1000 + S + L + 1)
    present = x.pop("present")
    x["past"], x["latent"] = present[:, :S - T], present[:, S - T:]  # the step's T new rows after the past
    want_o, want_present = session(_model(body=True, append=True)).run(None, x)
    got_o, got_present = session(_model(body=False, append=True), kernels).run(None, x)
    assert got_present.shape == want_present.shape == (B, S, L) and (got_present == present).all()
    assert (want_present == present).all()
    assert got_o.shape == want_o.shape == (B, H * T, L)
    np.testing.assert_allclose(got_o, want_o, rtol=1e-5, atol=1e-5, equal_nan=True)
    (plain,) = session(_model(body=False), kernels).run(None, _inputs(B, H, T, S, L, mask, seed=B * 1000 + S + L + 1))
    np.testing.assert_array_equal(got_o, plain)  # the same loops over the same keys as LatentAttention's


@pytest.mark.parametrize("change", [{"hidden": np.zeros((3, 5), bool)}, {"present": np.zeros((1, 4, 7), np.float32)},
                                    {"q": np.zeros((1, 5, 8), np.float32)}])
def test_latent_attention_kernel_names_the_bad_input(kernels, change):
    feeds = _inputs(1, 2, 2, 4, 8, "causal", seed=0) | change
    with pytest.raises(Exception, match=r"k3x.fused::LatentAttention: q \[1, \d, 8\], present \[1, 4, \d\], hidden "
                                        r"\[\d, \d\] and scale \[\]: expected \[B, H T, L\], \[B, S, L\], \[T, S\]"):
        session(_model(body=False), kernels).run(None, feeds)


@pytest.mark.parametrize("change", [{"latent": np.zeros((1, 2, 7), np.float32)},
                                    {"past": np.zeros((2, 2, 8), np.float32)}, {"hidden": np.zeros((2, 5), bool)}])
def test_latent_attention_append_kernel_names_the_bad_input(kernels, change):
    x = _inputs(1, 2, 2, 4, 8, "causal", seed=0)
    feeds = {"q": x["q"], "past": x["present"][:, :2], "latent": x["present"][:, 2:], "hidden": x["hidden"],
             "scale": x["scale"]} | change
    with pytest.raises(Exception, match=r"k3x.fused::LatentAttentionAppend: q \[1, 4, 8\], past \[\d, 2, 8\], "
                                        r"latent \[1, 2, \d\], hidden \[2, \d\] and scale \[\]: expected "
                                        r"\[B, H T, L\], \[B, P, L\], \[B, S - P, L\], \[T, S\]"):
        session(_model(body=False, append=True), kernels).run(None, feeds)
