"""Rewrites of the converted model's own nodes (not the k3 function bodies), made once in exporter/onnx.py
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
- `fuse_situ_glu`: the nine standard ops torch.onnx writes for a SiTU-GLU (custom_ops/moe/reference.py `glu`:
  the dense FFN and the shared experts) become one call of the local function `k3x.fused::SiTUGLU(a, u, beta,
  linear_beta)` whose body is those same ops (custom_ops/fused.py): every runtime inlines it to the
  same math, and ONNX Runtime runs it on one CPU kernel when the k3x kernel library is built.
- `fuse_latent_attention`: MLA's absorbed attention over the cached latent as torch.onnx writes model/mla.py
  `forward` (MatMul(q, Transpose(present)) -> Reshape -> Mul(scale) -> Where(hidden, -inf) -> Softmax ->
  Reshape -> MatMul(., present), fp32) becomes one call of `k3x.fused::LatentAttention(q, present, hidden,
  scale)` whose body is those ops (custom_ops/fused.py): every runtime inlines it to the same math, and ONNX
  Runtime runs it on one CPU kernel when the library is built (one pass over the cache per eight query rows,
  no [B, H, T, S] scores in memory). Where the cache is the growing one, present = Concat(past, latent) on axis
  1, the Concat joins the call: `k3x.fused::LatentAttentionAppend(q, past, latent, hidden, scale) -> (o,
  present)`, whose kernel writes present as it reads it (the Concat was one thread's copy of the whole cache a
  layer, which the attention then read again).
- `fuse_depthwise_conv` (the ort flavor's pass only, exporter/onnx_flavors.py; the trt pass undoes it with
  `unfuse_depthwise_conv`, so TensorRT keeps its own Conv and a rank's passes find the nodes as converted): a
  Conv with group = its channels, weight [C, 1, W], bias [C], no padding, stride and dilation 1 (KDA's short
  conv) becomes `k3x.fused::DepthwiseConv1d(x, w, b)` (attribute group), whose body is that Conv
  (custom_ops/fused.py); ONNX Runtime runs it on one CPU kernel, bit-identical, when the library is built (its
  own Conv took 0.35 ms a k3-bench decode step a layer, one im2col + GEMM per channel). The batch interface's
  fp32 KDA conv is by then inside a k3x.fused::KDAShortConv call (exporter/onnx_rewrites_kda.py, which runs
  after these at conversion); what this pass still finds is a conv that rewrite left (e.g. a bf16 graph's).

The matching helpers (`is_op`, `attr_of`, `scalar_of`, `single_use`, `is_depthwise_conv`, `attach_function`) and
`take_outputs` (a call's outputs in place of the values it replaces) are public for exporter/onnx_rewrites_kda.py.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from ..custom_ops.fused import (DEPTHWISE_CONV, FUNCTIONS, FUSED_DOMAIN, LATENT_ATTENTION, LATENT_ATTENTION_APPEND,
                                SITU_GLU, depthwise_conv_function, situ_glu_function)


def is_op(node: ir.Node | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain == ""


def rsqrt_as_div(model: ir.Model) -> int:
    """Rewrite every top-level `Mul(x, Reciprocal(Sqrt(a)))` (either operand order) into `Div(x, Sqrt(a))`;
    returns how many Muls were rewritten. A Reciprocal left without users is removed."""
    graph, done = model.graph, 0
    for rec in [n for n in graph if is_op(n, "Reciprocal") and is_op(n.inputs[0].producer(), "Sqrt")]:
        r, root = rec.outputs[0], rec.inputs[0]
        for mul, index in list(r.uses()):
            if not is_op(mul, "Mul") or mul.graph is not graph or mul.outputs[0].is_graph_output():
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


def attr_of(node: ir.Node, name: str, default):
    a = node.attributes.get(name)
    return default if a is None else a.value


def _plain_gemm(node: ir.Node | None, graph: ir.Graph) -> bool:
    """x @ Wᵀ with W a weight (no producer: an initializer or, in a weightless export, a graph input), no bias,
    unscaled, its one use the caller's."""
    if not is_op(node, "Gemm") or node.graph is not graph or len([i for i in node.inputs if i is not None]) != 2:
        return False
    if (attr_of(node, "transA", 0), attr_of(node, "transB", 0), attr_of(node, "alpha", 1.0)) != (0, 1, 1.0):
        return False
    out = node.outputs[0]
    return node.inputs[1].producer() is None and len(out.uses()) == 1 and not out.is_graph_output()


