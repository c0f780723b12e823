"""k3::linear_bf16: the reference against the formula (fp64 of the same bf16 weights) on awkward sizes, the op's
shape and dtype errors, and the op through torch.export -> ONNX -> ONNX Runtime on its function body (the `ort`
flavor); the `trt` flavor refuses the node (a CPU-only family: no plugin)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiny_onnx import export_k3, ort_flavor_session

import k3x.custom_ops  # noqa: F401  (registers torch.ops.k3.*)
from k3x.custom_ops.linear_bf16 import linear_bf16
from k3x.custom_ops.linear_bf16.reference import linear_bf16 as reference


def _inputs(shape: tuple[int, ...], N: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    K = shape[-1]
    return torch.randn(shape, generator=g), (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)


def _tolerance(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation's bound per output: K ulps of the sum of |products| (a wide margin over sqrt(K))."""
    return x.shape[-1] * 2.0 ** -23 * (x.abs().double() @ w.double().abs().T)


@pytest.mark.parametrize("shape,N", [((1, 1), 1), ((3, 37), 19), ((17, 100), 45), ((2, 5, 129), 33),
                                     ((130, 260), 7)])
def test_reference_is_the_formula(shape, N):
    x, w = _inputs(shape, N, seed=sum(shape) + N)
    y = linear_bf16(x, w)
    exact = x.double() @ w.double().T  # the bf16 weights widen exactly; only the accumulation rounds
    assert y.dtype == torch.float32 and y.shape == (*shape[:-1], N)
    assert ((y.double() - exact).abs() <= _tolerance(x, w)).all()
    assert torch.equal(y, reference(x, w))


def test_weights_are_read_exactly_and_activations_stay_fp32():
    """One-hot rows pick the weights' columns bit for bit; an activation with more bits than bf16 holds keeps
    them (1 + 2^-20 would round to 1 in bf16)."""
    x, w = _inputs((4, 24), 10, seed=3)
    eye = torch.eye(24)[:4]
    assert torch.equal(linear_bf16(eye, w), w[:, :4].float().T)
    one = torch.zeros(1, 24)
    one[0, 0] = 1 + 2.0 ** -20
    w = torch.zeros(1, 24, dtype=torch.bfloat16)
    w[0, 0] = 1.0
    assert linear_bf16(one, w).item() == 1 + 2.0 ** -20


@pytest.mark.parametrize("shape", [(1, 37), (2, 1, 37), (3, 17, 37)])
def test_opcheck(shape):
    """Schema, fake impl against the op, dispatch under aot_autograd with dynamic shapes."""
    x, w = _inputs(shape, 19, seed=shape[-2])
    torch.library.opcheck(torch.ops.k3.linear_bf16.default, (x, w),
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


@pytest.mark.parametrize("x,w,message", [
    (torch.zeros(2, 8), torch.zeros(4, 9, dtype=torch.bfloat16), r"x \(2, 8\) .* weight \(4, 9\)"),
    (torch.zeros(2, 8), torch.zeros(4, 8), r"weight \(4, 8\) torch.float32"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(4, 8, dtype=torch.bfloat16), r"x \(2, 8\) torch.bfloat16"),
    (torch.zeros(2, 8), torch.zeros(2, 4, 8, dtype=torch.bfloat16), r"weight \(2, 4, 8\)"),
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(4, 8, dtype=torch.bfloat16),
     r"x \(2, 8\) torch.float64: expected float32"),
])
def test_op_names_the_bad_input(x, w, message):
    with pytest.raises(ValueError, match=message):
        linear_bf16(x, w)


class Tiny(torch.nn.Module):
    """Two bf16 projections, as a trunk's would be: parameters stored in bf16, activations fp32."""

    def __init__(self, K: int, H: int, N: int) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.up = torch.nn.Parameter((torch.randn(H, K, generator=g) / K ** 0.5).to(torch.bfloat16))
        self.down = torch.nn.Parameter((torch.randn(N, H, generator=g) / H ** 0.5).to(torch.bfloat16))

    def forward(self, x):
        return linear_bf16(torch.relu(linear_bf16(x, self.up)), self.down)


@pytest.fixture(scope="module")
def exported():
    """Tiny(37, 45, 19) through torch.export (batch and sequence dynamic) and torch.onnx, k3 nodes bare."""
    model = Tiny(37, 45, 19)
    return model, export_k3(model, torch.randn(2, 5, 37))


def test_export_to_onnx_runs_the_function_body_on_onnx_runtime(exported):
    import onnx_ir as ir

    model, onnx_model = exported
    k3 = [n for n in onnx_model.graph if n.domain == "k3"]
    assert [n.op_type for n in k3] == ["LinearBF16"] * 2 and all(n.inputs[1].dtype == ir.DataType.BFLOAT16 for n in k3)
    assert not [n for n in k3 if set(n.attributes) != {"plugin_namespace"}]  # no attributes of its own
    proto, sess = ort_flavor_session(onnx_model)
    for shape in ((1, 1, 37), (3, 17, 37), (1, 130, 37)):
        x = torch.randn(shape, generator=torch.Generator().manual_seed(shape[1]))
        (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
        with torch.no_grad():
            want = model(x)
        assert y.shape == (*shape[:-1], 19)
        np.testing.assert_allclose(y, want.numpy(), rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_trt_flavor_refuses_the_node(exported):
    import onnx_ir as ir

    from k3x.exporter.onnx_flavors import trt_pass

    copy = ir.serde.deserialize_model(ir.serde.serialize_model(exported[1]))
    with pytest.raises(ValueError, match=r"k3::LinearBF16.*no TensorRT plugin; export the ort flavor"):
        trt_pass(copy)
