"""bench/kernel_roofline.py and kernel_resources' coverage: every op family has cases (the serving families
kda_packed, kda_prep and mla_paged included), each row carries its op's roofline (FLOPs, compulsory bytes, the
floor on the SM's GPUs) and the tensor-core / FMA instruction counts that show which loops run on MMAs."""

from __future__ import annotations

import pytest

from k3x.bench import kernel_resources as kr
from k3x.bench import kernel_roofline as rl
from k3x.custom_ops.registry import families


def test_every_family_has_cases_at_k3_shapes():
    """Every family with Triton kernels (a CPU-only family has none: registry.CPU_ONLY)."""
    assert {c.family for c in kr.cases()} == {f.name for f in families() if f.gpu}


def test_every_case_has_a_roofline():
    for c in kr.cases():
        est = kr.roofline(c, 90)
        assert est["GFLOP"] > 0 and est["MB"] > 0 and est["floor_us_H200"] <= est["floor_us_H100"], c.name
        assert set(kr.roofline(c, 100)) >= {"floor_us_B200", "bound_B200"}, c.name


def test_mla_decode_reads_the_past_latents_once():
    """B=1 past 1M (H=96, C=512, R=64): 1,048,576 x 576 bf16 latents = 1.21 GB; ~180 FLOP a byte, just under the
    H200's ridge (989 / 4.8 = 206): memory-bound, floor = bytes / 4.8 TB/s."""
    case = next(c for c in kr.cases() if c.family == "mla_paged" and c.name == "B1-rows1-past1048576")
    flops, nbytes = rl.op_cost("mla_paged", case.dims, case.attrs)
    assert nbytes == pytest.approx((1 << 20) * 576 * 2, rel=1e-3)
    assert flops == pytest.approx(((1 << 20) + 1) * 96 * (2 * 576 + 2 * 512))
    est = rl.estimate("mla_paged", case.dims, case.attrs, "H200")
    assert est["bound_H200"] == "memory" and est["floor_us_H200"] == pytest.approx(nbytes / 4.8e6, rel=1e-3)


def test_kda_decode_moves_the_fp32_state_twice_and_w4a8_uses_the_fp8_peak():
    d = {"B": 64, "T": 1, "H": 96, "K": 128, "V": 128}
    _, nbytes = rl.op_cost("kda", d, {})
    state = 64 * 96 * 128 * 128 * 4
    assert 2 * state < nbytes < 2.05 * state  # the tokens add ~1 %
    moe = {"N": 8192, "d": 7168, "L": 3584, "E": 896, "I": 3072}
    a16 = rl.estimate("moe_mxfp4", moe, {"top_k": 16}, "H200")
    a8 = rl.estimate("moe_mxfp4", moe, {"top_k": 16, "activations": "mxfp8"}, "H200")
    assert a16["bound_H200"] == a8["bound_H200"] == "compute"
    assert a8["floor_us_H200"] == pytest.approx(a16["floor_us_H200"] / 2, rel=1e-2)


def test_a_serving_kernel_row_carries_instruction_counts_and_its_roofline():
    """kda_prep at a 64-sequence decode step, compiled for sm_90a: no errors, no spills, the counts filled."""
    case = next(c for c in kr.cases() if c.family == "kda_prep" and c.name.startswith("N64-"))
    rows = kr.measure_case(case, kr.SMS[90])
    assert rows and not [r.error for r in rows if r.error]
    r = rows[0]
    assert not r.spills and r.sass > 0 and r.ffma > 0 and r.mma_sass == 0  # element-wise: no MMA belongs here
    assert r.extra["bound_H200"] == "memory" and r.extra["floor_us_H200"] > 0
