"""The routing half of the `k3::MoE` ONNX Runtime body, and the per-expert step as two `k3x.fused` calls.

`route` is K3's router and the sort of the routed pairs by expert (custom_ops/moe/onnx.py `moe_function`,
steps 1-2), in standard ops; every expert path starts from it. With fp32 stacked weights and at most
UNROLL_MAX local experts (`per_expert_count`) the body runs each expert on exactly its own rows, and what
surrounds the experts' GEMMs is two calls (custom_ops/fused.py), so ONNX Runtime can run each as one CPU kernel
(custom_ops/moe/ort_kernel.cc) where the bodies below are ~50 graph ops, a row Gather per expert and a Concat:

    MoEDispatch(logits [N, E], gate_bias [E], z [N, L], renormalize, scale, top_k [1], num_experts [1],
                expert_offset [1] int32) -> pair_w [N, k], pair_row [N, k] int64, x_0..x_{E_local-1} [n_e, L]
    MoECombine(pair_w, pair_row, y_0..y_{E_local-1} [n_e, L]) -> u [N, L]

x_e is expert e's rows of z (its pairs in the stable expert-sorted order), y_e its output rows in that
order; pair_w the (token, slot) pair's weight (0 for another rank's expert), pair_row its row of
Y = [0; y_0; ...; y_{E-1}] (0, the zero row, for another rank's expert); u[n] = sum_j pair_w[n, j] Y[pair_row[n, j]].
The functions are built for the model's local expert count (their output / input counts), which every MoE
node of a model shares. Between them, with SiTU, each expert's Gemm against [w1; w3] and one
`k3x.fused::SiTUGLUExperts` call for every expert's GLU (custom_ops/fused.py); with SiLU two Gemms and the ops.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import TensorProto, helper

from ...plan.onnx_node import FUSED_DOMAIN, Body
from .onnx_experts import Glu, Pairs, pair_rows, sorted_slots, weighted_sum

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
MOE_DISPATCH, MOE_COMBINE = "MoEDispatch", "MoECombine"  # op types in FUSED_DOMAIN
DISPATCH_INPUTS = ("logits", "gate_bias", "z", "renormalize", "scale", "top_k", "num_experts", "expert_offset")


def route(b: Body, logits: str, gb: str, z: str, r: str, scale: str, k: str, e_local: str, offset: str) -> Pairs:
    """Steps `route` and `segment` in `b`: s = sigmoid(logits) [N, E], ids = TopK(s + gb) [N, k], w = s[ids]
    renormalised (`r` in {0, 1}: w / (r (Σw + 1e-20) + 1 - r), exactly the reference for either) and scaled;
    ids local (id - offset; another rank's expert -> the sentinel e_local, sorted last); the M = N·k pairs
    (pair p = token p // k, slot p % k) sorted by expert (TopK ascending), Unique's hit experts and counts."""
    s = b.op("Sigmoid", logits)
    _, ids = b.op("TopK", b.op("Add", s, gb), k, outputs=2, axis=-1, largest=1, sorted=1)  # [N, k]
    w = b.op("GatherElements", s, ids, axis=-1)  # unbiased scores of the chosen experts [N, k]
    local = b.op("Sub", ids, b.op("Cast", offset, to=INT64))
    here = b.op("And", b.op("GreaterOrEqual", local, b.op("Constant", value_int=0)), b.op("Less", local, e_local))
    ids = b.op("Where", here, local, e_local)
    one, tiny = b.op("Constant", value_float=1.0), b.op("Constant", value_float=1e-20)
    total = b.op("Add", b.op("ReduceSum", w, b.ints(-1), keepdims=1), tiny)
    w = b.op("Mul", b.op("Div", w, b.op("Add", b.op("Mul", r, total), b.op("Sub", one, r))), scale)
    step, b.step = b.step, "segment"
    flat = b.ints(-1)
    pair_ids, pair_w = b.op("Reshape", ids, flat), b.op("Reshape", w, flat)  # [M]
    sorted_ids, order = b.op("TopK", pair_ids, b.op("Shape", pair_ids), outputs=2, axis=0, largest=0, sorted=1)
    rows = b.op("Div", order, k)  # [M], expert-sorted
    experts, _, inverse, counts = b.op("Unique", sorted_ids, outputs=4, sorted=1)  # hit experts, ascending
    starts = b.op("Sub", b.op("CumSum", counts, b.ints(0)), counts)
    hit = b.op("ReduceSum", b.op("Cast", b.op("Less", experts, e_local), to=INT64), keepdims=0)  # local hits
    b.step = step
    return Pairs(z, k, e_local, pair_ids, pair_w, order, sorted_ids, rows, experts, counts, inverse, starts, hit)


def dispatch_function(opset_version: int, experts: int) -> onnx.FunctionProto:
    """The MoEDispatch body for `experts` local experts: `route`, then each expert's rows of z (one Split of
    the sorted row indices by the segment sizes, a Gather per expert) and each pair's weight and row of Y."""
    b = Body(MOE_DISPATCH, "route")
    p = route(b, *DISPATCH_INPUTS)
    b.step = "rows"
    first = b.ints(0)
    # bounds[e]: sorted pairs with id < e, e = 0..E (the sentinel E_local sorts after every local id)
    ids = b.op("Unsqueeze", p.sorted_ids, b.ints(1))  # [M, 1]
    bounds = b.op("ReduceSum", b.op("Cast", b.op("Less", ids, b.ints(*range(experts + 1))), to=INT64), first,
                  keepdims=0)  # [E + 1]
    ends = b.op("Concat", b.op("Slice", bounds, b.ints(1), b.ints(experts + 1)),
                b.op("Unsqueeze", b.op("Size", p.sorted_ids), first), axis=0)
    rows = b.op("Split", p.rows, b.op("Sub", ends, bounds), outputs=experts + 1, axis=0)  # experts', sentinels'
    for e in range(experts):
        b.out("Gather", [p.z, rows[e]], [f"x_{e}"], axis=0)
    w, by_pair = pair_rows(b, p, sorted_slots(b, p))
    shape = b.op("Concat", b.ints(-1), p.k, axis=0)
    b.out("Reshape", [w, shape], ["pair_w"])
    b.out("Reshape", [by_pair, shape], ["pair_row"])
    return helper.make_function(FUSED_DOMAIN, MOE_DISPATCH, list(DISPATCH_INPUTS),
                                ["pair_w", "pair_row", *(f"x_{e}" for e in range(experts))], b.nodes,
                                [helper.make_opsetid("", opset_version)], doc_string="k3::MoE routing (k3x)")


def combine_function(opset_version: int, experts: int) -> onnx.FunctionProto:
    """The MoECombine body: Y = [0; y_0; ...] (one Concat), then `weighted_sum`."""
    b = Body(MOE_COMBINE, "combine")
    ys = [f"y_{e}" for e in range(experts)]
    width = b.op("Slice", b.op("Shape", ys[0]), b.ints(1), b.ints(2))
    y = b.op("Concat", b.op("ConstantOfShape", b.op("Concat", b.ints(1), width, axis=0)), *ys, axis=0)
    k = b.op("Slice", b.op("Shape", "pair_w"), b.ints(1), b.ints(2))
    flat = b.ints(-1)
    b.out("Identity", [weighted_sum(b, y, b.op("Reshape", "pair_w", flat), b.op("Reshape", "pair_row", flat), k,
                                    width)], ["u"])
    return helper.make_function(FUSED_DOMAIN, MOE_COMBINE, ["pair_w", "pair_row", *ys], ["u"], b.nodes,
                                [helper.make_opsetid("", opset_version)], doc_string="k3::MoE combine (k3x)")


def dispatched_experts(b: Body, inputs: tuple[str, ...], experts: int, glu: Glu,
                       glu_all: Callable[[Body, list[str]], list[str]] | None = None) -> str:
    """u [N, L] fp32 in the MoE body: MoEDispatch on `inputs` (DISPATCH_INPUTS' values in `b`), each expert's
    Gemms against Gather(w, e) at the constant e (ONNX Runtime folds those into per-expert constants at load,
    drops the then unused stacked weights, and prepacks them) and its GLU on its own rows, MoECombine.
    `glu_all` (every expert's [a | u] -> its GLU, one call): w1 and w3 stacked into one [2I, L] weight per
    expert, one Gemm each for a and u; else two Gemms and `glu` per expert."""
    pair_w, pair_row, *xs = b.op(MOE_DISPATCH, *inputs, outputs=2 + experts, domain=FUSED_DOMAIN)

    def gemm(x: str, w: str, e: int) -> str:
        return b.op("Gemm", x, b.op("Gather", w, b.op("Constant", value_int=e), axis=0), transB=1)
    if glu_all is None:
        hs = [glu(b, gemm(x, "w1", e), gemm(x, "w3", e)) for e, x in enumerate(xs)]
    else:
        w13 = b.op("Concat", "w1", "w3", axis=1)  # [E, 2I, L]: initializers, folded at load
        hs = glu_all(b, [gemm(x, w13, e) for e, x in enumerate(xs)])
    ys = [gemm(h, "w2", e) for e, h in enumerate(hs)]
    return b.op(MOE_COMBINE, pair_w, pair_row, *ys, domain=FUSED_DOMAIN)
