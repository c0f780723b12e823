"""`torch.library.opcheck` for every k3 custom op: schema, fake impl vs the real kernel, dispatch under
aot_autograd with dynamic shapes — on decode (T=1), odd and tail sizes. The reference backend runs on CPU.

Also: the fake impls use the one shape rule of each op (`*_output_shape(s)`), checked directly.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.attn_res import attn_res_output_shape
from k3x.custom_ops.kda import kda_output_shapes
from k3x.custom_ops.moe import moe_output_shape

# opcheck's default suite minus autograd registration (the ops are inference-only; no input needs grad)
CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")


def kda_args(B: int, T: int, H: int, K: int, V: int) -> tuple:
    q = F.normalize(torch.randn(B, T, H, K), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K), dim=-1)
    v = torch.randn(B, T, H, V)
    g = -5.0 * torch.sigmoid(torch.randn(B, T, H, K))  # log-decay in [-5, 0)
    beta = torch.sigmoid(torch.randn(B, T, H))
    s0 = torch.randn(B, H, K, V) * 0.1
    return q, k, v, g, beta, s0, K ** -0.5, "reference"


@pytest.mark.parametrize("B,T,H,K,V", [
    pytest.param(1, 1, 2, 16, 16, id="B1-T1-H2-K16-V16"),  # decode step (recurrent path)
    pytest.param(2, 7, 3, 8, 12, id="B2-T7-H3-K8-V12"),  # odd T, K != V
    pytest.param(1, 67, 1, 16, 32, id="B1-T67-H1-K16-V32"),  # chunk tail (T not a multiple of 64)
])
def test_kda_opcheck(B, T, H, K, V):
    args = kda_args(B, T, H, K, V)
    torch.library.opcheck(torch.ops.k3.kda.default, args, test_utils=CHECKS)
    o, s = torch.ops.k3.kda(*args)
    assert (tuple(o.shape), tuple(s.shape)) == kda_output_shapes(args[0].shape, args[2].shape)
    assert o.dtype == args[2].dtype and s.dtype == torch.float32


@pytest.mark.parametrize("lead,N,d", [
    pytest.param((1, 1), 1, 8, id="B1-T1-N1-d8"),  # decode, one bank entry
    pytest.param((2, 5), 3, 33, id="B2-T5-N3-d33"),  # odd width
    pytest.param((7,), 8, 64, id="tokens7-N8-d64"),  # flattened tokens, K3's max bank (8 blocks)
])
def test_attn_res_opcheck(lead, N, d):
    prefix, bank = torch.randn(*lead, d), torch.randn(*lead, N, d)
    args = (prefix, bank, torch.rand(d) + 0.5, torch.randn(d) / d ** 0.5, 1e-5, "reference")
    torch.library.opcheck(torch.ops.k3.attn_res.default, args, test_utils=CHECKS)
    assert tuple(torch.ops.k3.attn_res(*args).shape) == attn_res_output_shape(prefix.shape)


@pytest.mark.parametrize("N,d,L,E,I,top_k,activation", [
    pytest.param(1, 16, 16, 4, 8, 2, "situ", id="N1-d16-L16-E4-I8-k2-situ"),  # decode, no latent (L = d)
    pytest.param(7, 24, 12, 5, 9, 3, "silu", id="N7-d24-L12-E5-I9-k3-silu"),  # odd sizes, latent L < d
    pytest.param(13, 32, 32, 8, 16, 1, "situ", id="N13-d32-L32-E8-I16-k1-situ"),  # top-1
])
def test_moe_opcheck(N, d, L, E, I, top_k, activation):
    x, z = torch.randn(N, d), torch.randn(N, L)
    args = (x, z, torch.randn(E, d) / d ** 0.5, torch.randn(E) * 0.02, torch.randn(E, I, L) / L ** 0.5,
            torch.randn(E, I, L) / L ** 0.5, torch.randn(E, L, I) / I ** 0.5, top_k, 1.0, True, activation,
            4.0, 25.0, "reference")
    torch.library.opcheck(torch.ops.k3.moe.default, args, test_utils=CHECKS)
    assert tuple(torch.ops.k3.moe(*args).shape) == moe_output_shape(z.shape)


def test_fake_impls_keep_symbolic_dims():
    """Under a ShapeEnv the fake impls return outputs whose dims are the inputs' symbols (no specialising)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    real = kda_args(2, 3, 5, 16, 32)
    mode = FakeTensorMode(shape_env=ShapeEnv())
    q, k, v, g, beta, s0, scale, backend = (mode.from_tensor(a, static_shapes=False) if isinstance(a, torch.Tensor)
                                            else a for a in real)
    with mode:
        o, s = torch.ops.k3.kda(q, k, v, g, beta, s0, scale, backend)
    assert all(isinstance(x, torch.SymInt) for x in (*o.shape, *s.shape))
    assert [str(x) for x in o.shape] == [str(x) for x in (*q.shape[:3], v.shape[3])]
    assert [str(x) for x in s.shape] == [str(x) for x in s0.shape]
