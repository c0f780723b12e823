"""MoE reference against a per-token loop of docs/model.md §5.1 (routing, SiTU-GLU experts, weighted sum)."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.moe.reference import glu, moe, route
from tolerances import assert_close


def per_token(x, z, gw, gb, w1, w3, w2, k, scale, renorm, act, b1, b2):
    out = torch.zeros(z.shape, dtype=torch.float64)
    for n in range(x.shape[0]):
        s = torch.sigmoid(gw.double() @ x[n].double())
        chosen = sorted(range(len(s)), key=lambda e: -(s[e] + gb[e]).item())[:k]
        total = sum(s[e] for e in chosen)
        for e in chosen:
            p = (s[e] / (total + 1e-20) if renorm else s[e]) * scale
            a, b = w1[e].double() @ z[n].double(), w3[e].double() @ z[n].double()
            if act == "situ":
                h = (b1 * torch.tanh(a / b1) * torch.sigmoid(a)) * (b2 * torch.tanh(b / b2))
            else:
                h = a * torch.sigmoid(a) * b
            out[n] += p * (w2[e].double() @ h)
    return out


def weights(N=9, d=12, L=10, E=6, I=7):
    return (torch.randn(N, d), torch.randn(N, L), torch.randn(E, d), torch.randn(E) * 0.1,
            torch.randn(E, I, L) / 3, torch.randn(E, I, L) / 3, torch.randn(E, L, I) / 3)


@pytest.mark.parametrize("k", [1, 3, 6], ids=lambda k: f"top{k}")
@pytest.mark.parametrize("act", ["situ", "silu"])
@pytest.mark.parametrize("renorm,scale", [(True, 1.0), (False, 2.446)], ids=["renorm", "scaled"])
def test_matches_per_token_loop(k, act, renorm, scale):
    w = weights()
    out = moe(*w, k, scale, renorm, act, 4.0, 25.0)
    assert out.shape == w[1].shape
    assert_close(out, per_token(*w, k, scale, renorm, act, 4.0, 25.0).float(), torch.float32, "moe")


def test_bias_selects_but_does_not_weight():
    x, z, gw, gb, *_ = weights()
    big = torch.zeros_like(gb)
    big[2] = 100.0  # expert 2 always selected, its weight still from the unbiased score
    ids, w = route(x, gw, big, 2, 1.0, True)
    assert (ids == 2).any(-1).all()
    s = torch.sigmoid(x @ gw.t())
    assert_close(w, s.gather(-1, ids) / s.gather(-1, ids).sum(-1, keepdim=True), torch.float32, "weights")


def test_situ_glu_formula_and_bound():
    a, b = torch.randn(100) * 50, torch.randn(100) * 50
    y = glu(a, b, "situ", 4.0, 25.0)
    assert torch.allclose(y, 4 * torch.tanh(a / 4) * torch.sigmoid(a) * 25 * torch.tanh(b / 25))
    assert y.abs().max() <= 100.0
    small = torch.randn(10) * 1e-3
    assert torch.allclose(glu(small, small, "situ", 4.0, 25.0), small * torch.sigmoid(small) * small, atol=1e-9)
