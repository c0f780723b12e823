"""Loading an export folder runs no code and reads nothing outside it: pickled pt2 payloads, tampered
artifacts, escaping manifest paths and malformed manifests are refused with one line, exit 1."""

from __future__ import annotations

import json
import os
import pickle
import zipfile
from pathlib import Path

import pytest
from hostile_util import Payload, edit_manifest, k3x, rehash

from k3x.folder.artifacts import ExportFolder, ManifestError
from k3x.folder.trust import UnsafeArtifactError, check_pt2_archive


def _rewrite_pt2(path: Path, change) -> None:
    """Rewrite the zip entries of a .pt2 through `change(name, bytes) -> bytes | None (drop)`."""
    with zipfile.ZipFile(path) as z:
        entries = [(i.filename, z.read(i.filename)) for i in z.infolist()]
    with zipfile.ZipFile(path, "w") as z:
        for name, data in entries:
            new = change(name, data)
            if new is not None:
                z.writestr(name, new)


def _poison_weights(export_dir: Path, marker: Path) -> None:
    """Mark the first weight `use_pickle` and make its payload a pickle that writes `marker`."""
    pt2 = export_dir / "model.pt2"
    with zipfile.ZipFile(pt2) as z:
        cfg_name = next(n for n in z.namelist() if n.endswith("_weights_config.json"))
        cfg = json.loads(z.read(cfg_name))
    fqn = next(iter(cfg["config"]))
    cfg["config"][fqn]["use_pickle"] = True
    target = cfg["config"][fqn]["path_name"]
    poison = pickle.dumps(Payload(marker))

    def change(name: str, data: bytes):
        if name == cfg_name:
            return json.dumps(cfg)
        if name.endswith("/data/weights/" + target):
            return poison
        return data

    _rewrite_pt2(pt2, change)
    rehash(export_dir, "pt2")  # the attacker also rewrites the manifest: the hash check alone cannot help


@pytest.mark.parametrize("command", ["run", "verify"])
def test_pickled_pt2_weights_are_refused_and_nothing_runs(export_dir, tmp_path, command):
    marker = tmp_path / "marker"
    _poison_weights(export_dir, marker)
    args = ["run", export_dir, "--backend", "pt2", "--max-new-tokens", "2"] if command == "run" else \
        ["verify", export_dir, "--backends", "pt2", "--steps", "1"]
    code, out = k3x(*args)
    assert code == 1 and "pickled" in out and "Traceback" not in out, out
    assert not marker.exists()


def test_pickled_constant_and_sample_inputs_are_refused(export_dir, tmp_path):
    marker = tmp_path / "marker"
    pt2 = export_dir / "model.pt2"
    _rewrite_pt2(pt2, lambda n, d: pickle.dumps(Payload(marker)) if "sample_inputs" in n else d)
    with pytest.raises(UnsafeArtifactError, match="sample_inputs"):
        check_pt2_archive(pt2)
    _rewrite_pt2(pt2, lambda n, d: d if "sample_inputs" not in n else None)
    with zipfile.ZipFile(pt2, "a") as z:
        top = z.namelist()[0].split("/")[0]
        z.writestr(f"{top}/data/constants/opaque_obj_0", pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeArtifactError, match="unexpected archive entry"):
        check_pt2_archive(pt2)
    assert not marker.exists()


def test_the_exported_pt2_passes_the_check(export_dir):
    check_pt2_archive(export_dir / "model.pt2")


@pytest.mark.parametrize("backend,file", [("ort", "model.onnx"), ("pt2", "model.pt2")])
def test_tampered_artifact_is_refused_before_loading(export_dir, backend, file):
    p = export_dir / file
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped, same size
    p.write_bytes(bytes(data))
    code, out = k3x("run", export_dir, "--backend", backend, "--max-new-tokens", "2")
    assert code == 1 and "sha256" in out and "changed since the export" in out, out
    code, out = k3x("verify", export_dir, "--backends", backend, "--steps", "1")
    assert code == 1 and "sha256" in out, out


