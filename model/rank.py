"""One rank's program: the single-GPU K3 model with heads, FFN width and vocab divided by tp, the local
experts of its EP rank, and collectives as `_c10d_functional.*` graph nodes (model/parallel.py: the plan).

- Column-parallel projections need nothing: they are the local config's smaller layers. Row-parallel
  `o_proj` / `down_proj` are `RowParallelLinear`: the local matmul, then an all-reduce over TP.
- `VocabParallelEmbedding`: a masked lookup in the rank's rows, all-reduced over TP (the zeros of the other
  ranks add exactly, so the embedding is bit-identical). `VocabParallelHead`: local logits all-gathered
  over TP along the vocab axis.
- `ExpertParallelMoE`: the router is replicated; the one `k3::moe` (or `k3::moe_mxfp4`) node routes every
  token over all E experts (gate_weight [E, d]) and computes only the (token, slot) pairs whose expert is
  one of the rank's E_local (w1/w3/w2 are the rank's slice of the expert axis, dense or packed MXFP4),
  given by the op's `expert_offset` argument; the partial latent sums are all-reduced over EP. Per token a
  rank evaluates only its share of the token's top-k experts (k / ep on average), as the single GPU would.
- What differs between ranks is data only, as persistent buffers: `vocab_start` of the embedding and
  `expert_offset` (the global id of the rank's first expert) of every MoE layer. One trace serves all ranks.
- tp = ep = 1 is never routed here: the single-GPU model stays as it is (no collectives in its graph).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import Tensor, nn

from .config import K3Config
from .layers import GatedMLP
from .model import K3ForCausalLM
from .moe import LatentMoE, PackedExperts, StackedExperts
from .options import BuildOptions
from .parallel import Group, ParallelPlan


def all_reduce(x: Tensor, group: Group) -> Tensor:
    return x if group.size == 1 else funcol.all_reduce(x, "sum", group.name)


def all_gather_last(x: Tensor, group: Group) -> Tensor:
    """[..., n] on each rank -> [..., size * n], rank-major (the group size is explicit, so tracing needs no
    process group)."""
    if group.size == 1:
        return x
    y = torch.ops._c10d_functional.all_gather_into_tensor(x.movedim(-1, 0).contiguous(), group.size, group.name)
    return funcol.wait_tensor(y).movedim(0, -1)


class RowParallelLinear(nn.Linear):
    def __init__(self, d_in: int, d_out: int, group: Group) -> None:
        super().__init__(d_in, d_out, bias=False)
        self.group = group

    def forward(self, x: Tensor) -> Tensor:
        return all_reduce(F.linear(x, self.weight), self.group)


class VocabParallelEmbedding(nn.Embedding):
    def __init__(self, rows: int, d: int, group: Group) -> None:
        super().__init__(rows, d)
        self.group = group
        self.register_buffer("vocab_start", torch.zeros((), dtype=torch.int64))

    def forward(self, ids: Tensor) -> Tensor:
        local = ids - self.vocab_start
        inside = (local >= 0) & (local < self.num_embeddings)
        e = F.embedding(local.clamp(0, self.num_embeddings - 1), self.weight)
        return all_reduce(e * inside.unsqueeze(-1).to(e.dtype), self.group)


class VocabParallelHead(nn.Linear):
    def __init__(self, d: int, rows: int, group: Group) -> None:
        super().__init__(d, rows, bias=False)
        self.group = group

    def forward(self, h: Tensor) -> Tensor:
        return all_gather_last(F.linear(h, self.weight), self.group)


class ExpertParallelMoE(LatentMoE):
    """LatentMoE with the rank's `E / ep` experts; router, latent projections and norm replicated, shared
    experts tensor-parallel."""

    def __init__(self, cfg: K3Config, plan: ParallelPlan, build: BuildOptions) -> None:
        super().__init__(cfg, build)
        c, n = cfg.moe, plan.local_experts(cfg)
        self.experts = (PackedExperts if self.packed else StackedExperts)(n, cfg.expert_dim, c.intermediate_size)
        self.register_buffer("expert_offset", torch.zeros(1, dtype=torch.int32))  # set per rank
        self.ep_group = plan.ep_group
        if self.has_shared:
            self.shared_experts = rank_mlp(cfg, c.shared_intermediate_size, plan)

    def routed(self, xf: Tensor, z: Tensor, expert_offset: Tensor | None = None) -> Tensor:
        """This rank's share of Σ p_j E_j(z) (the pairs routed to its experts), all-reduced over the EP group."""
        return all_reduce(super().routed(xf, z, self.expert_offset), self.ep_group)


