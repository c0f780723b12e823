"""Engine builds through TensorRT-RTX on CPU: ONNX parsing, plugin creators, field passing, shape functions,
format negotiation and profiles run for real. Each build runs in a subprocess whose LD_LIBRARY_PATH holds the
`libtensorrt_rtx.so` symlink (scripts/setup_trt_rtx.sh): the loader reads it only at process start.
Engines are not executed (no GPU); the blob is searched for the plugin layers, their fields and cubins.
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


def _rtx_env() -> dict:
    link = subprocess.run([str(ROOT / "scripts/setup_trt_rtx.sh"), "--print-only", sys.prefix], check=True,
                          capture_output=True, text=True).stdout.strip()
    return os.environ | {"LD_LIBRARY_PATH": f"{link}:{os.environ.get('LD_LIBRARY_PATH', '')}"}


def _build(export_dir: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(export_dir),
           "--runtime", "trt-rtx", "--sm", "89", *args]
    return subprocess.run(cmd, env=_rtx_env(), capture_output=True, text=True, timeout=600)


@pytest.fixture(scope="module")
def k3_mini_export(tmp_path_factory) -> Path:
    import torch

    from k3x.exporter.onnx import OnnxOptions, export_onnx
    from k3x.exporter.trace import op_counts, trace
    from k3x.folder.artifacts import init_manifest
    from k3x.model import K3ForCausalLM
    from k3x.model.config import preset

    out = tmp_path_factory.mktemp("k3-mini")
    cfg = preset("k3-mini")
    model = K3ForCausalLM(cfg).eval()
    ep = trace(model)
    init_manifest(out, cfg, dtype=torch.float32, weights=True, op_counts=op_counts(ep))
    export_onnx(ep, cfg, out, OnnxOptions(flavors=("trt",), external_data=True))  # --strip-weights refits from it
    _list_onnx(out)
    return out


def _list_onnx(folder: Path) -> None:
    """Record the folder's ONNX files as its `onnx` artifact: build-engine reads only hash-checked input."""
    from k3x.folder.artifacts import update_manifest

    update_manifest(folder, "onnx", sorted(p.name for p in folder.iterdir() if p.name.startswith("model.")))


def test_k3_mini_engine_builds_with_plugins(k3_mini_export):
    import onnx

    onnx_file = onnx.load(str(k3_mini_export / "model.trt.onnx"), load_external_data=False)
    # the parser takes the layer functions and, nested in them, the k3x.fused calls (exporter/onnx_rewrites.py):
    # SiTU-GLU, KDA's short conv and the MLA attention over the growing latent cache, which writes the cache
    assert {f.domain for f in onnx_file.functions} == {"k3x.layers", "k3x.fused"}
    assert {"SiTUGLU", "KDAShortConv", "LatentAttentionAppend"} <= {f.name for f in onnx_file.functions}
    r = _build(k3_mini_export, "--max", "batch=4", "--max", "seq=64", "--opt", "seq=16", "--max", "past_seq=64",
               "--opt", "past_seq=16")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "k3::MoE: AOT path (sm_89 cubins)" in r.stderr and "k3::KDA: AOT path (sm_89 cubins)" in r.stderr
    blob = (k3_mini_export / "model.engine").read_bytes()
    assert len(blob) > 100_000
    for needle in (b"KDA", b"AttnRes", b"MoE", b"scale", b"num_heads", b"activation", b"situ", b"k3_kernels",
                   b"_kda_recurrent_kernel", b"_kda_intra_kernel", b"_kda_state_kernel", b"_attn_res_kernel",
                   b"_router_kernel", b"_moe_align_scan_kernel", b"_moe_gemm1_kernel", b"_moe_sum_kernel"):
        assert needle in blob, needle  # plugin layers, their ONNX fields, and the embedded cubins
    manifest = json.loads((k3_mini_export / "manifest.json").read_text())
    entry = manifest["artifacts"]["trt"]
    assert entry["sm"] == 89 and entry["runtime"] == "trt-rtx" and entry["tensorrt_version"].startswith("1.7")
    assert entry["plugin_paths"] == {"KDA": "aot", "AttnRes": "aot", "MoE": "aot", "MoEMXFP4": "aot", "MLAPaged": "aot",
                                     "KDAPacked": "aot", "KDADecode": "aot",
                                     "KDAPrep": "aot"}
    assert json.loads((k3_mini_export / "model.engine.json").read_text())["plugin_paths"]["MoE"] == "aot"
    assert entry["profile"]["batch"] == {"name": "batch", "min": 1, "opt": 1, "max": 4}
    assert entry["input_shapes"]["input_ids"] == [[1, 1], [1, 16], [4, 64]]
    assert {f["path"] for f in entry["files"]} == {"model.engine", "model.engine.json", "timing.cache"}


