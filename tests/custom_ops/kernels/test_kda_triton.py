"""KDA Triton kernels vs the fp32 references (`kda_chunked`, `kda_recurrent`).

Interpreter cases are fp32 and small; `gpu` cases run bf16 at realistic sizes on CUDA only.
"""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.kda import reference
from k3x.custom_ops.kda import triton as kernels
from tolerances import assert_close


def _inputs(B, T, H, K, V, *, gate_min=-5.0, with_state=True, dtype=torch.float32, device="cpu"):
    q = reference.l2norm(torch.randn(B, T, H, K, device=device))
    k = reference.l2norm(torch.randn(B, T, H, K, device=device))
    v = torch.randn(B, T, H, V, device=device)
    g = torch.rand(B, T, H, K, device=device) * gate_min  # log-decay in [gate_min, 0]
    beta = torch.rand(B, T, H, device=device)
    h0 = torch.randn(B, H, K, V, device=device) if with_state else None
    return [x.to(dtype) for x in (q, k, v, g, beta)] + [h0]


def _check(out, ref, dtype, what):
    o, s = out
    ro, rs = ref
    assert o.dtype == ro.dtype and s.dtype == torch.float32, what
    assert_close(o, ro, dtype, what=f"{what}: o")
    assert_close(s, rs, dtype, what=f"{what}: final state")


def _p(B, T, H, K, V, with_state=True, gate_min=-5.0):
    return pytest.param(B, T, H, K, V, with_state, gate_min, id=f"B{B}-T{T}-H{H}-K{K}-V{V}-h0{int(with_state)}-g{gate_min:g}")


CHUNK_CASES = [
    _p(1, 1, 1, 16, 32),  # one token: a chunk that is all tail
    _p(2, 15, 3, 32, 16, False),  # H not a power of two, K != V, no initial state
    _p(1, 63, 3, 16, 32),  # one short of a chunk
    _p(1, 64, 1, 32, 16),  # exactly one chunk
    _p(1, 65, 3, 16, 16, False),  # one-token tail chunk
    _p(1, 130, 1, 16, 32),  # three chunks, state carried twice
    _p(1, 20, 1, 40, 80),  # several K-blocks (BK=16) and V-blocks (BV=64), both with masked tails
    _p(1, 64, 2, 32, 16, True, -20.0),  # unbounded Kimi Linear gate: pairwise diagonal blocks
]


def _bounds(gate_min):
    """The gate lower bounds a case may promise: none (unbounded-gate kernel) and, for K3-like gates, the bound
    that selects the kernel compiled without the fallback."""
    return (None, gate_min) if kernels.safe_gate(gate_min) else (None,)


@pytest.mark.parametrize("B, T, H, K, V, with_state, gate_min", CHUNK_CASES)
def test_kda_chunked_matches_reference(B, T, H, K, V, with_state, gate_min, device):
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, gate_min=gate_min, with_state=with_state, device=device)
    for lb in _bounds(gate_min):
        out = kernels.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=lb)
        _check(out, reference.kda_chunked(q, k, v, g, beta, initial_state=h0), torch.float32, f"chunked lb={lb}")
        _check(out, reference.kda_recurrent(q, k, v, g, beta, initial_state=h0), torch.float32,
               f"chunked vs recurrent lb={lb}")


def test_kda_plan_picks_the_gate_variant_on_the_host():
    """K3's bound compiles the intra kernel without the pairwise fallback; no bound (Kimi Linear) keeps it."""
    d = {"B": 1, "T": 128, "H": 2, "K": 32, "V": 32}
    bounded = kernels.plan(d, ["fp32"], {"scale": 0.1, "gate_lower_bound": -5.0}).select(d)
    unbounded = kernels.plan(d, ["fp32"], {"scale": 0.1}).select(d)
    too_low = kernels.plan(d, ["fp32"], {"scale": 0.1, "gate_lower_bound": -6.0}).select(d)
    assert (bounded.name, unbounded.name, too_low.name) == ("chunked", "chunked-unbounded-gate",
                                                            "chunked-unbounded-gate")
    assert bounded.launches[0].constexprs["SAFE_GATE"] and not unbounded.launches[0].constexprs["SAFE_GATE"]


