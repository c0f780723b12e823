"""k3::kda_packed (reference): B sequences packed end to end, each from its own pool row, equal k3::kda run
sequence by sequence from those rows; the pool is never written; opcheck and the shape rule."""

from __future__ import annotations

import pytest
import torch

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.kda_packed import kda_packed, kda_packed_output_shapes
from k3x.custom_ops.kda_packed.reference import kda_packed as kda_packed_reference
from packed_steps import kda_step as packed_inputs
from tolerances import assert_close

CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")  # as test_opcheck.py


def per_sequence(q, k, v, g, beta, pool, cu, slots):
    """k3::kda run once per sequence from its pool row: the packed op's definition."""
    outs, finals = [], []
    for b, slot in enumerate(slots.tolist()):
        a, e = cu[b].item(), cu[b + 1].item()
        o, s = torch.ops.k3.kda(*(x[None, a:e] for x in (q, k, v, g, beta)), pool[slot: slot + 1],
                                q.shape[-1] ** -0.5, "reference")
        outs.append(o[0])
        finals.append(s[0])
    return torch.cat(outs), torch.stack(finals)


LENGTHS = [
    pytest.param([1], id="one-decode-row"),
    pytest.param([2], id="two-rows"),
    pytest.param([15, 63], id="15-63"),
    pytest.param([64, 65], id="64-65"),
    pytest.param([1, 1, 1, 1], id="decode-batch"),
    pytest.param([65, 1, 2, 15, 1, 64, 63], id="mixed-B7"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("lens", LENGTHS)
def test_matches_kda_sequence_by_sequence(lens, dtype):
    args = packed_inputs(lens, dtype=dtype, seed=len(lens))
    pool_before = args[5].clone()
    out = kda_packed(*args)
    o_ref, s_ref = per_sequence(*args)
    assert out.output.dtype == dtype and out.output.shape == args[2].shape
    assert out.final_state.shape == (len(lens), *args[5].shape[1:])
    assert_close(out.output, o_ref, dtype, "o")
    assert_close(out.final_state, s_ref, dtype, "final_state")
    assert torch.equal(args[5], pool_before), "the pool was written"


def test_each_sequence_starts_from_its_slot():
    """Swapping two slots swaps the two sequences' starting states: the slot index is honoured."""
    q, k, v, g, beta, pool, cu, slots = packed_inputs([3, 3])
    o1 = kda_packed(q, k, v, g, beta, pool, cu, slots).output
    o2 = kda_packed(q, k, v, g, beta, pool, cu, slots.flip(0)).output
    assert not torch.allclose(o1, o2)
    swapped = pool.clone()
    swapped[slots[0]], swapped[slots[1]] = pool[slots[1]], pool[slots[0]]
    assert_close(kda_packed(q, k, v, g, beta, swapped, cu, slots.flip(0)).output, o1, torch.float32, "o")


@pytest.mark.parametrize("bad,match", [
    (lambda cu, sl: (cu[:-1], sl), "cu_seqlens has"),
    (lambda cu, sl: (cu.flip(0), sl), "must rise"),
    (lambda cu, sl: (cu, sl.clone().fill_(0)), "distinct"),
    (lambda cu, sl: (cu, sl + 100), r"in \[0,"),
])
def test_bad_packing_names_the_input(bad, match):
    q, k, v, g, beta, pool, cu, slots = packed_inputs([2, 1, 3])
    cu, slots = bad(cu, slots)
    with pytest.raises(ValueError, match=match):
        kda_packed_reference(q, k, v, g, beta, pool, cu, slots)


@pytest.mark.parametrize("lens", [[1], [7, 1, 2], [67]], ids=["decode", "mixed", "chunk-tail"])
def test_opcheck(lens):
    q, k, v, g, beta, pool, cu, slots = packed_inputs(lens, H=3, K=8, V=12)
    args = (q, k, v, g, beta, pool, cu, slots, 8 ** -0.5, "reference", -5.0)
    torch.library.opcheck(torch.ops.k3.kda_packed.default, args, test_utils=CHECKS)
    o, s = torch.ops.k3.kda_packed(*args)
    assert (tuple(o.shape), tuple(s.shape)) == kda_packed_output_shapes(q.shape, v.shape, slots.shape)
    assert o.dtype == v.dtype and s.dtype == torch.float32
