"""What a new user hit following the README in a fresh clone, each fixed: the export's dtype follows the
checkpoint (and says so), `inspect` scales its units, `build-engine` refuses a target its runtime cannot build
before any work and says which GPUs an engine serves, a re-export says what it replaces, the manifest records
each ONNX input's and output's dtype and shape, and `--out` naming a folder of the source tree is refused."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from hostile_util import k3x
from safetensors.torch import load_file, save_file

from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import resolve_job
from k3x.model.summary import scaled_bytes

SOURCE_ROOT = Path(__file__).resolve().parents[2]


def _set_config(ckpt: Path, **fields) -> None:
    """config.json naming its dtype only by `fields` (init-checkpoint writes torch_dtype at both levels)."""
    cfg = json.loads((ckpt / "config.json").read_text())
    for d in (cfg, cfg.get("text_config", {})):
        d.pop("torch_dtype", None)
        d.pop("dtype", None)
    cfg.update(fields)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def _store_floats_as(ckpt: Path, dtype: torch.dtype) -> None:
    """Rewrite every shard with its float tensors in `dtype` (MXFP4 bytes stay uint8)."""
    for shard in ckpt.glob("*.safetensors"):
        tensors = {k: t.to(dtype) if t.is_floating_point() else t for k, t in load_file(shard).items()}
        save_file(tensors, shard, metadata={"format": "pt"})


def _job_of(ckpt: Path, out: Path, *targets: Target):
    return resolve_job(ExportOptions(targets or (Target.PT2,), out, checkpoint=ckpt))


# --- export --dtype auto ---------------------------------------------------------------------------

def test_the_default_export_says_which_dtype_it_chose(mini_cli_export):
    """The suite's CLI export (no --dtype) of an fp32 checkpoint stays fp32 and says why, in one line."""
    manifest = json.loads((mini_cli_export.export / "manifest.json").read_text())
    assert manifest["dtype"] == "fp32"
    lines = [line for line in mini_cli_export.output.splitlines() if line.startswith("dtype:")]
    assert lines == ["dtype: fp32 (auto: config.json torch_dtype float32)"], mini_cli_export.output


def test_a_bf16_checkpoint_exports_as_bf16(ckpt_dir, tmp_path):
    _set_config(ckpt_dir, torch_dtype="bfloat16")
    job = _job_of(ckpt_dir, tmp_path / "out")
    assert job.dtype == torch.bfloat16 and job.dtype_note == "dtype: bf16 (auto: config.json torch_dtype bfloat16)"


def test_the_safetensors_decide_without_a_config_dtype(ckpt_dir, tmp_path):
    _set_config(ckpt_dir)
    _store_floats_as(ckpt_dir, torch.bfloat16)
    job = _job_of(ckpt_dir, tmp_path / "out", Target.ONNX)
    assert job.dtype == torch.bfloat16
    assert job.dtype_note.startswith("dtype: bf16 (auto: the safetensors store bfloat16); model.onnx needs ONNX "
                                     "Runtime's CUDA provider") and "--dtype fp32" in job.dtype_note


@pytest.mark.parametrize("fields, dtype, why", [
    ({"dtype": "float16"}, torch.float32, "auto: config.json dtype float16"),  # transformers-5's key; fp32 holds fp16
    ({"torch_dtype": "torch.float32"}, torch.float32, "auto: config.json torch_dtype torch.float32"),
])
def test_config_dtype_spellings(ckpt_dir, tmp_path, fields, dtype, why):
    _set_config(ckpt_dir, **fields)
    job = _job_of(ckpt_dir, tmp_path / "out")
    assert job.dtype == dtype and job.dtype_note == f"dtype: fp32 ({why})"


def test_a_bad_config_dtype_is_one_line(ckpt_dir, tmp_path):
    _set_config(ckpt_dir, torch_dtype="int8")
    code, out = k3x("export", "--checkpoint", ckpt_dir, "--target", "pt2", "--out", tmp_path / "out")
    assert code == 1 and "config.json: torch_dtype='int8': expected one of bfloat16, float16, float32" in out, out
    assert "Traceback" not in out and not (tmp_path / "out").exists()


def test_an_asked_dtype_wins(ckpt_dir, tmp_path):
    _set_config(ckpt_dir, torch_dtype="bfloat16")
    job = resolve_job(ExportOptions((Target.PT2,), tmp_path / "out", checkpoint=ckpt_dir, dtype="fp32"))
    assert job.dtype == torch.float32 and job.dtype_note == "dtype: fp32 (--dtype)"


def test_inspect_pools_default_to_the_export_dtype(ckpt_dir):
    _set_config(ckpt_dir, torch_dtype="bfloat16")
    code, out = k3x("inspect", "--checkpoint", ckpt_dir, "--context", "64", "--sequences", "1")
    assert code == 0 and "latents bf16" in out and "384 B per token" not in out, out  # k3-mini: 192 B in bf16
    code, out = k3x("inspect", "--preset", "k3-mini", "--context", "64", "--sequences", "1")
    assert code == 0 and "latents fp32" in out and "384 B per token" in out, out  # what the tests' exports hold


# --- inspect's units ---------------------------------------------------------------------------------

def test_scaled_bytes():
    assert [scaled_bytes(n) for n in (0, 999, 1000, 65_280, 3.2e6, 1.45e12, 5e15)] == [
        "0 B", "999 B", "1.00 KB", "65.28 KB", "3.20 MB", "1.45 TB", "5,000.00 TB"]


