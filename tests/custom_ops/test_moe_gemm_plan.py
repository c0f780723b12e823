"""The MoE grouped GEMMs' launch plan (dense and MXFP4), checked on the host without compiling: the down
projection's buffer is in the activation dtype, swap-AB below 64 rows per block, a persistent grid sized from
compiled resources, native FP4 MMAs (`tl.dot_scaled`) chosen by target. The kernels themselves are checked
under the interpreter (tests/custom_ops/kernels) and compiled (tests/bench/test_kernel_resources.py)."""

from __future__ import annotations

import pytest

from k3x.custom_ops.moe import triton as dense
from k3x.custom_ops.moe_mxfp4 import triton as packed
from k3x.plan.launch import SM90_SMS, ctas_per_sm, workspace_layout

K3 = {"d": 7168, "L": 3584, "E": 896, "I": 3072}
ATTRS = {"top_k": 16, "routed_scaling_factor": 1.0, "renormalize": True, "activation": "situ", "situ_beta": 4.0,
         "situ_linear_beta": 25.0}
DENSE = ["bf16", "bf16", "bf16", "fp32", "bf16", "bf16", "bf16", "bf16"]
PACKED = ["bf16", "bf16", "bf16", "fp32"] + ["uint8"] * 6 + ["bf16"]


def _gemms(family: str, N: int, sm: int = 90, dtypes: list[str] | None = None, **attrs) -> tuple[dict, list]:
    mod, dts = (dense, DENSE) if family == "moe" else (packed, PACKED)
    d = dict(K3, N=N)
    plan = mod.plan(d, dtypes or dts, ATTRS | {"sm": sm} | attrs)
    return d, [x for x in plan.select(d).launches if "gemm" in x.kernel_name], plan


@pytest.mark.parametrize("family", ["moe", "moe_mxfp4"])
def test_down_projection_buffer_in_activation_dtype(family):
    """y [N·k, L] is written in z's dtype: 0.94 GB at N = 8192 in bf16 (was 1.88 GB of fp32)."""
    d, _, plan = _gemms(family, 8192)
    (y,) = [b for b in plan.workspace if b.name == "y"]
    assert y.dtype == "bf16"
    assert workspace_layout((y,), d)[1] == 8192 * 16 * 3584 * 2


@pytest.mark.parametrize("family", ["moe", "moe_mxfp4"])
@pytest.mark.parametrize("N, swap", [(1, True), (16, True), (64, True), (4096, False)])
def test_swap_ab_below_64_rows_per_block(family, N, swap):
    """Decode (N·k/E ≈ 0.02–1.1 rows per expert: 16-row blocks) puts the weight rows on the MMA's wide side."""
    _, gemms, _ = _gemms(family, N)
    assert [x.constexprs["SWAP"] for x in gemms] == [swap, swap]
    assert all((x.constexprs["BM"] < dense.SWAP_BELOW) == swap for x in gemms)


