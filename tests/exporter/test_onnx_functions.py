"""exporter/onnx_functions.py: k3-mini's decoder layers as ONNX local functions.

- One function per layer kind (4 on k3-mini), one call per layer named after it, each call passing its own
  layer's weights (they stay initializers of the main graph); the manifest records it per flavor.
- ONNX Runtime (CPU provider) gives bit-identical logits and state to the flat export (`--no-onnx-functions`),
  for a prefill and a decode step.
- Layers of one kind that are not isomorphic raise FunctionsError naming them, leaving the model unchanged;
  `save` then writes the flat graph and records why.
(TensorRT-RTX builds the function file: tests/exporter/test_trt_rtx_build.py.)
"""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.onnx_functions import DOMAIN, FunctionsError, functionalize, save
from k3x.model import preset

ort = pytest.importorskip("onnxruntime")
CFG = preset("k3-mini")
KINDS = [CFG.layer_kind(i) for i in range(CFG.num_layers)]


@pytest.fixture(scope="module")
def flat(mini_cli_export, tmp_path_factory):
    """The same checkpoint exported with --no-onnx-functions."""
    out = tmp_path_factory.mktemp("flat") / "export"
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(mini_cli_export.checkpoint), "--target", "onnx",
                                 "--no-onnx-functions", "--out", str(out)])
    assert r.exit_code == 0, r.output
    return out


def _manifest(folder) -> dict:
    return json.loads((folder / "manifest.json").read_text())["artifacts"]["onnx"]["layer_functions"]


def test_one_function_per_kind_one_call_per_layer_with_its_weights(mini_cli_export, flat):
    calls = {"kda_dense_first": 1, "kda_moe": 2, "mla_moe": 2, "mla_moe_block_start": 1}
    assert Counter(KINDS) == calls
    entries = _manifest(mini_cli_export.export)
    assert set(entries) == {"ort", "trt"}
    for flavor, name in (("ort", "model.onnx"), ("trt", "model.trt.onnx")):
        model = onnx.load(str(mini_cli_export.export / name), load_external_data=False)
        assert entries[flavor] == {"mode": "functions", "fallback": None, "calls": calls,
                                   "graph_nodes": len(model.graph.node)}
        assert sorted(f.name for f in model.functions if f.domain == DOMAIN) == sorted(calls)
        layer_calls = [n for n in model.graph.node if n.domain == DOMAIN]
        assert [(n.name, n.op_type) for n in layer_calls] == [(f"/model/layers.{i}", k) for i, k in enumerate(KINDS)]
        weights = {t.name for t in model.graph.initializer}
        for i, n in enumerate(layer_calls):
            mine = {w for w in weights if w.startswith(f"model.layers.{i}.")}
            assert mine and mine == {x for x in n.input if x.startswith("model.layers.")}, n.name
        flat_nodes = len(onnx.load(str(flat / name), load_external_data=False).graph.node)
        assert len(model.graph.node) < flat_nodes / 10, (len(model.graph.node), flat_nodes)
    for flavor, entry in _manifest(flat).items():
        assert entry["mode"] == "flat" and entry["fallback"] is None, flavor
        assert not [f for f in onnx.load(str(flat / "model.onnx"), load_external_data=False).functions
                    if f.domain == DOMAIN]


def _run(path) -> list[np.ndarray]:
    """Prefill 5 tokens of 2 sequences from an empty state, then decode one: logits and state of both."""
    so = ort.SessionOptions()
    so.log_severity_level = 3
    s = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(0, CFG.vocab_size, (2, 5)).astype(np.int64)
    feeds = {"input_ids": ids}
    for i in s.get_inputs()[1:]:
        feeds[i.name] = np.zeros([2 if d == "batch" else 0 if d == "past_seq" else d for d in i.shape], np.float32)
    out = s.run(None, feeds)
    again = s.run(None, {"input_ids": ids[:, :1]} | {i.name: v for i, v in zip(s.get_inputs()[1:], out[1:])})
    return out + again


def test_ort_outputs_equal_the_flat_export(mini_cli_export, flat):
    a, b = _run(mini_cli_export.export / "model.onnx"), _run(flat / "model.onnx")
    assert len(a) == len(b) == 2 * len(json.loads((flat / "manifest.json").read_text())["io"]["outputs"])
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x, y)  # bit-identical: the calls inline to the flat graph's nodes


def _tamper(model: onnx.ModelProto, layer: int) -> None:
    """One more attribute on `layer`'s KDA node: its layer kind is no longer isomorphic."""
    node = next(n for n in model.graph.node if n.name == f"/model/layers.{layer}/self_attn/KDA")
    node.attribute.append(onnx.helper.make_attribute("tampered", 1))


def test_layers_that_differ_fall_back_to_the_flat_graph(flat, tmp_path):
    proto = onnx.load(str(flat / "model.onnx"), load_external_data=False)
    _tamper(proto, 3)
    before = proto.SerializeToString()
    weights = {t.name for t in proto.graph.initializer if t.name.startswith(("model.", "lm_head."))}
    with pytest.raises(FunctionsError, match=r"^layers 1 and 3 \(kda_moe\) are not isomorphic: node \d+: "
                                             r"/model/layers\.1/self_attn/KDA vs /model/layers\.3/self_attn/KDA$"):
        functionalize(proto, KINDS, weights)
    assert proto.SerializeToString() == before  # nothing changed
    entry = save(ir.serde.deserialize_model(proto), tmp_path / "model.onnx", KINDS, weights)
    assert entry["mode"] == "flat" and "layers 1 and 3 (kda_moe) are not isomorphic" in entry["fallback"]
    written = onnx.load(str(tmp_path / "model.onnx"), load_external_data=False)
    assert entry["graph_nodes"] == len(written.graph.node) == len(proto.graph.node)
    assert not [f for f in written.functions if f.domain == DOMAIN]
    with pytest.raises(FunctionsError, match="nodes are named for layers"):  # another config's layer count
        functionalize(proto, KINDS[:-1], weights)
