"""KDA's short conv, SiLU and q/k L2 norm as one `k3x.fused::KDAShortConv` call (custom_ops/fused.py): a rewrite
of the converted batch-interface graph (model/kda.py `forward`), made once in exporter/onnx.py `to_onnx_ir` after
the rewrites of exporter/onnx_rewrites.py (the norms' Div is `rsqrt_as_div`'s), so every flavor file holds it.

Between the q|k|v projections and k3::KDA torch.onnx writes, per KDA layer: Transpose -> Concat(conv state, .)
-> Conv (depthwise) -> Transpose -> Sigmoid, Mul (SiLU) -> Reshape [B, T, 3, H, D] (its shape from Shape /
Concat) -> 3 x (Slice, Squeeze) -> 2 x L2 norm (Mul, ReduceSum, Add eps, Sqrt, Div), and a Slice of the
Concat for the new conv state: ~25 nodes, each a few microseconds of ONNX Runtime dispatch on a decode step.
The call's body is those ops (every runtime without the kernel inlines it to the same values), its CPU kernel
one pass (custom_ops/kda_prep/ort_kernel.cc). The chain is matched exactly (fp32, every intermediate used only
inside it, the shapes the tracer recorded: [B, T, 3, H, D] with 3·H·D the conv's channels, a new state of the
last W-1 columns); anything else is left as it is, and so is a chain of another channel count than the first
fused (one body, its Conv group a literal, serves every call).

TensorRT's flavor keeps the call, as it keeps LatentAttention's: a function of standard ops with no attribute
reference, which its parser inlines to the ops it parsed before (TensorRT fuses the pointwise chain itself and
has no kernel to gain). DepthwiseConv1d is undone there because its body needs the calling node's `group`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from ..custom_ops.fused import FUSED_DOMAIN, KDA_SHORT_CONV, kda_short_conv_function
from .onnx_rewrites import attach_function, attr_of, is_depthwise_conv, is_op, scalar_of, single_use, take_outputs


@dataclass
class _Chain:
    inputs: list[ir.Value]  # x, state, w, b
    outputs: list[ir.Value]  # q, k (normalised), v, the new conv state
    heads: tuple[int, int]  # H, D
    eps: float
    nodes: list[ir.Node]


def _ints(v: ir.Value | None) -> list[int] | None:
    """The values of a constant int64 tensor (an initializer or a Constant node's `value` / `value_ints`)."""
    if v is None:
        return None
    p, t = v.producer(), v.const_value
    if t is None and is_op(p, "Constant"):
        a = p.attributes.get("value") or p.attributes.get("value_ints")
        t = None if a is None else a.value
        if isinstance(t, (list, tuple)):
            return [int(i) for i in t]
    if t is None or t.dtype != ir.DataType.INT64 or t.size > 8:
        return None
    return [int(i) for i in t.numpy().reshape(-1)]


def _top(node: ir.Node | None, op_type: str, graph: ir.Graph) -> bool:
    return is_op(node, op_type) and node.graph is graph


def _reader(v: ir.Value) -> ir.Node | None:
    """The one node reading `v`, as its data input (its first), when `v` is used there only."""
    if not single_use(v):
        return None
    node, index = next(iter(v.uses()))
    return node if index == 0 else None


def _fp32(*values: ir.Value) -> bool:
    return all(v is not None and v.dtype == ir.DataType.FLOAT for v in values)


def _known(a, b) -> bool:
    """Two dims the tracer recorded as the same: equal ints, or the same named symbol."""
    return a == b and (isinstance(a, int) or getattr(a, "value", None) is not None)


def _l2norm(z: ir.Value, graph: ir.Graph) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """Div(z, Sqrt(Add(ReduceSum(Mul(z, z), [-1], keepdims=1), eps))), z used by that Mul and Div only, every
    step used once -> (the Div's output, eps, its nodes)."""
    users = {id(u): u for u, _ in z.uses()}
    mul = next((u for u in users.values() if is_op(u, "Mul")), None)
    div = next((u for u in users.values() if is_op(u, "Div")), None)
    if len(users) != 2 or z.is_graph_output() or mul is None or div is None or div.inputs[0] is not z or \
            list(mul.inputs) != [z, z]:
        return None
    red = _reader(mul.outputs[0])
    if not _top(red, "ReduceSum", graph) or attr_of(red, "keepdims", 1) != 1 or \
            attr_of(red, "noop_with_empty_axes", 0) != 0 or _ints(red.inputs[1] if len(red.inputs) > 1 else None) \
            not in ([-1], [3]) or not single_use(red.outputs[0]):
        return None
    add = next(iter(red.outputs[0].uses()))[0]  # Add(sums, eps) or Add(eps, sums)
    if not _top(add, "Add", graph) or not single_use(add.outputs[0]):
        return None
    eps = scalar_of(add.inputs[1] if add.inputs[0] is red.outputs[0] else add.inputs[0])
    sqrt = _reader(add.outputs[0])
    if eps is None or not _top(sqrt, "Sqrt", graph) or not single_use(sqrt.outputs[0]) or \
            div.inputs[1] is not sqrt.outputs[0] or div.graph is not graph:
        return None
    return div.outputs[0], eps, [mul, red, add, sqrt, div]


def _new_state(sl: ir.Node, xx: ir.Value, M: int) -> bool:
    """`sl` = Slice(xx, start, end, [2], [1]) to the end, its recorded output [B, C, M]: the last M columns."""
    ins = list(sl.inputs) + [None] * (5 - len(sl.inputs))
    shape = sl.outputs[0].shape
    return sl.inputs[0] is xx and _ints(ins[3]) in ([2], [-1]) and (ins[4] is None or _ints(ins[4]) == [1]) and \
        (_ints(ins[2]) or [0])[0] >= 2**31 - 1 and shape is not None and len(shape) == 3 and shape[2] == M and \
        _known(shape[0], xx.shape[0]) and shape[1] == xx.shape[1] and _fp32(sl.outputs[0])


def _chain(conv: ir.Node, graph: ir.Graph) -> _Chain | None:
    """The traced chain around the depthwise Conv `conv` (module docstring), or None."""
    if conv.graph is not graph or not is_depthwise_conv(conv):
        return None
    xx, w, b = conv.inputs
    cat = xx.producer()
    if not _top(cat, "Concat", graph) or len(cat.inputs) != 2 or attr_of(cat, "axis", 0) not in (-1, 2):
        return None
    state, xt = cat.inputs
    tr = xt.producer()
    if not _top(tr, "Transpose", graph) or list(attr_of(tr, "perm", [])) != [0, 2, 1] or not single_use(xt):
        return None
    x, C, y = tr.inputs[0], w.shape[0], conv.outputs[0]
    if not _fp32(x, state, w, b, y) or x.shape is None or len(x.shape) != 3 or x.shape[2] != C or \
            state.shape is None or len(state.shape) != 3 or state.shape[1] != C or state.shape[2] != w.shape[2] - 1:
        return None
    others = [u for u, _ in xx.uses() if u is not conv]
    if len(xx.uses()) != 2 or xx.is_graph_output() or not _top(others[0], "Slice", graph) or \
            not _new_state(others[0], xx, state.shape[2]):
        return None
    back = _reader(y)
    if not _top(back, "Transpose", graph) or list(attr_of(back, "perm", [])) != [0, 2, 1]:
        return None
    yt = back.outputs[0]
    users = {id(u): u for u, _ in yt.uses()}
    sig = next((u for u in users.values() if is_op(u, "Sigmoid")), None)
    silu = next((u for u in users.values() if is_op(u, "Mul")), None)
    if len(users) != 2 or yt.is_graph_output() or sig is None or silu is None or not single_use(sig.outputs[0]) or \
            {id(v) for v in silu.inputs} != {id(yt), id(sig.outputs[0])} or not single_use(silu.outputs[0]):
        return None
    reshape = _reader(silu.outputs[0])
    if not _top(reshape, "Reshape", graph):
        return None
    view = reshape.outputs[0]
    if view.shape is None or len(view.shape) != 5 or view.is_graph_output():
        return None
    three, H, D = view.shape[2:]
    if three != 3 or not all(isinstance(d, int) and d > 0 for d in (H, D)) or 3 * H * D != C or \
            not (_known(view.shape[0], x.shape[0]) and _known(view.shape[1], x.shape[1])):
        return None
    parts: dict[int, tuple[ir.Value, list[ir.Node]]] = {}
    for sl, index in view.uses():
        ins = list(sl.inputs) + [None] * (5 - len(sl.inputs))
        start, axes = _ints(ins[1]), _ints(ins[3])
        if not _top(sl, "Slice", graph) or index != 0 or start is None or len(start) != 1 or \
                _ints(ins[2]) != [start[0] + 1] or axes not in ([-3], [2]) or \
                (ins[4] is not None and _ints(ins[4]) != [1]):
            return None
        sq = _reader(sl.outputs[0])
        if not _top(sq, "Squeeze", graph) or len(sq.inputs) != 2 or _ints(sq.inputs[1]) not in ([-3], [2]):
            return None
        parts[start[0]] = sq.outputs[0], [sl, sq]
    if sorted(parts) != [0, 1, 2] or len(view.uses()) != 3:
        return None
    norms = [_l2norm(parts[i][0], graph) for i in (0, 1)]
    if None in norms or norms[0][1] != norms[1][1]:
        return None
    nodes = [tr, cat, conv, others[0], back, sig, silu, reshape] + [n for i in (0, 1, 2) for n in parts[i][1]] + \
        norms[0][2] + norms[1][2]
    return _Chain([x, state, w, b], [norms[0][0], norms[1][0], parts[2][0], others[0].outputs[0]], (H, D),
                  norms[0][1], nodes)


def fuse_kda_short_conv(model: ir.Model) -> int:
    """Rewrite every top-level traced KDA short-conv chain (`_chain`) into `k3x.fused::KDAShortConv(x, state, w,
    b, heads, eps)` (Constants for heads [3, H, D] and eps) and attach that function (and the domain's import)
    when any was rewritten; returns how many."""
    graph, channels, done = model.graph, None, 0
    for conv in [n for n in graph if is_op(n, "Conv")]:
        found = _chain(conv, graph)
        if found is None or channels not in (None, found.inputs[2].shape[0]):
            continue
        order = {id(n): i for i, n in enumerate(graph)}
        after = max((order[id(v.producer())] for v in found.inputs if v.producer() is not None), default=-1)
        first_use = min((order[id(u)] for v in found.outputs for u, _ in v.uses()), default=len(order))
        if first_use <= after:
            continue  # no place in the node order for one call (never so in a traced graph)
        heads = ir.node("Constant", [], attributes={"value_ints": [3, *found.heads]}, name=f"{conv.name}/kda_heads")
        eps = ir.node("Constant", [], attributes={"value": ir.tensor(np.array(found.eps, np.float32))},
                      name=f"{conv.name}/kda_eps")
        call = ir.node(KDA_SHORT_CONV, [*found.inputs, heads.outputs[0], eps.outputs[0]], domain=FUSED_DOMAIN,
                       num_outputs=4, name=f"{conv.name}/kda_short_conv")
        if after >= 0:
            graph.insert_after(list(graph)[after], [heads, eps, call])
        else:
            graph.insert_before(list(graph)[0], [heads, eps, call])
        take_outputs(graph, call, list(found.outputs), found.nodes)
        channels, done = found.inputs[2].shape[0], done + 1
    if done:
        attach_function(model, kda_short_conv_function(model.opset_imports[""], channels))
    return done