def test_skip_hash_check_is_stated(export_dir):
    code, out = k3x("run", export_dir, "--backend", "ort", "--max-new-tokens", "2", "--skip-hash-check")
    assert code == 0 and "sha256 check of the artifact files skipped" in out, out


@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "sub/model.onnx", ".."])
def test_escaping_manifest_paths_are_refused(export_dir, path):
    edit_manifest(export_dir, lambda m: m["artifacts"]["onnx"]["files"][0].update(path=path))
    code, out = k3x("run", export_dir, "--backend", "ort", "--max-new-tokens", "2")
    assert code == 1 and "artifacts.onnx.files[0].path" in out and "Traceback" not in out, out


def test_symlink_out_of_the_folder_is_refused(export_dir, tmp_path):
    outside = tmp_path / "outside.onnx"
    (export_dir / "model.onnx").rename(outside)
    os.symlink(outside, export_dir / "model.onnx")
    code, out = k3x("run", export_dir, "--backend", "ort", "--max-new-tokens", "2", "--skip-hash-check")
    assert code == 1 and "outside the export folder" in out, out


@pytest.mark.parametrize("change,field", [
    (lambda m: m.update(dtype="fp8"), "dtype='fp8'"),
    (lambda m: m.update(artifacts=[]), "artifacts=[]"),
    (lambda m: m["artifacts"]["pt2"].update(files="model.pt2"), "artifacts.pt2.files"),
    (lambda m: m["artifacts"]["pt2"]["files"][0].update(sha256="x"), "artifacts.pt2.files[0].sha256"),
    (lambda m: m["artifacts"]["pt2"]["files"][0].update(bytes=True), "artifacts.pt2.files[0].bytes"),
    (lambda m: m.update(schema=99), "schema=99"),
    (lambda m: m.pop("config"), "config is missing"),
    (lambda m: m["config"].update(hidden_size="big"), "hidden_size"),
    # the state contract must be the config's (model/state_contract.py)
    (lambda m: m["state"]["tensors"][1].update(shape=[4, 8, 16]),
     "state.tensors[1] (layer 0 kda_recurrent): shape=[4, 8, 16], the config gives [4, 16, 16]"),
    (lambda m: m["state"]["tensors"][1].update(axes=["head", "value", "key"]), "(layer 0 kda_recurrent): axes="),
    (lambda m: m["state"]["tensors"][3].update(dtype="bf16"), "(layer 1 kda_recurrent): dtype=bf16"),
    (lambda m: m["config"]["kda"].update(conv_kernel=3), "(layer 0 kda_conv): shape=[192, 3], the config gives [192, 2]"),
    (lambda m: m["state"].update(latent_block_size=16), "state.latent_block_size=16, the config gives None"),
    (lambda m: m["state"]["tensors"].pop(), "state.tensors lists 8 tensors, the config gives 9"),
])
def test_malformed_manifest_is_one_line_naming_the_field(export_dir, change, field):
    edit_manifest(export_dir, change)
    code, out = k3x("run", export_dir, "--backend", "pt2", "--max-new-tokens", "2")
    assert code == 1 and field in out and "Traceback" not in out and len(out.splitlines()) == 1, out


@pytest.mark.parametrize("text", ["[]", '"x"', "Infinity", "[" * 100000, b"\xff\xfe"])
def test_manifest_that_is_not_an_object_is_a_manifest_error(export_dir, text):
    (export_dir / "manifest.json").write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ManifestError):
        ExportFolder.open(export_dir)


def test_ort_sessions_run_without_the_growing_cpu_arena(export_dir):
    from k3x.runtime.ort_runner import ort_session

    sess, _ = ort_session(export_dir / "model.onnx", "cpu")
    cfg = sess.get_session_options()
    assert cfg.enable_cpu_mem_arena is False and cfg.enable_mem_pattern is False
