"""The k3::LinearQ8 ONNX Runtime CPU kernel (custom_ops/linear_q8/ort_kernel.cc) against the reference
(custom_ops/linear_q8/reference.py `linear_q8`, in fp64 on the same codes: its activations quantised in fp32 as
the kernel does, then the blocks' exact integer dot products scaled and summed in fp64), on a node with no
function body beside it (so the kernel ran): decode rows (1 to 4) and prefill rows (row passes of four and
tails, several tasks), K that is no multiple of the block (the last block padded), zero blocks, large and tiny
magnitudes, block sizes other than 32 (the vector path takes multiples of 32, the rest the per-block loop); the
activations quantised as the reference does, not kept in fp32; the kernel beside its function body (MLAS's
MatMulNBits); the non-VNNI builds (AVX2, generic) of the same source; errors that name the bad input.

Tolerance: the kernel's only rounding is fp32's in the products (dot · x scale) · w scale and in the sum over
the blocks (and over eight lanes, in another order than the reference's). The integers are exact, so against
the fp64 oracle the error is a few ulp of the sum of |terms|: rtol 1e-5 of the output's RMS scale, 2e-6 of each
value, covers K up to ~1000 blocks with margin."""

from __future__ import annotations

import subprocess

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_kernel_models import session, skip_without_ort_headers


def linear_model(weight: torch.Tensor, scales: torch.Tensor, K: int, body: bool = False):
    """One k3::LinearQ8 node, x a float input of any shape, `weight` uint8 [N, KB, BLOCK] and `scales` [N, KB]
    initializers; with `body`, the ort flavor's function body (MatMulNBits) attached."""
    N, _, block = weight.shape
    inits = [numpy_helper.from_array(weight.numpy(), "weight"), numpy_helper.from_array(scales.numpy(), "scales")]
    node = helper.make_node("LinearQ8", ["x", "weight", "scales"], ["y"], domain="k3", K=K, N=N, block_size=block)
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=inits)
    functions, extra = [], []
    if body:
        from k3x.custom_ops.linear_q8.onnx import MS_DOMAIN, function

        proto, imports = function(20, [node])
        functions, extra = [proto], [helper.make_opsetid(d, v) for d, v in imports.items()]
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1), *extra],
                             ir_version=10, functions=functions)


def oracle(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor) -> np.ndarray:
    """reference.linear_q8 with x's codes and scales from fp32 (as the kernel quantises) and the rest in fp64."""
    from k3x.custom_ops.linear_q8.reference import ZERO, quantize_activations

    n, blocks, block = weight.shape
    codes, xs = quantize_activations(x, blocks, block)
    w = (weight.to(torch.int16) - ZERO).double()
    dots = torch.einsum("...kb,nkb->...nk", codes.double(), w)
    return (dots * xs.double()[..., None, :] * scales.double()).sum(-1).numpy()


def _case(N: int, K: int, block: int, seed: int, shape: tuple[int, ...], magnitude: float = 1.0):
    from k3x.custom_ops.linear_q8.reference import quantize

    g = torch.Generator().manual_seed(seed)
    weight, scales = quantize(torch.randn(N, K, generator=g) / K ** 0.5, block)
    x = torch.randn(*shape, K, generator=g) * magnitude
    return x, weight, scales


def _check(y: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.sqrt((want ** 2).mean())) if want.size else 1.0
    np.testing.assert_allclose(y, want, rtol=2e-6, atol=1e-5 * scale)


@pytest.mark.parametrize("K", [1, 31, 33, 100, 1024])
@pytest.mark.parametrize("N,rows", [(1, (1,)), (3, (2,)), (8, (3,)), (17, (5,)), (300, (1,)), (17, (130,))])
def test_linear_q8_kernel_matches_the_reference(kernels, K, N, rows):
    x, w, s = _case(N, K, 32, seed=K * 7 + N, shape=rows)
    (y,) = session(linear_model(w, s, K), kernels).run(None, {"x": x.numpy()})
    assert y.shape == (*rows, N) and y.dtype == np.float32
    _check(y, oracle(x, w, s))


@pytest.mark.parametrize("block,K,shape,N", [
    (64, 300, (4,), 9), (64, 1024, (17,), 70),  # multiples of 32: the vector path, two steps a block
    (16, 100, (3,), 5), (4, 33, (2,), 6), (12, 37, (9,), 4),  # the per-block loop
    (128, 1024, (2, 3), 65),  # [B, T, K]
])
def test_linear_q8_kernel_takes_other_block_sizes(kernels, block, K, shape, N):
    x, w, s = _case(N, K, block, seed=block + K, shape=shape)
    (y,) = session(linear_model(w, s, K), kernels).run(None, {"x": x.numpy()})
    _check(y, oracle(x, w, s))


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1e4, 1e30])
def test_linear_q8_kernel_at_large_and_tiny_magnitudes_and_zero_blocks(kernels, magnitude):
    x, w, s = _case(40, 1000, 32, seed=3, shape=(5,), magnitude=magnitude)
    x[0] = 0  # a zero row: every block scale 0, codes 0
    x[1, 32:96] = 0  # zero blocks amid others
    x[2, :] = magnitude  # every code 127
    w[3] = 128  # a zero weight row: scales stay, codes 0
    s[4, :5] = 0
    (y,) = session(linear_model(w, s, 1000), kernels).run(None, {"x": x.numpy()})
    want = oracle(x, w, s)
    assert np.isfinite(y).all() and (y[0] == 0).all() and (y[:, 3] == 0).all()
    _check(y, want)


