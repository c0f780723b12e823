"""Decoder layers as ONNX local functions: one FunctionProto per layer kind, one call node per layer.

An exported graph repeats each layer's nodes (69 KDA + 24 MLA layers on K3). `functionalize` rewrites a
written ModelProto so that each layer kind (`K3Config.layer_kind`: mixer, FFN, AttnRes role) is one function
in domain `k3x.layers`, called once per layer with that layer's weights (initializers, or graph inputs in a
weightless export) as call inputs: weights keep their names and stay in the main graph (external data,
refit and checkpoint references are unchanged), and inlining the calls gives back the flat graph's nodes.

1. A node belongs to layer i by its name (`/model/layers.{i}/...`, exporter/onnx._name_nodes; a serving step's
   `/lm/model/layers.{i}/...`).
2. Shape arithmetic the exporter shares between layers (a size or Constant made in the first layer that needs
   it, read by later ones) is hoisted out of that layer: a node of the layer computed from constants and
   shapes alone whose value is read outside the layer stays in the main graph with its ancestors in the
   layer (all shape arithmetic too), and becomes a call input of every layer that reads it.
3. The layers of one kind must be isomorphic: the same nodes in the same order (domain, op, attributes),
   wired alike, the same inputs and outputs by position; names aside. The function is made from the first.
4. A call input that is the same small constant in every call (a Constant node's value, or a non-weight
   initializer) becomes a Constant inside the function.
5. Call nodes replace the layers; the graph is sorted again (a cycle means a layer is not convex).

Anything that does not fit raises `FunctionsError`; the caller then keeps the flat graph and records why.
"""

from __future__ import annotations

import heapq
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import onnx
from onnx import AttributeProto, FunctionProto, ModelProto, NodeProto, helper

if TYPE_CHECKING:
    import onnx_ir as ir

DOMAIN = "k3x.layers"
_LAYER = re.compile(r"^(.*?/layers\.(\d+))/")
_SIZE_OPS = {"Shape", "Size"}  # read only the shape of their input
_EMBED_BYTES = 4096  # a non-weight initializer at most this large may become a Constant in the body


class FunctionsError(RuntimeError):
    """The graph's layers cannot become local functions; the flat graph is written instead."""


@dataclass
class _Layer:
    index: int
    path: str  # `/model/layers.3`: the call node's name, stripped from body node names
    body: list[int]  # node positions kept in the function
    inputs: list[str]  # values read from outside, in order of first use
    outputs: list[str]  # values used outside, in production order
    signature: tuple


def model_nodes(model: ModelProto) -> list[NodeProto]:
    """The main graph's nodes and every local function's (a layer's k3 nodes live in its function)."""
    return [*model.graph.node, *(n for f in model.functions for n in f.node)]


def inline_layers(model: ModelProto) -> ModelProto:
    """`model` with its layer calls inlined: the flat graph's nodes (k3 op bodies stay functions)."""
    from onnx.inliner import inline_selected_functions

    return inline_selected_functions(model, [(f.domain, f.name) for f in model.functions if f.domain == DOMAIN])


def _attr_key(a: AttributeProto) -> bytes:
    if a.type in (AttributeProto.GRAPH, AttributeProto.GRAPHS):
        raise FunctionsError(f"attribute {a.name!r} holds a subgraph")
    return a.SerializeToString(deterministic=True)


def _size_values(g: onnx.GraphProto, weights: set[str]) -> set[str]:
    """Values computed from constants and shapes alone (no weight, no activation element)."""
    sizes = {t.name for t in g.initializer if t.name not in weights}
    for n in g.node:
        ins = [x for x in n.input if x]
        if n.domain in ("", "ai.onnx") and (n.op_type in _SIZE_OPS or (n.op_type == "Constant" and not ins)
                                            or (ins and all(x in sizes for x in ins))):
            sizes.update(n.output)
    return sizes


def _layer(g: onnx.GraphProto, index: int, path: str, members: list[int], sizes: set[str],
           graph_outputs: set[str], consumers: dict[str, list[int]]) -> _Layer:
    """Layer `index` (its nodes at `members`): the body (what step 2 does not hoist into the main graph), its
    inputs and outputs and its signature."""
    produced = {o: k for k in members for o in g.node[k].output}
    inside_all = set(members)
    hoisted: set[int] = set()
    for k in members:
        n = g.node[k]
        if any(o in graph_outputs or any(c not in inside_all for c in consumers.get(o, ())) for o in n.output):
            hoisted |= _size_ancestors(g, k, produced, sizes) or set()
    body = [k for k in members if k not in hoisted]
    if not body:
        raise FunctionsError(f"layer {index} has only shape arithmetic")
    inside = set(body)
    names: dict[str, tuple] = {}
    inputs: list[str] = []
    nodes = []
    for pos, k in enumerate(body):
        n = g.node[k]
        for x in n.input:
            if x and x not in names:
                names[x] = ("in", len(inputs))
                inputs.append(x)
        nodes.append((n.domain, n.op_type, n.overload, tuple(sorted(_attr_key(a) for a in n.attribute)),
                      tuple(names[x] if x else "" for x in n.input), len(n.output)))
        for j, o in enumerate(n.output):
            names[o] = ("node", pos, j)
    outputs = [o for k in body for o in g.node[k].output
               if o and (o in graph_outputs or any(c not in inside for c in consumers.get(o, ())))]
    signature = (len(inputs), tuple(nodes), tuple(names[o] for o in outputs))
    return _Layer(index, path, body, inputs, outputs, signature)


