"""`k3::mla_paged` — schema, fake impl, shape rule, limits and the kernel dispatch. Torch-only; Triton is
imported lazily.

    k3::mla_paged(q_latent [N, H, C], q_rope [N, H, R], latent [N, C+R], latent_pool [NB, BS, C+R],
                  block_table [B, MB] int32, past_lens [B] int32, cu_seqlens [B+1] int32, scale, kernels)
        -> o [N, H, C] (q_latent's dtype)
Same contract as `reference.mla_paged`: absorbed MLA attention of a serving step's packed tokens over each
sequence's past latents (read from the paged pool through its block table) and this step's latents (causal).
The query comes in two parts (the absorbed q_nope in the latent space, the rope part) rather than one
[N, H, C+R] tensor, so the shape rule gets C from an input's shape; the score is their sum, the same math.
Node attributes (static dims a plugin sizes its work from): num_heads H, kv_lora_rank C, rope_dim R,
block_size BS. Kernels "reference" run blocked.py (key blocks, online softmax: temporaries bounded by the step's
rows x heads x key block), checked against reference.py (the simple oracle).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from . import blocked
from .limits import KERNEL_MAX_LATENT




def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::mla_paged cannot run `cfg` (None if it can); `kernels`: also the Triton kernel limits."""
    m = getattr(cfg, "mla", None)
    if m is None or not kernels or m.latent_dim <= KERNEL_MAX_LATENT:
        return None
    return (f"mla.kv_lora_rank + mla.qk_rope_head_dim = {m.latent_dim}: the Triton k3::mla_paged kernels (and the "
            f"TensorRT plugin) support at most {KERNEL_MAX_LATENT}")


def mla_paged_output_shape(q_latent_shape):
    """One shape rule for the fake impl and the TensorRT plugin: o has q_latent's shape [N, H, C]."""
    return tuple(q_latent_shape)


SIGNATURE = Signature(
    "mla_paged", "MLAPaged",
    inputs=(TensorPort("q_latent", "T"), TensorPort("q_rope", "T", "q_latent"), TensorPort("latent", "T", "q_latent"),
            TensorPort("latent_pool", "T", "q_latent"), TensorPort("block_table", "I"), TensorPort("past_lens", "I"),
            TensorPort("cu_seqlens", "I")),
    outputs=(TensorPort("o", "T", "q_latent"),),
    attrs=(Attr("scale", float), Attr("num_heads", int, op=False), Attr("kv_lora_rank", int, op=False),
           Attr("rope_dim", int, op=False), Attr("block_size", int, op=False), KERNELS),
    shapes=lambda s: [mla_paged_output_shape(s[0])],
    doc="Absorbed MLA attention over a paged latent cache, for B sequences packed end to end. q_latent [N, H, C], "
        "q_rope [N, H, R], latent [N, C+R] (this step's), latent_pool [NB, BS, C+R], block_table [B, MB] int32, "
        "past_lens [B] int32, cu_seqlens [B+1] int32 -> o [N, H, C]. Token t of sequence b sees b's positions "
        "0..past_lens[b]-1 through the block table and this step's rows 0..t of b; softmax in fp32; "
        "o = sum p * key[:C]. Same contract as torch.ops.k3.mla_paged.",
)


@SIGNATURE.define
def _mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
               past_lens: Tensor, cu_seqlens: Tensor, scale: float, kernels: str) -> Tensor:
    args = (q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens)
    if require_kernels("k3::mla_paged", kernels, *args) is Kernels.TRITON:
        from . import triton

        return triton.mla_paged(*args, scale=scale)
    return blocked.mla_paged(*args, scale=scale)


def mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
              past_lens: Tensor, cu_seqlens: Tensor, *, scale: float,
              kernels: Kernels = Kernels.REFERENCE) -> Tensor:
    """o [N, H, C]: see the module docstring. The pool is in the queries' dtype (never cast here: a cast in a
    graph would copy the whole pool every step)."""
    return torch.ops.k3.mla_paged(q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,
                                  float(scale), Kernels(kernels).value)
