"""Gated Multi-head Latent Attention with no positional encoding (docs/model.md §3; DeepSeek-V2/V3 MLA).

- Query: q_a_proj -> RMSNorm -> q_b_proj (or a direct q_proj when q_lora_rank is None).
- KV: kv_a_proj_with_mqa -> [c_KV (kv_lora_rank) | k_extra (rope dim)]; only c_KV is normalised.
  The cache holds exactly this latent per token, `[B, S, kv_lora_rank + rope_dim]`, in the model dtype.
- NoPE: the rope slices are used un-rotated; `k_extra` is shared by all heads. Scale qk_head_dim^-1/2.
- Absorbed (`forward` and the serving step alike): the nope queries go through W_uk (kv_b_proj's key block)
  into the latent space, every head's queries are the rows of one GEMM against the cached latent itself
  ([c_KV | k_extra] is the key), the probabilities weigh c_KV, and W_uv (its value block) takes the result to
  the heads' value width. A decode step reads each cached latent once (S·(C+R) floats) instead of
  up-projecting every one through kv_b_proj (S·C·H·(qk_nope + v_head) MACs: ~4 GFLOP per MLA layer at 2 K
  positions on k3-bench), so its cost stays flat in the context; a prefill of T tokens pays T·S·H·(2C+R)
  MACs for the attention instead of S·C·H·(qk_nope + v_head) + T·S·H·(qk_nope + R + v_head) (k3-bench: more
  from ~85 tokens on, ~3x at 2 K from an empty cache), still a small share of a prefill's weight GEMMs.
- Scores in the model dtype, softmax in fp32, causal with the past offset; output gate σ(g_proj x).
- The values (c_KV) are weighed as the whole cached latent, [c_KV | k_extra], and the result's first
  kv_lora_rank columns kept: a slice of the cache, `present[..., :kv_lora_rank]`, is a copy of all of it in
  ONNX (a Slice node: 0.33 ms a decode step per MLA layer at 2,048 positions on kimi-linear-mid, one thread);
  the product's rope_dim extra columns cost less (rope_dim / kv_lora_rank more MACs over the same bytes).
- Static cache (`past_length` given, model/state.py): `past_latent` is [B, C, ...] of fixed capacity C; the
  new latents are scattered in at [past_length, past_length + T) (out of place: `scatter` -> ONNX
  ScatterElements, which TensorRT parses), keys are computed for all C positions and position j is visible
  to query t iff j <= past_length + t — the growing cache's causal rule with the offset as a tensor, so both
  give the same result on the filled positions. Capacity overflow is refused by the caller (K3Model on CPU,
  runners.check_request before a run): a scatter index past C is an error, not a clear one.
Plain PyTorch: it lowers to standard ONNX ops.
- Serving step (`forward_paged`): packed sequences over a paged latent pool, weights absorbed, through the
  `k3::mla_paged` custom op (custom_ops/mla_paged).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..custom_ops.common import cast
from ..custom_ops.mla_paged import mla_paged
from ..plan.kernels import Kernels
from .config import K3Config
from .layers import RMSNorm, linear


class GatedMLA(nn.Module):
    def __init__(self, cfg: K3Config) -> None:
        super().__init__()
        m, d = cfg.mla, cfg.hidden_size
        self.m = m
        self.use_q_lora = m.q_lora_rank is not None
        if self.use_q_lora:
            self.q_a_proj = linear(d, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, m.norm_eps)
            self.q_b_proj = linear(m.q_lora_rank, m.num_heads * m.qk_head_dim)
        else:
            self.q_proj = linear(d, m.num_heads * m.qk_head_dim)
        self.kv_a_proj_with_mqa = linear(d, m.latent_dim)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, m.norm_eps)
        self.kv_b_proj = linear(m.kv_lora_rank, m.num_heads * (m.qk_nope_head_dim + m.v_head_dim))
        if m.output_gate:
            self.g_proj = linear(d, m.num_heads * m.v_head_dim)
        self.o_proj = linear(m.num_heads * m.v_head_dim, d)

    def _query(self, x: Tensor) -> Tensor:
        """x [..., d] -> q [..., H, qk_nope + rope]."""
        m = self.m
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.use_q_lora else self.q_proj(x)
        return q.unflatten(-1, (-1, m.qk_head_dim))

    def _latent(self, x: Tensor) -> Tensor:
        """x [..., d] -> the cached latent [..., kv_lora + rope]: normed c_KV | k_extra."""
        c, k_extra = self.kv_a_proj_with_mqa(x).split([self.m.kv_lora_rank, self.m.qk_rope_head_dim], dim=-1)
        return torch.cat([self.kv_a_layernorm(c), k_extra], dim=-1)

    def _output(self, o: Tensor, x: Tensor) -> Tensor:
        """Attention output o [..., H * v_head_dim] -> y [..., d]: the output gate σ(g_proj x), then o_proj."""
        if self.m.output_gate:
            o = o * cast(torch.sigmoid(cast(self.g_proj(x), torch.float32)), o.dtype)
        return self.o_proj(o)

    def forward(self, x: Tensor, past_latent: Tensor, past_length: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """x [B, T, d]; past_latent [B, P, kv_lora + rope] -> (y [B, T, d], present [B, P+T, kv_lora + rope]).
        Static cache: past_latent [B, C, ...] and past_length (int64 scalar) -> present [B, C, ...]."""
        m = self.m
        B, T, _ = x.shape
        H, R, N, Dv = m.num_heads, m.qk_rope_head_dim, m.qk_nope_head_dim, m.v_head_dim
        q = self._query(x).transpose(1, 2)  # [B, H, T, N+R]
        latent = self._latent(x)  # [B, T, kv_lora + R]
        if past_length is None:
            present = torch.cat([cast(past_latent, latent.dtype), latent], dim=1)  # [B, S, kv_lora + R]
            offset = present.shape[1] - T
        else:
            offset = past_length + torch.arange(T, device=x.device)  # [T] cache positions written
            index = offset.view(1, T, 1).expand(B, T, latent.shape[-1])
            present = cast(past_latent, latent.dtype).scatter(1, index, latent)  # [B, C, kv_lora + R]
            offset = past_length
        S = present.shape[1]
        w_uk, w_uv = self._absorbed()  # [H, Nn, C], [H, Dv, C]
        q_nope, q_rope = q.split([N, R], dim=-1)  # [B, H, T, N], [B, H, T, R]
        q_latent = torch.cat([q_nope @ w_uk, q_rope], dim=-1).reshape(B, H * T, m.latent_dim)  # [B, H*T, C + R]
        # every head's queries as rows of one GEMM against the latent itself (keys: [c_KV | k_extra])
        scores = cast(q_latent @ present.transpose(1, 2), torch.float32).reshape(B, H, T, S) * (N + R) ** -0.5
        qpos = torch.arange(T, device=x.device)[:, None] + offset  # absolute query positions
        causal = torch.arange(S, device=x.device)[None, :] <= qpos  # [T, S]
        probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
        # the values are c_KV (the latent's first C columns): weighed over the whole latent, then the output's
        # first C columns kept, which reads the cache in place instead of copying its c_KV columns out first
        o = (cast(probs, present.dtype).reshape(B, H * T, S) @ present)[..., :m.kv_lora_rank]
        o = o.reshape(B, H, T, m.kv_lora_rank)  # [B, H, T, C]
        o = (o @ w_uv.transpose(1, 2)).transpose(1, 2).reshape(B, T, H * Dv)  # [B, T, H*Dv]
        return self._output(o, x), present

    def _absorbed(self) -> tuple[Tensor, Tensor]:
        """kv_b_proj's per-head blocks: W_uk [H, qk_nope, kv_lora] (keys), W_uv [H, v_head, kv_lora] (values)."""
        m = self.m
        return self.kv_b_proj.weight.unflatten(0, (-1, m.qk_nope_head_dim + m.v_head_dim)).split(
            [m.qk_nope_head_dim, m.v_head_dim], dim=1)

    def forward_paged(self, x: Tensor, latent_pool: Tensor, block_table: Tensor, past_lens: Tensor,
                      cu_seqlens: Tensor, *, kernels: Kernels) -> tuple[Tensor, Tensor]:
        """A serving step with absorbed weights: x [N, d] (B sequences packed end to end, sequence b = rows
        cu_seqlens[b]:cu_seqlens[b+1], its first token at position past_lens[b]); latent_pool [NB, BS,
        kv_lora + rope] read through block_table [B, MB] int32 (never written) -> (y [N, d], new_latent [N,
        kv_lora + rope]: this step's latents, which the runtime writes into the pool).
        Absorbed: q_nope goes through W_uk into the latent space, attention runs over the latent itself
        (k3::mla_paged), its output goes through W_uv — `forward`'s math over a paged pool."""
        m = self.m
        q_nope, q_rope = self._query(x).split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)  # [N, H, Nn | R]
        latent = self._latent(x)  # [N, kv_lora + R]
        w_uk, w_uv = self._absorbed()  # [H, Nn, C], [H, Dv, C]
        # batched matmuls over heads, not einsum: ONNX Runtime's Einsum ran them at ~36 GFLOP/s on CPU
        q_latent = (q_nope.transpose(0, 1) @ w_uk).transpose(0, 1)  # [N, H, C]
        o = mla_paged(q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,
                      scale=m.qk_head_dim ** -0.5, kernels=kernels)  # [N, H, C]
        v = (o.transpose(0, 1) @ w_uv.transpose(1, 2)).transpose(0, 1).flatten(1)  # [N, H * Dv]
        return self._output(v, x), latent
