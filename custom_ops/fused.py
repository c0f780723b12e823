"""`k3x.fused`: chains of standard ops grouped as ONNX local functions so ONNX Runtime can run each as one CPU
kernel; every runtime without the kernel inlines the body, the same ops as before. Not k3 op families (no torch
op, no plugin); domain `k3x.fused`, not `k3`, whose nodes are plugin nodes in the TensorRT flavor.

`SiTUGLU(a, u, beta, linear_beta) -> y`: the SiTU-GLU of custom_ops/moe/reference.py `glu`,

    y = [β1 tanh(a/β1) σ(a)] ⊙ [β2 tanh(u/β2)],  β1 = beta, β2 = linear_beta (fp32 scalars, Constants)

Its body is the nine ops torch.onnx writes for `glu` (Div, Tanh, Mul, Sigmoid, Mul; Div, Tanh, Mul; Mul), on
the same scalar constants, so ONNX Runtime and TensorRT's parser (as with the `k3x.layers` functions) inline
it to the same math. Its CPU kernel (custom_ops/moe/ort_kernel.cc, built by runtime/ort_kernels.py) makes one
pass over a and u where the body makes nine over [N, I]. Calls are made by exporter/onnx_rewrites.py
`fuse_situ_glu` from the traced dense FFN / shared-expert chain, and by the k3::MoE body for its experts.

`SiTUGLUExperts(beta, linear_beta, h_0..h_{E-1}) -> y_0..y_{E-1}`: the SiTU-GLU of each routed expert of a
k3::MoE body's per-expert path, h_e = [a_e | u_e] along the last axis (one Gemm against the expert's w1 and w3
stacked), y_e its GLU; the body splits each h_e and runs the SiTUGLU chain on the halves. One call (and one
kernel pass over every expert's rows) where one SiTUGLU call per expert was.

`DepthwiseConv1d(x, w, b) -> y` (attribute `group`): ONNX's Conv of x [B, C, L] with w [C, 1, W] and bias b [C],
group = C, no padding, stride and dilation 1 (KDA's short conv in the batch interface, model/kda.py). Its body
is that one Conv (the group an attribute reference); its CPU kernel (custom_ops/kda_prep/ort_kernel.cc) is a
loop over the channels with the Conv's sums in its order (bit-identical), where ONNX Runtime's Conv runs one
im2col + GEMM per channel (0.35 ms a decode step on k3-bench's 3,072 channels). Calls are made by exporter/onnx_rewrites.py `fuse_depthwise_conv`.

`KDAShortConv(x, state, w, b, heads, eps) -> q, k, v, conv`: the batch interface's KDA from the pre-conv
projections to the recurrence's inputs (model/kda.py `forward` and `_heads`), x [B, T, C] (q|k|v projections,
C = 3·H·D), state [B, C, W-1] (the past conv state), w [C, 1, W], b [C] (the Conv's bias: zeros as converted),
heads int64 [3, H, D], eps a fp32 scalar (Constants):

    xx = Concat(state, xᵀ) [B, C, W-1+T];  y = SiLU(Conv(xx, w, b, group = C)ᵀ) [B, T, C]
    q, k, v = Reshape(y, [B, T, 3, H, D]) split on axis 2;  q, k = z / sqrt(Σ_D z² + eps)
    conv = xx[:, :, T:]                                                     (the new state, [B, C, W-1])

Its body is those ops as torch.onnx writes them (the Conv's group a literal: the body is built for the calls'
channel count, so it has no attribute and TensorRT's parser inlines it like LatentAttention's). Its CPU kernel
(custom_ops/kda_prep/ort_kernel.cc) makes one pass per row (b, t) over ONNX Runtime's intra-op threads: the
conv from the window (its sums in the Conv's order, as DepthwiseConv1d's), SiLU and the two norms, where the
body runs ~25 nodes per KDA layer. Calls are made by exporter/onnx_rewrites_kda.py `fuse_kda_short_conv`.

`LatentAttention(q, present, hidden, scale) -> o`: the batch interface's absorbed MLA attention over the
cached latent (model/mla.py `forward`), q [B, H·T, L] (every head's queries in the latent space, head-major),
present [B, S, L] (the latent cache: keys, and as values all L columns), hidden [T, S] bool (True where query
position t must not see key s), scale a fp32 scalar:

    o = MatMul(Reshape(Softmax(Where(hidden, -inf, Reshape(MatMul(q, presentᵀ), [B, -1, T, S]) · scale)),
               [B, H·T, S]), present)                                       [B, H·T, L]

Its body is those ops as torch.onnx writes them (the same values, inlined). Its CPU kernel
(custom_ops/mla_paged/ort_kernel.cc) reads each cached row once per eight query rows, in key blocks with an
online softmax (no [B, H, T, S] scores in memory; a causal prefill skips the keys after its rows), the rows, and
a decode step's keys in chunks, over ONNX Runtime's intra-op threads. Calls are made by
exporter/onnx_rewrites.py `fuse_latent_attention`.

`LatentAttentionAppend(q, past, latent, hidden, scale) -> (o, present)`: the same over the growing cache, present
= Concat(past [B, P, L], latent [B, S - P, L]) on axis 1, which it also writes. Its body is that Concat and
LatentAttention's chain. Its kernel (the same file) copies each key chunk's rows into present in the task that
attends them (a decode step), reading the keys from past and latent as it copies them and writing present with
streaming stores, so the cache is read from memory once and by every thread, where ONNX Runtime's Concat copied
it on one thread and the attention read the copy again. Calls are made
by `fuse_latent_attention` where the cache is such a Concat.

`LinearQ8Group<P>(x, weight_0, scales_0, .., weight_{P-1}, scales_{P-1}) -> y_0 .. y_{P-1}` (attributes K,
block_size, N_0 .. N_{P-1}) and `LinearBF16Group<P>(x, weight_0, .., weight_{P-1}) -> y_0 .. y_{P-1}`, P = 2 to 8
(op types LinearQ8Group2 .. LinearQ8Group8, LinearBF16Group2 ..): the CPU trunk's projections of one activation
(KDA's q, k, v, gate and beta projections; MLA's q_a, kv_a and gate; an MoE layer's latent down-projection and
the shared experts' gate and up) in one call, y_i = k3::LinearQ8(x, weight_i, scales_i) with N = N_i
(k3::LinearBF16(x, weight_i)). Its body is those k3 calls, so without the kernel every runtime runs what it
ran before; its CPU kernels (custom_ops/linear_q8/ and linear_bf16/ort_kernel.cc) give each y_i as the
single-projection kernel does, bit for bit, with x quantised once and every projection's tasks in one dispatch
to the threads. One op type an arity, because a body must serve every call of its op type, and ONNX Runtime
resolves no function overload called from inside another function (the layer functions,
exporter/onnx_functions.py). Calls are made by exporter/onnx_rewrites_linear.py `group_projections` in the ort
flavor pass.

`MoEDispatch` and `MoECombine`: the k3::MoE body's routing and row traffic around its per-expert GEMMs
(custom_ops/moe/onnx_dispatch.py, their bodies and kernels' contract; kernels in custom_ops/moe/ort_kernel.cc),
built for the calling nodes' local expert count.
"""

