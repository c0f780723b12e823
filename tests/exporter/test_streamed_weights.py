"""Export with weights from a checkpoint, streamed: pt2 and ONNX are traced on meta and filled tensor by tensor
from the shards (bytes stored as the artifact holds them are copied file to file), the model is never loaded,
the archive is a valid zip `torch.export.load` reads with the checkpoint's exact tensors, and the peak RSS
of an export does not grow with the model (measured in a child process)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

from k3x.checkpoint.byte_ranges import StoredTensor, stream_weights
from k3x.checkpoint.files import CheckpointError, load_checkpoint
from k3x.checkpoint.save import save_checkpoint
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export
from k3x.exporter.trace import load_pt2
from k3x.folder.trust import checked_pt2
from k3x.model import build_model, preset
from k3x.model.options import BuildOptions

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """bf16 k3-mini, MXFP4 experts, several shards."""
    model = build_model(preset("k3-mini"), seed=3, dtype=torch.bfloat16)
    return save_checkpoint(model, tmp_path_factory.mktemp("stream") / "ckpt", max_shard_bytes=150_000)


def _read(r) -> bytes:
    with open(r.file, "rb") as f:
        f.seek(r.offset)
        return f.read(r.nbytes)


def test_stored_bytes_are_byte_ranges_converted_ones_are_tensors(ckpt):
    same = dict(stream_weights(ckpt, dtype=torch.bfloat16))
    ref = load_checkpoint(ckpt, dtype=torch.bfloat16).state_dict()
    assert list(same) == list(ref)
    for name, t in same.items():
        if isinstance(t, StoredTensor):  # the concatenated ranges are the loaded tensor's bytes
            got = b"".join(_read(r) for r in t.ranges)
            assert got == ref[name].contiguous().view(torch.uint8).numpy().tobytes(), name
        else:
            assert torch.equal(t, ref[name]), name
    stored = {n for n, t in same.items() if isinstance(t, StoredTensor)}
    assert "model.layers.1.block_sparse_moe.experts.w1" in stored  # packed experts: one range per expert
    assert len(same["model.layers.1.block_sparse_moe.experts.w1"].ranges) == 8
    assert "model.embed_tokens.weight" in stored  # bf16 -> bf16
    wide = dict(stream_weights(ckpt, dtype=torch.float32))  # bf16 -> fp32: converted in memory
    assert isinstance(wide["model.embed_tokens.weight"], torch.Tensor)
    assert isinstance(wide["model.layers.1.block_sparse_moe.experts.w1"], StoredTensor)  # bytes stay bytes


def test_copied_scales_are_still_checked(ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(ckpt, bad)
    name = "language_model.model.layers.1.block_sparse_moe.experts.2.w3.weight_scale"  # the published K3 names
    shard = bad / json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][name]
    tensors = load_file(str(shard))
    tensors[name][0, 0] = 0xFF
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="experts.w3_scale.*0xFF"):
        list(stream_weights(bad, dtype=torch.bfloat16))


@pytest.mark.slow
def test_pt2_and_onnx_stream_without_loading_the_model(ckpt, tmp_path, monkeypatch):
    import k3x.checkpoint.files as checkpoint

    def refuse(*a, **k):
        raise AssertionError("load_checkpoint called: the export loaded the whole model")

    copies = []
    real = os.copy_file_range
    monkeypatch.setattr(checkpoint, "load_checkpoint", refuse)
    monkeypatch.setattr(os, "copy_file_range", lambda *a: copies.append(a[2]) or real(*a))
    out = tmp_path / "out"
    export(ExportOptions((Target.PT2, Target.ONNX), out, checkpoint=ckpt, dtype="bf16"))
    monkeypatch.undo()
    assert copies  # file-to-file copies, not reads into memory

    from k3x.fileio import sha256

    manifest = json.loads((out / "manifest.json").read_text())
    for art in ("pt2", "onnx"):  # digests taken while writing == the files' bytes
        for f in manifest["artifacts"][art]["files"]:
            assert f["sha256"] == sha256(out / f["path"]), f["path"]
    with zipfile.ZipFile(out / "model.pt2") as z:
        assert z.testzip() is None  # every CRC matches
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
    with checked_pt2(out / "model.pt2") as f:
        ep = load_pt2(f)
    ref = load_checkpoint(ckpt, dtype=torch.bfloat16).state_dict()
    assert set(ep.state_dict) == set(ref)
    for name, t in ep.state_dict.items():
        assert t.device.type == "cpu" and torch.equal(t, ref[name]), name

    from k3x.runtime.runners import make_runner
    from k3x.runtime.verify import run_parity

    eager = make_runner("eager", out)
    report = run_parity(eager, [make_runner("pt2", out)], eager.module.cfg, steps=1, prompt_len=3, dtype=torch.bfloat16)
    assert report.ok, report.table()


def test_a_stream_that_lacks_a_weight_is_named(ckpt, tmp_path):
    from k3x.exporter.pt2_weights import save_streamed_pt2
    from k3x.exporter.trace import trace

    loaded = load_checkpoint(ckpt, dtype=torch.bfloat16)  # packed experts, as stored: the build says so
    ep = trace(build_model(loaded.cfg, loaded.build, device="meta", dtype=torch.bfloat16, seed=None))
    partial = (kv for kv in stream_weights(ckpt, dtype=torch.bfloat16) if "lm_head" not in kv[0])
    with pytest.raises(ValueError, match="not in the checkpoint stream: \\['lm_head.weight'\\]"):
        save_streamed_pt2(ep, tmp_path / "model.pt2", partial)
    wrong = ((n, torch.zeros(t.shape) if n == "lm_head.weight" else t)
             for n, t in stream_weights(ckpt, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight .lm_head.weight.: checkpoint gives torch.float32"):
        save_streamed_pt2(ep, tmp_path / "model2.pt2", wrong)


# peak RSS from VmHWM: ru_maxrss of a child started by fork+exec starts at the parent's (the pytest process)
PROBE = """
import re, sys, torch
from pathlib import Path
from k3x.exporter.options import ExportOptions, Target
from k3x.exporter.pipeline import export

