"""`k3::MoE` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.moe`, and the ONNX Runtime function body.

Body: standard ops, exact, O(N·top_k) expert work: sigmoid router, TopK on biased scores, GatherElements of
unbiased scores, renormalise; the routed (token, slot) pairs sorted by expert, then the experts' work
(onnx_experts.py: fp32 stacked experts, up to 64 of them, each on its own rows; more fp32 experts, a padded
batch when little of it is padding, else a Loop over the hit experts only; other weights, the Loop), each pair's output weighted and summed per token, in fp32. ORT's
com.microsoft::MoE routes with softmax, not K3's sigmoid + biased top-k + unbiased renormalised weights, so
it is not used. Numeric hyper-parameters are read from the node attributes (attribute references); the
activation is a string, so it is baked into the body and all MoE nodes of a model must share it.
"""

from __future__ import annotations

import onnx
import onnx_ir
from onnx import TensorProto

from ...plan.onnx_node import COMMON_ATTRIBUTES, FUSED_DOMAIN, MS_DOMAIN, Body, NodeSpec, opset, static
from ..fused import SITU_GLU, SITU_GLU_EXPERTS, situ_glu_halves
from .onnx_dispatch import dispatched_experts, route
from .onnx_experts import UNROLL_MAX, ExpertWeights, Quantize, routed_experts
from .op import SIGNATURE

FLOAT = TensorProto.FLOAT

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted


def offset_input(expert_offset):
    """The node's expert_offset input: the op's tensor as int32, or a constant 0 for a single-GPU call (the
    node always has the input, so the plugin has one port layout)."""
    import onnxscript

    op = onnxscript.opset18
    if expert_offset is None:
        return op.Constant(value=onnx.helper.make_tensor("expert_offset", TensorProto.INT32, [1], [0]))
    return op.Reshape(op.Cast(expert_offset, to=TensorProto.INT32), op.Constant(value_ints=[1]))


def translate(x, z, gate_weight, gate_bias, w1, w3, w2, top_k: int, routed_scaling_factor: float, renormalize: bool,
              activation: str, situ_beta: float, situ_linear_beta: float, kernels: str, expert_offset=None):
    E, I, L = (static(d, "moe expert weight dims") for d in w1.shape)
    return opset().MoE(x, z, gate_weight, gate_bias, w1, w3, w2, offset_input(expert_offset), top_k=int(top_k),
                       routed_scaling_factor=float(routed_scaling_factor), renormalize=int(bool(renormalize)),
                       activation=str(activation), situ_beta=float(situ_beta), situ_linear_beta=float(situ_linear_beta),
                       num_experts=E, hidden_size=static(x.shape[-1], "moe hidden_size"), expert_dim=L,
                       intermediate_size=I, **COMMON_ATTRIBUTES)


def _activation_constants(b: Body, activation: str) -> list[str]:
    if activation == "silu":
        return []
    if activation != "situ":
        raise ValueError(f"k3::MoE activation={activation!r}: expected 'situ' or 'silu'")
    return [b.ref("situ_beta", onnx.AttributeProto.FLOAT, "value_float"),
            b.ref("situ_linear_beta", onnx.AttributeProto.FLOAT, "value_float")]


def _glu(b: Body, a: str, u: str, betas: list[str], fused: bool) -> str:
    """SiLU-GLU a σ(a) ⊙ u when `betas` is empty, else SiTU-GLU [β1 tanh(a/β1) σ(a)] ⊙ [β2 tanh(u/β2)]: one
    `k3x.fused::SiTUGLU` call when `fused` (custom_ops/fused.py; its body is these ops), else the ops."""
    if not betas:
        return b.op("Mul", b.op("Mul", a, b.op("Sigmoid", a)), u)
    b1, b2 = betas
    if fused:
        return b.op(SITU_GLU, a, u, b1, b2, domain=FUSED_DOMAIN)
    return b.op("Mul", *situ_glu_halves(b, a, u, b1, b2))


def _glu_experts(b: Body, hs: list[str], betas: list[str]) -> list[str]:
    """Every expert's SiTU-GLU from its [a | u] rows as one `k3x.fused::SiTUGLUExperts` call."""
    ys = b.op(SITU_GLU_EXPERTS, *betas, *hs, outputs=len(hs), domain=FUSED_DOMAIN)
    return ys if isinstance(ys, list) else [ys]


def dense_weights(b: Body, e: str) -> dict[str, str]:
    """Expert `e`'s fp32 w1, w3 [I, L] and w2 [L, I] from the function's stacked inputs (Gather, then Cast)."""
    return {n: b.op("Cast", b.op("Gather", n, e, axis=0), to=FLOAT) for n in ("w1", "w3", "w2")}


def fp32_experts(nodes: list) -> bool:
    """Whether every MoE node's stacked expert weights (w1, w3, w2) are known fp32 (the batches read them
    whole, in place or folded per expert; bf16 ones would be cast whole, so those models keep the loop)."""
    return bool(nodes) and all(len(n.inputs) > 6 and all(v is not None and v.dtype == onnx_ir.DataType.FLOAT
                                                             for v in n.inputs[4:7]) for n in nodes)