def merge_sibling_gemms(model: ir.Model) -> int:
    """Rewrite every top-level `Concat(Gemm(x, W1, transB=1), ..., axis=-1)` of two or more plain Gemms of one
    x into `Gemm(x, Concat(W1, ..., axis=0), transB=1)`; returns how many Concats were rewritten."""
    graph, done = model.graph, 0
    for cat in [n for n in graph if is_op(n, "Concat") and len(n.inputs) >= 2]:
        gemms = [v.producer() for v in cat.inputs]
        rank = len(cat.outputs[0].shape) if cat.outputs[0].shape is not None else None
        if rank is None or attr_of(cat, "axis", 0) not in (-1, rank - 1) or cat.outputs[0].is_graph_output():
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


def scalar_of(v: ir.Value | None) -> float | None:
    """The value of a one-element constant (an initializer or a Constant node's output), else None."""
    if v is None:
        return None
    t = v.const_value
    if t is None and is_op(v.producer(), "Constant") and "value" in v.producer().attributes:
        t = v.producer().attributes["value"].value
    if t is None or t.size != 1:  # never reads a weight (a streamed or meta one has no data here)
        return None
    return float(t.numpy().reshape(-1)[0])


def single_use(v: ir.Value) -> bool:
    return len(v.uses()) == 1 and not v.is_graph_output()


def _scaled_tanh(v: ir.Value, graph: ir.Graph) -> tuple[ir.Value, float, list[ir.Node]] | None:
    """v = Mul(Tanh(Div(x, β)), β) (either Mul operand order), every step used once -> (x, β, its nodes)."""
    mul = v.producer()
    if not is_op(mul, "Mul") or mul.graph is not graph:
        return None
    for i in (0, 1):
        tanh, beta = mul.inputs[i].producer(), scalar_of(mul.inputs[1 - i])
        if beta is None or not is_op(tanh, "Tanh") or not single_use(tanh.outputs[0]):
            continue
        div = tanh.inputs[0].producer()
        if is_op(div, "Div") and single_use(div.outputs[0]) and scalar_of(div.inputs[1]) == beta:
            return div.inputs[0], beta, [mul, tanh, div]
    return None


def _situ_glu(out: ir.Node, graph: ir.Graph) -> tuple[ir.Value, ir.Value, float, float, list[ir.Node]] | None:
    """`out` = Mul(Mul(scaled_tanh(a, β1), Sigmoid(a)), scaled_tanh(u, β2)) (any operand orders, every
    intermediate used once) -> (a, u, β1, β2, the chain's nodes)."""
    if not is_op(out, "Mul") or out.graph is not graph:
        return None
    for i in (0, 1):
        left, right = out.inputs[i], out.inputs[1 - i]
        gated = left.producer()
        r = _scaled_tanh(right, graph) if single_use(right) else None
        if r is None or not is_op(gated, "Mul") or not single_use(left) or gated.graph is not graph:
            continue
        for j in (0, 1):
            sig, lt = gated.inputs[j].producer(), gated.inputs[1 - j]
            l_ = _scaled_tanh(lt, graph) if single_use(lt) else None
            if l_ is None or not is_op(sig, "Sigmoid") or not single_use(sig.outputs[0]) or sig.inputs[0] is not l_[0]:
                continue
            return l_[0], r[0], l_[1], r[1], [out, gated, sig, *l_[2], *r[2]]
    return None


def fuse_situ_glu(model: ir.Model) -> int:
    """Rewrite every top-level traced SiTU-GLU chain into `k3x.fused::SiTUGLU(a, u, β1, β2)` (scalar Constants)
    and attach that function (and the domain's import) when any was rewritten; returns how many."""
    graph, done = model.graph, 0
    for out in [n for n in graph if is_op(n, "Mul")]:
        if out.graph is not graph or out.outputs[0].is_graph_output():
            continue  # removed by an earlier rewrite, or a graph output (its name must stay)
        found = _situ_glu(out, graph)
        if found is None:
            continue
        a, u, b1, b2, chain = found
        betas = [ir.node("Constant", [], attributes={"value": ir.tensor(np.array(b, np.float32))},
                         name=f"{out.name}/situ_glu_{what}") for b, what in ((b1, "beta"), (b2, "linear_beta"))]
        fused = ir.node(SITU_GLU, [a, u, *(c.outputs[0] for c in betas)], domain=FUSED_DOMAIN,
                        name=f"{out.name}/situ_glu")
        fused.outputs[0].dtype, fused.outputs[0].shape = out.outputs[0].dtype, out.outputs[0].shape
        graph.insert_before(out, [*betas, fused])
        ir.convenience.replace_all_uses_with(out.outputs[0], fused.outputs[0])
        graph.remove(chain, safe=True)
        done += 1
    if done:
        attach_function(model, situ_glu_function(model.opset_imports[""]))
    return done


