"""One decoder layer: a mixer (KDA or MLA) and an FFN (dense or MoE), joined either by Block
Attention Residuals (K3, docs/model.md §4.2) or by the plain pre-norm residual (Kimi Linear).

AttnRes dataflow per layer l (state: `prefix` = running partial block sum, `bank` [B, T, N, d]):
  1. h = AttnRes(prefix, bank) if the bank is non-empty, else prefix (layer 0: the embedding);
  2. if l starts a block: bank <- [bank, prefix], prefix <- 0;
  3. prefix += mixer(input_layernorm(h));
  4. prefix += ffn(post_attention_layernorm(AttnRes(prefix, bank)))
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor, nn

from ..custom_ops.attn_res import attn_res
from .config import K3Config
from .kda import KimiDeltaAttention
from .layers import GatedMLP, RMSNorm, linear
from .mla import GatedMLA
from .moe import LatentMoE
from .options import BuildOptions


Mixer = Callable[[Tensor], tuple[Tensor, list[Tensor]]]  # normed input -> (mixer output, new state)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: K3Config, index: int, build: BuildOptions) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg, self.index, self.kernels = cfg, index, build.kernels
        self.kind = cfg.layer_types[index]
        self.self_attn = KimiDeltaAttention(cfg, build.kernels) if self.kind == "kda" else GatedMLA(cfg)
        self.input_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(d, cfg.rms_norm_eps)
        self.is_moe = cfg.mlp_types[index] == "moe"
        if self.is_moe:
            self.block_sparse_moe = LatentMoE(cfg, build)
        else:
            self.mlp = GatedMLP(cfg, d, cfg.dense_intermediate_size)
        self.block_start = index in cfg.block_starts()
        if cfg.attn_res is not None:
            self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(d, cfg.rms_norm_eps), linear(d, 1)
            self.mlp_res_norm, self.mlp_res_proj = RMSNorm(d, cfg.rms_norm_eps), linear(d, 1)

    @property
    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if self.is_moe else self.mlp

    def _mix(self, h: Tensor, state: list[Tensor], length: Tensor | None) -> tuple[Tensor, list[Tensor]]:
        if self.kind == "kda":
            y, conv, rec = self.self_attn(h, state[0], state[1])
            return y, [conv, rec]
        y, latent = self.self_attn(h, state[0], length)
        return y, [latent]

    def _attn_res(self, which: str, prefix: Tensor, bank: Tensor) -> Tensor:
        norm, proj = getattr(self, f"{which}_res_norm"), getattr(self, f"{which}_res_proj")
        return attn_res(prefix, bank, norm.weight, proj.weight, eps=self.cfg.rms_norm_eps, kernels=self.kernels)

    def forward(self, prefix: Tensor, bank: Tensor | None, state: list[Tensor], length: Tensor | None = None,
                mix: Mixer | None = None) -> tuple[Tensor, Tensor | None, list[Tensor]]:
        """prefix [B, T, d]; bank [B, T, N, d] or None; length: the static cache's past_length (MLA) or None
        -> (prefix, bank, new state). `mix`: the mixer call in place of this layer's own over `state` (the
        serving step's packed / paged mixers, model/serving.py); everything else is the same."""
        mix = mix or (lambda x: self._mix(x, state, length))
        if self.cfg.attn_res is None:  # plain pre-norm residual: `prefix` is the residual stream
            a, state = mix(self.input_layernorm(prefix))
            h = prefix + a
            return h + self.ffn(self.post_attention_layernorm(h)), None, state
        h = prefix if bank is None else self._attn_res("self_attention", prefix, bank)
        zero_prefix = self.block_start
        if self.block_start:
            bank = prefix.unsqueeze(2) if bank is None else torch.cat([bank, prefix.unsqueeze(2)], dim=2)
        a, state = mix(self.input_layernorm(h))
        prefix = a if zero_prefix else prefix + a
        assert bank is not None, "AttnRes: layer 0 must start a block"
        h2 = self._attn_res("mlp", prefix, bank)
        return prefix + self.ffn(self.post_attention_layernorm(h2)), bank, state
