"""Kimi Delta Attention, Triton kernels, their launch plan and launchers (forward only). Never imports
`reference.py`.

Same functions and contract as `reference.py`:
    q, k  [B, T, H, K]  L2-normalised;  v [B, T, H, V];  g [B, T, H, K] log-decay (<= 0);  beta [B, T, H]
    initial_state [B, H, K, V] fp32 (zeros when None).  Returns (o [B, T, H, V] in v's dtype,
    final_state [B, H, K, V] fp32).  Any T >= 1, any H; 16 <= K, V <= 256 for the chunked path.

Chunked prefill (docs/model.md §2.4), two kernels:
  1. `_kda_intra_kernel`, grid (NT, B*H), one 64-token chunk split into four 16-token sub-chunks.
     Within-chunk cumulative decay Γ by `tl.cumsum`.  Scores A[r, c] = Σ_d x_r k_c e^{Γ_r − Γ_c}
     (x = k for L, x = q for A^qk) are dense `tl.dot`s after factorising e^{Γ_r − Γ_c} =
     e^{Γ_r − R_i} · e^{R_i − Γ_c} with ONE reference R_i per row sub-chunk i: the cumulative decay just
     before its first row.  Each row sub-chunk is scored against the whole chunk in one [16, 64]
     accumulator (four per matrix, spread over the warps, instead of twenty replicated 16×16 blocks).
     Row factors are <= 1; column factors are <= 1 for earlier sub-chunks, <= e^{span_i} on the diagonal
     block, span_i = −Σ_{rows of i} g <= 16·5 = 80 for K3's gate >= −5 (finite in fp32 and bf16, whose max
     is e^88.7), and clamped for later sub-chunks (masked out).  Unbounded gates (Kimi Linear) are a
     separate variant chosen on the host from the op's `gate_lower_bound` (constexpr SAFE_GATE off): it
     checks span_i per (sub-chunk, K-block) at run time and, only where it exceeds 80, scores that sub-chunk
     pairwise with exponents min(Γ_r − Γ_c, 0) — exact for any g <= 0.  K3's variant never compiles it.
     Then the UT transform (I + Diag(β) L)^{-1} Diag(β): forward substitution on the four 16×16 diagonal
     blocks at once (stacked with `tl.join`) and block back-substitution for the six off-diagonal ones
     (fp32, "ieee" dots), assembled into one [64, 64] X; W = X (β k e^Γ) and U = X (β v) are single
     [64, 64] × [64, B] dots; the chunk's q e^Γ (scaled), k e^{Γ_C − Γ}, e^{Γ_C}, A^qk are stored.
  2. `_kda_state_kernel`, grid (V/BV, B*H), sequential over chunks with the fp32 state in registers:
     V' = U − W S;  O = (q e^Γ) S + A^qk V';  S ← e^{Γ_C} ⊙ S + (k e^{Γ_C − Γ})ᵀ V'.  The output is
     fused into the state pass, so the per-chunk states h are never written to memory.
Matmul operands are bf16 (fp32 accumulation) when the inputs are bf16, as in fla; otherwise fp32 with
input_precision="ieee" (exact-ish, slow: for tests and fp16/fp32 callers).

Recurrent decode (docs/model.md §2.1): `_kda_recurrent_kernel`, grid (V/BV, B*H), the [K, BV] state slice in
registers, token loop inside.  `kda_recurrent_` updates a state buffer in place (decode step).
`kda` picks recurrent for T <= RECURRENT_MAX_T, chunked above.

Packed mode (k3::kda_packed, `VARLEN` constexpr; dense k3::kda pins it off and its extra pointers to None):
ports [N, H, *] hold B sequences end to end; each program reads its sequence's first row and length from
cu_seqlens [B+1] and its initial state from the pool row slots[b]; `SPLIT` > 0 lets the recurrent kernel take
the sequences of <= SPLIT rows and the chunked pair the longer ones, in one step. `recurrent_launch` and
`chunked_launches` build the launches of either mode (kda_packed/triton.py plans with them).

Launch parameters are pure functions of the shapes (`kda_chunk_launch_config`, chosen from the kernels'
compiled sm_90 resources; `kda_recurrent_launch_config`), gathered in one `plan` (plan/launch.py) that the torch launchers below
run with Triton's JIT and the TensorRT plugin runs from cubins compiled ahead of time.
No autotune, no block pointers; kernel arguments are tensors, then scalars, then constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import SM90_SMS, Buffer, Launch, Plan, Variant, cdiv, ctas_per_sm, run
from .limits import KERNEL_HEAD_DIM

BT = 64  # chunk size
BC = 16  # sub-chunk size
SPAN_MAX = tl.constexpr(80.0)  # max within-sub-chunk decay span for the dense diagonal path (e^80 < fp32/bf16 max)
RECURRENT_MAX_T = 16  # kda(): recurrent kernel up to this many tokens, chunked above (tune with bench/gpu_check.py)


@triton.jit
def _mma(a, b, acc, DOT_BF16: tl.constexpr):
    """acc + a @ b in fp32: bf16 tensor-core operands, or fp32 with IEEE precision."""
    if DOT_BF16:
        acc = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return acc


@triton.jit
def _dot32(a, b):
    """a @ b for small fp32 [16, 16] blocks of the triangular solve (IEEE precision)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def _pairwise_rows(x, G, ka, Ga, BC: tl.constexpr, BT: tl.constexpr):
    """Σ_d x_r[d] k_c[d] exp(min(Γ_r[d] − Γ_c[d], 0)) for one row sub-chunk against the whole chunk, row by row.

    x, G [BC, BK] (rows r), ka, Ga [BT, BK] (columns c), fp32 -> [BC, BT]; exact for c <= r whatever the gate.
    Compiled only into the unbounded-gate variant, run only where the factorised form could overflow."""
    o = tl.arange(0, BC)
    acc = tl.zeros([BC, BT], dtype=tl.float32)
    for r in range(BC):
        sel = o[:, None] == r
        x_r = tl.sum(tl.where(sel, x, 0.0), 0)  # [BK]
        G_r = tl.sum(tl.where(sel, G, 0.0), 0)  # [BK]
        e = tl.exp(tl.minimum(G_r[None, :] - Ga, 0.0))  # [BT(c), BK]
        col = tl.sum(ka * e * x_r[None, :], 1)  # [BT(c)]
        acc = tl.where(sel, col[None, :], acc)
    return acc


