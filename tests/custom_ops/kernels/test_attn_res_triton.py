"""AttnRes Triton kernel vs the fp32 reference: every source count K3 uses, awkward widths."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.attn_res import reference
from k3x.custom_ops.attn_res import triton as kernels
from tolerances import assert_close


def _inputs(lead, N, d, dtype=torch.float32, device="cpu"):
    prefix = torch.randn(*lead, d, device=device) * 3.0  # the partial sum grows: larger scale than the bank
    bank = torch.randn(*lead, N, d, device=device)
    norm_weight = 1.0 + 0.1 * torch.randn(d, device=device)
    proj_weight = torch.randn(d, device=device)
    return prefix.to(dtype), bank.to(dtype), norm_weight, proj_weight


@pytest.mark.parametrize("N", range(1, 10), ids=lambda n: f"N{n}")  # K3: up to 8 bank blocks + prefix
@pytest.mark.parametrize("lead, d", [pytest.param((3,), 100, id="R3-d100"),  # d not a power of two
                                     pytest.param((2, 5), 37, id="B2-T5-d37")])  # leading dims, odd d
def test_attn_res_matches_reference(lead, d, N, device):
    prefix, bank, nw, pw = _inputs(lead, N, d, device=device)
    out = kernels.attn_res(prefix, bank, nw, pw, 1e-5)
    assert out.shape == prefix.shape and out.dtype == prefix.dtype
    assert_close(out, reference.attn_res(prefix, bank, nw, pw, 1e-5), torch.float32, what=f"N={N}")


def test_attn_res_several_d_blocks(device):
    prefix, bank, nw, pw = _inputs((2,), 8, 1000, device=device)  # BD=256 for 16 sources: 4 blocks, last masked
    assert_close(kernels.attn_res(prefix, bank, nw, pw, 1e-6), reference.attn_res(prefix, bank, nw, pw, 1e-6),
                 torch.float32, what="d=1000")


def test_attn_res_zero_query_is_mean(device):
    prefix, bank, nw, _ = _inputs((4,), 3, 64, device=device)
    out = kernels.attn_res(prefix, bank, nw, torch.zeros(64, device=device), 1e-5)
    assert_close(out, torch.cat([bank, prefix[:, None]], 1).mean(1), torch.float32, what="uniform softmax")


@pytest.mark.gpu
@pytest.mark.parametrize("N", [1, 8], ids=lambda n: f"N{n}")
def test_attn_res_bf16_gpu(N, device):
    prefix, bank, nw, pw = _inputs((64,), N, 7168, dtype=torch.bfloat16, device=device)
    out = kernels.attn_res(prefix, bank, nw, pw, 1e-5)
    assert out.dtype == torch.bfloat16
    assert_close(out, reference.attn_res(prefix, bank, nw, pw, 1e-5), torch.bfloat16, what="bf16")
