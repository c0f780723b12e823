"""`k3x inspect`: layer plan, parameter counts (total / active), cache sizes and bytes by storage format.

Built on the meta device, so the full 2.78T `k3` is summarised in about a second with no weights.
Active parameters = everything except the routed experts a token does not visit
(per MoE layer, (E - top_k) experts); the input embedding is reported both ways (docs/model.md §7).
Byte figures are printed in the decimal unit that fits them (`scaled_bytes`: B, KB, MB, GB, TB), so a 6-layer
test model and the 2.78T model both read as numbers, never `0.00 GB`.
"""

from __future__ import annotations

from typing import Any

from .config import K3Config
from .init import build_model
from .options import BuildOptions
from .state import state_bytes


def param_counts(cfg: K3Config) -> tuple[dict[str, Any], int, int]:
    """(the meta model's tensors by name, total parameters, active parameters) of the dense-expert model."""
    model = build_model(cfg, device="meta", seed=None)  # dense experts
    tensors = dict(model.named_parameters()) | dict(model.named_buffers())
    total = sum(t.numel() for t in tensors.values())
    per_expert = sum(t.numel() for n, t in tensors.items() if ".experts.w" in n) // max(
        1, len(cfg.moe_layers) * cfg.moe.num_experts)
    return tensors, total, total - len(cfg.moe_layers) * (cfg.moe.num_experts - cfg.moe.top_k) * per_expert


def summarize(cfg: K3Config) -> dict[str, Any]:
    """Counts are of weights (an MXFP4 config is counted as its dense twin); `storage` is the checkpoint's bytes."""
    tensors, total, active = param_counts(cfg)
    expert = {n: t.numel() for n, t in tensors.items() if ".experts.w" in n}
    per_expert = sum(expert.values()) // max(1, len(cfg.moe_layers) * cfg.moe.num_experts)
    inactive = total - active
    embed = tensors["model.embed_tokens.weight"].numel()
    fp32 = sum(t.numel() for n, t in tensors.items() if n.endswith(("A_log", "dt_bias", "e_score_correction_bias")))
    n_expert = sum(expert.values())
    storage = {  # bytes as the real checkpoint stores them
        "mxfp4_experts": n_expert // 2 + n_expert // 32,
        "bf16": 2 * (total - n_expert - fp32),
        "fp32": 4 * fp32,
    }
    artifact = {fmt: weight_bytes(cfg, build=BuildOptions(expert_format=fmt)) for fmt in ("mxfp4", "dense")}
    starts = set(cfg.block_starts())
    plan = [{"layer": i, "mixer": cfg.layer_types[i], "ffn": cfg.mlp_types[i], "attn_res_block_start": i in starts}
            for i in range(cfg.num_layers)]
    return {
        "name": cfg.name,
        "config_hash": cfg.hash(),
        "num_layers": cfg.num_layers,
        "kda_layers": len(cfg.kda_layers),
        "mla_layers": len(cfg.mla_layers),
        "moe_layers": len(cfg.moe_layers),
        "dense_layers": cfg.num_layers - len(cfg.moe_layers),
        "attn_res_blocks": len(starts),
        "total_params": total,
        "active_params": total - inactive,
        "active_params_excluding_embedding": total - inactive - embed,
        "params_per_routed_expert": per_expert,
        **state_bytes(cfg),
        "bytes_by_storage_format": storage,
        "checkpoint_bytes": sum(storage.values()),
        "artifact_weight_bytes": artifact,
        "layers": plan,
    }


def weight_bytes(cfg: K3Config, dtype=None, build: BuildOptions | None = None) -> int:
    """Bytes of the model's tensors as held (MXFP4 experts packed, gates and norms fp32, the rest `dtype`,
    bf16 by default) = what each artifact (model.pt2, model.onnx, model.trt.onnx, model.engine) stores."""
    import torch

    model = build_model(cfg, build, device="meta", dtype=dtype or torch.bfloat16, seed=None)
    return sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))


BYTE_UNITS = ("B", "KB", "MB", "GB", "TB")


def scaled_bytes(n: float) -> str:
    """`n` bytes in the largest decimal unit that keeps the figure >= 1 (`512 B`, `33.86 KB`, `1.40 TB`)."""
    if abs(n) < 1000:
        return f"{int(n):,} B"
    i = 0
    while abs(n) >= 1000 and i < len(BYTE_UNITS) - 1:
        n, i = n / 1000, i + 1
    return f"{n:,.2f} {BYTE_UNITS[i]}"


