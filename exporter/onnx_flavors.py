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
    MoE     -> standard ops, exact: sigmoid router, TopK on biased scores, GatherElements of unbiased
               scores, renormalise, then EVERY expert runs on every token as one batched MatMul over the
               stacked [E, I, L] weights, weighted by a dense [N, E] routing matrix (ScatterElements).
               Cost: E / top_k times the routed FLOPs and all expert weights read per call — fine for
               small models and CPU tests, not a production MoE (ORT's com.microsoft::MoE routes with
               softmax, not K3's sigmoid + biased top-k + unbiased renormalised weights).
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
FLOAT = TensorProto.FLOAT


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


def _glu(b: _Body, a: str, u: str, activation: str) -> str:
    if activation == "silu":
        return b.op("Mul", b.op("Mul", a, b.op("Sigmoid", a)), u)
    if activation != "situ":
        raise ValueError(f"k3::MoE activation={activation!r}: expected 'situ' or 'silu'")
    b1 = b.ref("situ_beta", onnx.AttributeProto.FLOAT, "value_float")
    b2 = b.ref("situ_linear_beta", onnx.AttributeProto.FLOAT, "value_float")
    left = b.op("Mul", b.op("Mul", b1, b.op("Tanh", b.op("Div", a, b1))), b.op("Sigmoid", a))
    return b.op("Mul", left, b.op("Mul", b2, b.op("Tanh", b.op("Div", u, b2))))


def moe_function(opset: int, activation: str) -> onnx.FunctionProto:
    # axes: N tokens, d width, L expert width, E experts, I expert intermediate, k top_k
    b = _Body("moe")
    f32 = {n: b.op("Cast", n, to=FLOAT) for n in ("x", "z", "gate_weight", "gate_bias", "w1", "w3", "w2")}
    s = b.op("Sigmoid", b.op("MatMul", f32["x"], b.op("Transpose", f32["gate_weight"], perm=[1, 0])))  # [N, E]
    k = b.op("Unsqueeze", b.ref("top_k", onnx.AttributeProto.INT, "value_int"), b.ints(0))  # [1]
    _, ids = b.op("TopK", b.op("Add", s, f32["gate_bias"]), k, outputs=2, axis=-1, largest=1, sorted=1)  # [N, k]
    w = b.op("GatherElements", s, ids, axis=-1)  # unbiased scores of the chosen experts [N, k]
    # renormalize in {0, 1}: w / (r * (Σw + 1e-20) + (1 - r)) is exactly the reference for either value
    r = b.op("Cast", b.ref("renormalize", onnx.AttributeProto.INT, "value_int"), to=FLOAT)
    one, tiny = b.op("Constant", value_float=1.0), b.op("Constant", value_float=1e-20)
    total = b.op("Add", b.op("ReduceSum", w, b.ints(-1), keepdims=1), tiny)
    w = b.op("Div", w, b.op("Add", b.op("Mul", r, total), b.op("Sub", one, r)))
    w = b.op("Mul", w, b.ref("routed_scaling_factor", onnx.AttributeProto.FLOAT, "value_float"))
    dense = b.op("ScatterElements", b.op("ConstantOfShape", b.op("Shape", s)), ids, w, axis=1)  # [N, E]
    h1 = b.op("MatMul", f32["z"], b.op("Transpose", f32["w1"], perm=[0, 2, 1]))  # [E, N, I]
    h3 = b.op("MatMul", f32["z"], b.op("Transpose", f32["w3"], perm=[0, 2, 1]))
    y = b.op("MatMul", _glu(b, h1, h3, activation), b.op("Transpose", f32["w2"], perm=[0, 2, 1]))  # [E, N, L]
    weight = b.op("Unsqueeze", b.op("Transpose", dense, perm=[1, 0]), b.ints(-1))  # [E, N, 1]
    u = b.op("ReduceSum", b.op("Mul", weight, y), b.ints(0), keepdims=0)  # [N, L]
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
