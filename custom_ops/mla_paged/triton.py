"""Absorbed MLA attention over a paged latent pool: Triton kernels, their launch plan and launcher. Never imports
`reference.py`.

Same contract as `reference.mla_paged` (op.py): q_latent [N, H, C], q_rope [N, H, R], latent [N, C+R],
latent_pool [NB, BS, C+R], block_table [B, MB] int32, past_lens [B] int32, cu_seqlens [B+1] int32
-> o [N, H, C] in q_latent's dtype.

Keys (MLA's keys are the latent itself, one per position for all heads) are read in tiles of BK positions:
position p < past_lens[b] is row p % BS of pool block block_table[b, p // BS]; later positions are this
step's latent rows of b. Online softmax in fp32 (exp2, scale·log2 e folded into the scores), an [M, C] fp32
accumulator, o = acc / l. Work is proportional to each sequence's real length, never to the pool.
Variants (`plan`):
- `rows` (any step; taken when some sequence brings several rows): one program per (sequence b, block of BMR
  query rows of b, block of BH heads); its M = BMR·BH query rows share every key tile (BMR·BH = 64, 32 when
  C > 256). Grid (B, cdiv(N, BMR), cdiv(H, BH)) (grids are + * // of the dims, so not the tighter
  N - B + 1); programs past their sequence's rows return after two loads. A program stops at its last row's
  position.
- `decode` (N == B: one row per sequence): split over keys so a lone long sequence still fills the GPU —
  `_mla_paged_split_kernel` per (b, split of KEYS_PER_SPLIT keys, BH heads) writes its partial (max, sum,
  unnormalised [BH, C]) to the workspace, an empty split (-inf, 0, 0); `_mla_paged_combine_kernel` per (b, BH
  heads) merges them with weights 2^(m_s - max m). NSPLIT = cdiv(MB·BS, KEYS_PER_SPLIT): the step's longest
  sequence sets it, shorter ones leave their tail splits empty.
fp32 inputs multiply in IEEE fp32 (tl.dot input_precision="ieee", `WIDE`); bf16/fp16 inputs stay in their
dtype and multiply on the tensor cores' 16-bit MMAs with fp32 accumulation (wgmma on sm_90a), the
probabilities rounded to the inputs' dtype for the second product, as flash attention does: half the
registers of widened tiles (a [BK, 512] key tile), and 16-bit MMAs rather than tf32 (bench/kernel_resources.py
shows which).
"""

from __future__ import annotations

import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import Buffer, Launch, Plan, Variant, cdiv, run
from .limits import KERNEL_MAX_LATENT

LOG2E = 1.4426950408889634


