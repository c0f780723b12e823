"""k3::kda_prep Triton (one fused kernel) vs the eager reference on packed steps: sequences of one row, of fewer
than W-1 rows and of many, an empty one, B = 1 to 7, slots a permutation of a pool with spare rows, both gates,
rows scaled over two orders of magnitude so the L2 norm matters. Interpreter cases are fp32 and small."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.kda_prep import reference
from k3x.custom_ops.kda_prep import triton as kernels
from k3x.plan.launch import run
from packed_steps import cu_seqlens, slots
from tolerances import assert_close

INPUTS = ("qkv", "f", "b", "conv_weight", "A_log", "dt_bias", "conv_pool", "cu_seqlens", "slots")
OUTPUTS = ("q", "k", "v", "g", "beta", "new_conv")


def prep_step(lens: list[int], H: int, K: int, V: int, W: int, seed: int = 0) -> list[torch.Tensor]:
    """k3::kda_prep's inputs, fp32: qkv, f, b, conv_weight, A_log, dt_bias, conv_pool (4 spare rows),
    cu_seqlens, slots."""
    gen = torch.Generator().manual_seed(seed)
    N, B, C, S = sum(lens), len(lens), 2 * H * K + H * V, len(lens) + 4
    r = lambda *s, a=1.0: torch.randn(*s, generator=gen) * a  # noqa: E731
    qkv = r(N, C) * torch.exp(r(N, 1, a=1.2))  # row scales ~0.1 .. ~10: q, k far from unit norm
    return [qkv, r(N, H, K, a=2.0), r(N, H), r(C, W, a=0.5), r(H + 1, a=0.5), r(H * K), r(S, C, W - 1, a=3.0),
            cu_seqlens(lens), slots(B, S, gen)]


def assert_outputs(got, want, what: str) -> None:
    for name, a, e in zip(OUTPUTS, got, want):
        assert_close(a.cpu(), e, torch.float32, f"{what}: {name}")


@pytest.mark.parametrize("lens,H,K,V,W,lb", [
    pytest.param([1, 2, 37, 1, 3], 2, 16, 16, 4, -5.0, id="mixed-B5-k3-gate"),
    pytest.param([5], 1, 16, 32, 3, 0.0, id="B1-kimi-gate"),
    pytest.param([1] * 7, 3, 16, 16, 4, -5.0, id="decode-B7"),
    pytest.param([2, 1, 20, 1, 1, 1], 3, 16, 32, 3, 0.0, id="mixed-B6-kimi-gate"),
])
def test_matches_reference(lens, H, K, V, W, lb, device):
    args = prep_step(lens, H, K, V, W, seed=len(lens) + W)
    pool = args[6].clone()
    ins = [x.to(device) for x in args]
    got = kernels.kda_prep(*ins, gate_lower_bound=lb)
    assert_outputs(got, reference.kda_prep(*args, gate_lower_bound=lb), f"{lens}")
    assert torch.equal(ins[6].cpu(), pool), "the pool was written"


def test_empty_sequence_keeps_its_state(device):
    """A sequence with no row (not in a serving step, but allowed by the packing): new_conv is its pool row."""
    args = prep_step([3, 0, 2], 2, 16, 16, 4, seed=3)
    got = kernels.kda_prep(*(x.to(device) for x in args), gate_lower_bound=-5.0)
    assert torch.equal(got[5][1].cpu(), args[6][args[8][1].long()]), "empty sequence: new_conv"
    assert_outputs(got, reference.kda_prep(*args, gate_lower_bound=-5.0), "[3, 0, 2]")


def test_plan_made_at_other_dims_runs_the_step(device):
    """A plugin plans once (at its profile's dims, here N = B = 1) and runs any step: grid and scalars follow."""
    args = [x.to(device) for x in prep_step([4, 1, 19], 2, 16, 32, 4, seed=5)]
    ports = dict(zip(INPUTS, args))
    N, B, C = args[0].shape[0], 3, args[0].shape[1]
    new = lambda *s: torch.full(s, float("nan"), device=device)  # noqa: E731
    outs = {"q": new(N, 2, 16), "k": new(N, 2, 16), "v": new(N, 2, 32), "g": new(N, 2, 16), "beta": new(N, 2),
            "new_conv": new(B, C, 3)}
    d = kernels.dims([tuple(x.shape) for x in args])
    run(kernels.plan(d | {"N": 1, "B": 1}, ["fp32"], {"gate_lower_bound": -5.0}), ports | outs, d)
    want = reference.kda_prep(*(x.cpu() for x in args), gate_lower_bound=-5.0)
    assert_outputs([outs[n] for n in OUTPUTS], want, "planned at N = B = 1")


def test_head_dims_outside_the_kernels_limits_are_refused():
    args = prep_step([2], 1, 8, 16, 4)
    with pytest.raises(ValueError, match="K=8, V=16"):
        kernels.kda_prep(*args)


def test_op_dispatches_to_the_kernel(allow_cpu_triton, device):
    args = [x.to(device) for x in prep_step([2, 3], 1, 16, 16, 4, seed=7)]
    got = torch.ops.k3.kda_prep(*args, "triton", -5.0)
    assert_outputs(got, reference.kda_prep(*(x.cpu() for x in args), gate_lower_bound=-5.0), "op")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1] * 64, [1] * 31 + [300, 2, 1000]], ids=["decode-B64", "mixed-B34"])
def test_op_bf16_gpu(lens, device):
    """torch.ops.k3.kda_prep with kernels='triton' at K3's head dims, bf16."""
    args = [x.to(device) for x in prep_step(lens, 4, 128, 128, 4, seed=len(lens))]
    args[:3] = [x.to(torch.bfloat16) for x in args[:3]]
    got = torch.ops.k3.kda_prep(*args, "triton", -5.0)
    want = reference.kda_prep(*args, gate_lower_bound=-5.0)
    for name, a, e in zip(OUTPUTS, got, want):
        assert_close(a, e, torch.bfloat16, name)
