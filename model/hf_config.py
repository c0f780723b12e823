"""Read a Hugging Face `config.json` (`kimi_k3` with `text_config`, or `kimi_linear`) into a K3Config.

The layer schedule comes from the config's own lists (`linear_attn_config.kda_layers` /
`full_attn_layers`, 1-based; `first_k_dense_replace`, `moe_layer_freq`), never from a fixed pattern.
Configs in transformers 5's own style (`layer_types`, `mlp_layer_types`, `linear_num_heads`, ...) are
first mapped to the published style by model/hf_transformers.py.
Architecture: docs/model.md §1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from . import hf_transformers
from .config import AttnResConfig, ConfigError, K3Config, KDAConfig, MLAConfig, MoEConfig


def _need(cfg: dict[str, Any], key: str, where: str) -> Any:
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{where}: field {key!r} is missing")
    return cfg[key]


def _layer_types(text: dict[str, Any], n: int, where: str) -> tuple[str, ...]:
    lac = _need(text, "linear_attn_config", where)
    kda = set(lac.get("kda_layers") or [])
    full = set(lac.get("full_attn_layers") or [])
    if not kda and not full:
        raise ConfigError(f"{where}: linear_attn_config needs kda_layers or full_attn_layers")
    if kda & full:
        raise ConfigError(f"{where}: layers {sorted(kda & full)} are in both kda_layers and full_attn_layers")
    out_of_range = sorted(x for x in kda | full if not 1 <= x <= n)
    if out_of_range:
        raise ConfigError(f"{where}: layer numbers {out_of_range} outside 1..num_hidden_layers ({n})")
    if not kda:
        kda = set(range(1, n + 1)) - full
    if not full:
        full = set(range(1, n + 1)) - kda
    missing = sorted(set(range(1, n + 1)) - kda - full)
    if missing:
        raise ConfigError(f"{where}: layers {missing} are neither kda_layers nor full_attn_layers")
    return tuple("kda" if (i + 1) in kda else "mla" for i in range(n))


def _mlp_types(text: dict[str, Any], n: int) -> tuple[str, ...]:
    listed = hf_transformers.mlp_types(text)  # transformers-5 style `mlp_layer_types`, validated
    if listed is not None:
        return listed
    if not text.get("num_experts"):
        return ("dense",) * n
    first = int(text.get("first_k_dense_replace", 0))
    freq = int(text.get("moe_layer_freq", 1))
    return tuple("moe" if (i >= first and i % freq == 0) else "dense" for i in range(n))


def _refuse_unsupported(raw: dict[str, Any], text: dict[str, Any], where: str) -> None:
    """Fields whose other values would change the computation k3x implements: refuse, never ignore."""
    checks = [
        ("moe_router_activation_func", text.get("moe_router_activation_func", "sigmoid"), lambda v: v == "sigmoid"),
        ("num_expert_group", text.get("num_expert_group", 1), lambda v: v in (None, 1)),
        ("topk_group", text.get("topk_group", 1), lambda v: v in (None, 1)),
        ("mla_use_nope", text.get("mla_use_nope", True), lambda v: v is True),
        ("tie_word_embeddings", raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
         lambda v: v is False),
        ("num_nextn_predict_layers", text.get("num_nextn_predict_layers", 0), lambda v: v in (None, 0)),
    ]
    for name, value, ok in checks:
        if not ok(value):
            raise ConfigError(f"{where}: {name}={value!r} is not supported by k3x (K3 / Kimi Linear use "
                              "sigmoid routing without expert groups, NoPE MLA, an untied head, no MTP layers)")


def config_from_hf(path: str | Path) -> K3Config:
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    where = str(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e})") from None
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        text = _need(raw, "text_config", where)
    elif model_type == "kimi_linear":
        text = raw
    else:
        raise ConfigError(f"{where}: model_type={model_type!r}; expected 'kimi_k3' or 'kimi_linear'")
    text = hf_transformers.to_published(text, where)  # transformers-5 config style -> the published one

    _refuse_unsupported(raw, text, where)
    n = int(_need(text, "num_hidden_layers", where))
    lac = _need(text, "linear_attn_config", where)
    act = text.get("hidden_act", "silu")
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: hidden_act={act!r}; supported: 'situ', 'silu'")
    latent = text.get("routed_expert_hidden_size")
    block = text.get("attn_res_block_size")
    return K3Config(
        name=raw.get("_name_or_path") or text.get("_name_or_path") or path.parent.name or "hf",
        hidden_size=int(_need(text, "hidden_size", where)),
        vocab_size=int(_need(text, "vocab_size", where)),
        layer_types=_layer_types(text, n, where),
        mlp_types=_mlp_types(text, n),
        dense_intermediate_size=int(_need(text, "intermediate_size", where)),
        kda=KDAConfig(
            num_heads=int(_need(lac, "num_heads", where + " linear_attn_config")),
            head_dim=int(_need(lac, "head_dim", where + " linear_attn_config")),
            conv_kernel=int(lac.get("short_conv_kernel_size", 4)),
            gate_lower_bound=lac.get("gate_lower_bound"),
            full_rank_output_gate=bool(lac.get("use_full_rank_gate", False)),
        ),
        mla=MLAConfig(
            num_heads=int(_need(text, "num_attention_heads", where)),
            q_lora_rank=text.get("q_lora_rank"),
            kv_lora_rank=int(_need(text, "kv_lora_rank", where)),
            qk_nope_head_dim=int(_need(text, "qk_nope_head_dim", where)),
            qk_rope_head_dim=int(_need(text, "qk_rope_head_dim", where)),
            v_head_dim=int(_need(text, "v_head_dim", where)),
            output_gate=bool(text.get("mla_use_output_gate", False)),
        ),
        moe=MoEConfig(
            num_experts=int(text.get("num_experts") or 1),
            top_k=int(text.get("num_experts_per_token") or 1),
            intermediate_size=int(text.get("moe_intermediate_size") or 1),
            num_shared_experts=int(text.get("num_shared_experts") or 0),
            latent_dim=int(latent) if latent else None,
            latent_norm=bool(text.get("latent_moe_use_norm", False)) and bool(latent),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            renormalize=bool(text.get("moe_renormalize", True)),
        ),
        attn_res=AttnResConfig(block_size=int(block)) if block else None,
        rms_norm_eps=float(text.get("rms_norm_eps", 1e-5)),
        activation=act,
        situ_beta=float(text.get("activation_situ_beta") or 4.0),
        situ_linear_beta=float(text.get("activation_situ_linear_beta") or 1.0),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))),
        max_position_embeddings=int(text.get("max_position_embeddings", 1048576)),
    )


def config_to_hf(cfg: K3Config) -> dict[str, Any]:
    """The `config.json` k3x writes next to a checkpoint (`kimi_k3` wrapper around a `kimi_linear` text config)."""
    text: dict[str, Any] = {
        "model_type": "kimi_linear",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": cfg.activation,
        "activation_situ_beta": cfg.situ_beta,
        "activation_situ_linear_beta": cfg.situ_linear_beta,
        "intermediate_size": cfg.dense_intermediate_size,
        "first_k_dense_replace": next((i for i, t in enumerate(cfg.mlp_types) if t == "moe"), cfg.num_layers),
        "moe_layer_freq": 1,
        "num_attention_heads": cfg.mla.num_heads,
        "num_key_value_heads": cfg.mla.num_heads,
        "q_lora_rank": cfg.mla.q_lora_rank,
        "kv_lora_rank": cfg.mla.kv_lora_rank,
        "qk_nope_head_dim": cfg.mla.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.mla.qk_rope_head_dim,
        "v_head_dim": cfg.mla.v_head_dim,
        "mla_use_nope": True,
        "mla_use_output_gate": cfg.mla.output_gate,
        "linear_attn_config": {
            "num_heads": cfg.kda.num_heads,
            "head_dim": cfg.kda.head_dim,
            "short_conv_kernel_size": cfg.kda.conv_kernel,
            "gate_lower_bound": cfg.kda.gate_lower_bound,
            "use_full_rank_gate": cfg.kda.full_rank_output_gate,
            "kda_layers": [i + 1 for i in cfg.kda_layers],
            "full_attn_layers": [i + 1 for i in cfg.mla_layers],
        },
        "num_experts": cfg.moe.num_experts,
        "num_experts_per_token": cfg.moe.top_k,
        "num_shared_experts": cfg.moe.num_shared_experts,
        "moe_intermediate_size": cfg.moe.intermediate_size,
        "routed_expert_hidden_size": cfg.moe.latent_dim,
        "latent_moe_use_norm": cfg.moe.latent_norm,
        "moe_router_activation_func": "sigmoid",
        "moe_renormalize": cfg.moe.renormalize,
        "routed_scaling_factor": cfg.moe.routed_scaling_factor,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "max_position_embeddings": cfg.max_position_embeddings,
    }
    if cfg.attn_res is not None:
        text["attn_res_block_size"] = cfg.attn_res.block_size
    if _mlp_types(text, cfg.num_layers) != cfg.mlp_types:
        raise ConfigError(f"mlp_types={cfg.mlp_types}: not expressible as first_k_dense_replace + moe_layer_freq=1")
    return {"model_type": "kimi_k3", "architectures": ["KimiK3ForConditionalGeneration"],
            "_name_or_path": cfg.name, "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}
