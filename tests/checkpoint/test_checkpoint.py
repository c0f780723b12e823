"""Checkpoint I/O: round trips, MXFP4 experts, sharding, and every bad input named with nothing loaded."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3x.checkpoint.files import CheckpointError, load_checkpoint
from k3x.checkpoint.save import save_checkpoint
from k3x.checkpoint.reference import checkpoint_hash
from k3x.model import build_model, preset
from k3x.model import mxfp4

EXPERT = "model.layers.1.block_sparse_moe.experts"
P = "language_model."  # the published K3 layout's prefix of every stored name (checkpoint/published.py)


@pytest.fixture(scope="module")
def model():
    return build_model(preset("k3-mini"), seed=4)


@pytest.fixture()
def dense_ckpt(tmp_path, model):
    return save_checkpoint(model, tmp_path / "ckpt", expert_format="dense")


def test_dense_round_trip_is_exact(model, dense_ckpt):
    sd, back = model.state_dict(), load_checkpoint(dense_ckpt).state_dict()
    assert sd.keys() == back.keys()
    for k in sd:
        assert torch.equal(sd[k], back[k]), k
    files = load_file(str(next(dense_ckpt.glob("*.safetensors"))))
    assert f"{P}{EXPERT}.7.w2.weight" in files and files[f"{P}{EXPERT}.7.w2.weight"].shape == (64 // 2, 32)


def test_mxfp4_experts_are_dequantised_on_dense_load(tmp_path, model):
    path = save_checkpoint(model, tmp_path / "mx", max_shard_bytes=60_000)
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # sharded
    assert f"{P}{EXPERT}.3.w1.weight_packed" in index["weight_map"]
    loaded = load_checkpoint(path, expert_format="dense")
    w = model.state_dict()[f"{EXPERT}.w1"][3]
    expect = mxfp4.dequantize(*mxfp4.quantize(w))
    assert torch.equal(loaded.state_dict()[f"{EXPERT}.w1"][3], expect)
    assert torch.equal(loaded.state_dict()["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_bf16_load_keeps_gate_params_fp32(dense_ckpt):
    m = load_checkpoint(dense_ckpt, dtype=torch.bfloat16)
    sd = m.state_dict()
    assert sd["lm_head.weight"].dtype == torch.bfloat16
    assert sd["model.layers.0.self_attn.A_log"].dtype == torch.float32


def rewrite(path, edit):
    """Apply `edit(dict) -> dict` to the single shard of a checkpoint (drops the index)."""
    (path / "model.safetensors.index.json").unlink()
    shard = next(path.glob("*.safetensors"))
    tensors = edit(load_file(str(shard)))
    shard.unlink()
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("edit,message", [
    (lambda t: {k: v for k, v in t.items() if k != P + "lm_head.weight"}, "missing tensor 'lm_head.weight'"),
    (lambda t: {k: v for k, v in t.items() if k != f"{P}{EXPERT}.5.w3.weight"}, f"missing tensor {EXPERT}.5.w3.weight"),
    (lambda t: t | {P + "model.layers.0.self_attn.bogus": torch.zeros(2)},
     f"unexpected tensor '{P}model.layers.0.self_attn.bogus'"),
    (lambda t: t | {P + "model.norm.weight": torch.zeros(65)}, r"'language_model.model.norm.weight' .* shape \[65\], expected \[64\]"),
    (lambda t: t | {P + "model.norm.weight": torch.zeros(64, dtype=torch.int32)}, f"'{P}model.norm.weight' .* dtype I32"),
], ids=["missing", "missing-expert", "unexpected", "shape", "dtype"])
def test_bad_tensors_are_named(dense_ckpt, edit, message):
    rewrite(dense_ckpt, edit)
    with pytest.raises(CheckpointError, match=message):
        load_checkpoint(dense_ckpt)


def test_a_log_stored_longer_than_heads(dense_ckpt, model):
    name = "model.layers.0.self_attn.A_log"
    real = model.state_dict()[name]
    rewrite(dense_ckpt, lambda t: t | {P + name: torch.cat([real, torch.full((5,), 99.0)])})
    assert torch.equal(load_checkpoint(dense_ckpt).state_dict()[name], real)


def test_names_without_the_prefix_and_vision_tensors(dense_ckpt, model):
    rewrite(dense_ckpt, lambda t: {k.removeprefix(P): v for k, v in t.items()}
            | {"vision_tower.patch_embed.weight": torch.zeros(3)})
    back = load_checkpoint(dense_ckpt).state_dict()
    assert torch.equal(back["lm_head.weight"], model.state_dict()["lm_head.weight"])


def test_truncated_file(dense_ckpt):
    shard = next(dense_ckpt.glob("*.safetensors"))
    shard.write_bytes(shard.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match=shard.name):
        load_checkpoint(dense_ckpt)


def test_corrupt_header(dense_ckpt):
    shard = next(dense_ckpt.glob("*.safetensors"))
    shard.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="not a readable safetensors"):
        load_checkpoint(dense_ckpt)


def test_config_that_does_not_match_weights(dense_ckpt):
    cfg = json.loads((dense_ckpt / "config.json").read_text())
    cfg["text_config"]["hidden_size"] = 96
    (dense_ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="does config.json match"):
        load_checkpoint(dense_ckpt)


def test_missing_shard_and_missing_config(dense_ckpt, tmp_path):
    next(dense_ckpt.glob("*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match="shard file"):
        load_checkpoint(dense_ckpt)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_checkpoint(tmp_path)


def test_save_is_atomic_and_refuses_non_empty(tmp_path, model, monkeypatch):
    import k3x.checkpoint.save as ck

    def boom(*a, **k):
        raise RuntimeError("disk full")

    monkeypatch.setattr(ck, "save_file", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        save_checkpoint(model, tmp_path / "x")
    assert list(tmp_path.iterdir()) == []  # nothing half-written
    monkeypatch.undo()
    save_checkpoint(model, tmp_path / "x", expert_format="dense")
    with pytest.raises(FileExistsError):
        save_checkpoint(model, tmp_path / "x")


def test_hash_changes_with_weights(dense_ckpt):
    h = checkpoint_hash(dense_ckpt)
    assert h == checkpoint_hash(dense_ckpt)
    rewrite(dense_ckpt, lambda t: t | {P + "model.norm.weight": t[P + "model.norm.weight"] + 1})
    assert checkpoint_hash(dense_ckpt) != h


def test_saved_folder_has_normal_permissions(tmp_path, model):
    import os

    umask = os.umask(0)
    os.umask(umask)
    path = save_checkpoint(model, tmp_path / "perm", expert_format="dense")
    assert path.stat().st_mode & 0o777 == 0o777 & ~umask  # not mkdtemp's 0700


def test_kimi_linear_a_log_layout(dense_ckpt, model):
    name = "model.layers.0.self_attn.A_log"
    real = model.state_dict()[name]
    rewrite(dense_ckpt, lambda t: t | {P + name: real.view(1, 1, -1, 1)})  # Kimi Linear stores [1, 1, H, 1]
    assert torch.equal(load_checkpoint(dense_ckpt).state_dict()[name], real)


def test_mxfp4_nan_scale_is_named(tmp_path, model):
    path = save_checkpoint(model, tmp_path / "mx")
    shard = next(path.glob("*.safetensors"))
    t = load_file(str(shard))
    key = f"{P}{EXPERT}.2.w2.weight_scale"
    t[key] = torch.full_like(t[key], 0xFF)
    save_file(t, str(shard))
    with pytest.raises(CheckpointError, match=f"{key}.*0xFF"):
        load_checkpoint(path)
