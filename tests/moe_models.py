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
