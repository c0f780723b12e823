"""The K3 causal LM: embeddings, the hybrid decoder stack, AttnRes output mix, final norm, untied head.

Parameter names equal the Hugging Face checkpoint's (`model.layers.{i}.self_attn.q_proj.weight`, ...,
`lm_head.weight`), except the stacked experts (see model/moe.py). The forward pass is export-clean:
state in, state out, as a flat list (model/state.py); KDA, AttnRes and MoE only through torch.ops.k3.
A static latent cache is selected by the inputs: a flat list one longer than the layers' state ends with
`past_length` (state_specs lists it for a static cache, model/options.CacheOptions), so a model loaded from a checkpoint
serves both interfaces.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.attn_res import attn_res
from ..custom_ops.common import cast
from .block import DecoderLayer
from .config import K3Config
from .layers import RMSNorm, linear
from .options import BuildOptions
from .state import state_specs


class K3Model(nn.Module):
    def __init__(self, cfg: K3Config, build: BuildOptions) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.cfg, self.build = cfg, build
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, build) for i in range(cfg.num_layers))
        self.norm = RMSNorm(d, cfg.rms_norm_eps)
        if cfg.attn_res is not None:
            self.output_attn_res_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.output_attn_res_proj = linear(d, 1)
        # how many flat state tensors each layer takes, in layer order
        self.state_slices: list[slice] = []
        start = 0
        for i in range(cfg.num_layers):
            n = sum(1 for s in state_specs(cfg) if s.layer == i)
            self.state_slices.append(slice(start, start + n))
            start += n
        self.latent_index = [j for j, s in enumerate(state_specs(cfg)) if s.kind == "latent"]

    def forward(self, input_ids: Tensor, past: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        n = self.state_slices[-1].stop if self.state_slices else 0
        if len(past) not in (n, n + 1):
            raise ValueError(f"past: {len(past)} tensors; this model takes {n} (+ past_length for a static cache)")
        length = past[n] if len(past) > n else None
        if length is not None:
            _check_capacity(length, input_ids.shape[1], [past[i] for i in self.latent_index])
        prefix, bank = self.embed_tokens(input_ids), None  # [B, T, d]
        present: list[Tensor] = []
        for layer, sl in zip(self.layers, self.state_slices):
            prefix, bank, new = layer(prefix, bank, past[sl], length)
            present.extend(new)
        if length is not None:
            present.append(length + input_ids.shape[1])
        return self.finish(prefix, bank), present

    def finish(self, prefix: Tensor, bank: Tensor | None) -> Tensor:
        """The last layer's (prefix, bank) -> the final hidden states: AttnRes output mix, final norm."""
        if bank is not None:
            prefix = attn_res(prefix, bank, self.output_attn_res_norm.weight, self.output_attn_res_proj.weight,
                              eps=self.cfg.rms_norm_eps, kernels=self.build.kernels)
        return self.norm(prefix)


def _check_capacity(length: Tensor, seq: int, caches: list[Tensor]) -> None:
    """Refuse (one line) a step that would write past a static cache's capacity. Checked for CPU tensors
    outside tracing only: on CUDA reading the length would sync (and break graph capture); runners refuse
    such requests up front (runtime/runners.check_request)."""
    if length.device.type != "cpu" or torch.compiler.is_compiling() or torch.compiler.is_exporting() \
            or isinstance(length, torch._subclasses.FakeTensor) or length.dim() != 0:
        return
    caps = {t.shape[1] for t in caches}  # the latent caches [B, C, L]
    end = int(length) + seq
    if caps and (int(length) < 0 or end > min(caps)):
        raise ValueError(f"past_length {int(length)} + {seq} new positions = {end}: over the static latent "
                         f"cache's capacity max_context={min(caps)}")


class K3ForCausalLM(nn.Module):
    """`cfg`: the architecture; `build`: kernels and expert format (model/options.py)."""

    def __init__(self, cfg: K3Config, build: BuildOptions | None = None) -> None:
        super().__init__()
        self.cfg, self.build = cfg, build or BuildOptions()
        self.build.check(cfg)  # ConfigError naming the field (e.g. Triton kernel or MXFP4 limits) before building
        self.model = K3Model(cfg, self.build)
        self.lm_head = linear(cfg.hidden_size, cfg.vocab_size)

    def forward(self, input_ids: Tensor, past: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        """input_ids [B, T] int64; past: flat state (model/state.py) -> (logits [B, T, vocab] fp32, present)."""
        h, present = self.model(input_ids, past)
        return cast(self.lm_head(h), torch.float32), present