def per_expert_count(nodes: list) -> int:
    """The local expert count every MoE node shares (w1's first dim, else the num_experts attribute) when it is
    at most UNROLL_MAX, else 0 (unknown, differing, or too many for one copy of the step per expert)."""
    def count(n) -> int | None:
        w1 = n.inputs[4] if len(n.inputs) > 4 else None
        if w1 is not None and w1.shape is not None and isinstance(w1.shape[0], int):
            return w1.shape[0]
        attr = n.attributes.get("num_experts")
        return attr.as_int() if attr is not None else None
    counts = {count(n) for n in nodes}
    e = counts.pop() if len(counts) == 1 else None
    return e if e is not None and 0 < e <= UNROLL_MAX else 0


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    batched = fp32_experts(nodes)
    return moe_function(NODE, opset_version, nodes, dense_weights, batched=batched,
                        per_expert=per_expert_count(nodes) if batched else 0)


def moe_function(spec: NodeSpec, opset_version: int, nodes: list, expert_weights: ExpertWeights,
                 quantize: Quantize | None = None, *, batched: bool = False, per_expert: int = 0
                 ) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """k3::MoE, exact (custom_ops/moe/reference.py), O(M·I·L) FLOPs for the M = N·top_k routed pairs.

    1. Route in fp32: s = sigmoid(x gate_weightᵀ), ids = TopK(s + gate_bias) [N, k], w = s[ids] renormalised
       and scaled [N, k] (the bias selects, never weighs).
    2. Sort the M (token, slot) pairs by expert (TopK ascending), so each expert's pairs form one segment of
       (row = pair // k, weight); Unique gives the hit experts, ascending, and their counts.
       Expert parallelism: ids become local (id - expert_offset); pairs of another rank's experts get the
       sentinel E_local, which sorts last, so the Loop's trip count (local hit experts) never reaches them.
    3. The experts (onnx_experts.routed_experts), fp32 stacked weights (`fp32_experts`): with `per_expert` =
       E_local (<= UNROLL_MAX, `per_expert_count`) one copy of the step per expert on exactly its own pairs,
       its weights folded to constants at load, between the k3x.fused calls MoEDispatch (steps 1-2 and each
       expert's rows) and MoECombine (onnx_dispatch.py); with more experts an If that runs every local expert on its
       pairs padded to the largest count as batched MatMuls reading the weights in place, while padding
       stays <= 2x the routed rows and at least half the experts are hit;
       otherwise (and always for bf16 / MXFP4 weights) a Loop over the hit experts only (<= min(E, M)
       iterations) builds each one's fp32 weights with `expert_weights` (a Gather, then Cast: bf16 weights
       are never all cast; transient memory is one expert's fp32 weights) and appends its rows to a
       sequence. Each pair's row is then weighted and the top_k slots of a token summed. u in z's dtype.
    The SiTU betas are attribute references evaluated in the function scope and read by the subgraphs as
    outer-scope values (no attribute references in subgraphs).
    `nodes`: the model's MoE nodes (onnx_ir), whose shared activation is baked in. `expert_weights(b, e)`
    builds expert e's fp32 weights inside the loop body (`dense_weights`; the MXFP4 sibling decodes there);
    `quantize(b, t)` rounds both expert-GEMM inputs there (the MXFP4 sibling's MXFP8 activations).
    """
    activations = {n.attributes["activation"].as_string() for n in nodes}
    if len(activations) != 1:
        raise ValueError(f"k3::MoE nodes use activations {sorted(activations)}; the ort body bakes in exactly one")
    b = Body(spec.op_type, "route")
    x, z, gw, gb = (b.op("Cast", n, to=FLOAT) for n in ("x", "z", "gate_weight", "gate_bias"))
    betas = _activation_constants(b, activations.pop())
    routing = (b.op("MatMul", x, b.op("Transpose", gw, perm=[1, 0])), gb, z,  # logits [N, E]
               b.op("Cast", b.ref("renormalize", onnx.AttributeProto.INT, "value_int"), to=FLOAT),
               b.ref("routed_scaling_factor", onnx.AttributeProto.FLOAT, "value_float"),
               b.op("Unsqueeze", b.ref("top_k", onnx.AttributeProto.INT, "value_int"), b.ints(0)),  # [1]
               b.op("Unsqueeze", b.ref("num_experts", onnx.AttributeProto.INT, "value_int"), b.ints(0)),  # local
               "expert_offset")
    if batched and per_expert:
        if per_expert > UNROLL_MAX:
            raise ValueError(f"per_expert={per_expert}: at most {UNROLL_MAX} experts get one copy of the step each")
        b.step = "per_expert"
        u = dispatched_experts(b, routing, per_expert, lambda body, a, u: _glu(body, a, u, betas, fused=True),
                               (lambda body, hs: _glu_experts(body, hs, betas)) if betas else None)
    else:
        pairs = route(b, *routing)
        b.step = "experts"
        # the GLU of the function's own nodes as a k3x.fused call; the If / Loop subgraphs keep the ops
        u = routed_experts(b, pairs, lambda body, a, u: _glu(body, a, u, betas, fused=body is b), expert_weights,
                           batched, quantize)
    b.out("CastLike", [u, "z"], ["u"])
    extra = {MS_DOMAIN: 1} if batched and not per_expert else {}  # the padded batch's FusedMatMul
    if any(n.domain == FUSED_DOMAIN for n in b.nodes):
        extra[FUSED_DOMAIN] = 1  # ort_pass attaches its function
    return b.function(spec, {"": opset_version, **extra}), extra
