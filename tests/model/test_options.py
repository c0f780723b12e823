"""Build and cache options apart from the architecture (model/options.py): the config hash is the
architecture's alone and unchanged for every preset; manifests from before the `options` entry still open."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k3x.model import build_model, preset
from k3x.model.config import PRESETS, ConfigError, K3Config
from k3x.model.options import BuildOptions, CacheOptions, ModelOptions
from k3x.plan.kernels import Kernels

# K3Config.hash() of every preset as manifests recorded it before the options left the config (reference
# kernels, dense experts, no static cache); k3-mini's 3-head architecture is the one before issue 19.
HASHES = {"k3": "41fdefcab8e95267", "kimi-linear-48b": "a1fcf045c78b103f", "k3-bench": "4fc2a43a7b36fdbe",
          "kimi-linear-mid": "58acfe42af6de91e",
          "k3-mini": "bd9488f7d2359da8"}
K3_MINI_3_HEADS = "9ada921bcb210405"


def test_every_preset_keeps_its_hash_and_the_config_holds_no_option():
    assert set(HASHES) == set(PRESETS)
    for name, cfg in PRESETS.items():
        assert cfg.hash() == HASHES[name], name
        assert not {"kernels", "expert_format", "max_context"} & set(cfg.to_dict()), name
    mini = preset("k3-mini")
    three = dataclasses.replace(mini, kda=dataclasses.replace(mini.kda, num_heads=3),
                                mla=dataclasses.replace(mini.mla, num_heads=3))
    assert three.hash() == K3_MINI_3_HEADS


def test_options_are_frozen_checked_and_round_trip():
    o = ModelOptions(BuildOptions(Kernels.TRITON, "mxfp4"), CacheOptions(64))
    assert o.to_dict() == {"kernels": "triton", "expert_format": "mxfp4", "activations": "bf16", "trunk": "dense",
                           "max_context": 64}
    assert ModelOptions.from_dict(json.loads(json.dumps(o.to_dict()))) == o
    w4a8 = ModelOptions(BuildOptions(Kernels.TRITON, "mxfp4", "mxfp8"))
    assert w4a8.to_dict()["activations"] == "mxfp8" and ModelOptions.from_dict(w4a8.to_dict()) == w4a8
    assert ModelOptions.from_dict({"expert_format": "mxfp4"}).build.activations == "bf16"  # manifests before it
    with pytest.raises(ConfigError, match="^activations='fp8': must be 'bf16' or 'mxfp8'$"):
        BuildOptions(expert_format="mxfp4", activations="fp8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^activations='mxfp8': .*needs expert_format='mxfp4'$"):
        BuildOptions(activations="mxfp8")
    assert BuildOptions("triton").kernels is Kernels.TRITON  # the CLI's string value
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.cache.max_context = 8  # type: ignore[misc]
    with pytest.raises(ConfigError, match="^expert_format='int8': must be 'dense' or 'mxfp4'$"):
        BuildOptions(expert_format="int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="^kernels='cuda': must be one of"):
        BuildOptions("cuda")  # type: ignore[arg-type]


def test_the_model_is_built_as_the_options_say():
    cfg = preset("k3-mini")
    packed = build_model(cfg, BuildOptions(expert_format="mxfp4"), device="meta", seed=None)
    dense = build_model(cfg, device="meta", seed=None)
    key = "model.layers.1.block_sparse_moe.experts.w1"
    assert packed.cfg == dense.cfg == cfg and packed.build.packed and not dense.build.packed
    assert packed.state_dict()[key].dtype != dense.state_dict()[key].dtype
    w4a8 = build_model(cfg, BuildOptions(expert_format="mxfp4", activations="mxfp8"), device="meta", seed=None)
    assert w4a8.model.layers[1].block_sparse_moe.activations == "mxfp8"
    assert packed.model.layers[1].block_sparse_moe.activations == "bf16"


def test_a_manifest_from_before_the_options_entry_opens_with_its_options_and_hash(tmp_path):
    """Older manifests kept kernels / expert_format / max_context inside `config` (and hashed them): the
    architecture reads back with the recorded hash, the options from the config's keys."""
    from typer.testing import CliRunner

    from k3x.cli import app
    from k3x.folder.artifacts import MANIFEST, ExportFolder

    out = tmp_path / "ex"
    r = CliRunner().invoke(app, ["export", "--preset", "k3-mini", "--no-weights", "--out", str(out)])
    assert r.exit_code == 0, r.output
    m = json.loads((out / MANIFEST).read_text())
    assert m["options"] == {"kernels": "reference", "expert_format": "dense", "activations": "bf16",
                            "trunk": "dense", "max_context": None}
    assert m["config_hash"] == HASHES["k3-mini"]
    old = {k: v for k, v in m.items() if k != "options"}
    old["state"] = [s["input"] for s in m["state"]["tensors"]]  # before the state contract: a list of names
    old["config"] = {**m["config"], "kernels": "reference", "expert_format": "dense"}  # as 0.x wrote it
    (out / MANIFEST).write_text(json.dumps(old))
    folder = ExportFolder.open(out)
    assert folder.config() == preset("k3-mini") and folder.config().hash() == old["config_hash"]
    assert folder.options() == ModelOptions()
    old["config"] |= {"backend": "triton", "expert_format": "mxfp4", "max_context": 32}  # pre-0.2 "backend"
    del old["config"]["kernels"]
    (out / MANIFEST).write_text(json.dumps(old))
    assert ExportFolder.open(out).options() == ModelOptions(BuildOptions(Kernels.TRITON, "mxfp4"), CacheOptions(32))
    assert K3Config.from_dict(old["config"]) == preset("k3-mini")


def test_a_bad_options_entry_is_one_line_naming_it(tmp_path):
    from k3x.folder.artifacts import MANIFEST, ExportFolder, ManifestError, init_manifest

    init_manifest(tmp_path, preset("k3-mini"), dtype=__import__("torch").float32, weights=False, op_counts={})
    m = json.loads((tmp_path / MANIFEST).read_text())
    m["options"]["expert_format"] = "fp8"
    (tmp_path / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(ManifestError, match=r"manifest.json: options: expert_format='fp8': must be 'dense' or"):
        ExportFolder.open(tmp_path).options()
