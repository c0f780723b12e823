"""GatedMLA.forward (model/mla.py), the batch interface, runs absorbed: it never up-projects the cached latent
through kv_b_proj (so a decode step's cost does not grow with S·C·H·(qk_nope + v_head)), and it equals the
up-projected attention (keys and values from every cached latent, written out here; fp64 but for the
softmax's fp32, as the model) on growing and static caches, prefill, chunks and decode rows."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3x.model import preset
from k3x.model.mla import GatedMLA


def _mla() -> GatedMLA:
    cfg = preset("k3-mini")
    torch.manual_seed(7)
    m = GatedMLA(dataclasses.replace(cfg, mla=dataclasses.replace(cfg.mla, output_gate=True)))
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.2) if p.dim() > 1 else p.uniform_(0.5, 1.5)
    return m.double().eval()


def _up_projected(m: GatedMLA, x, present, offset) -> torch.Tensor:
    """The attention with keys and values up-projected from every cached latent (the non-absorbed form)."""
    c = m.m
    B, T, _ = x.shape
    S, H, N, R, Dv = present.shape[1], c.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
    q = m._query(x).transpose(1, 2)
    lat, kx = present.split([c.kv_lora_rank, R], dim=-1)
    k_nope, v = m.kv_b_proj(lat).view(B, S, H, N + Dv).split([N, Dv], dim=-1)
    k = torch.cat([k_nope, kx.unsqueeze(2).expand(B, S, H, R)], dim=-1).transpose(1, 2)
    scores = (q @ k.transpose(-1, -2)).float() * (N + R) ** -0.5  # the model's softmax runs in fp32
    visible = torch.arange(S)[None, :] <= torch.arange(T)[:, None] + offset
    probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).double()
    return m._output((probs @ v.transpose(1, 2)).transpose(1, 2).reshape(B, T, H * Dv), x)


@pytest.mark.parametrize("B,P,T,static", [(2, 0, 6, False), (1, 37, 1, False), (3, 20, 4, False), (2, 9, 1, True),
                                          (1, 0, 5, True)])
def test_forward_is_absorbed_and_equals_the_up_projected_attention(B, P, T, static):
    m = _mla()
    calls = []
    m.kv_b_proj.register_forward_hook(lambda *_: calls.append(1))
    g = torch.Generator().manual_seed(B * 100 + P + T)
    L, d = m.m.latent_dim, m.o_proj.out_features
    x = torch.randn(B, T, d, generator=g, dtype=torch.float64)
    with torch.no_grad():
        if static:
            past = torch.randn(B, 48, L, generator=g, dtype=torch.float64)
            y, present = m(x, past, torch.tensor(P))
        else:
            y, present = m(x, torch.randn(B, P, L, generator=g, dtype=torch.float64))
        assert not calls  # the cached latent is never up-projected
        want = _up_projected(m, x, present, P)
    torch.testing.assert_close(y, want, rtol=1e-6, atol=1e-7)  # the scores' fp32 rounding
