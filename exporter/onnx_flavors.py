"""Flavor passes over an exported model with bare `k3::*` nodes (each pass edits the onnx_ir model in place).

- `trt`: checks every k3 node carries all its plugin fields and `plugin_namespace`, and that no k3
  function bodies are attached (TensorRT must resolve the nodes as plugins).
- `ort`: attaches one FunctionProto per k3 op type, so ONNX Runtime inlines them and needs no extra
  library:
    KDA     -> com.microsoft::LinearAttention (update_rule="gated_delta", per-key decay). Checked to
               match k3::kda's reference to ~5e-10 on CPU; its conventions: q/k/v/decay packed
               [B, T, H*D], decay in log space, beta [B, T, H], `scale` applied to q, past/present
               state [B, H, K, V]. It has no bf16 kernel, so the body computes in fp32 and casts o back.
    AttnRes -> standard ops, fp32 (RMS keys, softmax over sources, mix of the raw sources).
    MoE     -> standard ops, exact, O(N·top_k) expert work: sigmoid router, TopK on biased scores,
               GatherElements of unbiased scores, renormalise; the routed (token, slot) pairs sorted by
               expert, then a Loop over the hit experts only (each: its weights on its tokens, the
               weighted result ScatterND-added), in fp32. ORT's com.microsoft::MoE routes with softmax,
               not K3's sigmoid + biased top-k + unbiased renormalised weights, so it is not used.
  Numeric hyper-parameters are read from the node attributes (attribute references); the MoE
  activation is a string, so it is baked into the body and the pass insists all MoE nodes share it.
"""

from __future__ import annotations

from typing import Callable

import onnx
import onnx_ir as ir
from onnx import TensorProto, helper

from . import onnx_schemas as schemas

MS_DOMAIN = "com.microsoft"
FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL


def k3_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == schemas.DOMAIN]


class _Body:
    """Tiny FunctionProto builder: `b.op("Mul", a, c)` returns a fresh value name."""

    def __init__(self, name: str) -> None:
        self.name, self.nodes, self._n = name, [], 0

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs) -> str | list[str]:
        outs = [f"{self.name}_{op_type}_{self._n}_{i}" for i in range(outputs)]
        self._n += 1
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, domain=domain, **attrs))
        return outs[0] if outputs == 1 else outs

    def ref(self, attr: str, kind: int, as_name: str) -> str:
        """A Constant holding the calling node's attribute `attr` (an ONNX attribute reference)."""
        out = f"{self.name}_ref_{attr}"
        if any(out in n.output for n in self.nodes):
            return out
        a = onnx.AttributeProto(name=as_name, ref_attr_name=attr, type=kind)
        self.nodes.append(helper.make_node("Constant", [], [out]))
        self.nodes[-1].attribute.append(a)
        return out

    def ints(self, *values: int) -> str:
        return self.op("Constant", value_ints=list(values))

    def function(self, op_type: str, inputs: list[str], outputs: list[str], opsets: dict[str, int]
                 ) -> onnx.FunctionProto:
        spec = schemas.NODE_SPECS[op_type]
        return helper.make_function(schemas.DOMAIN, op_type, inputs, outputs, self.nodes,
                                    [helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                                    attributes=[f for f, _ in spec.fields], doc_string=spec.doc)


def kda_function(opset: int) -> onnx.FunctionProto:
    b = _Body("kda")
    packed = b.ints(0, 0, -1)  # [B, T, H, D] -> [B, T, H*D]
    q, k, v, g = (b.op("Reshape", b.op("Cast", x, to=FLOAT), packed) for x in ("q", "k", "v", "g"))
    beta, s0 = b.op("Cast", "beta", to=FLOAT), b.op("Cast", "initial_state", to=FLOAT)
    o, state = b.op("LinearAttention", q, k, v, s0, g, beta, outputs=2, domain=MS_DOMAIN, update_rule="gated_delta")
    la = b.nodes[-1]
    for attr, ref in (("q_num_heads", "num_heads"), ("kv_num_heads", "num_heads")):
        la.attribute.append(onnx.AttributeProto(name=attr, ref_attr_name=ref, type=onnx.AttributeProto.INT))
    la.attribute.append(onnx.AttributeProto(name="scale", ref_attr_name="scale", type=onnx.AttributeProto.FLOAT))
    o = b.op("Reshape", o, b.op("Shape", "v"))  # [B, T, H*V] -> [B, T, H, V]
    b.nodes.append(helper.make_node("CastLike", [o, "v"], ["o"]))
    b.nodes.append(helper.make_node("Identity", [state], ["final_state"]))
    return b.function("KDA", ["q", "k", "v", "g", "beta", "initial_state"], ["o", "final_state"],
                      {"": opset, MS_DOMAIN: 1})


def attn_res_function(opset: int) -> onnx.FunctionProto:
    b = _Body("attn_res")
    src, last = b.ints(-2), b.ints(-1)
    V = b.op("Cast", b.op("Concat", "bank", b.op("Unsqueeze", "prefix", src), axis=-2), to=FLOAT)  # [..., N+1, d]
    ms = b.op("ReduceMean", b.op("Mul", V, V), last, keepdims=1)
    eps = b.ref("eps", onnx.AttributeProto.FLOAT, "value_float")
    K = b.op("Mul", V, b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, eps))))
    query = b.op("Mul", b.op("Cast", "norm_weight", to=FLOAT), b.op("Cast", "proj_weight", to=FLOAT))  # [d]
    p = b.op("Softmax", b.op("MatMul", K, query), axis=-1)  # [..., N+1]
    mixed = b.op("ReduceSum", b.op("Mul", b.op("Unsqueeze", p, last), V), src, keepdims=0)  # [..., d]
    b.nodes.append(helper.make_node("CastLike", [mixed, "prefix"], ["out"]))
    return b.function("AttnRes", ["prefix", "bank", "norm_weight", "proj_weight"], ["out"], {"": opset})


