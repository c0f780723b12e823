"""Sibling projections as one node (the ort flavor): x · W₁ᵀ, x · W₂ᵀ, ... on one x become x · [W₁; W₂; ...]ᵀ.

A KDA layer projects its normed input six times (q, k, v, the decay gate's f_a, beta's b, the output gate g), an
MLA layer twice, a shared-expert MLP twice (gate, up), each a call with a fixed cost besides its bytes: on the
CPU trunks ONNX Runtime's MatMulNBits takes ~15 µs for even a 0.5 MB matrix. Every family whose onnx.py declares
`SIBLINGS` (plan/onnx_node.RowStacked: a node over row-stacked weights) is merged here:
- Nodes of that type with the same x and equal attributes (but the summed `rows`), whose weights are
  initializers, become one node: its weights a Concat of theirs along the rows (ONNX Runtime folds it into one
  initializer when the session is made: nothing changes on disk, and the trt flavor never sees it), its output
  a Split back into theirs, each keeping its name. A column of x · Wᵀ does not depend on the other columns:
  LinearBF16's outputs are the unmerged ones bit for bit; MatMulNBits sums a column whose 16-wide tile it now
  shares with another projection's columns in another order, within fp32 rounding (~4e-6 relative in
  tests/exporter/test_onnx_siblings.py; bit for bit where every width is a multiple of 16).
- A Concat that only re-joins consecutive pieces of such a Split (KDA's q | k | v) takes one piece instead.
- Measured on the 2-core AMD EPYC (Zen 4): a KDA layer's seven 8-bit projections of one input, caches evicted
  between calls, 224 µs as seven MatMulNBits calls, 158 µs as one.
"""

from __future__ import annotations

from collections import defaultdict

import onnx_ir as ir

from ..custom_ops.registry import families
from ..plan.onnx_node import DOMAIN, RowStacked


def stacked_types() -> dict[str, RowStacked]:
    """k3 op type -> its RowStacked declaration, for every family that has one."""
    return {f.onnx.NODE.op_type: f.onnx.SIBLINGS for f in families() if getattr(f.onnx, "SIBLINGS", None)}


def merge_siblings(model: ir.Model) -> int:
    """Merge every group of sibling projections in the main graph (module docstring); returns the nodes removed."""
    graph, removed = model.graph, 0
    kinds = stacked_types()
    groups: dict[tuple, list[ir.Node]] = defaultdict(list)
    for node in graph:
        spec = kinds.get(node.op_type) if node.domain == DOMAIN else None
        if spec is None or not all(_initializer(node.inputs[i]) for i in spec.weights):
            continue
        attrs = tuple(sorted((k, repr(a.value)) for k, a in node.attributes.items() if k != spec.rows))
        groups[(node.op_type, id(node.inputs[0]), attrs)].append(node)
    for (op_type, _, _), nodes in groups.items():
        if len(nodes) > 1:
            _merge(graph, nodes, kinds[op_type])
            removed += len(nodes) - 1
    for concat in [n for n in graph if n.op_type == "Concat" and n.domain == ""]:
        removed += _rejoin(graph, concat)
    return removed


def _initializer(v: ir.Value | None) -> bool:
    return v is not None and v.is_initializer() and v.shape is not None and isinstance(v.shape[0], int)


def _const(graph: ir.Graph, name: str, values: list[int]) -> ir.Value:
    value = ir.Value(name=name, const_value=ir.tensor(values, dtype=ir.DataType.INT64))
    value.shape, value.dtype = ir.Shape([len(values)]), ir.DataType.INT64
    graph.register_initializer(value)
    return value


def _merge(graph: ir.Graph, nodes: list[ir.Node], spec: RowStacked) -> None:
    """`nodes` (one op type, one x) as one node over their row-concatenated weights, its output split back."""
    first = nodes[0]
    widths = [n.inputs[spec.weights[0]].shape[0] for n in nodes]
    inputs = list(first.inputs)
    for i in spec.weights:
        cat = ir.node("Concat", [n.inputs[i] for n in nodes], attributes={"axis": 0}, name=f"{first.name}/rows_{i}")
        graph.insert_before(first, cat)
        inputs[i] = cat.outputs[0]
    attrs = {k: a.value for k, a in first.attributes.items()}
    if spec.rows is not None:
        attrs[spec.rows] = sum(widths)
    merged = ir.node(first.op_type, inputs, attributes=attrs, domain=first.domain, name=f"{first.name}/siblings")
    out = first.outputs[0]
    merged.outputs[0].dtype = out.dtype
    if out.shape is not None:
        merged.outputs[0].shape = ir.Shape([*out.shape[:-1], sum(widths)])
    graph.insert_before(first, merged)
    split = ir.node("Split", [merged.outputs[0], _const(graph, f"{out.name}/siblings_widths", widths)],
                    attributes={"axis": -1}, num_outputs=len(nodes), name=f"{first.name}/siblings_split")
    graph.insert_before(first, split)
    for node, piece in zip(nodes, split.outputs):
        _replace(node.outputs[0], piece)
        graph.remove(node, safe=True)


def _replace(old: ir.Value, new: ir.Value) -> None:
    """Every use of `old` moved to `new`, which takes `old`'s dtype, shape and name (a graph output's too)."""
    new.dtype, new.shape = old.dtype, old.shape
    ir.convenience.replace_all_uses_with(old, new, replace_graph_outputs=True)
    name, old.name = old.name, None
    new.name = name


def _rejoin(graph: ir.Graph, concat: ir.Node) -> int:
    """A Concat of consecutive pieces of one sibling Split along its axis, used by nothing else, as one piece of
    that Split; returns the nodes removed (0 or 1)."""
    split = concat.inputs[0].producer() if concat.inputs and concat.inputs[0] is not None else None
    if split is None or split.op_type != "Split" or not split.name.endswith("/siblings_split"):
        return 0
    pieces = list(split.outputs)
    if any(v is None or v.producer() is not split for v in concat.inputs):
        return 0
    idx = [pieces.index(v) for v in concat.inputs]
    rank = len(concat.outputs[0].shape) if concat.outputs[0].shape is not None else None
    axis = concat.attributes["axis"].value
    if idx != list(range(idx[0], idx[0] + len(idx))) or rank is None or axis % rank != rank - 1 \
            or any(len(pieces[i].uses()) != 1 or pieces[i].is_graph_output() for i in idx):
        return 0
    widths = list(split.inputs[1].const_value.numpy())
    lo, hi = idx[0], idx[-1] + 1
    new_widths = [int(w) for w in widths[:lo]] + [int(sum(widths[lo:hi]))] + [int(w) for w in widths[hi:]]
    widths_value = _const(graph, f"{concat.outputs[0].name}/siblings_widths", new_widths)
    remade = ir.node("Split", [split.inputs[0], widths_value], attributes={"axis": -1},
                     num_outputs=len(new_widths), name=split.name)
    graph.insert_before(split, remade)
    kept = pieces[:lo] + [concat.outputs[0]] + pieces[hi:]
    for old, new in zip(kept, remade.outputs):
        _replace(old, new)
    old_widths = split.inputs[1]
    graph.remove(concat, safe=True)
    graph.remove(split, safe=True)
    if not old_widths.uses():
        graph.initializers.pop(old_widths.name)
    return 1