def _only_input(node: ir.Node | None, op_type: str, graph: ir.Graph) -> ir.Value | None:
    """The data input of `node` (its first) when it is a top-level `op_type` whose output is used once."""
    if not is_op(node, op_type) or node.graph is not graph or not single_use(node.outputs[0]):
        return None
    return node.inputs[0]


def _latent_attention(out: ir.Node, graph: ir.Graph) -> tuple[list[ir.Value], list[ir.Node]] | None:
    """`out` = MatMul(Reshape(Softmax(Where(hidden, -inf, Mul(Reshape(MatMul(q, Transpose(present, [0, 2, 1]))),
    scale)), axis=-1)), present), fp32, hidden [T, S] bool, every intermediate used once (the Transpose may have
    other uses) -> ([q, present, hidden, scale], the chain's nodes)."""
    if not is_op(out, "MatMul") or out.graph is not graph:
        return None
    probs, present = out.inputs
    softmax = _only_input(probs.producer(), "Reshape", graph)
    softmax = softmax.producer() if softmax is not None else None
    if not is_op(softmax, "Softmax") or not single_use(softmax.outputs[0]) or \
            attr_of(softmax, "axis", -1) not in (-1, 3):
        return None
    where = softmax.inputs[0].producer()
    if not is_op(where, "Where") or not single_use(where.outputs[0]) or scalar_of(where.inputs[1]) != float("-inf"):
        return None
    hidden, mul = where.inputs[0], where.inputs[2].producer()
    if hidden.dtype != ir.DataType.BOOL or hidden.shape is None or len(hidden.shape) != 2 or \
            not is_op(mul, "Mul") or not single_use(mul.outputs[0]):
        return None
    for i in (0, 1):
        scale, reshape = mul.inputs[1 - i], mul.inputs[i].producer()
        scores = _only_input(reshape, "Reshape", graph) if scalar_of(scale) is not None else None
        mm = scores.producer() if scores is not None else None
        if not is_op(mm, "MatMul") or not single_use(mm.outputs[0]):
            continue
        q, keys = mm.inputs
        tr = keys.producer()
        if not is_op(tr, "Transpose") or tr.inputs[0] is not present or list(attr_of(tr, "perm", [])) != [0, 2, 1]:
            continue
        if {q.dtype, present.dtype, out.outputs[0].dtype} != {ir.DataType.FLOAT} or q.shape is None or \
                len(q.shape) != 3:
            continue
        chain = [out, probs.producer(), softmax, where, mul, reshape, mm] + [tr] * (len(keys.uses()) == 1)
        return [q, present, hidden, scale], chain
    return None


def _appended(present: ir.Value, out: ir.Node, chain: list[ir.Node], graph: ir.Graph) -> ir.Node | None:
    """The top-level Concat(past, latent) on axis 1 (fp32, rank 3) that makes `present`, when every use of it
    outside the attention's `chain` comes after `out` (so one call in out's place can write it)."""
    cat = present.producer()
    if not is_op(cat, "Concat") or cat.graph is not graph or len(cat.inputs) != 2 or \
            attr_of(cat, "axis", 0) not in (1, -2) or \
            any(v.dtype != ir.DataType.FLOAT or v.shape is None or len(v.shape) != 3 for v in cat.inputs):
        return None
    order = {id(n): i for i, n in enumerate(graph)}
    if any(order[id(user)] < order[id(out)] for user, _ in present.uses() if user not in chain):
        return None
    return cat


def fuse_latent_attention(model: ir.Model) -> int:
    """Rewrite every top-level traced attention over the MLA latent (`_latent_attention`) into
    `k3x.fused::LatentAttention(q, present, hidden, scale)`, or where the cache is Concat(past, latent)
    (`_appended`: the growing cache) into `k3x.fused::LatentAttentionAppend(q, past, latent, hidden, scale) ->
    (o, present)` in place of the Concat too, and attach the functions used (and the domain's import); returns
    how many."""
    graph, done, used = model.graph, 0, set()
    for out in [n for n in graph if is_op(n, "MatMul")]:
        found = _latent_attention(out, graph) if out.graph is graph else None
        if found is None:
            continue
        (q, present, hidden, scale), chain = found
        cat = _appended(present, out, chain, graph)
        if cat is None:  # attention over the cache in place
            op_type, cache, olds, removed = LATENT_ATTENTION, [present], [out.outputs[0]], chain
        else:  # the growing cache: the call writes present too, in the Concat's place
            op_type, cache, olds, removed = LATENT_ATTENTION_APPEND, list(cat.inputs), [out.outputs[0], present], \
                [*chain, cat]
        call = ir.node(op_type, [q, *cache, hidden, scale], domain=FUSED_DOMAIN, num_outputs=len(olds),
                       name=f"{out.name}/latent_attention" + ("_append" if cat is not None else ""))
        graph.insert_before(out, call)
        take_outputs(graph, call, olds, removed)
        used.add(op_type)
        done += 1
    for op_type in sorted(used):
        attach_function(model, FUNCTIONS[op_type](model.opset_imports[""], None))
    return done


