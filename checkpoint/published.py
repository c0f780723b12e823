"""The published checkpoint layouts: what `k3x init-checkpoint` writes, and the quantisation block a reader of
packed experts requires. Architecture: docs/model.md §1 and §6.

Two layouts, chosen by the architecture (`is_k3`):
- K3 (`moonshotai/Kimi-K3`): the multimodal `KimiK3ForConditionalGeneration` wrapper. config.json has
  `model_type: kimi_k3` with the text model in `text_config` (`model_type: kimi_linear`); every tensor name
  carries the `language_model.` prefix; `A_log` is stored padded with zeros, `[128]` for K3's 96 heads of
  128 channels. Only that one case is published, so k3x pads to `max(heads, head_dim)`, the rule that case
  fits (heads alone would give 96); the reader uses the first `heads` values of any longer vector.
- Kimi Linear (`moonshotai/Kimi-Linear-*`: no latent MoE, no AttnRes, no gate bound, SiLU, low-rank output
  gate): a plain `KimiLinearForCausalLM` config.json (`model_type: kimi_linear` at the top), names without
  a prefix, `A_log` stored `[1, 1, heads, 1]`.
Both write `torch_dtype` (the dtype of the stored non-expert weights) beside the model fields.

MXFP4 experts (`...experts.{e}.w{1,2,3}.weight_packed` + `weight_scale`) come with the compressed-tensors
block the published K3 config carries (`quantization_config`): `quant_method: compressed-tensors`, format
`mxfp4-pack-quantized`, 4-bit float weights in groups of 32 for `targets: ["Linear"]`, and `ignore` naming
every Linear module that is not a routed expert (the head, shared experts, attention, router, latent
projections, AttnRes projections) as `re:` patterns that match with or without the prefix, as the
published `re:.*shared_experts.*` does. Every tool that keys on that block (llama.cpp's converter, vLLM,
compressed-tensors) would otherwise take the packed bytes for dense weights, so a checkpoint that stores
packed bytes without it, or with a block that says another format, is refused (`check_quantization`).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from ..model.config import ConfigError, K3Config

if TYPE_CHECKING:
    import torch

PREFIX = "language_model."
K3_ARCHITECTURE = "KimiK3ForConditionalGeneration"
KIMI_LINEAR_ARCHITECTURE = "KimiLinearForCausalLM"
QUANT_METHOD = "compressed-tensors"
MXFP4_FORMAT = "mxfp4-pack-quantized"
MXFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32, "symmetric": True,
                 "dynamic": False}
PACKED_PARTS = (".weight_packed", ".weight_scale")
_LAYER = re.compile(r"^model\.layers\.\d+\.")


def is_k3(cfg: K3Config) -> bool:
    """The K3 layout for any config that uses one of K3's additions to Kimi Linear; else Kimi Linear's."""
    return (cfg.attn_res is not None or cfg.moe.latent_dim is not None or cfg.kda.gate_lower_bound is not None
            or cfg.kda.full_rank_output_gate or cfg.activation != "silu")


def stored_name(cfg: K3Config, name: str) -> str:
    """A checkpoint tensor name (model naming, experts unstacked) in the layout of `cfg`."""
    return PREFIX + name if is_k3(cfg) else name


def stored_a_log(cfg: K3Config, a_log: torch.Tensor) -> torch.Tensor:
    """`A_log` `[H]` as the layout stores it: K3 padded with zeros to `max(H, head_dim)`; Kimi Linear
    `[1, 1, H, 1]`."""
    if not is_k3(cfg):
        return a_log.reshape(1, 1, -1, 1).contiguous()
    out = a_log.new_zeros(max(a_log.numel(), cfg.kda.head_dim))
    out[: a_log.numel()] = a_log
    return out


def ignore_patterns(shapes: dict[str, tuple[int, ...]]) -> list[str]:
    """`ignore` of the quantisation block: one `re:` pattern per kind of Linear module (a 2-D `.weight`,
    embeddings aside; stacked experts are named `experts.w1` and never match) among `shapes` {model tensor
    name: shape}; shared experts as the published config writes them."""
    out: list[str] = []
    for name, shape in shapes.items():
        if len(shape) != 2 or not name.endswith(".weight") or "embed_tokens" in name:
            continue
        module = _LAYER.sub("", name[: -len(".weight")])
        pattern = "re:.*shared_experts.*" if "shared_experts." in module else f"re:.*{re.escape(module)}$"
        if pattern not in out:
            out.append(pattern)
    return out


def quantization_config(shapes: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The compressed-tensors block of a checkpoint of the model whose state is `shapes` ({model tensor name:
    shape}) with its routed experts MXFP4 and every other Linear weight left as it is."""
    return {
        "quant_method": QUANT_METHOD,
        "format": MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(MXFP4_WEIGHTS),
                                      "input_activations": None, "output_activations": None,
                                      "format": MXFP4_FORMAT}},
        "ignore": ignore_patterns(shapes),
        "kv_cache_scheme": None,
    }


def quantization_block(raw: dict[str, Any]) -> Any:
    """config.json's `quantization_config` (top level, or in `text_config`), None when absent."""
    text = raw.get("text_config")
    block = raw.get("quantization_config")
    return block if block is not None or not isinstance(text, dict) else text.get("quantization_config")


def check_quantization(raw: dict[str, Any], packed: bool, where: str) -> None:
    """Refuse (ConfigError naming `where` and the field) packed expert bytes that config.json does not declare
    as compressed-tensors MXFP4, groups of 32. Dense checkpoints pass whatever the block says: their float
    weights read one way only."""
    if not packed:
        return
    block = quantization_block(raw)
    if block is None:
        raise ConfigError(f"{where}: no quantization_config block, yet the checkpoint stores packed experts "
                          "(weight_packed / weight_scale); refused rather than read as dense weights (add the "
                          f"{QUANT_METHOD} {MXFP4_FORMAT} block `k3x init-checkpoint` writes)")
    if not isinstance(block, dict):
        raise ConfigError(f"{where}: quantization_config must be an object")
    if block.get("quant_method") != QUANT_METHOD:
        raise ConfigError(f"{where}: quantization_config.quant_method={block.get('quant_method')!r}; packed "
                          f"experts are read only as {QUANT_METHOD!r}")
    groups = block.get("config_groups") or {}
    if not isinstance(groups, dict) or not all(isinstance(g, dict) for g in groups.values()):
        raise ConfigError(f"{where}: quantization_config.config_groups must map names to objects")
    formats = {f for f in [block.get("format"), *(g.get("format") for g in groups.values())] if f is not None}
    if formats != {MXFP4_FORMAT}:
        raise ConfigError(f"{where}: quantization_config.format={sorted(map(str, formats)) or None}; packed "
                          f"experts are read only as {MXFP4_FORMAT!r}")
    for gname, group in groups.items():
        weights = group.get("weights")
        if weights is None:
            continue
        for field in ("num_bits", "type", "group_size"):
            got = weights.get(field) if isinstance(weights, dict) else None
            if got != MXFP4_WEIGHTS[field]:
                raise ConfigError(f"{where}: quantization_config.config_groups.{gname}.weights.{field}={got!r}; "
                                  f"MXFP4 is {MXFP4_WEIGHTS[field]!r}")


def holds_packed(names) -> bool:
    """Whether any stored tensor name is a packed-weight part (`weight_packed` / `weight_scale`)."""
    return any(n.endswith(PACKED_PARTS) for n in names)
