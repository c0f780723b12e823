"""`k3::KDAPrep` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.kda_prep`, and the ONNX Runtime function body (standard ops, fp32). ONNX Runtime runs the node on
the C++ kernel (ort_kernel.cc) when the k3 kernel library is loaded, and on this body otherwise.

Body, the packed short conv by gathers: every input a step can read is one row of `ext` [B·(W-1) + N, C] (the
B pool rows' W-1 columns, then this step's N rows); tap i of row n reads row `BM + n - (W-1) + i` when its local
position t = n - start reaches back no further than the sequence's first row, else the sequence's state row
`seq·(W-1) + t + i`. One Gather, Mul and Add per tap, not one [N·W, C] window gather, Mul and ReduceSum
(k3-bench 128-token prefill 163.8 -> 158.9 ms). The pool rows' layout change [B, C, W-1] <-> [B, W-1, C] is a
MatMul with the (W-1)² identity (exact for finite values): ONNX Runtime fuses the Transpose into it, whose
packing ran it 2-3x faster than its Transpose with a 3-wide axis (k3-bench, 32 sequences decoding: 6.2 ->
2.1 ms of node time). Each row's sequence is an [N, B+1] comparison with cu_seqlens. The W taps, the head dims
and the gate's form are baked in from the model's KDAPrep nodes (one KDA config per model).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted
FIELDS = ("num_heads", "head_dim", "value_dim", "conv_kernel", "gate_lower_bound")


def translate(qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots, kernels: str,
              gate_lower_bound: float = 0.0):
    H, K = static(f.shape[1], "kda heads"), static(f.shape[2], "kda head_dim")
    C = static(qkv.shape[1], "kda conv channels")
    return opset().KDAPrep(qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots, num_heads=H,
                           head_dim=K, value_dim=(C - 2 * H * K) // H,
                           conv_kernel=static(conv_weight.shape[1], "kda conv kernel"),
                           gate_lower_bound=float(gate_lower_bound), _outputs=6, **COMMON_ATTRIBUTES)


def shared_fields(nodes: list) -> dict:
    """FIELDS of the model's KDAPrep nodes (onnx_ir), which must agree: the body bakes them in."""
    seen = {tuple(n.attributes[f].value for f in FIELDS) for n in nodes}
    if len(seen) != 1:
        raise ValueError(f"k3::KDAPrep nodes disagree on {FIELDS}: {sorted(seen)}; one KDA config per model")
    return dict(zip(FIELDS, seen.pop()))


def _const(b: Body, array: np.ndarray) -> str:
    return b.op("Constant", value=numpy_helper.from_array(array))


