"""K3Config: presets, derived layout, HF config.json import (schedule from the config's own lists), errors."""

from __future__ import annotations

import dataclasses
import json

import pytest

from k3x.checkpoint.hf_config import config_from_hf, config_to_hf
from k3x.model.config import PRESETS, AttnResConfig, ConfigError, K3Config, KDAConfig, preset


def test_k3_preset_matches_published_config():
    c = preset("k3")
    assert (c.hidden_size, c.num_layers, c.vocab_size) == (7168, 93, 163840)
    assert c.mla_layers == tuple(range(3, 92, 4)) + (92,)  # 0-based 3, 7, ..., 91 and the final 92
    assert len(c.kda_layers) == 69 and len(c.mla_layers) == 24
    assert c.mlp_types[0] == "dense" and len(c.moe_layers) == 92
    assert (c.moe.num_experts, c.moe.top_k, c.moe.latent_dim, c.moe.intermediate_size) == (896, 16, 3584, 3072)
    assert c.moe.shared_intermediate_size == 6144 and c.mla.qk_head_dim == 192 and c.mla.latent_dim == 576
    assert c.block_starts() == (0, 12, 24, 36, 48, 60, 72, 84)
    assert c.kda.gate_lower_bound == -5.0 and c.kda.full_rank_output_gate


def test_k3_mini_covers_every_branch():
    c = preset("k3-mini")
    assert {"kda", "mla"} == set(c.layer_types) and {"dense", "moe"} == set(c.mlp_types)
    assert c.layer_types[-2:] == ("mla", "mla")
    assert len(c.block_starts()) >= 2 and c.attn_res is not None and c.moe.latent_dim is not None


def test_unknown_preset_lists_valid_names():
    with pytest.raises(ConfigError, match="k3-mini"):
        preset("k3-tiny")


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_hf_round_trip(tmp_path, name):
    c = PRESETS[name]
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(c)))
    back = config_from_hf(tmp_path)
    assert dataclasses.replace(back, name=c.name) == c


def k3_config_json() -> dict:
    """The published K3 config.json fields k3x reads (docs/model.md §1.1), as Hugging Face ships them."""
    full = [4 * i for i in range(1, 24)] + [93]
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "vision_config": {"model_type": "moonvit"},
            "text_config": {
                "model_type": "kimi_linear", "hidden_size": 7168, "num_hidden_layers": 93, "vocab_size": 163840,
                "rms_norm_eps": 1e-5, "hidden_act": "situ", "activation_situ_beta": 4.0,
                "activation_situ_linear_beta": 25.0, "intermediate_size": 33792, "first_k_dense_replace": 1,
                "moe_layer_freq": 1, "num_attention_heads": 96, "num_key_value_heads": 96, "q_lora_rank": 1536,
                "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
                "mla_use_nope": True, "mla_use_output_gate": True, "attn_res_block_size": 12,
                "linear_attn_config": {"num_heads": 96, "head_dim": 128, "short_conv_kernel_size": 4,
                                       "gate_lower_bound": -5.0, "use_full_rank_gate": True,
                                       "full_attn_layers": full,
                                       "kda_layers": [i for i in range(1, 94) if i not in full]},
                "num_experts": 896, "num_experts_per_token": 16, "num_shared_experts": 2,
                "moe_intermediate_size": 3072, "routed_expert_hidden_size": 3584, "latent_moe_use_norm": True,
                "moe_router_activation_func": "sigmoid", "moe_renormalize": True, "routed_scaling_factor": 1.0,
                "tie_word_embeddings": False, "max_position_embeddings": 1048576}}


def test_published_k3_json_equals_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(k3_config_json()))
    assert dataclasses.replace(config_from_hf(tmp_path), name="k3") == preset("k3")


def test_schedule_comes_from_the_lists_not_a_pattern(tmp_path):
    cfg = k3_config_json()
    lac = cfg["text_config"]["linear_attn_config"]
    lac["full_attn_layers"], lac["kda_layers"] = [1, 93], list(range(2, 93))
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    c = config_from_hf(tmp_path)
    assert c.mla_layers == (0, 92) and len(c.kda_layers) == 91


@pytest.mark.parametrize("mutate,field", [
    (lambda t: t["linear_attn_config"].update(full_attn_layers=[4, 200]), "outside 1..num_hidden_layers"),
    (lambda t: t["linear_attn_config"].update(kda_layers=[1, 2, 4]), "both kda_layers and full_attn_layers"),
    (lambda t: t.pop("hidden_size"), "hidden_size"),
    (lambda t: t.update(hidden_act="gelu"), "hidden_act"),
    (lambda t: t.update(num_experts_per_token=1000), "moe.top_k"),
    (lambda t: t["linear_attn_config"].update(gate_lower_bound=-9.0), "kda.gate_lower_bound"),
    (lambda t: t.update(moe_router_activation_func="softmax"), "moe_router_activation_func='softmax'"),
    (lambda t: t.update(num_expert_group=8, topk_group=4), "num_expert_group=8"),
    (lambda t: t.update(mla_use_nope=False), "mla_use_nope=False"),
    (lambda t: t.update(tie_word_embeddings=True), "tie_word_embeddings=True"),
])
def test_bad_json_names_the_field(tmp_path, mutate, field):
    cfg = k3_config_json()
    mutate(cfg["text_config"])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match=field):
        config_from_hf(tmp_path)


def test_invalid_dataclass_fields_are_named():
    mini = preset("k3-mini")
    with pytest.raises(ConfigError, match="kda.head_dim=512"):  # an op limit (custom_ops/kda/op.py)
        dataclasses.replace(mini, kda=KDAConfig(num_heads=4, head_dim=512))
    with pytest.raises(ConfigError, match="kda.head_dim=0"):
        KDAConfig(num_heads=4, head_dim=0)
    with pytest.raises(ConfigError, match="moe.top_k=9"):  # an op limit (custom_ops/moe/op.py)
        dataclasses.replace(mini, moe=dataclasses.replace(mini.moe, top_k=9, num_experts=8))
    with pytest.raises(ConfigError, match="attn_res.block_size=0"):
        AttnResConfig(block_size=0)
    with pytest.raises(ConfigError, match="mlp_types"):
        dataclasses.replace(preset("k3-mini"), mlp_types=("dense",))


def test_kernel_limits_apply_with_triton_kernels_only():
    """The Triton kernels' limits (head_dim >= 16) are checked when the config is validated with
    kernels=triton, before anything is built; the reference takes the config."""
    from k3x.model.options import BuildOptions
    from k3x.plan.kernels import Kernels

    small = dataclasses.replace(preset("k3-mini"), kda=KDAConfig(num_heads=2, head_dim=8))
    BuildOptions().check(small)
    with pytest.raises(ConfigError, match="kda.head_dim=8: the Triton k3::kda kernels"):
        BuildOptions(Kernels.TRITON).check(small)
    with pytest.raises(ConfigError, match="kda.head_dim=8"):
        small.check_ops(kernels=True)


def test_hash_is_stable_and_sensitive():
    c = preset("k3-mini")
    assert c.hash() == preset("k3-mini").hash()
    assert c.hash() != dataclasses.replace(c, rms_norm_eps=1e-6).hash()
    assert K3Config.from_dict(c.to_dict()) == c
