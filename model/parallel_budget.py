"""`k3x inspect --tp T --ep E`: what one rank holds and sends, and whether it fits a GPU (meta device only).

- Weights per rank, by the plan's splits (model/parallel.py) and the checkpoint's storage: routed experts
  MXFP4 (0.5 byte per element + one E8M0 byte per 32), gates / router bias fp32, everything else bf16.
  The largest rank is reported (ranks of one plan hold the same sizes).
- State per sequence: the rank's KDA conv + recurrent state (fp32, split with the heads) and its MLA latent
  cache (bf16, kv_lora + rope per token, the same on every TP rank) at `context` tokens.
- Collectives per token per layer, bf16 activations: the payload of each all-reduce (TP: d after every
  mixer, dense FFN and shared experts; EP: the latent L of the routed sum) and the bytes a rank sends in a
  ring all-reduce, 2 (n-1)/n x payload. For comparison, the all-to-all a data-parallel-attention layout
  would need instead: top_k latent vectors out and back, (ep-1)/ep of them off-rank.
- Fit: weights + batch x state against H200 (141 GB), B200 (180 GB), GB300 (288 GB); no allowance for
  activations, workspace or the runtime (state it as headroom).
"""

from __future__ import annotations

import math
from typing import Any

from .config import K3Config
from .init import build_model
from .parallel import ParallelPlan, split_of
from .state import state_bytes

GPUS_GB: dict[str, float] = {"H200": 141.0, "B200": 180.0, "GB300": 288.0}
ACT_BYTES = 2  # bf16 activations on the wire
_FP32 = ("A_log", "dt_bias", "e_score_correction_bias")


def rank_weight_bytes(cfg: K3Config, plan: ParallelPlan) -> dict[str, int]:
    """Bytes of one rank's weights by storage format."""
    out = {"mxfp4_experts": 0, "bf16": 0, "fp32": 0}
    for name, t in build_model(cfg, device="meta", seed=None).state_dict().items():
        s = split_of(name)
        n = t.numel() // (plan.ep if s.kind == "expert" else plan.tp if s.kind != "replicated" else 1)
        if s.kind == "expert":
            out["mxfp4_experts"] += n // 2 + n // 32
        elif name.endswith(_FP32):
            out["fp32"] += 4 * n
        else:
            out["bf16"] += 2 * n
    return out


def _ring(payload: int, n: int) -> int:
    return 0 if n == 1 else math.ceil(2 * (n - 1) / n * payload)


def budget(cfg: K3Config, plan: ParallelPlan, *, batch: int, context: int) -> dict[str, Any]:
    plan.check(cfg)
    local = plan.local_config(cfg)
    w = rank_weight_bytes(cfg, plan)
    sb = state_bytes(local, ACT_BYTES)
    kda, mla_tok = sb["kda_state_bytes_per_sequence"], sb["mla_kv_bytes_per_token"]
    per_seq = kda + mla_tok * context
    d, L, k = cfg.hidden_size, cfg.expert_dim, cfg.moe.top_k
    tp_payload, ep_payload = d * ACT_BYTES, L * ACT_BYTES
    moe_layers, dense_layers = len(cfg.moe_layers), cfg.num_layers - len(cfg.moe_layers)
    comm = {
        "mixer_tp_all_reduce": {"payload": tp_payload, "ring_send": _ring(tp_payload, plan.tp), "layers": cfg.num_layers},
        "dense_ffn_tp_all_reduce": {"payload": tp_payload, "ring_send": _ring(tp_payload, plan.tp), "layers": dense_layers},
        "shared_experts_tp_all_reduce": {"payload": tp_payload, "ring_send": _ring(tp_payload, plan.tp),
                                         "layers": moe_layers if cfg.moe.num_shared_experts else 0},
        "routed_ep_all_reduce": {"payload": ep_payload, "ring_send": _ring(ep_payload, plan.ep), "layers": moe_layers},
        "alternative_ep_all_to_all": {"payload": 2 * k * ep_payload,
                                      "ring_send": math.ceil(2 * k * ep_payload * (plan.ep - 1) / plan.ep),
                                      "layers": moe_layers},
    }
    total = sum(w.values())
    need = total + batch * per_seq
    fit = {g: {"capacity_bytes": int(gb * 1e9), "need_bytes": need, "fits": need <= gb * 1e9,
               "headroom_bytes": int(gb * 1e9 - need)} for g, gb in GPUS_GB.items()}
    return {"name": cfg.name, "tp": plan.tp, "ep": plan.ep, "world": plan.world,
            "experts_per_rank": plan.local_experts(cfg), "heads_per_rank": local.kda.num_heads,
            "weight_bytes_per_rank": {**w, "total": total},
            "kda_state_bytes_per_sequence": kda, "mla_cache_bytes_per_token": mla_tok,
            "mla_cache_bytes_per_sequence": mla_tok * context, "batch": batch, "context": context,
            "collective_bytes_per_token_per_layer": comm, "fit": fit}


def format_budget(b: dict[str, Any]) -> str:
    def gb(x: float) -> str:
        return f"{x / 1e9:,.2f} GB"

    w = b["weight_bytes_per_rank"]
    lines = [f"{b['name']}: tp={b['tp']} ep={b['ep']} ({b['world']} ranks), {b['heads_per_rank']} heads and "
             f"{b['experts_per_rank']} experts per rank",
             f"weights per rank: {gb(w['total'])} (MXFP4 experts {gb(w['mxfp4_experts'])}, bf16 {gb(w['bf16'])}, "
             f"fp32 {gb(w['fp32'])})",
             f"per sequence: KDA state {b['kda_state_bytes_per_sequence'] / 2**20:,.1f} MiB, MLA cache "
             f"{b['mla_cache_bytes_per_token']:,} B/token = {gb(b['mla_cache_bytes_per_sequence'])} at "
             f"{b['context']:,} tokens",
             "collectives per token per layer (bf16): payload / ring bytes sent per rank / layers"]
    for name, c in b["collective_bytes_per_token_per_layer"].items():
        lines.append(f"  {name:<30} {c['payload']:>8,} B {c['ring_send']:>8,} B  x{c['layers']}")
    lines.append(f"fit at batch {b['batch']} x {b['context']:,} tokens (weights + state; no activations/workspace):")
    for g, f in b["fit"].items():
        lines.append(f"  {g:<6} {gb(f['capacity_bytes']):>10}  need {gb(f['need_bytes'])}  "
                     + ("fits" if f["fits"] else "DOES NOT FIT") + f" (headroom {gb(f['headroom_bytes'])})")
    return "\n".join(lines)
