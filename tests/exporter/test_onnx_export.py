"""ONNX export of k3-mini: checker, GenAI-style I/O names and dim_params, k3 nodes and attributes, flavors,
byte-identical re-export, weightless (meta-device) export, shared external data."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
import torch

from k3x.custom_ops.registry import families
from k3x.exporter.onnx import FLAVOR_FILES, OnnxOptions, export_onnx
from k3x.exporter.onnx_functions import inline_layers
from k3x.model import build_model, empty_state, preset, state_specs
from onnx_mini_folder import export_folder, mini_export

NODE_SPECS = {f.onnx.NODE.op_type: f.onnx.NODE for f in families()}

ort = pytest.importorskip("onnxruntime")
CFG = preset("k3-mini")


def dims(vi: onnx.ValueInfoProto) -> list:
    return [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]


def test_io_names_dims_and_k3_nodes():
    m = mini_export()
    manifest = json.loads((m.folder / "manifest.json").read_text())
    assert manifest["artifacts"]["onnx"]["flavors"] == {"ort": "model.onnx", "trt": "model.trt.onnx"}
    specs = state_specs(CFG)
    for flavor, name in FLAVOR_FILES.items():
        path = m.folder / name
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path))
        ins = {i.name: dims(i) for i in model.graph.input}
        outs = {o.name: dims(o) for o in model.graph.output}
        assert list(ins) == manifest["io"]["inputs"] and list(outs) == manifest["io"]["outputs"]
        assert ins["input_ids"] == ["batch", "seq"] and outs["logits"] == ["batch", "seq", CFG.vocab_size]
        for s in specs:
            want_in = [d for d in s.dims]
            assert ins[s.input_name] == want_in, s.input_name
            want_out = ["batch", "total_seq", *s.dims[2:]] if s.kind == "latent" else want_in
            assert outs[s.output_name] == want_out, s.output_name
        k3 = [n for n in inline_layers(model).graph.node if n.domain == "k3"]  # one per layer, as traced
        counts = {t: sum(n.op_type == t for n in k3) for t in NODE_SPECS}
        traced = manifest["op_counts"]
        assert counts == {"KDA": traced["k3::kda"], "AttnRes": traced["k3::attn_res"], "MoE": traced["k3::moe"],
                          "MoEMXFP4": traced.get("k3::moe_mxfp4", 0),  # dense experts: no packed MoE nodes
                          "KDAPacked": 0, "MLAPaged": 0, "KDADecode": 0,
                          "KDAPrep": 0,  # serving-step ops: not in the batch interface
                          "LinearBF16": traced.get("k3::linear_bf16", 0),  # an fp32 trunk: no bf16 linear nodes
                          "LinearQ8": traced.get("k3::linear_q8", 0)}  # nor 8-bit ones
        for n in k3:
            attrs = {a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            assert attrs["plugin_namespace"] == b"k3"
            assert set(attrs) == {f for f, _ in NODE_SPECS[n.op_type].fields} | {"plugin_namespace"}
            if n.op_type == "MoE":
                assert (attrs["top_k"], attrs["num_experts"], attrs["activation"]) == (2, 8, b"situ")
        functions = sorted(f.name for f in model.functions if f.domain == "k3")
        assert functions == ([] if flavor == "trt" else ["AttnRes", "KDA", "MoE"])
        layers = sorted(f.name for f in model.functions if f.domain == "k3x.layers")
        assert layers == sorted({CFG.layer_kind(i) for i in range(CFG.num_layers)})
        assert manifest["artifacts"]["onnx"]["layer_functions"][flavor]["mode"] == "functions"


def test_node_names_map_back_to_the_model():
    """Main-graph nodes are named after the module they came from (a layer's call: /model/layers.1), layer
    function nodes after theirs within the layer (block_sparse_moe/MoE), k3 function-body nodes after their op
    and step, so an ONNX Runtime profile or a Netron view reads /model/layers.1 + block_sparse_moe/MoE."""
    model = onnx.load(str(mini_export().folder / FLAVOR_FILES["ort"]))
    names = [n.name for n in model.graph.node]
    assert len(set(names)) == len(names) and all(n.startswith("/") for n in names)
    calls = {n.name: n.op_type for n in model.graph.node if n.domain == "k3x.layers"}
    assert calls == {f"/model/layers.{i}": CFG.layer_kind(i) for i in range(CFG.num_layers)}
    k3 = {(f.name, n.name) for f in model.functions for n in f.node if n.domain == "k3"}
    for i in CFG.kda_layers:
        assert (CFG.layer_kind(i), "self_attn/KDA") in k3
    for i in CFG.moe_layers:
        assert (CFG.layer_kind(i), "block_sparse_moe/MoE") in k3
    assert (CFG.layer_kind(0), "AttnRes") in k3
    for f in model.functions:
        if f.domain == "k3":
            assert all(n.name.startswith(f"{f.name}/") for n in f.node), f.name
    steps = {f.name: {n.name.split("/")[1] for n in f.node} for f in model.functions if f.domain != "k3x.layers"}
    assert steps["MoE"] >= {"route", "per_expert"}  # its routing and combine: k3x.fused calls
    assert steps["MoEDispatch"] >= {"route", "segment", "rows"} and steps["MoECombine"] == {"combine"}


def test_reexport_is_byte_identical(tmp_path):
    m = mini_export()
    folder, _ = export_folder(m.checkpoint, tmp_path / "again")  # fresh load, fresh trace, fresh export
    for name in FLAVOR_FILES.values():
        assert (folder / name).read_bytes() == (m.folder / name).read_bytes(), name


def test_weightless_bf16_export_on_meta_device(tmp_path):
    from k3x.exporter.trace import trace

    # bf16 also proves the graph has no op without a bfloat16 type (SplitToSequence, Conv before opset 22)
    meta = build_model(CFG, device="meta", dtype=torch.bfloat16, seed=None)
    art = export_onnx(trace(meta), CFG, tmp_path, OnnxOptions(weights=False))
    weights = set(meta.state_dict())
    for path in art.files.values():
        onnx.checker.check_model(str(path), full_check=True)
        model = onnx.load(str(path), load_external_data=False)
        inputs = {i.name: i.type.tensor_type.elem_type for i in model.graph.input}
        io = {"input_ids", *(s.input_name for s in state_specs(CFG))}
        assert set(inputs) - io <= weights and len(set(inputs) - io) >= len(weights) - 2  # layer 0 skips AttnRes
        assert not weights & {t.name for t in model.graph.initializer}
        assert inputs["lm_head.weight"] == onnx.TensorProto.BFLOAT16
        assert inputs["model.norm.weight"] == onnx.TensorProto.FLOAT  # norms stay fp32 (precision plan)
        assert list(inputs)[0] == "input_ids" and path.stat().st_size < 2**20


def test_external_data_is_shared_by_both_flavors(tmp_path):
    m = mini_export()
    art = export_onnx(m.ep, CFG, tmp_path, OnnxOptions(external_data=True))
    assert art.external_data == tmp_path / "model.onnx.data" and art.external_data.stat().st_size > 10**5
    for path in art.files.values():
        model = onnx.load(str(path), load_external_data=False)
        locations = {e.value for t in model.graph.initializer for e in t.external_data if e.key == "location"}
        assert locations == {"model.onnx.data"}
    # the ort flavor with external data computes what the embedded-weights file computes
    feeds = {"input_ids": np.array([[3, 1, 4]], dtype=np.int64)}
    feeds.update({s.input_name: t.numpy() for s, t in zip(state_specs(CFG), empty_state(CFG, 1))})
    a = ort.InferenceSession(str(art.files["ort"]), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    b = ort.InferenceSession(str(m.folder / "model.onnx"), providers=["CPUExecutionProvider"]).run(["logits"], feeds)[0]
    np.testing.assert_array_equal(a, b)


def test_bad_flavor_is_rejected():
    with pytest.raises(ValueError, match="flavors"):
        OnnxOptions(flavors=("tensorrt",))
