"""`k3::MLAPaged` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.mla_paged`, and the ONNX Runtime function body in standard ops (fp32):

1. pad: sequence b's rows become a [Tmax] row of a [B, Tmax] grid (Tmax = the step's longest sequence; a
   short sequence repeats its last row, masked out of its keys and never read back);
2. past keys: the first MBp = ceil(max(past_lens) / BS) blocks of the block table gathered per sequence,
   [B, MBp*BS, L] -- only blocks holding past positions (a prefill reads none: MBp = 0), so nothing here
   grows with the pool, nor with this step's own rows;
3. scores over [past | step] (two MatMuls, no concatenated keys): past key j visible iff j < past_lens[b],
   step key s iff s <= t (additive 0 / -inf masks built on the index grids, [B, 1, 1, P] and [Tmax, Tmax],
   added to the scores: no Where over [B, H, Tmax, keys]); one Softmax over both; o = p_past @ past[:C] +
   p_step @ step[:C]. An If takes a step with no past (a prefill: P = 0) to one Softmax over the step's
   scores and one MatMul, without concatenating an empty past block and splitting it off again;
4. unpad: packed row n = grid cell (b, n - cu_seqlens[b]) with b = #{b' : cu_seqlens[b'+1] <= n}.
A step of one-row sequences (decode rows) beside longer ones (prompt chunks) runs 1-4 for each group on its
own (`_split`), so the decode rows are not padded to the chunk: on k3-bench, 31 decode rows beside a 230-token
chunk scored [32, H, 230, 530] a layer and the step took 2.6-4.0 s, 0.46-0.55 s split (with k3::KDAPacked's).
"""

from __future__ import annotations

import onnx

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted

FLOAT, INT64 = onnx.TensorProto.FLOAT, onnx.TensorProto.INT64


def translate(q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens, scale: float, kernels: str):
    return opset().MLAPaged(q_latent, q_rope, latent, latent_pool, block_table, past_lens, cu_seqlens,
                            scale=float(scale), num_heads=static(q_latent.shape[1], "mla_paged heads"),
                            kv_lora_rank=static(q_latent.shape[2], "mla_paged kv_lora_rank"),
                            rope_dim=static(q_rope.shape[2], "mla_paged rope_dim"),
                            block_size=static(latent_pool.shape[1], "mla_paged block_size"), **COMMON_ATTRIBUTES)


def _dim(b: Body, x: str, axis: int) -> str:
    """x's dim `axis` as an int64 scalar."""
    return b.op("Squeeze", b.op("Shape", x, start=axis, end=axis + 1), b.ints(0))


def _range(b: Body, n: str) -> str:
    return b.op("Range", b.op("Constant", value_int=0), n, b.op("Constant", value_int=1))


def _pad(b: Body, cu_seqlens: str) -> tuple[str, str, str, str]:
    """(grid [B, Tmax] of packed row ids, starts [B], t [Tmax] = 0..Tmax-1, Tmax) as int64."""
    cu = b.op("Cast", cu_seqlens, to=INT64)
    starts = b.op("Slice", cu, b.ints(0), b.ints(-1))
    lens = b.op("Sub", b.op("Slice", cu, b.ints(1), b.ints(2 ** 62)), starts)  # [B]
    tmax = b.op("ReduceMax", lens, keepdims=0)
    t = _range(b, tmax)
    last = b.op("Sub", b.op("Unsqueeze", lens, b.ints(1)), b.op("Constant", value_int=1))  # [B, 1]
    grid = b.op("Add", b.op("Unsqueeze", starts, b.ints(1)), b.op("Min", b.op("Unsqueeze", t, b.ints(0)), last))
    return grid, starts, t, tmax


def _row_sequences(b: Body, q_latent: str, cu: str) -> tuple[str, str]:
    """(n [N] = 0..N-1, seq [N]: each packed row's sequence, #{b : cu[b+1] <= n}) for int64 cu_seqlens `cu`."""
    n = _range(b, _dim(b, q_latent, 0))
    ends = b.op("Slice", cu, b.ints(1), b.ints(2 ** 62))
    before = b.op("LessOrEqual", b.op("Unsqueeze", ends, b.ints(0)), b.op("Unsqueeze", n, b.ints(1)))  # [N, B]
    return n, b.op("ReduceSum", b.op("Cast", before, to=INT64), b.ints(1), keepdims=0)


def _unpad(b: Body, o: str, starts: str, tmax: str, x: dict[str, str]) -> str:
    """o [B, H, Tmax, C] -> [N, H, C] in packed row order."""
    n, seq = _row_sequences(b, x["q_latent"], b.op("Cast", x["cu_seqlens"], to=INT64))
    cell = b.op("Add", b.op("Mul", seq, tmax), b.op("Sub", n, b.op("Gather", starts, seq)))
    rows = b.op("Reshape", b.op("Transpose", o, perm=[0, 2, 1, 3]),
                b.op("Concat", b.ints(-1), b.op("Shape", o, start=1, end=2), b.op("Shape", o, start=3), axis=0))
    return b.op("Gather", rows, cell)


