"""`k3::LinearQ8` in ONNX: the node spec, the torch.onnx translation of `torch.ops.k3.linear_q8`, and the ONNX
Runtime function body: one `com.microsoft::MatMulNBits` (bits 8, no zero_points: code 128 is zero), which takes
the node's uint8 weight and fp32 scales as they are. The body is the fallback where the kernel library
(ort_kernel.cc, the same op) is not built: ONNX Runtime runs the library's kernel when it has one.

accuracy_level 4 (int8 activations, quantised per block at run time; MLAS's int8 dot products): measured on
this project's CPU machine, levels 0-2 (fp32 activations) run the 8-bit weights through a dequantising fallback,
~100x slower than fp32 MatMul on the same matrix, while level 4 streams the weights at memory speed. The
activations' rounding is part of the int8 trunk's stated tolerance (runtime/tolerances.py). TensorRT has no
plugin for the node: the trt flavor is not written for it (registry.CPU_ONLY).
"""

from __future__ import annotations

import onnx
from onnx import helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()
ACCURACY_LEVEL = 4  # MatMulNBits: int8 activations (see the module docstring)
MS_DOMAIN = "com.microsoft"


def translate(x, weight, scales):
    return opset().LinearQ8(x, weight, scales, K=static(x.shape[-1], "linear_q8 K"),
                            N=static(weight.shape[0], "linear_q8 N"),
                            block_size=static(weight.shape[2], "linear_q8 block_size"), **COMMON_ATTRIBUTES)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body (the same for every node: K, N and block_size are the calling node's attributes)
    and the extra opset it imports (com.microsoft)."""
    b = Body("LinearQ8", "matmul")
    node = helper.make_node("MatMulNBits", ["x", "weight", "scales"], ["y"], name="LinearQ8/matmul/MatMulNBits",
                            domain=MS_DOMAIN, bits=8, accuracy_level=ACCURACY_LEVEL)
    for attr in ("K", "N", "block_size"):
        node.attribute.append(onnx.AttributeProto(name=attr, ref_attr_name=attr, type=onnx.AttributeProto.INT))
    b.nodes.append(node)
    return b.function(NODE, {"": opset_version, MS_DOMAIN: 1}), {MS_DOMAIN: 1}
