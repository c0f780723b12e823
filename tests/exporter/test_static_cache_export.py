"""`k3x export --max-context N` (static MLA latent cache) end to end on k3-mini: the manifest states it, the ONNX
graph has fixed-size latent caches and a `past_length` scalar (ScatterElements writes the new positions),
`k3x verify` passes for pt2 and ONNX Runtime over prefill + 8 decode steps, requests beyond the capacity are
refused in one line, GenAI is skipped with its reason, and TensorRT-RTX parses and builds the trt flavor."""

from __future__ import annotations

import importlib.util
import json

import onnx
import pytest
import torch
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.onnx_functions import inline_layers
from k3x.folder.artifacts import ExportFolder

runner = CliRunner()
C = 24


@pytest.fixture(scope="module")
def static_export(tmp_path_factory):
    from k3x.checkpoint.save import save_checkpoint
    from k3x.model import build_model, preset

    root = tmp_path_factory.mktemp("static")
    save_checkpoint(build_model(preset("k3-mini"), seed=0), root / "ckpt", expert_format="dense")
    r = runner.invoke(app, ["export", "--checkpoint", str(root / "ckpt"), "--out", str(root / "ex"), "--target",
                            "pt2", "--target", "onnx", "--max-context", str(C)])
    assert r.exit_code == 0, r.output
    return root / "ex", r.output


def test_manifest_and_onnx_interface(static_export):
    folder, output = static_export
    m = ExportFolder.open(folder).manifest
    assert m["static_cache"] == {"max_context": C, "length_input": "past_length"}
    assert m["options"] == {"kernels": "reference", "expert_format": "dense", "activations": "bf16",
                            "trunk": "dense", "max_context": C}
    assert "max_context" not in m["config"] and m["io"]["inputs"][-1] == "past_length"
    assert m["state"]["tensors"][-1] == {"layer": -1, "kind": "length", "input": "past_length",
                                         "output": "present_length", "shape": [], "axes": [], "dtype": "int64",
                                         "update": "replace", "snapshot": "token"}
    assert m["state"]["tensors"][-2]["shape"] == [C, 32]  # a static latent cache: C positions per sequence
    assert "genai: skipped — a static latent cache (--max-context)" in output and "genai" not in m["artifacts"]
    model = onnx.load(folder / "model.onnx", load_external_data=False)
    g = model.graph
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim] for v in [*g.input, *g.output]}
    assert dims["past_key_values.2.latent"] == dims["present.2.latent"] == ["batch", C, 32]
    assert dims["past_length"] == dims["present_length"] == []
    assert sum(n.op_type == "ScatterElements" for n in inline_layers(model).graph.node) == 3  # one per MLA layer


def test_verify_passes_and_long_requests_are_refused(static_export, tmp_path):
    folder, _ = static_export
    r = runner.invoke(app, ["verify", str(folder), "--backends", "pt2,ort", "--json", str(tmp_path / "v.json")])
    assert r.exit_code == 0 and "PASS" in r.output, r.output
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["ok"] is True
    assert {(s["backend"], s["step"]) for s in report["steps"]} == {(b, i) for b in ("pt2", "ort") for i in range(9)}
    assert all("present_length" in s["outputs"] and "present.5.latent" in s["outputs"] for s in report["steps"])
    r = runner.invoke(app, ["verify", str(folder), "--backends", "pt2", "--prompt-len", "20", "--steps", "5"])
    assert r.exit_code == 1
    assert r.output.strip().splitlines()[-1] == (
        f"error: prompt length 20 + 5 decode steps = 25 positions: over the static latent cache (max_context={C}, "
        "set at export); use a shorter request or re-export with a larger --max-context")


@pytest.mark.trt
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None
                    and importlib.util.find_spec("tensorrt_rtx") is None, reason="TensorRT-RTX not installed")
def test_trt_rtx_builds_the_static_cache_engine(static_export):
    from test_trt_rtx_build import _build

    folder, _ = static_export
    r = _build(folder)
    assert r.returncode == 0, r.stdout + r.stderr
    shapes = json.loads((folder / "model.engine.json").read_text())["input_shapes"]
    assert shapes["past_length"] == [[], [], []]
    assert shapes["past_key_values.5.latent"] == [[1, C, 32], [1, C, 32], [64, C, 32]]


@pytest.mark.parametrize("args,line", [
    (["--max-context", "16", "--tp", "2"],
     "error: --max-context: the static latent cache is not available for rank programs (--tp/--ep > 1)"),
    (["--max-context", "5000"], "error: max_context=5000: must be None or in [1, max_position_embeddings=4096]"),
])
def test_bad_max_context_is_refused_before_tracing(tmp_path, args, line):
    r = runner.invoke(app, ["export", "--preset", "k3-mini", "--out", str(tmp_path / "ex"), *args])
    assert r.exit_code == 1 and r.output.strip().splitlines()[-1] == line, r.output
    assert not (tmp_path / "ex").exists()


def test_pt2_program_with_static_cache_replays_one_graph(static_export):
    """The exported program itself (not the eager model) has one key per decode step: with the graph emulated
    on CPU (tests/emulated_graph.Emulated) it is captured once and replayed, tokens unchanged."""
    from emulated_graph import Emulated

    from k3x.runtime.runners import make_runner, next_feeds, start_feeds

    folder, _ = static_export
    cfg, cache = ExportFolder.open(folder).config(), ExportFolder.open(folder).options().cache
    plain, graphed = make_runner("pt2", folder), Emulated(make_runner("pt2", folder))
    seqs = []
    for r in (plain, graphed):
        out, toks = r.infer(start_feeds(cfg, torch.tensor([[3, 1, 4, 1, 5]]), cache=cache)), []
        for _ in range(8):
            toks.append(out["logits"][:, -1].argmax(-1, keepdim=True))
            out = r.infer(next_feeds(cfg, out, toks[-1], cache))
        seqs.append(torch.cat(toks, -1))
    assert torch.equal(seqs[0], seqs[1])
    assert graphed.stats == {"captured": 1, "replayed": 7, "eager": 2, "capture_failed": 0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_graph_flag_is_refused_in_one_line_without_cuda(static_export):
    folder, _ = static_export
    want = "no CUDA device (torch.cuda.is_available() is False)"
    for args, what in ((["run", str(folder), "--backend", "pt2"], "backend pt2"),
                       (["verify", str(folder), "--backends", "pt2"], "backend pt2"),
                       (["generate", "--checkpoint", str(folder.parent / "ckpt")], "generate")):
        r = runner.invoke(app, [*args, "--cuda-graph"])
        assert r.exit_code == 1, r.output
        assert r.output.strip().splitlines()[-1] == f"error: --cuda-graph: {what}: {want}", r.output
