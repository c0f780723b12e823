"""`k3::KDA` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.kda`, and the ONNX Runtime function body.

Body: com.microsoft::LinearAttention (update_rule="gated_delta", per-key decay). Checked to match the
reference to ~5e-10 on CPU; its conventions: q/k/v/decay packed [B, T, H*D], decay in log space,
beta [B, T, H], `scale` applied to q, past/present state [B, H, K, V]. It has no bf16 kernel, so the body
computes in fp32 and casts o back.
With the k3x kernel library built (runtime/ort_kernels.py), ONNX Runtime's CPU provider runs an fp32 KDA
node on ort_kernel.cc instead (the k3::KDAPacked kernel's recurrence, ort_recurrence.h): 141 -> 83 us a
k3-bench decode step a layer on the 2-core EPYC.
"""

from __future__ import annotations

import onnx

from ...plan.onnx_node import COMMON_ATTRIBUTES, MS_DOMAIN, Body, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted


def translate(q, k, v, g, beta, initial_state, scale: float, kernels: str, gate_lower_bound: float = 0.0):
    return opset().KDA(q, k, v, g, beta, initial_state, scale=float(scale), num_heads=static(q.shape[2], "kda heads"),
                       head_dim=static(q.shape[3], "kda head_dim"), value_dim=static(v.shape[3], "kda value_dim"), gate_lower_bound=float(gate_lower_bound),
                       _outputs=2, **COMMON_ATTRIBUTES)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports."""
    b = Body("KDA", "pack")
    o, state = linear_attention(b, "q", "k", "v", "g", "beta", "initial_state")
    b.step = "unpack"
    o = b.op("Reshape", o, b.op("Shape", "v"))  # [B, T, H*V] -> [B, T, H, V]
    b.out("CastLike", [o, "v"], ["o"])
    b.out("Identity", [state], ["final_state"])
    return b.function(NODE, {"": opset_version, MS_DOMAIN: 1}), {MS_DOMAIN: 1}


def linear_attention(b: Body, q: str, k: str, v: str, g: str, beta: str, s0: str) -> tuple[str, str]:
    """The recurrence as nodes of `b` (also k3::KDAPacked's body): q, k, g [B, T, H, K], v [B, T, H, V],
    beta [B, T, H], s0 [B, H, K, V], any float dtype -> (o [B, T, H*V] fp32, final state fp32). The calling
    node's attributes `num_heads` and `scale` are referenced, so the node must have them."""
    q, k, v, g, beta = packed_inputs(b, q, k, v, g, beta)
    return recurrence(b, q, k, v, g, beta, b.op("Cast", s0, to=onnx.TensorProto.FLOAT))


def packed_inputs(b: Body, q: str, k: str, v: str, g: str, beta: str) -> tuple[str, ...]:
    """LinearAttention's fp32 inputs: q, k, v, g [B, T, H, D] -> [B, T, H*D]; beta [B, T, H]."""
    packed = b.ints(0, 0, -1)
    q, k, v, g = (b.op("Reshape", b.op("Cast", x, to=onnx.TensorProto.FLOAT), packed) for x in (q, k, v, g))
    return q, k, v, g, b.op("Cast", beta, to=onnx.TensorProto.FLOAT)


def recurrence(b: Body, q: str, k: str, v: str, g: str, beta: str, s0: str) -> tuple[str, str]:
    """The LinearAttention node on `packed_inputs` and an fp32 state s0 -> (o [B, T, H*V], final state)."""
    b.step = "recurrence"
    o, state = b.op("LinearAttention", q, k, v, s0, g, beta, outputs=2, domain=MS_DOMAIN, update_rule="gated_delta")
    la = b.nodes[-1]
    for attr, ref in (("q_num_heads", "num_heads"), ("kv_num_heads", "num_heads")):
        la.attribute.append(onnx.AttributeProto(name=attr, ref_attr_name=ref, type=onnx.AttributeProto.INT))
    la.attribute.append(onnx.AttributeProto(name="scale", ref_attr_name="scale", type=onnx.AttributeProto.FLOAT))
    return o, state
