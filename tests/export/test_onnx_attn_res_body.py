"""The `ort` body of k3::AttnRes (custom_ops/attn_res/onnx.py `function`): one AttnRes node through the ort pass
and ONNX Runtime equals custom_ops/attn_res/reference.py for decode rows, a prefill and a long bank, and ORT's
profile shows what it costs: MatMuls on 2-D operands only (a 1-D operand is ORT's slow per-row path), and no
node but V's Concat writes a tensor of the sources' size (no normalised keys, no weighted copy of V)."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import onnx_ir as ir
import pytest
import torch
from onnx import TensorProto, helper

from k3x.custom_ops.attn_res.reference import attn_res
from k3x.export.onnx_flavors import ort_pass
from k3x.plan import onnx_node
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")

D, EPS = 32, 1e-5


def session(profile: str | None = None):
    node = helper.make_node("AttnRes", ["prefix", "bank", "norm_weight", "proj_weight"], ["out"],
                            domain=onnx_node.DOMAIN, eps=EPS, hidden_size=D, **onnx_node.COMMON_ATTRIBUTES)
    f = TensorProto.FLOAT
    graph = helper.make_graph([node], "attn_res", [
        helper.make_tensor_value_info("prefix", f, [1, "T", D]), helper.make_tensor_value_info("bank", f, [1, "T", "N", D]),
        helper.make_tensor_value_info("norm_weight", f, [D]), helper.make_tensor_value_info("proj_weight", f, [D])],
        [helper.make_tensor_value_info("out", f, [1, "T", D])])
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid("k3", 1)],
                              ir_version=10)
    proto = ir.serde.serialize_model(ort_pass(ir.serde.deserialize_model(proto)))
    onnx.checker.check_model(proto, full_check=True)
    so = ort.SessionOptions()
    if profile is not None:
        so.enable_profiling, so.profile_file_prefix = True, profile
    return ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def case(T: int, N: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"prefix": torch.randn(1, T, D, generator=g) * 3, "bank": torch.randn(1, T, N, D, generator=g),
            "norm_weight": 1 + 0.1 * torch.randn(D, generator=g), "proj_weight": torch.randn(D, generator=g)}


def check(sess, x: dict[str, torch.Tensor], what: str) -> None:
    (out,) = sess.run(None, {k: v.numpy() for k, v in x.items()})
    assert_close(torch.from_numpy(out), attn_res(*x.values(), EPS), torch.float32, what)


def test_body_matches_reference_one_session():
    sess = session()
    for T, N in ((1, 1), (32, 3), (70, 2), (5, 24)):  # decode rows, a batch, a prefill, a long bank
        check(sess, case(T, N, seed=T + N), f"T={T} N={N}")


def test_body_matmuls_are_2d_and_nothing_but_v_is_source_sized(tmp_path):
    sess = session(str(tmp_path / "ort"))
    T, N = 40, 3
    check(sess, case(T, N, seed=1), "profiled")
    nodes = [e for e in json.loads(Path(sess.end_profiling()).read_text())
             if e.get("cat") == "Node" and e["name"].endswith("_kernel_time")]
    matmuls = [e["args"]["input_type_shape"] for e in nodes if e["args"]["op_name"] == "MatMul"]
    assert len(matmuls) == 2 and all(len(next(iter(s.values()))) >= 2 for m in matmuls for s in m), matmuls
    big = sorted(e["args"]["op_name"] for e in nodes if int(e["args"]["output_size"]) >= 4 * T * (N + 1) * D)
    assert big == ["Concat"], big