def _kda_model(path: Path, *, g_type: int, v_heads: int) -> None:
    """A one-node k3::KDA graph (dims named like the real export), written as model.trt.onnx."""
    from onnx import TensorProto as T
    from onnx import helper

    def inp(name, t, shape):
        return helper.make_tensor_value_info(name, t, shape)

    H, K = 2, 16
    node = helper.make_node("KDA", ["q", "k", "v", "g", "beta", "s"], ["o", "s_out"], domain="k3",
                            plugin_namespace="k3", scale=0.25, num_heads=H, head_dim=K, value_dim=K,
                            gate_lower_bound=-5.0)
    graph = helper.make_graph([node], "kda", [
        inp("q", T.FLOAT, ["batch", "seq", H, K]), inp("k", T.FLOAT, ["batch", "seq", H, K]),
        inp("v", T.FLOAT, ["batch", "seq", v_heads, K]), inp("g", g_type, ["batch", "seq", H, K]),
        inp("beta", T.FLOAT, ["batch", "seq", H]), inp("s", T.FLOAT, ["batch", H, K, K])],
        [inp("o", T.FLOAT, None), inp("s_out", T.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)])
    path.write_bytes(model.SerializeToString())
    _list_onnx(path.parent)


@pytest.fixture()
def bare_export(tmp_path) -> Path:
    import torch

    from k3x.folder.artifacts import init_manifest
    from k3x.model.config import preset

    init_manifest(tmp_path, preset("k3-mini"), dtype=torch.float32, weights=False, op_counts={})
    return tmp_path


def test_unsupported_format_is_reported(bare_export):
    from onnx import TensorProto

    _kda_model(bare_export / "model.trt.onnx", g_type=TensorProto.FLOAT16, v_heads=2)
    r = _build(bare_export, "--max", "seq=32", "--opt", "seq=8")
    assert r.returncode == 1 and not (bare_export / "model.engine").exists()
    assert "engine build failed" in r.stderr and "k3::KDA formats:" in r.stderr and "g: fp32" in r.stderr


def test_shape_function_error_is_reported(bare_export):
    from onnx import TensorProto

    _kda_model(bare_export / "model.trt.onnx", g_type=TensorProto.FLOAT, v_heads=3)
    r = _build(bare_export, "--max", "seq=32", "--opt", "seq=8")
    assert r.returncode == 1 and not (bare_export / "model.engine").exists()
    assert "k3::KDA get_output_shapes" in r.stderr and "v[:3] has shape" in r.stderr, r.stderr[-3000:]


def test_good_kda_node_builds_and_missing_runtime_is_named(bare_export):
    from onnx import TensorProto

    _kda_model(bare_export / "model.trt.onnx", g_type=TensorProto.FLOAT, v_heads=2)
    r = _build(bare_export, "--max", "seq=32", "--opt", "seq=8", "--max", "batch=2")
    assert r.returncode == 0, r.stderr[-3000:]
    # the success line says which GPUs the engine serves; nothing was there to replace
    assert "serves sm_89 GPUs (Ada: RTX 40xx, L4, L40S) with TensorRT-RTX 1.7" in r.stdout, r.stdout
    assert "not H100 / H200" in r.stdout and "replaced in" not in r.stdout
    r = _build(bare_export, "--max", "seq=32", "--opt", "seq=8", "--max", "batch=2")  # a rebuild says what it replaced
    assert r.returncode == 0 and f"replaced in {bare_export}: model.engine, model.engine.json, timing.cache" in r.stdout
    r = subprocess.run([sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(bare_export),
                        "--runtime", "trt"], capture_output=True, text=True, timeout=120)
    if importlib.util.find_spec("tensorrt") is None:
        assert r.returncode == 1 and "install tensorrt-cu13" in r.stderr


