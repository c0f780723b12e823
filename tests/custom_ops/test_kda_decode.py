"""k3::kda_decode (reference): the fused decode step equals the serving layer's packed path (conv by gathers,
k3::kda_packed, RMSNorm, gate) on one-token steps; the in-place form writes exactly the slot rows the pure
form returns; opcheck and the shape rule; bad slots are named."""

from __future__ import annotations

import pytest
import torch

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.kda_decode import kda_decode, kda_decode_, kda_decode_output_shapes
from packed_steps import decode_step, kda_layer, layer_step
from tolerances import assert_close

CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")  # as test_opcheck.py


@pytest.mark.parametrize("B", [1, 5])
def test_layer_decode_equals_packed_path(B):
    """forward_decode (one fused op) == forward_packed on a step of one token per sequence, from the same pools."""
    m = kda_layer(seed=B)
    x, conv_pool, rec_pool, cu, slots = layer_step(m, [1] * B, seed=B)
    pools = conv_pool.clone(), rec_pool.clone()
    with torch.no_grad():
        y, conv, rec = m.forward_packed(x, conv_pool, rec_pool, cu, slots, kernels="reference")
        y2, conv2, rec2 = m.forward_decode(x, conv_pool, rec_pool, slots, kernels="reference")
    assert_close(y2, y, torch.float32, "y")
    assert_close(conv2, conv, torch.float32, "new conv")
    assert_close(rec2, rec, torch.float32, "new recurrent")
    assert torch.equal(conv_pool, pools[0]) and torch.equal(rec_pool, pools[1]), "a pool was written"


@pytest.mark.parametrize("lb", [-5.0, None], ids=["k3-gate", "kimi-linear-gate"])
def test_in_place_writes_the_slot_rows(lb):
    args = decode_step(4, seed=1)
    out = kda_decode(*args, eps=1e-5, gate_lower_bound=lb)
    conv_pool, state_pool, slots = args[8].clone(), args[9].clone(), args[10]
    o = kda_decode_(*args[:8], conv_pool, state_pool, slots, eps=1e-5, gate_lower_bound=lb)
    assert torch.equal(o, out.output)
    want_conv, want_state = args[8].clone(), args[9].clone()
    want_conv[slots.long()], want_state[slots.long()] = out.conv, out.state
    assert torch.equal(conv_pool, want_conv) and torch.equal(state_pool, want_state)


def test_gate_bound_is_applied():
    args = decode_step(3, seed=2)
    bounded = kda_decode(*args, eps=1e-5, gate_lower_bound=-5.0)
    unbounded = kda_decode(*args, eps=1e-5, gate_lower_bound=None)
    assert not torch.allclose(bounded.state, unbounded.state)


def test_bad_slots_name_the_input():
    args = list(decode_step(3))
    args[10] = torch.zeros(3, dtype=torch.int32)
    with pytest.raises(ValueError, match="slots"):
        kda_decode(*args, eps=1e-5)


@pytest.mark.parametrize("B", [1, 3])
def test_opcheck(B):
    args = decode_step(B, H=3, K=8, V=12, W=3)
    attrs = (8 ** -0.5, 1e-5, "reference", -5.0)
    torch.library.opcheck(torch.ops.k3.kda_decode.default, (*args, *attrs), test_utils=CHECKS)
    torch.library.opcheck(torch.ops.k3.kda_decode_.default, (*args[:8], args[8].clone(), args[9].clone(), args[10],
                                                             *attrs), test_utils=CHECKS)
    o, conv, state = torch.ops.k3.kda_decode(*args, *attrs)
    shapes = kda_decode_output_shapes(args[0].shape, args[3].shape, args[8].shape, args[9].shape)
    assert (tuple(o.shape), tuple(conv.shape), tuple(state.shape)) == shapes
    assert state.dtype == conv.dtype == torch.float32



def test_plugin_check_names_the_bad_port():
    from k3x.custom_ops.kda_decode.plugin import check

    args = decode_step(3, H=2, K=16, V=16, W=4)
    shapes = [tuple(x.shape) for x in args]
    attrs = {"num_heads": 2, "head_dim": 16, "value_dim": 16, "conv_kernel": 4}
    assert check(shapes, attrs) is None
    assert check(shapes, attrs | {"conv_kernel": 3}).startswith("field conv_kernel=3")
    bad = list(shapes)
    bad[0] = (3, 95)
    assert check(bad, attrs).startswith("qkv has shape")
    bad = list(shapes)
    bad[8] = (6, 96, 2)
    assert check(bad, attrs).startswith("conv_pool[1:] has shape")
