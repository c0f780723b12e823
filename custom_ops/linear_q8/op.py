"""`k3::linear_q8` — a dense projection on 8-bit block-quantised weights: schema, fake impl, shape rule.

    k3::linear_q8(x [..., K] fp32, weight [N, KB, BLOCK] uint8, scales [N, KB] fp32) -> [..., N] fp32
The int8 CPU trunk (model/trunk.py): a quarter of fp32's weight bytes. The reference (reference.py) quantises
the activations per block and multiplies the codes; ONNX Runtime runs the node on the kernel library's
ort_kernel.cc (the same math: block dot products in integers, streaming the weights once at decode) when it is
built, else as its function body, ONNX Runtime's own `com.microsoft::MatMulNBits` (onnx.py). A CPU-only family (registry.CPU_ONLY): no Triton kernel, no TensorRT plugin,
no `kernels` argument. K, N and the block size are node attributes (MatMulNBits needs them; K may be any
size, the last block zero-padded), read off the shapes at export.
"""

from __future__ import annotations

from torch import Tensor

from ...plan.signature import Attr, Signature, TensorPort
from . import reference

SIGNATURE = Signature(
    "linear_q8", "LinearQ8",
    inputs=(TensorPort("x", "X"), TensorPort("weight", "C"), TensorPort("scales", "X")),
    outputs=(TensorPort("y", "X"),),
    attrs=(Attr("K", int, op=False), Attr("N", int, op=False), Attr("block_size", int, op=False)),
    shapes=lambda s: [tuple(s[0][:-1]) + (s[1][0],)],
    doc="Linear projection on 8-bit block-quantised weights: x float [..., K], weight uint8 [N, ceil(K / "
        "block_size), block_size] (code 128 is zero), scales float [N, ceil(K / block_size)] -> y float [..., N] "
        "= x @ ((weight - 128) * scales)^T. Same contract as torch.ops.k3.linear_q8.",
)


@SIGNATURE.define
def _linear_q8(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    return reference.linear_q8(x, weight, scales)


def linear_q8(x: Tensor, weight: Tensor, scales: Tensor) -> Tensor:
    """x [..., K] fp32 through 8-bit weights [N, KB, BLOCK] and their scales [N, KB] -> [..., N] fp32 (one
    `k3::linear_q8` graph node)."""
    import torch

    return torch.ops.k3.linear_q8(x, weight, scales)