def test_stripped_engine_names_every_weight_source(k3_mini_export):
    """Every initializer of the trt ONNX (each weight TensorRT can ask the refitter for) has a recorded source
    whose bytes, read back, are the initializer's own (checked against onnx's own loading) and hash/size match."""
    import onnx
    from onnx import numpy_helper

    from k3x.exporter.engine_weights import inline_weights, read_weight, weight_sources

    onnx_path = k3_mini_export / "model.trt.onnx"
    sources = weight_sources(onnx_path)
    model = onnx.load(str(onnx_path))  # with its external data: the reference bytes
    assert set(sources) == {i.name for i in model.graph.initializer} and len(sources) > 50
    assert {s["file"] for s in sources.values()} == {"model.onnx.data", "model.trt.onnx"}
    inline = inline_weights(onnx_path)
    for init in model.graph.initializer:
        src = sources[init.name]
        want = numpy_helper.to_array(init).tobytes()
        assert read_weight(k3_mini_export, init.name, src, inline) == want and src["length"] == len(want)
        assert src["shape"] == list(init.dims)
    big = max(sources, key=lambda n: sources[n]["length"])
    assert sources[big]["file"] == "model.onnx.data" and sources[big]["length"] > 100_000


def test_changed_weight_source_is_refused(k3_mini_export, tmp_path):
    import shutil

    from k3x.exporter.engine_weights import WeightSourceError, read_weight, weight_sources

    sources = weight_sources(k3_mini_export / "model.trt.onnx")
    name, src = next((n, s) for n, s in sources.items() if not s.get("inline"))
    shutil.copy(k3_mini_export / src["file"], tmp_path / src["file"])
    with open(tmp_path / src["file"], "r+b") as f:
        f.seek(src["offset"] + 3)
        b = f.read(1)
        f.seek(src["offset"] + 3)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(WeightSourceError, match=f"weight {name!r} no longer matches"):
        read_weight(tmp_path, name, src)


def test_strip_weights_build(k3_mini_export):
    """--strip-weights: with a GPU, a plan without its weights whose metadata names every weight's source;
    TensorRT-RTX on a CPU cannot compile a refittable plan (Myelin needs CUDA): one clear error, nothing written."""
    import torch

    before = {p.name: p.stat().st_mtime_ns for p in k3_mini_export.iterdir()}
    r = _build(k3_mini_export, "--strip-weights", "--max", "batch=2", "--max", "seq=32", "--opt", "seq=8",
               "--max", "past_seq=32", "--opt", "past_seq=8")
    if not torch.cuda.is_available():
        assert r.returncode == 1 and "TensorRT-RTX compiles refittable plans with CUDA" in r.stderr, r.stderr[-2000:]
        assert {p.name: p.stat().st_mtime_ns for p in k3_mini_export.iterdir()} == before
        return
    assert r.returncode == 0, r.stderr[-3000:]
    meta = json.loads((k3_mini_export / "model.engine.json").read_text())
    data = (k3_mini_export / "model.onnx.data").stat().st_size
    assert meta["stripped"] and meta["bytes"] <= 0.05 * data and "weight-stripped" in r.stdout
    manifest = json.loads((k3_mini_export / "manifest.json").read_text())
    assert manifest["artifacts"]["trt"]["weights"] == meta["weights"]


def test_inline_weights_are_refused_for_stripping(tmp_path):
    import numpy as np
    from onnx import TensorProto as T
    from onnx import helper, numpy_helper, save

    from k3x.exporter.engine_weights import WeightSourceError, weight_sources

    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 4])],
                          [helper.make_tensor_value_info("y", T.FLOAT, None)], [w])
    save(helper.make_model(g), str(tmp_path / "model.trt.onnx"))
    with pytest.raises(WeightSourceError, match="every weight is inside the graph"):
        weight_sources(tmp_path / "model.trt.onnx")


def test_trt_rtx_targets_are_the_installed_librarys():
    """exporter/engine_targets.TRT_RTX_SMS (checked before any import) is TensorRT-RTX's ComputeCapability list."""
    from k3x.exporter.engine_targets import TRT_RTX_SMS

    code = ("import tensorrt_rtx_bindings as t; "
            "print(sorted(int(n[2:]) for n in t.ComputeCapability.__members__ if n[2:].isdigit()))")
    r = subprocess.run([sys.executable, "-c", code], env=_rtx_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout) == sorted(TRT_RTX_SMS)
