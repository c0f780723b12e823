"""`k3::KDAPacked` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.kda_packed`, and the ONNX Runtime function body.

Body: pad each sequence to the step's longest, L rows, then k3::KDA's own body (com.microsoft::LinearAttention,
`kda.onnx.linear_attention`) over [B, L] from the pool rows Gather(state_pool, slots). Padding rows sit after
each sequence's last row with g = 0 and beta = 0: the delta rule leaves the state unchanged on them
(S·exp(0) + k·0), so final_state is exact, and their outputs are never gathered back. Why not an ONNX Loop
over the sequences: one fused LinearAttention call, no subgraph, and exact O(N) work for the common steps
(decode only: L = 1; one prefill: B = 1); the price is B·L rows when a long prefill shares a step with many
decode rows. Unpacking finds each row's sequence by an [N, B] comparison; the pool is only read
(Gather of B rows), never copied whole, and not copied at all when the step holds every slot in order
(`_holds_every_slot`: the recurrence reads the pool where it is; 16.7 MB a layer at 32 sequences on k3-bench).
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, MS_DOMAIN, Body, NodeSpec, opset, static
from ..kda.onnx import packed_inputs, recurrence_node
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


def _shared_attributes(nodes: list) -> tuple[int, float]:
    """(num_heads, scale) of the model's KDAPacked nodes, baked into the recurrence subgraphs: every node
    must share them."""
    seen = {(n.attributes["num_heads"].as_int(), n.attributes["scale"].as_float()) for n in nodes}
    if len(seen) != 1:
        raise ValueError(f"k3::KDAPacked nodes with (num_heads, scale) {sorted(seen)}: the ort body bakes in one")
    return seen.pop()


def _holds_every_slot(b: Body, zero: str, one: str) -> str:
    """Whether the step holds every slot of the pool in order (B = S, slots = 0..S-1): a full server
    decoding, or a runner that passes the consecutive slots' rows as the pool (runtime/step_outputs.py)."""
    n, s = (b.op("Squeeze", b.op("Shape", x, start=0, end=1)) for x in ("slots", "state_pool"))
    order = b.op("Equal", b.op("Cast", "slots", to=TensorProto.INT64), b.op("Range", zero, n, one))
    moved = b.op("ReduceSum", b.op("Cast", b.op("Not", order), to=TensorProto.INT64), keepdims=0)
    return b.op("And", b.op("Equal", n, s), b.op("Equal", moved, zero))


def _recurrence(name: str, inputs: tuple[str, ...], pool: str | None, heads: int, scale: float) -> onnx.GraphProto:
    """A branch running LinearAttention from `pool` itself (read where it is: the recurrence sits inside the
    branch, so If returns its outputs without copying a pool) or, `pool` None, from Gather(state_pool, slots)."""
    nodes, node = [], f"KDAPacked/recurrence/{{}}_{name}"  # named as the body's nodes: profiles attribute them
    if pool is None:
        pool = f"{name}_s0"
        nodes.append(helper.make_node("Gather", ["state_pool", "slots"], [pool], name=node.format("Gather"), axis=0))
    q, k, v, g, beta = inputs
    outs = [f"{name}_o", f"{name}_state"]
    nodes.append(recurrence_node([q, k, v, pool, g, beta], outs, node.format("LinearAttention"), heads, scale))
    return helper.make_graph(nodes, name, [], [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs])


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body and the extra opsets it imports."""
    b = Body("KDAPacked", "pad")
    cu = b.op("Cast", "cu_seqlens", to=TensorProto.INT64)
    starts = b.op("Slice", cu, b.ints(0), b.ints(-1))  # [B]
    ends = b.op("Slice", cu, b.ints(1), b.ints(2 ** 62))  # [B]
    lens = b.op("Sub", ends, starts)
    L = b.op("ReduceMax", lens, keepdims=1)  # [1]: the longest sequence of the step
    zero, one = _scalar(b, 0), _scalar(b, 1)
    t = b.op("Unsqueeze", b.op("Range", zero, b.op("Squeeze", L), one), b.ints(0))  # [1, L]
    valid = b.op("Less", t, b.op("Unsqueeze", lens, b.ints(1)))  # [B, L]: a real row of sequence b
    rows = b.op("Where", valid, b.op("Add", b.op("Unsqueeze", starts, b.ints(1)), t), zero)  # [B, L] packed row
    q, k, v, g, beta = (b.op("Gather", x, rows, axis=0) for x in ("q", "k", "v", "g", "beta"))  # [B, L, ...]
    real = b.op("Cast", valid, to=TensorProto.FLOAT)
    g = b.op("Mul", g, b.op("Unsqueeze", real, b.ints(2, 3)))  # padding: g = 0 (no decay) ...
    beta = b.op("Mul", beta, b.op("Unsqueeze", real, b.ints(2)))  # ... and beta = 0 (no write)
    heads, scale = _shared_attributes(nodes)
    inputs = packed_inputs(b, q, k, v, g, beta)
    b.step = "recurrence"
    o, state = b.op("If", _holds_every_slot(b, zero, one), outputs=2,  # o [B, L, H*V] fp32
                    then_branch=_recurrence("whole_pool", inputs, "state_pool", heads, scale),
                    else_branch=_recurrence("gathered", inputs, None, heads, scale))
    b.step = "unpack"
    n = b.op("Range", zero, b.op("Squeeze", b.op("Shape", "q", start=0, end=1)), one)  # [N]
    ended = b.op("GreaterOrEqual", b.op("Unsqueeze", n, b.ints(1)), b.op("Unsqueeze", ends, b.ints(0)))  # [N, B]
    seq = b.op("ReduceSum", b.op("Cast", ended, to=TensorProto.INT64), b.ints(1), keepdims=0)  # [N] row's sequence
    local = b.op("Sub", n, b.op("Gather", starts, seq, axis=0))
    flat = b.op("Add", b.op("Mul", seq, L), local)  # [N] row of o [B*L, H*V]
    o = b.op("Gather", b.op("Flatten", o, axis=2), flat, axis=0)  # [N, H*V]
    b.out("CastLike", [b.op("Reshape", o, b.op("Shape", "v")), "v"], ["o"])
    b.out("Identity", [state], ["final_state"])
    return b.function(NODE, {"": opset_version, MS_DOMAIN: 1}), {MS_DOMAIN: 1}
