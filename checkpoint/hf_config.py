"""Read a Hugging Face `config.json` (`kimi_k3` with `text_config`, or `kimi_linear`) into a K3Config.

The layer schedule comes from the config's own lists (`linear_attn_config.kda_layers` /
`full_attn_layers`, 1-based; `first_k_dense_replace`, `moe_layer_freq`), never from a fixed pattern.
Configs in transformers 5's own style (`layer_types`, `mlp_layer_types`, `linear_num_heads`, ...) are
first mapped to the published style by checkpoint/hf_transformers.py.
Architecture: docs/model.md §1.

Parsing is strict (a config.json may come from anyone): the file must be UTF-8 JSON holding an object,
without NaN/Infinity and nested at most `_MAX_DEPTH` deep; integer fields must be JSON integers (64.9 is
refused, never truncated), floats finite, and the layer count is bounded before any per-layer list is
built. Every problem is one `ConfigError` line naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..model.config import LIMITS, AttnResConfig, ConfigError, K3Config, KDAConfig, MLAConfig, MoEConfig
from . import hf_transformers, published

if TYPE_CHECKING:
    import torch

_MAX_DEPTH = 32
_MAX_BYTES = 16 << 20
_NO_DEFAULT = object()


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 80 else text[:80] + "..."


def _get(cfg: dict[str, Any], key: str, where: str, kind: str, default: Any = _NO_DEFAULT) -> Any:
    """cfg[key] checked to be `kind` ("int", "float", "bool", "str", "list", "dict"); missing/null -> default."""
    v = cfg.get(key)
    if v is None:
        if default is _NO_DEFAULT:
            raise ConfigError(f"{where}: field {key!r} is missing")
        return default
    ok = {"int": isinstance(v, int) and not isinstance(v, bool),
          "float": isinstance(v, (int, float)) and not isinstance(v, bool),
          "bool": isinstance(v, bool), "str": isinstance(v, str),
          "list": isinstance(v, list), "dict": isinstance(v, dict)}[kind]
    if not ok:
        raise ConfigError(f"{where}: {key}={_short(v)}: must be {'an' if kind == 'int' else 'a'} {kind}")
    return float(v) if kind == "float" else v


def _depth(v: Any, where: str, level: int = 0) -> None:
    if level > _MAX_DEPTH:
        raise ConfigError(f"{where}: nested more than {_MAX_DEPTH} levels deep")
    for x in v.values() if isinstance(v, dict) else v if isinstance(v, list) else ():
        _depth(x, where, level + 1)


def _read_json(path: Path, where: str, data: bytes | None = None) -> dict[str, Any]:
    def no_constant(name: str) -> None:
        raise ConfigError(f"{where}: {name} is not a valid JSON number")

    try:
        size = path.stat().st_size if data is None else len(data)
        if size > _MAX_BYTES:
            raise ConfigError(f"{where}: {size} bytes; a config.json is at most {_MAX_BYTES}")
        raw = json.loads((path.read_bytes() if data is None else data).decode("utf-8"), parse_constant=no_constant)
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file (no config.json: not a checkpoint folder)") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{where}: not valid JSON ({e.msg} at line {e.lineno} column {e.colno})") from None
    except RecursionError:
        raise ConfigError(f"{where}: nested too deeply") from None
    except OSError as e:
        raise ConfigError(f"{where}: cannot read ({e.strerror})") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: must hold a JSON object, not {type(raw).__name__}")
    _depth(raw, where)
    return raw


def _layer_list(lac: dict[str, Any], key: str, where: str) -> set[int]:
    v = _get(lac, key, where, "list", [])
    if not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ConfigError(f"{where}: {key}={_short(v)}: must be a list of integers")
    return set(v)


def _layer_types(text: dict[str, Any], n: int, where: str) -> tuple[str, ...]:
    lac = _get(text, "linear_attn_config", where, "dict")
    kda = _layer_list(lac, "kda_layers", where + " linear_attn_config")
    full = _layer_list(lac, "full_attn_layers", where + " linear_attn_config")
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


def _mlp_types(text: dict[str, Any], n: int, where: str = "config") -> tuple[str, ...]:
    listed = hf_transformers.mlp_types(text)  # transformers-5 style `mlp_layer_types`, validated
    if listed is not None:
        return listed
    if not _get(text, "num_experts", where, "int", 0):
        return ("dense",) * n
    first = _get(text, "first_k_dense_replace", where, "int", 0)
    freq = _get(text, "moe_layer_freq", where, "int", 1)
    if freq < 1:
        raise ConfigError(f"{where}: moe_layer_freq={freq}: must be >= 1")
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


def config_from_hf(path: str | Path, data: bytes | None = None) -> K3Config:
    """The architecture config.json at `path` (a file or its folder) describes; `data`: its bytes, already
    read (then `path` only names it)."""
    path = Path(path)
    if data is None and path.is_dir():
        path = path / "config.json"
    where = str(path)
    raw = _read_json(path, where, data)
    model_type = raw.get("model_type")
    if model_type == "kimi_k3":
        text = _get(raw, "text_config", where, "dict")
    elif model_type == "kimi_linear":
        text = raw
    else:
        raise ConfigError(f"{where}: model_type={_short(model_type)}; expected 'kimi_k3' or 'kimi_linear'")
    text = hf_transformers.to_published(text, where)  # transformers-5 config style -> the published one

    _refuse_unsupported(raw, text, where)
    n = _get(text, "num_hidden_layers", where, "int")
    if not 0 < n <= LIMITS["layers"]:
        raise ConfigError(f"{where}: num_hidden_layers={n}: must be in 1..{LIMITS['layers']}")
    lac = _get(text, "linear_attn_config", where, "dict")
    lw = where + " linear_attn_config"
    act = _get(text, "hidden_act", where, "str", "silu")
    if act not in ("situ", "silu"):
        raise ConfigError(f"{where}: hidden_act={_short(act)}; supported: 'situ', 'silu'")
    latent = _get(text, "routed_expert_hidden_size", where, "int", None)
    block = _get(text, "attn_res_block_size", where, "int", None)
    name = raw.get("_name_or_path") or text.get("_name_or_path") or path.parent.name or "hf"
    tied = _get(raw, "tie_word_embeddings", where, "bool", _get(text, "tie_word_embeddings", where, "bool", False))
    return K3Config(
        name=name if isinstance(name, str) else "hf",
        hidden_size=_get(text, "hidden_size", where, "int"),
        vocab_size=_get(text, "vocab_size", where, "int"),
        layer_types=_layer_types(text, n, where),
        mlp_types=_mlp_types(text, n, where),
        dense_intermediate_size=_get(text, "intermediate_size", where, "int"),
        kda=KDAConfig(
            num_heads=_get(lac, "num_heads", lw, "int"),
            head_dim=_get(lac, "head_dim", lw, "int"),
            conv_kernel=_get(lac, "short_conv_kernel_size", lw, "int", 4),
            gate_lower_bound=_get(lac, "gate_lower_bound", lw, "float", None),
            full_rank_output_gate=_get(lac, "use_full_rank_gate", lw, "bool", False),
        ),
        mla=MLAConfig(
            num_heads=_get(text, "num_attention_heads", where, "int"),
            q_lora_rank=_get(text, "q_lora_rank", where, "int", None),
            kv_lora_rank=_get(text, "kv_lora_rank", where, "int"),
            qk_nope_head_dim=_get(text, "qk_nope_head_dim", where, "int"),
            qk_rope_head_dim=_get(text, "qk_rope_head_dim", where, "int"),
            v_head_dim=_get(text, "v_head_dim", where, "int"),
            output_gate=_get(text, "mla_use_output_gate", where, "bool", False),
        ),
        moe=MoEConfig(
            num_experts=_get(text, "num_experts", where, "int", 0) or 1,
            top_k=_get(text, "num_experts_per_token", where, "int", 0) or 1,
            intermediate_size=_get(text, "moe_intermediate_size", where, "int", 0) or 1,
            num_shared_experts=_get(text, "num_shared_experts", where, "int", 0),
            latent_dim=latent or None,
            latent_norm=_get(text, "latent_moe_use_norm", where, "bool", False) and bool(latent),
            routed_scaling_factor=_get(text, "routed_scaling_factor", where, "float", 1.0),
            renormalize=_get(text, "moe_renormalize", where, "bool", True),
        ),
        attn_res=AttnResConfig(block_size=block) if block else None,
        rms_norm_eps=_get(text, "rms_norm_eps", where, "float", 1e-5),
        activation=act,
        situ_beta=_get(text, "activation_situ_beta", where, "float", 0.0) or 4.0,
        situ_linear_beta=_get(text, "activation_situ_linear_beta", where, "float", 0.0) or 1.0,
        tie_word_embeddings=tied,
        max_position_embeddings=_get(text, "max_position_embeddings", where, "int", 1048576),
    )


def config_to_hf(cfg: K3Config, *, dtype: torch.dtype | None = None,
                 quantization: dict[str, Any] | None = None) -> dict[str, Any]:
    """The `config.json` k3x writes next to a checkpoint, in the published layout of its architecture
    (checkpoint/published.py): K3's `kimi_k3` wrapper around a `kimi_linear` text config, or Kimi Linear's
    plain `kimi_linear` config. `dtype`: the stored weights' (`torch_dtype`); `quantization`: the
    `quantization_config` block of packed experts."""
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
    if _mlp_types(text, cfg.num_layers, "config_to_hf") != cfg.mlp_types:
        raise ConfigError(f"mlp_types={cfg.mlp_types}: not expressible as first_k_dense_replace + moe_layer_freq=1")
    if dtype is not None:
        text["torch_dtype"] = str(dtype).removeprefix("torch.")
    if not published.is_k3(cfg):
        return {"architectures": [published.KIMI_LINEAR_ARCHITECTURE], "_name_or_path": cfg.name, **text,
                **({"quantization_config": quantization} if quantization is not None else {})}
    out = {"model_type": "kimi_k3", "architectures": [published.K3_ARCHITECTURE], "_name_or_path": cfg.name,
           "tie_word_embeddings": cfg.tie_word_embeddings, "text_config": text}
    if dtype is not None:
        out["torch_dtype"] = text["torch_dtype"]
    if quantization is not None:
        out["quantization_config"] = quantization
    return out


def raw_config(path: str | Path, data: bytes | None = None) -> dict[str, Any]:
    """config.json as a dict, read with the strict rules of `config_from_hf` (ConfigError naming the file);
    `data`: its bytes, already read."""
    return _read_json(Path(path), str(path), data)
