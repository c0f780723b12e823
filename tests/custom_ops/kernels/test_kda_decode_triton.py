"""k3::kda_decode Triton (the fused decode kernel) vs the unfused reference over 64 decode steps at batch 1 and
7, 8 steps at batch 64 (both forms of the kernel, then the pools carried, at conv width 3),
slots a permutation of a pool with spare rows: each side carries its own pools from step to step.
Interpreter cases are fp32 and small (one head where the batch is large: the interpreter runs programs one by
one, so its cost is steps x B x H: 64 steps at batch 64 took 113 s of the CI's interpreter run)."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.kda_decode import reference
from k3x.custom_ops.kda_decode import triton as kernels
from packed_steps import decode_step, decode_token
from tolerances import assert_close

STEPS = 64


def run_steps(B: int, H: int, K: int, V: int, W: int, lb: float | None, steps: int, device: str) -> None:
    """`steps` decode steps of the fused kernel vs the reference, each side carrying its own pools. The fused
    side alternates its two forms on one pool chain: even steps the pure form (new rows out, written back to
    pool[slots] as the serving runtime does), odd steps the in-place form (the kernel writes the slot rows)."""
    args = decode_step(B, H=H, K=K, V=V, W=W, S=B + 5, seed=B)
    weights, slots = args[4:8], args[10]
    ref_pools = [args[8].clone(), args[9].clone()]
    pools = [x.clone().to(device) for x in ref_pools]
    spare = [i for i in range(B + 5) if i not in slots.tolist()]
    untouched = [x[spare].clone() for x in ref_pools]
    gen = torch.Generator().manual_seed(100 + B)
    token, sl = args[:4], slots.to(device)
    attrs = {"scale": K ** -0.5, "eps": 1e-5, "gate_lower_bound": lb}
    for step in range(steps):
        ro, rc, rs = reference.kda_decode(*token, *weights, *ref_pools, slots, scale=K ** -0.5, eps=1e-5,
                                          gate_lower_bound=lb or 0.0)
        ref_pools[0][slots.long()], ref_pools[1][slots.long()] = rc, rs
        ins = [x.to(device) for x in (*token, *weights)]
        if step % 2 == 0:
            o, c, s = kernels.kda_decode(*ins, *pools, sl, **attrs)
            assert_close(c.cpu(), rc, torch.float32, f"B{B} step {step}: new conv")
            assert_close(s.cpu(), rs, torch.float32, f"B{B} step {step}: new state")
            pools[0][sl.long()], pools[1][sl.long()] = c, s
        else:
            o, _, _ = kernels.kda_decode(*ins, *pools, sl, **attrs, in_place=True)
        assert_close(o.cpu(), ro, torch.float32, f"B{B} step {step}: o")
        token = decode_token(B, H, K, V, gen)
    for name, a, e in zip(("conv pool", "state pool"), pools, ref_pools):
        assert_close(a.cpu(), e, torch.float32, f"B{B} after {steps} steps: {name}")
    assert all(torch.equal(a.cpu()[spare], u) for a, u in zip(pools, untouched)), "a spare slot was written"


@pytest.mark.parametrize("B,H,V,W,steps", [(1, 2, 32, 4, STEPS), (7, 1, 16, 4, STEPS), (64, 1, 16, 3, 8)],
                         ids=["B1", "B7", "B64"])
def test_steps_match_reference(B, H, V, W, steps, device):
    """K3's gate (lower bound -5), slots a permutation of a pool with spare rows."""
    run_steps(B, H, 16, V, W, -5.0, steps, device)


def test_kimi_linear_gate(device):
    """The unbounded gate (gate_lower_bound 0 / None), a few steps at B = 7."""
    run_steps(7, 2, 16, 16, 4, None, 6, device)


def test_grid_is_one_wave_at_batch_64():
    """K3's shape: 96 heads; the plan's grid at B = 64 fits one wave of sm_90 CTAs (DECODE_RESOURCES_SM90)."""
    d = {"B": 64, "H": 96, "K": 128, "V": 128, "W": 4}
    launch = kernels.plan(d, ["bf16"], {"scale": 128 ** -0.5, "eps": 1e-5}).select(d).launches[0]
    grid = launch.grid(d)
    regs, shared, spills = kernels.DECODE_RESOURCES_SM90[(launch.num_warps, launch.constexprs["TILES"] > 1)]
    from k3x.plan.launch import SM90_SMS, ctas_per_sm

    assert not spills and grid[0] * grid[1] <= SM90_SMS * ctas_per_sm(regs, shared, launch.num_warps)
    one = {**d, "B": 1}  # planned at batch 1 (the JIT plans per call): one tile per program, 96 programs
    first = kernels.plan(one, ["bf16"], {"scale": 128 ** -0.5, "eps": 1e-5}).select(one).launches[0]
    assert first.grid(one) == (96, 1, 1)
