"""The k3::MLAPaged ONNX Runtime CPU kernel (custom_ops/mla_paged/ort_kernel.cc) against the reference
(custom_ops/mla_paged/reference.py, fp64), on a node with no function body beside it (so the kernel ran):
prefill chunks, chunks after a past spread over blocks in a shuffled table, decode rows, pasts longer than
the kernel's key block, an empty sequence, no rope part; and errors that name the bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ort_kernel_models import bare, session


def _model(scale: float):
    from k3x.custom_ops.mla_paged.onnx import NODE

    return bare("MLAPaged", [n for n, _ in NODE.inputs], [n for n, _ in NODE.outputs], scale=scale)


def _inputs(lens: list[int], pasts: list[int], H: int, C: int, R: int, BS: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    N, B = sum(lens), len(lens)
    MB = max(1, max(-(-(p + t) // BS) for p, t in zip(pasts, lens)))
    NB = B * MB + 3
    table = torch.randperm(NB, generator=g)[:B * MB].reshape(B, MB).to(torch.int32)  # blocks out of order
    return {"q_latent": torch.randn(N, H, C, generator=g), "q_rope": torch.randn(N, H, R, generator=g),
            "latent": torch.randn(N, C + R, generator=g), "latent_pool": torch.randn(NB, BS, C + R, generator=g),
            "block_table": table, "past_lens": torch.tensor(pasts, dtype=torch.int32),
            "cu_seqlens": torch.tensor([0, *np.cumsum(lens)], dtype=torch.int32)}


@pytest.mark.parametrize("lens,pasts,H,C,R,BS", [
    ([1], [0], 1, 8, 4, 4),  # one token, no past
    ([128], [0], 2, 64, 16, 16),  # a prefill: 32 tasks of four rows per head
    ([7, 1, 0, 13, 1], [5, 40, 3, 0, 9], 3, 24, 8, 4),  # chunks and decode rows after pasts; an empty sequence
    ([2, 1], [300, 517], 2, 32, 8, 16),  # pasts of several key blocks (128 keys each)
    ([6, 3], [2, 0], 2, 16, 0, 8),  # no rope part (R = 0)
    ([9, 4], [3, 130], 2, 20, 6, 8),  # four-row tasks over widths past a multiple of 8 (L = 26) and of 16 (C)
])
def test_mla_paged_kernel_matches_the_reference(kernels, lens, pasts, H, C, R, BS):
    from k3x.custom_ops.mla_paged.reference import mla_paged

    x = _inputs(lens, pasts, H, C, R, BS, seed=sum(lens) + sum(pasts) + C)
    scale = (C + R) ** -0.5 * 3  # sharp enough that the softmax is not near uniform
    (got,) = session(_model(scale), kernels).run(None, {n: t.numpy() for n, t in x.items()})
    want = mla_paged(*(t.double() if t.is_floating_point() else t for t in x.values()), scale=scale)
    assert got.shape == tuple(want.shape)
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("change,message", [
    ({"latent": np.zeros((4, 11), np.float32)}, r"k3::MLAPaged: latent \[4, 11\]: expected \[N, C \+ R\] = \[4, 12\]"),
    ({"q_rope": np.zeros((4, 3, 4), np.float32)}, r"q_rope \[4, 3, 4\]: expected \[N, H, R\]"),
    ({"cu_seqlens": np.array([0, 3, 2], np.int32)}, r"cu_seqlens must rise from 0 to N = 4"),
    ({"past_lens": np.array([0, 5], np.int32)},
     r"past_lens\[1\] = 5: expected 0..4, what a block_table row of 1 blocks of 4 positions holds"),
    ({"block_table": np.array([[0], [5]], np.int32)}, r"block_table\[1, 0\] = 5: outside the pool of 5 blocks"),
])
def test_mla_paged_kernel_names_the_bad_input(kernels, change, message):
    feeds = {n: t.numpy() for n, t in _inputs([3, 1], [0, 1], 2, 8, 4, 4, seed=0).items()} | change
    with pytest.raises(Exception, match=message):
        session(_model(1.0), kernels).run(None, feeds)
