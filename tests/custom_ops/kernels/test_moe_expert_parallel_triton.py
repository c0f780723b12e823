"""Expert parallelism in the MoE Triton plans (routing over all E experts, only the pairs of this rank's
E_local experts aligned, computed and summed; `expert_offset` as an op argument) vs the reference, for the
dense and the MXFP4 family, including a rank no token is routed to."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.moe import reference as dense_ref
from k3x.custom_ops.moe import triton as dense_kernels
from k3x.custom_ops.moe_mxfp4 import reference as packed_ref
from k3x.custom_ops.moe_mxfp4 import triton as packed_kernels
from tolerances import assert_close


def _routing(N, d, E, hot, g):
    x = torch.randn(N, d, generator=g)
    gate_weight, gate_bias = torch.randn(E, d, generator=g) * d ** -0.5, torch.randn(E, generator=g) * 0.1
    if hot is not None:
        gate_bias[hot] = 100.0
    return x, gate_weight, gate_bias


def _experts(packed: bool, E, L, I, g):
    if packed:
        u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
        sc = lambda *s: torch.randint(118, 126, s, generator=g, dtype=torch.uint8)  # noqa: E731
        return [u8(E, I, L // 2), u8(E, I, L // 2), u8(E, L, I // 2), sc(E, I, L // 32), sc(E, I, L // 32),
                sc(E, L, I // 32)]
    return [torch.randn(E, I, L, generator=g) * L ** -0.5, torch.randn(E, I, L, generator=g) * L ** -0.5,
            torch.randn(E, L, I, generator=g) * I ** -0.5]


@pytest.mark.parametrize("packed", [False, True], ids=["dense", "mxfp4"])
@pytest.mark.parametrize("N, E, ep, k, hot", [
    (13, 8, 2, 3, None),  # random routing over 2 ranks
    (7, 8, 4, 2, 1),  # every token's first expert on rank 0; ranks 2, 3 may get nothing
    (1, 6, 3, 6, None),  # decode, top_k = E: every rank gets every token
])
def test_rank_partial_sums(packed, N, E, ep, k, hot, device):
    g = torch.Generator().manual_seed(N * 10 + E)
    d, L, I = 16, 64, 32
    x, gw, gb = _routing(N, d, E, hot, g)
    z = torch.randn(N, L, generator=g)
    w = _experts(packed, E, L, I, g)
    ref, kern = (packed_ref, packed_kernels) if packed else (dense_ref, dense_kernels)
    hyper = [k, 1.5, True, "situ", 4.0, 25.0]
    n, parts = E // ep, []
    for r in range(ep):
        off = torch.tensor([r * n], dtype=torch.int32)
        local = [t[r * n:(r + 1) * n] for t in w]
        args = [t.to(device) for t in [x, z, gw, gb, *local]] + hyper + [off.to(device)]
        out = kern.moe(*args)
        want = ref.moe(*[t.cpu() if isinstance(t, torch.Tensor) else t for t in args])
        assert_close(out.cpu(), want, torch.float32, what=f"rank {r} of {ep}")
        parts.append(out.cpu())
    whole = ref.moe(x, z, gw, gb, *w, *hyper)
    assert_close(sum(parts), whole, torch.float32, what="sum of the ranks")
