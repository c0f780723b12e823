"""The published checkpoint layouts (checkpoint/published.py): a k3x checkpoint converts with the rules an
external converter of the published K3 format applies, and k3x reads the published layout and its own
earlier one (no prefix, `A_log` `[H]`) to the same logits; Kimi Linear configs keep Kimi Linear's layout."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from k3x.checkpoint.files import INDEX, load_checkpoint
from k3x.checkpoint.save import save_checkpoint
from k3x.checkpoint.published import stored_a_log
from k3x.model import build_model, preset
from k3x.runtime.generate import full_logits

P = "language_model."
IDS = torch.tensor([[1, 5, 9, 3, 7, 2], [2, 4, 6, 8, 10, 12]])


def published_rules(config: dict, shapes: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{tensor name as the text model knows it: "mxfp4" | "float"}: how a converter of the published K3 format
    reads a checkpoint (config.json + the stored names and shapes), written from the format's rules as
    llama.cpp's K3 converter applies them: the text config is `text_config` when there is one; the
    `quantization_config` block selects the compressed-tensors MXFP4 path (no block: a KeyError, as there);
    the `language_model.` prefix is stripped; a module's `weight_packed` + `weight_scale` are one MXFP4
    weight; a Linear module (a 2-D weight that is not an embedding) is quantised exactly when no `ignore`
    entry (`re:` regex or exact module name) matches it, so a float Linear weight that is not ignored, or a
    packed one that is, is an error (the converter would read the bytes as the other kind)."""
    block = config["quantization_config"]
    if (block["quant_method"], block["format"]) != ("compressed-tensors", "mxfp4-pack-quantized"):
        raise ValueError(f"quantization {block['quant_method']} {block['format']}: not MXFP4")
    (group,) = block["config_groups"].values()
    weights = group["weights"]
    if group["targets"] != ["Linear"] or (weights["num_bits"], weights["type"], weights["group_size"]) != (4, "float", 32):
        raise ValueError(f"config group {group}: not MXFP4 weights of Linear modules")

    def ignored(module: str) -> bool:
        return any(re.match(p[3:], module) if p.startswith("re:") else p == module for p in block["ignore"])

    out: dict[str, str] = {}
    for name, shape in shapes.items():
        module, _, part = name.rpartition(".")
        if part == "weight_scale":
            continue  # read with its weight_packed
        kind = "mxfp4" if part == "weight_packed" else "float"
        linear = part == "weight_packed" or (part == "weight" and len(shape) == 2 and "embed_tokens" not in module)
        if linear and ignored(module) != (kind == "float"):
            raise ValueError(f"{name}: stored {kind}, but the quantization_config says otherwise")
        out[name.removeprefix(P).removesuffix("_packed")] = kind
    return out


def stored_shapes(folder: Path) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            shapes |= {k: tuple(h.get_slice(k).get_shape()) for k in h.keys()}
    return shapes