def _past_blocks(b: Body, past_lens: str) -> str:
    """[1]: the blocks holding the step's past positions, ceil(max(past_lens) / BS): a prefill (no past) reads
    none, a decode step no block beyond its last past position (the table also covers this step's rows)."""
    most = b.op("ReduceMax", b.op("Cast", past_lens, to=INT64), keepdims=1)
    bs = b.op("Shape", "latent_pool", start=1, end=2)
    return b.op("Div", b.op("Add", most, b.op("Sub", bs, b.ints(1))), bs)


def _scores(b: Body, q: str, keys: str, mask: str, scale: str) -> str:
    """(q . keys) * scale + mask (0 / -inf, broadcast): the masked scores [B, H, Tmax, keys]."""
    return b.op("Add", b.op("Mul", b.op("MatMul", q, b.op("Transpose", keys, perm=[0, 1, 3, 2])), scale), mask)


def _mix(b: Body, p: str, keys: str, C: str) -> str:
    return b.op("MatMul", p, b.op("Slice", keys, b.ints(0), C, b.ints(-1)))


def _step_only(s_step: str, step: str, C: str, tag: str) -> onnx.GraphProto:
    """If branch, no sequence has a past (a prefill step): softmax over this step's keys only (no empty past
    block concatenated to the scores and split off again)."""
    b = Body("MLAPaged", "prefill" + tag)
    return b.branch([_mix(b, b.op("Softmax", s_step, axis=-1), step, C)])


def _past_and_step(q: str, past: str, seen: str, s_step: str, step: str, C: str, tmax: str,
                   scale: str, tag: str) -> onnx.GraphProto:
    """If branch, some past: one softmax over [past | step] scores, each part mixing its own keys, whole
    (C + R wide), the sum cut to C: the output [B, H, Tmax, C + R] is smaller than the past keys a cut before
    the mix would copy whenever H·Tmax < the past (every decode step; 2.4 MB a layer at 32 sequences and 64
    positions on k3-bench)."""
    b = Body("MLAPaged", "past" + tag)
    p = b.op("Softmax", b.op("Concat", _scores(b, q, past, seen, scale), s_step, axis=-1), axis=-1)
    p_past, p_step = b.op("Split", p, b.op("Concat", b.op("Shape", past, start=2, end=3),
                                            b.op("Unsqueeze", tmax, b.ints(0)), axis=0), axis=-1, outputs=2)
    o = b.op("Add", b.op("MatMul", p_past, past), b.op("MatMul", p_step, step))  # [B, H, Tmax, C + R]
    return b.branch([b.op("Slice", o, b.ints(0), C, b.ints(-1))])


def _attend(b: Body, x: dict[str, str], scale: str, tag: str = "") -> str:
    """Steps 1-4 over the sequences of `x` (the input names, or one group's: q_latent, q_rope, latent,
    block_table, past_lens, cu_seqlens) -> o [N, H, C] fp32 in their packed order. `tag` names the If
    branches apart when a body attends twice (`_split`)."""
    b.step = "pad"
    grid, starts, t, tmax = _pad(b, x["cu_seqlens"])
    q = b.op("Cast", b.op("Concat", x["q_latent"], x["q_rope"], axis=-1), to=FLOAT)  # [N, H, L]
    q = b.op("Transpose", b.op("Gather", q, grid), perm=[0, 2, 1, 3])  # [B, H, Tmax, L]
    step = b.op("Unsqueeze", b.op("Cast", b.op("Gather", x["latent"], grid), to=FLOAT), b.ints(1))  # [B, 1, Tmax, L]
    b.step = "gather"
    table = b.op("Slice", x["block_table"], b.ints(0), _past_blocks(b, x["past_lens"]), b.ints(1))  # [B, MBp]
    blocks = b.op("Gather", "latent_pool", table, axis=0)  # [B, MBp, BS, L]
    past = b.op("Reshape", blocks, b.op("Concat", b.ints(0, 1, -1), b.op("Shape", "latent_pool", start=2), axis=0))
    past = b.op("Cast", past, to=FLOAT)  # [B, 1, MB*BS, L]
    b.step = "scores"
    zero, ninf = b.op("Constant", value_float=0.0), b.op("Constant", value_float=float("-inf"))
    j = _range(b, _dim(b, past, 2))
    past_lens = b.op("Cast", x["past_lens"], to=INT64)
    seen = b.op("Less", b.op("Unsqueeze", j, b.ints(0)), b.op("Unsqueeze", past_lens, b.ints(1)))  # [B, P]
    seen = b.op("Where", b.op("Unsqueeze", seen, b.ints(1, 2)), zero, ninf)  # [B, 1, 1, P] additive mask
    causal = b.op("LessOrEqual", b.op("Unsqueeze", t, b.ints(0)), b.op("Unsqueeze", t, b.ints(1)))  # [t, s]
    causal = b.op("Where", causal, zero, ninf)  # [Tmax, Tmax] additive mask
    s_step = _scores(b, q, step, causal, scale)  # [B, H, Tmax, Tmax]
    C = b.op("Shape", x["q_latent"], start=2, end=3)
    no_past = b.op("Equal", _dim(b, past, 2), b.op("Constant", value_int=0))
    o = b.op("If", no_past, then_branch=_step_only(s_step, step, C, tag),
             else_branch=_past_and_step(q, past, seen, s_step, step, C, tmax, scale, tag))  # [B, H, Tmax, C]
    b.step = "unpad"
    return _unpad(b, o, starts, tmax, x)


