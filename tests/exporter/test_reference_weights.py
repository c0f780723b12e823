"""`k3x export --weights reference`: pt2 and ONNX without their weights, read from the checkpoint at load.

One k3-mini checkpoint (a copy of the session's, so it can be changed here and put back) exported with the
checkpoint referenced, against the session's copying export of the same weights: same logits and tokens
from pt2 and ORT, no weight bytes in the folder, and a changed, moved or missing checkpoint refused at load
in one line naming the file.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import zipfile
from pathlib import Path

import onnx
import pytest
import torch
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.onnx_weights import REFERENCE_LOCATION
from k3x.exporter.pt2_weights import WEIGHT_RECORD
from k3x.runtime.base import RunnerError, RunnerOptions
from k3x.runtime.runners import generate, make_runner, open_folder, prefill_logits
from k3x.text.sampling import SamplingOptions

SHARD = "model-00001-of-00001.safetensors"


@pytest.fixture(scope="module")
def ref(mini_cli_export, tmp_path_factory) -> tuple[Path, Path]:
    """(checkpoint copy, its export with the checkpoint referenced)."""
    root = tmp_path_factory.mktemp("reference")
    shutil.copytree(mini_cli_export.checkpoint, root / "ckpt")
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(root / "ckpt"), "--target", "pt2", "--target", "onnx",
                                 "--weights", "reference", "--out", str(root / "export")])
    assert r.exit_code == 0, r.output
    assert "graph only: weights read from" in r.output
    return root / "ckpt", root / "export"


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_parity_with_the_copying_export(mini_cli_export, ref, backend):
    ids = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
    logits, tokens = [], []
    for d in (mini_cli_export.export, ref[1]):
        folder = open_folder(d)
        runner = make_runner(backend, folder, RunnerOptions(provider="cpu"))
        logits.append(prefill_logits(runner, folder.config(), ids))
        tokens.append(generate(runner, folder.config(), ids, SamplingOptions(max_new_tokens=6)).tokens)
    assert torch.equal(logits[0], logits[1])
    assert torch.equal(tokens[0], tokens[1])


def test_the_folder_holds_no_weight_bytes(mini_cli_export, ref):
    ckpt, export = ref
    manifest = json.loads((export / "manifest.json").read_text())
    source = manifest["weight_source"]
    assert source["path"] == str(ckpt) and source["resolved"] == str(ckpt.resolve())
    assert {f["name"] for f in source["files"]} == {"config.json", SHARD, "model.safetensors.index.json"}
    assert all(f["bytes"] == (ckpt / f["name"]).stat().st_size for f in source["files"])
    assert manifest["artifacts"]["pt2"]["weights"] == manifest["artifacts"]["onnx"]["weights"] == "checkpoint"
    copying = json.loads((mini_cli_export.export / "manifest.json").read_text())  # its weights streamed in
    for m in (manifest, copying):  # both stamped programs, saved by exporter/stamp_save.py
        assert m["artifacts"]["pt2"]["save"] == {"mode": "fast", "fallback": None}
    assert not list(export.glob("*.data"))
    with zipfile.ZipFile(export / "model.pt2") as z:  # every weight record is empty
        records = [i for i in z.infolist() if i.filename.startswith(WEIGHT_RECORD + "weight_")]
        assert records and sum(i.file_size for i in records) == 0
    with zipfile.ZipFile(mini_cli_export.export / "model.pt2") as z:  # the copying export's are not
        copied = sum(i.file_size for i in z.infolist() if i.filename.startswith(WEIGHT_RECORD + "weight_"))
    shard = (ckpt / SHARD).stat().st_size
    assert copied > shard // 2
    for name in ("model.onnx", "model.trt.onnx"):
        model = onnx.load(str(export / name), load_external_data=False)
        referenced = [i for i in model.graph.initializer if i.data_location == onnx.TensorProto.EXTERNAL]
        assert {e.value for i in referenced for e in i.external_data if e.key == "location"} == {REFERENCE_LOCATION}
        inline = sum(len(i.raw_data) for i in model.graph.initializer)
        assert len(referenced) > 10 and inline < shard // 100
    total = sum(p.stat().st_size for p in export.iterdir())
    assert total < sum(p.stat().st_size for p in mini_cli_export.export.iterdir()) - 2 * shard


@contextlib.contextmanager
def _changed(path: Path, data: bytes):
    """`path` holding `data` for the block, then its old bytes again."""
    old = path.read_bytes()
    path.write_bytes(data)
    try:
        yield
    finally:
        path.write_bytes(old)


def _run(export: Path, backend: str, *extra: str):
    return CliRunner().invoke(app, ["run", str(export), "--backend", backend, "--prompt-ids", "1,2,3",
                                    "--max-new-tokens", "2", *(["--provider", "cpu"] if backend == "ort" else []), *extra])


def _refused(r, needle: str) -> None:
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.strip().splitlines() if ln.strip() and not ln.startswith("note: ")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_a_changed_checkpoint_is_refused_at_load(ref, backend):
    ckpt, export = ref
    shard = ckpt / SHARD
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # same size, one byte of the last tensor changed
    with _changed(shard, bytes(data)):
        _refused(_run(export, backend), f"{shard}: sha256 differs")
        with pytest.raises(RunnerError, match="changed since the export"):
            make_runner(backend, export, RunnerOptions(provider="cpu"))
    with _changed(shard, bytes(data) + b"\0"):  # a size change is caught without the hash
        _refused(_run(export, backend, "--skip-hash-check"), f"{shard}: ")
    assert _run(export, backend).exit_code == 0  # as exported: runs


def test_a_moved_or_missing_checkpoint_is_refused_at_load(ref):
    ckpt, export = ref
    moved = ckpt.with_name("moved")
    ckpt.rename(moved)
    try:
        _refused(_run(export, "pt2"), f"{ckpt.resolve()}: the referenced checkpoint is missing")
    finally:
        moved.rename(ckpt)
    (ckpt / SHARD).rename(moved)
    try:
        _refused(_run(export, "ort"), f"{ckpt / SHARD}: missing")
    finally:
        moved.rename(ckpt / SHARD)


def test_a_shard_linked_out_of_the_checkpoint_is_refused(ref, tmp_path):
    ckpt, export = ref
    outside = tmp_path / SHARD
    (ckpt / SHARD).rename(outside)
    (ckpt / SHARD).symlink_to(outside)
    try:
        _refused(_run(export, "pt2", "--skip-hash-check"), "outside the checkpoint folder")
    finally:
        (ckpt / SHARD).unlink()
        outside.rename(ckpt / SHARD)


@pytest.mark.parametrize("args", [["--preset", "k3-mini"], ["--preset", "k3-mini", "--no-weights"]])
def test_reference_needs_a_checkpoint(args, tmp_path):
    r = CliRunner().invoke(app, ["export", *args, "--weights", "reference", "--out", str(tmp_path / "x")])
    _refused(r, "--weights reference: needs --checkpoint")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("args, reason", [
    (["--tp", "2"], "a rank's weights are slices of the checkpoint's tensors"),
    (["--ep", "2", "--serving"], "the rank runners do not slice a referenced checkpoint at load"),
    (["--target", "aoti"], "aoti compiles them in")])
def test_reference_refusals_name_the_reason(mini_cli_export, args, reason, tmp_path):
    r = CliRunner().invoke(app, ["export", "--checkpoint", str(mini_cli_export.checkpoint), "--weights", "reference",
                                 "--out", str(tmp_path / "x"), *(["--target", "pt2"] if "--target" not in args else []),
                                 *args])
    _refused(r, reason)
    assert not (tmp_path / "x").exists()
