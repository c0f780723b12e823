"""`k3::KDAPacked` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.kda_packed`, and the ONNX Runtime function body.

Body: pad each sequence to the step's longest, L rows, then k3::KDA's recurrence (com.microsoft::LinearAttention,
`kda.onnx.packed_inputs` and `recurrence`) over [B, L] from the pool rows Gather(state_pool, slots). Padding rows
sit after each sequence's last row with g = 0 and beta = 0: the delta rule leaves the state unchanged on them
(S·exp(0) + k·0), so final_state is exact, and their outputs are never gathered back. Why not an ONNX Loop over
the sequences: one fused LinearAttention call per step, and exact O(N) work for the common steps (decode only: L
= 1; one prefill: B = 1). Those have every sequence L rows (B·L = N): an If takes them to Reshapes of the
packed rows, no padding Gather in or out (the recurrence runs inside each branch). A step of decode rows
beside prompt chunks (continuous batching) runs two calls (`_split`): the one-row sequences as [Bd, 1], the
others padded to their own longest, so the decode rows are never padded to a chunk (k3-bench, 31 decode rows
and a 230-token chunk: the step 2.6-4.0 s -> 0.46-0.55 s with the same split in k3::MLAPaged). Any other step
pads every sequence to the longest. Unpacking finds each row's sequence by an [N, B] comparison. The pool is
only read (Gather of B rows), never copied whole, and not copied at all when the step holds every slot in order
(`_holds_every_slot`: LinearAttention reads the pool where it is; 16.7 MB a layer at 32 sequences on k3-bench).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, MS_DOMAIN, Body, NodeSpec, opset, static
from ..kda.onnx import packed_inputs, recurrence
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted


def translate(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale: float, kernels: str,
              gate_lower_bound: float = 0.0):
    return opset().KDAPacked(q, k, v, g, beta, state_pool, cu_seqlens, slots, scale=float(scale),
                             num_heads=static(q.shape[1], "kda heads"), head_dim=static(q.shape[2], "kda head_dim"),
                             value_dim=static(v.shape[2], "kda value_dim"), gate_lower_bound=float(gate_lower_bound),
                             _outputs=2, **COMMON_ATTRIBUTES)


def _scalar(b: Body, value: int) -> str:
    return b.op("Constant", value=helper.make_tensor("", TensorProto.INT64, [], [value]))


INPUTS = ("q", "k", "v", "g", "beta")


def _from_pool(b: Body, xs: list[str], full: str) -> list[str]:
    """The recurrence on xs [B, L, ...] from the step's pool rows -> [o [B, L, H*V], state]: an If on `full`
    (the step holds every slot in order) between LinearAttention reading the pool itself and one reading a
    Gather of its B rows. Each branch runs the recurrence: a branch returning the pool would copy it."""
    xs = packed_inputs(b, *xs)
    whole = Body("KDAPacked", "recurrence")
    then = whole.branch(list(recurrence(whole, *xs, "state_pool")), tag="_whole_pool")
    gathered = Body("KDAPacked", "pad")  # the pool's B rows, named as before: the `pad` step
    s0 = gathered.op("Gather", "state_pool", "slots", axis=0)  # [B, H, K, V] fp32
    other = gathered.branch(list(recurrence(gathered, *xs, s0)), tag="_gathered")
    return b.op("If", full, outputs=2, then_branch=then, else_branch=other)


def _holds_every_slot(b: Body) -> str:
    """Whether the step holds every slot of the pool in order (B = S, slots = 0..S-1): a full server
    decoding, or a runner that gives a consecutive-slot step its rows as the pool (runtime/step_outputs.py)."""
    n, s = (b.op("Squeeze", b.op("Shape", x, start=0, end=1)) for x in ("slots", "state_pool"))
    order = b.op("Equal", b.op("Cast", "slots", to=TensorProto.INT64), b.op("Range", _scalar(b, 0), n, _scalar(b, 1)))
    moved = b.op("ReduceSum", b.op("Cast", b.op("Not", order), to=TensorProto.INT64), keepdims=0)
    return b.op("And", b.op("Equal", n, s), b.op("Equal", moved, _scalar(b, 0)))


def _even(grid: str, full: str) -> onnx.GraphProto:
    """Branch, every sequence L rows (one prefill, decode rows only): the packed rows ARE the [B, L] grid, each
    input a Reshape (no copy, no padding to mask); o [B, L, H*V] as the recurrence writes it."""
    b = Body("KDAPacked", "even")
    xs = [b.op("Reshape", x, b.op("Concat", grid, b.op("Shape", x, start=1), axis=0)) for x in INPUTS]
    return b.branch(_from_pool(b, xs, full))


def _padded(b: Body, starts: str, lens: str, t: str) -> list[str]:
    """q, k, v, g, beta [B, L, ...] of the sequences starting at packed rows `starts` with `lens` rows, each
    padded to L rows (t [1, L] = 0..L-1) with g = 0 (no decay) and beta = 0 (no write)."""
    valid = b.op("Less", t, b.op("Unsqueeze", lens, b.ints(1)))  # [B, L]: a real row of sequence b
    rows = b.op("Where", valid, b.op("Add", b.op("Unsqueeze", starts, b.ints(1)), t), _scalar(b, 0))  # packed row
    q, k, v, g, beta = (b.op("Gather", x, rows, axis=0) for x in INPUTS)
    real = b.op("Cast", valid, to=TensorProto.FLOAT)
    return [q, k, v, b.op("Mul", g, b.op("Unsqueeze", real, b.ints(2, 3))),
            b.op("Mul", beta, b.op("Unsqueeze", real, b.ints(2)))]


def _row_sequences(b: Body, starts: str, ends: str) -> tuple[str, str]:
    """(seq [N]: each packed row's sequence, by an [N, B] comparison with the sequences' ends; local [N]: the
    row's index within its sequence)."""
    n = b.op("Range", _scalar(b, 0), b.op("Squeeze", b.op("Shape", "q", start=0, end=1)), _scalar(b, 1))  # [N]
    ended = b.op("GreaterOrEqual", b.op("Unsqueeze", n, b.ints(1)), b.op("Unsqueeze", ends, b.ints(0)))  # [N, B]
    seq = b.op("ReduceSum", b.op("Cast", ended, to=TensorProto.INT64), b.ints(1), keepdims=0)
    return seq, b.op("Sub", n, b.op("Gather", starts, seq, axis=0))


def _ragged(starts: str, ends: str, lens: str, t: str, L: str, full: str) -> onnx.GraphProto:
    """Branch, sequences of other lengths: each padded to L rows by a Gather of its packed rows, the padding
    rows with g = 0 (no decay) and beta = 0 (no write); o [N, H*V]: packed row n = row (its sequence, n - its
    start) of the padded output."""
    b = Body("KDAPacked", "ragged")
    o, state = _from_pool(b, _padded(b, starts, lens, t), full)  # o [B, L, H*V]
    b.step = "unpack"
    seq, local = _row_sequences(b, starts, ends)
    o = b.op("Gather", b.op("Flatten", o, axis=2), b.op("Add", b.op("Mul", seq, L), local), axis=0)  # [N, H*V]
    return b.branch([o, state])


def _split(starts: str, ends: str, lens: str) -> onnx.GraphProto:
    """Branch, one-row sequences (decode rows) beside longer ones (prompt chunks): two recurrences, the
    one-row sequences as [Bd, 1] (no padding) and the others padded to their own longest, Lp rows; o [N, H*V]
    and the states back in the step's order. Padding every sequence to the step's longest made a 230-token
    chunk beside 31 decode rows run 7,360 rows (k3-bench, ORT CPU: the step took 2.6-4.0 s)."""
    b = Body("KDAPacked", "split")
    zero, one_ = _scalar(b, 0), _scalar(b, 1)
    one = b.op("Equal", lens, one_)  # [B]: a one-row sequence
    D = b.op("Reshape", b.op("NonZero", one), b.ints(-1))  # [Bd] (in step order)
    P = b.op("Reshape", b.op("NonZero", b.op("Not", one)), b.ints(-1))  # [Bp]
    pool_d, pool_p = (b.op("Gather", "state_pool", b.op("Gather", "slots", x, axis=0), axis=0) for x in (D, P))
    xd = [b.op("Unsqueeze", b.op("Gather", x, b.op("Gather", starts, D, axis=0), axis=0), b.ints(1)) for x in INPUTS]
    sp, lp = (b.op("Gather", x, P, axis=0) for x in (starts, lens))
    Lp = b.op("ReduceMax", lp, keepdims=1)  # [1]
    t = b.op("Unsqueeze", b.op("Range", zero, b.op("Squeeze", Lp), one_), b.ints(0))  # [1, Lp]
    xp = _padded(b, sp, lp, t)  # [Bp, Lp, ...]
    od, sd = recurrence(b, *packed_inputs(b, *xd), pool_d)  # [Bd, 1, H*V]
    op, sp_state = recurrence(b, *packed_inputs(b, *xp), pool_p)  # [Bp, Lp, H*V]
    b.step = "unpack"
    hv = b.op("Shape", od, start=2)
    every = b.op("Concat", b.op("Reshape", od, b.op("Concat", b.ints(-1), hv, axis=0)),
                 b.op("Reshape", op, b.op("Concat", b.ints(-1), hv, axis=0)), axis=0)  # [Bd + Bp*Lp, H*V]
    bd = b.op("Shape", D)  # [1]
    pos_d, pos_p = (b.op("Sub", b.op("CumSum", b.op("Cast", m, to=TensorProto.INT64), zero), one_)
                    for m in (one, b.op("Not", one)))  # [B]: a sequence's index in its group
    seq, local = _row_sequences(b, starts, ends)
    padded = b.op("Add", bd, b.op("Add", b.op("Mul", b.op("Gather", pos_p, seq, axis=0), Lp), local))
    o = b.op("Gather", every, b.op("Where", b.op("Gather", one, seq, axis=0), b.op("Gather", pos_d, seq, axis=0),
                                   padded), axis=0)  # [N, H*V]
    state = b.op("Gather", b.op("Concat", sd, sp_state, axis=0), b.op("Where", one, pos_d, b.op("Add", bd, pos_p)),
                 axis=0)  # [B, H, K, V] in step order
    return b.branch([o, state])


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports. An If takes a step whose sequences all have
    the longest one's L rows (B·L = N: one prefill, or decode rows only) to Reshapes of the packed rows
    (in and out), one with one-row sequences beside longer ones to `_split`, any other to the padding Gathers.
    Each branch runs the recurrence itself and returns what it writes: a branch returning a Reshape of an
    input would copy it into the If's output."""
    b = Body("KDAPacked", "pad")
    cu = b.op("Cast", "cu_seqlens", to=TensorProto.INT64)
    starts = b.op("Slice", cu, b.ints(0), b.ints(-1))  # [B]
    ends = b.op("Slice", cu, b.ints(1), b.ints(2 ** 62))  # [B]
    lens = b.op("Sub", ends, starts)
    L = b.op("ReduceMax", lens, keepdims=1)  # [1]: the longest sequence of the step
    t = b.op("Unsqueeze", b.op("Range", _scalar(b, 0), b.op("Squeeze", L), _scalar(b, 1)), b.ints(0))  # [1, L]
    grid = b.op("Concat", b.op("Shape", lens), L, axis=0)  # [2] = (B, L)
    even = b.op("Equal", b.op("ReduceProd", grid, keepdims=0), b.op("Squeeze", b.op("Shape", "q", start=0, end=1)))
    full = _holds_every_slot(b)
    ones = b.op("ReduceSum", b.op("Cast", b.op("Equal", lens, _scalar(b, 1)), to=TensorProto.INT64), keepdims=0)
    mixed = b.op("And", b.op("And", b.op("Greater", ones, _scalar(b, 0)),  # decode rows beside longer sequences
                             b.op("Less", ones, b.op("Squeeze", b.op("Shape", lens)))),
                 b.op("Greater", b.op("ReduceMin", lens, keepdims=0), _scalar(b, 0)))  # (a row-less one: ragged)
    uneven = Body("KDAPacked", "uneven")
    uneven = uneven.branch(uneven.op("If", mixed, outputs=2, then_branch=_split(starts, ends, lens),
                                     else_branch=_ragged(starts, ends, lens, t, L, full)))
    o, state = b.op("If", even, outputs=2, then_branch=_even(grid, full), else_branch=uneven)  # [B, L, H*V] or [N, H*V]
    b.out("CastLike", [b.op("Reshape", o, b.op("Shape", "v")), "v"], ["o"])
    b.out("Identity", [state], ["final_state"])
    return b.function(NODE, {"": opset_version, MS_DOMAIN: 1}), {MS_DOMAIN: 1}
