"""The CPU trunk's projections of one activation as one `k3x.fused::LinearQ8Group<P>` / `LinearBF16Group<P>` call
(custom_ops/fused.py), a rewrite of the ort flavor pass (exporter/onnx_flavors.py).

An int8 or bf16 trunk export (model/trunk.py) holds a k3::LinearQ8 / k3::LinearBF16 node per projection. Several
read the same activation: a KDA layer's q, k, v, forget-gate, beta and output-gate projections (six), an MLA
layer's q_a, kv_a and gate (three), an MoE layer's latent down-projection and the shared experts' gate and up
(three). On a decode step each node is a small GEMV with a fixed cost of its own (x quantised again, a dispatch
to the threads and their wait); the group is one node, x quantised once, every projection's tasks in one
dispatch. On k3-bench's decode step, 98 of the 146 projections become 24 calls (docs/model.md §6.1: the time
it saves).

- `group_projections`: the top-level k3 nodes of one op type that read the same x, two or more, none writing a
  graph output, their weights (and scales) graph initializers or inputs (no producer: the call sits where the
  first of them was, so every input must exist there), become one call (sets of more than eight, calls of up to
  eight in graph order); their weights' shapes must agree beyond N (for LinearQ8, one quantisation of x). Each
  arity is an op type of its own, its body attached here (custom_ops/fused.py). The weights keep their names and
  bytes: nothing is concatenated, so streamed and weightless exports are unchanged.
- `ungroup_projections`: the calls back to the nodes they were (names, attributes and output names as found),
  the group functions detached. The ort pass runs it first and the trt pass too, so each pass starts from the
  nodes as converted, however many passes a model has been through (a rank program's: two a rank).
"""

from __future__ import annotations

import onnx_ir as ir

from ..custom_ops.fused import (FUSED_DOMAIN, LINEAR_GROUP_ARITIES, LINEAR_GROUPS, LINEAR_REFERENCED,
                                linear_group_function, linear_group_op)
from ..plan.onnx_node import DOMAIN

GROUPED = "k3x.grouped"  # a call's projections as they were: [(name, op type, attributes, output name)] (ir.Node.meta)


def _attributes(node: ir.Node) -> dict:
    return {name: a.value for name, a in sorted(node.attributes.items())}


def _literals(node: ir.Node) -> tuple:
    """A projection's attributes that a group body holds as they are (all but LINEAR_REFERENCED)."""
    return tuple((k, v) for k, v in _attributes(node).items() if k not in LINEAR_REFERENCED)


def _layout(node: ir.Node) -> tuple | None:
    """A projection's weight shape beyond N (LinearQ8's [KB, BLOCK]: one quantisation of x serves a group only
    where they agree); None where the shape is not known."""
    shape = node.inputs[1].shape
    return None if shape is None or not all(isinstance(d, int) for d in shape) else tuple(shape[1:])


def _groupable(node: ir.Node, graph: ir.Graph) -> bool:
    return node.domain == DOMAIN and node.op_type in LINEAR_GROUPS and node.graph is graph and \
        not node.outputs[0].is_graph_output() and node.inputs[0] is not None and \
        all(v is not None and v.producer() is None for v in node.inputs[1:])


def _name(nodes: list[ir.Node], op_type: str, taken: set[str]) -> str:
    """The scope the projections share (`/model/layers.3/self_attn`: the layer's, for exporter/onnx_functions.py)
    and the group's op type, numbered where that name is taken."""
    parts = [n.name.split("/") for n in nodes]
    common = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    base = "/".join(common + [op_type])
    name, k = base, 1
    while name in taken:
        name, k = f"{base}_{k}", k + 1
    return name


def _call_attributes(nodes: list[ir.Node]) -> list[ir.Attr]:
    """K, block_size and each projection's N as N_i, where the projections have them (LinearQ8)."""
    first = nodes[0].attributes
    out = [ir.AttrInt64(k, first[k].value) for k in ("K", "block_size") if k in first]
    return out + [ir.AttrInt64(f"N_{i}", n.attributes["N"].value) for i, n in enumerate(nodes) if "N" in n.attributes]


