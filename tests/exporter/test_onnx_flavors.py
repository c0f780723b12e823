"""Flavor passes: each `ort` function body, run by ONNX Runtime, equals the op's PyTorch reference; the
`trt` pass leaves bare plugin nodes with every plugin field.

Each case is a one-node model built by hand (so the body is tested without the exporter in the way).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.attn_res.reference import attn_res
from k3x.custom_ops.kda.reference import kda_recurrent, l2norm
from k3x.custom_ops.moe.reference import moe
from k3x.custom_ops.registry import families
from k3x.exporter.onnx_flavors import ort_pass, trt_pass
from k3x.plan import onnx_node
from tolerances import assert_close

NODE_SPECS = {f.onnx.NODE.op_type: f.onnx.NODE for f in families()}

ort = pytest.importorskip("onnxruntime")


def one_node_model(op_type: str, inputs: dict[str, torch.Tensor], outputs: dict[str, tuple], **attrs) -> ir.Model:
    node = helper.make_node(op_type, list(inputs), outputs, domain=onnx_node.DOMAIN, **attrs,
                            **onnx_node.COMMON_ATTRIBUTES)
    graph = helper.make_graph(
        [node], op_type,
        [helper.make_tensor_value_info(n, TensorProto.INT32 if t.dtype == torch.int32 else TensorProto.FLOAT,
                                       list(t.shape)) for n, t in inputs.items()],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, list(shape)) for n, shape in outputs.items()])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                              ir_version=10)
    return ir.serde.deserialize_model(proto)


def run_ort(model: ir.Model, inputs: dict[str, torch.Tensor], profile: str | None = None) -> list[np.ndarray]:
    """The `ort` flavor of `model` run on `inputs` (`profile`: a file prefix; the last run's session is
    `run_ort.session`, for its end_profiling())."""
    proto = ir.serde.serialize_model(ort_pass(model))
    onnx.checker.check_model(proto, full_check=True)
    so = ort.SessionOptions()
    if profile is not None:
        so.enable_profiling, so.profile_file_prefix = True, profile
    run_ort.session = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return run_ort.session.run(None, {n: t.numpy() for n, t in inputs.items()})


@pytest.mark.parametrize("B,T,H,K,V", [
    pytest.param(1, 1, 2, 8, 8, id="B1-T1-H2-K8-decode"),  # one decode step
    pytest.param(2, 9, 3, 16, 8, id="B2-T9-H3-K16-V8"),  # prefill, K != V
])
def test_kda_body_matches_reference(B, T, H, K, V):
    q, k = l2norm(torch.randn(B, T, H, K)), l2norm(torch.randn(B, T, H, K))
    inputs = {"q": q, "k": k, "v": torch.randn(B, T, H, V), "g": -5 * torch.sigmoid(torch.randn(B, T, H, K)),
              "beta": torch.sigmoid(torch.randn(B, T, H)), "initial_state": torch.randn(B, H, K, V)}
    scale = 0.3  # not K^-1/2: proves the attribute reaches LinearAttention
    outputs = {"o": (B, T, H, V), "final_state": (B, H, K, V)}
    model = one_node_model("KDA", inputs, outputs, scale=scale, num_heads=H, head_dim=K, value_dim=V,
                           gate_lower_bound=0.0)
    o, s = run_ort(model, inputs)
    *qkvgb, s0 = inputs.values()
    o_ref, s_ref = kda_recurrent(*qkvgb, scale=scale, initial_state=s0)
    assert_close(torch.from_numpy(o), o_ref, torch.float32, "o")
    assert_close(torch.from_numpy(s), s_ref, torch.float32, "final_state")


def attn_res_inputs(B: int, T: int, N: int, d: int) -> dict[str, torch.Tensor]:
    return {"prefix": torch.randn(B, T, d), "bank": torch.randn(B, T, N, d) * 3, "norm_weight": torch.randn(d),
            "proj_weight": torch.randn(d)}


@pytest.mark.parametrize("B,T,N", [(2, 5, 1), (2, 5, 3), (1, 1, 24)])
def test_attn_res_body_matches_reference(B, T, N):
    d = 16
    inputs = attn_res_inputs(B, T, N, d)
    (out,) = run_ort(one_node_model("AttnRes", inputs, {"out": (B, T, d)}, eps=1e-5, hidden_size=d), inputs)
    assert_close(torch.from_numpy(out), attn_res(*inputs.values(), 1e-5), torch.float32, "attn_res")


def test_attn_res_body_matmuls_are_2d_and_nothing_is_source_sized(tmp_path):
    """ORT's profile of the AttnRes body: its MatMuls take 2-D operands (a 1-D one is ORT's slow per-row path,
    ~30x at prefill) and no node writes a tensor the size of the sources (no concatenated V = [bank |
    prefix], no normalised keys, no weighted copy of V)."""
    T, N, d = 40, 3, 32
    inputs = attn_res_inputs(1, T, N, d)
    (out,) = run_ort(one_node_model("AttnRes", inputs, {"out": (1, T, d)}, eps=1e-5, hidden_size=d), inputs,
                     profile=str(tmp_path / "ort"))
    assert_close(torch.from_numpy(out), attn_res(*inputs.values(), 1e-5), torch.float32, "attn_res")
    nodes = [e for e in json.loads(Path(run_ort.session.end_profiling()).read_text())
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    matmuls = [e["args"]["input_type_shape"] for e in nodes if e["args"]["op_name"] == "MatMul"]
    assert len(matmuls) == 3 and all(len(next(iter(s.values()))) >= 2 for m in matmuls for s in m), matmuls
    big = sorted(e["args"]["op_name"] for e in nodes if int(e["args"]["output_size"]) >= 4 * T * (N + 1) * d)
    assert big == [], big


@pytest.mark.parametrize("activation,renormalize,factor", [
    pytest.param("situ", True, 1.0, id="situ-renorm"),  # K3
    pytest.param("silu", True, 2.446, id="silu-renorm-scaled"),  # Kimi Linear
    pytest.param("situ", False, 1.0, id="situ-no-renorm"),
])
def test_moe_body_matches_reference(activation, renormalize, factor):
    N, d, L, E, I, top_k = 11, 24, 16, 8, 12, 3
    inputs = {"x": torch.randn(N, d), "z": torch.randn(N, L), "gate_weight": torch.randn(E, d) * 0.3,
              "gate_bias": torch.randn(E) * 0.1, "w1": torch.randn(E, I, L) * 0.3, "w3": torch.randn(E, I, L) * 0.3,
              "w2": torch.randn(E, L, I) * 0.3}
    attrs = dict(top_k=top_k, routed_scaling_factor=factor, renormalize=int(renormalize), activation=activation,
                 situ_beta=4.0, situ_linear_beta=25.0, num_experts=E, hidden_size=d, expert_dim=L,
                 intermediate_size=I)
    ref = moe(*inputs.values(), top_k, factor, renormalize, activation, 4.0, 25.0)
    inputs["expert_offset"] = torch.zeros(1, dtype=torch.int32)  # one GPU: every expert is local
    (u,) = run_ort(one_node_model("MoE", inputs, {"u": (N, L)}, **attrs), inputs)
    assert_close(torch.from_numpy(u), ref, torch.float32, "moe")


def test_trt_pass_keeps_bare_plugin_nodes():
    inputs = {"prefix": torch.randn(2, 4), "bank": torch.randn(2, 1, 4), "norm_weight": torch.ones(4),
              "proj_weight": torch.ones(4)}
    model = ort_pass(one_node_model("AttnRes", inputs, {"out": (2, 4)}, eps=1e-5, hidden_size=4))
    assert model.functions  # the ort body is there ...
    trt_pass(model)
    assert not model.functions  # ... and the trt pass removes it
    node = next(iter(model.graph))
    assert node.attributes["plugin_namespace"].as_string() == "k3"
    assert [f for f, _ in NODE_SPECS["AttnRes"].fields] == [a for a in node.attributes if a != "plugin_namespace"]


def test_pass_rejects_a_node_without_its_plugin_fields():
    inputs = {"prefix": torch.randn(2, 4), "bank": torch.randn(2, 1, 4), "norm_weight": torch.ones(4),
              "proj_weight": torch.ones(4)}
    model = one_node_model("AttnRes", inputs, {"out": (2, 4)}, eps=1e-5)  # hidden_size missing
    with pytest.raises(ValueError, match="hidden_size"):
        trt_pass(model)
    with pytest.raises(ValueError, match="hidden_size"):
        ort_pass(model)


def test_schemas_registered_with_plugin_fields():
    for op_type, fields in ((t, s.fields) for t, s in NODE_SPECS.items()):
        s = onnx.defs.get_schema(op_type, 1, "k3")
        assert set(dict(fields)) | {"plugin_namespace"} == set(s.attributes)
