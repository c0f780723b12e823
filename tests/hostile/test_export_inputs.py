"""Hostile values around exports: engine profiles past the exported dims, `build-engine` on a read-only folder
or a full disk, non-integer rank counts and malformed rank lists in a manifest, GenAI token ids that are not
tokens, and terminal escape sequences in names and paths. Each is one `error:` line (or a note), exit 1."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess

import pytest
from hostile_util import edit_manifest, k3x

from k3x.exporter import engine


def _errors(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("error")]


PROFILES = [
    (["--max", "batch=1000000000"], "dim 'batch': profile 1..1000000000 leaves the exported range 1..64"),
    (["--min", "batch=0"], "dim 'batch': profile 0..64 leaves the exported range 1..64"),
    (["--max", "past_seq=8193"], "leaves the exported range 0..8192"),
    (["--max", "batch=²"], "--max 'batch=²': expected NAME=INT"),
    (["--opt", "seq=99999999999999999999"], "expected NAME=INT"),
]


@pytest.mark.parametrize("flags,expected", PROFILES, ids=[" ".join(f[0]) for f in PROFILES])
def test_engine_profile_outside_the_exported_dims_is_one_line(export_dir, flags, expected):
    code, out = k3x("build-engine", export_dir, *flags)
    errors = _errors(out)
    assert code == 1 and len(errors) == 1 and expected in errors[0] and "CRASH" not in out, out


def test_build_engine_on_a_folder_without_a_valid_manifest_is_one_line(export_dir):
    (export_dir / "manifest.json").write_text("[]")
    code, out = k3x("build-engine", export_dir)
    assert code == 1 and len(_errors(out)) == 1 and "manifest.json" in out and "CRASH" not in out, out


@contextlib.contextmanager
def _read_only_copy(src, tmp_path):
    """A copy of `src` in a read-only folder: chmod for a user, a read-only tmpfs for root (who ignores modes)."""
    if os.geteuid() != 0:
        dst = tmp_path / "ro" / "export"
        shutil.copytree(src, dst)
        for p in (dst, dst.parent):
            p.chmod(0o555)
        try:
            yield dst
        finally:
            for p in (dst.parent, dst):
                p.chmod(0o755)
        return
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("root without the right to mount a tmpfs: no read-only folder to test")
    try:
        shutil.copytree(src, mnt / "export")
        subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
        yield mnt / "export"
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_build_engine_on_a_read_only_folder_is_one_line(export_dir, tmp_path):
    with _read_only_copy(export_dir, tmp_path) as ro:
        code, out = k3x("build-engine", ro)
        assert code == 1 and _errors(out) == [f"error: {ro}: read-only; build-engine writes model.engine and "
                                              "model.engine.json there"], out


def test_build_engine_on_a_full_disk_is_one_line_and_writes_nothing(export_dir, monkeypatch):
    """The TensorRT build is replaced (none here); the engine's write goes through the real write_artifact
    into /dev/full, which fails with ENOSPC as a full disk does."""
    before = {p.name: p.read_bytes() for p in export_dir.iterdir()}

    def build_then_write_to_a_full_disk(export_dir, options):
        with engine.write_artifact(export_dir, "trt") as tmp:
            (tmp / engine.ENGINE_FILE).write_bytes(b"half an engine")
            with open("/dev/full", "wb") as full:
                full.write(b"\0" * (1 << 20))
                full.flush()

    monkeypatch.setattr(engine, "_build_engine", build_then_write_to_a_full_disk)
    code, out = k3x("build-engine", export_dir)
    assert code == 1 and len(_errors(out)) == 1 and "No space left on device" in out and "nothing was written" in out
    assert {p.name: p.read_bytes() for p in export_dir.iterdir()} == before


RANKS = [
    ("tp 2.9", {"tp": 2.9, "ep": 1}, "parallel: tp=2.9: must be an integer"),
    ("ep a string", {"tp": 1, "ep": "2"}, "parallel: ep='2': must be an integer"),
    ("ranks of integers", {"tp": 1, "ep": 1, "ranks": [0]}, "parallel: ranks must be a list of objects"),
]


@pytest.mark.parametrize("case,parallel,expected", RANKS, ids=[c[0] for c in RANKS])
def test_malformed_rank_entry_in_the_manifest_is_one_line(export_dir, case, parallel, expected):
    edit_manifest(export_dir, lambda m: m.update(parallel={"ranks": [{"rank": 0, "dir": "."}], **parallel}))
    code, out = k3x("run", export_dir, "--max-new-tokens", "1")
    assert code == 1 and len(_errors(out)) == 1 and expected in out, out


def test_genai_token_id_outside_the_vocabulary_writes_no_genai_config(ckpt_dir, tmp_path):
    gen = json.loads((ckpt_dir / "generation_config.json").read_text())
    (ckpt_dir / "generation_config.json").write_text(json.dumps({**gen, "bos_token_id": float("inf")}))
    code, out = k3x("export", "--checkpoint", ckpt_dir, "--target", "onnx", "--out", tmp_path / "e")
    assert code == 0 and "genai: skipped — bos_token_id=inf" in out, out
    assert not (tmp_path / "e" / "genai_config.json").exists()


def test_genai_eos_outside_the_vocabulary_is_named():
    from k3x.exporter.genai import _outside_vocab
    from k3x.model.config import preset

    cfg = preset("k3-mini")
    assert _outside_vocab(cfg, None, (2, cfg.vocab_size)) == f"eos_token_id={cfg.vocab_size}"
    assert _outside_vocab(cfg, 1, (2,)) is None


def test_config_name_with_terminal_escapes_is_printed_escaped(ckpt_dir):
    c = json.loads((ckpt_dir / "config.json").read_text())
    (ckpt_dir / "config.json").write_text(json.dumps({**c, "_name_or_path": "\x1b]0;pwned\x07\x1b[2J"}))
    code, out = k3x("inspect", "--checkpoint", ckpt_dir)
    assert code == 0 and "\x1b" not in out and "\x07" not in out and "\\x1b]0;pwned\\x07\\x1b[2J" in out, out


def test_path_with_terminal_escapes_in_an_error_is_escaped(ckpt_dir, tmp_path):
    hostile = tmp_path / "ck\x1b[2Jpt"
    ckpt_dir.rename(hostile)
    (hostile / "config.json").write_text("{")
    code, out = k3x("inspect", "--checkpoint", hostile)
    assert code == 1 and "\x1b" not in out and "ck\\x1b[2Jpt" in out, out


def test_a_failing_sharded_export_is_one_line(ckpt_dir, tmp_path):
    code, out = k3x("export", "--checkpoint", ckpt_dir, "--tp", "3", "--out", tmp_path / "e")
    assert code == 1 and _errors(out) == ["error: kda.num_heads=4: not divisible by tp=3"], out
