"""Explicit inference state: what each layer carries between calls, named as ONNX Runtime GenAI does.

- KDA layer i:  `past.{i}.conv` [batch, 3P, W-1] fp32 (last W-1 pre-conv inputs of q|k|v),
                `past.{i}.recurrent` [batch, H, K, V] fp32  ->  `present.{i}.conv` / `present.{i}.recurrent`
- MLA layer i:  `past_key_values.{i}.latent` [batch, past_seq, kv_lora + rope] (model dtype)
                ->  `present.{i}.latent` [batch, past_seq + seq, ...]
A flat list in layer order (conv before recurrent) is what the model's forward takes and returns.
AttnRes needs no cross-token state (docs/model.md §4.3).

Static latent cache (`CacheOptions(max_context=C)`, model/options.py): every MLA cache is preallocated, `[batch, C, kv_lora + rope]` in
and out (the same shape every step, so a decode step can be a CUDA graph), and the flat list ends with one
more tensor, `past_length` (int64 scalar: positions already in the caches) -> `present_length`
(past_length + seq). The new latents are written at [past_length, past_length + seq); positions beyond are
masked. One length for the whole batch (the sequences of a batch advance together).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .config import K3Config
from .options import CacheOptions


@dataclass(frozen=True)
class StateSpec:
    layer: int
    kind: str  # "conv" | "recurrent" | "latent" | "length" (static cache only; layer -1)
    input_name: str
    output_name: str
    dims: tuple[str | int, ...]  # "batch" / "past_seq" are dynamic
    fp32: bool  # else the model dtype

    def shape(self, batch: int, past_seq: int) -> tuple[int, ...]:
        return tuple(batch if x == "batch" else past_seq if x == "past_seq" else x for x in self.dims)

    def dtype(self, model_dtype: torch.dtype) -> torch.dtype:
        return torch.int64 if self.kind == "length" else torch.float32 if self.fp32 else model_dtype


def state_specs(cfg: K3Config, cache: CacheOptions | None = None) -> list[StateSpec]:
    """The flat state of `cfg` with `cache` (default: a growing latent cache)."""
    capacity = None if cache is None else cache.max_context
    specs: list[StateSpec] = []
    c, m = cfg.kda, cfg.mla
    for i, kind in enumerate(cfg.layer_types):
        if kind == "kda":
            specs.append(StateSpec(i, "conv", f"past.{i}.conv", f"present.{i}.conv",
                                   ("batch", 3 * c.proj_dim, c.conv_kernel - 1), True))
            specs.append(StateSpec(i, "recurrent", f"past.{i}.recurrent", f"present.{i}.recurrent",
                                   ("batch", c.num_heads, c.head_dim, c.head_dim), True))
        else:
            seq = "past_seq" if capacity is None else capacity
            specs.append(StateSpec(i, "latent", f"past_key_values.{i}.latent", f"present.{i}.latent",
                                   ("batch", seq, m.latent_dim), False))
    if capacity is not None:
        specs.append(StateSpec(-1, "length", "past_length", "present_length", (), False))
    return specs


def empty_state(cfg: K3Config, batch: int, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", cache: CacheOptions | None = None) -> list[torch.Tensor]:
    """The state before the first token: zeros, an empty (past_seq = 0) MLA latent cache (static: C zero
    positions and past_length 0)."""
    return [torch.zeros(s.shape(batch, 0), dtype=s.dtype(dtype), device=device)
            for s in state_specs(cfg, cache)]


def state_bytes(cfg: K3Config, dtype_bytes: int = 2) -> dict[str, int]:
    """KDA state bytes per sequence and MLA KV bytes per token (model dtype of `dtype_bytes`)."""
    specs = state_specs(cfg)
    kda = sum(4 * math.prod(s.shape(1, 0)) for s in specs if s.fp32)  # batch 1, any length
    mla = sum(dtype_bytes * s.dims[-1] for s in specs if s.kind == "latent")  # one token
    return {"kda_state_bytes_per_sequence": kda, "mla_kv_bytes_per_token": mla}


def pool_dims(cfg: K3Config, block_size: int) -> dict[str, list[str | int]]:
    """The serving pools of `cfg` by input name, their first dim named: `pool.{i}.conv|recurrent` ["slots", ...]
    (fp32), `pool.{i}.latent` ["blocks", block_size, kv_lora + rope] (model dtype). A rank program's are those
    of its local config: its KDA heads' rows, the whole latent (model/parallel.py)."""
    out: dict[str, list[str | int]] = {}
    for s in state_specs(cfg):
        if s.kind == "latent":
            out[f"pool.{s.layer}.latent"] = ["blocks", block_size, s.dims[-1]]
        elif s.layer >= 0:
            out[f"pool.{s.layer}.{s.kind}"] = ["slots", *s.dims[1:]]
    return out


def blocks_for(positions: int, block_size: int) -> int:
    """Latent blocks of `block_size` positions that hold `positions` positions (a serving deployment's pool)."""
    return -(-positions // block_size)


def pool_bytes(cfg: K3Config, context: int, sequences: int, block_size: int = 16,
               dtype: torch.dtype = torch.bfloat16) -> dict[str, int]:
    """Pool memory of a serving deployment (runtime/pools.py): `sequences` sequences of up to `context`
    positions each -> KDA state bytes per sequence, MLA latent bytes per token (all layers), latent blocks
    (rounded up per sequence) and the totals."""
    if context < 1 or sequences < 1 or block_size < 1:
        raise ValueError(f"context={context}, sequences={sequences}, block_size={block_size}: each must be >= 1")
    per = state_bytes(cfg, dtype_bytes=torch.empty((), dtype=dtype).element_size())
    kda, mla = per["kda_state_bytes_per_sequence"], per["mla_kv_bytes_per_token"]
    blocks = sequences * blocks_for(context, block_size)
    return {"sequences": sequences, "context": context, "block_size": block_size,
            "kda_bytes_per_sequence": kda, "mla_bytes_per_token": mla, "blocks": blocks,
            "kda_bytes": kda * sequences, "mla_bytes": mla * blocks * block_size,
            "total_bytes": kda * sequences + mla * blocks * block_size}
