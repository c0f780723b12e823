"""One k3 or k3x.fused node with no function body beside it (so only a registered kernel can run it) and an
ONNX Runtime CPU session for it, for the kernel tests (tests/runtime/test_ort_kernels*.py)."""

from __future__ import annotations

import os

import pytest
from onnx import TensorProto, helper


def skip_without_ort_headers() -> None:
    """Skip a kernel test where ONNX Runtime's headers are not installed (the message says which package);
    never in CI (.ci/run installs them), where a kernel test skipped would hide a broken install."""
    from k3x.runtime.ort_kernels import headers
    from k3x.runtime.runners import RunnerError

    try:
        headers()
    except RunnerError as e:
        if os.environ.get("CI"):
            raise
        pytest.skip(str(e))


def session(model, library=None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    if library is not None:
        so.register_custom_ops_library(str(library))
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def bare(op_type: str, ins, outs, domain: str = "k3", **attrs):
    """One `domain::op_type` node and no function: only a registered kernel can run it (cu_seqlens, slots,
    block_table and past_lens int32, every other input and output fp32)."""
    types = dict.fromkeys(("cu_seqlens", "slots", "block_table", "past_lens"), TensorProto.INT32)
    node = helper.make_node(op_type, list(ins), list(outs), domain=domain, **attrs)
    graph = helper.make_graph([node], op_type, [helper.make_tensor_value_info(n, types.get(n, TensorProto.FLOAT), None)
                                                for n in ins],
                              [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in outs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20), helper.make_opsetid(domain, 1)],
                             ir_version=10)
