"""`k3::MoEMXFP4` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.moe_mxfp4`, and the ONNX Runtime function body.

The experts travel packed (uint8 nibbles + uint8 E8M0 scales, the model's own tensors), so model.onnx holds
4.25 bits per expert weight. ONNX Runtime 1.31's CPU provider has no kernel for `DequantizeLinear` on
float4e2m1 and `Gather` rejects float4e2m1 tensors (docs/model.md §6), so the body decodes with plain ops:
the routing and the loop over hit experts are `custom_ops/moe/onnx.moe_function`'s; inside the loop, only
the current expert is decoded: Gather its bytes, split the nibbles (BitwiseAnd 15, BitShift right 4), look
the 16-value E2M1 table up with Gather, and multiply each block of 32 by 2^(byte − 127) (Pow, exact for
every E8M0 byte). Transient memory is one expert's fp32 weights, as in the dense body.

MXFP8 activations (node attribute activations="mxfp8", shared by every node of a model and baked into the body):
inside the loop both GEMM inputs go through `mxfp8` — mxfp8.py's rule with standard ops: per block of 32 the
amax's exponent (Log / ln 2, Floor, then corrected by comparing with Pow(2, e) so it is exact), the scale
2^s = Pow(2, max(e − 8, −127)), each V / 2^s clamped to ±448, its binade's E4M3 spacing found the same way,
Round (half to even) on V / 2^s / spacing, and back; a block holding a NaN or an infinity becomes NaN.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from ..moe.onnx import moe_function, offset_input
from .codec import BLOCK, E2M1
from .mxfp8 import E4M3_MAX, EMAX, MANTISSA_BITS, MIN_NORMAL_EXP
from .op import SIGNATURE, WEIGHTS

FLOAT, INT64, UINT8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8
LN2 = 0.6931471805599453

NODE = NodeSpec.of(SIGNATURE)
NODE.register()


def translate(x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale, top_k: int,
              routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
              situ_linear_beta: float, kernels: str, activations: str = "bf16", expert_offset=None):
    E, I, half = (static(d, "moe_mxfp4 expert weight dims") for d in w1.shape)
    return opset().MoEMXFP4(x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                            offset_input(expert_offset), top_k=int(top_k),
                            routed_scaling_factor=float(routed_scaling_factor), renormalize=int(bool(renormalize)),
                            activation=str(activation), situ_beta=float(situ_beta),
                            situ_linear_beta=float(situ_linear_beta), num_experts=E,
                            hidden_size=static(x.shape[-1], "moe_mxfp4 hidden_size"), expert_dim=2 * half,
                            intermediate_size=I, activations=str(activations), **COMMON_ATTRIBUTES)


def decode(b: Body, packed: str, scale: str) -> str:
    """fp32 [out, in] from packed [out, in/2] u8 and scale [out, in/32] u8 (one expert), standard ops only."""
    lo = b.op("BitwiseAnd", packed, b.op("Constant", value=helper.make_tensor("nib", UINT8, [], [15])))
    hi = b.op("BitShift", packed, b.op("Constant", value=helper.make_tensor("four", UINT8, [], [4])),
              direction="RIGHT")
    codes = b.op("Concat", b.op("Unsqueeze", lo, b.ints(-1)), b.op("Unsqueeze", hi, b.ints(-1)), axis=-1)
    table = b.op("Constant", value=helper.make_tensor("e2m1", FLOAT, [16], list(E2M1)))
    vals = b.op("Gather", table, b.op("Cast", codes, to=INT64), axis=0)  # [out, in/2, 2], low nibble first
    blocks = b.op("Reshape", vals, b.ints(0, -1, BLOCK))  # [out, in/32, 32]
    exp = b.op("Sub", b.op("Cast", scale, to=FLOAT), b.op("Constant", value_float=127.0))
    s = b.op("Pow", b.op("Constant", value_float=2.0), exp)  # exact powers of two, 2^-127 included
    return b.op("Reshape", b.op("Mul", blocks, b.op("Unsqueeze", s, b.ints(-1))), b.ints(0, -1))  # [out, in]


def packed_weights(b: Body, e: str) -> dict[str, str]:
    """Expert `e`'s fp32 w1, w3 [I, L] and w2 [L, I], decoded from its packed bytes only."""
    return {n: decode(b, b.op("Gather", n, e, axis=0), b.op("Gather", f"{n}_scale", e, axis=0)) for n in WEIGHTS}


