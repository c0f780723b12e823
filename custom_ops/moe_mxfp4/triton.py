"""Routed MoE on MXFP4-packed experts: Triton grouped GEMMs that read the packed nibbles and E8M0 scales, decode
them in registers (Hopper), re-code them to E4M3 for FP8 MMAs (Hopper, MXFP8 activations) or hand them to
`tl.dot_scaled` (sm_100+). Never imports `reference.py`.

The plan is `custom_ops/moe/triton.build_plan` (router, top-k, align, GEMM1, GEMM2, sum; same workspace and
grid rules) with its two GEMM launches swapped for the packed ones below and their own tiles; the routing,
alignment and sum kernels are shared. Axes as there: L expert width, I expert intermediate, E experts, BM/BN/BK
the tiles.

Weight tiles: R expert rows × BK weights, loaded as [R, BK/2] bytes w[e, n, k // 2] (each byte holds k = 2i in
its low and 2i + 1 in its high nibble: HBM traffic is the packed bytes, 4.25 bits per weight with the scales)
and [R, BK/32] E8M0 scale bytes, both contiguous (vectorised loads). Two ways into the MMA, chosen by target
in the plan (attrs["sm"]):
- sm_100+ with 16-bit activations: `tl.dot_scaled` takes the codes and scales as they are. Triton 3.8 lowers
  E2M1 × bf16 by upcasting the E2M1 operand to bf16 itself (tcgen05 kind::f16, not the block-scaled
  kind::mxf8f6f4, which needs both operands in FP8/FP6/FP4): exact, and the compiler's own decode;
- otherwise (Hopper, and fp32): decode in registers. Each nibble half becomes an fp32 by bit construction
  (`_e2m1`: sign bit 3 -> bit 31, E2M1's exponent/mantissa -> fp32's; 0.5 and 0 are the subnormal codes),
  times 2^(scale − 127) (`_e8m0`: the byte is fp32's exponent field; byte 0 is the subnormal 2^-127), the two
  halves interleaved back to [R, BK]. Both are exact, so a tile equals `codec.dequantize` bit for bit; it is
  cast to z's dtype (exact for bf16/fp16 too, save scales below their normal range) and goes to the same
  `tile_dot` as the dense kernels: 16-bit operands on tensor cores, fp32 operands as IEEE dots.
Swap-AB, the interleaved gate/up operand and the persistent grid are the dense kernels' (`moe.triton`); packed
tiles are half as wide (the decoded [R, BK] fp32 values live in registers).

MXFP8 activations (attrs["activations"] == "mxfp8", constexpr A8): each GEMM quantizes its activation tile in
the prologue of every k step (`_mxfp8`: mxfp8.py's rule with bit ops — the block's amax exponent from its fp32
bits, the E4M3 spacing of each element's binade from its bits, ties to even by adding and subtracting 1.5·2^23,
saturation by a clamp), blocks of 32 along K lying inside a BK tile (BK is 32 or 64, K a multiple of 32). On
sm_100+ the E4M3 codes and their E8M0 bytes go to `tl.dot_scaled` with the E2M1 weights (both operands
block-scaled: tcgen05 kind::mxf8f6f4, which needs 128 rows on the MMA's M side — the plan gives W4A8 tiles 128
activation rows at prefill and 128 weight rows in swap-AB at decode; compiled for sm_100a: block-scaled MMA and
no spills at N = 1 .. 4096, tests/bench/test_kernel_resources.py). On sm_90 (F8, `_fp8_dot`) every k step is one
scale block (BK = 32): the activation codes and the E2M1 weights re-coded to E4M3 by bit operations (every E2M1
value is an E4M3 value) go as float8e4nv into one FP8 MMA from zero (wgmma e4m3 × e4m3, k = 32, fp32 out; both
operands k-contiguous, as fp8 wgmma requires), and the partial is scaled by the two blocks' 2^(e − 127) in
registers — by the activation's first (partial × 2^s_a is Σ a_i · code_i), then the weight row's — and added to
the fp32 accumulator. Compiled for sm_90a: wgmma e4m3 in both GEMMs, no spills at N = 1 .. 4096
(tests/bench/test_kernel_resources.py). Elsewhere (sm < 90) the quantized values (E4M3 × 2^s, exact in fp32 and
bf16) take the decode path above.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import Plan, device_sm, run
from ..moe import triton as dense
from ..moe.triton import offset_to, store_h, store_y, tile_acc, tile_coords, tile_dot, tile_out, tile_pairs
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
def _load_packed(w, ws, rows, k0, K, m_row, BK: tl.constexpr):
    """Bytes [R, BK/2] and E8M0 scales [R, BK/32] (uint8, as stored) of weights k0 .. k0 + BK − 1 of the packed
    expert rows `rows` (int64 [R, 1], rows of K weights; `m_row` [R, 1] which exist); `w`, `ws` the bases.
    Contiguous and loaded once each (vectorised)."""
    o_b = tl.arange(0, BK // 2)[None, :]
    byte = tl.load(w + rows * (K // 2) + k0 // 2 + o_b, mask=m_row & (o_b < (K - k0) // 2), other=0)
    return byte.to(tl.uint8, bitcast=True), _load_scales(ws, rows, k0, K, m_row, BK)  # TensorRT passes int8


@triton.jit
def _load_scales(ws, rows, k0, K, m_row, BK: tl.constexpr):
    """The E8M0 scale bytes [R, BK/32] of `_load_packed`'s tile."""
    o_s = tl.arange(0, BK // 32)[None, :]
    s = tl.load(ws + rows * (K // 32) + k0 // 32 + o_s, mask=m_row & (o_s < (K - k0) // 32), other=127)
    return s.to(tl.uint8, bitcast=True)


@triton.jit
def _mxfp8(a, BM: tl.constexpr, BK: tl.constexpr):
    """Activation tile a [BM, BK] through MXFP8 (custom_ops/moe_mxfp4/mxfp8.py): (the E4M3 values P [BM, BK] as
    fp32, the block exponents s [BM, BK/32] int32, 128 for a block holding a NaN or an infinity)."""
    v = tl.reshape(a.to(tl.float32), [BM, BK // 32, 32])
    bits = v.to(tl.int32, bitcast=True) & 0x7FFFFFFF  # |v|'s bits: ordered like |v|
    bad = tl.max((bits >= 0x7F800000).to(tl.int32), axis=2)  # NaN or ±inf in the block
    e_max = (tl.maximum(tl.max(bits, axis=2), 7 << 23) >> 23) - 127  # floor(log2(amax)), at least -120
    s = tl.minimum(tl.maximum(e_max - 8, -127), 127)
    y = v * ((127 - s) << 23).to(tl.float32, bitcast=True)[:, :, None]  # V / 2^s, exact
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)  # saturate
    ey = tl.maximum((y.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)  # biased exponent of |y|, at least 2^-6
    t = y * ((257 - ey) << 23).to(tl.float32, bitcast=True)  # y / spacing 2^(ey - 130), exact, |t| <= 16
    t = (t + 12582912.0) - 12582912.0  # round to the nearest integer, ties to even (1.5·2^23)
    p = t * ((ey - 3) << 23).to(tl.float32, bitcast=True)
    return tl.reshape(p, [BM, BK]), tl.where(bad > 0, 128, s)


@triton.jit
def _mxfp8_values(a, BM: tl.constexpr, BK: tl.constexpr):
    """a [BM, BK] rounded through MXFP8 and back, in a's dtype (exact: E4M3 × 2^s fits fp32 and bf16)."""
    p, s = _mxfp8(a, BM, BK)
    x = tl.where(s == 128, float("nan"), _e8m0(s + 127))
    return tl.reshape(tl.reshape(p, [BM, BK // 32, 32]) * x[:, :, None], [BM, BK]).to(a.dtype)


@triton.jit
def _e4m3_code(code):
    """int32 E2M1 code (sign in bit 3) -> the E4M3 byte of the same value, exactly: magnitudes 2 .. 7 (1 .. 6)
    are E4M3's exponent and mantissa shifted by two bits plus 0x30 (bias 7 against E2M1's 1), 1 (0.5) is 0x30,
    0 is 0; the sign moves to bit 7."""
    mag = code & 7
    return tl.where(mag < 2, mag * 0x30, (mag << 2) + 0x30) | ((code & 8) << 4)


@triton.jit
def _fp8_dot(a, byte, s, acc, R: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr):
    """sm_90 W4A8 k step over one 32-wide scale block (BK == 32): a's MXFP8 codes and the E2M1 weights re-coded
    to E4M3 (`_e4m3_code`), both float8e4nv, into one FP8 MMA (wgmma e4m3 × e4m3, fp32 out) from zero; the
    partial × 2^(a's block exponent) × 2^(the weight row's) is added to acc outside the MMA (an activation block
    holding a NaN or an infinity scales by NaN, as the quantizer's 0xFF)."""
    tl.static_assert(BK == 32, "one E8M0 scale block per k step")
    BM: tl.constexpr = a.shape[0]
    p, e = _mxfp8(a, BM, BK)
    a8 = p.to(tl.float8e4nv)  # p is on the E4M3 grid: exact
    code = byte.to(tl.int32)
    b8 = tl.reshape(tl.join(_e4m3_code(code & 15), _e4m3_code(code >> 4)), [R, BK]).to(tl.uint8)
    b8 = b8.to(tl.float8e4nv, bitcast=True)
    x_a = tl.where(e == 128, float("nan"), _e8m0(e + 127))  # [BM, 1]
    x_b = _e8m0(s.to(tl.int32))  # [R, 1]
    if SWAP:  # the scales as row and column vectors of the partial (no [R, BM] scale tile to lay out)
        acc += tl.dot(b8, tl.trans(a8)) * tl.trans(x_a) * x_b
    else:
        acc += tl.dot(a8, tl.trans(b8)) * x_a * tl.trans(x_b)
    return acc


@triton.jit
def _packed_dot(a, byte, s, acc, R: tl.constexpr, BK: tl.constexpr, SWAP: tl.constexpr, IEEE: tl.constexpr,
                SCALED: tl.constexpr, AFMT: tl.constexpr, A8: tl.constexpr, F8: tl.constexpr):
    """One k step against a packed [R, BK] weight tile (see `tile_dot` for a, acc and SWAP). F8 (sm_90 with A8):
    `_fp8_dot`. SCALED (sm_100+, 16-bit a, or A8): `tl.dot_scaled`, E2M1 codes with their E8M0 scales against a
    in AFMT (A8: a's MXFP8 codes and scales, AFMT "e4m3"). Else (Hopper's 16-bit a, fp32, A8 below sm_90):
    decode in registers — the low and high nibbles as two [R, BK/2] halves interleaved (k = 2i + high), no
    per-element index math for the compiler to carry into the MMA operand's layout — and a plain dot (A8: on a's
    MXFP8 values)."""
    BM: tl.constexpr = a.shape[0]
    if F8:
        acc = _fp8_dot(a, byte, s, acc, R, BK, SWAP)
    elif SCALED:
        a_s = None
        if A8:
            p, e = _mxfp8(a, BM, BK)
            a, a_s = p.to(tl.float8e4nv), (e + 127).to(tl.uint8)  # p is on the E4M3 grid: exact
        if SWAP:
            acc = tl.dot_scaled(byte, s, "e2m1", tl.trans(a), a_s, AFMT, acc)
        else:
            acc = tl.dot_scaled(a, a_s, AFMT, tl.trans(byte), s, "e2m1", acc)
    else:
        if A8:
            a = _mxfp8_values(a, BM, BK)
        code = byte.to(tl.int32)
        scale = tl.reshape(tl.broadcast_to(_e8m0(s.to(tl.int32))[:, :, None], [R, BK // 32, 16]), [R, BK // 2])
        b = tl.reshape(tl.join(_e2m1(code & 15) * scale, _e2m1(code >> 4) * scale), [R, BK])
        acc = tile_dot(a, b.to(a.dtype), acc, SWAP, IEEE)
    return acc


@triton.jit
def _moe_mxfp4_gemm1_kernel(
    z, w1, w3, w1s, w3s, sorted_pair, block_expert,  # [N, L], [E, I, L/2] u8 ×2, [E, I, L/32] u8 ×2, [P], [P/BM]
    h,  # out [P, I]
    NK, I, L, num_m,
    beta1, beta2,
    TOPK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
    ACT: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr, SCALED: tl.constexpr, AFMT: tl.constexpr,
    A8: tl.constexpr = False, F8: tl.constexpr = False,
):
    num_n = tl.cdiv(I, BN)
    o_j = tl.arange(0, 2 * BN)  # wide operand row j: gate (w1, even j) or up (w3, odd j) of unit j // 2
    o_k = tl.arange(0, BK)
    up = o_j[:, None] % 2  # w3's rows are addressed from w1's base (see moe.triton.offset_to)
    d3, ds3 = up * offset_to(w1, w3), up * offset_to(w1s, w3s)
    for t in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):  # persistent: tiles in a loop
        pid_m, pid_n, e = tile_coords(t, num_m, num_n, block_expert, GROUP_M)
        if e >= 0:
            o_m, pair, valid = tile_pairs(pid_m, sorted_pair, NK, BM)
            a_ptr = z + (pair // TOPK).to(tl.int64)[:, None] * L + o_k[None, :]
            o_n = pid_n * BN + o_j[:, None] // 2
            rows = e.to(tl.int64) * I + o_n
            acc = tile_acc(2 * BN, BM, SWAP)
            for k0 in range(0, L, BK):
                a = tl.load(a_ptr + k0, mask=valid[:, None] & (o_k[None, :] < L - k0), other=0.0)
                byte, s = _load_packed(w1 + d3, w1s + ds3, rows, k0, L, o_n < I, BK)  # [2·BN, BK/2], [2·BN, BK/32]
                acc = _packed_dot(a, byte, s, acc, 2 * BN, BK, SWAP, IEEE, SCALED, AFMT, A8, F8)
            store_h(h, tile_out(acc, SWAP), o_m, pid_n, I, beta1, beta2, BM, BN, ACT)


@triton.jit
def _moe_mxfp4_gemm2_kernel(
    h, w2, w2s, sorted_pair, block_expert, topk_w,  # [P, I], [E, L, I/2] u8, [E, L, I/32] u8, [P], [P/BM], [NK]
    y,  # out [NK, L] (z's dtype), rows in pair order
    NK, I, L, E, num_m,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, IEEE: tl.constexpr,
    SWAP: tl.constexpr, SCALED: tl.constexpr, AFMT: tl.constexpr, TMA: tl.constexpr, A8: tl.constexpr = False,
    F8: tl.constexpr = False,
):
    num_n = tl.cdiv(L, BN)
    o_j = tl.arange(0, BN)
    o_k = tl.arange(0, BK)
    if TMA:  # the code bytes as [E·L, I/2] rows, TMA boxes of [BN, BK/2] (the scales' 2-byte rows are below
        # TMA's 16-byte box minimum: pointer loads)
        w2_desc = tl.make_tensor_descriptor(w2, shape=[E * L, I // 2], strides=[I // 2, 1],
                                            block_shape=[BN, BK // 2])
    for t in range(tl.program_id(0), num_m * num_n, tl.num_programs(0)):
        pid_m, pid_n, e = tile_coords(t, num_m, num_n, block_expert, GROUP_M)
        if e >= 0:
            o_m, pair, valid = tile_pairs(pid_m, sorted_pair, NK, BM)
            a_ptr = h + o_m[:, None].to(tl.int64) * I + o_k[None, :]
            o_n = pid_n * BN + o_j[:, None]
            rows = e.to(tl.int64) * L + o_n
            acc = tile_acc(BN, BM, SWAP)
            for k0 in range(0, I, BK):
                a = tl.load(a_ptr + k0, mask=valid[:, None] & (o_k[None, :] < I - k0), other=0.0)
                if TMA:
                    byte = w2_desc.load([e * L + pid_n * BN, k0 // 2]).to(tl.uint8, bitcast=True)
                    s = _load_scales(w2s, rows, k0, I, o_n < L, BK)
                else:
                    byte, s = _load_packed(w2, w2s, rows, k0, I, o_n < L, BK)
                acc = _packed_dot(a, byte, s, acc, BN, BK, SWAP, IEEE, SCALED, AFMT, A8, F8)
            store_y(y, tile_out(acc, SWAP), topk_w, pair, valid, pid_n, L, BN)


def dims(shapes) -> dict:
    """Named dims from the input shapes (x [N, d], z [N, L], gate_weight, gate_bias, w1 [E, I, L/2], ...)."""
    return dense.dims(shapes)  # the packed w1's dims 0 and 1 are the dense ones


PACKED_GEMMS = {
    "_moe_gemm1_kernel": (_moe_mxfp4_gemm1_kernel,
                          ("z", "w1", "w3", "w1_scale", "w3_scale", "sorted_pair", "block_expert", "h", "NK", "I",
                           "L", "num_m")),
    "_moe_gemm2_kernel": (_moe_mxfp4_gemm2_kernel,
                          ("h", "w2", "w2_scale", "sorted_pair", "block_expert", "wts", "y", "NK", "I", "L", "E",
                           "num_m")),
}


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """k3::moe's plan (custom_ops/moe/triton.build_plan: eight launches, same workspace) with the packed GEMMs
    and their tiles. Ports: x, z, gate_weight, gate_bias, w1, w3, w2 (u8), w1_scale, w3_scale, w2_scale (u8),
    expert_offset -> u. The decoded weights take z's dtype, so the plan is built as if the experts were stored in
    z's dtype."""
    if d["L"] % BLOCK or d["I"] % BLOCK:
        raise ValueError(f"k3::moe_mxfp4: L={d['L']} and I={d['I']} must be multiples of {BLOCK}")
    return dense.build_plan(d, [dtypes[0], dtypes[1], dtypes[2], dtypes[3], dtypes[1], dtypes[1], dtypes[1],
                                dtypes[-1]], attrs, PACKED_GEMMS, packed=True)


def moe(x: Tensor, z: Tensor, gate_weight: Tensor, gate_bias: Tensor, w1: Tensor, w3: Tensor, w2: Tensor,
        w1_scale: Tensor, w3_scale: Tensor, w2_scale: Tensor, top_k: int, routed_scaling_factor: float,
        renormalize: bool, activation: str, situ_beta: float, situ_linear_beta: float,
        expert_offset: Tensor | None = None, activations: str = "bf16") -> Tensor:
    """The whole plan on packed experts -> u [N, L] in z's dtype (`activations`: "bf16" or "mxfp8")."""
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
    attrs = dense.plan_attrs(top_k, routed_scaling_factor, renormalize, activation, situ_beta, situ_linear_beta)
    attrs["sm"] = device_sm(z.device)  # sm_100+: tl.dot_scaled
    attrs["activations"] = activations
    off = dense.no_offset(x.device) if expert_offset is None else expert_offset.reshape(1).to(torch.int32)
    tensors = dict(zip(PORTS, (dense.aligned(t) for t in (x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale,
                                                          w3_scale, w2_scale, off))))
    tensors["u"] = torch.empty(z.shape[0], L, device=z.device, dtype=z.dtype)
    d = dims([t.shape for t in tensors.values()])
    run(plan(d, [dtype_name(t.dtype) for t in tensors.values()], attrs), tensors, d)
    return tensors["u"]
