"""bench/kernel_resources.py: occupancy arithmetic, and the compiled resources of K3's hot kernels (sm_90a,
compiled on CPU) held against the regressions the H200 issue fixed: no spills in the KDA chunked kernels,
the intra kernel at >= 2 CTAs per SM, the state kernel within two waves at B=1, H=96 (among the entries that
ran right on an H200), no unbounded-gate fallback compiled for K3's bounded gate. Only the kernels checked are compiled (Triton's disk cache keeps reruns fast).
"""

from __future__ import annotations

import pytest

from k3x.bench import kernel_resources as kr

H200 = kr.SMS[90]


def test_occupancy_limits():
    assert kr.occupancy(255, 10240, 8, H200) == (1, "regs")  # 8 warps x 8192 regs fill the register file
    assert kr.occupancy(128, 10240, 4, H200) == (4, "regs")
    assert kr.occupancy(64, 131072, 4, H200) == (1, "smem")  # 2 x (128 KB + 1 KB) > 228 KB
    assert kr.occupancy(16, 0, 1, H200) == (32, "ctas")
    assert kr.occupancy(16, 0, 16, H200) == (4, "warps")


def test_registers_round_per_warp():
    # 129 registers are allocated as 136 per thread: 4352 per warp -> 15 warps -> 3 CTAs of 4 warps
    assert kr.occupancy(129, 0, 4, H200) == (3, "regs")


def test_markdown_reports_errors_as_rows():
    rows = [kr.Resources("kda", "c", "(plan)", 90, error="KeyError: 'scale'")]
    assert "error: KeyError" in kr.markdown(rows)


@pytest.fixture(scope="module")
def k3_prefill_b1():
    """KDA's chunked kernels at K3's prefill shape (B=1, T=4096, H=96, K=V=128, bf16, gate >= -5), sm_90a."""
    rows = kr.measure_case(kr.kda_case(1, 4096), H200)
    assert not [r.error for r in rows if r.error]
    return {r.kernel: r for r in rows}


def test_kda_chunked_kernels_do_not_spill(k3_prefill_b1):
    for r in k3_prefill_b1.values():
        assert not r.spills, f"{r.kernel}: stack {r.stack} B, {r.spill_ld} LDL / {r.spill_st} STL"


def test_kda_intra_two_ctas_per_sm_with_pipelined_loads(k3_prefill_b1):
    r = k3_prefill_b1["_kda_intra_kernel"]
    assert r.ctas_per_sm >= 2 and r.stages >= 2, (r.regs, r.shared, r.warps, r.stages)


def test_kda_state_kernel_within_two_waves_at_b1_h96(k3_prefill_b1):
    """Among the entries that run right on the H200 (two stages or BV=64), K3's prefill at B=1 fills at most two
    waves of the state kernel (BV=64, 192 CTAs at one per SM)."""
    r = k3_prefill_b1["_kda_state_kernel"]
    assert r.grid_ctas == 96 * 128 // 64 and r.waves <= 2.0, (r.grid_ctas, r.ctas_per_sm, r.regs, r.shared)


def test_kda_state_configs_that_ran_wrong_are_never_chosen():
    """The single-stage BV 16/32 entries (three of the four read shared memory out of bounds or gave wrong
    values on an H200 with Triton 3.6): no shape picks them; the two-stage and BV=64 entries stay choosable."""
    from k3x.custom_ops.kda import triton as kt

    bad = {(16, 4, 1), (32, 4, 1), (16, 8, 1), (32, 8, 1)}
    assert {k for k in kt.STATE_RESOURCES_SM90 if not kt.state_config_runs_right(k)} == bad
    for B in (1, 2, 7, 64, 256):
        for H in (1, 2, 8, 64, 96):
            for K in (16, 64, 128):
                state = kt.kda_chunk_launch_config(B, 4096, H, K, K)["state"]
                assert (state["BV"], state["num_warps"], state["num_stages"]) not in bad, (B, H, K, state)


def test_kda_launch_tables_match_the_compiled_kernels(k3_prefill_b1):
    """The resource tables the launch configuration is chosen from are what the compiler produces."""
    from k3x.custom_ops.kda import triton as kt

    cfg = kt.kda_chunk_launch_config(1, 4096, 96, 128, 128)
    for kernel, table, key in (
            ("_kda_intra_kernel", kt.INTRA_RESOURCES_SM90, (cfg["intra"]["BK"], cfg["intra"]["num_warps"],
                                                            cfg["intra"]["num_stages"])),
            ("_kda_state_kernel", kt.STATE_RESOURCES_SM90, (cfg["state"]["BV"], cfg["state"]["num_warps"],
                                                            cfg["state"]["num_stages"]))):
        r = k3_prefill_b1[kernel]
        regs, shared, spills = table[key]
        assert (r.regs, r.shared, r.spills) == (regs, shared, spills), (kernel, key)
        assert kt.ctas_per_sm(regs, shared, key[1]) == r.ctas_per_sm


