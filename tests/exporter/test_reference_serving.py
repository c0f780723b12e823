"""`k3x export --serving --weights reference`: a serving step whose pt2 and ONNX hold no weights; the runners read
them from the checkpoint at load under the step's names (`lm.` + the checkpoint's, the manifest's
`weight_source.prefix`).

A copy of the session's k3-mini checkpoint is exported twice with --serving (copied, referenced); three prompts
through continuous batching (more prompts than slots, a prompt prefilled in chunks) give the same tokens and
logits (`torch.equal`) on pt2 and ORT, the referencing folder holds no weight bytes, and a changed or moved
checkpoint is refused at load in one line naming the file. `k3x build-engine` on the referencing export: the
parser is handed the checkpoint's tensors (TensorRT-RTX on CPU builds it; its plan holds the weights), and the
weight sources a stripped engine records are the checkpoint's safetensors ranges, each reading back the
initializer's exact bytes (MXFP4 experts: one range per expert).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import onnx
import pytest
import torch
from onnx import numpy_helper
from serving_cases import prompts
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.engine_weights import WeightSourceError, checkpoint_ranges, inline_weights, read_weight, weight_sources
from k3x.exporter.pt2_weights import WEIGHT_RECORD
from k3x.exporter.serving import WEIGHT_PREFIX
from k3x.runtime.base import RunnerError, RunnerOptions
from k3x.runtime.runners import open_folder
from k3x.runtime.serve import ServeOptions, serve, serving_runner
from k3x.text.sampling import SamplingOptions

SHARD = "model-00001-of-00001.safetensors"
LENGTHS, NEW = [1, 20, 7], [3, 2, 4]
OPTIONS = ServeOptions(max_sequences=2, block_size=8, max_step_tokens=16, keep_logits=True)


@pytest.fixture(scope="module")
def exports(mini_cli_export, tmp_path_factory) -> tuple[Path, Path, Path]:
    """(checkpoint copy, its copying serving export, its referencing serving export)."""
    root = tmp_path_factory.mktemp("reference-serving")
    shutil.copytree(mini_cli_export.checkpoint, root / "ckpt")
    for name, extra in (("copy", []), ("reference", ["--weights", "reference"])):
        r = CliRunner().invoke(app, ["export", "--checkpoint", str(root / "ckpt"), "--serving", "--block-size", "8",
                                     "--target", "pt2", "--target", "onnx", "--out", str(root / name), *extra])
        assert r.exit_code == 0, r.output
    return root / "ckpt", root / "copy", root / "reference"


def _serve(backend: str, export: Path):
    folder = open_folder(export)
    cfg = folder.config()
    runner = serving_runner(backend, folder, RunnerOptions(provider="cpu"))
    return serve(runner, cfg, prompts(LENGTHS, cfg.vocab_size), SamplingOptions(), OPTIONS, max_new_tokens=NEW)


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_serving_parity_with_the_copying_export(exports, backend):
    copied, referenced = (_serve(backend, d) for d in exports[1:])
    assert [r.tokens for r in referenced] == [r.tokens for r in copied]
    assert [len(r.tokens) for r in referenced] == NEW
    for a, b in zip(copied, referenced):
        assert torch.equal(torch.stack(a.logits), torch.stack(b.logits))


def test_the_serving_folder_holds_no_weight_bytes(exports):
    ckpt, copied, referenced = exports
    manifest = json.loads((referenced / "manifest.json").read_text())
    assert manifest["weight_source"]["prefix"] == WEIGHT_PREFIX and manifest["serving"]["block_size"] == 8
    assert manifest["artifacts"]["pt2"]["weights"] == manifest["artifacts"]["onnx"]["weights"] == "checkpoint"
    assert not list(referenced.glob("*.data")) and list(copied.glob("*.data"))
    with zipfile.ZipFile(referenced / "model.pt2") as z:
        records = [i for i in z.infolist() if i.filename.startswith(WEIGHT_RECORD + "weight_")]
        assert records and sum(i.file_size for i in records) == 0
    shard = (ckpt / SHARD).stat().st_size
    size = {d: sum(p.stat().st_size for p in d.iterdir()) for d in (copied, referenced)}
    assert size[referenced] < size[copied] - 2 * shard  # the pt2's and the ONNX data's copies


def _run(export: Path, backend: str, prompt_file: Path):
    return CliRunner().invoke(app, ["run", str(export), "--backend", backend, "--prompts", str(prompt_file),
                                    "--max-new-tokens", "2", *(["--provider", "cpu"] if backend == "ort" else [])])


def _refused(r, needle: str) -> None:
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_a_changed_or_moved_checkpoint_is_refused_at_load(exports, backend, tmp_path):
    ckpt, _, referenced = exports
    (tmp_path / "p.jsonl").write_text('{"prompt_ids": [1, 2, 3]}\n{"prompt_ids": [4, 5]}\n')
    shard = ckpt / SHARD
    old = shard.read_bytes()
    shard.write_bytes(old[:-1] + bytes([old[-1] ^ 0xFF]))  # same size, one byte of the last tensor changed
    try:
        _refused(_run(referenced, backend, tmp_path / "p.jsonl"), f"{shard}: sha256 differs")
        with pytest.raises(RunnerError, match="changed since the export"):
            serving_runner(backend, referenced, RunnerOptions(provider="cpu"))
    finally:
        shard.write_bytes(old)
    moved = ckpt.with_name("moved")
    ckpt.rename(moved)
    try:
        _refused(_run(referenced, backend, tmp_path / "p.jsonl"),
                 f"{ckpt.resolve()}: the referenced checkpoint is missing")
    finally:
        moved.rename(ckpt)
    assert _run(referenced, backend, tmp_path / "p.jsonl").exit_code == 0  # as exported: it serves


def _sources(referenced: Path) -> tuple[Path, dict[str, dict]]:
    ckpt = checkpoint_ranges(open_folder(referenced))
    return ckpt[0], weight_sources(referenced / "model.trt.onnx", ckpt)


def test_stripped_engine_sources_are_checkpoint_ranges(exports):
    ckpt, copied, referenced = exports
    folder, sources = _sources(referenced)
    assert folder == ckpt.resolve()
    inits = onnx.load(str(copied / "model.trt.onnx")).graph.initializer  # with the copied external data
    want = {i.name: numpy_helper.to_array(i).tobytes() for i in inits}
    assert set(sources) == set(want)
    inline = inline_weights(referenced / "model.trt.onnx")
    for name, src in sources.items():  # every range, read back, is the copying export's initializer
        assert read_weight(referenced, name, src, inline, folder) == want[name], name
    from_ckpt = {n: s for n, s in sources.items() if s.get("checkpoint")}
    assert {r["file"] for s in from_ckpt.values() for r in s["ranges"]} == {SHARD}
    assert sum(s["length"] for s in from_ckpt.values()) > 0.9 * sum(map(len, want.values()))
    experts = from_ckpt[WEIGHT_PREFIX + "model.layers.1.block_sparse_moe.experts.w1"]
    assert experts["dtype"] == "INT8" and len(experts["ranges"]) == 8  # packed MXFP4 (the trt flavor types it INT8)
    name, src = next(iter(from_ckpt.items()))
    r = src["ranges"][0]
    old = (ckpt / SHARD).read_bytes()
    (ckpt / SHARD).write_bytes(old[:r["offset"]] + bytes([old[r["offset"]] ^ 1]) + old[r["offset"] + 1:])
    try:
        with pytest.raises(WeightSourceError, match=f"weight {name!r} no longer matches"):
            read_weight(referenced, name, src, inline, folder)
    finally:
        (ckpt / SHARD).write_bytes(old)
    with pytest.raises(WeightSourceError, match="not stored in the referenced checkpoint as the program holds it"):
        weight_sources(referenced / "model.trt.onnx", (folder, {}))


@pytest.mark.trt
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx_bindings") is None, reason="TensorRT-RTX not installed")
def test_build_engine_takes_the_weights_from_the_checkpoint(exports, tmp_path):
    copied, referenced = exports[1], tmp_path / "reference"
    shutil.copytree(exports[2], referenced)  # the build adds its files to the folder
    cmd = [sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(referenced), "--runtime",
           "trt-rtx", "--sm", "89"]  # a process of its own: it re-executes with TensorRT-RTX's library path
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    blob = (referenced / "model.engine").read_bytes()
    inits = onnx.load(str(copied / "model.trt.onnx")).graph.initializer
    for init in sorted(inits, key=lambda i: -numpy_helper.to_array(i).nbytes)[:3]:  # the largest weights
        assert numpy_helper.to_array(init).tobytes() in blob, init.name