def group_projections(model: ir.Model) -> int:
    """Each set of two or more groupable projections of one x as calls (module docstring); returns how many
    calls were made."""
    graph, done = model.graph, 0
    taken = {n.name for n in graph}
    imports = {"": model.opset_imports[""], DOMAIN: model.opset_imports.get(DOMAIN, 1)}
    sets: dict[tuple, list[ir.Node]] = {}
    for node in graph:  # graph order: a set's first node is where its call goes
        if _groupable(node, graph):
            layout = _layout(node)
            if layout is not None:
                sets.setdefault((node.op_type, id(node.inputs[0]), layout, _literals(node)), []).append(node)
    top = max(LINEAR_GROUP_ARITIES)
    for (op_type, _, _, literals), members in sets.items():
        for start in range(0, len(members), top):
            nodes = members[start: start + top]
            if len(nodes) < min(LINEAR_GROUP_ARITIES):
                continue
            group_op = linear_group_op(op_type, len(nodes))
            key = (FUSED_DOMAIN, group_op, "")
            if key in model.functions:
                body = next(iter(model.functions[key]))
                if tuple((k, a.value) for k, a in sorted(body.attributes.items()) if a.ref_attr_name is None) \
                        != literals:
                    continue  # another call's body holds other literal attributes: this set stays as it is
            else:
                fn = linear_group_function(op_type, len(nodes), dict(literals), imports)
                model.functions[key] = ir.serde.deserialize_function(fn)
                model.opset_imports[FUSED_DOMAIN] = 1
            inputs = [nodes[0].inputs[0]] + [v for n in nodes for v in n.inputs[1:]]
            name = _name(nodes, group_op, taken)
            taken.add(name)
            call = ir.Node(FUSED_DOMAIN, group_op, inputs, attributes=_call_attributes(nodes),
                           num_outputs=len(nodes), name=name)
            call.meta[GROUPED] = [(n.name, n.op_type, _attributes(n), n.outputs[0].name) for n in nodes]
            graph.insert_before(nodes[0], call)
            for new, node in zip(call.outputs, nodes):
                new.dtype, new.shape = node.outputs[0].dtype, node.outputs[0].shape
                ir.convenience.replace_all_uses_with(node.outputs[0], new)
            names = [n.outputs[0].name for n in nodes]
            graph.remove(nodes, safe=True)
            for new, old in zip(call.outputs, names):
                new.name = old
            done += 1
    return done


def _group_ops() -> set[str]:
    return {linear_group_op(op, p) for op in LINEAR_GROUPS for p in LINEAR_GROUP_ARITIES}


def _records(model: ir.Model, call: ir.Node) -> list[tuple]:
    """A call read back from a file: its body's calls, each reference resolved from the call's attributes."""
    out = []
    for i, n in enumerate(model.functions[(call.domain, call.op_type, "")]):
        attrs = {k: call.attributes[a.ref_attr_name].value if a.ref_attr_name else a.value
                 for k, a in sorted(n.attributes.items())}
        out.append((f"{call.name}/{i}", n.op_type, attrs, call.outputs[i].name))
    return out


def ungroup_projections(model: ir.Model) -> int:
    """`group_projections` undone (module docstring); returns how many calls were undone. A call made in another
    process (read back from a file) has no record of its nodes' names and is rebuilt from its body."""
    graph, done, ops = model.graph, 0, _group_ops()
    for call in [n for n in graph if n.domain == FUSED_DOMAIN and n.op_type in ops]:
        records = call.meta.get(GROUPED) or _records(model, call)
        per = (len(call.inputs) - 1) // len(records)
        nodes = []
        for i, (name, op_type, attributes, _) in enumerate(records):
            weights = call.inputs[1 + per * i: 1 + per * (i + 1)]
            nodes.append(ir.node(op_type, [call.inputs[0], *weights], attributes=attributes, domain=DOMAIN, name=name))
        graph.insert_before(call, nodes)
        for node, out in zip(nodes, call.outputs):
            node.outputs[0].dtype, node.outputs[0].shape = out.dtype, out.shape
            ir.convenience.replace_all_uses_with(out, node.outputs[0])
        graph.remove(call, safe=True)
        for node, (_, _, _, out_name) in zip(nodes, records):
            node.outputs[0].name = out_name
        done += 1
    for key in [k for k in model.functions if k[0] == FUSED_DOMAIN and k[1] in ops]:
        del model.functions[key]
    return done
