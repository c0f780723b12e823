"""The k3::MoEMXFP4 ONNX Runtime CPU kernel (custom_ops/moe_mxfp4/ort_kernel.cc) against the reference
(custom_ops/moe_mxfp4/reference.py, fp64), on a node with no function body beside it (so the kernel ran): one
token and many (the register-decoded path for one or two rows per expert, the scratch path for more, with row
tails), widths of one and of three MXFP4 blocks, top_k = E and 1, SiLU, expert parallelism, scales far from 1,
the router's passes, tails and tasks, MXFP8 activations; and errors that name the bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moe_models import ambiguous_tokens, mxfp4_model, packed_weights
from ort_kernel_models import session


def _reference(w: dict, x, z, k: int, activation: str, offset: int, E: int, activations: str = "bf16"):
    from k3x.custom_ops.moe_mxfp4.reference import moe

    off = torch.tensor([offset], dtype=torch.int32) if w["gate_weight"].shape[0] != E else None
    return moe(x.double(), z.double(), *w.values(), k, 1.5, True, activation, 4.0, 25.0, off, activations)


@pytest.mark.parametrize("E,E_all,N,k,L,I,activation,offset,scales", [
    (4, 4, 1, 2, 32, 32, "situ", 0, (118, 126)),  # one token, one block of each width
    (16, 16, 2, 1, 128, 64, "situ", 0, (118, 126)),  # at most two rows per expert: decoded in registers
    (16, 16, 37, 4, 96, 64, "situ", 0, (118, 126)),  # rows in fours and a tail, three blocks along L
    (16, 16, 6, 4, 64, 64, "situ", 0, (118, 126)),  # 24 rows gathered over the threads, each expert's few fused
    (8, 8, 5, 8, 64, 32, "silu", 0, (118, 126)),  # top_k = E
    (6, 12, 20, 3, 64, 96, "situ", 6, (118, 126)),  # the second of two ranks: half the pairs elsewhere
    (4, 4, 9, 2, 64, 32, "situ", 0, (60, 200)),  # scales from 2^-67 to 2^73
])
def test_moe_mxfp4_kernel_matches_the_reference(kernels, E, E_all, N, k, L, I, activation, offset, scales):
    d = 24
    w = packed_weights(E, d, L, I, seed=E * 7 + N + L, E_all=E_all, scales=scales)
    g = torch.Generator().manual_seed(N * 3 + I)
    x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)
    (u,) = session(mxfp4_model(w, k, activation=activation, offset=offset, body=False), kernels).run(
        None, {"x": x.numpy(), "z": z.numpy()})
    want = _reference(w, x, z, k, activation, offset, E).numpy()
    assert u.shape == want.shape and np.isfinite(u).all()
    scale = float(np.sqrt((want ** 2).mean()))
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("E,d", [
    (44, 40),  # router tasks of 32 experts and of 12: eight rows a pass, then a pass and a four-row tail
    (70, 24),  # three tasks, the last of six rows (all tail)
    (44, 20),  # a width that is no multiple of the vector: every row by the scalar loop
])
def test_moe_mxfp4_kernel_router_over_tasks_and_tails(kernels, E, d):
    """Every expert's logit counts: each token's experts and weights follow from all E router dot products."""
    N, k, L, I = 7, 4, 32, 32
    w = packed_weights(E, d, L, I, seed=E + d)
    g = torch.Generator().manual_seed(d)
    x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)
    (u,) = session(mxfp4_model(w, k, body=False), kernels).run(None, {"x": x.numpy(), "z": z.numpy()})
    want = _reference(w, x, z, k, "situ", 0, E).numpy()
    np.testing.assert_allclose(u, want, rtol=1e-5, atol=1e-5 * float(np.sqrt((want ** 2).mean())))


def test_moe_mxfp4_kernel_rounds_the_activations_through_mxfp8(kernels):
    E, k, d, L, I = 6, 2, 24, 64, 32
    w = packed_weights(E, d, L, I, seed=5)
    sess = session(mxfp4_model(w, k, activations="mxfp8", body=False), kernels)
    g = torch.Generator().manual_seed(5)
    for N in (1, 19, 40):
        x, z = torch.randn(N, d, generator=g), torch.randn(N, L, generator=g) * 4
        z[0, 3] = float("nan") if N == 19 else z[0, 3]  # its block of 32 becomes NaN, so its token's u does
        (u,) = sess.run(None, {"x": x.numpy(), "z": z.numpy()})
        want = _reference(w, x, z, k, "situ", 0, E, "mxfp8").float().numpy()
        keep = ~ambiguous_tokens(x, z, w, k)
        assert keep.float().mean() >= 0.8, f"{int((~keep).sum())} of {N} tokens near a rounding boundary"
        np.testing.assert_array_equal(np.isnan(u), np.isnan(want))
        keep = keep.numpy() & ~np.isnan(want).any(1)
        np.testing.assert_allclose(u[keep], want[keep], rtol=1e-5, atol=1e-5)
        other = _reference(w, x, z, k, "situ", 0, E, "bf16").numpy()
        assert not np.allclose(u[keep], other[keep], atol=1e-3)  # the format is honoured


def test_moe_mxfp4_kernel_equals_its_function_body(kernels):
    """The same node with its body attached: the library's kernel and ONNX Runtime's standard ops agree."""
    w = packed_weights(16, 32, 64, 64, seed=11)
    model = mxfp4_model(w, 4)
    g = torch.Generator().manual_seed(11)
    feeds = {"x": torch.randn(13, 32, generator=g).numpy(), "z": torch.randn(13, 64, generator=g).numpy()}
    (body,) = session(model).run(None, feeds)
    (kernel,) = session(model, kernels).run(None, feeds)
    np.testing.assert_allclose(kernel, body, rtol=1e-5, atol=1e-5 * float(np.abs(body).max()))


@pytest.mark.parametrize("name,shape,message", [
    ("w2_scale", (4, 64, 2), r"w2_scale \[4, 64, 2\]: expected \[E, L, I/32\] = \[4, 64, 1\]"),
    ("w3", (4, 32, 16), r"w3 \[4, 32, 16\]: expected \[E, I, L/2\] = \[4, 32, 32\]"),
    ("gate_weight", (3, 24), r"x \[2, 24\], gate_weight \[3, 24\]: expected \[N, d\] and \[E_all >= 4, d\]"),
])
def test_moe_mxfp4_kernel_names_the_bad_input(kernels, name, shape, message):
    w = packed_weights(4, 24, 64, 32, seed=1)
    w[name] = torch.zeros(shape, dtype=w[name].dtype)
    with pytest.raises(Exception, match="k3::MoEMXFP4: " + message):
        session(mxfp4_model(w, 2, body=False), kernels).run(
            None, {"x": np.zeros((2, 24), np.float32), "z": np.zeros((2, 64), np.float32)})