def test_inspect_of_a_small_model_prints_no_zeros():
    code, out = k3x("inspect", "--preset", "k3-mini")
    assert code == 0 and "0.00 GB" not in out and "MXFP4 experts 65.28 KB" in out, out


# --- build-engine targets ---------------------------------------------------------------------------

@pytest.mark.parametrize("flags", [["--runtime", "trt-rtx", "--sm", "90"], ["--sm", "90"], ["--runtime", "trt-rtx",
                                                                                         "--sm", "100"]])
def test_an_sm_trt_rtx_cannot_build_is_refused_before_any_work(tmp_path, flags, monkeypatch):
    """An empty folder: the refusal comes from the target, before the folder is read (which would refuse it too)."""
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "tensorrt" else real(n, *a))  # auto:
    code, out = k3x("build-engine", tmp_path, *flags)  # trt-rtx, as on a machine without TensorRT 11
    sm = flags[-1]
    assert code == 1 and f"--sm {sm}: TensorRT-RTX cannot build for sm_{sm}" in out and "manifest" not in out, out
    assert "sm_89" in out and "--runtime trt" in out


# --- re-export and the manifest's ONNX inputs and outputs ------------------------------------------

def test_the_manifest_records_each_onnx_input_and_output_as_onnx_runtime_sees_it(mini_cli_export):
    from k3x.runtime.ort_runner import ort_session

    entry = json.loads((mini_cli_export.export / "manifest.json").read_text())["artifacts"]["onnx"]
    names = {"float": "float32", "int64": "int64", "int32": "int32", "bfloat16": "bfloat16", "float16": "float16"}
    sess, _ = ort_session(mini_cli_export.export / entry["flavors"]["ort"], provider="cpu")
    for side, got in (("inputs", sess.get_inputs()), ("outputs", sess.get_outputs())):
        seen = [{"name": v.name, "dtype": names[v.type[len("tensor("):-1]], "shape": v.shape} for v in got]
        assert entry["io"]["ort"][side] == seen, side
    assert entry["io"]["ort"]["inputs"][0] == {"name": "input_ids", "dtype": "int64", "shape": ["batch", "seq"]}
    assert set(entry["io"]) == {"ort", "trt"}


# --- --out inside the source tree -----------------------------------------------------------------

@pytest.mark.parametrize("name", ["exporter", "runtime", "model"])
def test_out_naming_a_source_folder_is_refused_and_named(name, monkeypatch):
    """Run from the clone's root (where `pip install -e .` leaves a user), `--out exporter` names a package
    folder of k3x itself: refused in one line naming it, nothing touched."""
    monkeypatch.chdir(SOURCE_ROOT)
    before = sorted(os.listdir(name))
    code, out = k3x("export", "--preset", "k3-mini", "--no-weights", "--target", "pt2", "--out", name)
    assert code == 1 and f"{name}: not empty and not a k3x export folder" in out and "--out" in out, out
    assert sorted(os.listdir(name)) == before and not list(Path(".").glob(f".{name}.k3x-*"))


def test_inspect_export_shows_each_onnx_input_and_output(mini_cli_export, export_dir):
    code, out = k3x("inspect", "--export", mini_cli_export.export)
    assert code == 0 and "model.onnx (ort flavor)" in out and "model.trt.onnx (trt flavor)" in out, out
    lines = [line.split() for line in out.splitlines()]
    assert ["input_ids", "int64", "[batch,", "seq]"] in lines and ["logits", "float32", "[batch,", "seq,", "512]"] in lines
    manifest = json.loads((export_dir / "manifest.json").read_text())
    del manifest["artifacts"]["onnx"]  # as a pt2-only export's
    (export_dir / "manifest.json").write_text(json.dumps(manifest))
    code, out = k3x("inspect", "--export", export_dir)
    assert code == 1 and out.strip() == f"error: {export_dir}: no ONNX artifact (export with --target onnx)", out


def test_inspect_export_of_rank_programs_names_a_rank_folder():
    from k3x.folder.onnx_io import onnx_io_report
    from k3x.folder.schema import ManifestError

    with pytest.raises(ManifestError, match="tp2: no ONNX artifact; each rank folder holds its own: --export tp2/rank-000"):
        onnx_io_report({"artifacts": {}, "parallel": {"ranks": [{"dir": "rank-000"}, {"dir": "rank-001"}]}}, "tp2")


@pytest.mark.parametrize("kernels", ["0", "1"])
def test_a_bf16_onnx_export_on_the_cpu_names_the_trunk(ckpt_dir, tmp_path, monkeypatch, kernels):
    """A bf16 model.onnx run on the CPU provider is one line naming --trunk bf16, with or without the kernel
    library (its kernels are fp32: ONNX Runtime's type check fails on them, not on a missing kernel)."""
    monkeypatch.setenv("K3X_ORT_KERNELS", kernels)
    code, out = k3x("export", "--checkpoint", ckpt_dir, "--target", "onnx", "--dtype", "bf16", "--out", tmp_path / "b")
    assert code == 0, out
    code, out = k3x("run", tmp_path / "b", "--prompt-ids", "1,2", "--max-new-tokens", "1", "--provider", "cpu")
    assert code == 1 and "CRASH" not in out and "--trunk bf16" in out, out
