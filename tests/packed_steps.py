"""Serving-step inputs shared by the packed KDA tests (op, kernels, ONNX body, layer): B sequences packed end
to end, their cu_seqlens, and slots drawn as a permutation of a pool with spare rows (so a wrong slot reads
some other sequence's state)."""

from __future__ import annotations

import torch

from k3x.custom_ops.kda.reference import l2norm


def cu_seqlens(lens: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def slots(B: int, S: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(S, generator=gen)[:B].to(torch.int32)


def kda_step(lens: list[int], H: int = 2, K: int = 16, V: int = 24, S: int | None = None, dtype=torch.float32,
             seed: int = 0) -> tuple[torch.Tensor, ...]:
    """k3::kda_packed's inputs: q, k, v, g (in [-5, 0)), beta, state_pool, cu_seqlens, slots."""
    gen = torch.Generator().manual_seed(seed)
    N, B = sum(lens), len(lens)
    S = S or B + 3
    q = l2norm(torch.randn(N, H, K, generator=gen)).to(dtype)
    k = l2norm(torch.randn(N, H, K, generator=gen)).to(dtype)
    v = torch.randn(N, H, V, generator=gen).to(dtype)
    g = -5.0 * torch.rand(N, H, K, generator=gen)
    beta = torch.rand(N, H, generator=gen)
    pool = torch.randn(S, H, K, V, generator=gen) * 0.5
    return q, k, v, g, beta, pool, cu_seqlens(lens), slots(B, S, gen)


def kda_layer(seed: int = 0):
    """k3-mini's KimiDeltaAttention with every parameter random (init zeros some conv taps, gates, norms)."""
    from k3x.model import preset
    from k3x.model.kda import KimiDeltaAttention

    torch.manual_seed(seed)
    m = KimiDeltaAttention(preset("k3-mini")).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0.0, 0.3)
    return m


def layer_step(m, lens: list[int], S: int | None = None, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """forward_packed's inputs for layer `m`: x [N, d], conv_pool, rec_pool, cu_seqlens, slots."""
    gen = torch.Generator().manual_seed(seed)
    c = m.cfg.kda
    P, H, D, W = c.proj_dim, c.num_heads, c.head_dim, c.conv_kernel
    S = S or len(lens) + 2
    x = torch.randn(sum(lens), m.cfg.hidden_size, generator=gen)
    conv_pool = torch.randn(S, 3 * P, W - 1, generator=gen)
    rec_pool = torch.randn(S, H, D, D, generator=gen) * 0.3
    return x, conv_pool, rec_pool, cu_seqlens(lens), slots(len(lens), S, gen)


class LayerStep(torch.nn.Module):
    """A module whose forward is one layer's forward_packed (reference kernels): what torch.export traces."""

    def __init__(self, m):
        super().__init__()
        self.m = m

    def forward(self, x, conv_pool, rec_pool, cu_seqlens, slots):
        return self.m.forward_packed(x, conv_pool, rec_pool, cu_seqlens, slots, kernels="reference")


def decode_step(B: int, H: int = 2, K: int = 16, V: int = 24, W: int = 4, S: int | None = None,
                seed: int = 0) -> tuple[torch.Tensor, ...]:
    """k3::kda_decode's inputs, fp32: qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool,
    state_pool, slots (a permutation of a pool with spare rows)."""
    gen = torch.Generator().manual_seed(seed)
    S = S or B + 3
    C = 2 * H * K + H * V
    r = lambda *s, a=1.0: torch.randn(*s, generator=gen) * a  # noqa: E731
    return (r(B, C), r(B, H, K), r(B, H), r(B, H, V), r(C, W, a=0.5), r(H + 1, a=0.5), r(H * K), 1 + r(V, a=0.1),
            r(S, C, W - 1), r(S, H, K, V, a=0.3), slots(B, S, gen))


def decode_token(B: int, H: int, K: int, V: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """A further decode step's per-token inputs (qkv, f, b, gate) for `decode_step`'s layer."""
    C = 2 * H * K + H * V
    return (torch.randn(B, C, generator=gen), torch.randn(B, H, K, generator=gen), torch.randn(B, H, generator=gen),
            torch.randn(B, H, V, generator=gen))
