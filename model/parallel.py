"""The parallel plan as data: how `tp` x `ep` ranks split every weight and every state of a K3 model.

Layout: world = tp * ep ranks; rank r has tp_rank = r % tp and ep_rank = r // tp. The TP group of r is
the tp ranks sharing its ep_rank, the EP group the ep ranks sharing its tp_rank. Every rank sees every
token (attention is tensor-parallel, not data-parallel), so MoE dispatch needs no communication: each
rank picks the tokens routed to its own experts, and the combine is one all-reduce over the EP group of
the latent partial sums (N x L; L = 3584 in K3, half the model width). An all-to-all would only pay off
with data-parallel attention, where each rank holds different tokens (`comm_bytes` reports both).

Splits (`Split.kind`, the split dimension in `Split.dim`):
- column: output rows of a head-structured or FFN-intermediate projection, dim 0 (q/k/v, their convs,
  A_log, dt_bias, b_proj, f_b_proj, g(_b)_proj, q_b_proj, kv_b_proj, gate/up of the dense MLP and shared
  experts): contiguous blocks of whole heads, because every such tensor is head-major;
- row: the input columns of o_proj / down_proj, dim 1; their partial outputs are all-reduced over TP;
- expert: the stacked expert axis, dim 0, over EP. The split never touches the last axes, so it applies
  unchanged to packed MXFP4 experts (`[E, out, in/2]` nibbles + `[E, out, in/32]` E8M0 scales) and to a
  checkpoint's per-expert tensors (`experts.{e}.w1.weight_packed`: a rank reads only its experts);
- vocab: rows of the embedding and the head, dim 0, over TP (embedding: masked lookup + all-reduce;
  head: all-gather of the logits);
- replicated: everything else (norms, AttnRes, the router and its bias, q_a/kv_a, f_a/g_a, the latent
  down/up projections of the MoE).
State: KDA conv/recurrent states are split with their heads (conv channels are q|k|v, each column-split);
the MLA latent is the same on every rank (it is shared by all heads).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor

from .config import ConfigError, K3Config

KINDS = ("column", "row", "expert", "vocab", "replicated")
MAX_WORLD = 4096
_COLUMN = ("q_proj", "k_proj", "v_proj", "q_conv1d", "k_conv1d", "v_conv1d", "f_b_proj", "b_proj", "g_proj",
           "g_b_proj", "A_log", "dt_bias", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
_ROW = ("o_proj", "down_proj")


class ParallelError(ConfigError):
    """The plan cannot split this config; the message names the field and the plan size."""


@dataclass(frozen=True)
class Split:
    kind: str  # one of KINDS
    dim: int | None  # the split dimension; None when replicated


@dataclass(frozen=True)
class Group:
    """A process group as the traced graph names it: the name is the same on every rank (each rank registers
    its own TP / EP group under it, runtime/dist_run.py), so one trace serves all ranks."""
    name: str
    size: int


TP_GROUP, EP_GROUP = "k3x_tp", "k3x_ep"


def split_of(name: str) -> Split:
    """How the parameter/buffer `name` (the model's own name) is split."""
    parts = name.split(".")
    owner = parts[-2] if len(parts) >= 2 else ""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return Split("vocab", 0)
    if ".experts.w" in name:
        return Split("expert", 0)
    if parts[-1] in ("A_log", "dt_bias"):
        return Split("column", 0)
    if owner in _ROW:
        return Split("row", 1)
    if owner in _COLUMN:
        return Split("column", 0)
    return Split("replicated", None)


@dataclass(frozen=True)
class ParallelPlan:
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        for f in ("tp", "ep"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ParallelError(f"{f}={v!r}: must be an integer >= 1")
        if self.world > MAX_WORLD:
            raise ParallelError(f"tp*ep={self.world}: at most {MAX_WORLD} ranks")

    @property
    def world(self) -> int:
        return self.tp * self.ep

    @property
    def trivial(self) -> bool:
        return self.world == 1

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_group_ranks(self, rank: int) -> list[int]:
        return [self.ep_rank(rank) * self.tp + t for t in range(self.tp)]

    def ep_group_ranks(self, rank: int) -> list[int]:
        return [e * self.tp + self.tp_rank(rank) for e in range(self.ep)]

    @property
    def tp_group(self) -> Group:
        return Group(TP_GROUP, self.tp)

    @property
    def ep_group(self) -> Group:
        return Group(EP_GROUP, self.ep)

    def check(self, cfg: K3Config) -> None:
        """ParallelError naming the first field the plan cannot divide (before anything is built)."""
        m = cfg.moe
        need = [("kda.num_heads", cfg.kda.num_heads, "tp", self.tp),
                ("mla.num_heads", cfg.mla.num_heads, "tp", self.tp),
                ("vocab_size", cfg.vocab_size, "tp", self.tp),
                ("dense_intermediate_size", cfg.dense_intermediate_size, "tp", self.tp),
                ("moe.num_shared_experts * moe.intermediate_size", m.shared_intermediate_size, "tp", self.tp),
                ("moe.num_experts", m.num_experts, "ep", self.ep)]
        for field_name, value, axis, n in need:
            if value % n:
                raise ParallelError(f"{field_name}={value}: not divisible by {axis}={n}")

    def local_config(self, cfg: K3Config) -> K3Config:
        """The config of one rank's program: heads, vocab and dense FFN width divided by tp. Experts are
        not in it (the router stays full width); model/rank.py builds the local experts."""
        self.check(cfg)
        if self.tp == 1:
            return cfg
        return dataclasses.replace(
            cfg, vocab_size=cfg.vocab_size // self.tp,
            dense_intermediate_size=cfg.dense_intermediate_size // self.tp,
            kda=dataclasses.replace(cfg.kda, num_heads=cfg.kda.num_heads // self.tp),
            mla=dataclasses.replace(cfg.mla, num_heads=cfg.mla.num_heads // self.tp))

    def local_experts(self, cfg: K3Config) -> int:
        return cfg.moe.num_experts // self.ep

    def expert_range(self, cfg: K3Config, rank: int) -> range:
        n = self.local_experts(cfg)
        return range(self.ep_rank(rank) * n, (self.ep_rank(rank) + 1) * n)

    def index(self, name: str, shape: tuple[int, ...], rank: int) -> tuple[slice, ...]:
        """The slice of the full tensor `name` (of `shape`) that `rank` holds, as indices on that tensor."""
        s = split_of(name)
        if s.kind == "replicated":
            return tuple(slice(None) for _ in shape)
        n, i = (self.ep, self.ep_rank(rank)) if s.kind == "expert" else (self.tp, self.tp_rank(rank))
        size = shape[s.dim]
        if size % n:
            raise ParallelError(f"{name}: dim {s.dim} of size {size} not divisible by {n} ({s.kind} split)")
        step = size // n
        return tuple(slice(i * step, (i + 1) * step) if d == s.dim else slice(None) for d in range(len(shape)))

    def shard(self, name: str, t: Tensor, rank: int) -> Tensor:
        return t[self.index(name, tuple(t.shape), rank)]

    def table(self, cfg: K3Config) -> dict[str, Split]:
        """Every parameter and buffer of the single-GPU model and how it is split (a meta model: no memory)."""
        from .init import build_model

        model = build_model(cfg, device="meta", seed=None)
        return {n: split_of(n) for n, _ in list(model.named_parameters()) + list(model.named_buffers())}

    def to_dict(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "world": self.world, "rank_order": "rank = ep_rank * tp + tp_rank"}


def merge_states(full_cfg: K3Config, plan: ParallelPlan, per_tp_rank: list[list[Tensor]]) -> list[Tensor]:
    """The single-GPU flat state from the states of one TP group (index = tp_rank), for parity checks."""
    from .state import state_specs

    out: list[Tensor] = []
    for i, s in enumerate(state_specs(full_cfg)):
        parts = [states[i] for states in per_tp_rank]
        if s.kind == "latent" or plan.tp == 1:
            out.append(parts[0])
        elif s.kind == "recurrent":
            out.append(torch.cat(parts, dim=1))
        else:  # conv [B, 3 * P/tp, W-1] = q|k|v of this rank's heads
            B, _, w = parts[0].shape
            out.append(torch.cat([p.reshape(B, 3, -1, w) for p in parts], dim=2).reshape(B, -1, w))
    return out


def split_states(full_cfg: K3Config, plan: ParallelPlan, full: list[Tensor], tp_rank: int) -> list[Tensor]:
    """The inverse of `merge_states`: the flat state of the rank with `tp_rank`, cut from a whole one."""
    from .state import state_specs

    out: list[Tensor] = []
    for t, s in zip(full, state_specs(full_cfg)):
        if s.kind == "latent" or plan.tp == 1:
            out.append(t)
            continue
        n = t.shape[1] // (3 * plan.tp) if s.kind == "conv" else t.shape[1] // plan.tp
        if s.kind == "recurrent":
            out.append(t.narrow(1, tp_rank * n, n).contiguous())
        else:
            B, _, w = t.shape
            out.append(t.reshape(B, 3, -1, w).narrow(2, tp_rank * n, n).reshape(B, 3 * n, w).contiguous())
    return out