def test_bounded_gate_compiles_no_fallback():
    """K3's gate bound selects an intra kernel without the pairwise path: far less code than the unbounded one."""
    bounded = kr.measure_case(kr.kda_case(1, 4096), H200, kernels=("_kda_intra_kernel",))[0]
    unbounded = kr.measure_case(kr.kda_case(1, 4096, gate_lower_bound=None), H200, kernels=("_kda_intra_kernel",))[0]
    assert not bounded.error and not unbounded.error
    assert bounded.sass < 0.8 * unbounded.sass, (bounded.sass, unbounded.sass)


def test_attn_res_double_buffered_keeps_occupancy():
    """Two [NS, BD] tiles in flight per CTA (prefetch), still no spills and >= 4 CTAs per SM at K3's shape:
    >= 4 MB of loads in flight over the H200's 132 SMs."""
    case = next(c for c in kr.cases() if c.family == "attn_res")
    (r,) = kr.measure_case(case, H200)
    assert not r.error and not r.spills and r.ctas_per_sm >= 4, (r.regs, r.shared, r.ctas_per_sm)
    plan = kr.family_plan(case)
    c = plan.select(case.dims).launches[0].constexprs
    tile_bytes = (c["N"] + 1) * c["BD"] * 2  # bf16 sources of one tile
    assert r.ctas_per_sm * H200.sms * 2 * tile_bytes >= 4e6


MOE_GEMMS = ("_moe_gemm1_kernel", "_moe_gemm2_kernel", "_moe_mxfp4_gemm1_kernel", "_moe_mxfp4_gemm2_kernel")


@pytest.fixture(scope="module")
def k3_moe_gemms():
    """The grouped GEMMs (dense bf16 and MXFP4) at K3's decode (N = 1, 64) and prefill (N = 4096) shapes, sm_90a."""
    rows = {}
    for packed in (False, True):
        for N in (1, 64, 4096):
            for r in kr.measure_case(kr.moe_case(N, packed=packed), H200, kernels=MOE_GEMMS):
                assert not r.error, (r.case, r.kernel, r.error)
                rows[(N, r.kernel)] = r
    assert len(rows) == 12
    return rows


def test_moe_gemms_spill_free_on_wgmma(k3_moe_gemms):
    """No spills anywhere; decode tiles (16 token rows) run on wgmma too, because swap-AB puts 64–128 weight rows
    on the MMA's M side (16-row tiles compiled to mma.sync before)."""
    for (N, kernel), r in k3_moe_gemms.items():
        assert not r.spills, f"{kernel} @ N={N}: stack {r.stack} B, {r.spill_ld} LDL / {r.spill_st} STL"
        assert r.wgmma, f"{kernel} @ N={N}: no wgmma"


def test_down_projection_weights_through_tma(k3_moe_gemms):
    """GEMM2 (dense w2, MXFP4 code bytes) loads its weight tiles with TMA (cp.async.bulk.tensor) on sm_90a."""
    for N in (1, 64, 4096):
        for kernel in ("_moe_gemm2_kernel", "_moe_mxfp4_gemm2_kernel"):
            assert k3_moe_gemms[(N, kernel)].tma, (kernel, N)


def test_packed_prefill_gemms_below_255_registers(k3_moe_gemms):
    for kernel in MOE_GEMMS[2:]:
        r = k3_moe_gemms[(4096, kernel)]
        assert r.regs < 255, (kernel, r.regs)


def test_moe_gemms_persistent_in_one_wave(k3_moe_gemms):
    """Persistent grids: at most SMs × CTAs per SM programs (prefill was 45,744–53,368 CTAs in 135–350 waves)."""
    for (N, kernel), r in k3_moe_gemms.items():
        assert r.grid_ctas <= H200.sms * r.ctas_per_sm and r.waves <= 1.0, (kernel, N, r.grid_ctas, r.ctas_per_sm)
    for kernel in MOE_GEMMS:
        r = k3_moe_gemms[(4096, kernel)]
        assert r.grid_ctas == H200.sms * r.ctas_per_sm, (kernel, r.grid_ctas, r.ctas_per_sm)


def _table_matches_the_compiler(cases: list, rows: dict) -> None:
    """Every GEMM launch of the cases' plans has the (registers, shared memory) it compiled to in
    `GEMM_RESOURCES_SM90` (`rows`: (N, kernel) -> measured)."""
    from k3x.custom_ops.moe import triton as mt

    for case in cases:
        for x in kr.family_plan(case).select(case.dims).launches:
            if x.kernel_name not in MOE_GEMMS:
                continue
            r = rows[(case.dims["N"], x.kernel_name)]
            key = mt.resource_key(x.kernel_name, x.constexprs, x.num_warps, x.num_stages)
            assert mt.GEMM_RESOURCES_SM90[key] == (r.regs, r.shared), (key, r.regs, r.shared)


