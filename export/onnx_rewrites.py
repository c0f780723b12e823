"""Rewrites of the converted model's own nodes (not the k3 function bodies), made once in export/onnx.py
`to_onnx_ir` so every flavor file (and every rank, which reuses the converted model) holds the same graph:
standard ops in a form ONNX Runtime's graph optimizer fuses; TensorRT gets the same math.

- `rsqrt_as_div`: `x * Reciprocal(Sqrt(a))` (how torch.onnx writes `x * torch.rsqrt(a)`) becomes
  `Div(x, Sqrt(a))`. RMSNorm (`model/layers.py rms_norm`) is then Pow -> ReduceMean -> Add -> Sqrt -> Div ->
  Mul(weight), the pattern ONNX Runtime fuses into one SimplifiedLayerNormalization kernel (7 nodes and 6
  passes over the activations -> 1); the l2 norms of KDA's q/k lose their Reciprocal. Same math, one rounding
  less.
"""

from __future__ import annotations

import onnx_ir as ir


def _is(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain == ""


def rsqrt_as_div(model: ir.Model) -> int:
    """Rewrite every top-level `Mul(x, Reciprocal(Sqrt(a)))` (either operand order) into `Div(x, Sqrt(a))`;
    returns how many Muls were rewritten. A Reciprocal left without users is removed."""
    graph, done = model.graph, 0
    for rec in [n for n in graph if _is(n, "Reciprocal") and _is(n.inputs[0].producer(), "Sqrt")]:
        r, root = rec.outputs[0], rec.inputs[0]
        for mul, index in list(r.uses()):
            if not _is(mul, "Mul") or mul.graph is not graph or mul.outputs[0].is_graph_output():
                continue
            x = mul.inputs[1 - index]
            div = ir.node("Div", [x, root], name=f"{mul.name}/rsqrt_as_div")
            div.outputs[0].dtype, div.outputs[0].shape = mul.outputs[0].dtype, mul.outputs[0].shape
            graph.insert_before(mul, div)
            ir.convenience.replace_all_uses_with(mul.outputs[0], div.outputs[0])
            graph.remove(mul, safe=True)
            done += 1
        if not r.uses() and not r.is_graph_output():
            graph.remove(rec, safe=True)
    return done
