"""The expert-compute part of the `k3::MoE` ONNX Runtime body (custom_ops/moe/onnx.py `moe_function`).

Input: the M = N·top_k routed pairs sorted by local expert id (`Pairs`: the sentinel E_local of another
rank's experts sorts last). Output: u [N, L] fp32 = Σ_j w[n, j] · E_{ids[n, j]}(z[n]). Three ways, each
O(work actually routed); which one is fixed at export by the weights' dtype and the local expert count:

- per expert (onnx_dispatch.py `dispatched_experts`; fp32 stacked weights, at most UNROLL_MAX local
  experts, every call): one copy of the expert step per local expert e (the graph grows with E), each on
  exactly its own segment of the sorted pairs (no padding; an expert without pairs runs on zero rows), its
  weights a Gather of the stacked initializer at the constant e. ONNX Runtime folds those into per-expert
  constants at load and prepacks them for the Gemms; nothing else reads the stacked weights, so they are
  dropped (memory as before) and no call copies an expert's weights.
- padded (`padded_experts`; fp32, more local experts; an If with the loop, per call): every local expert's
  pairs in a [E, C, L] block, C = the largest expert's pair count (padding rows are zeros); three batched
  MatMuls read the stacked weights in place as the transposed operand (com.microsoft FusedMatMul transB:
  Z [E, C, L] @ w1ᵀ), so nothing copies or transposes them, nor the activations (the output comes out
  [E, C, L], rows as combined). Taken when the padding waste is bounded, E_local·C <= PADDED_WASTE ·
  M_local, and at least half the local experts are hit (the batch reads every expert's weights). At K3
  scale (896 experts, top-16) a decode step has E·C / M = 56: the loop; a balanced prefill is within 2x:
  padded. Neither batch takes bf16 weights (they would be cast whole) or MXFP4 ones (decoded whole):
  those keep the loop, one expert's fp32 weights at a time.
- loop (`looped_experts`): a Loop over the hit experts only, each expert's weights built by
  `expert_weights` (a Gather of one expert; MXFP4 decodes there), its outputs appended to a sequence, so no
  pass copies an [N, L] accumulator (the old ScatterND-add did: N·L per expert, 117 MB per pass at K3
  prefill of 8 K tokens); one ConcatFromSequence at the end ([1 + M_local, L], row 0 zeros).

`combine` then takes each pair's row back in (token, slot) order, weighs it and sums the top_k slots of each
token (in slot order; the reference adds experts in ascending id: equal within fp32 rounding).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import onnx
from onnx import TensorProto, helper

from ...plan.onnx_node import MS_DOMAIN, Body

FLOAT, INT64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
PADDED_WASTE = 2  # padded rows per routed row above which the loop is taken (K3 decode: 56)
UNROLL_MAX = 64  # local experts up to which each has its own copy of the step (`dispatched_experts`)

Glu = Callable[[Body, str, str], str]
ExpertWeights = Callable[[Body, str], dict[str, str]]
Quantize = Callable[[Body, str], str]  # rounds an expert-GEMM input (the MXFP4 sibling's MXFP8 activations)


@dataclass(frozen=True)
class Pairs:
    """Names in the function scope: z fp32 [N, L]; k [1]; e_local [1]; pair_ids [M] local ids (sentinel
    e_local), pair_w [M] in (token, slot) order; order [M] (sorted position -> pair), sorted_ids, rows [M]
    expert-sorted; experts, counts: Unique of sorted_ids; inverse [M]: each sorted pair's Unique index;
    starts [H]: each hit expert's first sorted position; hit: the local hit experts (scalar)."""

    z: str
    k: str
    e_local: str
    pair_ids: str
    pair_w: str
    order: str
    sorted_ids: str
    rows: str
    experts: str
    counts: str
    inverse: str
    starts: str
    hit: str


def _width(b: Body, p: Pairs) -> str:
    """[1]: L, the width of z's rows."""
    return b.op("Slice", b.op("Shape", p.z), b.ints(1), b.ints(2))


def _positions(b: Body, p: Pairs) -> str:
    """Each sorted pair's rank inside its expert's segment [M]."""
    arange = b.op("Range", b.op("Constant", value_int=0), b.op("Size", p.sorted_ids), b.op("Constant", value_int=1))
    return b.op("Sub", arange, b.op("Gather", p.starts, p.inverse, axis=0))


def _local_counts(b: Body, p: Pairs) -> tuple[str, str]:
    """(M_local: pairs routed to local experts, C: the largest local expert's pair count), scalars."""
    local = b.op("Cast", b.op("Less", p.experts, p.e_local), to=INT64)
    c = b.op("ReduceMax", b.op("Mul", p.counts, local), keepdims=0)
    m = b.op("ReduceSum", b.op("Cast", b.op("Less", p.sorted_ids, p.e_local), to=INT64), keepdims=0)
    return m, c