from __future__ import annotations

import onnx
from onnx import helper

from ..plan.onnx_node import DOMAIN, FUSED_DOMAIN, Body
from .moe.onnx_dispatch import MOE_COMBINE, MOE_DISPATCH, combine_function, dispatch_function

SITU_GLU = "SiTUGLU"
SITU_GLU_EXPERTS = "SiTUGLUExperts"
DEPTHWISE_CONV = "DepthwiseConv1d"
LATENT_ATTENTION = "LatentAttention"
LATENT_ATTENTION_APPEND = "LatentAttentionAppend"
KDA_SHORT_CONV = "KDAShortConv"
LINEAR_GROUPS = {"LinearQ8": "LinearQ8Group", "LinearBF16": "LinearBF16Group"}  # k3 op -> its groups' op type stem
LINEAR_GROUP_ARITIES = range(2, 9)  # projections a call (the kernels' MAX_GROUP, custom_ops/ort_kernel.h)
LINEAR_REFERENCED = ("K", "N", "block_size")  # a projection's attributes a group call carries (N as N_i)


def situ_glu_halves(b: Body, a: str, u: str, beta: str, linear_beta: str) -> tuple[str, str]:
    """[β1 tanh(a/β1) σ(a)] and [β2 tanh(u/β2)] as ops in `b`, in the order torch.onnx writes them (the
    SiTUGLU body, and the k3::MoE body's GLU where it cannot call the function); their product is the GLU."""
    left = b.op("Mul", b.op("Mul", b.op("Tanh", b.op("Div", a, beta)), beta), b.op("Sigmoid", a))
    return left, b.op("Mul", b.op("Tanh", b.op("Div", u, linear_beta)), linear_beta)


