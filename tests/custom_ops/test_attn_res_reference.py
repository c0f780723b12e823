"""AttnRes reference against the spec's formula written out per source and per token."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from k3x.custom_ops.attn_res.reference import attn_res
from tolerances import assert_close


def spec_loop(prefix, bank, nw, pw, eps):
    """Spec §4.2 literally: sources = bank entries then prefix; scores on RMSNorm'd keys; mix raw."""
    out = torch.empty_like(prefix, dtype=torch.float64)
    for idx in itertools.product(*(range(n) for n in prefix.shape[:-1])):
        srcs = [bank[idx][j].double() for j in range(bank.shape[-2])] + [prefix[idx].double()]
        scores = [float((s / torch.sqrt(s.pow(2).mean() + eps) * nw.double() * pw.double()).sum()) for s in srcs]
        m = max(scores)
        w = [math.exp(x - m) for x in scores]
        out[idx] = sum(wi / sum(w) * s for wi, s in zip(w, srcs))
    return out


@pytest.mark.parametrize("N", [1, 2, 8], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("d", [7, 64], ids=lambda d: f"d{d}")
def test_matches_spec_formula(N, d):
    prefix, bank = torch.randn(2, 3, d) * 3, torch.randn(2, 3, N, d)
    nw, pw = torch.rand(d) + 0.5, torch.randn(d)
    out = attn_res(prefix, bank, nw, pw, 1e-5)
    assert out.shape == prefix.shape and out.dtype == prefix.dtype
    assert_close(out, spec_loop(prefix, bank, nw, pw, 1e-5).float(), torch.float32, "attn_res")


def test_zero_query_is_plain_mean():
    prefix, bank = torch.randn(4, 16), torch.randn(4, 3, 16)
    out = attn_res(prefix, bank, torch.ones(16), torch.zeros(16), 1e-5)
    assert_close(out, torch.cat([bank, prefix[:, None]], 1).mean(1), torch.float32, "mean")


def test_mismatched_bank_is_refused():
    with pytest.raises(ValueError, match="bank"):
        attn_res(torch.randn(2, 8), torch.randn(3, 1, 8), torch.ones(8), torch.ones(8), 1e-5)
