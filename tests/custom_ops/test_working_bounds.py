"""`working_bytes` of the custom ops whose CPU implementation holds temporaries besides k3::mla_paged (which
tests/custom_ops/test_mla_paged_blocked.py covers): k3::kda_packed (custom_ops/kda_packed/reference.py) and
k3::attn_res (custom_ops/attn_res/reference.py). Their real temporaries, counted op by op on CPU (model/working.py
LiveBytes, outputs included), stay under the bound derived from the shapes, and the bound is not grossly over:
slack within 30 % for chunked KDA (measured 7-25 %) and the mixer (2-23 %), 2x for all-decode KDA (a few KiB)."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.attn_res import reference as attn_res_ref
from k3x.custom_ops.kda_packed import reference as kda_packed_ref
from k3x.model.working import LiveBytes


def kda_peak(lens: list[int], H: int, K: int, V: int, dtype: torch.dtype) -> int:
    g = torch.Generator().manual_seed(0)
    N, B = sum(lens), len(lens)
    q, k = (torch.randn(N, H, K, generator=g).to(dtype) for _ in range(2))
    v = torch.randn(N, H, V, generator=g).to(dtype)
    gate, beta = -torch.rand(N, H, K, generator=g), torch.rand(N, H, generator=g)
    pool = torch.randn(B + 1, H, K, V, generator=g)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    args = (q, k, v, gate, beta, pool, cu, torch.arange(1, B + 1, dtype=torch.int32))
    with torch.no_grad(), LiveBytes(list(args)) as m:
        kda_packed_ref.kda_packed(*args, scale=K ** -0.5)
    return m.peak


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,H,K,V", [([64], 4, 16, 16), ([100], 2, 32, 16), ([513], 4, 16, 16),
                                         ([3, 90, 1], 4, 16, 16)])
def test_kda_packed_temporaries_within_working_bytes(lens, H, K, V, dtype):
    peak = kda_peak(lens, H, K, V, dtype)
    bound = kda_packed_ref.working_bytes(sum(lens), H, K, V, sequences=len(lens),
                                         item_bytes=torch.empty((), dtype=dtype).element_size())
    assert peak <= bound <= 1.3 * peak, (peak, bound)


def test_kda_packed_decode_temporaries_within_working_bytes():
    peak = kda_peak([1, 1, 1], 4, 16, 16, torch.float32)
    bound = kda_packed_ref.working_bytes(3, 4, 16, 16, sequences=3)
    assert peak <= bound <= 2 * peak, (peak, bound)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 1), (64, 2), (512, 4)])
def test_attn_res_temporaries_within_working_bytes(rows, n, dtype):
    g = torch.Generator().manual_seed(0)
    prefix, bank = torch.randn(rows, 64, generator=g).to(dtype), torch.randn(rows, n, 64, generator=g).to(dtype)
    args = (prefix, bank, torch.randn(64, generator=g), torch.randn(64, generator=g))
    with LiveBytes(list(args)) as m:
        attn_res_ref.attn_res(*args, 1e-5)
    bound = attn_res_ref.working_bytes(rows, n + 1, 64, item_bytes=prefix.element_size())
    assert m.peak <= bound <= 1.3 * m.peak, (m.peak, bound)
