"""Inputs are bounded by what was traced and by the config, checked before anything runs; bad batch
files and runner failures are one line (exit 1, no traceback)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hostile_util import k3x

from k3x.runtime import ort_runner


def _error_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error")]


def _ids(n: int) -> str:
    return ",".join(["1"] * n)


@pytest.mark.parametrize("backend", ["pt2", "ort"])
def test_prompt_longer_than_the_traced_seq_max_is_refused(export_dir, backend):
    code, out = k3x("run", export_dir, "--backend", backend, "--prompt-ids", _ids(4097), "--max-new-tokens", "1")
    assert code == 1 and "over the exported maximum seq=4096" in out and "Traceback" not in out, out[-500:]


def test_decode_past_the_traced_maximum_or_the_context_length_is_refused(export_dir):
    code, out = k3x("run", export_dir, "--backend", "ort", "--max-new-tokens", str(10**9))
    assert code == 1 and "over the exported maximum past_seq=8192" in out, out
    code, out = k3x("run", export_dir, "--backend", "eager", "--max-new-tokens", "5000")
    assert code == 1 and "context length (max_position_embeddings=4096)" in out, out


def test_decode_past_the_traced_cache_maximum_is_refused(export_dir):
    code, out = k3x("verify", export_dir, "--backends", "ort", "--prompt-len", "4000", "--steps", "4100")
    assert code == 1 and ("past_seq=8192" in out or "context length" in out), out


def test_batch_over_the_traced_maximum_is_refused(export_dir, tmp_path):
    f = tmp_path / "ids.npy"
    np.save(f, np.ones((65, 3), dtype=np.int64))
    code, out = k3x("logits", "--backend", "pt2", "--export-dir", export_dir, "--batch-file", f, "--out",
                    tmp_path / "l.npy")
    assert code == 1 and "batch = 65 is over the exported maximum batch=64" in out, out


def test_eager_prefill_that_cannot_fit_in_memory_is_refused(ckpt_dir, tmp_path):
    f = tmp_path / "ids.npy"
    np.save(f, np.ones((64, 4096), dtype=np.int64))
    code, out = k3x("logits", "--checkpoint", ckpt_dir, "--batch-file", f, "--out", tmp_path / "l.npy")
    assert code == 1 and ("GiB for the prefill" in out), out


def test_npz_batch_file_is_refused(export_dir, tmp_path):
    f = tmp_path / "ids.npz"
    np.savez(f, ids=np.ones((1, 3), dtype=np.int64))
    code, out = k3x("logits", "--backend", "ort", "--export-dir", export_dir, "--batch-file", f, "--out",
                    tmp_path / "l.npy")
    assert code == 1 and ".npz archive" in out and len(_error_lines(out)) == 1, out


def test_npy_header_claiming_8_tib_is_refused(export_dir, tmp_path):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": "<i8", "fortran_order": False, "shape": (1 << 20, 1 << 20)})
    f = tmp_path / "huge.npy"
    f.write_bytes(buf.getvalue() + b"\x00" * 64)
    code, out = k3x("logits", "--backend", "ort", "--export-dir", export_dir, "--batch-file", f, "--out",
                    tmp_path / "l.npy")
    assert code == 1 and "the header says" in out and "Traceback" not in out, out


def test_a_runner_crash_is_one_line(export_dir, monkeypatch):
    def boom(self, feeds):
        raise RuntimeError("ONNX Runtime exploded\n  with a second line\n  and a third")

    monkeypatch.setattr(ort_runner.OrtRunner, "infer", boom)
    code, out = k3x("run", export_dir, "--backend", "ort", "--max-new-tokens", "2")
    assert code == 1 and _error_lines(out) == ["error: backend ort: RuntimeError: ONNX Runtime exploded"], out
