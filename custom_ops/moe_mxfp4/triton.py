"""Routed MoE on MXFP4-packed experts: Triton grouped GEMMs that read the packed nibbles and E8M0 scales and
decode in registers before the dot. Never imports `reference.py`.

The plan is `custom_ops/moe/triton.plan` (router, top-k, align, GEMM1, GEMM2, sum; same workspace, grids and
block sizes) with its two GEMM launches swapped for the packed ones below; the routing, alignment and sum
kernels are shared. Axes as there: L expert width, I expert intermediate, E experts, BM/BN/BK the tiles.

Weight tiles: the [BK, BN] view of w[e]ᵀ (element (k, n) = w[e, n, k]) is loaded as bytes w[e, n, k // 2]
(each byte feeds two neighbouring k of one column: HBM traffic is the packed bytes, 4.25 bits per weight with
the scales), the nibble `(byte >> 4·(k & 1)) & 15` is turned into an fp32 by bit construction (`_e2m1`:
sign bit 3 -> bit 31, E2M1's exponent/mantissa -> fp32's; 0.5 and 0 are the subnormal codes) and multiplied
by 2^(scale − 127) (`_e8m0`: the byte is fp32's exponent field; byte 0 is the subnormal 2^-127). Both are
exact, so a tile equals `codec.dequantize` bit for bit; it is cast to z's dtype (exact for bf16/fp16 too,
save scales below their normal range) and goes to the same `_mma` as the dense kernels: 16-bit operands on
tensor cores, fp32 operands as IEEE dots. Native FP4 (`tl.dot_scaled`, sm_100+) is not used yet: on sm_90
the decode-in-registers path is the only one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..dtypes import dtype_name
from ..launch import Launch, Plan, Variant, run
from ..moe import triton as dense
from ..moe.triton import _block_coords, _glu, _mma
from .codec import BLOCK

PORTS = ("x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale", "expert_offset")


@triton.jit
def _e2m1(code):
    """int32 E2M1 code (sign in bit 3) -> its fp32 value, exactly."""
    mag = code & 7
    e = mag >> 1
    m = mag & 1
    bits = tl.where(e == 0, m * (126 << 23), ((e + 126) << 23) | (m << 22))
    return (bits | ((code & 8) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def _e8m0(s):
    """int32 E8M0 byte -> 2^(s − 127) in fp32, exactly (byte 0: the subnormal 2^-127)."""
    return tl.where(s == 0, 1 << 22, s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_mxfp4(w, ws, row0, o_n, o_k, K, mask):
    """fp32 [BK, BN] tile: element (k, n) of the expert matrix whose row n (of K packed weights) starts at
    packed row `row0 + n`; `o_k` absolute k offsets [BK], `o_n` [BN]."""
    rows = (row0 + o_n[None, :]).to(tl.int64)
    byte = tl.load(w + rows * (K // 2) + o_k[:, None] // 2, mask=mask, other=0).to(tl.int32) & 255  # u8 or i8
    code = (byte >> ((o_k[:, None] & 1) * 4)) & 15
    s = tl.load(ws + rows * (K // 32) + o_k[:, None] // 32, mask=mask, other=127).to(tl.int32) & 255
    return _e2m1(code) * _e8m0(s)


@triton.jit
def _moe_mxfp4_gemm1_kernel(
    z, w1, w3, w1s, w3s, sorted_pair, block_expert,  # [N, L], [E, I, L/2] u8 ×2, [E, I, L/32] u8 ×2, [P], [P/BM]
    h,  # out [P, I]
    NK, I, L, num_m,
    beta1, beta2,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = _block_coords(num_m, tl.cdiv(I, BN), GROUP_M)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    o_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_pair + o_m)
    valid = pair < NK
    tok = (pair // TOPK).to(tl.int64)
    o_n = pid_n * BN + tl.arange(0, BN)
    m_n = o_n < I
    o_k = tl.arange(0, BK)
    a_ptr = z + tok[:, None] * L + o_k[None, :]
    acc1 = tl.zeros([BM, BN], dtype=tl.float32)
    acc3 = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, L, BK):
        m_k = o_k < L - k0
        a = tl.load(a_ptr + k0, mask=valid[:, None] & m_k[None, :], other=0.0)
        m_b = m_k[:, None] & m_n[None, :]
        b1 = _load_mxfp4(w1, w1s, e * I, o_n, k0 + o_k, L, m_b).to(a.dtype)
        b3 = _load_mxfp4(w3, w3s, e * I, o_n, k0 + o_k, L, m_b).to(a.dtype)
        acc1 = _mma(a, b1, acc1, IEEE)
        acc3 = _mma(a, b3, acc3, IEEE)
    out = _glu(acc1, acc3, beta1, beta2, ACT)
    tl.store(h + o_m[:, None].to(tl.int64) * I + o_n[None, :], out.to(h.dtype.element_ty), mask=m_n[None, :])


@triton.jit
def _moe_mxfp4_gemm2_kernel(
    h, w2, w2s, sorted_pair, block_expert, topk_w,  # [P, I], [E, L, I/2] u8, [E, L, I/32] u8, [P], [P/BM], [NK]
    y,  # out [NK, L] fp32, rows in pair order
    NK, I, L, num_m,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
):
    pid_m, pid_n = _block_coords(num_m, tl.cdiv(L, BN), GROUP_M)
    e = tl.load(block_expert + pid_m).to(tl.int64)
    if e < 0:
        return
    o_m = pid_m * BM + tl.arange(0, BM)
    pair = tl.load(sorted_pair + o_m)
    valid = pair < NK
    o_n = pid_n * BN + tl.arange(0, BN)
    m_n = o_n < L
    o_k = tl.arange(0, BK)
    a_ptr = h + o_m[:, None].to(tl.int64) * I + o_k[None, :]
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        m_k = o_k < I - k0
        a = tl.load(a_ptr + k0, mask=valid[:, None] & m_k[None, :], other=0.0)
        b = _load_mxfp4(w2, w2s, e * L, o_n, k0 + o_k, I, m_k[:, None] & m_n[None, :]).to(a.dtype)
        acc = _mma(a, b, acc, IEEE)
    wt = tl.load(topk_w + pair, mask=valid, other=0.0)
    tl.store(y + pair[:, None].to(tl.int64) * L + o_n[None, :], acc * wt[:, None],
             mask=valid[:, None] & m_n[None, :])


def dims(shapes) -> dict:
    """Named dims from the input shapes (x [N, d], z [N, L], gate_weight, gate_bias, w1 [E, I, L/2], ...)."""
    return dense.dims(shapes)  # the packed w1's dims 0 and 1 are the dense ones


PACKED_GEMMS = {
    "_moe_gemm1_kernel": (_moe_mxfp4_gemm1_kernel,
                          ("z", "w1", "w3", "w1_scale", "w3_scale", "sorted_pair", "block_expert", "h", "NK", "I",
                           "L", "num_m")),
    "_moe_gemm2_kernel": (_moe_mxfp4_gemm2_kernel,
                          ("h", "w2", "w2_scale", "sorted_pair", "block_expert", "wts", "y", "NK", "I", "L",
                           "num_m")),
}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """k3::moe's plan (custom_ops/moe/triton.plan: eight launches, same workspace) with the packed GEMMs.
    Ports: x, z, gate_weight, gate_bias, w1, w3, w2 (u8), w1_scale, w3_scale, w2_scale (u8) -> u. The decoded
    weights take z's dtype, so the dense plan is built as if the experts were stored in z's dtype."""
    if d["L"] % BLOCK or d["I"] % BLOCK:
        raise ValueError(f"k3::moe_mxfp4: L={d['L']} and I={d['I']} must be multiples of {BLOCK}")
    base = dense.plan(d, [dtypes[0], dtypes[1], dtypes[2], dtypes[3], dtypes[1], dtypes[1], dtypes[1],
                          dtypes[-1]], attrs)
    (variant,) = base.variants
    launches = []
    for x in variant.launches:
        if x.kernel_name in PACKED_GEMMS:
            kernel, args = PACKED_GEMMS[x.kernel_name]
            x = Launch(kernel, args, x.constexprs, grid=x.grid, scalars=x.scalars, num_warps=x.num_warps,
                       num_stages=x.num_stages, divisible=tuple(a for a in x.divisible if a in args))
        launches.append(x)
    return Plan((Variant(variant.name, tuple(launches)),), workspace=base.workspace)


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
        w1_scale: Tensor, w3_scale: Tensor, w2_scale: Tensor, top_k: int, routed_scaling_factor: float,
        renormalize: bool, activation: str, situ_beta: float, situ_linear_beta: float,
        expert_offset: Tensor | None = None) -> Tensor:
    """The whole plan on packed experts -> u [N, L] in z's dtype."""
    E, I, half = w1.shape
    L = 2 * half
    want = {"w3": (E, I, half), "w2": (E, L, I // 2), "w1_scale": (E, I, L // BLOCK), "w3_scale": (E, I, L // BLOCK),
            "w2_scale": (E, L, I // BLOCK)}
    got = dict(zip(("w3", "w2", "w1_scale", "w3_scale", "w2_scale"), (w3, w2, w1_scale, w3_scale, w2_scale)))
    bytes_ = (torch.uint8, torch.int8)  # int8: the same bytes, as TensorRT passes them
    bad = [n for n, s in want.items() if tuple(got[n].shape) != s or got[n].dtype not in bytes_]
    EG = gate_weight.shape[0]  # experts routed over; E local ones (expert parallelism)
    if bad or w1.dtype not in bytes_ or z.shape != (x.shape[0], L) or gate_weight.shape != (EG, x.shape[-1]) or (
            EG != E if expert_offset is None else EG < E):
        raise ValueError(f"moe_mxfp4: x {tuple(x.shape)} z {tuple(z.shape)} gate {tuple(gate_weight.shape)} "
                         f"w1 {tuple(w1.shape)} {w1.dtype} do not fit" + (f" ({', '.join(bad)})" if bad else ""))
    attrs = dense._attrs(top_k, routed_scaling_factor, renormalize, activation, situ_beta, situ_linear_beta)
    off = dense.no_offset(x.device) if expert_offset is None else expert_offset.reshape(1).to(torch.int32)
    tensors = dict(zip(PORTS, (t.contiguous() for t in (x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale,
                                                          w3_scale, w2_scale, off))))
    tensors["u"] = torch.empty(z.shape[0], L, device=z.device, dtype=z.dtype)
    d = dims([t.shape for t in tensors.values()])
    run(plan(d, [dtype_name(t.dtype) for t in tensors.values()], attrs), tensors, d)
    return tensors["u"]
