"""Kimi-Linear checkpoints as Hugging Face transformers 5.x writes them (`KimiLinearForCausalLM.save_pretrained`).

Two differences from the published `moonshotai/Kimi-Linear-*` layout, both mapped here so that
checkpoint/hf_config.py and checkpoint/files.py keep reading one (the published) layout:

- Config: transformers' own style lists the schedule per layer (`layer_types`: "linear_attention" /
  "full_attention"; `mlp_layer_types`: "dense" / "sparse") and flattens `linear_attn_config` into
  `linear_num_heads`, `linear_head_dim`, `linear_conv_kernel_dim`; a few fields carry its
  attribute-map names (`model_max_length`, `num_local_experts`, `n_shared_experts`, ...).
  `to_published(text, where)` turns such a config into the published style (`linear_attn_config` with
  1-based `kda_layers` / `full_attn_layers`); `mlp_layer_types` is kept, validated, and read by
  `mlp_types`. Fields transformers' class defaults would fill are filled the same way, so a config
  reads as transformers reads it. A config with both styles must agree, else it is refused.
- Weights: transformers renames every layer's FFN prefix to `block_sparse_moe.` when saving, so the
  dense first layer's MLP is written as `model.layers.0.block_sparse_moe.{gate,up,down}_proj.weight`.
  `WEIGHT_RENAMES` (a rename table applied to every stored name at load) maps it back to `mlp.`.
  The MoE itself never has a bare `gate_proj` (its router is `gate.weight`; shared experts are
  `shared_experts.gate_proj`), so the rename cannot catch an MoE tensor.
"""

from __future__ import annotations

import re
from typing import Any

from ..model.config import ConfigError

# transformers attribute-map spelling -> the published field k3x reads (KimiLinearConfig.attribute_map)
ALIASES: dict[str, str] = {
    "model_max_length": "max_position_embeddings",
    "num_local_experts": "num_experts",
    "num_experts_per_tok": "num_experts_per_token",
    "n_shared_experts": "num_shared_experts",
    "norm_topk_prob": "moe_renormalize",
    "n_group": "num_expert_group",
}
# KimiLinearConfig class defaults where k3x's published-style defaults differ (filled when a
# transformers-style config omits them, as transformers itself would)
TRANSFORMERS_DEFAULTS: dict[str, Any] = {
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "moe_renormalize": True,
}
LAYER_KINDS = {"linear_attention": "kda", "full_attention": "mla"}
MLP_KINDS = {"dense": "dense", "sparse": "moe"}

WEIGHT_RENAMES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^(model\.layers\.\d+)\.block_sparse_moe\.((?:gate|up|down)_proj\.weight)$"), r"\1.mlp.\2"),
)


def rename_weight(name: str) -> str:
    """A stored tensor name -> the published name (unchanged unless a `WEIGHT_RENAMES` entry matches)."""
    for pattern, target in WEIGHT_RENAMES:
        name, n = pattern.subn(target, name)
        if n:
            break
    return name


def is_transformers_style(text: dict[str, Any]) -> bool:
    return text.get("layer_types") is not None


def _per_layer(text: dict[str, Any], key: str, kinds: dict[str, str], n: int, where: str) -> list[str]:
    values = text[key]
    if not isinstance(values, list) or len(values) != n:
        raise ConfigError(f"{where}: {key} must list one entry per layer (num_hidden_layers={n}), got {values!r}")
    bad = sorted({repr(v) for v in values if not isinstance(v, str) or v not in kinds})
    if bad:
        raise ConfigError(f"{where}: {key} has [{', '.join(bad)[:200]}]; entries must be one of {sorted(kinds)}")
    return [kinds[v] for v in values]


def _sorted_ints(values: Any, where: str) -> list[int]:
    values = values or []
    if not isinstance(values, list) or not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"{where}={str(values)[:80]}: must be a list of integers")
    return sorted(values)


def _linear_attn_config(text: dict[str, Any], n: int, where: str) -> dict[str, Any]:
    kinds = _per_layer(text, "layer_types", LAYER_KINDS, n, where)
    lac: dict[str, Any] = {
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "kda"],
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "mla"],
        "short_conv_kernel_size": text.get("linear_conv_kernel_dim", 4),
    }
    for ours, theirs in (("num_heads", "linear_num_heads"), ("head_dim", "linear_head_dim")):
        if text.get(theirs) is None:
            raise ConfigError(f"{where}: field {theirs!r} is missing (needed with layer_types)")
        lac[ours] = text[theirs]
    return lac


def to_published(text: dict[str, Any], where: str) -> dict[str, Any]:
    """A `kimi_linear` text config in either style -> the published style (a new dict; input untouched)."""
    out = dict(text)
    for alias, field in ALIASES.items():
        if alias in out:
            value = out.pop(alias)
            if field in out and out[field] != value:
                raise ConfigError(f"{where}: {alias}={value!r} and {field}={out[field]!r} disagree")
            out[field] = value
    if not is_transformers_style(out) and out.get("mlp_layer_types") is None:
        return out
    n = out.get("num_hidden_layers")
    if not isinstance(n, int) or n < 1:
        raise ConfigError(f"{where}: num_hidden_layers={n!r}: must be an integer >= 1")
    if out.get("mlp_layer_types") is not None:
        _per_layer(out, "mlp_layer_types", MLP_KINDS, n, where)
    if not is_transformers_style(out):
        return out
    lac = _linear_attn_config(out, n, where)
    given = out.get("linear_attn_config")
    if given is not None and not isinstance(given, dict):
        raise ConfigError(f"{where}: linear_attn_config={str(given)[:80]}: must be a dict")
    if given:  # both styles: they must describe the same model
        for key, value in lac.items():
            mine = _sorted_ints(given.get(key), f"{where}: linear_attn_config.{key}") if key.endswith("_layers") \
                else given.get(key)
            if key in given and mine != value:
                raise ConfigError(f"{where}: linear_attn_config.{key}={given[key]!r} disagrees with "
                                  f"layer_types / linear_* fields ({value!r})")
        lac = {**given, **lac}
    out["linear_attn_config"] = lac
    for field, value in TRANSFORMERS_DEFAULTS.items():
        if out.get(field) is None:
            out[field] = value
    return out


def mlp_types(text: dict[str, Any]) -> tuple[str, ...] | None:
    """The FFN kind per layer from a validated `mlp_layer_types` ("dense"/"sparse"), or None when absent."""
    values = text.get("mlp_layer_types")
    return None if values is None else tuple(MLP_KINDS[v] for v in values)
