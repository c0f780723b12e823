"""MXFP4 experts end to end: a packed k3-mini checkpoint exports to pt2 and both ONNX flavors with the experts
as uint8 nibbles + E8M0 scales (artifact weight bytes within 5% of the checkpoint's tensor bytes), the `ort`
body decodes exactly (every code, every scale byte) and the pt2 / ONNX Runtime programs match eager."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from scratch_dirs import scratch_dir
from onnx import TensorProto, helper

from k3x.custom_ops.moe_mxfp4.codec import dequantize
from k3x.custom_ops.moe_mxfp4.onnx import decode
from k3x.plan.onnx_node import Body
from k3x.exporter.onnx_functions import inline_layers

ort = pytest.importorskip("onnxruntime")


def test_body_decode_is_the_codec_bit_for_bit():
    """Every byte (both nibbles: all 16 codes) against every E8M0 byte 0..254 through the body's decode nodes."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1)  # [255, 256]: row r all bytes
    scale = torch.arange(255, dtype=torch.uint8)[:, None].repeat(1, 16)  # [255, 16]: row r scale byte r
    b = Body("Decode")
    out = decode(b, "packed", "scale")
    graph = helper.make_graph(
        b.nodes + [helper.make_node("Identity", [out], ["w"])], "decode",
        [helper.make_tensor_value_info("packed", TensorProto.UINT8, [255, 256]),
         helper.make_tensor_value_info("scale", TensorProto.UINT8, [255, 16])],
        [helper.make_tensor_value_info("w", TensorProto.FLOAT, [255, 512])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (w,) = sess.run(None, {"packed": packed.numpy(), "scale": scale.numpy()})
    want = dequantize(packed, scale).numpy()
    assert np.array_equal(w.view(np.uint32), want.view(np.uint32))  # bit patterns: signed zeros, subnormals, inf


@functools.lru_cache(maxsize=1)
def packed_exports() -> tuple[Path, Path, Path]:
    """(pt2 export, ONNX export, checkpoint): ONNX alone from a checkpoint is the streamed path."""
    from k3x.checkpoint.save import save_checkpoint
    from k3x.exporter.options import ExportOptions, Target
    from k3x.exporter.pipeline import export
    from k3x.model import build_model, preset

    root = scratch_dir("k3x-test-mxfp4-")
    ckpt = save_checkpoint(build_model(preset("k3-mini"), seed=2), root / "ckpt")  # MXFP4 experts
    export(ExportOptions((Target.PT2,), root / "pt2", checkpoint=ckpt))
    export(ExportOptions((Target.ONNX,), root / "onnx", checkpoint=ckpt))
    return root / "pt2", root / "onnx", ckpt


def _tensor_bytes(ckpt: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            total += sum(h.get_tensor(k).nbytes for k in h.keys())
    return total


@pytest.mark.parametrize("name, byte_type", [("model.onnx", TensorProto.UINT8), ("model.trt.onnx", TensorProto.INT8)])
def test_onnx_flavors_carry_packed_experts(name, byte_type):
    _, folder, ckpt = packed_exports()
    model = inline_layers(onnx.load(str(folder / name)))  # each k3 node wired to its layer's initializers
    inits = {i.name: i for i in model.graph.initializer}
    nodes = [n for n in model.graph.node if n.domain == "k3" and n.op_type == "MoEMXFP4"]
    assert len(nodes) == 5  # one node per MoE layer of k3-mini
    for n in nodes:
        types = [inits[i].data_type for i in n.input[4:10]]
        assert types == [byte_type] * 6, n.name  # w1, w3, w2 packed + three scale tensors (TensorRT: int8)
    assert not any(n.op_type == "MoE" for n in model.graph.node)
    weights = sum(len(i.raw_data) or onnx.numpy_helper.to_array(i).nbytes for i in inits.values())
    stored = _tensor_bytes(ckpt)
    assert abs(weights - stored) <= 0.05 * stored, (weights, stored)


def test_pt2_carries_packed_experts_and_the_checkpoint_bytes():
    folder, _, ckpt = packed_exports()
    ep = torch.export.load(str(folder / "model.pt2"))
    sd = ep.state_dict
    experts = {k: v for k, v in sd.items() if ".experts." in k}
    assert experts and all(v.dtype == torch.uint8 for v in experts.values())
    held = sum(v.nbytes for v in sd.values()) + sum(v.nbytes for v in ep.constants.values()
                                                     if isinstance(v, torch.Tensor))
    stored = _tensor_bytes(ckpt)
    assert abs(held - stored) <= 0.05 * stored, (held, stored)
    counts = json.loads((folder / "manifest.json").read_text())["op_counts"]
    assert counts.get("k3::moe_mxfp4") == 5 and not counts.get("k3::moe")


def test_pt2_and_ort_match_packed_eager():
    from k3x.runtime.runners import RunnerOptions, make_runner
    from k3x.runtime.verify import run_parity

    pt2, onnx_folder, ckpt = packed_exports()
    eager = make_runner("eager", pt2)
    assert eager.module.build.expert_format == "mxfp4"
    assert eager.module.model.layers[1].block_sparse_moe.experts.w1.dtype == torch.uint8
    ort_runner = make_runner("ort", onnx_folder, RunnerOptions(provider="cpu"))
    report = run_parity(eager, [make_runner("pt2", pt2), ort_runner], eager.module.cfg, steps=2, prompt_len=5)
    assert report.ok, report.table()
    assert {s.backend for s in report.steps} == {"pt2", "ort"}


def test_ort_on_the_mxfp4_kernel_matches_packed_eager(kernels, tmp_path):
    """The packed export on the kernel library: every MoEMXFP4 node ran on the kernel (none inlined as its body),
    and the logits and state match eager's as the function bodies' do."""
    from k3x.runtime.ort_runner import OrtRunner
    from k3x.runtime.runners import make_runner
    from k3x.runtime.verify import run_parity

    pt2, onnx_folder, _ = packed_exports()
    eager = make_runner("eager", pt2)
    runner = OrtRunner(onnx_folder / "model.onnx", provider="cpu", profile=str(tmp_path / "mxfp4"))
    report = run_parity(eager, [runner], eager.module.cfg, steps=2, prompt_len=5)
    assert report.ok, report.table()
    events = [e for e in json.loads(Path(runner.session.end_profiling()).read_text()) if e.get("cat") == "Node"]
    ops = {e["args"]["op_name"] for e in events}
    assert "MoEMXFP4" in ops and not any("MoEMXFP4/" in e["name"] for e in events), ops


@pytest.mark.trt
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None
                    and importlib.util.find_spec("tensorrt_rtx") is None, reason="TensorRT-RTX not installed")
def test_trt_rtx_engine_takes_the_packed_plugin_ports(tmp_path):
    """TensorRT-RTX builds on CPU: the MoEMXFP4 plugin accepts the int8 byte ports (no UINT8 plugin formats)."""
    folder = shutil.copytree(packed_exports()[1], tmp_path / "export")
    root = Path(__file__).resolve().parents[2]
    link = subprocess.run([str(root / "scripts/setup_trt_rtx.sh"), "--print-only", sys.prefix], check=True,
                          capture_output=True, text=True).stdout.strip()
    env = os.environ | {"LD_LIBRARY_PATH": f"{link}:{os.environ.get('LD_LIBRARY_PATH', '')}"}
    r = subprocess.run([sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(folder),
                        "--runtime", "trt-rtx", "--sm", "89", "--max", "batch=2", "--max", "seq=16", "--opt", "seq=4",
                        "--max", "past_seq=32", "--opt", "past_seq=8"], env=env, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "k3::MoEMXFP4: AOT path (sm_89 cubins)" in r.stderr
    meta = json.loads((folder / "model.engine.json").read_text())
    assert "MoEMXFP4" in json.dumps(meta)


def test_onnx_only_export_streams_the_weights():
    """ONNX alone from a checkpoint never loads the model: traced on meta, every weight streamed into
    model.onnx.data (a loaded k3-mini export would keep them inline: it is far under 2 GB)."""
    _, folder, ckpt = packed_exports()
    model = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    external = [i for i in model.graph.initializer if i.data_location == TensorProto.EXTERNAL]
    assert len(external) > 100 and all(e.external_data[0].value == "model.onnx.data" for e in external)
    data = folder / "model.onnx.data"
    assert abs(data.stat().st_size - _tensor_bytes(ckpt)) <= 0.05 * _tensor_bytes(ckpt) + 64 * len(external)
