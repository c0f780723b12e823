"""The serving step's engine (issue 20): `k3x build-engine` on a `k3x export --serving` folder of k3-mini builds
through TensorRT-RTX on CPU with the k3::KDAPacked and k3::MLAPaged plugins (AOT cubins), one optimisation
profile over the serving dims (tokens, seqs, table_blocks, logits_rows, slots, blocks; the block size fixed)
taken from the manifest's `serving` entry, `--opt/--max` applied to them. The engine is not executed (no GPU):
its recorded I/O and profile are checked against the manifest, the blob for the plugin layers and kernels.
The build runs in a subprocess: `build-engine` puts TensorRT-RTX's library folder on LD_LIBRARY_PATH by re-exec.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from k3x.cli import app
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export
from k3x.model import preset
from k3x.model.state import state_specs

CFG, BS = preset("k3-mini"), 8
needs_rtx = pytest.mark.skipif(
    importlib.util.find_spec("tensorrt_rtx_bindings") is None and importlib.util.find_spec("tensorrt_rtx") is None,
    reason="TensorRT-RTX not installed (pip install -e .[trt-rtx]; scripts/setup_trt_rtx.sh)")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serving-engine") / "k3-mini"
    export(ExportOptions((Target.ONNX,), out, preset="k3-mini", serving=True, block_size=BS))
    return out


def expected_profile(dims: dict[str, dict[str, int]]) -> dict[str, list[list[int]]]:
    """input -> [min, opt, max] shapes, from the step contract (docs: the serving step's I/O) and the pools'
    static dims (model/state.py), each dynamic dim at the manifest's range."""
    def shapes(*axes) -> list[list[int]]:
        return [[dims[a][k] if isinstance(a, str) else (dims["seqs"][k] + 1 if a is None else a) for a in axes]
                for k in ("min", "opt", "max")]

    out = {"input_ids": shapes("tokens"), "cu_seqlens": shapes(None), "past_lens": shapes("seqs"),
           "slots": shapes("seqs"), "block_table": shapes("seqs", "table_blocks"),
           "logits_index": shapes("logits_rows")}
    for s in state_specs(CFG):
        if s.layer < 0:
            continue
        static = s.shape(1, 0)[1:]  # conv [3P, W-1], recurrent [H, K, V]
        pool = shapes("blocks", BS, s.dims[-1]) if s.kind == "latent" else shapes("slots", *static)
        out[f"pool.{s.layer}.{s.kind}"] = pool
    return out


@pytest.mark.trt
@pytest.mark.slow
@needs_rtx
def test_serving_engine_builds_with_the_manifest_interface(folder):
    cmd = [sys.executable, "-c", "from k3x.cli import app; app()", "build-engine", str(folder), "--runtime", "trt-rtx",
           "--sm", "89", "--opt", "tokens=32", "--max", "tokens=4096", "--max", "seqs=64", "--max", "logits_rows=64"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-4000:]
    assert "k3::KDAPacked: AOT path (sm_89 cubins)" in r.stderr and "k3::MLAPaged: AOT path (sm_89 cubins)" in r.stderr
    manifest = json.loads((folder / "manifest.json").read_text())
    serving, art = manifest["serving"], manifest["artifacts"]["trt"]
    meta = json.loads((folder / "model.engine.json").read_text())
    assert art["runtime"] == "trt-rtx" and art["sm"] == 89 and art["onnx_sha256"] == meta["onnx_sha256"]
    assert art["plugin_paths"]["KDAPacked"] == art["plugin_paths"]["MLAPaged"] == "aot"
    assert {f["path"] for f in art["files"]} >= {"model.engine", "model.engine.json"}
    onnx = next(f for f in manifest["artifacts"]["onnx"]["files"] if f["path"] == "model.trt.onnx")
    assert meta["onnx_sha256"] == onnx["sha256"]
    dims = {n: dict(r) for n, r in serving["dims"].items()}
    dims["tokens"].update(opt=32, max=4096)
    dims["seqs"]["max"] = dims["logits_rows"]["max"] = 64
    assert {n: {k: p[k] for k in ("min", "opt", "max")} for n, p in meta["profile"].items()} == dims
    assert sorted(meta["input_shapes"]) == sorted(serving["inputs"]) and meta["outputs"] == serving["outputs"]
    assert meta["input_shapes"] == art["input_shapes"] == expected_profile(dims)
    blob = (folder / "model.engine").read_bytes()
    for needle in (b"KDAPacked", b"MLAPaged", b"_kda_recurrent_kernel", b"_mla_paged_kernel",
                   b"_mla_paged_split_kernel", b"_mla_paged_combine_kernel"):
        assert needle in blob, needle  # the plugin layers and their embedded cubins


@pytest.mark.parametrize("flags, message", [
    (["--max", "batch=4"], "dims ['batch']: not dynamic dims; known: ['blocks', 'logits_rows', 'seqs', 'slots', "
                           "'table_blocks', 'tokens']"),
    (["--max", "seqs=2000"], "dim 'seqs': profile 1..2000 leaves the exported range 1..1024"),
])
def test_serving_profile_flags_are_checked_in_one_line(folder, flags, message):
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}
    r = CliRunner().invoke(app, ["build-engine", str(folder), "--runtime", "trt-rtx", *flags])
    assert r.exit_code == 1 and message in r.output and "Traceback" not in r.output
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before  # refused before anything is written
