"""bench/cpu_decode.py's pieces: the dense twin holds the packed model's weights (its experts decoded, so both give
the same logits), a decode step's bytes count top_k experts in each format (MXFP4: a quarter of fp32 plus a scale
byte per 32), and the one-token MoE node runs on ONNX Runtime; bench/expert_scaling.py's: the step measure's
rounds and its check of the child's library, the node measure, a child decoding on the function body."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from k3x.bench.cpu_decode import same_weights, step_bytes
from k3x.bench.expert_scaling import moe_node
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


def test_the_step_scaling_interleaves_the_expert_counts_and_paths_and_checks_the_library():
    """Each round runs every expert count on each path in turn; a child whose session had the kernel library
    when its path says otherwise (or lacked it on the kernel path) stops the measure."""
    from k3x.bench.expert_scaling import PATHS, spread, step_scaling

    calls = []

    def run(onnx, experts, steps, env, kernels=None):
        calls.append((onnx.name, experts, steps, env))
        ms = experts / 1e3 + (0.1 if env else 0.0)  # the body path 100 ms slower
        return {"decode_s": [ms] * steps, "cpu_s": [2 * ms] * steps,
                "kernels": not env if kernels is None else kernels}

    files = {16: Path("a.onnx"), 64: Path("b.onnx")}
    got = step_scaling(files, run, {"kernel": 3, "body": 1}, rounds=2)
    assert calls == [("a.onnx", 16, 3, PATHS["kernel"]), ("a.onnx", 16, 1, PATHS["body"]),
                     ("b.onnx", 64, 3, PATHS["kernel"]), ("b.onnx", 64, 1, PATHS["body"])] * 2
    assert got["kernel"][64] == pytest.approx({"ms": 64.0, "cpu_ms": 128.0})
    assert got["body"][16] == pytest.approx({"ms": 116.0, "cpu_ms": 232.0})
    assert spread({E: f["ms"] for E, f in got["kernel"].items()}) == pytest.approx(4.0)
    with pytest.raises(RuntimeError, match="kernel path, 16 experts: the child ran without"):
        step_scaling(files, lambda *a: run(*a, kernels=False), {"kernel": 1}, rounds=1)


def test_the_node_scaling_times_each_expert_count_with_the_caches_evicted():
    from k3x.bench.expert_scaling import node_scaling

    got = node_scaling([4, 8], 2, 64, 64, 32, None, rounds=2, body_every=1, evict_bytes=1 << 20)
    assert set(got) == {"body"} and set(got["body"]) == {4, 8} and all(ms > 0 for ms in got["body"].values())


def test_a_child_decodes_on_the_function_body_when_its_environment_says_so(mini_cli_export):
    """A `--child` process (the scaling's step measure: depth 128, no floor, the expert count passed on) decodes
    through the batch interface; K3X_ORT_KERNELS=0 in its environment keeps the kernel library out."""
    from k3x.bench.cpu_decode import run_child

    E = preset("k3-mini").moe.num_experts
    got = run_child(mini_cli_export.export / "model.onnx", "k3-mini", [128], 2, 1, 0, E, {"K3X_ORT_KERNELS": "0"})
    f = got["128"]
    assert f["kernels"] is False and len(f["decode_s"]) == len(f["cpu_s"]) == 2 and f["floor_ms"] == []
    assert all(t > 0 for t in f["decode_s"])
