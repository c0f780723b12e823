"""MXFP4 MoE Triton kernels (packed GEMMs decoding nibbles + E8M0 scales in registers) vs the fp32 reference."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from k3x.custom_ops.moe_mxfp4 import reference
from k3x.custom_ops.moe_mxfp4 import triton as kernels
from k3x.custom_ops.moe_mxfp4.triton import PORTS
from tolerances import assert_close


def _inputs(N, d, L, I, E, *, hot=None, device="cpu"):
    g = torch.Generator().manual_seed(N * 100 + E)
    x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)
    gate_weight, gate_bias = torch.randn(E, d, generator=g) * d ** -0.5, torch.randn(E, generator=g) * 0.1
    if hot is not None:
        gate_bias[hot] = 100.0
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731 - every code
    sc = lambda *s: torch.randint(118, 126, s, generator=g, dtype=torch.uint8)  # noqa: E731 - O(1) products
    packed = [u8(E, I, L // 2), u8(E, I, L // 2), u8(E, L, I // 2)]
    scales = [sc(E, I, L // 32), sc(E, I, L // 32), sc(E, L, I // 32)]
    return [t.to(device) for t in [x, z, gate_weight, gate_bias, *packed, *scales]]


@pytest.mark.parametrize("N, d, L, I, E, k, act, hot", [
    (13, 24, 64, 32, 6, 2, "situ", None),  # random routing, two k tiles of the GEMM1 reduction
    (9, 16, 32, 96, 5, 1, "silu", 3),  # top-1, one expert takes every token, I spans 3 scale blocks
    (5, 16, 96, 64, 12, 3, "situ", None),  # more experts than pairs, L past one 64-wide tile
])
def test_packed_moe_matches_reference(N, d, L, I, E, k, act, hot, device):
    args = _inputs(N, d, L, I, E, hot=hot, device=device) + [k, 1.5, True, act, 4.0, 25.0]
    out = kernels.moe(*args)
    assert out.shape == (N, L) and out.dtype == torch.float32
    assert_close(out, reference.moe(*args), torch.float32, what="u")


@pytest.mark.parametrize("block_m, programs", [(16, 2), (64, 3), (128, 1)])
def test_packed_gemm_orientations_and_persistent_grid(block_m, programs, device):
    """Swap-AB and plain packed tiles, persistent grids smaller than the tile count, against the reference."""
    from test_moe_triton import run_with

    args = _inputs(37, 16, 96, 64, 5, hot=2, device=device) + [2, 1.5, True, "silu", 4.0, 25.0]
    out = run_with(kernels, args, PORTS, {"block_m": block_m, "gemm_programs": programs})
    assert_close(out, reference.moe(*args), torch.float32, what=f"u BM={block_m}")


def test_decode_tile_is_the_codec(device):
    """Every code and scale byte 0 (subnormal 2^-127) .. 252 (6·2^125 still finite) through the packed GEMM2 with
    a one-hot activation: column n of the output is row n of the decoded expert, bit for bit."""
    from k3x.custom_ops.moe_mxfp4.codec import dequantize

    L, I = 32, 256  # one expert's w2 [1, L, I/2]: 32 rows x 256 weights
    packed = torch.arange(256, dtype=torch.uint8).repeat(L, I // 2 // 256 + 1)[:, : I // 2][None].contiguous()
    scale = (torch.arange(L * I // 32) % 253).to(torch.uint8).reshape(1, L, I // 32)
    want = dequantize(packed, scale)[0]  # [L, I]
    for i, swap in ((0, False), (77, True), (255, False), (255, True)):  # one-hot h: weight column i (TMA = swap)
        sorted_pair = torch.tensor([0] + [1] * 15, dtype=torch.int32)  # pair 0, then padding (NK = 1)
        block_expert = torch.tensor([0], dtype=torch.int32)
        h = torch.zeros(16, I)
        h[0, i] = 1.0
        y = torch.empty(1, L, device=device)
        kernels._moe_mxfp4_gemm2_kernel[(1,)](
            h.to(device), packed.to(device), scale.to(device), sorted_pair.to(device), block_expert.to(device),
            torch.ones(1, device=device), y, 1, I, L, 1, 1,
            BM=16, BN=32, BK=32, GROUP_M=1, IEEE=True, SWAP=swap, SCALED=False, AFMT="fp32", TMA=swap)
        assert torch.equal(y.cpu()[0], want[:, i]), f"column {i}, swap {swap}"


@pytest.mark.parametrize("swap", [False, True])
def test_dot_scaled_tile_is_the_codec(swap, device):
    """The sm_100+ path (`tl.dot_scaled`: E2M1 codes and E8M0 scales straight into the MMA, bf16 activations) on
    every code byte and scale bytes 1 .. 252, one-hot h: each output column is the decoded weight, bit for bit
    (every decoded value has at most two significant bits, so bf16 holds it exactly)."""
    from k3x.custom_ops.moe_mxfp4.codec import dequantize

    L, I = 32, 256  # one expert
    packed = torch.arange(256, dtype=torch.uint8).repeat(L, 1)[:, : I // 2][None].contiguous()
    scale = (torch.arange(L * I // 32) % 252 + 1).to(torch.uint8).reshape(1, L, I // 32)
    want = dequantize(packed, scale)[0]  # [L, I]
    for i in (0, 77, 255):
        h = torch.zeros(16, I, dtype=torch.bfloat16)
        h[0, i] = 1.0
        y = torch.empty(1, L, dtype=torch.bfloat16, device=device)
        kernels._moe_mxfp4_gemm2_kernel[(1,)](
            h.to(device), packed.to(device), scale.to(device),
            torch.tensor([0] + [1] * 15, dtype=torch.int32, device=device), torch.zeros(1, dtype=torch.int32,
                                                                                        device=device),
            torch.ones(1, device=device), y, 1, I, L, 1, 1,
            BM=16, BN=32, BK=64, GROUP_M=1, IEEE=False, SWAP=swap, SCALED=True, AFMT="bf16", TMA=not swap)
        assert torch.equal(y.cpu()[0].float(), want[:, i]), f"column {i}"


def test_int8_bytes_as_tensorrt_passes_them(device):
    """TensorRT hands the packed ports over as int8: the same bytes give the same result, bit for bit."""
    args = _inputs(13, 24, 64, 32, 6, device=device) + [2, 1.5, True, "situ", 4.0, 25.0]
    signed = [a.view(torch.int8) if torch.is_tensor(a) and a.dtype == torch.uint8 else a for a in args]
    assert torch.equal(kernels.moe(*signed), kernels.moe(*args))


@triton.jit
def _mxfp8_tile_kernel(x, out, BM: tl.constexpr, BK: tl.constexpr):
    o = tl.arange(0, BM)[:, None] * BK + tl.arange(0, BK)[None, :]
    tl.store(out + o, kernels._mxfp8_values(tl.load(x + o), BM, BK))


def test_mxfp8_prologue_is_the_quantizer(device):
    """The GEMM prologue's MXFP8 rounding (bit ops, ties by 1.5·2^23) equals mxfp8.fake_quantize bit for bit on
    every E4M3 value, tie and neighbour at four scales, saturation, zero, clamped (2^-140) and NaN/Inf blocks."""
    from mxfp8_cases import scale_blocks

    from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize

    rows = [torch.from_numpy(scale_blocks(s)) for s in (-127, -9, 0, 119)]
    x = torch.cat(rows).reshape(-1)
    x = torch.cat([x, torch.zeros(32), torch.full((32,), 2.0 ** -140), torch.randn(64) * 1e3])
    x = torch.cat([x, torch.zeros(-len(x) % 2048)]).reshape(-1, 32, 64)
    x[-1, 0, 3], x[-1, 1, 40] = float("nan"), float("inf")
    for tile in x:
        out = torch.empty(32, 64, device=device)
        _mxfp8_tile_kernel[(1,)](tile.contiguous().to(device), out, BM=32, BK=64)
        want = fake_quantize(tile)
        assert torch.equal(out.cpu().isnan(), want.isnan())
        assert torch.equal(out.cpu().nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("N, L, I, block_m, sm", [
    (37, 96, 64, 16, 90), (37, 96, 160, 64, 90),  # FP8 dots: swap-AB, plain tiles (L, I not multiples of BN)
    (1, 96, 160, 16, 90),  # one token, I of five scale blocks
    (37, 96, 64, 16, 100), (37, 96, 64, 64, 100),  # tl.dot_scaled
    (37, 96, 64, 16, 80),  # no FP8 MMA: the MXFP8 values into the decode path
])
def test_packed_moe_mxfp8_matches_reference(N, L, I, block_m, sm, device):
    """W4A8: both GEMMs quantize their activation tiles in the prologue; FP8 dots of E4M3 codes with the E8M0
    scales applied per 32-wide k step (sm_90), tl.dot_scaled with E4M3 codes and E8M0 scales on both operands
    (sm_100) and the decode path (below sm_90), swap-AB and plain tiles, against the reference's exact emulation
    (fp32) — and MXFP8 changes the result (it is not a no-op)."""
    from test_moe_triton import run_with

    hyper = [2, 1.5, True, "situ", 4.0, 25.0]
    args = _inputs(N, 16, L, I, 5, hot=2, device=device) + hyper
    out = run_with(kernels, args, PORTS, {"block_m": block_m, "gemm_programs": 2, "sm": sm,
                                          "activations": "mxfp8"})
    want = reference.moe(*[a.cpu() if torch.is_tensor(a) else a for a in args], activations="mxfp8")
    assert_close(out.cpu(), want, torch.float32, what=f"u N={N} I={I} BM={block_m} sm={sm}")
    plain = reference.moe(*[a.cpu() if torch.is_tensor(a) else a for a in args])
    assert (want - plain).abs().max() > 1e-3


def test_moe_entry_takes_the_activation_format(device):
    args = _inputs(13, 24, 64, 32, 6, device=device) + [2, 1.5, True, "situ", 4.0, 25.0]
    out = kernels.moe(*args, activations="mxfp8")
    assert_close(out.cpu(), reference.moe(*[a.cpu() if torch.is_tensor(a) else a for a in args],
                                         activations="mxfp8"), torch.float32, what="u")


@triton.jit
def _e4m3_code_kernel(out):
    code = tl.arange(0, 16)
    tl.store(out + code, kernels._e4m3_code(code).to(tl.uint8))


def test_e2m1_codes_recoded_to_e4m3_exactly(device):
    """The sm_90 W4A8 path re-codes every E2M1 code (both signs, 0.5 and the zeros included) to the E4M3 byte of
    the same value: torch's float8_e4m3fn encoding, not the interpreter's fp8 emulation, is the judge."""
    from k3x.custom_ops.moe_mxfp4.codec import E2M1

    out = torch.empty(16, dtype=torch.uint8, device=device)
    _e4m3_code_kernel[(1,)](out)
    assert torch.equal(out.cpu(), torch.tensor(E2M1).to(torch.float8_e4m3fn).view(torch.uint8))


def _fp8_gemm2(h: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, swap: bool, BN: int) -> torch.Tensor:
    """The packed GEMM2 on its sm_90 W4A8 path (F8: MXFP8 codes × E4M3-recoded weights, one 32-wide scale block per
    FP8 dot) over one expert: h [NK, I] (NK a multiple of 16, every row a pair of weight 1) -> y [NK, L] fp32."""
    (NK, I), L, dev = h.shape, packed.shape[1], h.device
    y = torch.empty(NK, L, device=dev)
    kernels._moe_mxfp4_gemm2_kernel[(NK // 16 * (L // BN),)](
        h, packed.to(dev), scale.to(dev), torch.arange(NK, dtype=torch.int32, device=dev),
        torch.zeros(NK // 16, dtype=torch.int32, device=dev), torch.ones(NK, device=dev), y, NK, I, L, 1, NK // 16,
        BM=16, BN=BN, BK=32, GROUP_M=1, IEEE=True, SWAP=swap, SCALED=False, AFMT="e4m3", TMA=swap, A8=True, F8=True)
    return y


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_tile_is_the_codec(swap, device):
    """Weight side of the sm_90 W4A8 dot: every code byte and scale bytes 0 (2^-127) .. 252, a one-hot activation
    (1.0: code 256 at scale 2^-8), eight k steps of which seven are zero blocks — each output column is the decoded
    weight, bit for bit (activation scale applied first: 256·w·2^-8 is the E2M1 value before 2^(s − 127))."""
    from k3x.custom_ops.moe_mxfp4.codec import dequantize

    L, I = 32, 256
    packed = torch.arange(256, dtype=torch.uint8).repeat(L, 1)[:, : I // 2][None].contiguous()
    scale = (torch.arange(L * I // 32) % 253).to(torch.uint8).reshape(1, L, I // 32)
    want = dequantize(packed, scale)[0]  # [L, I]
    h = torch.zeros(16, I)
    for row, i in enumerate((0, 77, 200, 255)):
        h[row, i] = 1.0
    y = _fp8_gemm2(h.to(device), packed, scale, swap, BN=32).cpu()
    for row, i in enumerate((0, 77, 200, 255)):
        assert torch.equal(y[row], want[:, i]), f"column {i}, swap {swap}"
    assert not y[4:].any()


@pytest.mark.parametrize("swap", [False, True])
def test_fp8_dot_is_the_quantizer(swap, device):
    """Activation side of the sm_90 W4A8 dot, through the FP8 MMA: identity weights (code 1.0, scale 2^0), so
    y = h's MXFP8 values — equal to mxfp8.fake_quantize bit for bit on every E4M3 value, tie and neighbour at
    scales 2^-127 (subnormal fp32 scale), 2^-9, 2^0 and 2^119, zero, clamped (2^-140) and NaN/Inf blocks (a whole
    NaN row, as the quantizer's 0xFF scale)."""
    from mxfp8_cases import scale_blocks

    from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize

    rows = [torch.from_numpy(scale_blocks(s)) for s in (-127, -9, 0, 119)]
    h = torch.cat(rows + [torch.zeros(1, 32), torch.full((1, 32), 2.0 ** -140), torch.randn(2, 32) * 1e3])
    h = torch.cat([h, torch.zeros(-len(h) % 16, 32)])
    h[-1, 3], h[-2, 30] = float("nan"), float("inf")
    packed = torch.full((1, 32, 16), 0, dtype=torch.uint8)
    packed[0, torch.arange(32), torch.arange(32) // 2] = torch.where(torch.arange(32) % 2 == 0, 0x02, 0x20).to(
        torch.uint8)  # E2M1 code 2 (1.0) at k = n: low nibble for even n, high for odd
    y = _fp8_gemm2(h.to(device), packed, torch.full((1, 32, 1), 127, dtype=torch.uint8), swap, BN=32).cpu()
    want = fake_quantize(h)
    assert torch.equal(y.isnan(), want.isnan())
    assert torch.equal(y.nan_to_num(), want.nan_to_num())


@pytest.mark.parametrize("activations", ["mxfp8", "bf16"])
def test_gpu_check_w4a8_steps_run_the_plan(activations, device):
    """bench/gpu_check's W4A8 timing runs the packed plan's own steps (align, GEMM1, GEMM2, sum) on fixed routing
    (sm_90: FP8 dots with MXFP8 activations): what it times computes the routed packed experts, on the weights
    its parity section draws (O(1) outputs)."""
    from k3x.bench.gpu_check_bench import moe_steps
    from k3x.bench.gpu_check_w4a8 import packed_experts
    from k3x.custom_ops.moe_mxfp4.codec import dequantize
    from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize

    N, L, I, E, k = 9, 64, 64, 4, 2
    z = torch.randn(N, L, generator=torch.Generator().manual_seed(0)).to(device)
    w = packed_experts(E, I, L, device, torch.Generator(device).manual_seed(1))
    ids = torch.stack([torch.randperm(E)[:k] for _ in range(N)]).to(device)
    wts = torch.rand(N, k, device=device)
    u = moe_steps(kernels, z, ids, wts, w, sm=90, activations=activations)["experts"]()["u"]
    want = reference.routed_experts(
        z, ids, wts, E, lambda e: tuple(dequantize(w[n][e], w[f"{n}_scale"][e]) for n in ("w1", "w3", "w2")),
        "situ", 4.0, 25.0, fake_quantize if activations == "mxfp8" else None)
    assert_close(u, want, torch.float32, what=f"u {activations}")
    assert 0.05 < want.pow(2).mean().sqrt() < 20