def _activation_constants(b: _Body, activation: str) -> list[str]:
    if activation == "silu":
        return []
    if activation != "situ":
        raise ValueError(f"k3::MoE activation={activation!r}: expected 'situ' or 'silu'")
    return [b.ref("situ_beta", onnx.AttributeProto.FLOAT, "value_float"),
            b.ref("situ_linear_beta", onnx.AttributeProto.FLOAT, "value_float")]


def _glu(b: _Body, a: str, u: str, betas: list[str]) -> str:
    """SiLU-GLU a σ(a) ⊙ u when `betas` is empty, else SiTU-GLU [β1 tanh(a/β1) σ(a)] ⊙ [β2 tanh(u/β2)]."""
    if not betas:
        return b.op("Mul", b.op("Mul", a, b.op("Sigmoid", a)), u)
    b1, b2 = betas
    left = b.op("Mul", b.op("Mul", b1, b.op("Tanh", b.op("Div", a, b1))), b.op("Sigmoid", a))
    return b.op("Mul", left, b.op("Mul", b2, b.op("Tanh", b.op("Div", u, b2))))


def _expert_loop_body(z: str, experts: str, starts: str, ends: str, rows: str, weights: str, betas: list[str]
                      ) -> onnx.GraphProto:
    """Iteration i: expert experts[i] on its segment [starts[i], ends[i]) of the expert-sorted pairs."""
    b = _Body("moe_expert")
    i, cond, acc = "moe_expert_i", "moe_expert_cond", "moe_expert_acc"
    axis0 = b.ints(0)
    e = b.op("Gather", experts, i, axis=0)  # scalar expert id
    lo, hi = (b.op("Unsqueeze", b.op("Gather", t, i, axis=0), axis0) for t in (starts, ends))
    tok, we = b.op("Slice", rows, lo, hi, axis0), b.op("Slice", weights, lo, hi, axis0)  # [n_e]
    ze = b.op("Gather", z, tok, axis=0)  # [n_e, L]
    W = {n: b.op("Cast", b.op("Gather", n, e, axis=0), to=FLOAT) for n in ("w1", "w3", "w2")}  # [I, L], [L, I]
    g = _glu(b, b.op("Gemm", ze, W["w1"], transB=1), b.op("Gemm", ze, W["w3"], transB=1), betas)  # [n_e, I]
    y = b.op("Mul", b.op("Gemm", g, W["w2"], transB=1), b.op("Unsqueeze", we, b.ints(1)))  # [n_e, L]
    b.nodes.append(helper.make_node("ScatterND", [acc, b.op("Unsqueeze", tok, b.ints(1)), y],
                                    ["moe_expert_acc_out"], reduction="add"))  # a token occurs once per expert
    b.nodes.append(helper.make_node("Identity", [cond], ["moe_expert_cond_out"]))
    return helper.make_graph(
        b.nodes, "moe_expert",
        [helper.make_tensor_value_info(i, INT64, []), helper.make_tensor_value_info(cond, BOOL, []),
         helper.make_tensor_value_info(acc, FLOAT, None)],
        [helper.make_tensor_value_info("moe_expert_cond_out", BOOL, []),
         helper.make_tensor_value_info("moe_expert_acc_out", FLOAT, None)])