def attach_function(model: ir.Model, function) -> None:
    """A k3x.fused function (FunctionProto) and its domain's import, attached to `model`."""
    fn = ir.serde.deserialize_function(function)
    model.functions[fn.identifier()] = fn
    model.opset_imports[FUSED_DOMAIN] = 1


def is_depthwise_conv(node: ir.Node) -> bool:
    """A Conv of x [B, C, L] with w [C, 1, W] and a bias b [C] (KDA's has one, zeros, once converted), group C,
    no padding, stride or dilation."""
    if not is_op(node, "Conv") or len(node.inputs) != 3 or any(v is None or v.shape is None for v in node.inputs[1:]):
        return False
    w = node.inputs[1].shape
    if len(w) != 3 or not all(isinstance(d, int) for d in w) or w[1] != 1 or attr_of(node, "group", 1) != w[0] \
            or list(node.inputs[2].shape) != [w[0]]:
        return False
    plain = {"pads": [0, 0], "strides": [1], "dilations": [1], "kernel_shape": [w[2]]}
    return attr_of(node, "auto_pad", "NOTSET") in ("NOTSET", b"NOTSET") and \
        all(list(attr_of(node, k, v)) == v for k, v in plain.items())


CONV_ATTRIBUTES = "k3x.conv"  # a fused call's Conv attributes and metadata, kept in memory (ir.Node.meta)


def fuse_depthwise_conv(model: ir.Model) -> int:
    """Rewrite every top-level depthwise 1-D Conv (`is_depthwise_conv`) into `k3x.fused::DepthwiseConv1d` and attach
    that function (and the domain's import) when any was rewritten; returns how many."""
    graph, done = model.graph, 0
    for conv in [n for n in graph if is_depthwise_conv(n)]:
        if conv.outputs[0].is_graph_output():
            continue  # a graph output's name must stay
        fused = ir.node(DEPTHWISE_CONV, list(conv.inputs), attributes={"group": int(attr_of(conv, "group", 1))},
                        domain=FUSED_DOMAIN, name=f"{conv.name}/depthwise")
        # in memory only, for unfuse to give back the node as found: its attributes and metadata
        fused.meta[CONV_ATTRIBUTES] = (list(conv.attributes.values()), dict(conv.metadata_props))
        _swap(graph, conv, fused)
        done += 1
    if done:
        attach_function(model, depthwise_conv_function(model.opset_imports[""]))
    return done


def unfuse_depthwise_conv(model: ir.Model) -> int:
    """`fuse_depthwise_conv` undone: each top-level DepthwiseConv1d call back to the Conv it was (its attributes and
    output name as found, when fused in this process), the function detached; returns how many."""
    graph, done = model.graph, 0
    for call in [n for n in graph if n.domain == FUSED_DOMAIN and n.op_type == DEPTHWISE_CONV]:
        kept, metadata = call.meta.get(CONV_ATTRIBUTES) or ([ir.AttrInt64("group", call.attributes["group"].value)], {})
        conv = ir.Node("", "Conv", list(call.inputs), attributes=kept, name=call.name.removesuffix("/depthwise"),
                       metadata_props=metadata)
        _swap(graph, call, conv)
        done += 1
    model.functions.pop((FUSED_DOMAIN, DEPTHWISE_CONV, ""), None)
    return done


def take_outputs(graph: ir.Graph, call: ir.Node, olds: list[ir.Value], removed: list[ir.Node]) -> None:
    """`call`'s outputs (already in `graph`) in place of the values `olds`, in order: their dtypes, shapes and
    names (the graph's own, not fresh ones: the same in every rank's file), every use and graph output moved to
    them; then the `removed` nodes (those that made `olds`) removed."""
    names = [v.name for v in olds]
    for new, old in zip(call.outputs, olds, strict=True):
        new.dtype, new.shape = old.dtype, old.shape
    ir.convenience.replace_all_uses_with(olds, list(call.outputs), replace_graph_outputs=True)
    graph.remove(removed, safe=True)
    for new, name in zip(call.outputs, names):
        new.name = name


def _swap(graph: ir.Graph, old: ir.Node, new: ir.Node) -> None:
    """`new` (one output) in place of `old` (`take_outputs`)."""
    graph.insert_before(old, new)
    take_outputs(graph, new, [old.outputs[0]], [old])
