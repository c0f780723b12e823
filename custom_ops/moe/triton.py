"""Routed (latent) MoE, Triton kernels and launchers. Never imports `reference.py`.

Axes: N tokens, d router width, L expert width, E experts, I expert intermediate, k = top_k,
NK = N·k (token, slot) pairs, P = padded pair rows, BM = rows per GEMM block.
Same contract as `reference.route` / `reference.moe` (docs/model.md §5.1–5.2).

Pipeline of `moe`:
  1. `route`: `_router_kernel` (scores s = sigmoid(x W_rᵀ), fp32 accumulation; 16-bit operands go to
     tensor cores unchanged, which is exact-product fp32 math) and `_topk_kernel` (per token: k rounds
     of argmax over s + bias, weights from the unbiased s, optional renormalisation, × factor).
  2. `moe_align`, three kernels, no atomics: `_moe_align_count_kernel` (per chunk of ALIGN_BLOCK pairs, a
     count per expert), `_moe_align_scan_kernel` (one program: each expert's segment padded to a multiple
     of BM and placed by an exclusive scan over experts, the idea of vLLM's `moe_align_block_size`; each
     chunk's first row per expert; the expert of every BM-row block), `_moe_align_scatter_kernel` (each
     pair to its row: chunk offset + rank among the chunk's earlier pairs of that expert).  The result is
     the stable sort of the NK pairs by expert — deterministic: `sorted_pair [P]` (pair id, or NK for
     padding) and `block_expert [P/BM]` (expert id, or -1 for unused tail blocks, which exit at once).
     P = `padded_rows(NK, E, BM)` is the worst case NK + min(E, NK)·(BM − 1), so grids depend on shapes
     only (CUDA graphs, TensorRT AOT plugins).
  3. `_moe_gemm1_kernel`: grouped GEMM over tiles (row block × column block), A rows gathered from z by token
     id; gate (w1) and up (w3) rows of the same expert interleaved into one [2·BN, BK] operand (w3's rows
     addressed from w1's base, `offset_to`), so each k step is one wide dot; SiTU-GLU or SiLU-GLU on each
     (gate, up) column pair in the fp32 epilogue; h [P, I] in z's dtype.
  4. `_moe_gemm2_kernel`: h @ w2ᵀ per tile, epilogue × routing weight (fp32), rows scattered to y [NK, L] in
     z's dtype by pair id (un-permute).
  5. `_moe_sum_kernel`: u[n] = Σ_j y[n·k + j] in fp32, in slot order j = 0..k−1, cast to z's dtype once.
Both GEMMs: persistent (min(tiles, 132 × CTAs per SM) programs, CTAs per SM from the compiled sm_90a resources
in `GEMM_RESOURCES_SM90`, each program walking tiles t = pid, pid + grid, ... in GROUP_M swizzle order; tiles of
unused tail blocks are skipped), and swap-AB below `SWAP_BELOW` rows per block (decode: the tile is R weight
rows × BM tokens, so the weight rows fill the MMA's 64-wide M side and 16 tokens its N side; wgmma on sm_90a
instead of 16-row mma.sync). GEMM2's weight tiles come through a TMA descriptor built on the device (sm_90+,
rows of w2 16-byte multiples; 128 B of global scratch per program, which the AOT plugin carves out of its
workspace: plugins/adapter.run_plan); everything else is pointer loads pipelined by Triton (cp.async): the
activation rows are gathered by token (no TMA gather before sm_100) and GEMM1's interleaved gate/up operand is
two tensors' rows, not one TMA box.
Precision of the down projection: each routed expert's weighted row is rounded once to z's dtype in y (bf16:
relative 2^-9 per term) before the fp32 slot-order sum — y was an fp32 [NK, L] buffer (1.9 GB at K3's prefill
of 8192 tokens), now half that in bf16, and bit-identical to before in fp32.
Deterministic: no atomics anywhere; every y row is written by exactly one program and summed in fixed order.
Experts with no tokens get no blocks; one expert with every token gets NK/BM blocks.  Matmuls take
16-bit operands as they are and fp32 operands with input_precision="ieee".  Launch parameters are pure
functions of the shapes (`moe_launch_config`, `gemm_config`); no autotune, no block pointers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import ITEMSIZE, dtype_name
from ...plan.launch import SM90_SMS, Buffer, Launch, Plan, PlanError, Variant, cdiv, ctas_per_sm, run

ACTIVATIONS = {"silu": 0, "situ": 1}
ALIGN_BLOCK = 256  # pairs per program of the align count / scatter kernels


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _glu(acc1, acc3, beta1, beta2, ACT: tl.constexpr):
    """The gate+up epilogue of both grouped GEMM1s (dense and MXFP4), fp32: SiTU-GLU (ACT 1)
    [β1 tanh(a/β1) σ(a)] ⊙ [β2 tanh(b/β2)], or SiLU-GLU (ACT 0) a σ(a) ⊙ b."""
    if ACT == 1:
        out = beta1 * _tanh(acc1 / beta1) * tl.sigmoid(acc1) * (beta2 * _tanh(acc3 / beta2))
    else:
        out = acc1 * tl.sigmoid(acc1) * acc3
    return out


@triton.jit
def _router_kernel(
    x, wg, s,  # [N, D], [E, D], scores out [N, E] fp32
    N, E, D,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    o_m = pid_m * BM + tl.arange(0, BM)
    o_n = pid_n * BN + tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    m_m, m_n = o_m < N, o_n < E
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, D, BK):
        m_k = (k0 + o_k) < D
        a = tl.load(x + o_m[:, None].to(tl.int64) * D + k0 + o_k[None, :], mask=m_m[:, None] & m_k[None, :],
                    other=0.0)
        b = tl.load(wg + o_n[None, :].to(tl.int64) * D + k0 + o_k[:, None], mask=m_k[:, None] & m_n[None, :],
                    other=0.0)  # [BK, BN]
        acc = _mma(a, b, acc, IEEE)
    tl.store(s + o_m[:, None].to(tl.int64) * E + o_n[None, :], tl.sigmoid(acc), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def _topk_kernel(
    s, bias,  # [N, E] fp32 scores, [E]
    ids, wts,  # [N, TOPK] int64 (local expert ids, -1 = another rank's expert), [N, TOPK] fp32
    offset,  # [1] int32: global id of the first local expert (expert parallelism; 0 on one GPU)
    E, E_LOCAL,
    factor,
    TOPK: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr, RENORM: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    o_e = tl.arange(0, EP)
    m_e = o_e < E
    b_s = tl.load(s + row * E + o_e, mask=m_e, other=0.0)
    sel = tl.where(m_e, b_s + tl.load(bias + o_e, mask=m_e, other=0.0).to(tl.float32), float("-inf"))
    o_j = tl.arange(0, KP)
    b_id = tl.zeros([KP], dtype=tl.int32)
    b_w = tl.zeros([KP], dtype=tl.float32)
    for j in range(TOPK):  # selection on biased scores, weights from unbiased ones
        idx = tl.argmax(sel, 0)
        hit = o_e == idx
        b_id = tl.where(o_j == j, idx, b_id)
        b_w = tl.where(o_j == j, tl.sum(tl.where(hit, b_s, 0.0), 0), b_w)
        sel = tl.where(hit, float("-inf"), sel)
    if RENORM:
        b_w = b_w / (tl.sum(b_w, 0) + 1e-20)
    m_j = o_j < TOPK
    loc = b_id - tl.load(offset)  # routing and weights over all E experts; ids relative to the local ones
    b_id = tl.where((loc >= 0) & (loc < E_LOCAL), loc, -1)
    tl.store(ids + row * TOPK + o_j, b_id.to(tl.int64), mask=m_j)
    tl.store(wts + row * TOPK + o_j, b_w * factor, mask=m_j)


@triton.jit
def _moe_align_count_kernel(
    ids,  # [NK] int64: expert of each (token, slot) pair
    counts,  # out [NB, E] int32: pairs of chunk b routed to expert e
    NK, E,
    BLOCK: tl.constexpr, BE: tl.constexpr,
):
    b = tl.program_id(0)
    o_p = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(ids + o_p, mask=o_p < NK, other=-1).to(tl.int32)  # -1: past NK, matches no expert
    for e0 in range(0, E, BE):
        o_e = e0 + tl.arange(0, BE)
        hit = (e[:, None] == o_e[None, :]).to(tl.int32)  # [BLOCK, BE]
        tl.store(counts + b * E + o_e, tl.sum(hit, 0), mask=o_e < E)


@triton.jit
def _moe_align_scan_kernel(
    counts,  # [NB, E] int32: chunk counts
    offsets,  # out [NB, E] int32: row of chunk b's first pair of expert e in sorted_pair (not in place: the
              # replicas of a small [EP] vector live in several warps, which would read each other's stores)
    sorted_pair, block_expert,  # out [P] int32 (all NK: padding, until the scatter), [P / BM] int32
    NK, E, NB, P,
    BM: tl.constexpr, EP: tl.constexpr, BB: tl.constexpr, BP: tl.constexpr,
):
    # One program: per-expert totals; segments padded to BM, laid out by an exclusive scan over experts; each
    # chunk's first row per expert (chunks in pair order, so the layout is a stable sort); every block's expert.
    o_e = tl.arange(0, EP)
    m_e = o_e < E
    tot = tl.zeros([EP], dtype=tl.int32)
    for b in range(0, NB):
        tot += tl.load(counts + b * E + o_e, mask=m_e, other=0)
    padded = (tot + BM - 1) // BM * BM  # 0 for empty experts (and e >= E)
    end = tl.cumsum(padded, 0)  # inclusive padded segment ends
    row = end - padded  # segment starts, then advanced chunk by chunk
    for b in range(0, NB):
        tl.store(offsets + b * E + o_e, row, mask=m_e)
        row += tl.load(counts + b * E + o_e, mask=m_e, other=0)
    used = tl.sum(padded, 0)
    for j0 in range(0, P // BM, BB):  # expert of block j = experts whose segment ends at or before j·BM
        o_j = j0 + tl.arange(0, BB)
        first = o_j * BM
        e_j = tl.sum((end[None, :] <= first[:, None]).to(tl.int32), 1)  # [BB]
        tl.store(block_expert + o_j, tl.where(first < used, e_j, -1), mask=first < P)
    pad = tl.zeros([BP], dtype=tl.int32) + NK
    for r0 in range(0, P, BP):
        o_r = r0 + tl.arange(0, BP)
        tl.store(sorted_pair + o_r, pad, mask=o_r < P)


@triton.jit
def _moe_align_scatter_kernel(
    ids, offsets,  # [NK] int64, [NB, E] int32 (chunk b's first row per expert, from the scan)
    sorted_pair,  # out [P] int32: pair id n·k + j at its row
    NK, E,
    BLOCK: tl.constexpr, BJ: tl.constexpr,
):
    b = tl.program_id(0)
    o_i = tl.arange(0, BLOCK)
    o_p = b * BLOCK + o_i
    m_p = o_p < NK
    e = tl.load(ids + o_p, mask=m_p, other=-1).to(tl.int32)
    rank = tl.zeros([BLOCK], dtype=tl.int32)  # earlier pairs of this chunk with the same expert
    for j0 in range(0, BLOCK, BJ):
        o_j = j0 + tl.arange(0, BJ)
        e_j = tl.load(ids + b * BLOCK + o_j, mask=b * BLOCK + o_j < NK, other=-2).to(tl.int32)
        hit = (e_j[None, :] == e[:, None]) & (o_j[None, :] < o_i[:, None])  # [BLOCK, BJ]
        rank += tl.sum(hit.to(tl.int32), 1)
    m_p = m_p & (e >= 0)  # pairs of another rank's experts (-1) get no row
    row = tl.load(offsets + b * E + e, mask=m_p, other=0) + rank
    tl.store(sorted_pair + row, o_p, mask=m_p)


@triton.jit
def tile_coords(t, num_m, num_n, block_expert, GROUP_M: tl.constexpr):
    """Tile t of a grouped GEMM -> (row block, column block, expert or -1). GROUP_M swizzle: GROUP_M
    consecutive row blocks sweep all column blocks together, so each weight tile is read from HBM about once."""
    in_group = GROUP_M * num_n
    first_m = (t // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (t % in_group) % size_m
    return pid_m, (t % in_group) // size_m, tl.load(block_expert + pid_m)


@triton.jit
def tile_pairs(pid_m, sorted_pair, NK, BM: tl.constexpr):
    """Rows of row block pid_m -> (row indices [BM], their (token, slot) pairs, which pairs are real: padding
    rows hold NK)."""
    o_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_pair + o_m)
    return o_m, pair, pair < NK


@triton.jit
def offset_to(p, q):
    """q − p in elements of p's type, declared a multiple of 16 bytes (both are 16-byte aligned: the AOT launcher
    refuses other pointers, `moe` copies misaligned experts). GEMM1's wide operand addresses w3's rows as
    w1 + this: an offset times the row's parity, not a `where` on pointers, which loses the contiguity the
    vectorised, cp.async-pipelined loads need (scalar 2-byte loads and 235 registers at K3 decode otherwise)."""
    ELEM: tl.constexpr = p.dtype.element_ty.primitive_bitwidth // 8
    return tl.multiple_of((q.to(tl.int64) - p.to(tl.int64)) // ELEM, 16 // ELEM)


@triton.jit
def tile_dot(a, b, acc, SWAP: tl.constexpr, IEEE: tl.constexpr):
    """One k step of a grouped GEMM tile: a [BM, BK] activation rows, b [R, BK] weight rows (both k-contiguous,
    as loaded). SWAP: acc [R, BM] += b aᵀ (weight rows on the MMA's wide M side, few tokens on its N side);
    else acc [BM, R] += a bᵀ."""
    if SWAP:
        acc = _mma(b, tl.trans(a), acc, IEEE)
    else:
        acc = _mma(a, tl.trans(b), acc, IEEE)
    return acc


@triton.jit
def tile_acc(R: tl.constexpr, BM: tl.constexpr, SWAP: tl.constexpr):
    if SWAP:
        acc = tl.zeros([R, BM], dtype=tl.float32)
    else:
        acc = tl.zeros([BM, R], dtype=tl.float32)
    return acc


@triton.jit
def tile_out(acc, SWAP: tl.constexpr):
    """The accumulator as [BM, R] whatever the MMA orientation."""
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def store_h(h, acc, o_m, pid_n, I, beta1, beta2, BM: tl.constexpr, BN: tl.constexpr, ACT: tl.constexpr):
    """GEMM1 epilogue: acc [BM, 2·BN] holds gate (even) and up (odd) columns of BN intermediate units; the GLU of
    each pair is stored to h [P, I] in h's dtype."""
    acc1, acc3 = tl.split(tl.reshape(acc, [BM, BN, 2]))
    o_n = pid_n * BN + tl.arange(0, BN)
    out = _glu(acc1, acc3, beta1, beta2, ACT)
    tl.store(h + o_m[:, None].to(tl.int64) * I + o_n[None, :], out.to(h.dtype.element_ty), mask=o_n[None, :] < I)


@triton.jit
def store_y(y, acc, topk_w, pair, valid, pid_n, L, BN: tl.constexpr):
    """GEMM2 epilogue: acc [BM, BN] × routing weight, rows scattered to y [NK, L] (pair order, y's dtype)."""
    o_n = pid_n * BN + tl.arange(0, BN)
    wt = tl.load(topk_w + pair, mask=valid, other=0.0)
    tl.store(y + pair[:, None].to(tl.int64) * L + o_n[None, :], (acc * wt[:, None]).to(y.dtype.element_ty),
             mask=valid[:, None] & (o_n[None, :] < L))


@triton.jit
def _moe_gemm1_kernel(
    z, w1, w3, sorted_pair, block_expert,  # [N, L], [E, I, L] ×2, [P] int32, [P/BM] int32
    h,  # out [P, I]
    NK, I, L, num_m,
    beta1, beta2,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
):
    num_n = tl.cdiv(I, BN)
    o_j = tl.arange(0, 2 * BN)  # wide operand row j: gate (w1, even j) or up (w3, odd j) of unit j // 2
    o_k = tl.arange(0, BK)
    d3 = offset_to(w1, w3)
    for t in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):  # persistent: tiles in a loop
        pid_m, pid_n, e = tile_coords(t, num_m, num_n, block_expert, GROUP_M)
        if e >= 0:
            o_m, pair, valid = tile_pairs(pid_m, sorted_pair, NK, BM)
            a_row = z + (pair // TOPK).to(tl.int64)[:, None] * L  # gathered rows [BM, 1]
            o_n = pid_n * BN + o_j // 2
            m_n = o_n < I
            b_row = w1 + ((e.to(tl.int64) * I + o_n[:, None]) * L + (o_j[:, None] % 2) * d3)  # [2·BN, 1]
            acc = tile_acc(2 * BN, BM, SWAP)
            for k0 in range(0, L, BK):
                m_k = o_k < L - k0
                a = tl.load(a_row + (k0 + o_k)[None, :], mask=valid[:, None] & m_k[None, :], other=0.0)
                b = tl.load(b_row + (k0 + o_k)[None, :], mask=m_n[:, None] & m_k[None, :], other=0.0)  # [2·BN, BK]
                acc = tile_dot(a, b, acc, SWAP, IEEE)
            store_h(h, tile_out(acc, SWAP), o_m, pid_n, I, beta1, beta2, BM, BN, ACT)


@triton.jit
def _moe_gemm2_kernel(
    h, w2, sorted_pair, block_expert, topk_w,  # [P, I], [E, L, I], [P], [P/BM], [NK] fp32
    y,  # out [NK, L] (z's dtype), rows in pair order
    NK, I, L, E, num_m,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
    SWAP: tl.constexpr, TMA: tl.constexpr,
):
    num_n = tl.cdiv(L, BN)
    o_j = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    if TMA:  # w2 as [E·L, I] rows: TMA boxes of [BN, BK] (rows past an expert's L are read but never stored)
        w2_desc = tl.make_tensor_descriptor(w2, shape=[E * L, I], strides=[I, 1], block_shape=[BN, BK])
    for t in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, e = tile_coords(t, num_m, num_n, block_expert, GROUP_M)
        if e >= 0:
            o_m, pair, valid = tile_pairs(pid_m, sorted_pair, NK, BM)
            a_ptr = h + o_m[:, None].to(tl.int64) * I + o_k[None, :]
            o_n = pid_n * BN + o_j
            m_n = o_n < L
            b_ptr = w2 + (e.to(tl.int64) * L + o_n[:, None]) * I + o_k[None, :]  # rows of w2[e] [BN, BK]
            acc = tile_acc(BN, BM, SWAP)
            for k0 in range(0, I, BK):
                m_k = o_k < I - k0
                a = tl.load(a_ptr + k0, mask=valid[:, None] & m_k[None, :], other=0.0)
                if TMA:
                    b = w2_desc.load([e * L + pid_n * BN, k0])
                else:
                    b = tl.load(b_ptr + k0, mask=m_n[:, None] & m_k[None, :], other=0.0)
                acc = tile_dot(a, b, acc, SWAP, IEEE)
            store_y(y, tile_out(acc, SWAP), topk_w, pair, valid, pid_n, L, BN)


@triton.jit
def _moe_sum_kernel(
    y, ids, u,  # [N * TOPK, L] (z's dtype), [N * TOPK] int64 (-1: another rank's expert, its y row unwritten), [N, L]
    L,
    TOPK: tl.constexpr, BL: tl.constexpr,
):
    row, pid_l = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_l = pid_l * BL + tl.arange(0, BL)
    m_l = o_l < L
    acc = tl.zeros([BL], dtype=tl.float32)
    for j in range(TOPK):
        here = tl.load(ids + row * TOPK + j) >= 0
        acc += tl.load(y + (row * TOPK + j) * L + o_l, mask=m_l & here, other=0.0).to(tl.float32)
    tl.store(u + row * L + o_l, acc.to(u.dtype.element_ty), mask=m_l)


# ----------------------------------------------------------------------------------- launch plan and launchers


def block_m(N: int, top_k: int, E: int) -> int:
    """Rows per GEMM block: the average rows per expert, as a power of two in [16, 64], or 128 when large."""
    avg = N * top_k / E
    return 128 if avg >= 512 else max(16, min(64, triton.next_power_of_2(max(1, int(avg)))))


def padded_rows(NK: int, E: int, BM: int) -> int:
    """P: rows of `sorted_pair` / `h` in the worst case (each non-empty expert padded by up to BM − 1)."""
    return (NK + min(E, NK) * (BM - 1) + BM - 1) // BM * BM


SWAP_BELOW = 64  # rows per block below which the grouped GEMMs swap A and B (weight rows on the MMA's M side)

# Compiled resources of the grouped GEMMs on sm_90a at K3's configurations (triton 3.8, bf16 activations, and
# MXFP8 ones into the MXFP4 experts; tests/bench/test_kernel_resources.py recompiles them and holds them to these
# numbers): `resource_key` -> (registers per thread, dynamic shared memory bytes). The persistent grid is
# SM90_SMS × the CTAs per SM these allow; a configuration not listed gets one CTA per SM.
GEMM_RESOURCES_SM90: dict[tuple, tuple[int, int]] = {
    ("_moe_gemm1_kernel", 16, 64, 64, 4, 3): (72, 55296), ("_moe_gemm2_kernel", 16, 128, 64, 4, 3): (47, 55320),
    ("_moe_gemm1_kernel", 64, 128, 64, 8, 3): (128, 122880), ("_moe_gemm2_kernel", 64, 128, 64, 4, 3): (124, 73752),
    ("_moe_mxfp4_gemm1_kernel", 16, 32, 64, 4, 3): (161, 8192),
    ("_moe_mxfp4_gemm2_kernel", 16, 64, 64, 4, 3): (78, 10384),
    ("_moe_mxfp4_gemm1_kernel", 64, 64, 64, 8, 3): (214, 40960),
    ("_moe_mxfp4_gemm2_kernel", 64, 64, 64, 4, 3): (104, 36880),
    # Hopper W4A8 (MXFP8 activations, e4m3 wgmma: the "fp8" entries)
    ("_moe_mxfp4_gemm1_kernel", 16, 32, 32, 4, 3, "fp8"): (128, 4096),
    ("_moe_mxfp4_gemm2_kernel", 16, 64, 32, 4, 3, "fp8"): (68, 4624),
    ("_moe_mxfp4_gemm1_kernel", 64, 64, 32, 8, 3, "fp8"): (226, 14336),
    ("_moe_mxfp4_gemm2_kernel", 64, 64, 32, 8, 3, "fp8"): (128, 14352),
}


def gemm_config(BM: int, L: int, I: int, elem_bytes: int, packed: bool, fp8: bool = False) -> dict:
    """Tiles of the two grouped GEMMs at BM rows per block. Swap-AB below `SWAP_BELOW` rows (decode): the tile
    is R weight rows × BM tokens, GEMM1's R = 2·BN gate and up rows interleaved (one wide dot), 4 warps.
    Otherwise BM × R with GEMM1's R = 2·BN columns; MXFP4 tiles are half as wide (their weights are decoded in
    registers, [BK, R] fp32 values per step). `fp8` (Hopper W4A8, packed): k steps of one 32-wide scale block,
    GEMM2's prefill tile on 8 warps (128 registers, 2 CTAs per SM; 219 on 4 warps)."""
    BK = 64 if elem_bytes <= 2 and not fp8 else 32
    np2 = triton.next_power_of_2
    if BM < SWAP_BELOW:
        rows = 64 if packed else 128
        g1 = {"BN": min(rows // 2, max(16, np2(I))), "num_warps": 4}
        g2 = {"BN": min(rows, max(16, np2(L))), "num_warps": 4}
    else:
        wide = 64 if packed else 128
        g1 = {"BN": min(wide, max(16, np2(I))), "num_warps": 8}
        g2 = {"BN": min(wide, max(16, np2(L))), "num_warps": 8 if BM >= 128 or fp8 else 4}
    common = {"BK": BK, "GROUP_M": 8, "num_stages": 3, "SWAP": BM < SWAP_BELOW}
    return {"gemm1": g1 | common, "gemm2": g2 | common}


def resource_key(kernel: str, constexprs: dict, num_warps: int, num_stages: int) -> tuple:
    """A grouped GEMM launch's key into `GEMM_RESOURCES_SM90`: (kernel, BM, BN, BK, warps, stages), "fp8" last
    for the Hopper W4A8 kernels (constexpr F8)."""
    c = constexprs
    return (kernel, c["BM"], c["BN"], c["BK"], num_warps, num_stages) + (("fp8",) if c.get("F8") else ())


def persistent_ctas(key: tuple, num_warps: int) -> int:
    """Programs of a persistent grouped GEMM: SM90_SMS × its CTAs per SM from `GEMM_RESOURCES_SM90`."""
    res = GEMM_RESOURCES_SM90.get(key)
    return SM90_SMS * (ctas_per_sm(*res, num_warps) if res else 1)


def moe_launch_config(N: int, top_k: int, E: int, L: int, I: int, elem_bytes: int = 2, packed: bool = False) -> dict:
    """Block sizes of every MoE kernel (pure function of the shapes and operand width).

    AOT compilers: give pointers and L/I/E/D `tt.divisibility=16` (as the JIT does); without it the
    GEMM loads are not vectorised or pipelined and the kernels spill."""
    BM = block_m(N, top_k, E)
    BK = 64 if elem_bytes <= 2 else 32
    EP = triton.next_power_of_2(E)
    return {
        "BM": BM,
        "router": {"BM": 32, "BN": 64, "BK": BK, "num_warps": 4, "num_stages": 3},
        "topk": {"KP": triton.next_power_of_2(top_k), "EP": EP, "num_warps": 4 if EP <= 1024 else 8,
                 "num_stages": 1},
        "align": {"BLOCK": ALIGN_BLOCK, "BE": min(64, EP), "BJ": 32, "EP": EP, "BB": max(1, 4096 // EP), "BP": 1024,
                  "num_warps": 4 if EP <= 1024 else 8, "num_stages": 1},
        **gemm_config(BM, L, I, elem_bytes, packed),
        "sum": {"BL": min(1024, triton.next_power_of_2(L)), "num_warps": 4, "num_stages": 1},
    }


def dims(shapes) -> dict:
    """Named dims from the input shapes (x [N, d], z [N, L], gate_weight [EG, d], gate_bias, w1 [E, I, L], ...):
    EG experts are routed over, E are local (EG = E on one GPU)."""
    (N, d), (_, L), (EG, _), (E, I, _) = shapes[0], shapes[1], shapes[2], shapes[4]
    return {"N": N, "d": d, "L": L, "E": E, "I": I, "EG": EG}


def _ieee(*dtypes: str) -> bool:
    """fp32 math on IEEE dots unless every operand has the same 16-bit dtype (then tensor cores)."""
    return not (len(set(dtypes)) == 1 and dtypes[0] in ("fp16", "bf16"))


GEMM_ARGS = {
    "_moe_gemm1_kernel": ("z", "w1", "w3", "sorted_pair", "block_expert", "h", "NK", "I", "L", "num_m"),
    "_moe_gemm2_kernel": ("h", "w2", "sorted_pair", "block_expert", "wts", "y", "NK", "I", "L", "E", "num_m"),
}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The eight launches of k3::moe, block sizes (BM included) chosen at dims `d`; grids and int32 sizes
    follow the runtime N, the weight dims d, L, E, I, EG are static (checked at every launch). Ports: x, z,
    gate_weight, gate_bias, w1, w3, w2, expert_offset -> u. Expert parallelism: the router and top-k run over
    EG experts, the top-k writes local ids (-1 for another rank's expert), which align, the GEMMs and the sum
    skip; EG = E and offset 0 on one GPU. `attrs`: the op's hyper-parameters (top_k, routed_scaling_factor,
    renormalize, activation, situ_beta, situ_linear_beta; the MXFP4 family's `activations`, "mxfp8" quantizing
    both GEMMs' activation tiles), specialised into the code; `sm`: the target (90 if absent; the MXFP4 GEMMs
    use native FP4 MMAs from 100, FP8 MMAs on 90 with "mxfp8"); `block_m` overrides BM, `gemm_programs` the
    persistent GEMMs' grid size (tests). Workspace: s [N, EG] fp32, ids [N·k] int64, wts [N·k]
    fp32, counts/offsets [NB, E] int32, sorted_pair [P] int32, block_expert [P/BM] int32, h [P, I] and
    y [N·k, L] (z's dtype), P = padded_rows(N·k, E, BM)."""
    return build_plan(d, dtypes, attrs, {n: (globals()[n], a) for n, a in GEMM_ARGS.items()}, packed=False)


def build_plan(d: dict, dtypes: list[str], attrs: dict, gemms: dict, *, packed: bool) -> Plan:
    """`plan` with the two grouped GEMMs given as {dense kernel name: (kernel, args)} (the MXFP4 family passes
    its packed ones; `packed` picks their tiles). `dtypes` as the dense op's (experts in w1's dtype)."""
    E, I, L, D, k = d["E"], d["I"], d["L"], d["d"], int(attrs["top_k"])
    EG = d.get("EG", E)  # experts routed over (all of them); E: the local ones (expert parallelism)
    sm = int(attrs.get("sm") or 90)
    BM = int(attrs.get("block_m") or block_m(max(int(d["N"]), 1), k, E))
    a8 = packed and attrs.get("activations", "bf16") == "mxfp8"  # MXFP8 activations (moe_mxfp4.triton)
    # W4A8 on sm_100+: tcgen05's block-scaled MMA (kind::mxf8f6f4) takes 128 rows on its M side (Triton 3.8
    # upcasts to kind::f16 at 64): 128 activation rows per block at prefill (the packed tiles' width: no
    # spills), the dense tiles' 128 weight rows in swap-AB at decode (the codes reach the MMA undecoded)
    mx = a8 and sm >= 100
    f8 = a8 and 90 <= sm < 100  # Hopper W4A8: e4m3 wgmma, the E8M0 scales applied per 32-wide k step
    if mx and SWAP_BELOW <= BM < 128 and not attrs.get("block_m"):
        BM = 128
    c = moe_launch_config(max(int(d["N"]), 1), k, E, L, I, ITEMSIZE[dtypes[1]], packed) | gemm_config(
        BM, L, I, ITEMSIZE[dtypes[1]], packed and not (mx and BM < SWAP_BELOW), fp8=f8)
    r, a, g1, g2, su = c["router"], c["align"], c["gemm1"], c["gemm2"], c["sum"]
    t = moe_launch_config(1, k, EG, L, I)["topk"]  # top-k over all EG experts
    static = {"d": D, "L": L, "E": E, "I": I, "EG": EG}

    def sizes(x: dict) -> dict:
        """Every int32 argument at runtime dims `x` (N dynamic; the weight dims must be the planned ones)."""
        x = {"EG": x["E"]} | dict(x)  # dims without EG: one GPU, every expert routed over is local
        for name, v in static.items():
            if x[name] != v:
                raise PlanError(f"k3::moe: runtime {name}={x[name]} differs from the planned {v} (static dim)")
        NK = x["N"] * k
        P = padded_rows(NK, E, BM)
        return {"N": x["N"], "NK": NK, "NB": cdiv(NK, ALIGN_BLOCK), "P": P, "num_m": P // BM} | static

    div16 = {n for n, v in static.items() if v % 16 == 0} | {"P"}  # P is a multiple of BM >= 16

    def launch(kernel, args, constexprs, grid, cfg):
        return Launch(kernel, args, constexprs, grid=grid, scalars=sizes, num_warps=cfg["num_warps"],
                      num_stages=cfg["num_stages"], divisible=tuple(n for n in args if n in div16))

    def gemm(name: str, cols: int, g: dict, constexprs: dict) -> Launch:
        """A persistent grouped GEMM: min(tiles, SMs × CTAs per SM) programs walking the tiles."""
        kernel, args = gemms[name]
        tiles = lambda x: num_m(x) * cdiv(cols, g["BN"])  # noqa: E731
        scaled = packed and sm >= 100 and (a8 or z_t in ("bf16", "fp16"))
        if packed:  # native MXFP4 MMA (tl.dot_scaled) on sm_100+ with 16-bit or MXFP8 activations; Hopper W4A8:
            # FP8 MMAs (F8); decode else
            constexprs = constexprs | {"SCALED": scaled, "AFMT": "e4m3" if a8 else z_t, "A8": a8, "F8": f8}
        if "TMA" in kernel.arg_names:  # GEMM2's weights: rows of I elements (I/2 bytes packed), 16-byte strides;
            # not with dot_scaled (8 B of spills at K3's prefill on sm_100a)
            row_bytes = I // 2 if packed else I * ITEMSIZE[w_t]
            constexprs = constexprs | {"TMA": sm >= 90 and row_bytes % 16 == 0 and not scaled}
        constexprs = constexprs | {"BM": BM, "BN": g["BN"], "BK": g["BK"], "GROUP_M": g["GROUP_M"], "SWAP": g["SWAP"],
                                   "IEEE": _ieee(z_t, w_t)}
        key = resource_key(kernel.fn.__name__, constexprs, g["num_warps"], g["num_stages"])
        ctas = int(attrs.get("gemm_programs") or persistent_ctas(key, g["num_warps"]))
        return launch(kernel, args, constexprs, lambda x: (min(tiles(x), ctas), 1, 1), g)

    num_m = lambda x: sizes(x)["num_m"]  # noqa: E731
    nb = lambda x: sizes(x)["NB"]  # noqa: E731
    x_t, z_t, gw_t, w_t = dtypes[0], dtypes[1], dtypes[2], dtypes[4]
    act = attrs.get("activation", "situ")
    launches = (
        launch(_router_kernel, ("x", "gate_weight", "s", "N", "EG", "d"),
               {"BM": r["BM"], "BN": r["BN"], "BK": r["BK"], "IEEE": _ieee(x_t, gw_t)},
               lambda x: (cdiv(x["N"], r["BM"]), cdiv(EG, r["BN"]), 1), r),
        launch(_topk_kernel, ("s", "gate_bias", "ids", "wts", "expert_offset", "EG", "E"),
               {"factor": float(attrs.get("routed_scaling_factor", 1.0)), "TOPK": k, "KP": t["KP"], "EP": t["EP"],
                "RENORM": bool(attrs.get("renormalize", True))}, lambda x: (x["N"], 1, 1), t),
        launch(_moe_align_count_kernel, ("ids", "counts", "NK", "E"), {"BLOCK": a["BLOCK"], "BE": a["BE"]},
               lambda x: (nb(x), 1, 1), a),
        launch(_moe_align_scan_kernel, ("counts", "offsets", "sorted_pair", "block_expert", "NK", "E", "NB", "P"),
               {"BM": BM, "EP": a["EP"], "BB": a["BB"], "BP": a["BP"]}, lambda x: (1, 1, 1), a),
        launch(_moe_align_scatter_kernel, ("ids", "offsets", "sorted_pair", "NK", "E"),
               {"BLOCK": a["BLOCK"], "BJ": a["BJ"]}, lambda x: (nb(x), 1, 1), a),
        gemm("_moe_gemm1_kernel", I, g1,
             {"beta1": float(attrs.get("situ_beta", 4.0)), "beta2": float(attrs.get("situ_linear_beta", 25.0)),
              "TOPK": k, "ACT": ACTIVATIONS[act]}),
        gemm("_moe_gemm2_kernel", L, g2, {}),
        launch(_moe_sum_kernel, ("y", "ids", "u", "L"), {"TOPK": k, "BL": su["BL"]},
               lambda x: (x["N"], cdiv(L, su["BL"]), 1), su),
    )
    ws = (Buffer("s", "fp32", lambda x: x["N"] * EG), Buffer("ids", "int64", lambda x: x["N"] * k),
          Buffer("wts", "fp32", lambda x: x["N"] * k), Buffer("counts", "int32", lambda x: nb(x) * E),
          Buffer("offsets", "int32", lambda x: nb(x) * E),
          Buffer("sorted_pair", "int32", lambda x: sizes(x)["P"]), Buffer("block_expert", "int32", num_m),
          Buffer("h", z_t, lambda x: sizes(x)["P"] * I), Buffer("y", z_t, lambda x: x["N"] * k * L))
    return Plan((Variant("experts", launches),), workspace=ws)


ROUTE = ("_router_kernel", "_topk_kernel")
ALIGN = ("_moe_align_count_kernel", "_moe_align_scan_kernel", "_moe_align_scatter_kernel")


def aligned(t: Tensor) -> Tensor:
    """`t` contiguous and 16-byte aligned (copied if not): GEMM1 addresses w3 from w1's base (`offset_to`)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def plan_attrs(top_k, routed_scaling_factor, renormalize, activation, situ_beta, situ_linear_beta) -> dict:
    """The plan attributes of the op's routing arguments (activation checked)."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r}: expected one of {sorted(ACTIVATIONS)}")
    return {"top_k": int(top_k), "routed_scaling_factor": float(routed_scaling_factor),
            "renormalize": bool(renormalize), "activation": activation, "situ_beta": float(situ_beta),
            "situ_linear_beta": float(situ_linear_beta)}


def route(x: Tensor, gate_weight: Tensor, gate_bias: Tensor, top_k: int, routed_scaling_factor: float,
          renormalize: bool) -> tuple[Tensor, Tensor]:
    """The plan's routing step: (topk_ids [N, k] int64, topk_weights [N, k] fp32), ids in descending order of
    biased score."""
    N, D = x.shape
    E = gate_weight.shape[0]
    if gate_weight.shape != (E, D) or gate_bias.shape != (E,) or not 1 <= top_k <= E:
        raise ValueError(f"route: x {tuple(x.shape)} gate {tuple(gate_weight.shape)} bias {tuple(gate_bias.shape)} "
                         f"top_k={top_k} do not fit")
    d = {"N": N, "d": D, "L": 1, "E": E, "I": 1, "EG": E}
    dts = [dtype_name(x.dtype), dtype_name(x.dtype), dtype_name(gate_weight.dtype), "fp32", "fp32"]
    p = plan(d, dts, plan_attrs(top_k, routed_scaling_factor, renormalize, "silu", 1.0, 1.0))
    env = run(p, {"x": x.contiguous(), "gate_weight": gate_weight.contiguous(), "gate_bias": gate_bias.contiguous(),
                  "expert_offset": no_offset(x.device)}, d, only=ROUTE)
    return env["ids"].view(N, top_k), env["wts"].view(N, top_k)


def moe_align(ids: Tensor, E: int, BM: int) -> tuple[Tensor, Tensor]:
    """The plan's align step with `BM` rows per block: pairs stably sorted by expert, each expert's segment
    padded to a multiple of BM (static output sizes). ids [N, k] -> sorted_pair [P] int32 (pair id n·k + j, or
    NK for padding), block_expert [P/BM] int32 (expert of each block, -1 past the last used block);
    P = `padded_rows(NK, E, BM)`."""
    N, k = ids.shape
    d = {"N": N, "d": 1, "L": 1, "E": E, "I": 1, "EG": E}
    p = plan(d, ["fp32"] * 5, plan_attrs(k, 1.0, True, "silu", 1.0, 1.0) | {"block_m": BM})
    env = run(p, {"ids": ids.reshape(-1).contiguous()}, d, only=ALIGN)
    return env["sorted_pair"], env["block_expert"]


def no_offset(device) -> Tensor:
    """expert_offset of a single-GPU call: 0."""
    return torch.zeros(1, dtype=torch.int32, device=device)


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
        top_k: int, routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
        situ_linear_beta: float, expert_offset: Tensor | None = None) -> Tensor:
    """The whole plan: routing, align, grouped GEMMs, weighted sum -> u [N, L] in z's dtype (this rank's
    partial sum when `expert_offset` is given: w1/w3/w2 hold the E local experts, gate_weight all EG)."""
    E, I, L = w1.shape
    EG = gate_weight.shape[0]
    if (z.shape != (x.shape[0], L) or w3.shape != w1.shape or w2.shape != (E, L, I)
            or gate_weight.shape != (EG, x.shape[-1]) or (EG != E if expert_offset is None else EG < E)):
        raise ValueError(f"moe: shapes x {tuple(x.shape)} z {tuple(z.shape)} gate {tuple(gate_weight.shape)} "
                         f"w1 {tuple(w1.shape)} w3 {tuple(w3.shape)} w2 {tuple(w2.shape)} do not fit")
    attrs = plan_attrs(top_k, routed_scaling_factor, renormalize, activation, situ_beta, situ_linear_beta)
    off = no_offset(x.device) if expert_offset is None else expert_offset.reshape(1).to(torch.int32)
    tensors = dict(zip(("x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2", "expert_offset"),
                       (aligned(t) for t in (x, z, gate_weight, gate_bias, w1, w3, w2, off))))
    tensors["u"] = torch.empty(z.shape[0], L, device=z.device, dtype=z.dtype)
    d = dims([t.shape for t in tensors.values()])
    run(plan(d, [dtype_name(t.dtype) for t in tensors.values()], attrs), tensors, d)
    return tensors["u"]
