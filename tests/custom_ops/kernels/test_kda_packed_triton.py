"""k3::kda_packed Triton (kda's kernels in packed mode) vs the packed reference: decode rows, prefill
chunks with tails, mixed steps (both variants of the plan), permuted slots. Interpreter cases are fp32 and small."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.kda_packed import reference
from k3x.custom_ops.kda_packed import triton as kernels
from packed_steps import kda_step
from tolerances import assert_close


def _inputs(lens, H, K, V, device, seed=0):
    return [x.to(device) for x in kda_step(lens, H=H, K=K, V=V, S=len(lens) + 2, seed=seed)]


@pytest.mark.parametrize("lens,H,K,V,variant", [
    pytest.param([1, 1, 1], 2, 16, 32, "recurrent", id="decode-B3"),
    pytest.param([3, 1, 14], 1, 16, 16, "recurrent", id="short-appends"),
    pytest.param([16, 17], 1, 16, 16, "mixed", id="split-at-16-17"),
    pytest.param([17], 2, 16, 16, "mixed", id="one-prefill-17"),
    pytest.param([1, 65, 2, 70], 3, 16, 32, "mixed", id="mixed-tails"),
    pytest.param([64, 1, 129], 1, 32, 16, "mixed", id="whole-chunks"),
])
def test_matches_reference(lens, H, K, V, variant, device):
    args = _inputs(lens, H, K, V, device, seed=len(lens))
    pool = args[5].clone()
    d = kernels.dims([tuple(x.shape) for x in args])
    assert kernels.plan(d, ["fp32"], {"scale": K ** -0.5, "gate_lower_bound": -5.0}).select(d).name == variant
    o, s = kernels.kda_packed(*args, scale=K ** -0.5, gate_lower_bound=-5.0)
    ro, rs = reference.kda_packed(*(x.cpu() for x in args), scale=K ** -0.5)
    assert_close(o.cpu(), ro, torch.float32, f"{lens}: o")
    assert_close(s.cpu(), rs, torch.float32, f"{lens}: final state")
    assert torch.equal(args[5], pool), "the pool was written"


def test_unbounded_gate_variant(device):
    """Without a gate bound (Kimi Linear) the mixed variant's intra kernel keeps the pairwise fallback."""
    args = _inputs([20, 1, 40], 2, 16, 16, device, seed=3)
    args[3] = args[3] * 4.0  # gates down to -20: 16-row spans past 80
    d = kernels.dims([tuple(x.shape) for x in args])
    assert kernels.plan(d, ["fp32"], {"scale": 0.25}).select(d).name == "mixed-unbounded-gate"
    o, s = kernels.kda_packed(*args, scale=0.25)
    ro, rs = reference.kda_packed(*(x.cpu() for x in args), scale=0.25)
    assert_close(o.cpu(), ro, torch.float32, "o")
    assert_close(s.cpu(), rs, torch.float32, "final state")


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [[1] * 64, [1] * 31 + [300, 17, 1000]], ids=["decode-B64", "mixed-B34"])
def test_op_bf16_gpu(lens, device):
    """torch.ops.k3.kda_packed with kernels='triton' at K3's head dims, bf16."""
    q, k, v, g, beta, pool, cu, slots = (x.to(device) for x in kda_step(lens, H=4, K=128, V=128, dtype=torch.bfloat16))
    o, s = torch.ops.k3.kda_packed(q, k, v, g, beta, pool, cu, slots, 128 ** -0.5, "triton", -5.0)
    ro, rs = reference.kda_packed(q, k, v, g, beta, pool, cu, slots, scale=128 ** -0.5)
    assert_close(o, ro, torch.bfloat16, "o")
    assert_close(s, rs, torch.bfloat16, "final state")
