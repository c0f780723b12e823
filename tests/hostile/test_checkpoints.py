"""A checkpoint folder is confined and consistent: shards outside it (index paths, absolute paths,
symlinks) are refused, duplicates and index/shard disagreements are named, the hash covers exactly the
files used, each shard is opened once, files are readable by others."""

from __future__ import annotations

import json
import os
import shutil
import stat

import pytest
from hostile_util import k3x
from safetensors.torch import load_file, save_file

from k3x.checkpoint import files as ckpt_mod
from k3x.checkpoint.files import INDEX, CheckpointError, load_checkpoint
from k3x.checkpoint.reference import checkpoint_hash

SHARD = "model-00001-of-00001.safetensors"
HEAD = "language_model.lm_head.weight"  # as the published K3 layout stores it


def _index(ckpt):
    return json.loads((ckpt / INDEX).read_text())


def _write_index(ckpt, data):
    (ckpt / INDEX).write_text(json.dumps(data))


@pytest.mark.parametrize("how", ["relative", "absolute", "symlink"])
def test_shard_outside_the_folder_is_refused(ckpt_dir, tmp_path, how):
    other = tmp_path / "other"
    other.mkdir()
    shutil.move(ckpt_dir / SHARD, other / SHARD)
    idx = _index(ckpt_dir)
    if how == "symlink":
        os.symlink(other / SHARD, ckpt_dir / SHARD)
    else:
        name = f"../other/{SHARD}" if how == "relative" else str(other / SHARD)
        idx["weight_map"] = {k: name for k in idx["weight_map"]}
        _write_index(ckpt_dir, idx)
    with pytest.raises(CheckpointError, match="outside"):
        load_checkpoint(ckpt_dir)
    with pytest.raises(CheckpointError, match="outside"):
        checkpoint_hash(ckpt_dir)
    code, out = k3x("generate", "--checkpoint", ckpt_dir, "--max-new-tokens", "1")
    assert code == 1 and "outside" in out, out


def _split(ckpt, duplicate: str | None = None):
    """Split the one shard into two (no index), optionally with `duplicate` in both."""
    tensors = load_file(ckpt / SHARD)
    names = sorted(tensors)
    half = len(names) // 2
    a = {k: tensors[k] for k in names[:half]}
    b = {k: tensors[k] for k in names[half:]}
    if duplicate:
        a[duplicate] = b[duplicate] = tensors[duplicate]
    (ckpt / SHARD).unlink()
    save_file(a, str(ckpt / "a.safetensors"))
    save_file(b, str(ckpt / "b.safetensors"))
    return names


def test_duplicate_tensor_across_shards_without_index_is_named(ckpt_dir):
    (ckpt_dir / INDEX).unlink()
    names = _split(ckpt_dir, duplicate=HEAD)
    assert len(names) > 2
    with pytest.raises(CheckpointError, match=f"'{HEAD}' is in both a.safetensors and b.safetensors"):
        load_checkpoint(ckpt_dir)


def test_tensor_in_a_shard_but_not_in_the_index_is_named(ckpt_dir):
    idx = _index(ckpt_dir)
    del idx["weight_map"][HEAD]
    _write_index(ckpt_dir, idx)
    with pytest.raises(CheckpointError, match=f"'{HEAD}' is in this shard but not in"):
        load_checkpoint(ckpt_dir)


def test_split_checkpoint_without_index_loads(ckpt_dir):
    (ckpt_dir / INDEX).unlink()
    _split(ckpt_dir)
    assert load_checkpoint(ckpt_dir).cfg.name == "k3-mini"


def test_hash_covers_exactly_the_files_used(ckpt_dir):
    h = checkpoint_hash(ckpt_dir)
    (ckpt_dir / "notes.json").write_text("{}")  # not a weight file: no change
    (ckpt_dir / "unused.safetensors").write_bytes(b"")  # not named by the index: no change
    assert checkpoint_hash(ckpt_dir) == h
    data = bytearray((ckpt_dir / SHARD).read_bytes())
    data[-1] ^= 1
    (ckpt_dir / SHARD).write_bytes(bytes(data))
    assert checkpoint_hash(ckpt_dir) != h


def test_each_shard_is_opened_once(ckpt_dir, monkeypatch):
    opened = []
    real = ckpt_mod._open
    monkeypatch.setattr(ckpt_mod, "_open", lambda f: opened.append(f) or real(f))
    load_checkpoint(ckpt_dir)
    assert len(opened) == 1, opened


def test_checkpoint_files_are_readable_by_others(built):
    for f in (built / "ckpt").iterdir():
        assert f.stat().st_mode & stat.S_IROTH, f
