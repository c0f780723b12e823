"""Parity harness: pt2 and ort pass on k3-mini over prefill + 8 decode steps; corrupted weights, broken
state handling and bad folders fail with exit code 1."""

from __future__ import annotations

import json
import shutil

import onnx
import pytest
import torch
from onnx import numpy_helper
from typer.testing import CliRunner

from k3x.checkpoint.files import load_checkpoint
from k3x.cli import app
from k3x.model import preset
from k3x.runtime.runners import ModuleRunner
from k3x.runtime.verify import compare, run_parity
from onnx_mini_folder import mini_export

pytest.importorskip("onnxruntime")
CFG = preset("k3-mini")
cli = CliRunner()


def test_verify_cli_passes_for_pt2_and_ort(tmp_path):
    m = mini_export()
    out = tmp_path / "report.json"
    res = cli.invoke(app, ["verify", str(m.folder), "--backends", "pt2,ort", "--steps", "8", "--batch", "2",
                           "--provider", "cpu", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "PASS" in res.output and "decode 8" in res.output
    report = json.loads(out.read_text())
    assert report["ok"] and len(report["steps"]) == 2 * 9
    names = set(report["steps"][0]["outputs"])
    assert {"logits", "present.0.recurrent", "present.5.latent"} <= names


def test_corrupted_onnx_weights_exit_1(tmp_path):
    m = mini_export()
    folder = shutil.copytree(m.folder, tmp_path / "export")
    model = onnx.load(str(folder / "model.onnx"))
    init = next(t for t in model.graph.initializer if t.name == "model.layers.3.self_attn.A_log")
    init.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(init) + 0.5, init.name))  # a KDA layer's decay only
    onnx.save(model, str(folder / "model.onnx"))
    res = cli.invoke(app, ["verify", str(folder), "--backends", "ort", "--steps", "2", "--provider", "cpu"])
    assert res.exit_code == 1 and "sha256 differs from the manifest" in res.output, res.output  # refused unloaded
    res = cli.invoke(app, ["verify", str(folder), "--backends", "ort", "--steps", "2", "--provider", "cpu",
                           "--skip-hash-check"])  # the parity harness catches it too
    assert res.exit_code == 1, res.output
    assert "FAIL" in res.output


class DropsState:
    """A runner that forgets the KDA recurrent state after the prefill: only decode steps can catch it."""

    name = "drops-state"

    def __init__(self, inner) -> None:
        self.inner = inner

    def infer(self, feeds):
        feeds = {k: torch.zeros_like(v) if k.endswith("recurrent") else v for k, v in feeds.items()}
        return self.inner.infer(feeds)


def test_decode_steps_catch_a_runner_that_drops_state():
    model = load_checkpoint(mini_export().checkpoint)
    ref = ModuleRunner("eager", model, CFG)
    report = run_parity(ref, [DropsState(ref)], CFG, steps=2)
    assert report.steps[0].ok and not report.ok  # prefill passes (state starts at zero), decode fails
    assert "FAIL" in report.table()


def test_compare_flags_shape_and_nonfinite():
    e = torch.ones(2, 3)
    assert not compare(torch.ones(3, 2), e, "x", torch.float32).ok
    assert compare(torch.full((2, 3), float("nan")), e, "x", torch.float32).problem == "non-finite"
    assert compare(None, e, "x", torch.float32).problem == "missing"
    assert compare(e + 1e-6, e, "x", torch.float32).ok and not compare(e + 1e-3, e, "x", torch.float32).ok
    assert compare(e.bfloat16(), e, "x", torch.float32).problem == "dtype bfloat16 != float32"


def test_verify_rejects_a_folder_that_is_not_an_export(tmp_path):
    res = cli.invoke(app, ["verify", str(tmp_path)])
    assert res.exit_code == 1 and "no manifest (run `k3x export` into this folder first)" in res.output


def test_verify_rejects_an_unknown_backend():
    res = cli.invoke(app, ["verify", str(mini_export().folder), "--backends", "tensorflow"])
    assert res.exit_code == 1 and "tensorflow" in res.output


def test_checkpoint_changed_after_export_is_named(tmp_path):
    """A changed checkpoint is reported as such, not as a backend parity failure."""
    import shutil

    from safetensors.torch import load_file, save_file

    m = mini_export()
    ckpt = tmp_path / "ckpt"
    shutil.copytree(m.checkpoint, ckpt)
    folder = tmp_path / "export"
    shutil.copytree(m.folder, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["checkpoint"]["path"] = str(ckpt)
    (folder / "manifest.json").write_text(json.dumps(manifest))
    shard = next(ckpt.glob("*.safetensors"))
    t = load_file(str(shard))
    t["language_model.model.norm.weight"] = t["language_model.model.norm.weight"] * 2  # the published K3 names
    save_file(t, str(shard))
    res = cli.invoke(app, ["verify", str(folder), "--backends", "pt2", "--steps", "1"])
    assert res.exit_code == 1 and "changed since the export" in res.output, res.output