def _floor_log2(b: Body, a: str) -> str:
    """floor(log2(a)) as an exact fp32 integer for positive normal fp32 `a`: Floor(Log(a) / ln 2), then one
    step down if 2^e > a and one up if 2^(e+1) <= a (the Log estimate is off by at most one near powers of 2)."""
    two, one = b.op("Constant", value_float=2.0), b.op("Constant", value_float=1.0)
    e = b.op("Floor", b.op("Div", b.op("Log", a), b.op("Constant", value_float=LN2)))
    e = b.op("Sub", e, b.op("Cast", b.op("Greater", b.op("Pow", two, e), a), to=FLOAT))
    return b.op("Add", e, b.op("Cast", b.op("LessOrEqual", b.op("Pow", two, b.op("Add", e, one)), a), to=FLOAT))


def mxfp8(b: Body, x: str) -> str:
    """fp32 [n, K] (K % 32 == 0) rounded through MXFP8 and back (custom_ops/moe_mxfp4/mxfp8.py), standard ops."""
    c = lambda v: b.op("Constant", value_float=float(v))  # noqa: E731
    two, last = c(2.0), b.ints(-1)
    blocks = b.op("Reshape", x, b.ints(0, -1, BLOCK))  # [n, K/32, 32]
    bad = b.op("ReduceMax", b.op("Cast", b.op("Or", b.op("IsNaN", blocks), b.op("IsInf", blocks)), to=FLOAT), last,
               keepdims=1)  # [n, K/32, 1]: 1 where the block holds a NaN or an infinity
    amax = b.op("Max", b.op("ReduceMax", b.op("Abs", blocks), last, keepdims=1), c(2.0 ** -120))
    s = b.op("Max", b.op("Sub", _floor_log2(b, amax), c(EMAX)), c(-127))  # <= 119 for finite fp32
    y = b.op("Mul", blocks, b.op("Pow", two, b.op("Neg", s)))  # V / 2^s, exact
    y = b.op("Min", b.op("Max", y, c(-E4M3_MAX)), c(E4M3_MAX))  # saturate
    binade = _floor_log2(b, b.op("Max", b.op("Abs", y), c(2.0 ** MIN_NORMAL_EXP)))
    ulp = b.op("Pow", two, b.op("Sub", binade, c(MANTISSA_BITS)))  # E4M3 spacing of |y|'s binade
    p = b.op("Mul", b.op("Round", b.op("Div", y, ulp)), ulp)  # nearest, ties to even
    out = b.op("Where", b.op("Greater", bad, c(0.0)), c(float("nan")), b.op("Mul", p, b.op("Pow", two, s)))
    return b.op("Reshape", out, b.ints(0, -1))


def function(opset_version: int, nodes: list):
    """The dense MoE body (routing, sort by expert, Loop over hit experts) with each hit expert decoded from
    MXFP4 inside the loop (`decode`) and, with activations="mxfp8", both GEMM inputs rounded through MXFP8
    (`mxfp8`); needs opset >= 18 (BitwiseAnd)."""
    if opset_version < 18:
        raise ValueError(f"k3::MoEMXFP4 body needs ai.onnx opset >= 18 (BitwiseAnd), model has {opset_version}")
    formats = {n.attributes["activations"].as_string() if "activations" in n.attributes else "bf16" for n in nodes}
    if len(formats) != 1 or not formats <= {"bf16", "mxfp8"}:
        raise ValueError(f"k3::MoEMXFP4 nodes use activations {sorted(formats)}; the ort body bakes in one of "
                         "'bf16', 'mxfp8'")
    return moe_function(NODE, opset_version, nodes, packed_weights, mxfp8 if formats.pop() == "mxfp8" else None)
