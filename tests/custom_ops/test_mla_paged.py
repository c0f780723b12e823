"""k3::mla_paged (custom_ops/mla_paged): the reference against a dense oracle written here (each sequence's
contiguous history, never the pool), over block sizes 1/4/16, awkward lengths, permuted and non-contiguous
block tables, up to 7 sequences mixing decode rows and prefill chunks with a past; opcheck; the shape rule."""

from __future__ import annotations

import pytest
import torch

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.mla_paged import mla_paged, mla_paged_output_shape
from k3x.custom_ops.mla_paged.reference import mla_paged as reference
from paged_cases import paged_case
from tolerances import assert_close

CHECKS = ("test_schema", "test_faketensor", "test_aot_dispatch_dynamic")

CASES = {  # (past, T) per sequence
    "decode-1": [(5, 1)],
    "prefill-no-past": [(0, 9)],
    "mixed-3": [(0, 4), (17, 1), (3, 6)],
    "mixed-7": [(31, 1), (0, 1), (16, 3), (1, 1), (8, 8), (15, 2), (2, 13)],
    "chunk-after-long-past": [(47, 5), (64, 1)],
}


def dense_oracle(case, q_latent, q_rope, scale):
    """Per token: softmax over [its sequence's history | this step's rows up to it], in fp64."""
    C = q_latent.shape[-1]
    out = torch.empty(q_latent.shape, dtype=torch.float64)
    cu = case.cu_seqlens.tolist()
    for b, hist in enumerate(case.history):
        for t in range(cu[b + 1] - cu[b]):
            n = cu[b] + t
            keys = torch.cat([hist, case.latent[cu[b]:n + 1]]).double()  # [past + t + 1, L]
            q = torch.cat([q_latent[n], q_rope[n]], -1).double()  # [H, L]
            p = torch.softmax(q @ keys.T * scale, dim=-1)
            out[n] = p @ keys[:, :C]
    return out


def queries(case, H, C, R, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    N = case.latent.shape[0]
    return (torch.randn(N, H, C, generator=gen, dtype=torch.float64).to(dtype),
            torch.randn(N, H, R, generator=gen, dtype=torch.float64).to(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_matches_dense_oracle(name, block_size, dtype):
    C, R, H = 12, 5, 3
    case = paged_case(CASES[name], block_size, C + R, dtype=dtype, strided=block_size == 4)
    ql, qr = queries(case, H, C, R, dtype)
    scale = 0.3
    out = reference(ql, qr, case.latent, *case.paged, scale)
    assert out.dtype == dtype and out.shape == (case.latent.shape[0], H, C)
    assert_close(out, dense_oracle(case, ql, qr, scale), dtype, f"{name} BS={block_size}")


def test_no_rope_part_and_public_function():
    """R = 0 (a latent without an extra part) through torch.ops.k3.mla_paged; pool garbage stays unread."""
    C, H = 8, 2
    case = paged_case([(6, 2), (0, 3)], 4, C)
    ql, qr = queries(case, H, C, 0, torch.float32)
    out = mla_paged(ql, qr, case.latent, *case.paged, scale=C ** -0.5)
    assert_close(out, dense_oracle(case, ql, qr, C ** -0.5), torch.float32, "R=0")


def test_reads_only_the_sequences_blocks():
    """Poisoning every block no sequence uses (and the unused rows of used blocks) changes nothing."""
    C, R, H = 6, 2, 2
    case = paged_case([(5, 2), (9, 1)], 4, C + R, spare_blocks=4)
    ql, qr = queries(case, H, C, R, torch.float32)
    before = reference(ql, qr, case.latent, *case.paged, 0.5)
    keep = torch.zeros(case.pool.shape[:2], dtype=torch.bool)
    for b, past in enumerate(case.past_lens.tolist()):
        for p in range(past):
            keep[case.block_table[b, p // 4], p % 4] = True
    case.pool[~keep] = float("nan")
    torch.testing.assert_close(reference(ql, qr, case.latent, *case.paged, 0.5), before)


@pytest.mark.parametrize("seqs,block_size", [
    pytest.param([(0, 1)], 1, id="decode-no-past-BS1"),
    pytest.param([(3, 1), (0, 5)], 4, id="mixed-BS4"),
    pytest.param([(20, 3), (1, 1), (0, 2)], 16, id="B3-BS16"),
])
def test_mla_paged_opcheck(seqs, block_size):
    C, R, H = 8, 4, 2
    case = paged_case(seqs, block_size, C + R)
    ql, qr = queries(case, H, C, R, torch.float32)
    args = (ql, qr, case.latent, *case.paged, 0.25, "reference")
    torch.library.opcheck(torch.ops.k3.mla_paged.default, args, test_utils=CHECKS)
    assert tuple(torch.ops.k3.mla_paged(*args).shape) == mla_paged_output_shape(ql.shape)