def use_padded(b: Body, p: Pairs) -> tuple[str, str]:
    """(the If condition, C): some local pair, padded rows E_local·C <= PADDED_WASTE·M_local (FLOPs), and
    at least half the local experts hit, 2·H >= E_local (the batch reads every expert's weights, the loop
    the H hit ones)."""
    m, c = _local_counts(b, p)
    e = b.op("Squeeze", p.e_local)
    flops = b.op("LessOrEqual", b.op("Mul", e, c), b.op("Mul", m, b.op("Constant", value_int=PADDED_WASTE)))
    bytes_read = b.op("GreaterOrEqual", b.op("Mul", p.hit, b.op("Constant", value_int=2)), e)
    return b.op("And", b.op("And", b.op("Greater", m, b.op("Constant", value_int=0)), flops), bytes_read), c


def padded_experts(name: str, p: Pairs, c: str, glu: Glu) -> onnx.GraphProto:
    """Branch: every local expert on its pairs padded to C rows, batched over experts -> (Y [E, C, L] as the
    last MatMul writes it (a Reshape as the branch's output would be copied into the If's output:
    `routed_experts` flattens it), each sorted pair's row of Y [E·C, L]; a sentinel pair's row is clamped to
    0, a real row, and weighted 0 in `combine`)."""
    b = Body(name, "padded")
    local = b.op("Less", p.sorted_ids, p.e_local)
    slot = b.op("Add", b.op("Mul", p.sorted_ids, c), _positions(b, p))  # [M]
    slot = b.op("Where", local, slot, b.op("Constant", value_int=0))
    m, _ = _local_counts(b, p)
    first = b.ints(0)
    m1 = b.op("Unsqueeze", m, first)
    e_rows = b.op("Mul", p.e_local, b.op("Unsqueeze", c, first))  # [1] = E·C
    width = _width(b, p)
    # source row of z per padded row, 0 = a zero row prepended to z (one int scatter, one row Gather)
    src = b.op("ScatterElements", b.op("ConstantOfShape", e_rows, value=helper.make_tensor("zero", INT64, [1], [0])),
               b.op("Slice", slot, first, m1), b.op("Add", b.op("Slice", p.rows, first, m1),
                                                    b.op("Constant", value_int=1)), axis=0)  # [E·C], unique slots
    z0 = b.op("Concat", b.op("ConstantOfShape", b.op("Concat", b.ints(1), width, axis=0)), p.z, axis=0)
    zp = b.op("Gather", z0, src, axis=0)  # [E·C, L]
    zp = b.op("Reshape", zp, b.op("Concat", p.e_local, b.op("Unsqueeze", c, first), width, axis=0))  # [E, C, L]
    g = glu(b, _times_t(b, zp, "w1"), _times_t(b, zp, "w3"))  # [E, C, I]
    return b.branch([_times_t(b, g, "w2"), slot])  # [E, C, L]


def _times_t(b: Body, x: str, w: str) -> str:
    """x [E, C, K] @ w[e]ᵀ per expert, w [E, O, K] read in place as the transposed operand -> [E, C, O]."""
    return b.op("FusedMatMul", x, w, domain=MS_DOMAIN, transB=1)


def sorted_slots(b: Body, p: Pairs) -> str:
    """[M]: sorted pair i's row of a Y that holds a zero row, then the local pairs in sorted order (i + 1);
    a sentinel pair's row is the zero row."""
    arange = b.op("Range", b.op("Constant", value_int=1), b.op("Add", b.op("Size", p.sorted_ids),
                                                                b.op("Constant", value_int=1)),
                  b.op("Constant", value_int=1))
    return b.op("Where", b.op("Less", p.sorted_ids, p.e_local), arange, b.op("Constant", value_int=0))


def _expert_loop_body(name: str, p: Pairs, ends: str, glu: Glu, expert_weights: ExpertWeights,
                      quantize: Quantize | None) -> onnx.GraphProto:
    """Iteration i: expert experts[i] on its segment [starts[i], ends[i]) of the sorted pairs, its
    unweighted outputs [n_e, L] appended to the carried sequence; `quantize(b, t)` (if given) rounds both
    GEMM inputs (its rows of z, the GLU output) first."""
    q = quantize or (lambda _, t: t)
    b = Body(name, "expert")
    i, cond, seq = "moe_expert_i", "moe_expert_cond", "moe_expert_seq"
    axis0 = b.ints(0)
    e = b.op("Gather", p.experts, i, axis=0)  # scalar expert id
    lo, hi = (b.op("Unsqueeze", b.op("Gather", t, i, axis=0), axis0) for t in (p.starts, ends))
    ze = q(b, b.op("Gather", p.z, b.op("Slice", p.rows, lo, hi, axis0), axis=0))  # [n_e, L]
    W = expert_weights(b, e)  # fp32 [I, L], [I, L], [L, I]
    h = q(b, glu(b, b.op("Gemm", ze, W["w1"], transB=1), b.op("Gemm", ze, W["w3"], transB=1)))  # [n_e, I]
    b.out("SequenceInsert", [seq, b.op("Gemm", h, W["w2"], transB=1)], ["moe_expert_seq_out"])
    b.out("Identity", [cond], ["moe_expert_cond_out"])
    seq_type = helper.make_sequence_type_proto(helper.make_tensor_type_proto(FLOAT, None))
    return helper.make_graph(
        b.nodes, "moe_expert",
        [helper.make_tensor_value_info(i, INT64, []), helper.make_tensor_value_info(cond, BOOL, []),
         helper.make_value_info(seq, seq_type)],
        [helper.make_tensor_value_info("moe_expert_cond_out", BOOL, []),
         helper.make_value_info("moe_expert_seq_out", seq_type)])