@triton.jit
def _inv_unit_lower4(L0, L1, L2, L3, BC: tl.constexpr):
    """(I + L_i)^{-1} for four strictly lower-triangular fp32 [BC, BC] blocks at once, by forward substitution.

    The blocks are stacked into one [BC, BC, 2, 2] tensor (`tl.join`), so the BC − 1 dependent steps run once
    for all four diagonal blocks instead of four times in sequence."""
    o = tl.arange(0, BC)
    Y = -tl.join(tl.join(L0, L1), tl.join(L2, L3))  # Y = X − I; row i is final once processed
    for i in range(1, BC):
        sel = (o == i)[:, None, None, None]
        a = tl.sum(tl.where(sel, Y, 0.0), 0)  # [BC(c), 2, 2]: row i of −L (a_j = 0 for j >= i)
        a = a + tl.sum(a[:, None, :, :] * Y, 0)
        Y = tl.where(sel, a[None, :, :, :], Y)
    Y01, Y23 = tl.split(Y)
    Y0, Y1 = tl.split(Y01)
    Y2, Y3 = tl.split(Y23)
    eye = (o[:, None] == o[None, :]).to(tl.float32)
    return Y0 + eye, Y1 + eye, Y2 + eye, Y3 + eye


@triton.jit
def _split4(x, BC: tl.constexpr):
    """[BC, 4·BC] -> its four [BC, BC] column blocks."""
    y = tl.permute(tl.reshape(x, [BC, 2, 2, BC]), (0, 3, 1, 2))  # [r, c, a, b]: column block 2a + b
    y0, y1 = tl.split(y)  # b = 0, 1
    x0, x2 = tl.split(y0)
    x1, x3 = tl.split(y1)
    return x0, x1, x2, x3


@triton.jit
def _cat4(x0, x1, x2, x3, BC: tl.constexpr):
    """Four [BC, BC] blocks -> [BC, 4·BC] (x_j in columns j·BC ...)."""
    y = tl.join(tl.join(x0, x2), tl.join(x1, x3))  # [r, c, a, b]: block 2a + b
    return tl.reshape(tl.permute(y, (0, 2, 3, 1)), [BC, 4 * BC])


@triton.jit
def _cat_rows4(r0, r1, r2, r3, BC: tl.constexpr, BT: tl.constexpr):
    """Four [BC, BT] row blocks -> [4·BC, BT]."""
    y = tl.join(tl.join(r0, r2), tl.join(r1, r3))  # [r, c, a, b]: row block 2a + b
    return tl.reshape(tl.permute(y, (2, 3, 0, 1)), [4 * BC, BT])


