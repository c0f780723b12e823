"""`expert_offset`, the expert-parallel argument of k3::moe and k3::moe_mxfp4 (reference, schema, plugin
check): routing over all E experts of gate_weight, only the pairs routed to the rank's E_local experts are
computed (the MXFP4 reference decodes only those), the ranks' partial sums add up to the whole MoE, and a
single-GPU call (no offset) is what it was."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.moe import reference as dense_ref
from k3x.custom_ops.moe.op import MoEOptions, moe
from k3x.custom_ops.moe_mxfp4 import reference as packed_ref
from k3x.custom_ops.moe_mxfp4.codec import dequantize
from tolerances import assert_close

HYPER = [2, 1.5, True, "situ", 4.0, 25.0]


def _inputs(N=11, d=16, L=32, I=32, E=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)
    gw, gb = torch.randn(E, d, generator=g) * d ** -0.5, torch.randn(E, generator=g) * 0.1
    packed = [torch.randint(0, 256, s, generator=g, dtype=torch.uint8) for s in ((E, I, L // 2),) * 2 + ((E, L, I // 2),)]
    scales = [torch.randint(118, 126, s, generator=g, dtype=torch.uint8)
              for s in ((E, I, L // 32),) * 2 + ((E, L, I // 32),)]
    return x, z, gw, gb, packed, scales


def _off(v: int) -> torch.Tensor:
    return torch.tensor([v], dtype=torch.int32)


def test_dense_ranks_add_up_and_offset_zero_is_the_single_gpu_op():
    x, z, gw, gb, packed, scales = _inputs()
    w = [dequantize(p, s) for p, s in zip(packed, scales)]
    whole = dense_ref.moe(x, z, gw, gb, *w, *HYPER)
    assert torch.equal(dense_ref.moe(x, z, gw, gb, *w, *HYPER, _off(0)), whole)  # E_local = E, offset 0
    parts = [dense_ref.moe(x, z, gw, gb, *(t[r * 2:(r + 1) * 2] for t in w), *HYPER, _off(r * 2)) for r in range(4)]
    assert_close(sum(parts), whole, torch.float32, what="EP=4 sum")


def test_packed_rank_decodes_only_its_routed_experts(monkeypatch):
    x, z, gw, gb, packed, scales = _inputs(N=3)
    ids, _ = dense_ref.route(x, gw, gb, 2, 1.5, True)
    decoded: list[int] = []
    real = packed_ref.dequantize

    def spy(p, s, *a):
        decoded.append(p.data_ptr())
        return real(p, s, *a)

    monkeypatch.setattr(packed_ref, "dequantize", spy)
    for r in range(4):
        decoded.clear()
        local = [t[r * 2:(r + 1) * 2] for t in packed + scales]
        packed_ref.moe(x, z, gw, gb, *local, *HYPER, _off(r * 2))
        hit = {e for e in ids.flatten().tolist() if r * 2 <= e < r * 2 + 2}
        assert len(decoded) == 3 * len(hit), (r, hit)  # w1, w3, w2 of each local expert a token is routed to


def test_rank_with_no_routed_pair_returns_zeros():
    x, z, gw, gb, packed, scales = _inputs()
    gb = gb.clone()
    gb[:2] += 100.0  # every token picks experts 0 and 1 (top-2): ranks 1..3 get nothing
    w = [dequantize(p, s) for p, s in zip(packed, scales)]
    u = dense_ref.moe(x, z, gw, gb, *(t[2:4] for t in w), *HYPER, _off(2))
    assert torch.equal(u, torch.zeros_like(u))


def test_op_schema_takes_the_offset_and_checks_it():
    x, z, gw, gb, packed, scales = _inputs()
    w = [dequantize(p, s)[:4] for p, s in zip(packed, scales)]  # E_local = 4 of E = 8
    opts = MoEOptions(*HYPER)
    u = moe(x, z, gw, gb, *w, options=opts, expert_offset=_off(4))
    assert_close(u, dense_ref.moe(x, z, gw, gb, *w, *HYPER, _off(4)), torch.float32, what="op")
    torch.library.opcheck(torch.ops.k3.moe.default, (x, z, gw, gb, *w, *HYPER, "reference", _off(4)))
    with pytest.raises(ValueError, match="gate"):  # 8 routed experts, 4 held: needs the offset
        moe(x, z, gw, gb, *w, options=opts)
    with pytest.raises(ValueError, match="expert_offset"):
        moe(x, z, gw, gb, *w, options=opts, expert_offset=torch.tensor([4.0]))


def test_plugin_check_takes_the_offset_port():
    from k3x.custom_ops.moe.plugin import check

    attrs = {"top_k": 2, "num_experts": 4, "hidden_size": 16, "expert_dim": 32, "intermediate_size": 32}
    shapes = [[5, 16], [5, 32], [8, 16], [8], [4, 32, 32], [4, 32, 32], [4, 32, 32], [1]]
    assert check(shapes, attrs) is None  # gate over 8 experts, 4 local
    assert "fewer than w1's 4" in check([[5, 16], [5, 32], [2, 16], [2]] + shapes[4:], attrs)
    assert "expert_offset has shape [2]" in check(shapes[:-1] + [[2]], attrs)