def test_a_k3x_checkpoint_converts_with_the_published_rules(mini_cli_export):
    ckpt = mini_cli_export.checkpoint  # `k3x init-checkpoint --preset k3-mini`
    config = json.loads((ckpt / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("kimi_k3", ["KimiK3ForConditionalGeneration"])
    assert config["text_config"]["model_type"] == "kimi_linear"
    assert config["torch_dtype"] == config["text_config"]["torch_dtype"] == "float32"  # what init-checkpoint stores
    weight_map = json.loads((ckpt / INDEX).read_text())["weight_map"]
    shapes = stored_shapes(ckpt)
    assert set(weight_map) == set(shapes) and all(n.startswith(P) for n in weight_map)  # every name prefixed
    kinds = published_rules(config, shapes)
    packed = sorted(n for n, k in kinds.items() if k == "mxfp4")
    assert len(packed) == 5 * 8 * 3  # every routed expert of the 5 MoE layers, w1/w2/w3; nothing else
    assert all(re.fullmatch(r"model\.layers\.\d\.block_sparse_moe\.experts\.\d\.w[123]\.weight", n) for n in packed)
    assert kinds["lm_head.weight"] == kinds["model.layers.1.block_sparse_moe.shared_experts.up_proj.weight"] == "float"
    assert shapes[P + "model.layers.0.self_attn.A_log"] == (16,)  # 4 heads, padded to head_dim 16 as K3 pads 96 to 128
    with pytest.raises(KeyError):  # without the block a converter has no MXFP4 path: the block is what it keys on
        published_rules({k: v for k, v in config.items() if k != "quantization_config"}, shapes)


def test_k3_stores_a_log_as_published():
    a_log = torch.arange(96, dtype=torch.float32) + 1
    stored = stored_a_log(preset("k3"), a_log)
    assert stored.shape == (128,) and torch.equal(stored[:96], a_log) and not stored[96:].any()


def _random_a_log(model) -> None:
    """A_log starts at 0 (K3's init): random values, so a reader taking the wrong entries shows in the logits."""
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, t in model.named_parameters():
            if name.endswith("A_log"):
                t.copy_(torch.rand(t.shape, generator=g) * 2 - 1)


def earlier_layout(src: Path, dst: Path) -> Path:
    """The layout k3x wrote before the published one: names without the prefix, `A_log` `[H]`, no dtype field
    (the quantization_config, which packed experts need, kept)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.pop("torch_dtype")
    config["text_config"].pop("torch_dtype")
    heads = config["text_config"]["linear_attn_config"]["num_heads"]
    (dst / "config.json").write_text(json.dumps(config))
    index = json.loads((dst / INDEX).read_text())
    index["weight_map"] = {k.removeprefix(P): f for k, f in index["weight_map"].items()}
    (dst / INDEX).write_text(json.dumps(index))
    for f in dst.glob("*.safetensors"):
        tensors = {k.removeprefix(P): t[:heads] if k.endswith("A_log") else t for k, t in load_file(str(f)).items()}
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("expert_format", ["mxfp4", "dense"])
def test_published_and_earlier_layouts_load_to_the_same_logits(tmp_path, expert_format):
    model = build_model(preset("k3-mini"), seed=6)
    _random_a_log(model)
    published = save_checkpoint(model, tmp_path / "published", expert_format=expert_format)
    earlier = earlier_layout(published, tmp_path / "earlier")
    assert ("quantization_config" in json.loads((earlier / "config.json").read_text())) == (expert_format == "mxfp4")
    a, b = load_checkpoint(published), load_checkpoint(earlier)
    name = "model.layers.0.self_attn.A_log"
    assert torch.equal(a.state_dict()[name], model.state_dict()[name])
    assert torch.equal(b.state_dict()[name], model.state_dict()[name])
    logits = full_logits(a, IDS)
    assert torch.equal(logits, full_logits(b, IDS))
    if expert_format == "dense":  # dense experts round-trip exactly
        assert torch.equal(logits, full_logits(model, IDS))


def test_kimi_linear_configs_keep_kimi_linears_layout(tmp_path):
    mini = preset("k3-mini")
    cfg = replace(mini, name="kimi-linear-tiny", activation="silu", attn_res=None,
                  kda=replace(mini.kda, gate_lower_bound=None, full_rank_output_gate=False),
                  mla=replace(mini.mla, q_lora_rank=None, output_gate=False),
                  moe=replace(mini.moe, latent_dim=None, latent_norm=False, num_shared_experts=1))
    model = build_model(cfg, seed=2)
    _random_a_log(model)
    path = save_checkpoint(model, tmp_path / "kl")
    config = json.loads((path / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("kimi_linear", ["KimiLinearForCausalLM"])
    assert "text_config" not in config and config["quantization_config"]["format"] == "mxfp4-pack-quantized"
    shapes = stored_shapes(path)
    assert not any(n.startswith(P) for n in shapes)
    assert shapes["model.layers.0.self_attn.A_log"] == (1, 1, 4, 1)  # as Kimi Linear stores it
    assert sum(k == "mxfp4" for k in published_rules(config, shapes).values()) == 5 * 8 * 3
    back = load_checkpoint(path)
    assert back.cfg.kda.gate_lower_bound is None and back.cfg.moe.latent_dim is None
    name = "model.layers.0.self_attn.A_log"
    assert torch.equal(back.state_dict()[name], model.state_dict()[name])