def test_kda_chunked_mixed_dense_and_pairwise_blocks(device):
    """Sub-chunk 1 of each chunk has span > 80 (pairwise diagonal block), the others <= 80 (dense)."""
    q, k, v, g, beta, h0 = _inputs(1, 100, 2, 16, 16, device=device)
    steep = (torch.arange(100, device=device) // 16) % 4 == 1  # rows 16..31, 80..95
    g = torch.where(steep[None, :, None, None], g * 3.0, g)  # gate down to -15 there
    out = kernels.kda_chunked(q, k, v, g, beta, initial_state=h0)
    _check(out, reference.kda_recurrent(q, k, v, g, beta, initial_state=h0), torch.float32, "mixed")


@pytest.mark.parametrize("B, T, H, K, V, with_state, gate_min", [
    _p(1, 1, 1, 16, 32),  # decode step
    _p(2, 1, 3, 32, 16, False),  # decode, batch, no state
    _p(1, 15, 3, 16, 16, True, -20.0),  # short append with an unbounded gate
    _p(1, 5, 1, 48, 80),  # K, V not powers of two
])
def test_kda_recurrent_matches_reference(B, T, H, K, V, with_state, gate_min, device):
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, gate_min=gate_min, with_state=with_state, device=device)
    out = kernels.kda_recurrent(q, k, v, g, beta, initial_state=h0)
    _check(out, reference.kda_recurrent(q, k, v, g, beta, initial_state=h0), torch.float32, "recurrent")


def test_kda_recurrent_in_place_state(device):
    q, k, v, g, beta, h0 = _inputs(2, 3, 3, 16, 32, device=device)
    state = h0.clone()
    o = kernels.kda_recurrent_(q, k, v, g, beta, state, scale=0.3)
    ro, rs = reference.kda_recurrent(q, k, v, g, beta, scale=0.3, initial_state=h0)
    assert_close(o, ro, torch.float32, what="o")
    assert_close(state, rs, torch.float32, what="state updated in place")


@pytest.mark.parametrize("T", [kernels.RECURRENT_MAX_T, kernels.RECURRENT_MAX_T + 1])
def test_kda_dispatch_both_sides_of_threshold(T, device):
    q, k, v, g, beta, h0 = _inputs(1, T, 1, 16, 16, device=device)
    _check(kernels.kda(q, k, v, g, beta, None, h0), reference.kda_recurrent(q, k, v, g, beta, initial_state=h0),
           torch.float32, f"kda T={T}")


def test_kda_rejects_unsupported_shapes(device):
    q, k, v, g, beta, _ = _inputs(1, 4, 1, 8, 16, device=device)
    with pytest.raises(ValueError, match="16 <= K"):
        kernels.kda_chunked(q, k, v, g, beta)


@pytest.mark.gpu
@pytest.mark.parametrize("B, T, H, K, V, with_state, gate_min", [
    _p(2, 300, 3, 128, 128),  # K3 head dims, tail chunk
    _p(1, 1000, 4, 64, 128, False),
    _p(1, 256, 2, 128, 128, True, -20.0),  # unbounded gate in bf16
])
def test_kda_chunked_bf16_gpu(B, T, H, K, V, with_state, gate_min, device):
    q, k, v, g, beta, h0 = _inputs(B, T, H, K, V, gate_min=gate_min, with_state=with_state, dtype=torch.bfloat16,
                                   device=device)
    for lb in _bounds(gate_min):
        out = kernels.kda_chunked(q, k, v, g, beta, initial_state=h0, gate_lower_bound=lb)
        _check(out, reference.kda_chunked(q, k, v, g, beta, initial_state=h0), torch.bfloat16, f"bf16 chunked lb={lb}")


@pytest.mark.gpu
@pytest.mark.parametrize("B", [1, 64])
def test_kda_decode_bf16_gpu(B, device):
    q, k, v, g, beta, h0 = _inputs(B, 1, 96, 128, 128, dtype=torch.bfloat16, device=device)
    out = kernels.kda_recurrent(q, k, v, g, beta, initial_state=h0)
    _check(out, reference.kda_recurrent(q, k, v, g, beta, initial_state=h0), torch.bfloat16, "bf16 decode")
