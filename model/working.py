"""The working memory of one serving step: what a step holds on top of the pools while it runs (for long
contexts: peak = pools + this), derived from the shapes, not calibrated.

    step_working_bytes(cfg, rows=512, block_size=16) -> {"attention_bytes", "kda_bytes", "total_bytes", ...}

The serving step (model/serving.py) runs on the meta device (no weights, no data) for one sequence of `rows`
tokens whose past fills at least one key block, under `LiveBytes`: every op's new outputs are counted while
their storage lives (views and in-place results share a counted storage; the weights, feeds and pools are
the caller's, not counted), and the high-water mark is kept. Custom ops run there as their fake impls (their
outputs only); k3::mla_paged's own temporaries (custom_ops/mla_paged/blocked.py `working_bytes`: one key
block's scores and keys, the online-softmax state) are added on top of what is live when it is called, so
the peak is the largest moment of the step. The same for the other custom ops whose CPU implementation holds
temporaries: k3::kda_packed (custom_ops/kda_packed/reference.py `working_bytes`: its chunked form's [H, C, C, K]
pairwise decays, a constant ~4 MiB on k3-mini whatever the chunk) and k3::attn_res (custom_ops/attn_res/reference.py
`working_bytes`: the stacked sources and keys). k3::moe's are not counted (its expert GEMMs of the routed rows).
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..custom_ops.attn_res import reference as attn_res_ref
from ..custom_ops.kda_packed import reference as kda_packed_ref
from ..custom_ops.mla_paged import blocked
from .config import K3Config
from .state import pool_dims


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of the tensors ops create while they live: `now`, and `peak` (high-water mark).
    `known`: tensors that exist before (not counted, nor their views); `inner`: {op overload: fn(args) ->
    bytes} an op holds inside while it runs (added to `now` for the peak during that call)."""

    def __init__(self, known: list[Tensor] = (), inner: dict | None = None) -> None:
        super().__init__()
        self.known = {id(t.untyped_storage()) for t in known}
        self.keep = [t.untyped_storage() for t in known]  # ids stay valid while counting
        self.inner = inner or {}
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def free(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.inner:
            self.peak = max(self.peak, self.now + self.inner[func](args))
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, Tensor):
                st = t.untyped_storage()
                key = id(st)
                if key in self.live or key in self.known or st.nbytes() == 0:
                    continue
                self.live[key] = st.nbytes()
                self.now += st.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(st, self.free, key)
        return out


def attention_bytes(args) -> int:
    """k3::mla_paged's temporaries for its call args (q_latent, q_rope, latent, latent_pool, ...)."""
    q_latent, q_rope, _, latent_pool = args[:4]
    N, H, C = q_latent.shape
    return blocked.working_bytes(N, H, C, q_rope.shape[-1], latent_pool.shape[1],
                                 item_bytes=latent_pool.element_size())


def kda_bytes(args) -> int:
    """k3::kda_packed's temporaries (outputs included) for its call args (q, k, v, g, beta, pool, cu, slots)."""
    q, _, v = args[:3]
    N, H, K = q.shape
    return kda_packed_ref.working_bytes(N, H, K, v.shape[-1], sequences=args[7].shape[0], item_bytes=v.element_size())


def mix_bytes(args) -> int:
    """k3::attn_res's temporaries (output included) for its call args (prefix [..., d], bank [..., N, d], ...)."""
    prefix, bank = args[:2]
    return attn_res_ref.working_bytes(prefix.numel() // prefix.shape[-1], bank.shape[-2] + 1, prefix.shape[-1],
                                      item_bytes=prefix.element_size())


def inner_bytes() -> dict:
    """{custom op: fn(args) -> bytes it holds inside} for LiveBytes: the ops whose CPU implementation holds
    temporaries the meta run does not see."""
    k3 = torch.ops.k3
    return {k3.mla_paged.default: attention_bytes, k3.kda_packed.default: kda_bytes, k3.attn_res.default: mix_bytes}


def step_working_bytes(cfg: K3Config, rows: int, block_size: int = 16,
                       dtype: torch.dtype = torch.float32) -> dict[str, int]:
    """Peak bytes one serving step of `rows` tokens (one sequence, a prefill chunk) holds besides the weights
    and pools: see the module docstring. `attention_bytes`: k3::mla_paged's part at its call."""
    from .init import build_model
    from .serving import K3ServingStep

    step = K3ServingStep(build_model(cfg, device="meta", dtype=dtype, seed=None), kernels="reference")
    past = blocked.key_block_for(block_size)
    blocks = -(-(past + rows) // block_size)
    i32 = torch.int32
    with torch.device("meta"):
        feeds = {"input_ids": torch.empty(rows, dtype=torch.int64), "cu_seqlens": torch.empty(2, dtype=i32),
                 "past_lens": torch.empty(1, dtype=i32), "slots": torch.empty(1, dtype=i32),
                 "block_table": torch.empty(1, blocks, dtype=i32), "logits_index": torch.empty(1, dtype=torch.int64)}
        pools = [torch.empty([blocks if d == "blocks" else 1 if d == "slots" else d for d in dims],
                             dtype=dtype if name.endswith(".latent") else torch.float32)
                 for name, dims in pool_dims(cfg, block_size).items()]
    known = [*feeds.values(), *pools, *step.parameters(), *step.buffers()]
    with torch.no_grad(), LiveBytes(known, inner_bytes()) as m:
        step(**feeds, pools=pools)
    attn = blocked.working_bytes(rows, cfg.mla.num_heads, cfg.mla.kv_lora_rank, cfg.mla.qk_rope_head_dim,
                                 block_size, item_bytes=dtype.itemsize)
    kda = kda_packed_ref.working_bytes(rows, cfg.kda.num_heads, cfg.kda.head_dim, cfg.kda.head_dim,
                                       item_bytes=dtype.itemsize)
    return {"rows": rows, "key_block": past, "attention_bytes": attn, "kda_bytes": kda, "total_bytes": m.peak}