def situ_glu_function(opset_version: int) -> onnx.FunctionProto:
    """The SiTUGLU body: the traced chain, on the same scalar constants (ONNX Runtime gives bit-identical
    outputs whether the call sits in the main graph or in a `k3x.layers` function)."""
    b = Body(SITU_GLU)
    b.out("Mul", list(situ_glu_halves(b, "a", "u", "beta", "linear_beta")), ["y"])
    return helper.make_function(FUSED_DOMAIN, SITU_GLU, ["a", "u", "beta", "linear_beta"], ["y"], b.nodes,
                                [helper.make_opsetid("", opset_version)], doc_string="SiTU-GLU (k3x)")


def situ_glu_experts_function(opset_version: int, experts: int) -> onnx.FunctionProto:
    """The SiTUGLUExperts body for `experts` experts: each h_e split in halves (a_e, u_e), the SiTUGLU chain."""
    b = Body(SITU_GLU_EXPERTS)
    hs, ys = [f"h_{e}" for e in range(experts)], [f"y_{e}" for e in range(experts)]
    for h, y in zip(hs, ys):
        a, u = b.op("Split", h, axis=-1, num_outputs=2, outputs=2)
        b.out("Mul", list(situ_glu_halves(b, a, u, "beta", "linear_beta")), [y])
    return helper.make_function(FUSED_DOMAIN, SITU_GLU_EXPERTS, ["beta", "linear_beta", *hs], ys, b.nodes,
                                [helper.make_opsetid("", opset_version)], doc_string="SiTU-GLU of each expert (k3x)")


def depthwise_conv_function(opset_version: int) -> onnx.FunctionProto:
    """The DepthwiseConv1d body: one Conv, its group the calling node's `group` attribute."""
    conv = helper.make_node("Conv", ["x", "w", "b"], ["y"], name=f"{DEPTHWISE_CONV}/Conv")
    conv.attribute.append(onnx.AttributeProto(name="group", ref_attr_name="group", type=onnx.AttributeProto.INT))
    return helper.make_function(FUSED_DOMAIN, DEPTHWISE_CONV, ["x", "w", "b"], ["y"], [conv],
                                [helper.make_opsetid("", opset_version)], attributes=["group"],
                                doc_string="depthwise 1-D convolution (k3x)")


def _attend_latent(b: Body, present: str) -> None:
    """The traced attention over the latent `present` as ops in `b`, writing the function's output o."""
    scores = b.op("MatMul", "q", b.op("Transpose", present, perm=[0, 2, 1]))  # [B, H*T, S]
    per_head = b.op("Concat", b.op("Shape", scores, end=1), b.ints(-1), b.op("Shape", "hidden", end=1),
                    b.op("Shape", scores, start=2), axis=0)  # [B, H, T, S]
    scaled = b.op("Mul", b.op("Reshape", scores, per_head), "scale")
    masked = b.op("Where", "hidden", b.op("Constant", value_float=float("-inf")), scaled)
    probs = b.op("Reshape", b.op("Softmax", masked, axis=-1), b.op("Shape", scores))
    b.out("MatMul", [probs, present], ["o"])


def latent_attention_function(opset_version: int) -> onnx.FunctionProto:
    """The LatentAttention body: the traced chain; T from `hidden`'s rows, so it needs no attribute."""
    b = Body(LATENT_ATTENTION)
    _attend_latent(b, "present")
    return helper.make_function(FUSED_DOMAIN, LATENT_ATTENTION, ["q", "present", "hidden", "scale"], ["o"], b.nodes,
                                [helper.make_opsetid("", opset_version)],
                                doc_string="attention over the MLA latent (k3x)")


def latent_attention_append_function(opset_version: int) -> onnx.FunctionProto:
    """The LatentAttentionAppend body: the traced Concat of the cache, then LatentAttention's chain over it."""
    b = Body(LATENT_ATTENTION_APPEND)
    b.out("Concat", ["past", "latent"], ["present"], axis=1)
    _attend_latent(b, "present")
    return helper.make_function(FUSED_DOMAIN, LATENT_ATTENTION_APPEND, ["q", "past", "latent", "hidden", "scale"],
                                ["o", "present"], b.nodes, [helper.make_opsetid("", opset_version)],
                                doc_string="the MLA latent cache's new rows appended, attention over it (k3x)")


