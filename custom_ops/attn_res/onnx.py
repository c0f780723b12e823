"""`k3::AttnRes` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.attn_res`, and the ONNX Runtime function body (standard ops, fp32: RMS keys, softmax over
sources, mix of the raw sources)."""

from __future__ import annotations

import onnx

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted


def translate(prefix, bank, norm_weight, proj_weight, eps: float, kernels: str):
    return opset().AttnRes(prefix, bank, norm_weight, proj_weight, eps=float(eps),
                           hidden_size=static(prefix.shape[-1], "attn_res hidden_size"), **COMMON_ATTRIBUTES)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports (none)."""
    FLOAT = onnx.TensorProto.FLOAT
    b = Body("AttnRes", "keys")
    src, last = b.ints(-2), b.ints(-1)
    V = b.op("Cast", b.op("Concat", "bank", b.op("Unsqueeze", "prefix", src), axis=-2), to=FLOAT)  # [..., N+1, d]
    ms = b.op("ReduceMean", b.op("Mul", V, V), last, keepdims=1)
    eps = b.ref("eps", onnx.AttributeProto.FLOAT, "value_float")
    K = b.op("Mul", V, b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, eps))))
    b.step = "scores"
    query = b.op("Mul", b.op("Cast", "norm_weight", to=FLOAT), b.op("Cast", "proj_weight", to=FLOAT))  # [d]
    p = b.op("Softmax", b.op("MatMul", K, query), axis=-1)  # [..., N+1]
    b.step = "mix"
    mixed = b.op("ReduceSum", b.op("Mul", b.op("Unsqueeze", p, last), V), src, keepdims=0)  # [..., d]
    b.out("CastLike", [mixed, "prefix"], ["out"])
    return b.function(NODE, {"": opset_version}), {}