def looped_experts(b: Body, p: Pairs, glu: Glu, expert_weights: ExpertWeights, quantize: Quantize | None = None
                   ) -> tuple[str, str]:
    """Loop over the hit experts -> (Y [1 + M_local, L]: a zero row, then the pairs' outputs in sorted
    order; each sorted pair's row of Y, sentinels on the zero row)."""
    ends = b.op("CumSum", p.counts, b.ints(0))
    zero = b.op("ConstantOfShape", b.op("Concat", b.ints(1), _width(b, p), axis=0))  # [1, L]
    seq = b.op("SequenceConstruct", zero)
    body = _expert_loop_body(b.name, p, ends, glu, expert_weights, quantize)
    y = b.op("ConcatFromSequence", b.op("Loop", p.hit, "", seq, body=body), axis=0)
    return y, sorted_slots(b, p)


def looped_branch(name: str, p: Pairs, glu: Glu, expert_weights: ExpertWeights) -> onnx.GraphProto:
    b = Body(name, "loop")
    return b.branch(list(looped_experts(b, p, glu, expert_weights)))


def pair_rows(b: Body, p: Pairs, slots: str) -> tuple[str, str]:
    """([M] weights, [M] rows of Y), both in (token, slot) order: pair j takes row slots[sorted position of j];
    a pair of another rank's expert weighs 0 (the mask is on the [M] weights, not the [M, L] rows: its row of
    Y is a real, finite one, the zero row or a padded expert output, so 0 · row = 0 exactly as a masked row)."""
    by_pair = b.op("ScatterElements", b.op("ConstantOfShape", b.op("Shape", slots), value=helper.make_tensor(
        "zero", INT64, [1], [0])), p.order, slots, axis=0)  # [M] in (token, slot) order
    w = b.op("Where", b.op("Less", p.pair_ids, p.e_local), p.pair_w, b.op("Constant", value_float=0.0))  # [M]
    return w, by_pair


def weighted_sum(b: Body, y: str, w: str, rows: str, k: str, width: str) -> str:
    """u [N, L]: each token's k pair rows of Y (`rows` [M]) weighted (`w` [M]) and summed ([1, k] @ [k, L] per
    token, one batched MatMul: half the time of a Mul and a ReduceSum over the [M, L] rows)."""
    w = b.op("Reshape", w, b.op("Concat", b.ints(-1, 1), k, axis=0))  # [N, 1, k]
    shape = b.op("Concat", b.ints(-1), k, width, axis=0)
    picked = b.op("Reshape", b.op("Gather", y, rows, axis=0), shape)  # [N, k, L]
    return b.op("Squeeze", b.op("MatMul", w, picked), b.ints(1))  # weighted sum of a token's k rows: one MatMul


def combine(b: Body, p: Pairs, y: str, slots: str) -> str:
    """u [N, L] fp32 from Y and each sorted pair's row of it (`pair_rows`, `weighted_sum`)."""
    return weighted_sum(b, y, *pair_rows(b, p, slots), p.k, _width(b, p))


def routed_experts(b: Body, p: Pairs, glu: Glu, expert_weights: ExpertWeights, batched: bool,
                   quantize: Quantize | None = None) -> str:
    """u [N, L] fp32 of the routed pairs. fp32 stacked weights w1/w3/w2 (`batched`): an If between the padded
    batch (on the waste rule) and the loop. Other weights: the loop. `quantize` (MXFP8 activations, MXFP4
    experts only) runs in the loop; the batch never takes it. (Up to UNROLL_MAX fp32 experts the body takes
    onnx_dispatch.dispatched_experts instead.)"""
    if batched and quantize is not None:
        raise ValueError("MXFP8 activations run in the expert loop only (MXFP4 experts), not the batches")
    if not batched:
        return combine(b, p, *looped_experts(b, p, glu, expert_weights, quantize))
    cond, c = use_padded(b, p)
    y, slots = b.op("If", cond, outputs=2, then_branch=padded_experts(b.name, p, c, glu),
                    else_branch=looped_branch(b.name, p, glu, expert_weights))
    y = b.op("Reshape", y, b.op("Concat", b.ints(-1), _width(b, p), axis=0))  # [E·C or 1 + M, L]
    return combine(b, p, y, slots)
