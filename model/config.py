"""K3Config: the single source of truth for every shape in k3x.

Architecture: docs/model.md §1 (config values), §11 (tensor shapes).

Notable choices:
- Frozen dataclasses nested per concern (KDA, MLA, MoE, AttnRes); derived sizes are properties.
- The hybrid layout is explicit: `layer_types` ("kda"/"mla") and `mlp_types` ("dense"/"moe"), one
  entry per decoder layer. `checkpoint/hf_config.config_from_hf` reads them from the config's own lists,
  never from a pattern.
- Presets by exact name in `PRESETS`; variants come from `dataclasses.replace`.
- The architecture only, exactly what config.json says: build and run choices (kernels, expert format,
  cache capacity, the parallel plan) are option objects of their own (model/options.py, model/parallel.py).
  `hash` covers the architecture; its format (`HASH_FORMAT`) keeps the values manifests recorded before
  the options moved out, so an export folder's architecture keeps its hash.
- Validation in `__post_init__`; every error names the field and the value (cut to 80 characters).
  Types are checked before values (`_check_types`: ints are ints, never bools or 64.9; floats finite), and
  sizes have upper bounds (`LIMITS`, generous for any real model) so a hostile config is refused before
  anything is allocated or built.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field, replace
from typing import Any, Literal

LayerType = Literal["kda", "mla"]
MlpType = Literal["dense", "moe"]


class ConfigError(ValueError):
    """A config field has a value k3x cannot build; the message names field and value."""


# upper bounds of sizes (K3 itself: 93 layers, width 7168, 163840 vocab, 96 heads, 896 experts)
# the hash format: two keys the config dict held (at their defaults) before the build options left it
HASH_FORMAT: dict[str, str] = {"kernels": "reference", "expert_format": "dense"}
LEGACY_OPTION_KEYS = ("kernels", "backend", "expert_format", "max_context")  # read as options (model/options.py)

LIMITS: dict[str, int] = {"layers": 1024, "hidden_size": 65536, "vocab_size": 1 << 22, "heads": 1024,
                          "experts": 4096, "max_position_embeddings": 1 << 24, "other": 1 << 20}


def _check(ok: bool, field_name: str, value: Any, why: str) -> None:
    if not ok:
        text = repr(value)
        raise ConfigError(f"{field_name}={text if len(text) <= 80 else text[:80] + '...'}: {why}")


def _limit(field_name: str) -> int:
    leaf = field_name.rsplit(".", 1)[-1]
    if leaf in LIMITS:
        return LIMITS[leaf]
    return LIMITS["heads" if leaf == "num_heads" else "experts" if "experts" in leaf else "other"]


def _check_types(obj: Any, prefix: str = "") -> None:
    """Every int field an int (not a bool) within `LIMITS`, every float finite, every bool a bool."""
    for f in dataclasses.fields(obj):
        v, kind, name = getattr(obj, f.name), str(f.type), prefix + f.name
        if v is None and "None" in kind:
            continue
        base = kind.split(" |")[0]
        if base == "int":
            _check(isinstance(v, int) and not isinstance(v, bool), name, v, "must be an integer")
            _check(v <= _limit(name), name, v, f"must be <= {_limit(name)}")
        elif base == "float":
            _check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v), name, v,
                   "must be a finite number")
        elif base == "bool":
            _check(isinstance(v, bool), name, v, "must be true or false")
        elif base == "str":
            _check(isinstance(v, str) and len(v) <= 256, name, v, "must be a string of <= 256 characters")


@dataclass(frozen=True)
class KDAConfig:
    num_heads: int
    head_dim: int
    conv_kernel: int = 4
    gate_lower_bound: float | None = -5.0  # None = Kimi Linear gate (-exp(A_log) * softplus)
    full_rank_output_gate: bool = True  # False = low-rank g_a_proj/g_b_proj (Kimi Linear)

    def __post_init__(self) -> None:
        _check_types(self, "kda.")
        _check(self.num_heads > 0, "kda.num_heads", self.num_heads, "must be > 0")
        _check(self.head_dim > 0, "kda.head_dim", self.head_dim, "must be > 0")  # op limits: check_ops
        _check(self.conv_kernel >= 2, "kda.conv_kernel", self.conv_kernel, "must be >= 2")
        lb = self.gate_lower_bound
        _check(lb is None or -5.0 <= lb < 0.0, "kda.gate_lower_bound", lb,
               "must be None or in [-5, 0) (the chunked kernels rely on the bound)")

    @property
    def proj_dim(self) -> int:  # P = H * D
        return self.num_heads * self.head_dim


@dataclass(frozen=True)
class MLAConfig:
    num_heads: int
    q_lora_rank: int | None  # None = direct q_proj (Kimi Linear)
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    output_gate: bool = True
    norm_eps: float = 1e-6  # q_a_layernorm / kv_a_layernorm (K3-HF default; docs/model.md §10.2)

    def __post_init__(self) -> None:
        _check_types(self, "mla.")
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            _check(getattr(self, name) > 0, f"mla.{name}", getattr(self, name), "must be > 0")
        _check(self.qk_rope_head_dim >= 0, "mla.qk_rope_head_dim", self.qk_rope_head_dim, "must be >= 0")
        _check(self.q_lora_rank is None or self.q_lora_rank > 0, "mla.q_lora_rank", self.q_lora_rank,
               "must be None or > 0")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:  # cached per token: c_KV + shared k_extra
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int
    top_k: int
    intermediate_size: int  # per routed expert
    num_shared_experts: int
    latent_dim: int | None  # None = experts at full hidden width (plain MoE, Kimi Linear)
    latent_norm: bool = True
    routed_scaling_factor: float = 1.0
    renormalize: bool = True

    def __post_init__(self) -> None:
        _check_types(self, "moe.")
        _check(self.num_experts > 0, "moe.num_experts", self.num_experts, "must be > 0")
        _check(self.top_k > 0, "moe.top_k", self.top_k, "must be > 0")  # op limits: K3Config.check_ops
        _check(self.intermediate_size > 0, "moe.intermediate_size", self.intermediate_size, "must be > 0")
        _check(self.num_shared_experts >= 0, "moe.num_shared_experts", self.num_shared_experts, "must be >= 0")
        _check(self.latent_dim is None or self.latent_dim > 0, "moe.latent_dim", self.latent_dim,
               "must be None or > 0")
        _check(not (self.latent_norm and self.latent_dim is None), "moe.latent_norm", self.latent_norm,
               "needs moe.latent_dim")

    @property
    def shared_intermediate_size(self) -> int:  # shared experts are stored as one merged MLP
        return self.num_shared_experts * self.intermediate_size


@dataclass(frozen=True)
class AttnResConfig:
    block_size: int  # counted in decoder layers (K3: 12)

    def __post_init__(self) -> None:
        _check_types(self, "attn_res.")
        _check(self.block_size > 0, "attn_res.block_size", self.block_size, "must be > 0")


@dataclass(frozen=True)
class K3Config:
    name: str
    hidden_size: int
    vocab_size: int
    layer_types: tuple[LayerType, ...]
    mlp_types: tuple[MlpType, ...]
    dense_intermediate_size: int
    kda: KDAConfig
    mla: MLAConfig
    moe: MoEConfig
    attn_res: AttnResConfig | None  # None = plain pre-norm residual (Kimi Linear)
    rms_norm_eps: float = 1e-5
    activation: Literal["situ", "silu"] = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float = 25.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 1048576
    extra: tuple[tuple[str, Any], ...] = field(default=(), compare=False)  # informational only

    def __post_init__(self) -> None:
        _check_types(self)
        _check(isinstance(self.layer_types, tuple) and len(self.layer_types) <= LIMITS["layers"], "layer_types",
               len(self.layer_types) if isinstance(self.layer_types, tuple) else self.layer_types,
               f"must be a tuple of at most {LIMITS['layers']} layers")
        _check(self.max_position_embeddings > 0, "max_position_embeddings", self.max_position_embeddings,
               "must be > 0")
        _check(self.hidden_size > 0, "hidden_size", self.hidden_size, "must be > 0")
        _check(self.vocab_size > 0, "vocab_size", self.vocab_size, "must be > 0")
        _check(len(self.layer_types) > 0, "layer_types", self.layer_types, "must name at least one layer")
        bad = [t for t in self.layer_types if t not in ("kda", "mla")]
        _check(not bad, "layer_types", bad, "entries must be 'kda' or 'mla'")
        bad = [t for t in self.mlp_types if t not in ("dense", "moe")]
        _check(not bad, "mlp_types", bad, "entries must be 'dense' or 'moe'")
        _check(len(self.mlp_types) == len(self.layer_types), "mlp_types", len(self.mlp_types),
               f"needs one entry per layer ({len(self.layer_types)})")
        _check(self.activation in ("situ", "silu"), "activation", self.activation, "must be 'situ' or 'silu'")
        _check(self.rms_norm_eps > 0, "rms_norm_eps", self.rms_norm_eps, "must be > 0")
        _check(not self.tie_word_embeddings, "tie_word_embeddings", self.tie_word_embeddings,
               "k3x models have an untied lm_head (K3 and Kimi Linear do)")
        if self.moe.latent_dim is not None:
            _check(self.moe.latent_dim <= self.hidden_size, "moe.latent_dim", self.moe.latent_dim,
                   f"must be <= hidden_size ({self.hidden_size})")
        self.check_ops(kernels=False)

    def check_ops(self, *, kernels: bool, packed_experts: bool = False) -> None:
        """ConfigError naming the field if a k3 op (with `kernels`: its Triton kernels and TensorRT plugin;
        with `packed_experts`: k3::moe_mxfp4) cannot run this config; the limits live with each op
        (custom_ops/<family>/op.py). Build options check through `BuildOptions.check` (model/options.py)."""
        from ..custom_ops.registry import check_config

        reason = check_config(self, kernels=kernels, packed_experts=packed_experts)
        if reason:
            raise ConfigError(reason)

    # --- derived layout -----------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def kda_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "kda")

    @property
    def mla_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "mla")

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.mlp_types) if t == "moe")

    @property
    def max_heads(self) -> int:  # the widest attention of any layer (memory estimates)
        return max(self.mla.num_heads, self.kda.num_heads)

    @property
    def expert_dim(self) -> int:  # width the routed experts work at
        return self.moe.latent_dim or self.hidden_size

    def block_starts(self) -> tuple[int, ...]:
        """Layers that write the running partial sum into the AttnRes bank (docs/model.md §4.2 step 2)."""
        if self.attn_res is None:
            return ()
        return tuple(range(0, self.num_layers, self.attn_res.block_size))

    def layer_kind(self, i: int) -> str:
        """Layer i's shape: mixer, FFN and AttnRes role (`_first`: layer 0 opens the bank; `_block_start`: it
        writes the running partial sum). Layers of one kind trace to the same graph (exporter/stamp.py) and share
        one ONNX function (exporter/onnx_functions.py). E.g. 'kda_dense_first', 'kda_moe', 'mla_moe'."""
        role = "_first" if self.attn_res is not None and i == 0 else "_block_start" if i in self.block_starts() else ""
        return f"{self.layer_types[i]}_{self.mlp_types[i]}{role}"

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["extra"] = dict(self.extra)
        return d

    def hash(self) -> str:
        blob = json.dumps(self.to_dict() | HASH_FORMAT, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> K3Config:
        d = {k: v for k, v in d.items() if k not in LEGACY_OPTION_KEYS}  # older manifests: model/options.py
        d["kda"] = KDAConfig(**d["kda"])
        d["mla"] = MLAConfig(**d["mla"])
        d["moe"] = MoEConfig(**d["moe"])
        d["attn_res"] = AttnResConfig(**d["attn_res"]) if d.get("attn_res") else None
        d["layer_types"] = tuple(d["layer_types"])
        d["mlp_types"] = tuple(d["mlp_types"])
        d["extra"] = tuple(sorted((d.get("extra") or {}).items()))
        return cls(**d)


def schedule(num_layers: int, mla_every: int, final_mla: bool, first_dense: int) -> tuple[tuple, tuple]:
    """The K3 / Kimi Linear schedule: MLA at 1-based multiples of `mla_every` (and the last layer)."""
    layer_types = tuple(
        "mla" if ((i + 1) % mla_every == 0 or (final_mla and i == num_layers - 1)) else "kda"
        for i in range(num_layers)
    )
    mlp_types = tuple("dense" if i < first_dense else "moe" for i in range(num_layers))
    return layer_types, mlp_types


def _k3() -> K3Config:
    lt, mt = schedule(93, 4, True, 1)
    return K3Config(
        name="k3", hidden_size=7168, vocab_size=163840, layer_types=lt, mlp_types=mt,
        dense_intermediate_size=33792,
        kda=KDAConfig(num_heads=96, head_dim=128, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=96, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=True),
        moe=MoEConfig(num_experts=896, top_k=16, intermediate_size=3072, num_shared_experts=2,
                      latent_dim=3584, latent_norm=True, routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=12),
    )


def _kimi_linear_48b() -> K3Config:
    lt, mt = schedule(27, 4, True, 1)
    return K3Config(
        name="kimi-linear-48b", hidden_size=2304, vocab_size=163840, layer_types=lt, mlp_types=mt,
        dense_intermediate_size=9216,
        kda=KDAConfig(num_heads=32, head_dim=128, gate_lower_bound=None, full_rank_output_gate=False),
        mla=MLAConfig(num_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128,
                      qk_rope_head_dim=64, v_head_dim=128, output_gate=False),
        moe=MoEConfig(num_experts=256, top_k=8, intermediate_size=1024, num_shared_experts=1,
                      latent_dim=None, latent_norm=False, routed_scaling_factor=2.446),
        attn_res=None, activation="silu",
    )


def _k3_mini() -> K3Config:
    # 6 layers: KDA(dense) KDA MLA KDA(block write at 4) MLA MLA -- every branch, incl. the final double MLA.
    # 4 heads, 8 experts, even FFN widths and vocab: splits at TP=2 x EP=2 (the README's multi-GPU lines).
    lt = ("kda", "kda", "mla", "kda", "mla", "mla")
    mt = ("dense",) + ("moe",) * 5
    return K3Config(
        name="k3-mini", hidden_size=64, vocab_size=512, layer_types=lt, mlp_types=mt,
        dense_intermediate_size=128,
        kda=KDAConfig(num_heads=4, head_dim=16, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=4, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, output_gate=True),
        moe=MoEConfig(num_experts=8, top_k=2, intermediate_size=32, num_shared_experts=2,
                      latent_dim=32, latent_norm=True, routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=4),
        max_position_embeddings=4096,
    )


def _k3_bench() -> K3Config:
    lt, mt = schedule(12, 4, True, 1)
    return K3Config(
        name="k3-bench", hidden_size=1024, vocab_size=32768, layer_types=lt, mlp_types=mt,
        dense_intermediate_size=4096,
        kda=KDAConfig(num_heads=8, head_dim=128, gate_lower_bound=-5.0, full_rank_output_gate=True),
        mla=MLAConfig(num_heads=8, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64,
                      qk_rope_head_dim=32, v_head_dim=64, output_gate=True),
        moe=MoEConfig(num_experts=16, top_k=4, intermediate_size=256, num_shared_experts=2,
                      latent_dim=512, latent_norm=True, routed_scaling_factor=1.0),
        attn_res=AttnResConfig(block_size=4),
        max_position_embeddings=65536,
    )


def _kimi_linear_mid() -> K3Config:
    # The CPU anchor's mid-size Kimi Linear (480 M parameters, 8 layers 3 KDA : 1 MLA, 32 experts top-4; fp32 on
    # 2 cores): Kimi Linear's architecture at the widths of k3-bench, for the prefill and decode targets.
    big = _kimi_linear_48b()
    lt, mt = schedule(8, 4, True, 1)
    return replace(big, name="kimi-linear-mid", hidden_size=1024, vocab_size=32768, layer_types=lt, mlp_types=mt,
                   dense_intermediate_size=4096, kda=replace(big.kda, num_heads=8), mla=replace(big.mla, num_heads=8),
                   moe=replace(big.moe, num_experts=32, top_k=4, intermediate_size=512))


PRESETS: dict[str, K3Config] = {
    c.name: c for c in (_k3(), _kimi_linear_48b(), _k3_mini(), _k3_bench(), _kimi_linear_mid())
}


def preset(name: str) -> K3Config:
    """Exact lookup; the error lists the valid names."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"preset={name!r}: unknown; valid presets: {', '.join(sorted(PRESETS))}") from None
