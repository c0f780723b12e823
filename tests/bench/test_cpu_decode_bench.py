"""bench/cpu_decode.py's pieces: the dense twin holds the packed model's weights (its experts decoded, so both give
the same logits), a decode step's bytes count top_k experts in each format (MXFP4: a quarter of fp32 plus a scale
byte per 32), and the one-token MoE node runs on ONNX Runtime."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

from k3x.bench.cpu_decode import moe_node, same_weights, step_bytes
from k3x.model import build_model, preset
from k3x.model.options import BuildOptions
from k3x.model.state import empty_state


def test_the_dense_twin_has_the_packed_weights_and_a_step_reads_top_k_experts():
    cfg = preset("k3-mini")
    packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=3)
    dense = same_weights(packed, cfg)
    ids = torch.randint(0, cfg.vocab_size, (1, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, _ = packed(ids, empty_state(cfg, 1))
        got, _ = dense(ids, empty_state(cfg, 1))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    m, layers = cfg.moe, len(cfg.moe_layers)
    expert = 3 * m.intermediate_size * cfg.expert_dim  # w1, w3, w2 elements of one expert
    extra = step_bytes(dense, cfg) - step_bytes(packed, cfg)
    assert extra == layers * m.top_k * (4 * expert - expert // 2 - expert // 32)


def test_the_moe_node_runs():
    sess = ort.InferenceSession(moe_node(16, 4, 64, 64, 32).SerializeToString(), providers=["CPUExecutionProvider"])
    (u,) = sess.run(None, {"x": np.ones((1, 64), np.float32), "z": np.ones((1, 64), np.float32)})
    assert u.shape == (1, 64) and np.isfinite(u).all()


def test_a_trunk_form_streams_its_own_bytes():
    """The bf16 trunk's step reads two bytes per projection weight, the int8 trunk's one plus a 4-byte scale per 32
    (model/trunk.py); the rest of the step is the MXFP4 form's."""
    from k3x.bench.cpu_decode import form_model
    from k3x.model.trunk import trunk_modules

    cfg = preset("k3-mini")
    packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=3)
    fp32 = step_bytes(packed, cfg)
    shapes = [packed.get_submodule(n).weight.shape for n in trunk_modules(packed)]
    weights = sum(n * k for n, k in shapes)
    assert step_bytes(form_model("mxfp4+bf16", packed, cfg), cfg) == fp32 - 2 * weights
    int8 = sum(n * (-(-k // 32)) * (32 + 4) for n, k in shapes)  # codes padded to whole blocks, one scale each
    assert step_bytes(form_model("mxfp4+int8", packed, cfg), cfg) == fp32 - 4 * weights + int8
