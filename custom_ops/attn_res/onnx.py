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


def _scores(b: Body, V: str, query: str, d: str, eps: str) -> str:
    """(V · query) / sqrt(mean(V²) + eps) [..., n, 1] of sources V [..., n, d] (the sum of squares by
    ReduceSumSquare)."""
    rms = b.op("Sqrt", b.op("Add", b.op("Div", b.op("ReduceSumSquare", V, b.ints(-1), keepdims=1), d), eps))
    return b.op("Div", b.op("MatMul", V, query), rms)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports (none). Each source is read a few times and
    nothing of the sources' size is written: the bank and the prefix are never concatenated (V = [bank |
    prefix] only in the math); score = (V · query) / sqrt(mean(V²) + eps) (= K · query, without materialising
    the keys K) per part, the two parts' scores [..., N, 1] and [..., 1, 1] joined for the softmax; the query
    a [d, 1] matrix (ONNX Runtime's MatMul with a 1-D operand is a per-row loop, ~30x slower at prefill); the
    mix one MatMul of the bank's [1, N] weights by its [N, d] sources per token plus the prefix's weight times
    the prefix."""
    FLOAT = onnx.TensorProto.FLOAT
    b = Body("AttnRes", "keys")
    src, last = b.ints(-2), b.ints(-1)
    bank, prefix = b.op("Cast", "bank", to=FLOAT), b.op("Cast", "prefix", to=FLOAT)  # [..., N, d], [..., d]
    d = b.op("Cast", b.op("Shape", prefix, start=-1), to=FLOAT)
    eps = b.ref("eps", onnx.AttributeProto.FLOAT, "value_float")
    b.step = "scores"
    query = b.op("Mul", b.op("Cast", "norm_weight", to=FLOAT), b.op("Cast", "proj_weight", to=FLOAT))  # [d]
    query = b.op("Unsqueeze", query, last)  # [d, 1]
    s = b.op("Concat", _scores(b, bank, query, d, eps), _scores(b, b.op("Unsqueeze", prefix, src), query, d, eps),
             axis=-2)  # [..., N+1, 1]
    p = b.op("Softmax", b.op("Squeeze", s, last), axis=-1)  # [..., N+1]
    b.step = "mix"
    p_bank, p_prefix = b.op("Split", p, b.op("Concat", b.op("Shape", bank, start=-2, end=-1), b.ints(1), axis=0),
                            axis=-1, outputs=2)  # [..., N], [..., 1]
    mixed = b.op("Squeeze", b.op("MatMul", b.op("Unsqueeze", p_bank, src), bank), src)  # [..., 1, N] @ [..., N, d]
    b.out("CastLike", [b.op("Add", mixed, b.op("Mul", p_prefix, prefix)), "prefix"], ["out"])
    return b.function(NODE, {"": opset_version}), {}