@pytest.mark.parametrize("rows", [1, 3, 9])  # decode rows (the GEMV) and prefill rows (the GEMM)
def test_linear_q8_kernel_gives_nan_where_a_row_holds_a_nan_or_an_infinity(kernels, rows):
    """As the reference: a row with a NaN or an infinity gives NaN outputs (its codes would be undefined as int8);
    the other rows are untouched."""
    from k3x.custom_ops.linear_q8.reference import linear_q8

    x, w, s = _case(17, 100, 32, seed=rows, shape=(rows,))
    x[0, 40] = float("nan")
    if rows > 1:
        x[rows - 1, 99] = float("inf")
    (y,) = session(linear_model(w, s, 100), kernels).run(None, {"x": x.numpy()})
    bad = [0, rows - 1]
    assert np.isnan(y[bad]).all() and torch.isnan(linear_q8(x, w, s)[bad]).all()
    good = [r for r in range(rows) if r not in bad]
    _check(y[good], oracle(x[good], w, s))


def test_linear_q8_kernel_quantises_the_activations_like_the_reference(kernels):
    """Against the fp32 product on the dequantised weights (no activation rounding) the kernel is ~1e-3 off;
    against the int8 reference, ~1e-7: it rounds x per block as the reference does."""
    from k3x.custom_ops.linear_q8.reference import dequantize

    x, w, s = _case(64, 1024, 32, seed=5, shape=(3,))
    (y,) = session(linear_model(w, s, 1024), kernels).run(None, {"x": x.numpy()})
    exact = (x.double() @ dequantize(w, s, 1024, torch.float64).T).numpy()
    to_int8 = np.abs(y - oracle(x, w, s)).max()
    to_fp32 = np.abs(y - exact).max()
    assert to_fp32 > 1e-4 and to_int8 < to_fp32 / 100


def test_linear_q8_kernel_beside_its_function_body(kernels):
    """MLAS's MatMulNBits (the body, run without the library) computes the same op: the two agree to a few fp32
    ulp of the output (a code rounded the other way at an exact half would be off by a step: rare)."""
    x, w, s = _case(70, 300, 32, seed=2, shape=(33,))
    model = linear_model(w, s, 300, body=True)
    for rows in (1, 4, 33):
        (body,) = session(model).run(None, {"x": x[:rows].numpy()})
        (kernel,) = session(model, kernels).run(None, {"x": x[:rows].numpy()})
        np.testing.assert_allclose(kernel, body, rtol=1e-4, atol=1e-4 * float(np.abs(body).max()))


def test_linear_q8_kernel_names_the_bad_input(kernels):
    x, w, s = _case(4, 64, 32, seed=0, shape=(2,))
    with pytest.raises(Exception, match=r"k3::LinearQ8: x \[2, 65\], weight \[4, 2, 32\] and scales \[4, 2\]: "
                                        r"expected \[\.\.\., K\]"):
        session(linear_model(w, s, 64), kernels).run(None, {"x": np.zeros((2, 65), np.float32)})
    bad = torch.full((4, 3, 6), 128, dtype=torch.uint8)
    with pytest.raises(Exception, match=r"k3::LinearQ8: block size 6 \(weight \[4, 3, 6\]\): the kernel takes a "
                                        r"multiple of 4"):
        session(linear_model(bad, torch.ones(4, 3), 18), kernels).run(None, {"x": np.zeros((1, 18), np.float32)})


@pytest.mark.parametrize("flags", [["-mno-avx512f", "-mno-avxvnni"], ["-mno-avx2"]], ids=["avx2", "generic"])
def test_linear_q8_kernel_on_the_other_paths(kernels, tmp_path, flags):
    """The same source built for a CPU without VNNI (the AVX2 path) and without AVX2 (the scalar path), loaded as
    the library is, against the reference."""
    from k3x.custom_ops.fused import FUSED_DOMAIN
    from k3x.plan.onnx_node import DOMAIN
    from k3x.runtime import ort_kernels

    skip_without_ort_headers()
    entry = tmp_path / "entry.cc"
    entry.write_text(ort_kernels.ENTRY.format(
        domain=DOMAIN, fused=FUSED_DOMAIN, declarations="void k3x_add_linear_q8(Ort::CustomOpDomain&, "
        "Ort::CustomOpDomain&);", calls="    k3x_add_linear_q8(k3, fused);"))
    library = tmp_path / "libq8.so"
    source = ort_kernels.sources()["linear_q8"]
    r = subprocess.run([*ort_kernels.compiler_command(), *flags, str(entry), str(source), "-o", str(library)],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    for N, K, block, rows in ((17, 1024, 32, (3,)), (300, 100, 32, (1,)), (9, 300, 64, (17,)), (5, 37, 12, (2,))):
        x, w, s = _case(N, K, block, seed=N + K, shape=rows)
        x[0, :block] = 0
        (y,) = session(linear_model(w, s, K), library).run(None, {"x": x.numpy()})
        _check(y, oracle(x, w, s))
