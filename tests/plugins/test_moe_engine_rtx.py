"""A one-node `k3::MoE` graph builds into a TensorRT-RTX engine on CPU with the AOT path: the parser finds the
IPluginV3 creator, the shape function, format negotiation, `configure_plugin` (8 cubins compiled for sm_89) and
`get_workspace_size` (evaluated at the profile's max N) all run for real; the engine carries the cubins.
Runs in a subprocess with the `libtensorrt_rtx.so` link on LD_LIBRARY_PATH (scripts/setup_trt_rtx.sh).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.trt, pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_rtx_bindings") is None and importlib.util.find_spec("tensorrt_rtx") is None,
    reason="TensorRT-RTX not installed (pip install -e .[trt-rtx]; scripts/setup_trt_rtx.sh)")]

ROOT = Path(__file__).resolve().parents[2]
N_MAX, d, L, E, I, K = 64, 64, 32, 8, 48, 2


def _moe_model(path: Path) -> None:
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    weights = {"gate_weight": rng.standard_normal((E, d)), "gate_bias": rng.standard_normal(E) * 0.1,
               "w1": rng.standard_normal((E, I, L)), "w3": rng.standard_normal((E, I, L)),
               "w2": rng.standard_normal((E, L, I))}
    inits = [numpy_helper.from_array(v.astype(np.float32), k) for k, v in weights.items()]
    inits.append(numpy_helper.from_array(np.zeros(1, np.int32), "expert_offset"))  # one GPU: every expert local
    node = helper.make_node("MoE", ["x", "z", *weights, "expert_offset"], ["u"], domain="k3", plugin_namespace="k3", top_k=K,
                            routed_scaling_factor=2.5, renormalize=1, activation="situ", situ_beta=4.0,
                            situ_linear_beta=25.0, num_experts=E, hidden_size=d, expert_dim=L, intermediate_size=I)
    graph = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", T.FLOAT16, ["batch", d]),
                                              helper.make_tensor_value_info("z", T.FLOAT16, ["batch", L])],
                              [helper.make_tensor_value_info("u", T.FLOAT16, None)], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)])
    path.write_bytes(model.SerializeToString())


def test_moe_node_builds_aot(tmp_path):
    import torch

    from k3x.folder.artifacts import init_manifest, update_manifest
    from k3x.model.config import preset

    init_manifest(tmp_path, preset("k3-mini"), dtype=torch.float32, weights=False, op_counts={})
    _moe_model(tmp_path / "model.trt.onnx")
    update_manifest(tmp_path, "onnx", ["model.trt.onnx"])  # build-engine reads only hash-checked input
    link = subprocess.run([str(ROOT / "scripts/setup_trt_rtx.sh"), "--print-only", sys.prefix], check=True,
                          capture_output=True, text=True).stdout.strip()
    env = os.environ | {"LD_LIBRARY_PATH": f"{link}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(tmp_path),
                        "--runtime", "trt-rtx", "--sm", "89", "--opt", "batch=4", "--max", f"batch={N_MAX}"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "k3::MoE: AOT path (sm_89 cubins)" in r.stderr
    assert json.loads((tmp_path / "model.engine.json").read_text())["plugin_paths"]["MoE"] == "aot"
    blob = (tmp_path / "model.engine").read_bytes()
    for needle in (b"k3_kernels", b"k3_config", b"_router_kernel", b"_topk_kernel", b"_moe_align_count_kernel",
                   b"_moe_align_scan_kernel", b"_moe_align_scatter_kernel", b"_moe_gemm1_kernel",
                   b"_moe_gemm2_kernel", b"_moe_sum_kernel", b'"fp16"'):
        assert needle in blob, needle