@triton.jit
def _load_tile(ptr, rows, o_k, m_k, T, STRIDE: tl.constexpr):
    """[len(rows), BK] fp32 tile of rows `rows` (masked past T) and channels o_k."""
    m = (rows < T)[:, None] & m_k[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * STRIDE + o_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_tile(ptr, x, rows, o_k, m_k, T, STRIDE: tl.constexpr):
    m = (rows < T)[:, None] & m_k[None, :]
    tl.store(ptr + rows[:, None].to(tl.int64) * STRIDE + o_k[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _row_scores(k, q, g, ka, Ga, ga, o_t, rows, o_k, m_k, T, scale, Lr, Qr, I: tl.constexpr, H: tl.constexpr,
                K: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, DOT_BF16: tl.constexpr,
                SAFE_GATE: tl.constexpr):
    """One K-block's contribution to row sub-chunk I's scores against the whole chunk: L_I· and A^qk_I· [BC, BT].

    Reference R_I = Γ just before the sub-chunk. Row factors e^{Γ_r − R_I} <= 1; column factors
    e^{R_I − Γ_c} <= 1 for earlier sub-chunks, <= e^{span_I} on the diagonal block (finite when the gate is
    bounded: SAFE_GATE), clamped at e^{SPAN_MAX} for later ones (masked out by the caller). Without SAFE_GATE a
    sub-chunk whose span exceeds SPAN_MAX in this K-block is computed pairwise instead."""
    R = tl.sum(tl.where((o_t < I * BC)[:, None], ga, 0.0), 0)  # [BK]
    gr = _load_tile(g, rows, o_k, m_k, T, H * K)
    Gr = tl.cumsum(gr, 0)  # Γ_r − R_I
    f = tl.exp(Gr)
    kr = _load_tile(k, rows, o_k, m_k, T, H * K)
    qr = _load_tile(q, rows, o_k, m_k, T, H * K) * scale
    colt = tl.trans(ka * tl.exp(tl.minimum(R[None, :] - Ga, SPAN_MAX)))  # [BK, BT]
    if SAFE_GATE:
        Lr = _mma(kr * f, colt, Lr, DOT_BF16)
        Qr = _mma(qr * f, colt, Qr, DOT_BF16)
    else:
        span = tl.max(-tl.sum(gr, 0), 0)
        if span <= SPAN_MAX:
            Lr = _mma(kr * f, colt, Lr, DOT_BF16)
            Qr = _mma(qr * f, colt, Qr, DOT_BF16)
        else:  # unbounded gate: pairwise exponents, each factor <= 1
            Lr += _pairwise_rows(kr, Gr + R[None, :], ka, Ga, BC, BT)
            Qr += _pairwise_rows(qr, Gr + R[None, :], ka, Ga, BC, BT)
    return Lr, Qr


@triton.jit
def seq_span(cu_seqlens, i_b, T, NT, chunk_stride, BT: tl.constexpr, VARLEN: tl.constexpr):
    """(first row, length, gl chunk base, gl chunk stride) of sequence i_b. Dense [B, T]: rows i_b·T.., gl
    [B, NT, H, K] (chunk base i_b·NT, stride H·K). VARLEN (packed by cu_seqlens): rows cu[i_b]..cu[i_b+1]-1,
    gl indexed by each chunk's first packed row (base cu[i_b], stride BT·H·K), so it needs N rows."""
    if VARLEN:
        bos = tl.load(cu_seqlens + i_b).to(tl.int64)
        T = (tl.load(cu_seqlens + i_b + 1) - bos).to(tl.int32)
        return bos, T, bos, chunk_stride * BT
    return i_b.to(tl.int64) * T, T, i_b.to(tl.int64) * NT, chunk_stride


@triton.jit
def slot_shift(slots, i_b, ROW: tl.constexpr):
    """Elements from row i_b to row slots[i_b] of a state pool of ROW-element rows (VARLEN's initial states)."""
    return (tl.load(slots + i_b).to(tl.int64) - i_b) * ROW


@triton.jit
def _kda_intra_kernel(
    q, k, v, g, beta,  # inputs [B, T, H, K|V], beta [B, T, H]
    cu_seqlens,  # VARLEN: [B+1] int32 (inputs packed [N, H, *]); else None
    w, u, qg, kg, A, gl,  # outputs [B, T, H, K], [B, T, H, V], [B, T, H, K] ×2, [B, T, H, BT], [B, NT, H, K] fp32
    T, NT,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr, SAFE_GATE: tl.constexpr,
    VARLEN: tl.constexpr, SPLIT: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, T, c0, gs = seq_span(cu_seqlens, i_b, T, NT, H * K, BT, VARLEN)
    if VARLEN:
        if (i_t * BT >= T) | (T <= SPLIT):  # past this sequence's chunks, or left to the recurrent kernel
            return
    # per-head base pointers; a row r of the sequence is at + r * (H * X)
    q += (tok0 * H + i_h) * K
    k += (tok0 * H + i_h) * K
    g += (tok0 * H + i_h) * K
    w += (tok0 * H + i_h) * K
    qg += (tok0 * H + i_h) * K
    kg += (tok0 * H + i_h) * K
    v += (tok0 * H + i_h) * V
    u += (tok0 * H + i_h) * V
    A += (tok0 * H + i_h) * BT
    beta += tok0 * H + i_h
    gl += (c0 * H + i_h) * K + i_t * gs

    o_t = tl.arange(0, BT)
    rows = i_t * BT + o_t  # the chunk's rows
    o_i = tl.arange(0, BC)
    r0 = i_t * BT + o_i  # rows of the four sub-chunks
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    b_all = tl.load(beta + rows.to(tl.int64) * H, mask=rows < T, other=0.0).to(tl.float32)  # [BT]

    # ---- 1. scores of each row sub-chunk against the chunk, L (unscaled by β) and A^qk: [BC, BT] fp32 each
    L0 = tl.zeros([BC, BT], dtype=tl.float32)
    L1 = tl.zeros([BC, BT], dtype=tl.float32)
    L2 = tl.zeros([BC, BT], dtype=tl.float32)
    L3 = tl.zeros([BC, BT], dtype=tl.float32)
    Q0 = tl.zeros([BC, BT], dtype=tl.float32)
    Q1 = tl.zeros([BC, BT], dtype=tl.float32)
    Q2 = tl.zeros([BC, BT], dtype=tl.float32)
    Q3 = tl.zeros([BC, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        ka = _load_tile(k, rows, o_k, m_k, T, H * K)  # [BT, BK]
        ga = _load_tile(g, rows, o_k, m_k, T, H * K)
        Ga = tl.cumsum(ga, 0)  # Γ (within-chunk cumulative decay)
        L0, Q0 = _row_scores(k, q, g, ka, Ga, ga, o_t, r0, o_k, m_k, T, scale, L0, Q0, 0, H, K, BC, BT, DOT_BF16,
                             SAFE_GATE)
        L1, Q1 = _row_scores(k, q, g, ka, Ga, ga, o_t, r1, o_k, m_k, T, scale, L1, Q1, 1, H, K, BC, BT, DOT_BF16,
                             SAFE_GATE)
        L2, Q2 = _row_scores(k, q, g, ka, Ga, ga, o_t, r2, o_k, m_k, T, scale, L2, Q2, 2, H, K, BC, BT, DOT_BF16,
                             SAFE_GATE)
        L3, Q3 = _row_scores(k, q, g, ka, Ga, ga, o_t, r3, o_k, m_k, T, scale, L3, Q3, 3, H, K, BC, BT, DOT_BF16,
                             SAFE_GATE)

    # ---- 2. A^qk (causal incl. diagonal) -> A [.., BT]; entries above the diagonal stored as zeros
    m_all = o_t < BT
    _store_tile(A, tl.where(o_t[None, :] <= o_i[:, None], Q0, 0.0), r0, o_t, m_all, T, H * BT)
    _store_tile(A, tl.where(o_t[None, :] <= o_i[:, None] + BC, Q1, 0.0), r1, o_t, m_all, T, H * BT)
    _store_tile(A, tl.where(o_t[None, :] <= o_i[:, None] + 2 * BC, Q2, 0.0), r2, o_t, m_all, T, H * BT)
    _store_tile(A, tl.where(o_t[None, :] <= o_i[:, None] + 3 * BC, Q3, 0.0), r3, o_t, m_all, T, H * BT)

    # ---- 3. UT transform: X = (I + Diag(β) L)^{-1}, block lower-triangular [BT, BT] fp32
    b0 = tl.load(beta + r0.to(tl.int64) * H, mask=r0 < T, other=0.0).to(tl.float32)
    b1 = tl.load(beta + r1.to(tl.int64) * H, mask=r1 < T, other=0.0).to(tl.float32)
    b2 = tl.load(beta + r2.to(tl.int64) * H, mask=r2 < T, other=0.0).to(tl.float32)
    b3 = tl.load(beta + r3.to(tl.int64) * H, mask=r3 < T, other=0.0).to(tl.float32)
    L00, _x01, _x02, _x03 = _split4(L0 * b0[:, None], BC)
    L10, L11, _x12, _x13 = _split4(L1 * b1[:, None], BC)
    L20, L21, L22, _x23 = _split4(L2 * b2[:, None], BC)
    L30, L31, L32, L33 = _split4(L3 * b3[:, None], BC)
    strict = o_i[:, None] > o_i[None, :]
    X00, X11, X22, X33 = _inv_unit_lower4(tl.where(strict, L00, 0.0), tl.where(strict, L11, 0.0),
                                          tl.where(strict, L22, 0.0), tl.where(strict, L33, 0.0), BC)
    X10 = -_dot32(X11, _dot32(L10, X00))
    X21 = -_dot32(X22, _dot32(L21, X11))
    X20 = -_dot32(X22, _dot32(L20, X00) + _dot32(L21, X10))
    X32 = -_dot32(X33, _dot32(L32, X22))
    X31 = -_dot32(X33, _dot32(L31, X11) + _dot32(L32, X21))
    X30 = -_dot32(X33, _dot32(L30, X00) + _dot32(L31, X10) + _dot32(L32, X20))
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    X = _cat_rows4(_cat4(X00, zero, zero, zero, BC), _cat4(X10, X11, zero, zero, BC),
                   _cat4(X20, X21, X22, zero, BC), _cat4(X30, X31, X32, X33, BC), BC, BT)  # [BT, BT]

    # ---- 4. W = X (β k e^Γ), q e^Γ (scaled), k e^{Γ_C − Γ}, e^{Γ_C}, per K-block: one [BT, BT] x [BT, BK] dot
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        ga = _load_tile(g, rows, o_k, m_k, T, H * K)
        Ga = tl.cumsum(ga, 0)
        RC = tl.sum(ga, 0)
        tl.store(gl + o_k, tl.exp(RC), mask=m_k)
        ka = _load_tile(k, rows, o_k, m_k, T, H * K)
        _store_tile(kg, ka * tl.exp(RC[None, :] - Ga), rows, o_k, m_k, T, H * K)
        kb = ka * tl.exp(Ga) * b_all[:, None]
        _store_tile(w, _mma(X, kb, tl.zeros([BT, BK], dtype=tl.float32), DOT_BF16), rows, o_k, m_k, T, H * K)
        _store_tile(qg, _load_tile(q, rows, o_k, m_k, T, H * K) * scale * tl.exp(Ga), rows, o_k, m_k, T, H * K)

    # ---- 5. U = X (β v), per V-block
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        vb = _load_tile(v, rows, o_v, m_v, T, H * V) * b_all[:, None]
        _store_tile(u, _mma(X, vb, tl.zeros([BT, BV], dtype=tl.float32), DOT_BF16), rows, o_v, m_v, T, H * V)


@triton.jit
def _kda_state_kernel(
    w, u, qg, kg, A, gl, h0,  # from the intra kernel; h0 [B, H, K, V] fp32 (ignored unless HAS_H0)
    cu_seqlens, slots,  # VARLEN: [B+1], [B] int32, h0 is the pool [S, H, K, V] read at row slots[b]; else None
    o, ht,  # outputs [B, T, H, V], [B, H, K, V] fp32
    T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr, HAS_H0: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, T, c0, gs = seq_span(cu_seqlens, i_b, T, NT, H * K, BT, VARLEN)
    if VARLEN:
        if T <= SPLIT:  # left to the recurrent kernel
            return
        NT = tl.cdiv(T, BT)
    w += (tok0 * H + i_h) * K
    qg += (tok0 * H + i_h) * K
    kg += (tok0 * H + i_h) * K
    u += (tok0 * H + i_h) * V
    o += (tok0 * H + i_h) * V
    A += (tok0 * H + i_h) * BT
    gl += (c0 * H + i_h) * K
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)  # state slice [K, BV]
    if HAS_H0:
        if VARLEN:
            h0 += slot_shift(slots, i_b, H * K * V)  # the pool row of this sequence
        S = tl.load(h0 + p_s, mask=m_s, other=0.0).to(tl.float32)
    ddt = w.dtype.element_ty
    for i_t in range(0, NT):
        rows = i_t * BT + o_t
        m_t = rows < T
        r64 = rows.to(tl.int64)
        b_w = tl.load(w + r64[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_q = tl.load(qg + r64[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_kg = tl.load(kg + r64[:, None] * (H * K) + o_k[None, :], mask=m_t[:, None] & m_k[None, :], other=0.0)
        b_u = tl.load(u + r64[:, None] * (H * V) + o_v[None, :], mask=m_t[:, None] & m_v[None, :], other=0.0)
        b_A = tl.load(A + r64[:, None] * (H * BT) + o_t[None, :], mask=m_t[:, None], other=0.0)
        b_gl = tl.load(gl + i_t * gs + o_k, mask=m_k, other=0.0)
        S_d = S.to(ddt)
        vn = b_u.to(tl.float32) - _mma(b_w, S_d, tl.zeros([BT, BV], dtype=tl.float32), DOT_BF16)  # V' [BT, BV]
        vn_d = vn.to(ddt)
        b_o = _mma(b_q, S_d, tl.zeros([BT, BV], dtype=tl.float32), DOT_BF16)
        b_o = _mma(b_A, vn_d, b_o, DOT_BF16)
        tl.store(o + r64[:, None] * (H * V) + o_v[None, :], b_o.to(o.dtype.element_ty),
                 mask=m_t[:, None] & m_v[None, :])
        S = _mma(tl.trans(b_kg), vn_d, S * b_gl[:, None], DOT_BF16)
    tl.store(ht + p_s, S, mask=m_s)


@triton.jit
def _kda_recurrent_kernel(  # arguments in TensorRT QDP order: inputs, int32 scalars, outputs
    q, k, v, g, beta, h0,  # [B, T, H, K|V], beta [B, T, H], h0 [B, H, K, V] fp32 (may alias ht)
    cu_seqlens, slots,  # VARLEN: [B+1], [B] int32, h0 is the pool [S, H, K, V] read at row slots[b]; else None
    T,
    o, ht,  # [B, T, H, V], [B, H, K, V] fp32
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr, VARLEN: tl.constexpr, SPLIT: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0, T, _c0, _gs = seq_span(cu_seqlens, i_b, T, 1, 0, 1, VARLEN)
    if VARLEN:
        if SPLIT > 0:
            if T > SPLIT:  # left to the chunked kernels
                return
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        if VARLEN:
            h0 += slot_shift(slots, i_b, H * K * V)  # the pool row of this sequence
        S = tl.load(h0 + p_s, mask=m_s, other=0.0).to(tl.float32)
    for t in range(0, T):
        row = (tok0 + t) * H + i_h
        b_q = tl.load(q + row * K + o_k, mask=m_k, other=0.0).to(tl.float32) * scale
        b_k = tl.load(k + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_g = tl.load(g + row * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + row * V + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_beta = tl.load(beta + row).to(tl.float32)
        S = S * tl.exp(b_g)[:, None]  # decay rows
        err = b_v - tl.sum(b_k[:, None] * S, 0)  # [BV]
        S = S + b_k[:, None] * (b_beta * err)[None, :]  # delta write
        b_o = tl.sum(b_q[:, None] * S, 0)  # read after the write
        tl.store(o + row * V + o_v, b_o.to(o.dtype.element_ty), mask=m_v)
    tl.store(ht + p_s, S, mask=m_s)


# ----------------------------------------------------------------------------------- launch plan and launchers


def _np2(x: int) -> int:
    return triton.next_power_of_2(x)



# Compiled resources on sm_90a (triton 3.8, K = V = 128, bf16; `python -m k3x.bench.kernel_resources` and
# tests/bench/test_kernel_resources.py recompile the chosen entries and hold them to these numbers):
# (BV, num_warps, num_stages) -> (registers per thread, dynamic shared memory bytes, spills?)
STATE_RESOURCES_SM90 = {
    (16, 4, 1): (158, 63488, False), (16, 4, 2): (90, 122880, False), (32, 4, 1): (168, 69632, False),
    (32, 4, 2): (128, 131072, False), (64, 4, 1): (255, 81920, True), (64, 4, 2): (208, 147456, False),
    (16, 8, 1): (98, 65536, False), (32, 8, 1): (140, 69632, False), (32, 8, 2): (118, 131072, False),
    (64, 8, 1): (182, 81920, False), (64, 8, 2): (170, 147456, False),
}
# (BK, num_warps, num_stages) -> (registers, shared, spills?) of the intra kernel (bounded gate)
INTRA_RESOURCES_SM90 = {
    (16, 4, 1): (247, 16384, False), (16, 4, 2): (246, 24576, False), (32, 4, 1): (255, 16384, False),
    (32, 4, 2): (255, 33792, True), (16, 8, 1): (141, 16384, False), (16, 8, 2): (183, 24576, False),
    (32, 8, 1): (175, 16384, False), (32, 8, 2): (228, 33792, False),
}


def state_config_runs_right(key: tuple[int, int, int]) -> bool:
    """Whether a (BV, warps, stages) entry of the state kernel may be chosen. Measured on an H200 with Triton
    3.6 (bench/gpu_check.py, 2026-12-04; B=1, T=1281, H=96, bf16 against the fp64 reference), three of the
    four single-stage entries at BV 16 or 32 ran wrong: (16, 4, 1) and (32, 4, 1) read shared memory out of
    bounds in the bf16 dot at K=128 (compute-sanitizer: invalid __shared__ read; an illegal address) and gave
    wrong values at K=64 (output rmse ratio 1.1), (32, 8, 1) faulted at K=128. (16, 8, 1) matched at both,
    but is left out with them: one run is no proof for an entry whose neighbours fail. Every two-stage entry
    and every BV=64 entry matched at K=64 and 128. Left-out entries stay in the table (compiled resources) but
    are never chosen."""
    BV, _warps, stages = key
    return stages >= 2 or BV >= 64


def _pick_state(B: int, H: int, V: int) -> tuple[int, int, int]:
    """(BV, warps, stages) of the state kernel from its compiled resources, among the entries that run right
    (`state_config_runs_right`): no spills, then the fewest waves x (BV + 32) (a CTA's serial chunk loop does
    math in proportion to its BV columns plus the loads of the [BT, K] w, qg, kg tiles every CTA makes
    whatever its BV, worth about 32 columns), then larger BV, then more stages."""
    def cost(key):
        BV, warps, stages = key
        regs, shared, spills = STATE_RESOURCES_SM90[key]
        grid = B * H * triton.cdiv(V, BV)
        waves = -(-grid // (ctas_per_sm(regs, shared, warps) * SM90_SMS))
        return (spills, waves * (BV + 32), -BV, -stages)
    return min((k for k in STATE_RESOURCES_SM90 if k[0] <= max(16, _np2(V)) and state_config_runs_right(k)),
               key=cost)


def _pick_intra() -> tuple[int, int, int]:
    """(BK, warps, stages) of the intra kernel: no spills, most CTAs per SM (its grid is NT x B*H, many
    waves), then more stages (pipelined loads), then fewer registers."""
    def cost(key):
        regs, shared, spills = INTRA_RESOURCES_SM90[key]
        return (spills, -ctas_per_sm(regs, shared, key[1]), -key[2], regs)
    return min(INTRA_RESOURCES_SM90, key=cost)


def kda_chunk_launch_config(B: int, T: int, H: int, K: int, V: int,
                            state_entry: tuple[int, int, int] | None = None) -> dict:
    """Block sizes, warps and stages of the two chunked kernels, chosen from their compiled sm_90 resources
    (tables above, measured at K = V = 128; larger K shrinks BV to keep the [K, BV] fp32 state slice the same
    size). With the tables: intra BK=16, 4 warps, 2 stages (246 registers, 2 CTAs per SM, no spills); state
    BV=64, 4 warps, 2 stages at K3's B=1, H=96 (208 registers, 144 KB, one CTA per SM: 192 CTAs in two waves;
    the single-stage BV=32 entry that filled one wave ran wrong on an H200, `state_config_runs_right`).
    `state_entry`: the state kernel's (BV, warps, stages) named instead of chosen (a candidate the dispatcher
    picks by measurement, kda/candidates.py); it must be one that runs right.

    AOT compilers: give pointers and the K/V-sized int arguments `tt.divisibility=16` as the JIT does
    for such values; without it loads are not vectorised and the state kernel spills."""
    BK_state = _np2(K)
    if state_entry is not None and not (state_entry in STATE_RESOURCES_SM90
                                        and state_config_runs_right(state_entry)):
        raise ValueError(f"kda: state kernel entry {state_entry} is not one that runs right")
    BV_state, w_state, s_state = _pick_state(B, H, V) if state_entry is None else state_entry
    BV_state = max(16, min(BV_state * 128 // max(BK_state, 128), _np2(V)))
    BK, w_intra, s_intra = _pick_intra()
    return {
        "intra": {"BK": BK, "BV": min(64, _np2(V)), "num_warps": w_intra, "num_stages": s_intra},
        "state": {"BK": BK_state, "BV": BV_state, "num_warps": w_state, "num_stages": s_state},
    }


def kda_recurrent_launch_config(B: int, T: int, H: int, K: int, V: int) -> dict:
    """Block sizes of the recurrent kernel: enough programs to fill the GPU even at B=1."""
    BK = _np2(K)
    BV = min(_np2(V), 64)
    while BV > 16 and B * H * triton.cdiv(V, BV) < 1024:
        BV //= 2
    return {"BK": BK, "BV": BV, "num_warps": 4 if BK * BV >= 4096 else 2, "num_stages": 1}


def safe_gate(gate_lower_bound: float | None) -> bool:
    """Whether a gate bounded below by `gate_lower_bound` (log-decay per token; None or 0 = unbounded, the
    op's encoding) keeps every 16-token diagonal span <= SPAN_MAX, so the intra kernel is compiled without the
    pairwise fallback (K3: -5 -> spans <= 80)."""
    return gate_lower_bound is not None and 0.0 < -float(gate_lower_bound) * BC <= SPAN_MAX.value


def dims(shapes) -> dict:
    """Named dims from the input shapes (q, k, v, g, beta, initial_state)."""
    (B, T, H, K), v = shapes[0], shapes[2]
    return {"B": B, "T": T, "H": H, "K": K, "V": v[3]}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The launches of k3::kda at dims `d` (block sizes chosen there; grids follow the runtime B and T):
    variant "recurrent" for T <= RECURRENT_MAX_T (one kernel), "chunked" above (intra + state kernels, their
    intermediates w, u, qg, kg, A, gl in the workspace). `dtypes` are the port dtypes (q first); `scale` is
    specialised into the code. Ports: q, k, v, g, beta, initial_state -> o, final_state."""
    safe = safe_gate(attrs.get("gate_lower_bound"))
    recurrent = recurrent_launch(d, attrs, varlen=False, split=0)
    intra, state, ws = chunked_launches(d, dtypes, attrs, varlen=False, split=0)
    return Plan((Variant("recurrent", (recurrent,), when=lambda x: x["T"] <= RECURRENT_MAX_T),
                 Variant("chunked" if safe else "chunked-unbounded-gate", (intra, state),
                         when=lambda x: x["T"] > RECURRENT_MAX_T)), workspace=ws)


DENSE = {"cu_seqlens": None, "slots": None, "VARLEN": False, "SPLIT": 0}  # the packed-only arguments, unused


def _layout(d: dict, varlen: bool) -> tuple:
    """(T for the launch configs, the kernels' T scalar, rows of the token axis, the initial-state ports) of
    dense [B, T, H, *] ports, or of packed [N, H, *] ports (varlen: dims N, B; the kernels read each
    sequence's T from cu_seqlens and its initial state from state_pool row slots[b])."""
    if varlen:
        return d["N"], (lambda x: x["N"]), (lambda x: x["N"]), ("state_pool", "cu_seqlens", "slots")
    return d["T"], (lambda x: x["T"]), (lambda x: x["B"] * x["T"]), ("initial_state",)


def recurrent_launch(d: dict, attrs: dict, *, varlen: bool, split: int) -> Launch:
    """The recurrent kernel's launch. varlen: packed ports plus state_pool, cu_seqlens, slots,
    running only the sequences of <= `split` rows (0: all of them)."""
    B, H, K, V = d["B"], d["H"], d["K"], d["V"]
    t_hint, t_arg, _, h0 = _layout(d, varlen)
    r = kda_recurrent_launch_config(B, max(t_hint, 1), H, K, V)
    return Launch(_kda_recurrent_kernel, ("q", "k", "v", "g", "beta", *h0, "T", "o", "final_state"),
                  {"scale": float(attrs["scale"]), "H": H, "K": K, "V": V, "BK": r["BK"], "BV": r["BV"], "HAS_H0": True}
                  | ({"VARLEN": True, "SPLIT": split} if varlen else DENSE),
                  grid=lambda x, BV=r["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=lambda x: {"T": t_arg(x)},
                  num_warps=r["num_warps"], num_stages=r["num_stages"])


def chunked_launches(d: dict, dtypes: list[str], attrs: dict, *, varlen: bool,
                     split: int) -> tuple[Launch, Launch, tuple[Buffer, ...]]:
    """The chunked pair (intra, state) and their workspace. varlen: packed ports plus cu_seqlens, slots, running
    only the sequences of > `split` rows; programs past a sequence's chunks return at once (the chunk grid is
    sized for the longest possible sequence, N rows)."""
    B, H, K, V = d["B"], d["H"], d["K"], d["V"]
    t_hint, t_arg, tokens, h0 = _layout(d, varlen)
    c = kda_chunk_launch_config(B, max(t_hint, RECURRENT_MAX_T + 1), H, K, V, attrs.get("state_entry"))
    dot_bf16 = dtypes[0] == "bf16"
    idt = "bf16" if dot_bf16 else "fp32"  # dtype of the intermediates
    nt = lambda x: cdiv(t_arg(x), BT)  # noqa: E731
    rows = lambda n: (lambda x: tokens(x) * H * n)  # noqa: E731
    gl_rows = tokens if varlen else (lambda x: x["B"] * nt(x))  # varlen: gl indexed by each chunk's first row
    ws = (Buffer("w", idt, rows(K)), Buffer("u", idt, rows(V)), Buffer("qg", idt, rows(K)),
          Buffer("kg", idt, rows(K)), Buffer("A", idt, rows(BT)), Buffer("gl", "fp32", lambda x: gl_rows(x) * H * K))
    ci, cs = c["intra"], c["state"]
    sizes = lambda x: {"T": t_arg(x), "NT": nt(x)}  # noqa: E731
    mode = {"VARLEN": True, "SPLIT": split} if varlen else DENSE
    intra = Launch(_kda_intra_kernel, ("q", "k", "v", "g", "beta", *(("cu_seqlens",) if varlen else ()),
                                       "w", "u", "qg", "kg", "A", "gl", "T", "NT"),
                   {"scale": float(attrs["scale"]), "H": H, "K": K, "V": V, "BT": BT, "BC": BC, "BK": ci["BK"],
                    "BV": ci["BV"], "DOT_BF16": dot_bf16, "SAFE_GATE": safe_gate(attrs.get("gate_lower_bound"))}
                   | {k: v for k, v in mode.items() if k != "slots"},
                   grid=lambda x: (nt(x), x["B"] * H, 1), scalars=sizes,
                   num_warps=ci["num_warps"], num_stages=ci["num_stages"])
    state = Launch(_kda_state_kernel, ("w", "u", "qg", "kg", "A", "gl", *h0, "o", "final_state", "T", "NT"),
                   {"H": H, "K": K, "V": V, "BT": BT, "BK": cs["BK"], "BV": cs["BV"], "DOT_BF16": dot_bf16,
                    "HAS_H0": True} | mode,
                   grid=lambda x, BV=cs["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=sizes,
                   num_warps=cs["num_warps"], num_stages=cs["num_stages"])
    return intra, state, ws


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"kda: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} do not match")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"kda: initial_state {tuple(initial_state.shape)}, expected {(B, H, K, v.shape[-1])}")


def _run(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, h0: Tensor | None,
         ht: Tensor | None, chunked: bool, gate_lower_bound: float | None = None,
         state_entry: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Execute `plan`'s recurrent or chunked variant on torch tensors: (o, final_state); ht may alias h0
    (in-place decode)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = q.new_zeros(B, H, K, V, dtype=torch.float32) if h0 is None else h0.float().contiguous()
    ht = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if ht is None else ht
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    d = dims([q.shape, k.shape, v.shape])
    p = plan(d, [dtype_name(q.dtype)], {"scale": scale, "gate_lower_bound": gate_lower_bound,
                                        "state_entry": state_entry})
    wanted = p.variants[1 if chunked else 0]
    run(Plan((Variant(wanted.name, wanted.launches),), p.workspace),
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0, "o": o, "final_state": ht}, d)
    return o, ht


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                initial_state: Tensor | None = None, chunk_size: int = 64,
                gate_lower_bound: float | None = None,
                state_entry: tuple[int, int, int] | None = None) -> tuple[Tensor, Tensor]:
    """Chunked prefill. `gate_lower_bound`: the caller's promise that g >= it everywhere (K3: -5); with a bound
    of at least -SPAN_MAX/16 the intra kernel is the one compiled without the unbounded-gate fallback.
    `state_entry`: the state kernel's launch entry (None: chosen from its resources)."""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size != BT:
        raise ValueError(f"kda_chunked (triton): chunk_size={chunk_size}, only {BT} is implemented")
    K, V = q.shape[-1], v.shape[-1]
    lo, hi = KERNEL_HEAD_DIM
    if not (lo <= K <= hi and lo <= V <= hi):
        raise ValueError(f"kda_chunked (triton): needs {lo} <= K, V <= {hi}, got K={K}, V={V}")
    return _run(q, k, v, g, beta, scale, initial_state, None, True, gate_lower_bound, state_entry)


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check(q, k, v, g, beta, initial_state)
    return _run(q, k, v, g, beta, scale, initial_state, None, False)


def kda_recurrent_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                   scale: float | None = None) -> Tensor:
    """Decode step(s) updating `state` [B, H, K, V] (contiguous fp32) in place; returns o [B, T, H, V].

    Each program reads its state slice before writing it, so input and output may alias."""
    _check(q, k, v, g, beta, state)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"kda_recurrent_: state must be contiguous fp32, got {state.dtype}")
    return _run(q, k, v, g, beta, scale, state, state, False)[0]


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
        initial_state: Tensor | None = None, gate_lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """The plan's variant for this T: recurrent kernel for T <= RECURRENT_MAX_T (decode, short appends),
    chunked kernels above (the bounded-gate intra kernel when `gate_lower_bound` allows it)."""
    if q.shape[1] <= RECURRENT_MAX_T:
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state, gate_lower_bound=gate_lower_bound)
