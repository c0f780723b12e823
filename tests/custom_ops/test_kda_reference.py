"""KDA references: recurrent == chunked == fla-core's naive_recurrent_kda, on fresh random inputs."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.kda.reference import kda_chunked, kda_gate, kda_recurrent, l2norm
from tolerances import assert_close


def inputs(B, T, H, K, V, gate_min=-5.0, dtype=torch.float32, state=True):
    q = l2norm(torch.randn(B, T, H, K)).to(dtype)
    k = l2norm(torch.randn(B, T, H, K)).to(dtype)
    v = torch.randn(B, T, H, V).to(dtype)
    g = gate_min * torch.rand(B, T, H, K)
    beta = torch.rand(B, T, H)
    h0 = torch.randn(B, H, K, V) if state else None
    return q, k, v, g, beta, h0


CASES = [
    pytest.param(2, 37, 3, 16, 24, id="B2-T37-H3-K16-V24"),  # odd T, K != V, H not a power of two
    pytest.param(1, 130, 2, 32, 8, id="B1-T130-H2-K32-V8"),  # three chunks with a tail
    pytest.param(1, 64, 1, 8, 8, id="B1-T64-H1-K8-V8"),  # exactly one chunk
    pytest.param(3, 1, 2, 8, 16, id="B3-T1-H2-K8-V16"),  # decode step
]


@pytest.mark.parametrize("B,T,H,K,V", CASES)
def test_matches_fla_naive_recurrent(B, T, H, K, V):
    from fla.ops.kda.naive import naive_recurrent_kda

    q, k, v, g, beta, h0 = inputs(B, T, H, K, V)
    o, s = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
    assert o.shape == (B, T, H, V) and s.shape == (B, H, K, V) and s.dtype == torch.float32
    assert_close(o, o_ref.to(o.dtype), torch.float32, "o")
    assert_close(s, s_ref, torch.float32, "state")


@pytest.mark.parametrize("B,T,H,K,V", CASES)
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_chunked_matches_recurrent(B, T, H, K, V, chunk_size):
    q, k, v, g, beta, h0 = inputs(B, T, H, K, V)
    o1, s1 = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o2, s2 = kda_chunked(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size)
    assert_close(o2, o1, torch.float32, "o")
    assert_close(s2, s1, torch.float32, "state")


@pytest.mark.parametrize("gate", [-5.0, -60.0], ids=["lower-bound", "unbounded-kimi-linear"])
def test_chunked_no_overflow_at_strong_decay(gate):
    """Every step at the decay bound (and far below it): a naive factorisation over a 64-chunk overflows."""
    B, T, H, K, V = 1, 150, 2, 16, 16
    q, k, v, _, beta, h0 = inputs(B, T, H, K, V)
    g = torch.full((B, T, H, K), gate)
    o1, s1 = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    o2, s2 = kda_chunked(q, k, v, g, beta, initial_state=h0)
    assert torch.isfinite(o2).all() and torch.isfinite(s2).all()
    assert_close(o2, o1, torch.float32, "o")
    assert_close(s2, s1, torch.float32, "state")


def test_fla_naive_chunk_agrees():
    from fla.ops.kda.naive import naive_chunk_kda

    q, k, v, g, beta, h0 = inputs(2, 128, 3, 16, 16)  # fla's naive chunk form needs T % 64 == 0
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0)
    o_ref, s_ref = naive_chunk_kda(q, k, v, g, beta, initial_state=h0.clone(), output_final_state=True)
    assert_close(o, o_ref.to(o.dtype), torch.float32, "o")
    assert_close(s, s_ref, torch.float32, "state")


def test_split_sequence_equals_whole():
    """Prefill t tokens, then continue from the state: identical to one pass (the decode contract)."""
    q, k, v, g, beta, h0 = inputs(1, 50, 2, 8, 12)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0)
    oa, sa = kda_chunked(q[:, :33], k[:, :33], v[:, :33], g[:, :33], beta[:, :33], initial_state=h0)
    ob, sb = kda_recurrent(q[:, 33:], k[:, 33:], v[:, 33:], g[:, 33:], beta[:, 33:], initial_state=sa)
    assert_close(torch.cat([oa, ob], 1), o, torch.float32, "o")
    assert_close(sb, s, torch.float32, "state")


def test_bf16_inputs_keep_fp32_state_and_v_dtype():
    q, k, v, g, beta, h0 = inputs(1, 20, 2, 8, 8, dtype=torch.bfloat16)
    o, s = kda_chunked(q, k, v, g, beta, initial_state=h0)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32


def test_fp64_inputs_give_an_fp64_oracle():
    q, k, v, g, beta, h0 = (x.double() for x in inputs(1, 40, 2, 8, 8))
    o1, s1 = kda_chunked(q, k, v, g, beta, initial_state=h0)
    o2, s2 = kda_recurrent(q, k, v, g, beta, initial_state=h0)
    assert o1.dtype == s1.dtype == torch.float64
    assert (o1 - o2).abs().max() < 1e-12 and (s1 - s2).abs().max() < 1e-12


def test_shape_errors_name_the_tensor():
    q, k, v, g, beta, h0 = inputs(1, 5, 2, 8, 8)
    with pytest.raises(ValueError, match="initial_state"):
        kda_recurrent(q, k, v, g, beta, initial_state=h0[:, :1])
    with pytest.raises(ValueError, match="beta"):
        kda_chunked(q, k, v, g, beta[:, :3], initial_state=h0)


def test_gates_follow_the_spec_formulas():
    f = torch.randn(2, 3, 4, 5)
    A_log, dt_bias = torch.randn(6), torch.randn(4 * 5)  # A_log stored longer than H = 4
    x = f + dt_bias.view(4, 5)
    a = A_log[:4].exp().view(4, 1)
    safe = kda_gate(f, A_log, dt_bias, -5.0)
    assert torch.allclose(safe, -5.0 * torch.sigmoid(a * x))
    assert (safe > -5).all() and (safe < 0).all()
    kimi = kda_gate(f, A_log, dt_bias, None)
    assert torch.allclose(kimi, -a * torch.log1p(torch.exp(x)), atol=1e-6)


def test_l2norm():
    x = torch.randn(3, 7)
    y = l2norm(x)
    assert torch.allclose(y, x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6))