def moe_function(opset: int, activation: str) -> onnx.FunctionProto:
    """k3::MoE, exact (custom_ops/moe/reference.py), O(M·I·L) FLOPs for the M = N·top_k routed pairs.

    1. Route in fp32: s = sigmoid(x gate_weightᵀ), ids = TopK(s + gate_bias) [N, k], w = s[ids] renormalised
       and scaled [N, k] (the bias selects, never weighs).
    2. Sort the M (token, slot) pairs by expert (TopK ascending), so each expert's pairs form one segment of
       (row = pair // k, weight); Unique gives the hit experts, ascending, and their counts.
    3. Loop over the hit experts only (<= min(E, M) iterations): Gather the expert's weights (cast to fp32
       after the Gather: bf16 weights are never all cast) and its rows of z, Gemm / GLU / Gemm, scale by
       the pair weights, ScatterND-add into the fp32 accumulator u [N, L] (a token occurs once per expert;
       experts are added in ascending id, the reference's order). u is returned in z's dtype.
    Each hit expert's weights are read (and copied by its Gather) once per call; transient memory is one
    expert's fp32 weights plus its activations. The SiTU betas are attribute references evaluated in the
    function scope and read by the loop body as outer-scope values (no attribute references in subgraphs).
    """
    b = _Body("moe")
    x, z, gw, gb = (b.op("Cast", n, to=FLOAT) for n in ("x", "z", "gate_weight", "gate_bias"))
    betas = _activation_constants(b, activation)
    # 1. route
    s = b.op("Sigmoid", b.op("MatMul", x, b.op("Transpose", gw, perm=[1, 0])))  # [N, E]
    k = b.op("Unsqueeze", b.ref("top_k", onnx.AttributeProto.INT, "value_int"), b.ints(0))  # [1]
    _, ids = b.op("TopK", b.op("Add", s, gb), k, outputs=2, axis=-1, largest=1, sorted=1)  # [N, k]
    w = b.op("GatherElements", s, ids, axis=-1)  # unbiased scores of the chosen experts [N, k]
    # renormalize in {0, 1}: w / (r * (Σw + 1e-20) + (1 - r)) is exactly the reference for either value
    r = b.op("Cast", b.ref("renormalize", onnx.AttributeProto.INT, "value_int"), to=FLOAT)
    one, tiny = b.op("Constant", value_float=1.0), b.op("Constant", value_float=1e-20)
    total = b.op("Add", b.op("ReduceSum", w, b.ints(-1), keepdims=1), tiny)
    w = b.op("Div", w, b.op("Add", b.op("Mul", r, total), b.op("Sub", one, r)))
    w = b.op("Mul", w, b.ref("routed_scaling_factor", onnx.AttributeProto.FLOAT, "value_float"))
    # 2. segment the M = N * k pairs by expert; pair p is (token p // k, slot p % k)
    flat = b.ints(-1)
    pair_ids, pair_w = b.op("Reshape", ids, flat), b.op("Reshape", w, flat)  # [M]
    sorted_ids, order = b.op("TopK", pair_ids, b.op("Shape", pair_ids), outputs=2, axis=0, largest=0, sorted=1)
    rows, weights = b.op("Div", order, k), b.op("Gather", pair_w, order, axis=0)  # [M], expert-sorted
    experts, _, _, counts = b.op("Unique", sorted_ids, outputs=4, sorted=1)  # hit experts, ascending
    ends = b.op("CumSum", counts, b.ints(0))
    starts = b.op("Sub", ends, counts)
    # 3. loop over the hit experts
    acc = b.op("ConstantOfShape", b.op("Shape", z))  # fp32 zeros [N, L]
    body = _expert_loop_body(z, experts, starts, ends, rows, weights, betas)
    u = b.op("Loop", b.op("Size", experts), "", acc, body=body)
    b.nodes.append(helper.make_node("CastLike", [u, "z"], ["u"]))
    return b.function("MoE", ["x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2"], ["u"], {"": opset})


def _check_attributes(nodes: list[ir.Node]) -> None:
    for n in nodes:
        spec = schemas.NODE_SPECS.get(n.op_type)
        if spec is None:
            raise ValueError(f"node {n.name!r}: unknown op k3::{n.op_type} (known: {sorted(schemas.NODE_SPECS)})")
        missing = [f for f, _ in spec.fields if f not in n.attributes] + \
                  [a for a in schemas.COMMON_ATTRIBUTES if a not in n.attributes]
        if missing:
            raise ValueError(f"node {n.name!r} (k3::{n.op_type}) lacks attribute(s) {missing}")


def trt_pass(model: ir.Model) -> ir.Model:
    """Bare plugin nodes: attributes complete, no k3 function bodies."""
    _check_attributes(k3_nodes(model))
    for key in [k for k in model.functions if k[0] == schemas.DOMAIN]:
        del model.functions[key]
    return model


def ort_pass(model: ir.Model) -> ir.Model:
    """Attach standard-op / com.microsoft function bodies to every k3 op type the model uses."""
    nodes = k3_nodes(model)
    _check_attributes(nodes)
    opset = model.opset_imports[""]
    if opset < 18:
        raise ValueError(f"ort flavor needs ai.onnx opset >= 18 (ReduceMean axes as input), model has {opset}")
    used = {n.op_type for n in nodes}
    activations = {n.attributes["activation"].as_string() for n in nodes if n.op_type == "MoE"}
    if len(activations) > 1:
        raise ValueError(f"k3::MoE nodes use several activations {sorted(activations)}; the ort body bakes in one")
    builders: dict[str, Callable[[], onnx.FunctionProto]] = {
        "KDA": lambda: kda_function(opset),
        "AttnRes": lambda: attn_res_function(opset),
        "MoE": lambda: moe_function(opset, activations.pop()),
    }
    for op_type in sorted(used):
        fn = ir.serde.deserialize_function(builders[op_type]())
        model.functions[fn.identifier()] = fn
    if "KDA" in used:
        model.opset_imports[MS_DOMAIN] = 1
    return model


FLAVOR_PASSES: dict[str, Callable[[ir.Model], ir.Model]] = {"ort": ort_pass, "trt": trt_pass}