def peak():
    return int(re.search(r"VmHWM:\\s+(\\d+) kB", Path("/proc/self/status").read_text()).group(1)) * 1024

ck, out = Path(sys.argv[1]), Path(sys.argv[2])
export(ExportOptions((Target.PT2,), out / "meta", checkpoint=ck, dtype="bf16", weights=False))
before = peak()
export(ExportOptions((Target.PT2,), out / "weights", checkpoint=ck, dtype="bf16"))
print("RSS", before, peak())
"""


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads VmHWM from /proc (Linux)")
def test_peak_rss_does_not_grow_with_the_model(tmp_path):
    """A 0.33 GB checkpoint (64 experts, largest tensor 16 MiB): exporting its weights raises the peak RSS of a
    process that already traced the same program by at most 2 x the largest tensor (+ 64 MiB slack); the
    whole process stays under the bound of 1 GiB + 2 x the largest tensor. Loading the model (the old path)
    raised it by the checkpoint's size."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("export_weights", ROOT / "bench" / "export_weights.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    mini = preset("k3-mini")
    cfg = dataclasses.replace(mini, name="k3-mini-wide", hidden_size=1024, moe=dataclasses.replace(
        mini.moe, num_experts=64, intermediate_size=512, latent_dim=1024))
    ckpt_bytes = bench.synth_checkpoint(cfg, tmp_path / "ckpt")
    largest = max(t.numel() * t.element_size() for t in build_model(
        cfg, BuildOptions(expert_format="mxfp4"), device="meta", dtype=torch.bfloat16).state_dict().values())
    assert ckpt_bytes > 16 * largest
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / ".pyshim"), os.environ.get("PYTHONPATH")]))}
    r = subprocess.run([sys.executable, "-c", PROBE, str(tmp_path / "ckpt"), str(tmp_path)], capture_output=True,
                       text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    before, after = (int(x) for x in r.stdout.split("RSS")[1].split())
    assert after - before <= 2 * largest + (64 << 20), (before, after, ckpt_bytes)
    assert after <= (1 << 30) + 2 * largest, (after, largest)
    assert (tmp_path / "weights" / "model.pt2").stat().st_size >= ckpt_bytes


def test_copy_ranges_in_many_chunks_sees_every_byte_once_in_order(tmp_path, monkeypatch):
    import hashlib

    import k3x.checkpoint.byte_ranges as cr

    monkeypatch.setattr(cr, "CHUNK", 1000)  # several chunks per range, a short last one
    a, b = tmp_path / "a", tmp_path / "b"
    a.write_bytes(os.urandom(10_000))
    b.write_bytes(os.urandom(7_777))
    ranges = (cr.ByteRange(a, 123, 4_567), cr.ByteRange(b, 0, 7_777), cr.ByteRange(a, 9_000, 1_000))
    want = a.read_bytes()[123:4_690] + b.read_bytes() + a.read_bytes()[9_000:]
    seen, chunks = hashlib.sha256(), []
    with open(tmp_path / "out", "wb") as f:
        f.write(b"head")
        cr.copy_ranges(ranges, f, see=(seen.update, chunks.append))
        f.write(b"tail")
    assert (tmp_path / "out").read_bytes() == b"head" + want + b"tail"
    assert seen.hexdigest() == hashlib.sha256(want).hexdigest() and b"".join(chunks) == want
    assert max(map(len, chunks)) == 1000
    with open(tmp_path / "short", "wb") as f, pytest.raises(OSError, match="short read"):
        cr.copy_ranges((cr.ByteRange(b, 7_000, 1_000),), f, see=(seen.update,))  # past the end of b


def test_zip64_records_read_back(ckpt, tmp_path, monkeypatch):
    """Records and offsets past 4 GiB (K3's stacked experts: 4.9 GB) take zip64 fields; with the threshold
    lowered every record does, and zipfile and torch.export.load (through k3x's strict zip check, which must
    accept zip64 fields and data descriptors) still read the archive exactly."""
    import k3x.exporter.pt2_weights as pw
    from k3x.exporter.trace import load_pt2
    from k3x.folder.trust import checked_pt2

    monkeypatch.setattr(pw, "ZIP64_FROM", 1000)
    out = tmp_path / "out"
    export(ExportOptions((Target.PT2,), out, checkpoint=ckpt, dtype="bf16"))
    with zipfile.ZipFile(out / "model.pt2") as z:
        assert z.testzip() is None
        big = [i for i in z.infolist() if i.file_size >= 1000]
        assert big and all(i.header_offset for i in big[1:])
    with checked_pt2(out / "model.pt2") as f:
        ep = load_pt2(f)
    ref = load_checkpoint(ckpt, dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(t, ref[n]) for n, t in ep.state_dict.items())
