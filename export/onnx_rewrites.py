"""Rewrites of the converted model's own nodes (not the k3 function bodies), made once in export/onnx.py
`to_onnx_ir` so every flavor file (and every rank, which reuses the converted model) holds the same graph:
standard ops in a form ONNX Runtime's graph optimizer fuses; TensorRT gets the same math.

- `rsqrt_as_div`: `x * Reciprocal(Sqrt(a))` (how torch.onnx writes `x * torch.rsqrt(a)`) becomes
  `Div(x, Sqrt(a))`. RMSNorm (`model/layers.py rms_norm`) is then Pow -> ReduceMean -> Add -> Sqrt -> Div ->
  Mul(weight), the pattern ONNX Runtime fuses into one SimplifiedLayerNormalization kernel (7 nodes and 6
  passes over the activations -> 1); the l2 norms of KDA's q/k lose their Reciprocal. Same math, one rounding
  less.
- `merge_sibling_gemms`: `Concat(Gemm(x, W1ᵀ), Gemm(x, W2ᵀ), ..., axis=-1)` (KDA's q, k, v projections, which
  the short conv reads as one [N, 3P] tensor) becomes `Gemm(x, Concat(W1, W2, ...)ᵀ)`: one GEMM over the
  three weights and no copy of their outputs. The weights' Concat is a node over the initializers, which ONNX
  Runtime and TensorRT fold into one constant at load: no weight is copied at export (streamed and weightless
  exports are unchanged). Same dot products; measured on k3-bench prefill in the note of this change.
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


def _attr(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _plain_gemm(node: ir.Node | None, graph: ir.Graph) -> bool:
    """x @ Wᵀ with W a weight (no producer: an initializer or, in a weightless export, a graph input), no bias,
    unscaled, its one use the caller's."""
    if not _is(node, "Gemm") or node.graph is not graph or len([i for i in node.inputs if i is not None]) != 2:
        return False
    if (_attr(node, "transA", 0), _attr(node, "transB", 0), _attr(node, "alpha", 1.0)) != (0, 1, 1.0):
        return False
    out = node.outputs[0]
    return node.inputs[1].producer() is None and len(out.uses()) == 1 and not out.is_graph_output()


def merge_sibling_gemms(model: ir.Model) -> int:
    """Rewrite every top-level `Concat(Gemm(x, W1, transB=1), ..., axis=-1)` of two or more plain Gemms of one
    x into `Gemm(x, Concat(W1, ..., axis=0), transB=1)`; returns how many Concats were rewritten."""
    graph, done = model.graph, 0
    for cat in [n for n in graph if _is(n, "Concat") and len(n.inputs) >= 2]:
        gemms = [v.producer() for v in cat.inputs]
        rank = len(cat.outputs[0].shape) if cat.outputs[0].shape is not None else None
        if rank is None or _attr(cat, "axis", 0) not in (-1, rank - 1) or cat.outputs[0].is_graph_output():
            continue
        if not all(_plain_gemm(g, graph) for g in gemms) or len({id(g.inputs[0]) for g in gemms}) != 1:
            continue
        weights = [g.inputs[1] for g in gemms]
        if len({w.dtype for w in weights}) != 1 or len(set(map(id, gemms))) != len(gemms):
            continue
        stacked = ir.node("Concat", weights, attributes={"axis": 0}, name=f"{cat.name}/merged_weights")
        stacked.outputs[0].dtype = weights[0].dtype
        gemm = ir.node("Gemm", [gemms[0].inputs[0], stacked.outputs[0]], attributes={"transB": 1},
                       name=f"{cat.name}/merged_gemm")
        gemm.outputs[0].dtype, gemm.outputs[0].shape = cat.outputs[0].dtype, cat.outputs[0].shape
        graph.insert_before(cat, [stacked, gemm])
        ir.convenience.replace_all_uses_with(cat.outputs[0], gemm.outputs[0])
        graph.remove([cat, *gemms], safe=True)
        done += 1
    return done