def rank_mlp(cfg: K3Config, intermediate: int, plan: ParallelPlan) -> GatedMLP:
    """A GatedMLP with 1/tp of the intermediate width and a row-parallel down projection."""
    mlp = GatedMLP(cfg, cfg.hidden_size, intermediate // plan.tp)
    if plan.tp > 1:
        mlp.down_proj = RowParallelLinear(intermediate // plan.tp, cfg.hidden_size, plan.tp_group)
    return mlp


def build_rank_model(cfg: K3Config, plan: ParallelPlan, build: BuildOptions | None = None, *,
                     dtype: torch.dtype = torch.float32) -> K3ForCausalLM:
    """The rank program's module on the meta device (shapes only; every rank's is the same). Fill it with
    `to_empty` + a rank's weights (checkpoint/rank_slices.py), then `set_rank_buffers`."""
    from .init import build_model

    plan.check(cfg)
    local = plan.local_config(cfg)
    model = build_model(local, build, device="meta", dtype=dtype, seed=None)
    d, tp = cfg.hidden_size, plan.tp_group
    with torch.device("meta"):
        if plan.tp > 1:
            model.model.embed_tokens = VocabParallelEmbedding(local.vocab_size, d, tp)
            model.lm_head = VocabParallelHead(d, local.vocab_size, tp)
        for layer in model.model.layers:
            if plan.tp > 1:
                a = layer.self_attn
                a.o_proj = RowParallelLinear(a.o_proj.in_features, d, tp)
                if not layer.is_moe:
                    layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj.in_features, d, tp)
            if layer.is_moe:
                layer.block_sparse_moe = ExpertParallelMoE(cfg, plan, model.build)
    model.cfg = model.model.cfg = local
    return _cast(model, dtype)


def _cast(model: K3ForCausalLM, dtype: torch.dtype) -> K3ForCausalLM:
    fp32_names = ("A_log", "dt_bias", "e_score_correction_bias", "norm.weight")  # as model/init.build_model
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        if t.is_floating_point() and not name.endswith(fp32_names):
            t.data = t.data.to(dtype)
    return model.eval()


def set_rank_buffers(model: K3ForCausalLM, cfg: K3Config, plan: ParallelPlan, rank: int) -> None:
    """Write the data that makes a rank program rank `rank`'s: its vocab offset and its first expert's id."""
    emb = model.model.embed_tokens
    if isinstance(emb, VocabParallelEmbedding):
        emb.vocab_start.fill_(plan.tp_rank(rank) * emb.num_embeddings)
    first = plan.expert_range(cfg, rank).start
    for name, buf in model.named_buffers():
        if name.endswith("expert_offset"):
            buf.fill_(first)


def rank_state_dict(full: dict[str, Tensor], cfg: K3Config, plan: ParallelPlan, rank: int,
                    build: BuildOptions | None = None) -> dict[str, Tensor]:
    """A rank's weights cut from a whole single-GPU state dict (presets, tests); checkpoints are read
    slice by slice instead (checkpoint/rank_slices.py)."""
    model = build_rank_model(cfg, plan, build, dtype=next(iter(full.values())).dtype).to_empty(device="cpu")
    set_rank_buffers(model, cfg, plan, rank)
    out = dict(model.state_dict())
    for name, t in full.items():
        out[name] = plan.shard(name, t, rank)
    return out