def _l2norm(b: Body, x: str, eps: str) -> str:
    return b.op("Div", x, b.op("Sqrt", b.op("Add", b.op("ReduceSumSquare", x, b.ints(-1), keepdims=1), eps)))


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """The ONNX Runtime body (see the module docstring) and the extra opsets it imports (none)."""
    a = shared_fields(nodes)
    H, K, V, W, lb = (a[f] for f in FIELDS)
    M, FLOAT, I64 = W - 1, TensorProto.FLOAT, TensorProto.INT64
    b = Body("KDAPrep", "rows")
    x = b.op("Cast", "qkv", to=FLOAT)  # [N, C]
    cu = b.op("Cast", "cu_seqlens", to=I64)  # [B+1]
    n = b.op("Range", _const(b, np.array(0, np.int64)), b.op("Squeeze", b.op("Shape", x, start=0, end=1)),
             _const(b, np.array(1, np.int64)))  # [N] row n
    seq = b.op("Sub", b.op("ReduceSum", b.op("Cast", b.op("GreaterOrEqual", b.op("Unsqueeze", n, b.ints(1)),
                                                            b.op("Unsqueeze", cu, b.ints(0))), to=I64),
                           b.ints(1), keepdims=0), _const(b, np.array(1, np.int64)))  # [N] row n's sequence
    t = b.op("Sub", n, b.op("Gather", cu, seq, axis=0))  # [N] local position
    bm = b.op("Mul", b.op("Shape", "slots"), _const(b, np.array([M], np.int64)))  # [1] B·(W-1)
    b.step = "conv"
    eye = _const(b, np.eye(M, dtype=np.float32))
    states = b.op("Gather", "conv_pool", "slots", axis=0)  # [B, C, M] fp32
    old = b.op("Flatten", b.op("MatMul", eye, b.op("Transpose", states, perm=[0, 2, 1])), axis=2)  # [B·M, C]
    ext = b.op("Concat", old, x, axis=0)  # [B·M + N, C]
    weight = b.op("Cast", "conv_weight", to=FLOAT)  # [C, W]
    y = None
    here, state_row = b.op("Add", bm, n), b.op("Add", b.op("Mul", seq, _const(b, np.array(M, np.int64))), t)
    for i in range(W):
        row = b.op("Where", b.op("GreaterOrEqual", t, _const(b, np.array(M - i, np.int64))),
                   b.op("Add", here, _const(b, np.array(i - M, np.int64))),
                   b.op("Add", state_row, _const(b, np.array(i, np.int64))))
        tap = b.op("Mul", b.op("Gather", ext, row, axis=0),
                   b.op("Gather", weight, _const(b, np.array(i, np.int64)), axis=1))  # [N, C]
        y = tap if y is None else b.op("Add", y, tap)
    b.step = "state"  # new_conv[b, :, j] = sequence b's input at local position len_b - M + j
    seqs = b.op("Range", _const(b, np.array(0, np.int64)), b.op("Squeeze", b.op("Shape", "slots")),
                _const(b, np.array(1, np.int64)))  # [B]
    start = b.op("Unsqueeze", b.op("Slice", cu, b.ints(0), b.ints(-1)), b.ints(1))  # [B, 1]
    length = b.op("Sub", b.op("Unsqueeze", b.op("Slice", cu, b.ints(1), b.ints(2 ** 62)), b.ints(1)), start)
    p = b.op("Add", b.op("Sub", length, _const(b, np.array(M, np.int64))), _const(b, np.arange(M, dtype=np.int64)))
    row = b.op("Where", b.op("GreaterOrEqual", p, _const(b, np.array(0, np.int64))),
               b.op("Add", b.op("Add", bm, start), p),
               b.op("Add", b.op("Add", b.op("Mul", b.op("Unsqueeze", seqs, b.ints(1)),
                                            _const(b, np.array(M, np.int64))), _const(b, np.array(M, np.int64))), p))
    new = b.op("Reshape", b.op("Gather", ext, row, axis=0), b.op("Concat", b.op("Shape", "slots"),
                                                                  b.ints(M, -1), axis=0))  # [B, M, C]
    b.out("MatMul", [b.op("Transpose", new, perm=[0, 2, 1]), eye], ["new_conv"])
    b.step = "heads"
    y = b.op("Mul", y, b.op("Sigmoid", y))  # SiLU
    q, k, v = b.op("Split", y, _const(b, np.array([H * K, H * K, H * V], np.int64)), axis=1, outputs=3)
    eps = _const(b, np.array(1e-6, np.float32))
    for name, z, d in (("q", q, K), ("k", k, K), ("v", v, V)):
        z = b.op("Reshape", z, b.ints(0, H, d))
        b.out("CastLike", [_l2norm(b, z, eps) if name != "v" else z, "qkv"], [name])
    b.step = "gate"
    fx = b.op("Add", b.op("Cast", "f", to=FLOAT), b.op("Reshape", "dt_bias", b.ints(H, K)))  # [N, H, K]
    decay = b.op("Unsqueeze", b.op("Exp", b.op("Slice", "A_log", b.ints(0), b.ints(H))), b.ints(1))  # [H, 1]
    if lb != 0.0:  # K3's safe gate lb·σ(e^A (f + dt_bias))
        b.out("Mul", [_const(b, np.array(lb, np.float32)), b.op("Sigmoid", b.op("Mul", decay, fx))], ["g"])
    else:  # Kimi Linear's −e^A·softplus(f + dt_bias)
        b.out("Neg", [b.op("Mul", decay, b.op("Softplus", fx))], ["g"])
    b.out("Sigmoid", [b.op("Cast", "b", to=FLOAT)], ["beta"])
    return b.function(NODE, {"": opset_version}), {}
