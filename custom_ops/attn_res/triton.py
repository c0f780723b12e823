"""Block Attention Residuals mixer, Triton kernel, its launch plan and launcher. Never imports `reference.py`.

Same contract as `reference.attn_res` (docs/model.md §4.2):
    prefix [..., d], bank [..., N, d] (N >= 1, N + 1 <= 16 sources), norm_weight [d], proj_weight [d]
    -> [..., d] in prefix's dtype.

One program per token row, two passes over its N + 1 sources (bank rows, then prefix), all fp32, each pass
double-buffered (the next [NS, BD] tile is requested before the current one is used):
  1. per d-block: accumulate Σ v² and Σ v·(norm_weight ⊙ proj_weight) for every source at once
     ([NS, BD] tile, NS = next power of two of N + 1); score_i = rsqrt(mean(v_i²) + eps) · Σ v_i·w,
     which equals RMSNorm(v_i) · w without materialising the normalised keys; softmax over sources.
  2. per d-block, last block first: out = Σ_i p_i v_i (the raw sources), stored in prefix's dtype.
The second pass re-reads the row's (N + 1)·d elements (9 × 7168 bf16 = 129 KB at K3 sizes, too large to keep
on chip per row); walking it backwards starts with the blocks pass 1 read last, the likeliest still in L2.
Memory traffic floor: (N + 1)·d reads + d writes per token. About 4.9 MB of loads in flight on an H200
(4 CTAs per SM x 2 tiles x 4.6 KB; 3 MB before double-buffering).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.launch import Launch, Plan, Variant, run
from .limits import KERNEL_MAX_BANK


@triton.jit
def _load_sources(bank, prefix, o_s, o_d, N, d):
    """[NS, BD] fp32 tile: rows 0..N-1 from this token's bank, row N from prefix, the rest zeros (and zeros for
    columns outside [0, d): the prefetch past either end of the row reads nothing)."""
    m_d = (o_d >= 0) & (o_d < d)
    from_bank = (o_s < N)[:, None] & m_d[None, :]
    x = tl.load(bank + o_s[:, None] * d + o_d[None, :], mask=from_bank, other=0.0).to(tl.float32)
    from_prefix = (o_s == N)[:, None] & m_d[None, :]
    p = tl.load(prefix + o_d[None, :] + o_s[:, None] * 0, mask=from_prefix, other=0.0).to(tl.float32)
    return x + p


@triton.jit
def _attn_res_kernel(
    prefix, bank, norm_weight, proj_weight,  # [R, d], [R, N, d], [d], [d]
    out,  # [R, d]
    N, d,
    eps,
    NS: tl.constexpr, BD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    prefix += row * d
    bank += row * N * d
    out += row * d
    o_s = tl.arange(0, NS)
    NB = tl.cdiv(d, BD)
    ssq = tl.zeros([NS], dtype=tl.float32)
    dot = tl.zeros([NS], dtype=tl.float32)
    # pass 1, loads double-buffered: the tile of block i + 1 is requested before block i is reduced
    x = _load_sources(bank, prefix, o_s, tl.arange(0, BD), N, d)  # [NS, BD]
    for i in range(0, NB):
        o_d = i * BD + tl.arange(0, BD)
        x_next = _load_sources(bank, prefix, o_s, o_d + BD, N, d)  # past the row: masked, no traffic
        m_d = o_d < d
        qw = (tl.load(norm_weight + o_d, mask=m_d, other=0.0).to(tl.float32)
              * tl.load(proj_weight + o_d, mask=m_d, other=0.0).to(tl.float32))  # effective query [BD]
        ssq += tl.sum(x * x, 1)
        dot += tl.sum(x * qw[None, :], 1)
        x = x_next
    score = dot * tl.rsqrt(ssq / d + eps)  # [NS]
    score = tl.where(o_s <= N, score, float("-inf"))
    p = tl.exp(score - tl.max(score, 0))
    p = p / tl.sum(p, 0)
    # pass 2 walks the row backwards: the blocks read last in pass 1 are the likeliest still in L2
    x = _load_sources(bank, prefix, o_s, (NB - 1) * BD + tl.arange(0, BD), N, d)
    for j in range(0, NB):
        o_d = (NB - 1 - j) * BD + tl.arange(0, BD)
        x_next = _load_sources(bank, prefix, o_s, o_d - BD, N, d)  # before the row (j = NB - 1): masked
        tl.store(out + o_d, tl.sum(x * p[:, None], 0).to(out.dtype.element_ty), mask=o_d < d)
        x = x_next


def attn_res_launch_config(rows: int, n_bank: int, d: int, entry: tuple[int, int] | None = None) -> dict:
    """One program per row; the [NS, BD] tile holds ~4096 fp32 values, two tiles in flight (double-buffered by
    hand: Triton's pipeliner does not take these masked gather loads, so `num_stages` stays 1). `entry`:
    (tile values NS·BD, warps) named instead (a candidate the dispatcher picks by measurement, candidates.py)."""
    NS = triton.next_power_of_2(n_bank + 1)
    values, warps = (4096, None) if entry is None else entry
    BD = max(16, min(triton.next_power_of_2(d), values // NS))
    return {"NS": NS, "BD": BD, "num_warps": warps or (4 if NS * BD <= 2048 else 8), "num_stages": 1}


ENTRIES = tuple((values, warps) for values in (1024, 2048, 4096, 8192) for warps in (2, 4, 8))  # launch candidates


def dims(shapes) -> dict:
    """Named dims from the input shapes (prefix [..., d], bank [..., N, d], ...): R rows of d, N bank entries."""
    prefix, bank = list(shapes[0]), list(shapes[1])
    R = 1
    for x in prefix[:-1]:
        R = x * R
    return {"R": R, "N": bank[-2], "d": prefix[-1]}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """One launch, one program per row, with N, d and eps specialised into the code: its runtime arguments
    (prefix, bank, norm_weight, proj_weight, out) are already TensorRT QDP order."""
    c = attn_res_launch_config(max(int(d["R"]), 1), d["N"], d["d"], attrs.get("entry"))
    launch = Launch(_attn_res_kernel, ("prefix", "bank", "norm_weight", "proj_weight", "out"),
                    {"N": d["N"], "d": d["d"], "eps": float(attrs["eps"]), "NS": c["NS"], "BD": c["BD"]},
                    grid=lambda x: (x["R"], 1, 1), num_warps=c["num_warps"], num_stages=c["num_stages"])
    return Plan((Variant("rows", (launch,)),))


def attn_res(prefix: Tensor, bank: Tensor, norm_weight: Tensor, proj_weight: Tensor, eps: float,
             entry: tuple[int, int] | None = None) -> Tensor:
    if bank.shape[:-2] != prefix.shape[:-1] or bank.shape[-1] != prefix.shape[-1]:
        raise ValueError(f"attn_res: bank {tuple(bank.shape)} does not match prefix {tuple(prefix.shape)}")
    d, N = prefix.shape[-1], bank.shape[-2]
    if not 1 <= N <= KERNEL_MAX_BANK:
        raise ValueError(f"attn_res (triton): needs 1 <= N <= {KERNEL_MAX_BANK} bank entries, got N={N}")
    if norm_weight.numel() != d or proj_weight.numel() != d:
        raise ValueError(f"attn_res: norm_weight {tuple(norm_weight.shape)} / proj_weight "
                         f"{tuple(proj_weight.shape)} must have {d} elements")
    prefix_2d = prefix.reshape(-1, d).contiguous()  # [R, d]
    bank_3d = bank.reshape(-1, N, d).contiguous()  # [R, N, d]
    out = torch.empty_like(prefix_2d)
    d_ = dims([prefix_2d.shape, bank_3d.shape])
    run(plan(d_, [], {"eps": eps, "entry": entry}),
        {"prefix": prefix_2d, "bank": bank_3d, "norm_weight": norm_weight.contiguous(),
         "proj_weight": proj_weight.reshape(-1).contiguous(), "out": out}, d_)
    return out.reshape(prefix.shape)
