"""`k3::AttnRes` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.attn_res`, and the ONNX Runtime function body (standard ops, fp32: RMS-normalised scores,
softmax over sources, mix of the raw sources)."""

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
    """The ONNX Runtime body and the extra opsets it imports (none). Each source is read a few times and
    nothing of its size is written but V itself: score = (V · query) / sqrt(mean(V²) + eps) (= K · query,
    without materialising the keys K; the sum of squares by ReduceSumSquare), the query a [d, 1] matrix (ONNX
    Runtime's MatMul with a 1-D operand is a per-row loop, ~30x slower at prefill), the mix one MatMul of the
    [1, N+1] weights by the [N+1, d] sources per token."""
    FLOAT = onnx.TensorProto.FLOAT
    b = Body("AttnRes", "keys")
    src, last = b.ints(-2), b.ints(-1)
    V = b.op("Cast", b.op("Concat", "bank", b.op("Unsqueeze", "prefix", src), axis=-2), to=FLOAT)  # [..., N+1, d]
    d = b.op("Cast", b.op("Shape", V, start=-1), to=FLOAT)
    eps = b.ref("eps", onnx.AttributeProto.FLOAT, "value_float")
    rms = b.op("Sqrt", b.op("Add", b.op("Div", b.op("ReduceSumSquare", V, last, keepdims=1), d), eps))  # [..., N+1, 1]
    b.step = "scores"
    query = b.op("Mul", b.op("Cast", "norm_weight", to=FLOAT), b.op("Cast", "proj_weight", to=FLOAT))  # [d]
    s = b.op("Div", b.op("MatMul", V, b.op("Unsqueeze", query, last)), rms)  # [..., N+1, 1]
    p = b.op("Softmax", b.op("Squeeze", s, last), axis=-1)  # [..., N+1]
    b.step = "mix"
    mixed = b.op("Squeeze", b.op("MatMul", b.op("Unsqueeze", p, src), V), src)  # [..., 1, N+1] @ [..., N+1, d]
    b.out("CastLike", [mixed, "prefix"], ["out"])
    return b.function(NODE, {"": opset_version}), {}
