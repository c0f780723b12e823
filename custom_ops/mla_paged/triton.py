"""Absorbed MLA attention over a paged latent pool: Triton kernel, its launch plan and launcher. Never imports
`reference.py`.

Same contract as `reference.mla_paged` (op.py): q_latent [N, H, C], q_rope [N, H, R], latent [N, C+R],
latent_pool [NB, BS, C+R], block_table [B, MB] int32, past_lens [B] int32, cu_seqlens [B+1] int32
-> o [N, H, C] in q_latent's dtype.

One program per (sequence b, block of BMR query rows of b, block of BH heads): its M = BMR * BH query rows
(row-major over (row, head)) share every key — MLA's keys are the latent itself, one per position for all
heads — so a key tile is read once per program and multiplied for all its rows. Keys in blocks of BK
positions: position p < past_lens[b] is row p % BS of pool block block_table[b, p // BS]; later positions are
this step's latent rows of b. Online softmax in fp32 (exp2, scale·log2 e folded into the scores); the
accumulator holds [M, C] fp32; o = acc / l. A program stops at its last query row's position, so the work
is proportional to each sequence's real length, never to the pool or to MB beyond what b uses.
Grid: (B, cdiv(N, BMR), cdiv(H, BH)) (grids are + * // of the dims, so no tighter N - B + 1); programs past
their sequence's rows return after two loads. Variants: `rows` (prefill chunks mixed in: BMR * BH = 64, 32 when C > 256) and
`decode` (N == B: every sequence one row, BMR = 1, 16..64 heads per program, grid (B, 1, cdiv(H, BH))).
Not split over keys: a lone long decode runs cdiv(H, BH) programs (a split-K variant with a combine pass is
the next step for long-context decode on a GPU).
fp32 inputs multiply in IEEE fp32 (tl.dot input_precision="ieee"); bf16/fp16 inputs are widened to fp32 and
multiplied in tf32, exact for their mantissas (the probabilities are rounded to tf32 in the second product).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import Launch, Plan, Variant, cdiv, run
from .op import KERNEL_MAX_LATENT

LOG2E = 1.4426950408889634


@triton.jit
def _load_keys(pool, latent, table_row, p, past, n_keys, start, o_d, D, off, BS: tl.constexpr, L):
    """Keys [BK, BD] fp32 of positions p (zeros at p >= n_keys): from the pool through the block table below
    `past`, else from this step's latent rows (start + p - past); columns off + o_d (< off + D) of the row."""
    in_pool = p < past
    blk = tl.load(table_row + p // BS, mask=in_pool, other=0).to(tl.int64)
    m_d = (o_d < D)[None, :]
    from_pool = tl.load(pool + (blk * BS + p % BS)[:, None] * L + off + o_d[None, :],
                        mask=in_pool[:, None] & m_d, other=0.0)
    row = (start + p - past).to(tl.int64)
    from_step = tl.load(latent + row[:, None] * L + off + o_d[None, :], mask=((p >= past) & (p < n_keys))[:, None] & m_d,
                        other=0.0)
    return from_pool.to(tl.float32) + from_step.to(tl.float32)


@triton.jit
def _mla_paged_kernel(
    q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,  # inputs
    MB,  # block-table row stride
    o,  # [N, H, C]
    QK_SCALE: tl.constexpr,  # scale * log2(e)
    H: tl.constexpr, C: tl.constexpr, R: tl.constexpr, BS: tl.constexpr,
    BMR: tl.constexpr, BH: tl.constexpr, BC: tl.constexpr, BR: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    start = tl.load(cu_seqlens + b)
    T = tl.load(cu_seqlens + b + 1) - start
    r0 = tl.program_id(1) * BMR
    if r0 >= T:
        return
    past = tl.load(past_lens + b)
    L = C + R
    i = tl.arange(0, BMR * BH)
    row, head = r0 + i // BH, tl.program_id(2) * BH + i % BH  # [M]
    live = (row < T) & (head < H)
    q_off = ((start + row).to(tl.int64) * H + head)
    o_c, o_r = tl.arange(0, BC), tl.arange(0, BR)
    ql = tl.load(q_latent + q_off[:, None] * C + o_c[None, :], mask=live[:, None] & (o_c < C)[None, :],
                 other=0.0).to(tl.float32)  # [M, BC]
    qr = tl.load(q_rope + q_off[:, None] * R + o_r[None, :], mask=live[:, None] & (o_r < R)[None, :],
                 other=0.0).to(tl.float32)  # [M, BR]
    m_i = tl.full([BMR * BH], float("-inf"), tl.float32)
    l_i = tl.zeros([BMR * BH], tl.float32)
    acc = tl.zeros([BMR * BH, BC], tl.float32)
    table_row = block_table + b.to(tl.int64) * MB
    qpos = past + row  # [M] each query's own position: it sees keys at <= qpos
    n_keys = past + tl.minimum(T, r0 + BMR)
    for k0 in range(0, n_keys, BK):
        p = k0 + tl.arange(0, BK)
        kc = _load_keys(latent_pool, latent, table_row, p, past, n_keys, start, o_c, C, 0, BS, L)  # [BK, BC]
        kr = _load_keys(latent_pool, latent, table_row, p, past, n_keys, start, o_r, R, C, BS, L)  # [BK, BR]
        s = tl.dot(ql, tl.trans(kc), input_precision=PRECISION)
        s += tl.dot(qr, tl.trans(kr), input_precision=PRECISION)
        s = tl.where(p[None, :] <= qpos[:, None], s * QK_SCALE, float("-inf"))  # [M, BK]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        prob = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(prob, 1)
        acc = acc * alpha[:, None] + tl.dot(prob, kc, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(live, l_i, 1.0)[:, None]
    tl.store(o + q_off[:, None] * C + o_c[None, :], out.to(o.dtype.element_ty), mask=live[:, None] & (o_c < C)[None, :])


def dims(shapes) -> dict:
    """Named dims from the input shapes (q_latent [N, H, C], q_rope [N, H, R], ..., block_table [B, MB], ...)."""
    (N, H, C), R, (NB, BS, L), (B, MB) = shapes[0], shapes[1][2], shapes[3], shapes[4]
    return {"N": N, "H": H, "C": C, "R": R, "NB": NB, "BS": BS, "L": L, "B": B, "MB": MB}


def _launch(d: dict, precision: str, scale: float, BMR: int, BH: int, decode: bool) -> Launch:
    po2 = triton.next_power_of_2
    BC, BR = max(16, po2(d["C"])), max(16, po2(max(d["R"], 1)))
    BK = 16 if BC * BMR * BH > 16384 else 32
    return Launch(
        _mla_paged_kernel,
        ("q_latent", "q_rope", "latent", "latent_pool", "block_table", "past_lens", "cu_seqlens", "MB", "o"),
        {"QK_SCALE": scale * LOG2E, "H": d["H"], "C": d["C"], "R": d["R"], "BS": d["BS"], "BMR": BMR, "BH": BH, "BC": BC, "BR": BR, "BK": BK,
         "PRECISION": precision},
        grid=lambda x: (x["B"], 1 if decode else cdiv(x["N"], BMR), cdiv(x["H"], BH)),
        scalars=lambda x: {"MB": x["MB"]},
        num_warps=8 if BC * BMR * BH >= 16384 else 4, num_stages=1)


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """Two variants of the one kernel: `decode` when N == B (every sequence one row), else `rows` (any step);
    `scale` specialised into the code, like the static dims."""
    if d["C"] + d["R"] > KERNEL_MAX_LATENT:
        raise ValueError(f"mla_paged (triton): C + R = {d['C'] + d['R']} > {KERNEL_MAX_LATENT}")
    precision = "ieee" if not dtypes or dtypes[0] == "fp32" else "tf32"
    scale, heads = float(attrs["scale"]), triton.next_power_of_2(d["H"])
    decode = _launch(d, precision, scale, 1, max(16, min(heads, 64)), True)
    bh, m = min(heads, 16), 64 if d["C"] <= 256 else 32  # [M, C] fp32 accumulator: 64 KB at K3's C = 512
    rows = _launch(d, precision, scale, m // bh, bh, False)
    return Plan((Variant("decode", (decode,), when=lambda x: x["N"] == x["B"]), Variant("rows", (rows,))))


def mla_paged(q_latent: Tensor, q_rope: Tensor, latent: Tensor, latent_pool: Tensor, block_table: Tensor,
              past_lens: Tensor, cu_seqlens: Tensor, *, scale: float) -> Tensor:
    N, H, C = q_latent.shape
    if q_rope.shape[:2] != (N, H) or latent.shape != (N, C + q_rope.shape[2]) or latent_pool.shape[2] != latent.shape[1]:
        raise ValueError(f"mla_paged: q_latent {tuple(q_latent.shape)}, q_rope {tuple(q_rope.shape)}, latent "
                         f"{tuple(latent.shape)}, latent_pool {tuple(latent_pool.shape)} do not agree")
    o = q_latent.new_empty(N, H, C)  # contiguous, whatever q_latent's strides (empty_like keeps them)
    ins = [x.contiguous() for x in (q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens)]
    names = ("q_latent", "q_rope", "latent", "latent_pool", "block_table", "past_lens", "cu_seqlens")
    d = dims([x.shape for x in ins])
    run(plan(d, [dtype_name(q_latent.dtype)], {"scale": scale}), dict(zip(names, ins)) | {"o": o}, d)
    return o