@pytest.mark.parametrize("family, activations", [("moe", "bf16"), ("moe_mxfp4", "bf16"), ("moe_mxfp4", "mxfp8")])
@pytest.mark.parametrize("N", [1, 64, 4096])
def test_persistent_grid_from_compiled_resources(family, activations, N):
    """Each grouped GEMM launches min(tiles, 132 × CTAs per SM) programs, CTAs per SM from the sm_90a table
    (the Hopper W4A8 GEMMs from their own "fp8" entries)."""
    d, gemms, _ = _gemms(family, N, activations=activations)
    for x in gemms:
        c = x.constexprs
        key = dense.resource_key(x.kernel_name, c, x.num_warps, x.num_stages)
        assert key in dense.GEMM_RESOURCES_SM90, key
        assert (key[-1] == "fp8") == (activations == "mxfp8"), key
        cap = SM90_SMS * ctas_per_sm(*dense.GEMM_RESOURCES_SM90[key], x.num_warps)
        sizes = x.scalars(d)
        cols = d["I"] if "gemm1" in x.kernel_name else d["L"]
        tiles = sizes["num_m"] * -(-cols // c["BN"])
        assert x.grid(d) == (min(tiles, cap), 1, 1)
        if N == 4096:
            assert tiles > cap  # prefill: every program walks many tiles


def test_gemm_programs_override_and_small_shapes():
    d = {"N": 5, "d": 16, "L": 32, "E": 4, "I": 32}
    plan = dense.plan(d, ["fp32"] * 8, ATTRS | {"top_k": 2, "gemm_programs": 3})
    grids = [x.grid(d)[0] for x in plan.select(d).launches if "gemm" in x.kernel_name]
    assert grids == [3, 3]


@pytest.mark.parametrize("sm, dtypes, scaled", [
    (90, PACKED, False),  # Hopper: decode in registers
    (100, PACKED, True),  # Blackwell: tl.dot_scaled
    (120, PACKED, True),
    (100, ["fp32", "fp32", "fp32", "fp32"] + ["uint8"] * 6 + ["fp32"], False),  # fp32 activations: IEEE dots
])
def test_dot_scaled_chosen_by_target(sm, dtypes, scaled):
    for N in (1, 4096):
        _, gemms, _ = _gemms("moe_mxfp4", N, sm, dtypes)
        assert [x.constexprs["SCALED"] for x in gemms] == [scaled, scaled]
    _, gemms, _ = _gemms("moe", 1, sm)
    assert all("SCALED" not in x.constexprs for x in gemms)


@pytest.mark.parametrize("family, sm, dtypes, I, tma", [
    ("moe", 90, DENSE, 3072, True),  # w2 rows of 6144 bytes: TMA boxes
    ("moe", 89, DENSE, 3072, False),  # no TMA before Hopper
    ("moe", 90, ["fp32"] * 8, 18, False),  # rows of 72 bytes: not 16-byte strides
    ("moe_mxfp4", 90, PACKED, 3072, True),  # code bytes, I/2 per row
    ("moe_mxfp4", 100, PACKED, 3072, False),  # dot_scaled keeps pointer loads
])
def test_tma_for_the_down_projection_weights(family, sm, dtypes, I, tma):
    """GEMM2 reads w2 (the MXFP4 codes) through a TMA descriptor where its rows allow; GEMM1's interleaved
    gate/up operand is not one TMA box and stays on pointer loads."""
    mod = dense if family == "moe" else packed
    d = dict(K3, N=4096, I=I)
    plan = mod.plan(d, dtypes, ATTRS | {"sm": sm})
    gemm1, gemm2 = [x for x in plan.select(d).launches if "gemm" in x.kernel_name]
    assert gemm2.constexprs["TMA"] is tma and "TMA" not in gemm1.constexprs


FP32_PACKED = ["fp32", "fp32", "fp32", "fp32"] + ["uint8"] * 6 + ["fp32"]


@pytest.mark.parametrize("sm, dtypes, scaled, f8", [
    (90, PACKED, False, True),  # Hopper: E4M3 codes × E4M3-recoded weights, FP8 dots, scales per 32-wide k step
    (90, FP32_PACKED, False, True),  # fp32 z: quantized to E4M3 too
    (89, PACKED, False, False),  # before Hopper: MXFP8 values from the prologue into the decode path
    (100, PACKED, True, False),  # Blackwell: E4M3 codes + E8M0 scales on both tl.dot_scaled operands
    (100, FP32_PACKED, True, False),
])
def test_mxfp8_activations_in_both_gemms(sm, dtypes, scaled, f8):
    """activations="mxfp8" (the plugin field / op argument) turns on the prologue quantizer (A8) in both packed
    GEMMs, whatever z's dtype; from sm_100 both operands go block-scaled into tl.dot_scaled (AFMT e4m3), on sm_90
    into FP8 dots one E8M0 block (BK = 32) at a time (F8)."""
    for N in (1, 4096):
        d = dict(K3, N=N)
        plan = packed.plan(d, dtypes, ATTRS | {"sm": sm, "activations": "mxfp8"})
        gemms = [x for x in plan.select(d).launches if "gemm" in x.kernel_name]
        assert [(x.constexprs["A8"], x.constexprs["SCALED"], x.constexprs["F8"]) for x in gemms] == [
            (True, scaled, f8)] * 2
        assert {x.constexprs["AFMT"] for x in gemms} == {"e4m3"}
        if scaled:
            assert not gemms[1].constexprs["TMA"]
        if f8:
            assert {x.constexprs["BK"] for x in gemms} == {32}
    _, gemms, _ = _gemms("moe_mxfp4", 1, sm, dtypes)  # bf16 activations: no quantizer, today's path
    assert [(x.constexprs["A8"], x.constexprs["F8"]) for x in gemms] == [(False, False)] * 2


@pytest.mark.parametrize("sm, bm, rows", [(90, 64, 64), (100, 128, 128)])
def test_mxfp8_tiles_fit_the_block_scaled_mma_on_sm100(sm, bm, rows):
    """sm_100 W4A8 tiles give tcgen05's block-scaled MMA (kind::mxf8f6f4) the 128 rows its M side needs (Triton
    3.8 upcasts to kind::f16 at 64; compiled: tests/bench, bench/README): at K3's prefill (N = 4096, 64-row
    blocks otherwise) 128 activation rows, at decode (swap-AB) 128 weight rows — GEMM1's 2·BN gate/up rows,
    GEMM2's BN. Hopper keeps the packed tiles."""
    d = dict(K3, N=4096)
    plan = packed.plan(d, PACKED, ATTRS | {"sm": sm, "activations": "mxfp8"})
    gemms = [x for x in plan.select(d).launches if "gemm" in x.kernel_name]
    assert [(x.constexprs["BM"], x.constexprs["SWAP"]) for x in gemms] == [(bm, False)] * 2
    d1 = dict(K3, N=1)
    plan = packed.plan(d1, PACKED, ATTRS | {"sm": sm, "activations": "mxfp8"})
    g1, g2 = [x for x in plan.select(d1).launches if "gemm" in x.kernel_name]
    assert g1.constexprs["SWAP"] and g1.constexprs["BM"] == 16 and (2 * g1.constexprs["BN"], g2.constexprs["BN"]) \
        == (rows, rows)
