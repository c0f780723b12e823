"""bench/linear_bf16.py's pieces: the trunk shapes are the presets' projections (nn.Linear's [out, in]), and the
benchmark's model (copies of the node, distinct bf16 weights) runs on ONNX Runtime's function body to x @ W^T."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
from onnx import numpy_helper

from k3x.bench.linear_bf16 import model, trunk_shapes


def test_trunk_shapes_are_the_presets_projections():
    bench, mid = trunk_shapes("k3-bench"), trunk_shapes("kimi-linear-mid")
    assert bench["lm_head"] == mid["lm_head"] == (32768, 1024)
    assert bench["dense_up"] == (4096, 1024) and bench["dense_down"] == (1024, 4096)
    assert bench["mla_kv_b"] == (8 * (64 + 64), 256) and mid["mla_kv_b"] == (8 * (128 + 128), 512)
    assert bench["mla_q_b"] == (8 * (64 + 32), 384) and "mla_q_b" not in mid  # Kimi Linear: no q LoRA


def test_the_benchmark_model_is_copies_of_the_linear():
    proto = model(5, 20, copies=3, seed=0)
    sess = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    x = np.random.default_rng(1).standard_normal((2, 20), np.float32)
    ys = sess.run(None, {"x": x})
    weights = [numpy_helper.to_array(t).astype(np.float32) for t in proto.graph.initializer]
    assert len(ys) == len(weights) == 3 and not np.array_equal(weights[0], weights[1])
    for y, w in zip(ys, weights):
        np.testing.assert_allclose(y, x @ w.T, rtol=1e-5, atol=1e-5)