def test_moe_gemm_resource_table_matches_the_compiler(k3_moe_gemms):
    """The table the persistent grids are sized from is what the compiler produces at K3's configurations."""
    _table_matches_the_compiler([kr.moe_case(N, packed=p) for N in (1, 4096) for p in (False, True)], k3_moe_gemms)


@pytest.fixture(scope="module")
def k3_w4a8_gemms():
    """The MXFP4 GEMMs with MXFP8 activations (W4A8) at K3's decode (N = 1) and prefill (N = 4096) shapes,
    sm_90a."""
    rows = {}
    for N in (1, 4096):
        for r in kr.measure_case(kr.moe_case(N, packed=True, activations="mxfp8"), H200, kernels=MOE_GEMMS[2:]):
            assert not r.error, (r.case, r.kernel, r.error)
            rows[(N, r.kernel)] = r
    assert len(rows) == 4
    return rows


def test_w4a8_gemms_use_fp8_wgmma_on_sm90a(k3_w4a8_gemms):
    """activations="mxfp8" on Hopper: both packed GEMMs take their MXFP8 codes and the E4M3-recoded weights
    into FP8 wgmma (e4m3 × e4m3, k = 32: one E8M0 block per MMA, scales applied outside it) and into no other
    MMA, at decode (swap-AB) and prefill; no spills, one persistent wave."""
    for (N, kernel), r in k3_w4a8_gemms.items():
        kinds = r.mma.split(",")
        assert all(k.startswith("wgmma.mma_async.") and k.endswith("k32.f32.e4m3.e4m3") for k in kinds), (
            N, kernel, r.mma)
        assert not r.spills and r.waves <= 1.0, (N, kernel, r.stack, r.spill_ld, r.spill_st, r.waves)


def test_w4a8_resource_table_matches_the_compiler(k3_w4a8_gemms):
    """The Hopper W4A8 GEMMs' persistent grids are sized from their own ("fp8") entries, which are what the
    compiler produces."""
    _table_matches_the_compiler([kr.moe_case(N, packed=True, activations="mxfp8") for N in (1, 4096)],
                                k3_w4a8_gemms)


def test_w4a8_gemms_use_block_scaled_mma_on_sm100a():
    """activations="mxfp8": both packed GEMMs quantize their activation tiles and hand E4M3 codes + E8M0 scales
    with the E2M1 weights to tcgen05's block-scaled MMA (kind::mxf8f6f4) at decode (swap-AB, 128 weight rows)
    and prefill (128 activation rows), without spills."""
    for N in (1, 4096):
        case = kr.moe_case(N, packed=True, activations="mxfp8")
        rows = kr.measure_case(case, kr.SMS[100], kernels=MOE_GEMMS[2:])
        assert len(rows) == 2
        for r in rows:
            assert not r.error and r.mx_mma and not r.spills, (N, r.kernel, r.error, r.regs, r.stack)


@pytest.mark.parametrize("sm", [90, 100])
def test_fused_decode_one_wave_no_spills(sm):
    """k3::kda_decode at K3's shape: no spills, one wave at batch 64 (and batch 1) on sm_90a and sm_100a, the
    state moved about twice (read once, written once: everything else is ~8% on top), and the resource
    table the grid is sized from is what the compiler produces."""
    from k3x.custom_ops.kda_decode import triton as dt

    for B in (1, 64):
        case = kr.decode_case(B)
        (r,) = kr.measure_case(case, kr.SMS[sm])
        assert not r.error and not r.spills, (B, r.error, r.stack, r.spill_ld, r.spill_st)
        assert r.waves <= 1.0, (B, r.grid_ctas, r.ctas_per_sm)
        assert 2.0 <= r.extra["moved_vs_state"] < 2.2, r.extra
        if sm == 90:
            launch = kr.family_plan(case).select(case.dims).launches[0]
            key = (launch.num_warps, launch.constexprs["TILES"] > 1)
            assert dt.DECODE_RESOURCES_SM90[key] == (r.regs, r.shared, r.spills), (key, r.regs, r.shared)


def test_mla_decode_multiplies_bf16_on_tensor_cores():
    """The MLA split kernel at K3's decode (B=32, past 16K, H=96, C=512, R=64): bf16 operands into 16-bit MMAs
    (it widened to fp32 and ran tf32 MMAs before, with a 368-byte spill stack), fp32 accumulation."""
    case = next(c for c in kr.cases() if c.family == "mla_paged" and c.name == "B32-rows1-past16384")
    r = {x.kernel: x for x in kr.measure_case(case, H200)}["_mla_paged_split_kernel"]
    assert not r.error, r.error
    assert "f32.bf16.bf16" in r.mma and "tf32" not in r.mma and r.mma_sass > 0, r.mma
    assert r.stack <= 64, (r.stack, r.spill_ld, r.spill_st)
