"""`k3::LinearBF16` in ONNX: the node spec, the torch.onnx translation of `torch.ops.k3.linear_bf16`, and the
ONNX Runtime function body.

The node takes the bf16 weight initializer as stored (two bytes a weight in model.onnx). The body is three
standard ops, MatMul(X, Transpose(Cast(W, float))): ONNX Runtime constant-folds the Cast and the Transpose of an
initializer when the session is made, so without the kernel library the node runs as fp32 MLAS MatMul on a
widened copy (fp32 bytes in memory, the bf16 file on disk); with the library (ort_kernel.cc) the kernel reads
the bf16 bytes themselves. No attributes. TensorRT has no plugin for it: the trt flavor refuses the node
(registry.CPU_ONLY, exporter/onnx_flavors.py).
"""

from __future__ import annotations

import onnx

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()


def translate(x, weight):
    return opset().LinearBF16(x, weight, **COMMON_ATTRIBUTES)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body (the same for every node) and the extra opsets it imports (none)."""
    b = Body("LinearBF16", "matmul")
    wt = b.op("Transpose", b.op("Cast", "weight", to=onnx.TensorProto.FLOAT), perm=[1, 0])  # [K, N] fp32
    b.out("MatMul", ["x", wt], ["y"])
    return b.function(NODE, {"": opset_version}), {}
