"""folder/artifacts.py: manifest contents, artifacts renamed into place, nothing half-written on failure."""

from __future__ import annotations

import json

import pytest
import torch

from k3x.folder.artifacts import (MANIFEST, ExportFolder, ManifestError, init_manifest, read_manifest, sha256,
    update_manifest, write_artifact)
from k3x.folder.dims import DYNAMIC_DIMS
from k3x.model import preset
from k3x.model.state import state_specs

OPS = {"k3::attn_res": 12, "k3::kda": 3, "k3::moe": 5}


@pytest.fixture()
def folder(tmp_path):
    out = tmp_path / "export"
    init_manifest(out, preset("k3-mini"), dtype=torch.bfloat16, weights=True, op_counts=OPS,
                  checkpoint=tmp_path / "ckpt", checkpoint_hash="abc123")
    return out


def leftovers(out):
    return sorted(p.name for p in out.iterdir() if p.name.startswith(".tmp"))


def test_manifest_records_config_versions_dims_ops_and_state(folder, tmp_path):
    cfg = preset("k3-mini")
    m = json.loads((folder / MANIFEST).read_text())
    assert m["config"] == json.loads(json.dumps(cfg.to_dict())) and m["config_hash"] == cfg.hash()
    assert m["checkpoint"] == {"path": str((tmp_path / "ckpt").resolve()), "hash": "abc123"}
    assert m["dtype"] == "bf16" and m["weights"] is True
    assert set(m["versions"]) == {"torch", "triton", "onnx", "onnxruntime", "k3x"}
    assert m["versions"]["torch"] == torch.__version__
    assert m["dynamic_dims"] == {n: {"min": d.min, "opt": d.opt, "max": d.max} for n, d in DYNAMIC_DIMS.items()}
    assert m["op_counts"] == OPS
    specs = state_specs(cfg)
    assert m["io"]["inputs"] == ["input_ids"] + [s.input_name for s in specs]
    assert m["io"]["outputs"] == ["logits"] + [s.output_name for s in specs]
    assert {k: m["state"][k] for k in ("version", "interface", "latent_block_size")} == \
        {"version": 1, "interface": "batch", "latent_block_size": None}
    assert m["state"]["tensors"][0] == {"layer": 0, "kind": "kda_conv", "input": "past.0.conv",
                                        "output": "present.0.conv", "shape": [3 * 64, 3], "axes": ["channel", "time"],
                                        "dtype": "fp32", "update": "replace", "snapshot": "token"}
    latent = next(s for s in m["state"]["tensors"] if s["kind"] == "mla_latent")
    assert latent["shape"] == ["position", 32] and latent["dtype"] == "bf16"
    assert m["artifacts"] == {}


def test_write_artifact_renames_into_place_and_lists_sha256(folder):
    extra = {"flavor": "x"}
    with write_artifact(folder, "thing", extra, primary="b.bin") as tmp:
        assert tmp.parent == folder and not (folder / "a.txt").exists()
        (tmp / "a.txt").write_text("hello")
        (tmp / "b.bin").write_bytes(b"\x00" * 10)
        extra["added_inside"] = 1  # stages may fill `extra` while writing
    entry = read_manifest(folder)["artifacts"]["thing"]
    assert [f["path"] for f in entry["files"]] == ["b.bin", "a.txt"]  # primary first
    assert entry["files"][1] == {"path": "a.txt", "bytes": 5, "sha256": sha256(folder / "a.txt")}
    assert entry["flavor"] == "x" and entry["added_inside"] == 1
    assert leftovers(folder) == []
    d = ExportFolder.open(folder)
    assert d.artifact("thing") == folder / "b.bin" and d.verify() == []
    (folder / "a.txt").write_text("tampered")
    assert d.verify() == [str(folder / "a.txt")]


def test_injected_failure_leaves_nothing_half_written(folder):
    before = (folder / MANIFEST).read_text()
    with pytest.raises(RuntimeError, match="injected"):
        with write_artifact(folder, "pt2") as tmp:
            (tmp / "model.pt2").write_bytes(b"half a program")
            raise RuntimeError("injected failure mid-write")
    assert not (folder / "model.pt2").exists()
    assert leftovers(folder) == []
    assert (folder / MANIFEST).read_text() == before


def test_failed_rewrite_keeps_the_previous_artifact(folder):
    with write_artifact(folder, "pt2") as tmp:
        (tmp / "model.pt2").write_bytes(b"v1")
    with pytest.raises(RuntimeError):
        with write_artifact(folder, "pt2") as tmp:
            (tmp / "model.pt2").write_bytes(b"v2 (partial")
            raise RuntimeError("boom")
    assert (folder / "model.pt2").read_bytes() == b"v1"
    assert ExportFolder.open(folder).verify() == []


def test_update_manifest_is_the_one_call_for_later_stages(folder):
    (folder / "model.engine").write_bytes(b"engine")
    m = update_manifest(folder, "trt", ["model.engine"], {"sm": 90, "profiles": [{"batch": [1, 1, 8]}]})
    assert m["artifacts"]["trt"]["sm"] == 90
    assert ExportFolder.open(folder).files("trt") == [folder / "model.engine"]
    with pytest.raises(ManifestError, match="does not exist"):
        update_manifest(folder, "onnx", ["missing.onnx"])


def test_export_folder_reads_back_config_dtype_checkpoint(folder, tmp_path):
    d = ExportFolder.open(folder)
    assert d.config() == preset("k3-mini")
    assert d.dtype() is torch.bfloat16 and d.checkpoint() == (tmp_path / "ckpt").resolve()
    with pytest.raises(ManifestError, match=r"no onnx artifact \(it has: .*\); make it with `k3x export --target onnx`"):
        d.artifact("onnx")
    with pytest.raises(ManifestError, match="no manifest"):
        ExportFolder.open(tmp_path / "nowhere")
    with pytest.raises(ManifestError, match="no manifest"):
        with write_artifact(tmp_path, "x"):
            pass


def test_manifest_is_readable_by_others(folder):
    import os

    umask = os.umask(0)
    os.umask(umask)
    assert (folder / MANIFEST).stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0600
