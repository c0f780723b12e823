"""`k3::linear_bf16` — a dense projection reading bf16 weights as stored: schema, fake impl, shape rule.

    k3::linear_bf16(x [..., K] fp32, weight [N, K] bf16) -> [..., N] fp32 = x @ weight.float().T
fp32 accumulation, activations kept in fp32 (reference.py). The CPU trunk of a bf16 export: the graph keeps the
checkpoint's bf16 bytes (half of fp32's), and ONNX Runtime runs the node on the kernel library's bf16 GEMV /
GEMM (ort_kernel.cc) or, without the library, on its function body (onnx.py). A CPU-only family
(registry.CPU_ONLY): no Triton kernel, no TensorRT plugin, no `kernels` argument; on any torch device the op
is the reference's matmul. No config limits: any K and N.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.signature import Signature, TensorPort
from . import reference

SIGNATURE = Signature(
    "linear_bf16", "LinearBF16",
    inputs=(TensorPort("x", "X"), TensorPort("weight", "B")),
    outputs=(TensorPort("y", "X"),),
    attrs=(),
    shapes=lambda s: [tuple(s[0][:-1]) + (s[1][0],)],
    doc="Linear projection on bf16 weights: x float [..., K], weight bfloat16 [N, K] (nn.Linear's layout) -> "
        "y float [..., N] = x @ float(weight)^T, fp32 accumulation. Same contract as torch.ops.k3.linear_bf16.",
)


@SIGNATURE.define
def _linear_bf16(x: Tensor, weight: Tensor) -> Tensor:
    if x.dtype != torch.float32:  # the reference also takes fp64 (an fp64 oracle); the op's output is fp32
        raise ValueError(f"linear_bf16: x {tuple(x.shape)} {x.dtype}: expected float32")
    return reference.linear_bf16(x, weight)


def linear_bf16(x: Tensor, weight: Tensor) -> Tensor:
    """x [..., K] fp32 through weight [N, K] bf16 -> [..., N] fp32 (one `k3::linear_bf16` graph node)."""
    return torch.ops.k3.linear_bf16(x, weight)
