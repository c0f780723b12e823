"""The serving step: one forward over B sequences packed end to end, prefill chunks and decode
tokens mixed, state read from pools.

    step = K3ServingStep(lm, kernels=Kernels.REFERENCE)   # lm's own modules: no weight copy
    logits, new = step(input_ids, cu_seqlens, past_lens, slots, block_table, logits_index, pools)

Inputs (flat, named by `input_names`): input_ids [N] int64, cu_seqlens [B+1] int32, past_lens [B] int32,
slots [B] int32, block_table [B, MB] int32, logits_index [M] int64, then the pools in layer order:
`pool.{i}.conv` [S, 3P, W-1] fp32 and `pool.{i}.recurrent` [S, H, K, V] fp32 per KDA layer, `pool.{i}.latent`
[NB, BS, kv_lora + rope] per MLA layer. Outputs (`output_names`): logits [M, vocab] fp32, then per layer
`new.{i}.conv` [B, 3P, W-1], `new.{i}.recurrent` [B, H, K, V] (the state after the step), `new.{i}.latent`
[N, kv_lora + rope] (this step's latents, packed like input_ids). Pools are never written here: the runtime
writes the new rows back (runtime/pools.py).

Fused decode: when every sequence of a step has one token (N == B) and the step runs eagerly, each KDA layer
takes `KimiDeltaAttention.forward_decode` (k3::kda_decode: one kernel per layer) instead of the packed path;
same inputs, same outputs. The choice is made per call on concrete sizes; a traced step (torch.export for
pt2 / ONNX / TensorRT / AOTI: N is symbolic) always keeps the packed path, which handles every step, so the
exported graph and its contract do not change. `fused_decode=False` turns it off.

Token-wise parts (embedding, norms, AttnRes over depth, FFN / MoE, head) run on x [1, N, d] through the
decoder layers unchanged; only the mixers are sequence-aware (`KimiDeltaAttention.forward_packed`,
`GatedMLA.forward_paged`). The final AttnRes mix, norm and head run on the `logits_index` rows only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.common import cast
from ..plan.kernels import Kernels
from .block import DecoderLayer, Mixer
from .config import K3Config
from .model import K3ForCausalLM
from .state import state_specs

STEP_INPUTS = ("input_ids", "cu_seqlens", "past_lens", "slots", "block_table", "logits_index")


def pool_names(cfg: K3Config) -> list[tuple[str, str]]:
    """(pool input, step output) names in layer order: `pool.{i}.conv` -> `new.{i}.conv`, ..."""
    return [(f"pool.{s.layer}.{s.kind}", f"new.{s.layer}.{s.kind}") for s in state_specs(cfg) if s.layer >= 0]


class K3ServingStep(nn.Module):
    def __init__(self, lm: K3ForCausalLM, *, kernels: Kernels | str = Kernels.REFERENCE,
                 fused_decode: bool = True) -> None:
        super().__init__()
        self.lm, self.cfg, self.kernels, self.fused_decode = lm, lm.cfg, Kernels(kernels), fused_decode
        names = pool_names(lm.cfg)
        self.input_names = [*STEP_INPUTS, *(p for p, _ in names)]
        self.output_names = ["logits", *(n for _, n in names)]

    def _mixer(self, layer: DecoderLayer, pools: list[Tensor], feeds: dict[str, Tensor], decode: bool) -> Mixer:
        """The layer's attention on the step's [1, N, d] hidden as its ops take it, [N, d] (squeeze, not h[0]:
        ONNX Runtime runs a Squeeze on the same buffer where h[0], a Gather, copied it in every layer)."""
        attn, k = layer.self_attn, self.kernels

        if layer.kind == "kda" and decode:
            def mix(h: Tensor) -> tuple[Tensor, list[Tensor]]:
                y, conv, rec = attn.forward_decode(h.squeeze(0), pools[0], pools[1], feeds["slots"], kernels=k)
                return y[None], [conv, rec]
        elif layer.kind == "kda":
            def mix(h: Tensor) -> tuple[Tensor, list[Tensor]]:
                y, conv, rec = attn.forward_packed(h.squeeze(0), pools[0], pools[1], feeds["cu_seqlens"],
                                                   feeds["slots"], kernels=k)
                return y[None], [conv, rec]
        else:
            def mix(h: Tensor) -> tuple[Tensor, list[Tensor]]:
                y, latent = attn.forward_paged(h.squeeze(0), pools[0], feeds["block_table"], feeds["past_lens"],
                                               feeds["cu_seqlens"], kernels=k)
                return y[None], [latent]
        return mix

    def decode_only(self, input_ids: Tensor, slots: Tensor) -> bool:
        """Whether this call takes the fused decode: enabled, eager (concrete sizes, not a trace) and one token
        per sequence (N == B: every sequence of a step has at least one token)."""
        n, b = input_ids.shape[0], slots.shape[0]
        eager = not torch.compiler.is_compiling() and type(n) is int and type(b) is int
        return self.fused_decode and eager and n == b

    def forward(self, input_ids: Tensor, cu_seqlens: Tensor, past_lens: Tensor, slots: Tensor, block_table: Tensor,
                logits_index: Tensor, pools: list[Tensor]) -> tuple[Tensor, list[Tensor]]:
        m = self.lm.model
        if len(pools) != len(self.input_names) - len(STEP_INPUTS):
            raise ValueError(f"pools: {len(pools)} tensors; this model takes {len(self.input_names) - len(STEP_INPUTS)}")
        feeds = {"cu_seqlens": cu_seqlens, "past_lens": past_lens, "slots": slots, "block_table": block_table}
        decode = self.decode_only(input_ids, slots)
        prefix, bank = m.embed_tokens(input_ids)[None], None  # [1, N, d]
        new: list[Tensor] = []
        for layer, sl in zip(m.layers, m.state_slices):
            prefix, bank, state = layer(prefix, bank, [], mix=self._mixer(layer, pools[sl], feeds, decode))
            new.extend(state)
        rows = logits_index
        prefix = prefix.index_select(1, rows)  # the rest is token-wise: only the wanted rows
        bank = None if bank is None else bank.index_select(1, rows)
        return cast(self.lm.lm_head(m.finish(prefix, bank)[0]), torch.float32), new
