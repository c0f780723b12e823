"""k3::kda_prep, Triton: the KDA layer's pre-recurrence over packed sequences in one kernel, its launch plan and
the torch launcher. Never imports `reference.py`.

`_kda_prep_kernel`, grid (cdiv(N, ROWS) + B, H): the first index p says what a program does (uniform per
program), the second is its head h, whose q, k and v channels it owns (heads share no channel).
  p < cdiv(N, ROWS): rows p·ROWS .. p·ROWS + ROWS-1 of the step. Each row finds its sequence b by counting the
    sequence ends cu_seqlens[1..B] <= row (B in blocks of SEQ_BLOCK; an empty sequence owns no row), then its
    local position t and pool row slots[b]. Per channel, tap i of the short conv reads local position
    t - (W-1) + i: this step's row at >= 0, else conv_pool[slot, ch, t + i]. Then SiLU, q and k
    L2-normalised over K (eps 1e-6), the decay gate from f, A_log[h], dt_bias (K3's lb·σ(e^A (f + dt)) when
    GATE_LB != 0, Kimi Linear's −e^A·softplus(f + dt) otherwise) and β = σ(b).
  p >= cdiv(N, ROWS): sequence b = p - cdiv(N, ROWS): new_conv[b, ch, j] = its input at local position
    len_b - (W-1) + j, a row of this step, else conv_pool[slot, ch, len_b + j] (a sequence of fewer than W-1
    rows, or none, keeps its old state's last columns).
One launch (so QDP's aot_impl carries it too); no constexpr depends on N or B, so a plugin compiled at one
step runs any: the grid and the int32 scalars N, B follow the runtime dims. The pool is only read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import Launch, Plan, Variant, cdiv, run
from ..kda.op import KERNEL_HEAD_DIM

# Rows per program: [ROWS, K] fp32 tiles; neighbouring rows read the same conv taps (L1 hits). Compiled for
# sm_90a (triton 3.8, K = V = 128, W = 4, bf16, 4 warps): 156 registers, no spills.
ROWS = 16
SEQ_BLOCK = 32  # sequence ends compared per step of a row's search


@triton.jit
def _conv_rows(qkv, conv_pool, conv_w, row, t, slot, live, ch, m, C: tl.constexpr, W: tl.constexpr,
               ROWS: tl.constexpr, BC: tl.constexpr):
    """SiLU(causal conv) [ROWS, BC] fp32 of channels ch [BC] at rows `row` (local position t, pool row slot)."""
    y = tl.zeros([ROWS, BC], tl.float32)
    m2 = live[:, None] & m[None, :]
    for i in tl.static_range(W):
        p = t - (W - 1) + i  # [ROWS] the local position tap i reads
        x = tl.load(qkv + (row - (W - 1) + i)[:, None] * C + ch[None, :], mask=m2 & (p >= 0)[:, None], other=0.0)
        past = tl.load(conv_pool + (slot[:, None] * C + ch[None, :]) * (W - 1) + (t + i)[:, None],
                       mask=m2 & (p < 0)[:, None], other=0.0)
        w = tl.load(conv_w + ch * W + i, mask=m, other=0.0).to(tl.float32)
        y += (x.to(tl.float32) + past) * w[None, :]
    return y * tl.sigmoid(y)


@triton.jit
def _conv_tail(qkv, conv_pool, new_row, start, n, slot, ch, m, C: tl.constexpr, W: tl.constexpr,
               BW: tl.constexpr):
    """new_row[ch, :] = the last W-1 inputs of channels ch [BC] of a sequence of n rows from `start`."""
    j = tl.arange(0, BW)
    p = n - (W - 1) + j  # [BW] local position of column j
    mj = m[:, None] & (j < W - 1)[None, :]
    x = tl.load(qkv + (start + p).to(tl.int64)[None, :] * C + ch[:, None], mask=mj & (p >= 0)[None, :], other=0.0)
    past = tl.load(conv_pool + (slot * C + ch[:, None]) * (W - 1) + (n + j)[None, :], mask=mj & (p < 0)[None, :],
                   other=0.0)
    tl.store(new_row + ch[:, None] * (W - 1) + j[None, :], x.to(tl.float32) + past, mask=mj)


@triton.jit
def _kda_prep_kernel(  # arguments in TensorRT QDP order: inputs, int32 scalars, outputs
    qkv, f, b, conv_w, A_log, dt_bias, conv_pool, cu_seqlens, slots,
    N, B,
    q, k, v, g, beta, new_conv,
    GATE_LB: tl.constexpr, H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, W: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr, BW: tl.constexpr, ROWS: tl.constexpr, SEQ_BLOCK: tl.constexpr,
):
    C: tl.constexpr = 2 * H * K + H * V
    pid, h = tl.program_id(0), tl.program_id(1)
    o_k, o_v = tl.arange(0, BK), tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    ch_q, ch_k, ch_v = h * K + o_k, H * K + h * K + o_k, 2 * H * K + h * V + o_v
    blocks = tl.cdiv(N, ROWS)
    if pid < blocks:
        row = pid * ROWS + tl.arange(0, ROWS)
        live = row < N
        seq = tl.zeros([ROWS], tl.int32)
        for b0 in range(0, B, SEQ_BLOCK):  # sequence of a row = how many sequences end at or before it
            o_b = b0 + tl.arange(0, SEQ_BLOCK)
            ends = tl.load(cu_seqlens + 1 + o_b, mask=o_b < B, other=0)
            seq += tl.sum(((ends[None, :] <= row[:, None]) & (o_b < B)[None, :]).to(tl.int32), 1)
        seq = tl.where(live, seq, 0)  # rows past N: every sequence ends before them
        t = row - tl.load(cu_seqlens + seq)
        slot = tl.load(slots + seq).to(tl.int64)
        row = row.to(tl.int64)
        hb = row * H + h  # [ROWS] (row, head) index of the [N, H, *] outputs
        mk2, mv2 = live[:, None] & m_k[None, :], live[:, None] & m_v[None, :]
        x = _conv_rows(qkv, conv_pool, conv_w, row, t, slot, live, ch_q, m_k, C, W, ROWS, BK)
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        tl.store(q + hb[:, None] * K + o_k[None, :], x.to(q.dtype.element_ty), mask=mk2)
        x = _conv_rows(qkv, conv_pool, conv_w, row, t, slot, live, ch_k, m_k, C, W, ROWS, BK)
        x = x * tl.rsqrt(tl.sum(x * x, 1) + 1e-6)[:, None]
        tl.store(k + hb[:, None] * K + o_k[None, :], x.to(k.dtype.element_ty), mask=mk2)
        x = _conv_rows(qkv, conv_pool, conv_w, row, t, slot, live, ch_v, m_v, C, W, ROWS, BV)
        tl.store(v + hb[:, None] * V + o_v[None, :], x.to(v.dtype.element_ty), mask=mv2)
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        dtb = tl.load(dt_bias + h * K + o_k, mask=m_k, other=0.0).to(tl.float32)
        fx = tl.load(f + hb[:, None] * K + o_k[None, :], mask=mk2, other=0.0).to(tl.float32) + dtb[None, :]
        if GATE_LB != 0.0:
            gate = GATE_LB * tl.sigmoid(a * fx)
        else:  # softplus as torch computes it: linear past 20
            gate = -a * tl.where(fx > 20.0, fx, tl.log(1.0 + tl.exp(tl.minimum(fx, 20.0))))
        tl.store(g + hb[:, None] * K + o_k[None, :], gate, mask=mk2)
        tl.store(beta + hb, tl.sigmoid(tl.load(b + hb, mask=live, other=0.0).to(tl.float32)), mask=live)
    else:
        i_b = pid - blocks
        start = tl.load(cu_seqlens + i_b)
        n = tl.load(cu_seqlens + i_b + 1) - start
        slot_b = tl.load(slots + i_b).to(tl.int64)  # a scalar (the branches' names must keep their types)
        new_row = new_conv + i_b.to(tl.int64) * (C * (W - 1))
        _conv_tail(qkv, conv_pool, new_row, start, n, slot_b, ch_q, m_k, C, W, BW)
        _conv_tail(qkv, conv_pool, new_row, start, n, slot_b, ch_k, m_k, C, W, BW)
        _conv_tail(qkv, conv_pool, new_row, start, n, slot_b, ch_v, m_v, C, W, BW)


def dims(shapes) -> dict:
    """Named dims from the input shapes (qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots).
    Symbolic dims first in V's expression: QDP's shape expressions have no reflected `int * dim`."""
    (N, C), (_, H, K), W, B = shapes[0], shapes[1], shapes[3][1], shapes[8][0]
    return {"N": N, "B": B, "H": H, "K": K, "V": (C - H * K * 2) // H, "W": W}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The one launch of k3::kda_prep at dims `d` (N, B, H, K, V, W). Ports: qkv, f, b, conv_weight, A_log,
    dt_bias, conv_pool, cu_seqlens, slots -> q, k, v, g, beta, new_conv. N and B set only the grid and scalars."""
    H, K, V, W = d["H"], d["K"], d["V"], d["W"]
    np2 = triton.next_power_of_2
    launch = Launch(_kda_prep_kernel, (*_PORTS, "N", "B", *_OUTPUTS),
                    {"GATE_LB": float(attrs.get("gate_lower_bound") or 0.0), "H": H, "K": K, "V": V, "W": W,
                     "BK": np2(K), "BV": np2(V), "BW": np2(W), "ROWS": ROWS, "SEQ_BLOCK": SEQ_BLOCK},
                    grid=lambda x: (cdiv(x["N"], ROWS) + x["B"], H, 1), scalars=lambda x: {"N": x["N"], "B": x["B"]},
                    num_warps=4, num_stages=1)
    return Plan((Variant("fused", (launch,)),))