def _lens(b: Body) -> tuple[str, str, str]:
    """(cu_seqlens as int64, each sequence's rows [B], whether it has one row [B])."""
    cu = b.op("Cast", "cu_seqlens", to=INT64)
    lens = b.op("Sub", b.op("Slice", cu, b.ints(1), b.ints(2 ** 62)), b.op("Slice", cu, b.ints(0), b.ints(-1)))
    return cu, lens, b.op("Equal", lens, b.op("Constant", value_int=1))


def _split(x: dict[str, str], scale: str) -> onnx.GraphProto:
    """If branch, one-row sequences (decode rows) beside longer ones (prompt chunks): each group attends on
    its own, so only the longer sequences are padded to their longest; o [N, H, C] back in packed order.
    Padding every sequence to the step's longest made a 230-token chunk beside 31 decode rows score
    [32, H, 230, 530] per layer (k3-bench, ORT CPU: the step took 2.6-4.0 s)."""
    b = Body("MLAPaged", "split")
    zero, one_ = b.op("Constant", value_int=0), b.op("Constant", value_int=1)
    cu, lens, one = _lens(b)  # from the inputs again: ORT rewrites an outer Cast's name badly in subgraphs
    _, seq = _row_sequences(b, x["q_latent"], cu)
    groups = []
    for tag, member in (("_one", one), ("_long", b.op("Not", one))):
        idx = b.op("Reshape", b.op("NonZero", member), b.ints(-1))  # [Bg]: the group's sequences in step order
        rows = b.op("Reshape", b.op("NonZero", b.op("Gather", member, seq)), b.ints(-1))  # [Ng]: their rows
        glens = b.op("Gather", lens, idx)
        gcu = b.op("Cast", b.op("Concat", b.ints(0), b.op("CumSum", glens, zero), axis=0), to=onnx.TensorProto.INT32)
        g = {"q_latent": b.op("Gather", x["q_latent"], rows), "q_rope": b.op("Gather", x["q_rope"], rows),
             "latent": b.op("Gather", x["latent"], rows), "block_table": b.op("Gather", x["block_table"], idx),
             "past_lens": b.op("Gather", x["past_lens"], idx), "cu_seqlens": gcu}
        groups.append((member, _attend(b, g, scale, tag)))
        b.step = "split"
    (one_mask, o_one), (long_mask, o_long) = groups
    # packed row n's row in [o_one | o_long]: its index among the rows of its group (+ the one-row count)
    in_one, in_long = (b.op("Sub", b.op("CumSum", b.op("Cast", b.op("Gather", m, seq), to=INT64), zero), one_)
                       for m in (one_mask, long_mask))
    ones = b.op("Squeeze", b.op("Shape", o_one, start=0, end=1), b.ints(0))
    where = b.op("Where", b.op("Gather", one_mask, seq), in_one, b.op("Add", in_long, ones))
    return b.branch([b.op("Gather", b.op("Concat", o_one, o_long, axis=0), where)])


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports (none). An If takes a step with one-row sequences
    beside longer ones to `_split` (each group attends on its own), any other step to one `_attend`."""
    b = Body("MLAPaged", "route")  # its own step names: the branches' bodies count their nodes from 0 again
    x = {n: n for n in ("q_latent", "q_rope", "latent", "block_table", "past_lens", "cu_seqlens")}
    scale = b.ref("scale", onnx.AttributeProto.FLOAT, "value_float")
    _, lens, one = _lens(b)  # one: [B] a one-row sequence
    ones = b.op("ReduceSum", b.op("Cast", one, to=INT64), keepdims=0)
    mixed = b.op("And", b.op("Greater", ones, b.op("Constant", value_int=0)),
                 b.op("Less", ones, _dim(b, lens, 0)))
    whole = Body("MLAPaged", "pad")
    whole = whole.branch([_attend(whole, x, scale)], tag="_whole")
    o = b.op("If", mixed, then_branch=_split(x, scale), else_branch=whole)  # [N, H, C]
    b.out("CastLike", [o, "q_latent"], ["o"])
    return b.function(NODE, {"": opset_version}), {}
