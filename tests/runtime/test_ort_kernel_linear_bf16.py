"""The k3::LinearBF16 ONNX Runtime CPU kernel (custom_ops/linear_bf16/ort_kernel.cc) against the reference
(custom_ops/linear_bf16/reference.py in fp64 on the same bf16 weights), on a node with no function body beside it
(so the kernel ran): decode rows (1 to 4: the GEMV path), prefill rows (the transposed-panel GEMM: row tiles and
tails, K over several panel blocks), 3-D inputs, widths K and N that are no multiple of the vector width; the
kernel equal to the function body; errors that name the bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper

from ort_kernel_models import session


def linear_model(weight: torch.Tensor, body: bool = False):
    """One k3::LinearBF16 node, x a float input of any shape, `weight` [N, K] a bfloat16 initializer (the
    checkpoint's bytes); with `body`, the ort flavor's function body attached."""
    w = helper.make_tensor("weight", TensorProto.BFLOAT16, list(weight.shape),
                           weight.contiguous().view(torch.int16).numpy().tobytes(), raw=True)
    node = helper.make_node("LinearBF16", ["x", "weight"], ["y"], domain="k3", plugin_namespace="k3")
    graph = helper.make_graph([node], "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializer=[w])
    functions = []
    if body:
        from k3x.custom_ops.linear_bf16.onnx import function

        functions = [function(20, [node])[0]]
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                             ir_version=10, functions=functions)


def _weights(N: int, K: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)


@pytest.mark.parametrize("shape,N", [
    ((1, 1), 1),  # one weight
    ((1, 37), 45),  # decode, K below one vector, N not a multiple of the rows a step takes
    ((2, 100), 67), ((3, 129), 130), ((4, 1030), 19),  # decode rows 2, 3, 4, K with a vector tail
    ((20, 1030), 35),  # prefill: K over two panel blocks and a tail, N a panel and a tail
    ((17, 100), 45),  # prefill: a tile of rows and a tail, N a panel and a tail
    ((130, 260), 67),
    ((2, 9, 37), 33), ((1, 3, 130), 7),  # [B, T, K]: 18 rows (sweep) and 3 (GEMV)
    ((0, 16), 8),  # no rows
])
def test_linear_bf16_kernel_matches_the_reference(kernels, shape, N):
    from k3x.custom_ops.linear_bf16.reference import linear_bf16

    K = shape[-1]
    w = _weights(N, K, seed=N * 31 + K)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape)))
    (y,) = session(linear_model(w), kernels).run(None, {"x": x.numpy()})
    want = linear_bf16(x.double(), w).numpy()
    assert y.shape == (*shape[:-1], N) and y.dtype == np.float32
    scale = float(np.sqrt((want ** 2).mean())) if want.size else 1.0
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * scale)


def test_linear_bf16_kernel_keeps_the_activations_in_fp32(kernels):
    """An activation with more bits than bf16 holds keeps them (1 + 2^-20 would round to 1 in bf16), on both
    paths."""
    w = torch.zeros(5, 40, dtype=torch.bfloat16)
    w[:, 3] = 1.0
    sess = session(linear_model(w), kernels)
    for rows in (1, 9):
        x = torch.zeros(rows, 40)
        x[:, 3] = 1 + 2.0 ** -20
        (y,) = sess.run(None, {"x": x.numpy()})
        assert (y == np.float32(1 + 2.0 ** -20)).all()


def test_linear_bf16_kernel_equals_its_function_body(kernels):
    """The same node with its body attached: the library's kernel and ONNX Runtime's MLAS on the widened
    weights agree (and without the library the body runs)."""
    w = _weights(70, 300, seed=2)
    model = linear_model(w, body=True)
    for shape in ((1, 300), (4, 300), (2, 33, 300)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[-2])).numpy()
        (body,) = session(model).run(None, {"x": x})
        (kernel,) = session(model, kernels).run(None, {"x": x})
        np.testing.assert_allclose(kernel, body, rtol=1e-5, atol=1e-5 * float(np.abs(body).max()))


def test_linear_bf16_kernel_names_the_bad_input(kernels):
    with pytest.raises(Exception, match=r"k3::LinearBF16: x \[2, 8\] and weight \[4, 9\]: expected \[\.\.\., K\] "
                                        r"and \[N, K\]"):
        session(linear_model(_weights(4, 9, seed=0)), kernels).run(None, {"x": np.zeros((2, 8), np.float32)})
