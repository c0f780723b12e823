"""k3::mla_paged Triton kernels vs the fp32 reference: decode-only steps (the `decode` variant, split over keys:
one split or several, some empty) and mixed steps (`rows`), block sizes 1/4/16, awkward head counts, C and R
(R = 0 too), permuted and strided block tables, past lengths crossing block and key-tile edges, prefill chunks
longer than a query block; the model's forward_paged with kernels=triton."""

from __future__ import annotations

import pytest
import torch

from k3x.custom_ops.mla_paged import reference
from k3x.custom_ops.mla_paged import triton as kernels
from paged_cases import paged_case
from tolerances import assert_close


def _check(seqs, block_size, H, C, R, device, *, strided=False, dtype=torch.float32):
    case = paged_case(seqs, block_size, C + R, strided=strided)
    gen = torch.Generator().manual_seed(5)
    N = case.latent.shape[0]
    ql, qr = torch.randn(N, H, C, generator=gen), torch.randn(N, H, R, generator=gen)
    args = [x.to(device) for x in (ql, qr, case.latent, *case.paged)]
    args[:4] = [x.to(dtype) for x in args[:4]]
    scale = (C + R) ** -0.5
    out = kernels.mla_paged(*args, scale=scale)
    assert out.shape == (N, H, C) and out.dtype == dtype
    want = reference.mla_paged(*[x.cpu().float() if x.is_floating_point() else x.cpu() for x in args], scale)
    assert_close(out.cpu(), want.to(dtype), dtype, f"{seqs} BS={block_size} H={H} C={C} R={R}")


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seqs", [
    pytest.param([(0, 1)], id="first-token"),
    pytest.param([(33, 1), (5, 1), (16, 1)], id="B3-pasts-across-tiles"),
    pytest.param([(1, 1), (0, 1), (47, 1), (15, 1), (2, 1), (31, 1), (17, 1)], id="B7"),
])
def test_decode_steps(seqs, block_size, device):
    _check(seqs, block_size, 3, 24, 8, device, strided=True)


@pytest.mark.parametrize("seqs", [
    pytest.param([(600, 1)], id="one-long"),
    pytest.param([(600, 1), (3, 1), (257, 1), (256, 1), (255, 1)], id="B5-empty-splits"),  # 3 splits of 256 keys
])
def test_decode_split_over_keys(seqs, device):
    _check(seqs, 16, 5, 24, 8, device)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("seqs", [
    pytest.param([(0, 37)], id="prefill-37"),
    pytest.param([(19, 21)], id="chunk-with-past"),
    pytest.param([(0, 5), (40, 1), (3, 18), (0, 1), (9, 2)], id="mixed-B5"),
])
def test_mixed_steps(seqs, block_size, device):
    _check(seqs, block_size, 3, 24, 8, device)


@pytest.mark.parametrize("H,C,R", [(1, 16, 0), (5, 20, 3), (17, 12, 5), (2, 40, 64)],
                         ids=["H1-C16-R0", "H5-C20-R3", "H17-C12-R5", "H2-C40-R64"])
def test_awkward_dims(H, C, R, device):
    _check([(7, 3), (20, 1)], 4, H, C, R, device)
    _check([(7, 1), (20, 1)], 4, H, C, R, device)  # decode variant


@pytest.mark.parametrize("seqs", [
    pytest.param([(33, 1), (0, 1), (300, 1)], id="decode-split"),
    pytest.param([(7, 5), (0, 9)], id="rows"),
])
def test_16bit_inputs_on_16bit_mma(seqs, device):
    """16-bit inputs stay 16-bit into the dots (fp32 accumulation; probabilities rounded to the inputs' dtype),
    as on the GPU's bf16 MMAs. fp16 here: the interpreter multiplies fp16 but not bf16 (it dots bf16's raw bits)."""
    _check(seqs, 4, 3, 24, 8, device, dtype=torch.float16)


@pytest.mark.gpu
@pytest.mark.parametrize("seqs", [[(1000, 1)] * 4, [(300, 64), (5000, 1)]], ids=["decode-B4", "mixed"])
def test_k3_sizes_bf16_gpu(seqs, device):
    _check(seqs, 16, 16, 512, 64, device, dtype=torch.bfloat16)


def test_model_forward_paged_with_the_kernel(allow_cpu_triton, device):
    """GatedMLA.forward_paged (k3-mini sizes) with kernels=triton equals kernels=reference."""
    from k3x.model import preset
    from k3x.model.mla import GatedMLA

    torch.manual_seed(0)
    m = GatedMLA(preset("k3-mini")).to(device).eval()
    case = paged_case([(0, 6), (11, 1), (4, 3)], 4, m.m.latent_dim)
    x = torch.randn(case.latent.shape[0], m.o_proj.out_features, device=device)
    paged = [t.to(device) for t in case.paged]
    with torch.no_grad():
        y, lat = m.forward_paged(x, *paged, kernels="triton")
        y_ref, lat_ref = m.forward_paged(x, *paged, kernels="reference")
    assert_close(y.cpu(), y_ref.cpu(), torch.float32, "y")
    torch.testing.assert_close(lat, lat_ref)
