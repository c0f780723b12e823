"""MXFP4 experts kept packed: an MXFP4 checkpoint loads as uint8 nibbles + E8M0 scales (the checkpoint's bytes),
the model runs `k3::moe_mxfp4`, and its outputs equal the dense-decoded model's bit for bit in fp32."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3x.checkpoint.files import CheckpointError, load_checkpoint
from k3x.checkpoint.save import save_checkpoint
from k3x.model import build_model, mxfp4, preset
from k3x.model.options import BuildOptions
from k3x.model.state import empty_state

EXPERT = "model.layers.1.block_sparse_moe.experts"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_checkpoint(build_model(preset("k3-mini"), seed=5), tmp_path_factory.mktemp("mx") / "ckpt",
                           max_shard_bytes=200_000)


def test_mxfp4_checkpoint_loads_packed_with_the_checkpoint_bytes(ckpt):
    from safetensors import safe_open

    m = load_checkpoint(ckpt)
    assert m.build.expert_format == "mxfp4"
    sd = m.state_dict()
    assert sd[f"{EXPERT}.w1"].dtype == torch.uint8 and sd[f"{EXPERT}.w1"].shape == (8, 32, 16)  # [E, I, L/2]
    assert sd[f"{EXPERT}.w2_scale"].shape == (8, 32, 1)  # [E, L, I/32]
    stored = {}
    for f in ckpt.glob("*.safetensors"):
        with safe_open(str(f), "pt") as h:
            stored |= {k: h.get_tensor(k) for k in h.keys()}
    held = sum(t.nbytes for t in sd.values())
    total = sum(t.nbytes for t in stored.values())
    assert abs(held - total) <= 0.05 * total, (held, total)
    stored = {k.removeprefix("language_model."): t for k, t in stored.items()}  # the published K3 layout's prefix
    assert torch.equal(sd[f"{EXPERT}.w1"][3], stored[f"{EXPERT}.3.w1.weight_packed"])  # the stored bytes
    assert torch.equal(sd[f"{EXPERT}.w2_scale"][7], stored[f"{EXPERT}.7.w2.weight_scale"])


def test_packed_eager_equals_dense_decoded_eager_bitwise(ckpt):
    packed, dense = load_checkpoint(ckpt), load_checkpoint(ckpt, expert_format="dense")
    assert dense.state_dict()[f"{EXPERT}.w1"].dtype == torch.float32
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    a, pa = packed(ids, empty_state(packed.cfg, 2))
    b, pb = dense(ids, empty_state(dense.cfg, 2))
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(pa, pb))


def test_packed_model_saves_the_same_bytes(ckpt, tmp_path):
    again = save_checkpoint(load_checkpoint(ckpt), tmp_path / "again", max_shard_bytes=200_000)
    for f in ckpt.glob("*.safetensors"):
        assert (again / f.name).read_bytes() == f.read_bytes(), f.name
    with pytest.raises(ValueError, match="holds MXFP4 experts"):
        save_checkpoint(load_checkpoint(ckpt), tmp_path / "dense", expert_format="dense")


def test_dense_checkpoint_cannot_load_packed(tmp_path):
    path = save_checkpoint(build_model(preset("k3-mini"), seed=1), tmp_path / "d", expert_format="dense")
    assert load_checkpoint(path).build.expert_format == "dense"
    with pytest.raises(CheckpointError, match=r"experts\.0\.w1\.weight.*expert_format='dense'"):
        load_checkpoint(path, expert_format="mxfp4")


def test_nan_scale_is_refused_when_loading_packed(ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    bad = shutil.copytree(ckpt, tmp_path / "bad")
    shard = next(f for f in sorted(bad.glob("*.safetensors")) if any("weight_scale" in k for k in load_file(str(f))))
    tensors = load_file(str(shard))
    key = next(k for k in tensors if k.endswith("weight_scale"))
    tensors[key][0, 0] = 0xFF
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"{key}.*0xFF"):
        load_checkpoint(bad)


def test_random_packed_preset_and_mxfp4_limits():
    cfg, packed = preset("k3-mini"), BuildOptions(expert_format="mxfp4")
    m = build_model(cfg, packed, seed=0)
    e = dict(m.named_parameters())
    w = mxfp4.dequantize(e[f"{EXPERT}.w1"][0], e[f"{EXPERT}.w1_scale"][0])
    assert 0.05 < w.std() < 0.5  # ~ N(0, 1/L), L = 32
    from k3x.model.config import ConfigError

    odd = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, intermediate_size=40))
    BuildOptions().check(odd)  # dense experts have no such limit
    with pytest.raises(ConfigError, match="moe.intermediate_size=40: MXFP4"):
        packed.check(odd)
    with pytest.raises(ConfigError, match="moe.intermediate_size=40: MXFP4"):
        build_model(odd, packed, device="meta", seed=None)  # refused before anything is built