@triton.jit
def _load_keys(pool, latent, table_row, p, past, n_keys, start, o_d, D, off, BS: tl.constexpr, L, WIDE: tl.constexpr):
    """Keys [BK, BD] of positions p (zeros at p >= n_keys), fp32 when WIDE else in the pool's dtype: from the pool
    through the block table below `past`, else from this step's latent rows (start + p - past); columns
    off + o_d (< off + D) of the row (one of the two masked loads is zero, so their sum is exact)."""
    in_pool = p < past
    blk = tl.load(table_row + p // BS, mask=in_pool, other=0).to(tl.int64)
    m_d = (o_d < D)[None, :]
    from_pool = tl.load(pool + (blk * BS + p % BS)[:, None] * L + off + o_d[None, :],
                        mask=in_pool[:, None] & m_d, other=0.0)
    row = (start + p - past).to(tl.int64)
    in_step = (p >= past) & (p < n_keys)
    from_step = tl.load(latent + row[:, None] * L + off + o_d[None, :], mask=in_step[:, None] & m_d, other=0.0)
    if WIDE:
        return from_pool.to(tl.float32) + from_step.to(tl.float32)
    return from_pool + from_step.to(from_pool.dtype)


@triton.jit
def _load_q(q_latent, q_rope, q_off, live, C: tl.constexpr, R: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr,
            WIDE: tl.constexpr):
    """The queries of rows q_off ([M] = packed row * H + head): q_latent [M, BC], q_rope [M, BR], fp32 when WIDE."""
    o_c, o_r = tl.arange(0, BC), tl.arange(0, BR)
    ql = tl.load(q_latent + q_off[:, None] * C + o_c[None, :], mask=live[:, None] & (o_c < C)[None, :], other=0.0)
    qr = tl.load(q_rope + q_off[:, None] * R + o_r[None, :], mask=live[:, None] & (o_r < R)[None, :], other=0.0)
    if WIDE:
        return ql.to(tl.float32), qr.to(tl.float32)
    return ql, qr


@triton.jit
def _attend(ql, qr, qpos, m_i, l_i, acc, pool, latent, table_row, past, n_keys, start, k_lo, k_hi,
            QK_SCALE: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr, BC: tl.constexpr,
            BR: tl.constexpr, BK: tl.constexpr, WIDE: tl.constexpr):
    """Online softmax of queries at positions qpos [M] over keys [k_lo, k_hi) (k_lo <= every qpos): the running
    (max, sum, [M, BC] accumulator) updated; scores in log2 units."""
    o_c, o_r = tl.arange(0, BC), tl.arange(0, BR)
    for k0 in range(k_lo, k_hi, BK):
        p = k0 + tl.arange(0, BK)
        kc = _load_keys(pool, latent, table_row, p, past, n_keys, start, o_c, C, 0, BS, C + R, WIDE)  # [BK, BC]
        kr = _load_keys(pool, latent, table_row, p, past, n_keys, start, o_r, R, C, BS, C + R, WIDE)  # [BK, BR]
        if WIDE:
            s = tl.dot(ql, tl.trans(kc), input_precision="ieee")
            s += tl.dot(qr, tl.trans(kr), input_precision="ieee")
        else:
            s = tl.dot(ql, tl.trans(kc))
            s += tl.dot(qr, tl.trans(kr))
        seen = (p[None, :] <= qpos[:, None]) & (p < k_hi)[None, :]
        s = tl.where(seen, s * QK_SCALE, float("-inf"))  # [M, BK]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        if WIDE:
            acc = acc * alpha[:, None] + tl.dot(prob, kc, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(prob.to(kc.dtype), kc)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _mla_paged_kernel(
    q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,  # inputs
    MB,  # block-table row stride
    o,  # [N, H, C]
    QK_SCALE: tl.constexpr,  # scale * log2(e)
    H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
    BMR: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    WIDE: tl.constexpr,
):
    """One program: BMR query rows of sequence b x BH heads, over all the keys they see."""
    b = tl.program_id(0)
    start = tl.load(cu_seqlens + b)
    T = tl.load(cu_seqlens + b + 1) - start
    r0 = tl.program_id(1) * BMR
    if r0 >= T:
        return
    past = tl.load(past_lens + b)
    i = tl.arange(0, BMR * BH)
    row, head = r0 + i // BH, tl.program_id(2) * BH + i % BH  # [M]
    live = (row < T) & (head < H)
    q_off = ((start + row).to(tl.int64) * H + head)
    ql, qr = _load_q(q_latent, q_rope, q_off, live, C, R, BC, BR, WIDE)
    m_i = tl.full([BMR * BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BMR * BH], tl.float32)
    acc = tl.zeros([BMR * BH, BC], tl.float32)
    n_keys = past + tl.minimum(T, r0 + BMR)
    m_i, l_i, acc = _attend(ql, qr, past + row, m_i, l_i, acc, latent_pool, latent, block_table + b.to(tl.int64) * MB,
                            past, n_keys, start, 0, n_keys, QK_SCALE, C, R, BS, BC, BR, BK, WIDE)
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    o_c = tl.arange(0, BC)
    tl.store(o + q_off[:, None] * C + o_c[None, :], out.to(o.dtype.element_ty), mask=live[:, None] & (o_c < C)[None, :])


@triton.jit
def _mla_paged_split_kernel(
    q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,  # inputs
    MB, NSPLIT,  # block-table row stride, key splits per sequence
    part_acc, part_ml,  # workspace: [B, NSPLIT, H, C] unnormalised outputs, [B, NSPLIT, H, 2] (max, sum)
    QK_SCALE: tl.constexpr, H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
    BH: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr, KPS: tl.constexpr,
    WIDE: tl.constexpr,
):
    """Decode (one row per sequence): keys [s * KPS, (s + 1) * KPS) of sequence b for BH heads; an empty split
    leaves (-inf, 0, 0)."""
    b, split = tl.program_id(0), tl.program_id(1)
    start, past = tl.load(cu_seqlens + b), tl.load(past_lens + b)
    head = tl.program_id(2) * BH + tl.arange(0, BH)
    live = head < H
    ql, qr = _load_q(q_latent, q_rope, start.to(tl.int64) * H + head, live, C, R, BC, BR, WIDE)
    m_i = tl.full([BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    k_lo = split * KPS
    k_hi = tl.minimum(k_lo + KPS, past + 1)
    m_i, l_i, acc = _attend(ql, qr, past + head * 0, m_i, l_i, acc, latent_pool, latent,
                            block_table + b.to(tl.int64) * MB, past, past + 1, start, k_lo, k_hi,
                            QK_SCALE, C, R, BS, BC, BR, BK, WIDE)
    slot = (b.to(tl.int64) * NSPLIT + split) * H + head  # [BH]
    o_c = tl.arange(0, BC)
    tl.store(part_acc + slot[:, None] * C + o_c[None, :], acc, mask=live[:, None] & (o_c < C)[None, :])
    tl.store(part_ml + slot * 2, m_i, mask=live)
    tl.store(part_ml + slot * 2 + 1, l_i, mask=live)


@triton.jit
def _mla_paged_combine_kernel(
    cu_seqlens, NSPLIT, part_acc, part_ml, o,
    H: tl.constexpr, C: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr,
):
    """o of sequence b's one row, BH heads: the splits' partial softmaxes merged (weights 2^(m_s - max m))."""
    b = tl.program_id(0)
    head = tl.program_id(1) * BH + tl.arange(0, BH)
    live = head < H
    o_c = tl.arange(0, BC)
    base = b.to(tl.int64) * NSPLIT * H + head  # [BH] slot of split 0
    m_max = tl.full([BH], float("-inf"), tl.float32)
    for split in range(0, NSPLIT):
        m_max = tl.maximum(m_max, tl.load(part_ml + (base + split * H) * 2, mask=live, other=0.0))
    l_i = tl.zeros([BH], tl.float32)
    acc = tl.zeros([BH, BC], tl.float32)
    for split in range(0, NSPLIT):
        slot = base + split * H
        w = tl.exp2(tl.load(part_ml + slot * 2, mask=live, other=0.0) - m_max)
        l_i += w * tl.load(part_ml + slot * 2 + 1, mask=live, other=0.0)
        acc += w[:, None] * tl.load(part_acc + slot[:, None] * C + o_c[None, :],
                                    mask=live[:, None] & (o_c < C)[None, :], other=0.0)
    row = tl.load(cu_seqlens + b).to(tl.int64)
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    tl.store(o + (row * H + head)[:, None] * C + o_c[None, :], out.to(o.dtype.element_ty),
             mask=live[:, None] & (o_c < C)[None, :])


def dims(shapes) -> dict:
    """Named dims from the input shapes (q_latent [N, H, C], q_rope [N, H, R], ..., block_table [B, MB], ...)."""
    (N, H, C), R, (NB, BS, L), (B, MB) = shapes[0], shapes[1][2], shapes[3], shapes[4]
    return {"N": N, "H": H, "C": C, "R": R, "NB": NB, "BS": BS, "L": L, "B": B, "MB": MB}


INPUTS = ("q_latent", "q_rope", "latent", "latent_pool", "block_table", "past_lens", "cu_seqlens")
KEYS_PER_SPLIT = 256  # decode: keys per program; a sequence's step runs cdiv(MB * BS, 256) splits


def _blocks(d: dict, M: int) -> dict:
    """Tile sizes for M = query rows x heads per program: latent columns (C, R padded), keys per tile, warps."""
    po2 = triton.next_power_of_2
    BC, BR = max(16, po2(d["C"])), max(16, po2(max(d["R"], 1)))
    return {"BC": BC, "BR": BR, "BK": 16 if BC * M > 16384 else 32, "num_warps": 8 if BC * M >= 16384 else 4}


def _splits(x: dict):
    return cdiv(x["MB"] * x["BS"], KEYS_PER_SPLIT)


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """`decode` when N == B (every sequence one row): the split kernel over key ranges, then the combine;
    else `rows`: one pass per (sequence, query block, head block). `scale` specialised into the code, like
    the static dims; the splits' partials live in the workspace."""
    if d["C"] + d["R"] > KERNEL_MAX_LATENT:
        raise ValueError(f"mla_paged (triton): C + R = {d['C'] + d['R']} > {KERNEL_MAX_LATENT}")
    static = {"QK_SCALE": float(attrs["scale"]) * LOG2E, "H": d["H"], "C": d["C"], "R": d["R"], "BS": d["BS"],
              "WIDE": not dtypes or dtypes[0] == "fp32"}
    heads, m = triton.next_power_of_2(d["H"]), 64 if d["C"] <= 256 else 32  # [M, C] fp32 accumulator: 64 KB at C = 512
    rh, dh = min(heads, 16), max(16, min(heads, m))  # heads per program: rows, decode
    rm = m // rh  # query rows per program
    t = _blocks(d, m)
    rows = Launch(_mla_paged_kernel, INPUTS + ("MB", "o"),
                  static | {"BMR": rm, "BH": rh, "BC": t["BC"], "BR": t["BR"], "BK": t["BK"]},
                  grid=lambda x: (x["B"], cdiv(x["N"], rm), cdiv(x["H"], rh)), scalars=lambda x: {"MB": x["MB"]},
                  num_warps=t["num_warps"])
    t = _blocks(d, dh)
    split = Launch(_mla_paged_split_kernel, INPUTS + ("MB", "NSPLIT", "part_acc", "part_ml"),
                   static | {"BH": dh, "BC": t["BC"], "BR": t["BR"], "BK": t["BK"], "KPS": KEYS_PER_SPLIT},
                   grid=lambda x: (x["B"], _splits(x), cdiv(x["H"], dh)),
                   scalars=lambda x: {"MB": x["MB"], "NSPLIT": _splits(x)}, num_warps=t["num_warps"])
    combine = Launch(_mla_paged_combine_kernel, ("cu_seqlens", "NSPLIT", "part_acc", "part_ml", "o"),
                     {"H": d["H"], "C": d["C"], "BH": dh, "BC": t["BC"]}, grid=lambda x: (x["B"], cdiv(x["H"], dh), 1),
                     scalars=lambda x: {"NSPLIT": _splits(x)}, num_warps=4)
    workspace = (Buffer("part_acc", "fp32", lambda x: x["B"] * _splits(x) * x["H"] * x["C"]),
                 Buffer("part_ml", "fp32", lambda x: x["B"] * _splits(x) * x["H"] * 2))
    return Plan((Variant("decode", (split, combine), when=lambda x: x["N"] == x["B"]), Variant("rows", (rows,))),
                workspace)


def mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
              past_lens: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    N, H, C = q_latent.shape
    L = C + q_rope.shape[2]
    if q_rope.shape[:2] != (N, H) or latent.shape != (N, L) or latent_pool.shape[2] != L:
        raise ValueError(f"mla_paged: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, latent "
                         f"{tuple(latent.shape)}, latent_pool {tuple(latent_pool.shape)} do not agree")
    o = q_latent.new_empty(N, H, C)  # contiguous, whatever q_latent's strides (empty_like keeps them)
    ins = [x.contiguous() for x in (q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens)]
    d = dims([x.shape for x in ins])
    run(plan(d, [dtype_name(q_latent.dtype)], {"scale": scale}), dict(zip(INPUTS, ins)) | {"o": o}, d)
    return o
