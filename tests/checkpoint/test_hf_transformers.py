"""Kimi-Linear checkpoints written by Hugging Face transformers 5.x load in k3x and match transformers' logits.

A tiny `kimi_linear` model (random init, fp32) is built with transformers itself, saved with
`save_pretrained`, loaded by k3x, and compared: full prefill, then prefill-then-decode with carried
state, against transformers' own forward (relative error <= 1e-5). Both config styles are checked
(transformers-5 `layer_types` style as written, and the published `linear_attn_config` style).
transformers resolves its KDA / conv functions to fla's Triton kernels when fla is installed; on a
CPU machine the test points them back at transformers' own PyTorch paths (`__wrapped__`).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from k3x.checkpoint.files import CheckpointError, load_checkpoint
from k3x.checkpoint.hf_config import config_from_hf
from k3x.checkpoint.hf_transformers import rename_weight, to_published
from k3x.model.config import ConfigError
from k3x.model.state import empty_state

transformers = pytest.importorskip("transformers")

T_PREFILL, T_DECODE = 70, 4  # prefill longer than one KDA chunk (64)
TORCH_PATHS = ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention", "causal_conv1d_fn",
               "causal_conv1d_update")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def tf_model():
    import transformers.models.kimi_linear.modeling_kimi_linear as mk

    saved = {n: getattr(mk, n) for n in TORCH_PATHS}
    for n in TORCH_PATHS:  # transformers' PyTorch reference instead of fla's Triton kernels (no GPU here)
        setattr(mk, n, getattr(saved[n], "__wrapped__", saved[n]))
    cfg = transformers.KimiLinearConfig(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=8, num_local_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        linear_head_dim=8, linear_num_heads=2,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], initializer_range=0.1,
        pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(cfg).eval()
    with torch.no_grad():  # non-trivial routing and norms (the init leaves bias 0 and norms 1)
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("e_score_correction_bias", "norm.weight")):
                t.add_(0.3 * torch.randn(t.shape))
    yield model
    for n, f in saved.items():
        setattr(mk, n, f)


@pytest.fixture(scope="module")
def tf_ckpt(tf_model, tmp_path_factory):
    path = tmp_path_factory.mktemp("tf") / "kimi-linear-tiny"
    tf_model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 96, (2, T_PREFILL + T_DECODE), generator=torch.Generator().manual_seed(1))


def _k3x_logits(path, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(full-sequence logits, logits of prefill T_PREFILL then T_DECODE single-token steps)."""
    model = load_checkpoint(path)
    with torch.no_grad():
        full, _ = model(ids, empty_state(model.cfg, ids.shape[0]))
        out, state = model(ids[:, :T_PREFILL], empty_state(model.cfg, ids.shape[0]))
        steps = [out]
        for t in range(T_PREFILL, ids.shape[1]):
            out, state = model(ids[:, t:t + 1], state)
            steps.append(out)
    return full, torch.cat(steps, 1)


def _tf_logits(model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        full = model(ids).logits
        r = model(ids[:, :T_PREFILL], use_cache=True)
        steps, cache = [r.logits], r.cache
        for t in range(T_PREFILL, ids.shape[1]):
            r = model(ids[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(r.logits)
            cache = r.cache
    return full, torch.cat(steps, 1)


def test_transformers_checkpoint_matches_transformers_logits(tf_model, tf_ckpt, ids):
    names = json.loads((tf_ckpt / "config.json").read_text())
    assert "layer_types" in names and "linear_attn_config" not in names  # transformers-5 style as written
    full, stepped = _k3x_logits(tf_ckpt, ids)
    ref_full, ref_stepped = _tf_logits(tf_model, ids)
    assert ref_full.abs().max() > 0.1  # a signal worth comparing
    assert _rel(full, ref_full) <= 1e-5
    assert _rel(stepped, ref_stepped) <= 1e-5
    assert _rel(stepped, ref_full) <= 1e-5  # prefill-then-decode == one full forward


def test_published_config_style_loads_the_same_weights(tf_ckpt, tmp_path, ids):
    import shutil

    raw = json.loads((tf_ckpt / "config.json").read_text())
    for key in ("layer_types", "mlp_layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        raw.pop(key)
    raw["linear_attn_config"] = {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                                 "kda_layers": [1, 3], "full_attn_layers": [2, 4]}
    raw["first_k_dense_replace"], raw["moe_layer_freq"] = 1, 1
    pub = tmp_path / "published"
    shutil.copytree(tf_ckpt, pub)
    (pub / "config.json").write_text(json.dumps(raw))
    same_name = lambda c: dataclasses.replace(c, name="x")  # noqa: E731 (the name is the folder's)
    assert same_name(config_from_hf(pub)) == same_name(config_from_hf(tf_ckpt))
    assert torch.equal(_k3x_logits(pub, ids)[0], _k3x_logits(tf_ckpt, ids)[0])


def test_dense_mlp_written_under_block_sparse_moe_is_renamed():
    assert rename_weight("model.layers.0.block_sparse_moe.gate_proj.weight") == "model.layers.0.mlp.gate_proj.weight"
    assert rename_weight("model.layers.7.block_sparse_moe.down_proj.weight") == "model.layers.7.mlp.down_proj.weight"
    for kept in ("model.layers.1.block_sparse_moe.gate.weight",
                 "model.layers.1.block_sparse_moe.shared_experts.gate_proj.weight",
                 "model.layers.1.block_sparse_moe.experts.0.w1.weight"):
        assert rename_weight(kept) == kept


def test_both_names_for_one_tensor_are_refused(tf_ckpt, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    dup = tmp_path / "dup"
    shutil.copytree(tf_ckpt, dup)
    tensors = load_file(str(dup / "model.safetensors"))
    tensors["model.layers.0.mlp.up_proj.weight"] = tensors["model.layers.0.block_sparse_moe.up_proj.weight"].clone()
    save_file(tensors, str(dup / "model.safetensors"))
    with pytest.raises(CheckpointError, match="both fill 'model.layers.0.mlp.up_proj.weight'"):
        load_checkpoint(dup)


BASE = {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
        "mlp_layer_types": ["dense", "sparse"], "linear_num_heads": 2, "linear_head_dim": 8}


def test_transformers_style_maps_to_published():
    out = to_published({**BASE, "model_max_length": 4096, "num_local_experts": 4}, "c")
    assert out["linear_attn_config"] == {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4,
                                         "kda_layers": [1], "full_attn_layers": [2]}
    assert out["max_position_embeddings"] == 4096 and out["num_experts"] == 4
    assert out["num_shared_experts"] == 1 and out["routed_scaling_factor"] == 2.446  # transformers' defaults


@pytest.mark.parametrize("change, message", [
    ({"layer_types": ["linear_attention", "sliding_attention"]}, "layer_types has \\['sliding_attention'\\]"),
    ({"layer_types": ["linear_attention"]}, "layer_types must list one entry per layer"),
    ({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types has \\['moe'\\]"),
    ({"linear_num_heads": None}, "field 'linear_num_heads' is missing"),
    ({"linear_attn_config": {"kda_layers": [2], "full_attn_layers": [1]}}, "linear_attn_config.kda_layers"),
    ({"num_experts": 4, "num_local_experts": 8}, "num_local_experts=8 and num_experts=4 disagree"),
])
def test_bad_transformers_style_is_one_clear_error(change, message):
    with pytest.raises(ConfigError, match=message):
        to_published({**BASE, **change}, "c.json")