def _size_ancestors(g: onnx.GraphProto, k: int, produced: dict[str, int], sizes: set[str]) -> set[int] | None:
    """Node k and its ancestors among the layer's nodes (`produced`), if all are shape arithmetic; else None."""
    out, todo = set(), [k]
    while todo:
        j = todo.pop()
        if j in out:
            continue
        if not all(o in sizes for o in g.node[j].output):
            return None
        out.add(j)
        todo.extend(produced[x] for x in g.node[j].input if x in produced)
    return out


def _difference(a: _Layer, b: _Layer, g: onnx.GraphProto) -> str:
    na, nb = a.signature[1], b.signature[1]
    for pos, (x, y) in enumerate(zip(na, nb)):
        if x != y:
            return f"node {pos}: {g.node[a.body[pos]].name} vs {g.node[b.body[pos]].name}"
    if len(na) != len(nb):
        return f"{len(na)} vs {len(nb)} nodes"
    return f"{a.signature[0]} vs {b.signature[0]} inputs, outputs {a.signature[2]} vs {b.signature[2]}"


def _constants(g: onnx.GraphProto, weights: set[str]) -> dict[str, bytes]:
    """value -> a key of its constant value, for the values step 4 may move into a function body."""
    out = {n.output[0]: b"node" + _attr_key(n.attribute[0]) for n in g.node
           if n.op_type == "Constant" and n.domain == "" and len(n.attribute) == 1 and not n.input}
    for t in g.initializer:
        if t.name not in weights and not t.external_data and len(t.raw_data) <= _EMBED_BYTES:
            c = onnx.TensorProto()
            c.CopyFrom(t)
            c.name = ""
            out[t.name] = b"init" + c.SerializeToString(deterministic=True)
    return out


def _function(g: onnx.GraphProto, kind: str, first: _Layer, embed: dict[int, NodeProto], opsets: dict[str, int],
              weights: set[str]) -> FunctionProto:
    """The function of `kind`, made from its first layer: inputs renamed (a weight after its name in the
    layer, `x{p}` otherwise), Constants for the embedded inputs, node names relative to the layer."""
    prefix = f"{first.path}/"
    weight_prefix = re.compile(rf"^(.*\.)?layers\.{first.index}\.")
    rename = {}
    for p, x in enumerate(first.inputs):
        rename[x] = weight_prefix.sub("", x) if x in weights else f"x{p}"
    nodes = []
    for p, c in embed.items():
        c.name, c.output[:] = f"embedded_{p}", [rename[first.inputs[p]]]
        nodes.append(c)
    for k in first.body:
        n = NodeProto()
        n.CopyFrom(g.node[k])
        n.name = n.name.removeprefix(prefix)
        n.input[:] = [rename.get(x, x) for x in n.input]
        nodes.append(n)
    names = [rename[x] for p, x in enumerate(first.inputs) if p not in embed]
    values = names + [o for n in nodes for o in n.output]
    if len(set(values)) != len(values):
        raise FunctionsError(f"layer {first.index}: a renamed input collides with a value name in the body")
    used = {n.domain for n in nodes}
    return helper.make_function(DOMAIN, kind, names, first.outputs, nodes, [helper.make_opsetid(d, opsets[d]) for d in sorted(used)])


def _embedded(layers: list[_Layer], constants: dict[str, bytes], g: onnx.GraphProto) -> dict[int, NodeProto]:
    """Input positions every call passes the same constant at -> a Constant node of that value."""
    out = {}
    for p, x in enumerate(layers[0].inputs):
        key = constants.get(x)
        if key is None or any(constants.get(lay.inputs[p]) != key for lay in layers[1:]):
            continue
        out[p] = _constant_node(x, g)
    return out


def _constant_node(value: str, g: onnx.GraphProto) -> NodeProto:
    for n in g.node:
        if n.op_type == "Constant" and list(n.output) == [value]:
            c = NodeProto()
            c.CopyFrom(n)
            return c
    (t,) = [t for t in g.initializer if t.name == value]
    return helper.make_node("Constant", [], [value], value=t)


def _sort(nodes: list[NodeProto], available: set[str]) -> list[NodeProto]:
    """Topological order, stable (the given order where the dependencies allow); FunctionsError on a cycle."""
    producer = {o: k for k, n in enumerate(nodes) for o in n.output}
    waiting = [0] * len(nodes)
    users: dict[int, list[int]] = defaultdict(list)
    for k, n in enumerate(nodes):
        deps = {producer[x] for x in n.input if x and x not in available and x in producer}
        waiting[k] = len(deps)
        for d in deps:
            users[d].append(k)
    ready = [k for k, w in enumerate(waiting) if w == 0]
    heapq.heapify(ready)
    out = []
    while ready:
        k = heapq.heappop(ready)
        out.append(nodes[k])
        for u in users[k]:
            waiting[u] -= 1
            if waiting[u] == 0:
                heapq.heappush(ready, u)
    if len(out) != len(nodes):
        raise FunctionsError("a layer is not convex: replacing it with one call makes a cycle")
    return out


