"""`k3::MoEMXFP4` in ONNX: the node spec (= the TensorRT plugin's fields), the torch.onnx translation of
`torch.ops.k3.moe_mxfp4`, and the ONNX Runtime function body.

The experts travel packed (uint8 nibbles + uint8 E8M0 scales, the model's own tensors), so model.onnx holds
4.25 bits per expert weight. ONNX Runtime 1.31's CPU provider has no kernel for `DequantizeLinear` on
float4e2m1 and `Gather` rejects float4e2m1 tensors (docs/model.md §6), so the body decodes with plain ops:
the routing and the loop over hit experts are `custom_ops/moe/onnx.moe_function`'s; inside the loop, only
the current expert is decoded: Gather its bytes, split the nibbles (BitwiseAnd 15, BitShift right 4), look
the 16-value E2M1 table up with Gather, and multiply each block of 32 by 2^(byte − 127) (Pow, exact for
every E8M0 byte). Transient memory is one expert's fp32 weights, as in the dense body.
"""

from __future__ import annotations

from onnx import TensorProto, helper

from ...plan.onnx_node import COMMON_ATTRIBUTES, Body, NodeSpec, opset, static
from ..moe.onnx import moe_function, offset_input
from .codec import BLOCK, E2M1
from .op import SIGNATURE, WEIGHTS

FLOAT, INT64, UINT8 = TensorProto.FLOAT, TensorProto.INT64, TensorProto.UINT8

NODE = NodeSpec.of(SIGNATURE)
NODE.register()


def translate(x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale, top_k: int,
              routed_scaling_factor: float, renormalize: bool, activation: str, situ_beta: float,
              situ_linear_beta: float, kernels: str, expert_offset=None):
    E, I, half = (static(d, "moe_mxfp4 expert weight dims") for d in w1.shape)
    return opset().MoEMXFP4(x, z, gate_weight, gate_bias, w1, w3, w2, w1_scale, w3_scale, w2_scale,
                            offset_input(expert_offset), top_k=int(top_k),
                            routed_scaling_factor=float(routed_scaling_factor), renormalize=int(bool(renormalize)),
                            activation=str(activation), situ_beta=float(situ_beta),
                            situ_linear_beta=float(situ_linear_beta), num_experts=E,
                            hidden_size=static(x.shape[-1], "moe_mxfp4 hidden_size"), expert_dim=2 * half,
                            intermediate_size=I, **COMMON_ATTRIBUTES)


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


def function(opset_version: int, nodes: list):
    """The dense MoE body (routing, sort by expert, Loop over hit experts) with each hit expert decoded from
    MXFP4 inside the loop (`decode`); needs opset >= 18 (BitwiseAnd)."""
    if opset_version < 18:
        raise ValueError(f"k3::MoEMXFP4 body needs ai.onnx opset >= 18 (BitwiseAnd), model has {opset_version}")
    return moe_function(NODE, opset_version, nodes, packed_weights)
