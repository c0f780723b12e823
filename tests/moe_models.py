"""One k3::MoE node as an `ort` flavor model (its function bodies attached by exporter/onnx_flavors.py
`ort_pass`), with random weights and tokens: the MoE body tests (tests/exporter/test_onnx_moe_body.py) run it
on ONNX Runtime's own ops, the kernel tests (tests/runtime/test_ort_kernels.py) on the k3x kernels."""

from __future__ import annotations

import onnx
import onnx_ir as ir
import torch
from onnx import TensorProto, helper

from k3x.exporter.onnx_flavors import ort_pass
from k3x.plan import onnx_node

ONNX_TYPE = {torch.float32: TensorProto.FLOAT, torch.bfloat16: TensorProto.BFLOAT16}


def initializer(name: str, t: torch.Tensor) -> onnx.TensorProto:
    raw = t.contiguous().view(torch.int16 if t.dtype == torch.bfloat16 else t.dtype).numpy().tobytes()
    return helper.make_tensor(name, ONNX_TYPE[t.dtype], list(t.shape), raw, raw=True)


def weights(E: int, d: int, L: int, I: int, dtype=torch.float32, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"gate_weight": torch.randn(E, d, generator=g) * 0.3, "gate_bias": torch.randn(E, generator=g) * 0.1,
            "w1": (torch.randn(E, I, L, generator=g) * 0.3).to(dtype),
            "w3": (torch.randn(E, I, L, generator=g) * 0.3).to(dtype),
            "w2": (torch.randn(E, L, I, generator=g) * 0.3).to(dtype)}


def tokens(N: int, d: int, L: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(N, d, generator=g), torch.randn(N, L, generator=g)


def moe_model(w: dict[str, torch.Tensor], top_k: int, activation: str = "situ", renormalize: bool = True,
              factor: float = 1.0, offset: int | None = None) -> onnx.ModelProto:
    """x [N, d], z [N, L] fp32 inputs (N dynamic) -> u [N, L]; the weights (and expert_offset) initializers."""
    E, I, L = w["w1"].shape
    d = w["gate_weight"].shape[1]
    inits = [initializer(n, t) for n, t in w.items()]
    inits.append(helper.make_tensor("expert_offset", TensorProto.INT32, [1], [offset or 0]))
    node = helper.make_node(
        "MoE", ["x", "z", *w, "expert_offset"], ["u"], domain=onnx_node.DOMAIN, top_k=top_k, routed_scaling_factor=factor,
        renormalize=int(renormalize), activation=activation, situ_beta=4.0, situ_linear_beta=25.0,
        num_experts=E, hidden_size=d, expert_dim=L, intermediate_size=I, **onnx_node.COMMON_ATTRIBUTES)
    graph = helper.make_graph(
        [node], "moe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
         helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", L])],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, ["N", L])],
        initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                              ir_version=10)
    proto = ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(proto)))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def packed_weights(E: int, d: int, L: int, I: int, seed: int, E_all: int | None = None,
                   scales: tuple[int, int] = (118, 126)) -> dict[str, torch.Tensor]:
    """Random MXFP4 experts (every code, E8M0 bytes in `scales`) for k3::MoEMXFP4, a router over E_all (>= E)."""
    g = torch.Generator().manual_seed(seed)
    u8 = lambda *s: torch.randint(0, 256, s, generator=g, dtype=torch.uint8)  # noqa: E731
    sc = lambda *s: torch.randint(*scales, s, generator=g, dtype=torch.uint8)  # noqa: E731
    E_all = E_all or E
    return {"gate_weight": torch.randn(E_all, d, generator=g) * d ** -0.5,
            "gate_bias": torch.randn(E_all, generator=g) * 0.1, "w1": u8(E, I, L // 2), "w3": u8(E, I, L // 2),
            "w2": u8(E, L, I // 2), "w1_scale": sc(E, I, L // 32), "w3_scale": sc(E, I, L // 32),
            "w2_scale": sc(E, L, I // 32)}


def mxfp4_model(w: dict[str, torch.Tensor], top_k: int, activations: str = "bf16", activation: str = "situ",
                factor: float = 1.5, offset: int = 0, body: bool = True) -> onnx.ModelProto:
    """One k3::MoEMXFP4 node (packed experts as uint8 initializers), x [N, d] and z [N, L] fp32 inputs -> u; with
    `body` its function body attached (the `ort` pass), else none (only a registered kernel can run it)."""
    E, I, half = w["w1"].shape
    d = w["gate_weight"].shape[1]
    inits = [helper.make_tensor(n, TensorProto.UINT8 if t.dtype == torch.uint8 else TensorProto.FLOAT,
                                list(t.shape), t.contiguous().numpy().tobytes(), raw=True) for n, t in w.items()]
    inits.append(helper.make_tensor("expert_offset", TensorProto.INT32, [1], [offset]))
    node = helper.make_node(
        "MoEMXFP4", ["x", "z", *w, "expert_offset"], ["u"], domain=onnx_node.DOMAIN, top_k=top_k,
        routed_scaling_factor=factor, renormalize=1, activation=activation, situ_beta=4.0, situ_linear_beta=25.0,
        num_experts=E, hidden_size=d, expert_dim=2 * half, intermediate_size=I, activations=activations,
        **onnx_node.COMMON_ATTRIBUTES)
    graph = helper.make_graph(
        [node], "moe_mxfp4", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", d]),
                              helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 2 * half])],
        [helper.make_tensor_value_info("u", TensorProto.FLOAT, ["N", 2 * half])], initializer=inits)
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                              ir_version=10)
    if not body:
        return proto
    proto = ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(proto)))
    onnx.checker.check_model(proto, full_check=True)
    return proto


def ambiguous_tokens(x, z, w: dict, k: int) -> torch.Tensor:
    """Tokens with a GLU output h (the down GEMM's input) within 1e-5 relative of an MXFP8 rounding boundary (an
    E4M3 midpoint, or a block amax at a power of two): two fp32 GEMM1 sums differing in their last bits (ORT's
    Gemm vs torch's matmul, MLAS's vectorised Tanh / Sigmoid, a few 1e-6 apart) may round such an h one E4M3 step
    apart — the one deviation an exact emulation cannot rule out. Every other token must meet the tolerance table."""
    from k3x.custom_ops.moe.reference import glu, route
    from k3x.custom_ops.moe_mxfp4.codec import dequantize
    from k3x.custom_ops.moe_mxfp4.mxfp8 import fake_quantize

    ids, _ = route(x, w["gate_weight"], w["gate_bias"], k, 1.5, True)
    zq = fake_quantize(z)
    out = torch.zeros(len(z), dtype=torch.bool)
    for t in range(len(z)):
        for e in ids[t].tolist():
            h = glu(zq[t] @ dequantize(w["w1"][e], w["w1_scale"][e]).t(),
                    zq[t] @ dequantize(w["w3"][e], w["w3_scale"][e]).t(), "situ", 4.0, 25.0)
            out[t] |= not torch.equal(fake_quantize(h * (1 + 1e-5)), fake_quantize(h * (1 - 1e-5)))
    return out