_PORTS = ("qkv", "f", "b", "conv_weight", "A_log", "dt_bias", "conv_pool", "cu_seqlens", "slots")
_OUTPUTS = ("q", "k", "v", "g", "beta", "new_conv")


def kda_prep(qkv: Tensor, f: Tensor, b: Tensor, conv_weight: Tensor, A_log: Tensor, dt_bias: Tensor,
             conv_pool: Tensor, cu_seqlens: Tensor, slots: Tensor, *,
             gate_lower_bound: float = 0.0) -> tuple[Tensor, ...]:
    """Run `plan` with Triton's JIT: (q, k [N, H, K], v [N, H, V] in qkv's dtype, g [N, H, K] fp32, beta [N, H]
    fp32, new_conv [B, C, W-1] fp32). cu_seqlens / slots are trusted (reading them would synchronise)."""
    N, C = qkv.shape
    _, H, K = f.shape
    V, W, B = (C - 2 * H * K) // H, conv_weight.shape[1], slots.shape[0]
    lo, hi = KERNEL_HEAD_DIM
    if not (lo <= K <= hi and lo <= V <= hi):
        raise ValueError(f"kda_prep (triton): needs {lo} <= K, V <= {hi}, got K={K}, V={V}")
    if C != 2 * H * K + H * V or tuple(conv_weight.shape) != (C, W) or tuple(conv_pool.shape[1:]) != (C, W - 1):
        raise ValueError(f"kda_prep (triton): qkv {tuple(qkv.shape)}, f {tuple(f.shape)}, conv_weight "
                         f"{tuple(conv_weight.shape)}, conv_pool {tuple(conv_pool.shape)} do not fit C = 2HK + HV")
    if conv_pool.dtype != torch.float32:
        raise ValueError(f"kda_prep (triton): conv_pool must be fp32, got {conv_pool.dtype}")
    ports = dict(zip(_PORTS, (qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens.to(torch.int32),
                              slots.to(torch.int32))))
    ports = {n: x.contiguous() for n, x in ports.items()}
    new = lambda *shape, dtype=torch.float32: torch.empty(*shape, device=qkv.device, dtype=dtype)  # noqa: E731
    ports |= {"q": new(N, H, K, dtype=qkv.dtype), "k": new(N, H, K, dtype=qkv.dtype),
              "v": new(N, H, V, dtype=qkv.dtype), "g": new(N, H, K), "beta": new(N, H), "new_conv": new(B, C, W - 1)}
    d = dims([tuple(ports[n].shape) for n in _PORTS])
    run(plan(d, [dtype_name(qkv.dtype)], {"gate_lower_bound": gate_lower_bound}), ports, d)
    return tuple(ports[n] for n in _OUTPUTS)
