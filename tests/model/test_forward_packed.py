"""KimiDeltaAttention.forward_packed (one serving step over packed sequences, pool-indexed state) equals
`forward` run per sequence from that sequence's state, and exports with dynamic N (tokens) and B (sequences)."""

from __future__ import annotations

import pytest
import torch

from packed_steps import LayerStep, kda_layer, layer_step
from tolerances import assert_close


@pytest.mark.parametrize("lens", [
    pytest.param([1], id="decode"),
    pytest.param([2], id="shorter-than-W-1"),
    pytest.param([1, 2, 3, 4, 5], id="around-W"),
    pytest.param([70, 1, 2, 1, 64], id="prefill-and-decode"),
])
def test_matches_forward_per_sequence(lens):
    m = kda_layer()
    x, conv_pool, rec_pool, cu, slots = layer_step(m, lens, seed=len(lens))
    pools = conv_pool.clone(), rec_pool.clone()
    with torch.no_grad():
        y, new_conv, new_rec = m.forward_packed(x, conv_pool, rec_pool, cu, slots, kernels="reference")
        for b, slot in enumerate(slots.tolist()):
            a, e = cu[b].item(), cu[b + 1].item()
            yb, cb, rb = m(x[None, a:e], conv_pool[slot: slot + 1], rec_pool[slot: slot + 1])
            assert_close(y[a:e], yb[0], torch.float32, f"y of sequence {b}")
            assert_close(new_conv[b], cb[0], torch.float32, f"new conv of sequence {b}")
            assert_close(new_rec[b], rb[0], torch.float32, f"new recurrent of sequence {b}")
    assert new_conv.dtype == new_rec.dtype == torch.float32
    assert torch.equal(pools[0], conv_pool) and torch.equal(pools[1], rec_pool), "a pool was written"


def test_short_sequence_keeps_old_conv_columns():
    """A 1-row sequence's new conv state is its old state shifted by one column plus the new input."""
    m = kda_layer()
    x, conv_pool, rec_pool, cu, slots = layer_step(m, [1, 3])
    with torch.no_grad():
        _, new_conv, _ = m.forward_packed(x, conv_pool, rec_pool, cu, slots, kernels="reference")
        first = torch.cat([m.q_proj(x[:1]), m.k_proj(x[:1]), m.v_proj(x[:1])], -1)[0]
    assert torch.equal(new_conv[0, :, :-1], conv_pool[slots[0], :, 1:])
    assert_close(new_conv[0, :, -1], first, torch.float32, "new input column")


def test_exports_with_dynamic_tokens_and_sequences():
    from torch.export import Dim, export

    m = kda_layer()
    N, B, S = Dim("N", min=1, max=4096), Dim("B", min=1, max=256), Dim("S", min=1, max=1024)
    shapes = {"x": {0: N}, "conv_pool": {0: S}, "rec_pool": {0: S}, "cu_seqlens": {0: B + 1}, "slots": {0: B}}
    with torch.no_grad():
        ep = export(LayerStep(m), layer_step(m, [5, 1, 3]), dynamic_shapes=shapes)
        for lens in ([1], [70, 1, 2], [2, 2, 2, 2, 9]):  # other N and B than traced
            args = layer_step(m, lens, S=7, seed=sum(lens))
            for got, want in zip(ep.module()(*args), LayerStep(m)(*args)):
                assert_close(got, want, torch.float32, f"exported {lens}")
    ops = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "k3.kda_packed.default" in ops