def kda_short_conv_function(opset_version: int, channels: int) -> onnx.FunctionProto:
    """The KDAShortConv body for `channels` (C, the Conv's group): the traced chain, the new state's start T
    from x's shape as the exporter takes it."""
    b = Body(KDA_SHORT_CONV)
    xt = b.op("Transpose", "x", perm=[0, 2, 1])  # [B, C, T]
    xx = b.op("Concat", "state", xt, axis=-1)  # [B, C, W-1+T]
    yt = b.op("Transpose", b.op("Conv", xx, "w", "b", group=channels), perm=[0, 2, 1])  # [B, T, C]
    y = b.op("Mul", yt, b.op("Sigmoid", yt))
    view = b.op("Reshape", y, b.op("Concat", b.op("Shape", y, end=2), "heads", axis=0), allowzero=1)
    axis = b.ints(-3)
    for i, name in enumerate(("q", "k")):
        z = b.op("Squeeze", b.op("Slice", view, b.ints(i), b.ints(i + 1), axis), axis)
        sums = b.op("ReduceSum", b.op("Mul", z, z), b.ints(-1), keepdims=1)
        b.out("Div", [z, b.op("Sqrt", b.op("Add", sums, "eps"))], [name])
    b.out("Squeeze", [b.op("Slice", view, b.ints(2), b.ints(3), axis), axis], ["v"])
    b.out("Slice", [xx, b.op("Shape", xt, start=2, end=3), b.ints(2**63 - 1), b.ints(2), b.ints(1)], ["conv"])
    return helper.make_function(FUSED_DOMAIN, KDA_SHORT_CONV, ["x", "state", "w", "b", "heads", "eps"],
                                ["q", "k", "v", "conv"], b.nodes, [helper.make_opsetid("", opset_version)],
                                doc_string="KDA's short conv, SiLU and q/k L2 norm (k3x)")


def linear_group_op(op_type: str, arity: int) -> str:
    """The group op type for `arity` k3::`op_type` projections (LinearQ8Group6, ...)."""
    return f"{LINEAR_GROUPS[op_type]}{arity}"


def linear_group_function(op_type: str, arity: int, literals: dict, imports: dict[str, int]) -> onnx.FunctionProto:
    """The body of `linear_group_op(op_type, arity)`: a k3::`op_type` call per projection, the weights as inputs
    (weight_i, and scales_i for LinearQ8), K, block_size and N (as N_i) the calling node's attributes where the
    projection has them (LinearQ8), `literals` (the projections' other attributes, the same for all) as they
    are; `imports` the domains' versions (ai.onnx and k3, as the model imports them)."""
    scaled = op_type == "LinearQ8"
    name = linear_group_op(op_type, arity)
    inputs, outputs, nodes = ["x"], [], []
    for i in range(arity):
        weights = [f"weight_{i}"] + ([f"scales_{i}"] if scaled else [])
        inputs += weights
        outputs.append(f"y_{i}")
        node = helper.make_node(op_type, ["x", *weights], [f"y_{i}"], name=f"{name}/{i}", domain=DOMAIN, **literals)
        if scaled:
            for attr, ref in (("K", "K"), ("N", f"N_{i}"), ("block_size", "block_size")):
                node.attribute.append(onnx.AttributeProto(name=attr, ref_attr_name=ref, type=onnx.AttributeProto.INT))
        nodes.append(node)
    attributes = ["K", "block_size", *(f"N_{i}" for i in range(arity))] if scaled else []
    return helper.make_function(FUSED_DOMAIN, name, inputs, outputs, nodes,
                                [helper.make_opsetid(d, v) for d, v in sorted(imports.items())],
                                attributes=attributes, doc_string=f"{arity} k3::{op_type} projections of one x (k3x)")


# op type in FUSED_DOMAIN -> its body, for (ai.onnx opset, the calls' (input count, output count))
FUNCTIONS = {SITU_GLU: lambda opset_version, _: situ_glu_function(opset_version),
             SITU_GLU_EXPERTS: lambda opset_version, ports: situ_glu_experts_function(opset_version, ports[1]),
             DEPTHWISE_CONV: lambda opset_version, _: depthwise_conv_function(opset_version),
             LATENT_ATTENTION: lambda opset_version, _: latent_attention_function(opset_version),
             LATENT_ATTENTION_APPEND: lambda opset_version, _: latent_attention_append_function(opset_version),
             MOE_DISPATCH: lambda opset_version, ports: dispatch_function(opset_version, ports[1] - 2),
             MOE_COMBINE: lambda opset_version, ports: combine_function(opset_version, ports[0] - 2)}
