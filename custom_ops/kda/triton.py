"""Kimi Delta Attention, Triton kernels, their launch plan and launchers (forward only). Never imports
`reference.py`.

Same functions and contract as `reference.py`:
    q, k  [B, T, H, K]  L2-normalised;  v [B, T, H, V];  g [B, T, H, K] log-decay (<= 0);  beta [B, T, H]
    initial_state [B, H, K, V] fp32 (zeros when None).  Returns (o [B, T, H, V] in v's dtype,
    final_state [B, H, K, V] fp32).  Any T >= 1, any H; 16 <= K, V <= 256 for the chunked path.

Chunked prefill (docs/model.md §2.4), two kernels:
  1. `_kda_intra_kernel`, grid (NT, B*H), one 64-token chunk split into four 16-token sub-chunks.
     Within-chunk cumulative decay Γ by `tl.cumsum`.  Score blocks A[r, c] = Σ_d x_r k_c e^{Γ_r − Γ_c}
     (x = k for L, x = q for A^qk) are dense `tl.dot`s after factorising e^{Γ_r − Γ_c} =
     e^{Γ_r − R_i} · e^{R_i − Γ_c} with ONE reference R_i per row sub-chunk i: the cumulative decay just
     before its first row.  Row factors are <= 1; column factors are <= 1 for earlier sub-chunks and
     <= e^{span_i} on the diagonal block, span_i = −Σ_{rows of i} g <= 16·5 = 80 for K3's gate >= −5
     (finite in fp32 and bf16, whose max is e^88.7).  So the 16×16 diagonal blocks use the same dense
     dot as the off-diagonal ones.  Unbounded gates (Kimi Linear): the kernel checks span_i per
     (sub-chunk, K-block) at run time and, only where it exceeds 80, computes that diagonal block
     pairwise with exponents min(Γ_r − Γ_c, 0) — exact for any g <= 0, never clamped, and a branch K3
     never takes.  Then the UT transform (I + Diag(β) L)^{-1} Diag(β): forward substitution on the four
     16×16 diagonal blocks and block back-substitution for the six off-diagonal ones (fp32, "ieee"
     dots), W = T (k e^Γ), U = T v, and the chunk's q e^Γ (scaled), k e^{Γ_C − Γ}, e^{Γ_C}, A^qk.
  2. `_kda_state_kernel`, grid (V/BV, B*H), sequential over chunks with the fp32 state in registers:
     V' = U − W S;  O = (q e^Γ) S + A^qk V';  S ← e^{Γ_C} ⊙ S + (k e^{Γ_C − Γ})ᵀ V'.  The output is
     fused into the state pass, so the per-chunk states h are never written to memory.
Matmul operands are bf16 (fp32 accumulation) when the inputs are bf16, as in fla; otherwise fp32 with
input_precision="ieee" (exact-ish, slow: for tests and fp16/fp32 callers).

Recurrent decode (docs/model.md §2.1): `_kda_recurrent_kernel`, grid (V/BV, B*H), the [K, BV] state slice in
registers, token loop inside.  `kda_recurrent_` updates a state buffer in place (decode step).
`kda` picks recurrent for T <= RECURRENT_MAX_T, chunked above.

Launch parameters are pure functions of the shapes (`kda_chunk_launch_config`,
`kda_recurrent_launch_config`), gathered in one `plan` (custom_ops/launch.py) that the torch launchers below
run with Triton's JIT and the TensorRT plugin runs from cubins compiled ahead of time.
No autotune, no block pointers; kernel arguments are tensors, then scalars, then constexprs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dtypes import dtype_name
from ..launch import Buffer, Launch, Plan, Variant, cdiv, run
from .op import KERNEL_HEAD_DIM

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
def _diag_pairwise(x, k, G, BC: tl.constexpr):
    """Σ_d x_r[d] k_c[d] exp(min(Γ_r[d] − Γ_c[d], 0)) for one 16×16 diagonal block, row by row.

    x, k, G [BC, BK] fp32 -> [BC, BC].  Used only where the factorised form could overflow.
    """
    o = tl.arange(0, BC)
    acc = tl.zeros([BC, BC], dtype=tl.float32)
    for r in range(BC):
        sel = o[:, None] == r
        x_r = tl.sum(tl.where(sel, x, 0.0), 0)  # [BK]
        G_r = tl.sum(tl.where(sel, G, 0.0), 0)  # [BK]
        e = tl.exp(tl.minimum(G_r[None, :] - G, 0.0))  # [BC(c), BK]
        col = tl.sum(k * e * x_r[None, :], 1)  # [BC(c)]
        acc = tl.where(sel, col[None, :], acc)
    return acc


@triton.jit
def _inv_unit_lower(L, BC: tl.constexpr):
    """(I + L)^{-1} for a strictly lower-triangular fp32 [BC, BC] block, by forward substitution."""
    o = tl.arange(0, BC)
    Y = -L  # Y = X − I; row i is final once processed
    for i in range(1, BC):
        sel = o[:, None] == i
        a = tl.sum(tl.where(sel, Y, 0.0), 0)  # row i of −L (a_j = 0 for j >= i)
        a = a + tl.sum(a[:, None] * Y, 0)
        Y = tl.where(sel, a[None, :], Y)
    return Y + (o[:, None] == o[None, :]).to(tl.float32)


@triton.jit
def _scores(kr, qr, kc, kd, qd, Gd, span, Akk, Aqk, IS_DIAG: tl.constexpr, BC: tl.constexpr,
            DOT_BF16: tl.constexpr):
    """Accumulate one (row sub-chunk, column sub-chunk, K-block) contribution to L and A^qk."""
    kct = tl.trans(kc)
    if IS_DIAG:
        if span <= SPAN_MAX:  # factorised form is finite
            Akk = _mma(kr, kct, Akk, DOT_BF16)
            Aqk = _mma(qr, kct, Aqk, DOT_BF16)
        else:  # unbounded gate: pairwise exponents, each factor <= 1
            Akk += _diag_pairwise(kd, kd, Gd, BC)
            Aqk += _diag_pairwise(qd, kd, Gd, BC)
    else:
        Akk = _mma(kr, kct, Akk, DOT_BF16)
        Aqk = _mma(qr, kct, Aqk, DOT_BF16)
    return Akk, Aqk


@triton.jit
def _load_sub(ptr, rows, o_k, m_k, T, STRIDE: tl.constexpr):
    """[BC, BK] fp32 tile of rows `rows` (masked past T) and channels o_k."""
    m = (rows < T)[:, None] & m_k[None, :]
    return tl.load(ptr + rows[:, None].to(tl.int64) * STRIDE + o_k[None, :], mask=m, other=0.0).to(tl.float32)


@triton.jit
def _store_sub(ptr, x, rows, o_k, m_k, T, STRIDE: tl.constexpr):
    m = (rows < T)[:, None] & m_k[None, :]
    tl.store(ptr + rows[:, None].to(tl.int64) * STRIDE + o_k[None, :], x.to(ptr.dtype.element_ty), mask=m)


@triton.jit
def _kda_intra_kernel(
    q, k, v, g, beta,  # inputs [B, T, H, K|V], beta [B, T, H]
    w, u, qg, kg, A, gl,  # outputs [B, T, H, K], [B, T, H, V], [B, T, H, K] ×2, [B, T, H, BT], [B, NT, H, K] fp32
    T, NT,
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, DOT_BF16: tl.constexpr,
):
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0 = i_b.to(tl.int64) * T  # first token of this sequence in the flattened [B*T] axis
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
    gl += ((i_b.to(tl.int64) * NT + i_t) * H + i_h) * K

    o_i = tl.arange(0, BC)
    r0 = i_t * BT + o_i  # rows of the four sub-chunks
    r1 = r0 + BC
    r2 = r0 + 2 * BC
    r3 = r0 + 3 * BC
    b0 = tl.load(beta + r0.to(tl.int64) * H, mask=r0 < T, other=0.0).to(tl.float32)
    b1 = tl.load(beta + r1.to(tl.int64) * H, mask=r1 < T, other=0.0).to(tl.float32)
    b2 = tl.load(beta + r2.to(tl.int64) * H, mask=r2 < T, other=0.0).to(tl.float32)
    b3 = tl.load(beta + r3.to(tl.int64) * H, mask=r3 < T, other=0.0).to(tl.float32)

    # ---- 1. score blocks L_ij (unscaled by β) and A^qk_ij, accumulated over K-blocks: [BC, BC] fp32 each
    L00 = tl.zeros([BC, BC], dtype=tl.float32)
    L10 = tl.zeros([BC, BC], dtype=tl.float32)
    L11 = tl.zeros([BC, BC], dtype=tl.float32)
    L20 = tl.zeros([BC, BC], dtype=tl.float32)
    L21 = tl.zeros([BC, BC], dtype=tl.float32)
    L22 = tl.zeros([BC, BC], dtype=tl.float32)
    L30 = tl.zeros([BC, BC], dtype=tl.float32)
    L31 = tl.zeros([BC, BC], dtype=tl.float32)
    L32 = tl.zeros([BC, BC], dtype=tl.float32)
    L33 = tl.zeros([BC, BC], dtype=tl.float32)
    Q00 = tl.zeros([BC, BC], dtype=tl.float32)
    Q10 = tl.zeros([BC, BC], dtype=tl.float32)
    Q11 = tl.zeros([BC, BC], dtype=tl.float32)
    Q20 = tl.zeros([BC, BC], dtype=tl.float32)
    Q21 = tl.zeros([BC, BC], dtype=tl.float32)
    Q22 = tl.zeros([BC, BC], dtype=tl.float32)
    Q30 = tl.zeros([BC, BC], dtype=tl.float32)
    Q31 = tl.zeros([BC, BC], dtype=tl.float32)
    Q32 = tl.zeros([BC, BC], dtype=tl.float32)
    Q33 = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        k0 = _load_sub(k, r0, o_k, m_k, T, H * K)
        k1 = _load_sub(k, r1, o_k, m_k, T, H * K)
        k2 = _load_sub(k, r2, o_k, m_k, T, H * K)
        k3 = _load_sub(k, r3, o_k, m_k, T, H * K)
        q0 = _load_sub(q, r0, o_k, m_k, T, H * K) * scale
        q1 = _load_sub(q, r1, o_k, m_k, T, H * K) * scale
        q2 = _load_sub(q, r2, o_k, m_k, T, H * K) * scale
        q3 = _load_sub(q, r3, o_k, m_k, T, H * K) * scale
        g0 = _load_sub(g, r0, o_k, m_k, T, H * K)
        g1 = _load_sub(g, r1, o_k, m_k, T, H * K)
        g2 = _load_sub(g, r2, o_k, m_k, T, H * K)
        g3 = _load_sub(g, r3, o_k, m_k, T, H * K)
        # Γ (within-chunk cumulative decay) and the references R_i = Γ before sub-chunk i: [BK]
        R1 = tl.sum(g0, 0)
        R2 = R1 + tl.sum(g1, 0)
        R3 = R2 + tl.sum(g2, 0)
        RC = R3 + tl.sum(g3, 0)
        G0 = tl.cumsum(g0, 0)
        G1 = tl.cumsum(g1, 0) + R1[None, :]
        G2 = tl.cumsum(g2, 0) + R2[None, :]
        G3 = tl.cumsum(g3, 0) + R3[None, :]
        # row factors e^{Γ_r − R_i} <= 1
        f0 = tl.exp(G0)
        f1 = tl.exp(G1 - R1[None, :])
        f2 = tl.exp(G2 - R2[None, :])
        f3 = tl.exp(G3 - R3[None, :])
        # spans of the diagonal blocks (largest column factor exponent)
        s0 = tl.max(-R1, 0)
        s1 = tl.max(R1 - R2, 0)
        s2 = tl.max(R2 - R3, 0)
        s3 = tl.max(R3 - RC, 0)
        # row sub-chunk 0
        L00, Q00 = _scores(k0 * f0, q0 * f0, k0 * tl.exp(tl.minimum(-G0, SPAN_MAX)), k0, q0, G0, s0, L00, Q00,
                           True, BC, DOT_BF16)
        # row sub-chunk 1, reference R1
        kr, qr = k1 * f1, q1 * f1
        L10, Q10 = _scores(kr, qr, k0 * tl.exp(R1[None, :] - G0), k0, q0, G0, s1, L10, Q10, False, BC, DOT_BF16)
        L11, Q11 = _scores(kr, qr, k1 * tl.exp(tl.minimum(R1[None, :] - G1, SPAN_MAX)), k1, q1, G1, s1, L11, Q11,
                           True, BC, DOT_BF16)
        # row sub-chunk 2, reference R2
        kr, qr = k2 * f2, q2 * f2
        L20, Q20 = _scores(kr, qr, k0 * tl.exp(R2[None, :] - G0), k0, q0, G0, s2, L20, Q20, False, BC, DOT_BF16)
        L21, Q21 = _scores(kr, qr, k1 * tl.exp(R2[None, :] - G1), k1, q1, G1, s2, L21, Q21, False, BC, DOT_BF16)
        L22, Q22 = _scores(kr, qr, k2 * tl.exp(tl.minimum(R2[None, :] - G2, SPAN_MAX)), k2, q2, G2, s2, L22, Q22,
                           True, BC, DOT_BF16)
        # row sub-chunk 3, reference R3
        kr, qr = k3 * f3, q3 * f3
        L30, Q30 = _scores(kr, qr, k0 * tl.exp(R3[None, :] - G0), k0, q0, G0, s3, L30, Q30, False, BC, DOT_BF16)
        L31, Q31 = _scores(kr, qr, k1 * tl.exp(R3[None, :] - G1), k1, q1, G1, s3, L31, Q31, False, BC, DOT_BF16)
        L32, Q32 = _scores(kr, qr, k2 * tl.exp(R3[None, :] - G2), k2, q2, G2, s3, L32, Q32, False, BC, DOT_BF16)
        L33, Q33 = _scores(kr, qr, k3 * tl.exp(tl.minimum(R3[None, :] - G3, SPAN_MAX)), k3, q3, G3, s3, L33, Q33,
                           True, BC, DOT_BF16)

    # ---- 2. A^qk (causal incl. diagonal) -> A [.., BT]; upper blocks stored as zeros
    incl = o_i[:, None] >= o_i[None, :]
    strict = o_i[:, None] > o_i[None, :]
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    m_all = o_i < BC
    _store_sub(A, tl.where(incl, Q00, 0.0), r0, o_i, m_all, T, H * BT)
    _store_sub(A + BC, zero, r0, o_i, m_all, T, H * BT)
    _store_sub(A + 2 * BC, zero, r0, o_i, m_all, T, H * BT)
    _store_sub(A + 3 * BC, zero, r0, o_i, m_all, T, H * BT)
    _store_sub(A, Q10, r1, o_i, m_all, T, H * BT)
    _store_sub(A + BC, tl.where(incl, Q11, 0.0), r1, o_i, m_all, T, H * BT)
    _store_sub(A + 2 * BC, zero, r1, o_i, m_all, T, H * BT)
    _store_sub(A + 3 * BC, zero, r1, o_i, m_all, T, H * BT)
    _store_sub(A, Q20, r2, o_i, m_all, T, H * BT)
    _store_sub(A + BC, Q21, r2, o_i, m_all, T, H * BT)
    _store_sub(A + 2 * BC, tl.where(incl, Q22, 0.0), r2, o_i, m_all, T, H * BT)
    _store_sub(A + 3 * BC, zero, r2, o_i, m_all, T, H * BT)
    _store_sub(A, Q30, r3, o_i, m_all, T, H * BT)
    _store_sub(A + BC, Q31, r3, o_i, m_all, T, H * BT)
    _store_sub(A + 2 * BC, Q32, r3, o_i, m_all, T, H * BT)
    _store_sub(A + 3 * BC, tl.where(incl, Q33, 0.0), r3, o_i, m_all, T, H * BT)

    # ---- 3. UT transform: X = (I + Diag(β) L)^{-1}, block lower-triangular, fp32
    X00 = _inv_unit_lower(tl.where(strict, L00 * b0[:, None], 0.0), BC)
    X11 = _inv_unit_lower(tl.where(strict, L11 * b1[:, None], 0.0), BC)
    X22 = _inv_unit_lower(tl.where(strict, L22 * b2[:, None], 0.0), BC)
    X33 = _inv_unit_lower(tl.where(strict, L33 * b3[:, None], 0.0), BC)
    L10 = L10 * b1[:, None]
    L20 = L20 * b2[:, None]
    L21 = L21 * b2[:, None]
    L30 = L30 * b3[:, None]
    L31 = L31 * b3[:, None]
    L32 = L32 * b3[:, None]
    X10 = -_dot32(X11, _dot32(L10, X00))
    X21 = -_dot32(X22, _dot32(L21, X11))
    X20 = -_dot32(X22, _dot32(L20, X00) + _dot32(L21, X10))
    X32 = -_dot32(X33, _dot32(L32, X22))
    X31 = -_dot32(X33, _dot32(L31, X11) + _dot32(L32, X21))
    X30 = -_dot32(X33, _dot32(L30, X00) + _dot32(L31, X10) + _dot32(L32, X20))

    # ---- 4. W = X (β k e^Γ), q e^Γ, k e^{Γ_C − Γ}, e^{Γ_C}, per K-block
    for i_k in range(0, tl.cdiv(K, BK)):
        o_k = i_k * BK + tl.arange(0, BK)
        m_k = o_k < K
        g0 = _load_sub(g, r0, o_k, m_k, T, H * K)
        g1 = _load_sub(g, r1, o_k, m_k, T, H * K)
        g2 = _load_sub(g, r2, o_k, m_k, T, H * K)
        g3 = _load_sub(g, r3, o_k, m_k, T, H * K)
        R1 = tl.sum(g0, 0)
        R2 = R1 + tl.sum(g1, 0)
        R3 = R2 + tl.sum(g2, 0)
        RC = R3 + tl.sum(g3, 0)
        G0 = tl.cumsum(g0, 0)
        G1 = tl.cumsum(g1, 0) + R1[None, :]
        G2 = tl.cumsum(g2, 0) + R2[None, :]
        G3 = tl.cumsum(g3, 0) + R3[None, :]
        tl.store(gl + o_k, tl.exp(RC), mask=m_k)
        k0 = _load_sub(k, r0, o_k, m_k, T, H * K)
        k1 = _load_sub(k, r1, o_k, m_k, T, H * K)
        k2 = _load_sub(k, r2, o_k, m_k, T, H * K)
        k3 = _load_sub(k, r3, o_k, m_k, T, H * K)
        _store_sub(kg, k0 * tl.exp(RC[None, :] - G0), r0, o_k, m_k, T, H * K)
        _store_sub(kg, k1 * tl.exp(RC[None, :] - G1), r1, o_k, m_k, T, H * K)
        _store_sub(kg, k2 * tl.exp(RC[None, :] - G2), r2, o_k, m_k, T, H * K)
        _store_sub(kg, k3 * tl.exp(RC[None, :] - G3), r3, o_k, m_k, T, H * K)
        kb0 = k0 * tl.exp(G0) * b0[:, None]
        kb1 = k1 * tl.exp(G1) * b1[:, None]
        kb2 = k2 * tl.exp(G2) * b2[:, None]
        kb3 = k3 * tl.exp(G3) * b3[:, None]
        acc = tl.zeros([BC, BK], dtype=tl.float32)
        _store_sub(w, _mma(X00, kb0, acc, DOT_BF16), r0, o_k, m_k, T, H * K)
        _store_sub(w, _mma(X11, kb1, _mma(X10, kb0, acc, DOT_BF16), DOT_BF16), r1, o_k, m_k, T, H * K)
        _store_sub(w, _mma(X22, kb2, _mma(X21, kb1, _mma(X20, kb0, acc, DOT_BF16), DOT_BF16), DOT_BF16),
                   r2, o_k, m_k, T, H * K)
        _store_sub(w, _mma(X33, kb3, _mma(X32, kb2, _mma(X31, kb1, _mma(X30, kb0, acc, DOT_BF16), DOT_BF16),
                                          DOT_BF16), DOT_BF16), r3, o_k, m_k, T, H * K)
        _store_sub(qg, _load_sub(q, r0, o_k, m_k, T, H * K) * scale * tl.exp(G0), r0, o_k, m_k, T, H * K)
        _store_sub(qg, _load_sub(q, r1, o_k, m_k, T, H * K) * scale * tl.exp(G1), r1, o_k, m_k, T, H * K)
        _store_sub(qg, _load_sub(q, r2, o_k, m_k, T, H * K) * scale * tl.exp(G2), r2, o_k, m_k, T, H * K)
        _store_sub(qg, _load_sub(q, r3, o_k, m_k, T, H * K) * scale * tl.exp(G3), r3, o_k, m_k, T, H * K)

    # ---- 5. U = X (β v), per V-block
    for i_v in range(0, tl.cdiv(V, BV)):
        o_v = i_v * BV + tl.arange(0, BV)
        m_v = o_v < V
        vb0 = _load_sub(v, r0, o_v, m_v, T, H * V) * b0[:, None]
        vb1 = _load_sub(v, r1, o_v, m_v, T, H * V) * b1[:, None]
        vb2 = _load_sub(v, r2, o_v, m_v, T, H * V) * b2[:, None]
        vb3 = _load_sub(v, r3, o_v, m_v, T, H * V) * b3[:, None]
        acc = tl.zeros([BC, BV], dtype=tl.float32)
        _store_sub(u, _mma(X00, vb0, acc, DOT_BF16), r0, o_v, m_v, T, H * V)
        _store_sub(u, _mma(X11, vb1, _mma(X10, vb0, acc, DOT_BF16), DOT_BF16), r1, o_v, m_v, T, H * V)
        _store_sub(u, _mma(X22, vb2, _mma(X21, vb1, _mma(X20, vb0, acc, DOT_BF16), DOT_BF16), DOT_BF16),
                   r2, o_v, m_v, T, H * V)
        _store_sub(u, _mma(X33, vb3, _mma(X32, vb2, _mma(X31, vb1, _mma(X30, vb0, acc, DOT_BF16), DOT_BF16),
                                          DOT_BF16), DOT_BF16), r3, o_v, m_v, T, H * V)


@triton.jit
def _kda_state_kernel(
    w, u, qg, kg, A, gl, h0,  # from the intra kernel; h0 [B, H, K, V] fp32 (ignored unless HAS_H0)
    o, ht,  # outputs [B, T, H, V], [B, H, K, V] fp32
    T, NT,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    DOT_BF16: tl.constexpr, HAS_H0: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0 = i_b.to(tl.int64) * T
    w += (tok0 * H + i_h) * K
    qg += (tok0 * H + i_h) * K
    kg += (tok0 * H + i_h) * K
    u += (tok0 * H + i_h) * V
    o += (tok0 * H + i_h) * V
    A += (tok0 * H + i_h) * BT
    gl += (i_b.to(tl.int64) * NT * H + i_h) * K
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    o_t = tl.arange(0, BT)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)  # state slice [K, BV]
    if HAS_H0:
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
        b_gl = tl.load(gl + i_t * H * K + o_k, mask=m_k, other=0.0)
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
    T,
    o, ht,  # [B, T, H, V], [B, H, K, V] fp32
    scale,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    HAS_H0: tl.constexpr,
):
    i_v, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h = i_bh // H, i_bh % H
    tok0 = i_b.to(tl.int64) * T
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_s = m_k[:, None] & m_v[None, :]
    p_s = i_bh.to(tl.int64) * K * V + o_k[:, None] * V + o_v[None, :]
    S = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
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


def kda_chunk_launch_config(B: int, T: int, H: int, K: int, V: int) -> dict:
    """Block sizes and warps of the two chunked kernels (pure function of the shapes).

    AOT compilers: give pointers and the K/V-sized int arguments `tt.divisibility=16` as the JIT does
    for such values; without it loads are not vectorised and the state kernel spills."""
    BK_state = _np2(K)
    # state slice [K, BV] fp32 in registers: 64 columns up to K=128, 32 beyond; smaller if B*H is tiny
    BV_state = min(_np2(V), 64 if K <= 128 else 32)
    if B * H * triton.cdiv(V, BV_state) < 264 and BV_state > 16:  # < 2 programs per SM (132 SMs)
        BV_state //= 2
    return {
        # BK=16 / 8 warps: the least register spilling on sm_90 (ptxas -v) for 12 [16, BK] tiles + 20 [16, 16] blocks
        "intra": {"BK": 16, "BV": min(64, _np2(V)), "num_warps": 8, "num_stages": 1},
        "state": {"BK": BK_state, "BV": BV_state, "num_warps": 8 if BK_state * BV_state >= 8192 else 4,
                  "num_stages": 2},
    }


def kda_recurrent_launch_config(B: int, T: int, H: int, K: int, V: int) -> dict:
    """Block sizes of the recurrent kernel: enough programs to fill the GPU even at B=1."""
    BK = _np2(K)
    BV = min(_np2(V), 64)
    while BV > 16 and B * H * triton.cdiv(V, BV) < 1024:
        BV //= 2
    return {"BK": BK, "BV": BV, "num_warps": 4 if BK * BV >= 4096 else 2, "num_stages": 1}


def dims(shapes) -> dict:
    """Named dims from the input shapes (q, k, v, g, beta, initial_state)."""
    (B, T, H, K), v = shapes[0], shapes[2]
    return {"B": B, "T": T, "H": H, "K": K, "V": v[3]}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The launches of k3::kda at dims `d` (block sizes chosen there; grids follow the runtime B and T):
    variant "recurrent" for T <= RECURRENT_MAX_T (one kernel), "chunked" above (intra + state kernels, their
    intermediates w, u, qg, kg, A, gl in the workspace). `dtypes` are the port dtypes (q first); `scale` is
    specialised into the code. Ports: q, k, v, g, beta, initial_state -> o, final_state."""
    B, T, H, K, V = d["B"], d["T"], d["H"], d["K"], d["V"]
    scale = float(attrs["scale"])
    r = kda_recurrent_launch_config(B, max(T, 1), H, K, V)
    recurrent = Launch(_kda_recurrent_kernel, ("q", "k", "v", "g", "beta", "initial_state", "T", "o", "final_state"),
                       {"scale": scale, "H": H, "K": K, "V": V, "BK": r["BK"], "BV": r["BV"], "HAS_H0": True},
                       grid=lambda x, BV=r["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=lambda x: {"T": x["T"]},
                       num_warps=r["num_warps"], num_stages=r["num_stages"])
    c = kda_chunk_launch_config(B, max(T, RECURRENT_MAX_T + 1), H, K, V)
    dot_bf16 = dtypes[0] == "bf16"
    idt = "bf16" if dot_bf16 else "fp32"  # dtype of the intermediates
    nt = lambda x: cdiv(x["T"], BT)  # noqa: E731
    rows = lambda n: (lambda x: x["B"] * x["T"] * H * n)  # noqa: E731
    ws = (Buffer("w", idt, rows(K)), Buffer("u", idt, rows(V)), Buffer("qg", idt, rows(K)),
          Buffer("kg", idt, rows(K)), Buffer("A", idt, rows(BT)), Buffer("gl", "fp32", lambda x: x["B"] * nt(x) * H * K))
    ci, cs = c["intra"], c["state"]
    sizes = lambda x: {"T": x["T"], "NT": nt(x)}  # noqa: E731
    intra = Launch(_kda_intra_kernel, ("q", "k", "v", "g", "beta", "w", "u", "qg", "kg", "A", "gl", "T", "NT"),
                   {"scale": scale, "H": H, "K": K, "V": V, "BT": BT, "BC": BC, "BK": ci["BK"], "BV": ci["BV"],
                    "DOT_BF16": dot_bf16},
                   grid=lambda x: (nt(x), x["B"] * H, 1), scalars=sizes,
                   num_warps=ci["num_warps"], num_stages=ci["num_stages"])
    state = Launch(_kda_state_kernel, ("w", "u", "qg", "kg", "A", "gl", "initial_state", "o", "final_state", "T",
                                       "NT"),
                   {"H": H, "K": K, "V": V, "BT": BT, "BK": cs["BK"], "BV": cs["BV"], "DOT_BF16": dot_bf16,
                    "HAS_H0": True},
                   grid=lambda x, BV=cs["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=sizes,
                   num_warps=cs["num_warps"], num_stages=cs["num_stages"])
    return Plan((Variant("recurrent", (recurrent,), when=lambda x: x["T"] <= RECURRENT_MAX_T),
                 Variant("chunked", (intra, state), when=lambda x: x["T"] > RECURRENT_MAX_T)), workspace=ws)


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    B, T, H, K = q.shape
    if k.shape != q.shape or g.shape != q.shape or v.shape[:3] != (B, T, H) or beta.shape != (B, T, H):
        raise ValueError(f"kda: shapes q {tuple(q.shape)} k {tuple(k.shape)} v {tuple(v.shape)} "
                         f"g {tuple(g.shape)} beta {tuple(beta.shape)} do not match")
    if initial_state is not None and initial_state.shape != (B, H, K, v.shape[-1]):
        raise ValueError(f"kda: initial_state {tuple(initial_state.shape)}, expected {(B, H, K, v.shape[-1])}")


def _run(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None, h0: Tensor | None,
         ht: Tensor | None, variant: str) -> tuple[Tensor, Tensor]:
    """Execute `plan`'s `variant` on torch tensors: (o, final_state); ht may alias h0 (in-place decode)."""
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    h0 = q.new_zeros(B, H, K, V, dtype=torch.float32) if h0 is None else h0.float().contiguous()
    ht = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32) if ht is None else ht
    o = torch.empty(B, T, H, V, device=q.device, dtype=v.dtype)
    d = dims([q.shape, k.shape, v.shape])
    p = plan(d, [dtype_name(q.dtype)], {"scale": scale})
    wanted = next(x for x in p.variants if x.name == variant)
    run(Plan((Variant(variant, wanted.launches),), p.workspace),
        {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0, "o": o, "final_state": ht}, d)
    return o, ht


def kda_chunked(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                initial_state: Tensor | None = None, chunk_size: int = 64) -> tuple[Tensor, Tensor]:
    _check(q, k, v, g, beta, initial_state)
    if chunk_size != BT:
        raise ValueError(f"kda_chunked (triton): chunk_size={chunk_size}, only {BT} is implemented")
    K, V = q.shape[-1], v.shape[-1]
    lo, hi = KERNEL_HEAD_DIM
    if not (lo <= K <= hi and lo <= V <= hi):
        raise ValueError(f"kda_chunked (triton): needs {lo} <= K, V <= {hi}, got K={K}, V={V}")
    return _run(q, k, v, g, beta, scale, initial_state, None, "chunked")


def kda_recurrent(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
                  initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    _check(q, k, v, g, beta, initial_state)
    return _run(q, k, v, g, beta, scale, initial_state, None, "recurrent")


def kda_recurrent_(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state: Tensor,
                   scale: float | None = None) -> Tensor:
    """Decode step(s) updating `state` [B, H, K, V] (contiguous fp32) in place; returns o [B, T, H, V].

    Each program reads its state slice before writing it, so input and output may alias."""
    _check(q, k, v, g, beta, state)
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise ValueError(f"kda_recurrent_: state must be contiguous fp32, got {state.dtype}")
    return _run(q, k, v, g, beta, scale, state, state, "recurrent")[0]


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float | None = None,
        initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The plan's variant for this T: recurrent kernel for T <= RECURRENT_MAX_T (decode, short appends),
    chunked kernels above."""
    if q.shape[1] <= RECURRENT_MAX_T:
        return kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state)