def functionalize(model: ModelProto, kinds: list[str], weights: set[str]) -> dict[str, int]:
    """Rewrite `model` in place: layer i (`kinds[i]` its kind) becomes a call of its kind's function.
    Returns {kind: calls}. Raises FunctionsError, leaving `model` unchanged, when the layers do not fit."""
    g = model.graph
    members: dict[int, list[int]] = defaultdict(list)
    paths: dict[int, str] = {}
    for k, n in enumerate(g.node):
        m = _LAYER.match(n.name)
        if m:
            i = int(m.group(2))
            members[i].append(k)
            if paths.setdefault(i, m.group(1)) != m.group(1):
                raise FunctionsError(f"layer {i}'s nodes are named under {paths[i]} and {m.group(1)}")
    if sorted(members) != list(range(len(kinds))):
        raise FunctionsError(f"nodes are named for layers {sorted(members)[:8]}..., the config has {len(kinds)}")
    consumers: dict[str, list[int]] = defaultdict(list)
    for k, n in enumerate(g.node):
        for x in n.input:
            consumers[x].append(k)
    sizes, graph_outputs = _size_values(g, weights), {o.name for o in g.output}
    layers = [_layer(g, i, paths[i], members[i], sizes, graph_outputs, consumers) for i in range(len(kinds))]
    by_kind: dict[str, list[_Layer]] = defaultdict(list)
    for lay in layers:
        by_kind[kinds[lay.index]].append(lay)
    for kind, group in by_kind.items():
        for other in group[1:]:
            if other.signature != group[0].signature:
                raise FunctionsError(f"layers {group[0].index} and {other.index} ({kind}) are not isomorphic: "
                                     f"{_difference(group[0], other, g)}")
    constants = _constants(g, weights)
    opsets = {o.domain: o.version for o in model.opset_import}
    functions, calls, embedded = [], {}, set()
    for kind, group in by_kind.items():
        embed = _embedded(group, constants, g)
        functions.append(_function(g, kind, group[0], embed, opsets, weights))
        for lay in group:
            calls[lay.body[-1]] = helper.make_node(kind, [x for p, x in enumerate(lay.inputs) if p not in embed],
                                                   lay.outputs, name=lay.path, domain=DOMAIN)
            embedded.update(lay.inputs[p] for p in embed)
    in_body = {k for lay in layers for k in lay.body}
    nodes = [calls[k] if k in calls else n for k, n in enumerate(g.node) if k not in in_body or k in calls]
    nodes = _sort(nodes, {i.name for i in g.input} | {t.name for t in g.initializer})
    _commit(model, nodes, functions, embedded)
    return {kind: len(group) for kind, group in by_kind.items()}


def _commit(model: ModelProto, nodes: list[NodeProto], functions: list[FunctionProto],
            embedded: set[str]) -> None:
    """Replace the graph's nodes, drop the constants and value infos nothing in the main graph uses any more."""
    g = model.graph
    used = {x for n in nodes for x in n.input} | {o.name for o in g.output}
    nodes = [n for n in nodes if not (n.op_type == "Constant" and n.output[0] in embedded and n.output[0] not in used)]
    produced = {o for n in nodes for o in n.output}
    nodes = [NodeProto.FromString(n.SerializeToString()) for n in nodes]  # detached before the graph's are cleared
    del g.node[:]
    g.node.extend(nodes)
    for k in reversed(range(len(g.initializer))):  # in place: weights are not copied
        if g.initializer[k].name in embedded and g.initializer[k].name not in used:
            del g.initializer[k]
    for k in reversed(range(len(g.value_info))):
        if g.value_info[k].name not in produced:
            del g.value_info[k]
    model.functions.extend(functions)
    model.opset_import.append(helper.make_opsetid(DOMAIN, 1))


def save(model: ir.Model, path: Path, kinds: list[str] | None, weights: set[str]) -> dict:
    """Write `model` to `path`: its layers as functions when `kinds` (one per layer) is given and they fit,
    else the flat graph. Returns the manifest entry {"mode": "functions" | "flat", "fallback": why flat
    although asked, or null, "calls": {kind: calls} with functions, "graph_nodes": the main graph's nodes}."""
    import onnx_ir as ir

    proto = ir.serde.serialize_model(model)
    entry: dict = {"mode": "flat", "fallback": None}
    if kinds is not None:
        try:
            entry = {"mode": "functions", "fallback": None, "calls": functionalize(proto, kinds, weights)}
        except FunctionsError as e:
            entry["fallback"] = str(e)
    entry["graph_nodes"] = len(proto.graph.node)
    onnx.save(proto, path)
    return entry