def format_summary(s: dict[str, Any]) -> str:
    def b(x: int) -> str:
        return f"{x / 1e9:,.1f}B" if x >= 1e8 else f"{x / 1e6:,.2f}M"

    plan = " ".join(("|" if p["attn_res_block_start"] else "") + ("K" if p["mixer"] == "kda" else "M")
                    + ("e" if p["ffn"] == "moe" else "d") for p in s["layers"])
    st = s["bytes_by_storage_format"]
    return "\n".join([
        f"{s['name']}  (config {s['config_hash']})",
        f"layers            {s['num_layers']}: {s['kda_layers']} KDA + {s['mla_layers']} MLA; "
        f"{s['moe_layers']} MoE + {s['dense_layers']} dense; {s['attn_res_blocks']} AttnRes blocks",
        f"plan              {plan}",
        "                  (K=KDA M=MLA, e=MoE d=dense, | = AttnRes block start)",
        f"params total      {b(s['total_params'])} ({s['total_params']:,})",
        f"params active     {b(s['active_params'])} incl. input embedding, "
        f"{b(s['active_params_excluding_embedding'])} excl.",
        f"MLA KV cache      {s['mla_kv_bytes_per_token']:,} bytes/token (bf16)",
        f"KDA state         {s['kda_state_bytes_per_sequence']:,} bytes/sequence (fp32, any length)",
        f"storage           MXFP4 experts {scaled_bytes(st['mxfp4_experts'])}, bf16 {scaled_bytes(st['bf16'])}, "
        f"fp32 {scaled_bytes(st['fp32'])}",
        f"artifact weights  {scaled_bytes(s['artifact_weight_bytes']['mxfp4'])} each (pt2, model.onnx, model.trt.onnx, "
        f"engine; bf16, MXFP4 experts packed); {scaled_bytes(s['artifact_weight_bytes']['dense'])} with dense experts",
    ])


def format_pools(b: dict, plan=None, dtype: str | None = None) -> str:
    """`k3x inspect --context N --sequences S`: model/state.py `pool_bytes` as lines. With a plan of more than
    one rank (`--tp/--ep`), `b` is one rank's (its local config): the figures are per rank."""
    per, head = "", ""
    if plan is not None and plan.world > 1:
        per = " per rank"
        head = (f" on each of {plan.world} ranks (tp={plan.tp}, ep={plan.ep}: KDA heads split over tp, the MLA "
                "latent replicated on every rank, experts hold no state)")
    return (f"serving pools for {b['sequences']} sequence(s) x {b['context']:,} positions (block size "
            f"{b['block_size']}{', latents ' + dtype if dtype else ''}){head}:\n"
            f"  KDA state:  {b['kda_bytes_per_sequence']:,} B per sequence{per} -> {scaled_bytes(b['kda_bytes'])}\n"
            f"  MLA latent: {b['mla_bytes_per_token']:,} B per token{per}, {b['blocks']:,} blocks -> "
            f"{scaled_bytes(b['mla_bytes'])}\n"
            f"  total{per}: {scaled_bytes(b['total_bytes'])}")


def format_working(w: dict, pools: dict) -> str:
    """`k3x inspect ... --chunk T`: model/working.py `step_working_bytes` and the peak it implies over `pools`."""
    return (f"  step working memory ({w['rows']:,} tokens, MLA key blocks of {w['key_block']:,}): "
            f"{scaled_bytes(w['total_bytes'])} (attention {scaled_bytes(w['attention_bytes'])} of it)\n"
            f"  peak (pools + step): {scaled_bytes(pools['total_bytes'] + w['total_bytes'])}")


def pools_report(cfg: K3Config, context: int, sequences: int, *, block_size: int = 16, tp: int = 1, ep: int = 1,
                 dtype: str = "bf16", chunk: int | None = None) -> str:
    """`k3x inspect --context N --sequences S [--tp T --ep E] [--dtype] [--chunk T]`: pool memory of a serving
    deployment (latents in the model dtype, `dtype`: bf16 | fp32; KDA states are fp32 either way), per rank
    under a plan (its local config: its KDA heads; the latent whole); with `chunk`, the working memory of a
    step of that many tokens (model/working.py) and the peak pools + step."""
    import torch

    from .parallel import ParallelPlan
    from .state import pool_bytes
    from .working import step_working_bytes

    plan = ParallelPlan(tp, ep)
    torch_dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    local = plan.local_config(cfg)
    pools = pool_bytes(local, context, sequences, block_size, dtype=torch_dtype)
    lines = [format_pools(pools, plan, dtype)]
    if chunk is not None:
        lines.append(format_working(step_working_bytes(local, chunk, block_size, torch_dtype), pools))
    return "\n".join(lines)
