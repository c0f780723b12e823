"""The k3x.fused::LinearQ8Group<P> and LinearBF16Group<P> CPU kernels (custom_ops/linear_q8/ and linear_bf16/
ort_kernel.cc): each output equals, bit for bit, what the single-projection kernel gives for its weight (the
same tasks, the same sums; x quantised once for the group), at decode rows (the GEMV, 1 to 4) and prefill rows
(the GEMM), with projections of awkward and empty widths, two to eight a call; the group's function body
(custom_ops/fused.py: the k3 calls) gives the same outputs as the single nodes' bodies; and errors name the bad
input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from ort_kernel_models import session

ort = pytest.importorskip("onnxruntime")

OPSET = 20


def _weights(op_type: str, widths: list[int], K: int, seed: int) -> list[list[np.ndarray]]:
    """Each projection's weight inputs: LinearQ8 [weight uint8 [N, KB, 32], scales [N, KB]], LinearBF16 [weight]."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in widths:
        w = torch.randn(n, K, generator=g) / K ** 0.5
        if op_type == "LinearQ8":
            from k3x.custom_ops.linear_q8.reference import quantize

            q, s = quantize(w, 32)
            out.append([q.numpy(), s.numpy()])
        else:
            out.append([w.to(torch.bfloat16)])
    return out


def _initializer(a, name: str):
    if isinstance(a, torch.Tensor):  # bf16: numpy has no bfloat16, so the tensor's raw bytes
        return helper.make_tensor(name, TensorProto.BFLOAT16, list(a.shape), a.view(torch.int16).numpy().tobytes(),
                                  raw=True)
    return numpy_helper.from_array(a, name)


def _attributes(op_type: str, weights: list, K: int) -> dict:
    return {"K": K, "N": weights[0].shape[0], "block_size": 32} if op_type == "LinearQ8" else {}


def model(op_type: str, weights: list[list], K: int, grouped: bool, body: bool = False):
    """x -> one output per projection: one group call (`grouped`) or one k3 node each; with `body`, the ort
    flavor's function bodies attached (the group's and the k3 op's), else none (only a kernel can run it)."""
    from k3x.custom_ops.fused import linear_group_function, linear_group_op

    inits, names = [], []
    for i, ws in enumerate(weights):
        names.append([f"w{i}_{j}" for j in range(len(ws))])
        inits += [_initializer(a, n) for a, n in zip(ws, names[-1])]
    outs = [f"y{i}" for i in range(len(weights))]
    calls = [_attributes(op_type, ws, K) for ws in weights]
    functions = []
    if grouped:
        refs = {"K": K, "block_size": 32} | {f"N_{i}": a["N"] for i, a in enumerate(calls)} if op_type == "LinearQ8" \
            else {}
        nodes = [helper.make_node(linear_group_op(op_type, len(weights)), ["x", *sum(names, [])], outs,
                                  domain="k3x.fused", **refs)]
        if body:
            functions.append(linear_group_function(op_type, len(weights), {}, {"": OPSET, "k3": 1}))
    else:
        nodes = [helper.make_node(op_type, ["x", *n], [y], domain="k3", **a) for n, y, a in zip(names, outs, calls)]
    imports = [helper.make_opsetid("", OPSET), helper.make_opsetid("k3", 1), helper.make_opsetid("k3x.fused", 1)]
    if body:
        module = __import__(f"k3x.custom_ops.{'linear_q8' if op_type == 'LinearQ8' else 'linear_bf16'}.onnx",
                            fromlist=["function"])
        proto, extra = module.function(OPSET, [])
        functions.append(proto)
        imports += [helper.make_opsetid(d, v) for d, v in extra.items()]
    graph = helper.make_graph(nodes, "group", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, None) for y in outs],
                              initializer=inits)
    return helper.make_model(graph, opset_imports=imports, ir_version=10, functions=functions)


OPS = ["LinearQ8", "LinearBF16"]


@pytest.mark.parametrize("op_type", OPS)
@pytest.mark.parametrize("rows", [(1,), (3,), (1, 4), (5,), (2, 37)])  # the GEMV (1-4 rows), the GEMM (more)
@pytest.mark.parametrize("widths,K", [([1024, 1024, 1024, 128, 8, 1024], 256),  # a KDA layer's six (K smaller)
                                       ([5, 100, 1, 70], 100),  # odd widths, K no multiple of the block
                                       ([17, 0, 33], 64),  # an empty projection
                                       ([3, 9, 2, 7, 1, 4, 6, 5], 40)])  # the most a call takes
def test_group_kernel_equals_the_single_kernels(kernels, op_type, rows, widths, K):
    weights = _weights(op_type, widths, K, seed=K + len(rows))
    x = torch.randn(*rows, K, generator=torch.Generator().manual_seed(sum(rows))).numpy()
    got = session(model(op_type, weights, K, grouped=True), kernels).run(None, {"x": x})
    want = session(model(op_type, weights, K, grouped=False), kernels).run(None, {"x": x})
    for g, w, n in zip(got, want, widths):
        assert g.shape == (*rows, n) and g.dtype == np.float32
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("op_type", OPS)
def test_group_body_equals_the_single_bodies(op_type):
    """Without the kernel library ONNX Runtime inlines the group to the k3 calls, and those to their bodies:
    the outputs the ungrouped nodes gave."""
    K, widths = 96, [64, 8, 40]
    weights = _weights(op_type, widths, K, seed=1)
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(2)).numpy()
    got = session(model(op_type, weights, K, grouped=True, body=True)).run(None, {"x": x})
    want = session(model(op_type, weights, K, grouped=False, body=True)).run(None, {"x": x})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_q8_group_kernel_names_the_bad_input(kernels):
    K = 64
    weights = _weights("LinearQ8", [16, 16], K, seed=3)
    weights[1] = [np.ascontiguousarray(weights[1][0].reshape(16, 4, 16)), weights[1][1].repeat(2, axis=1)]
    with pytest.raises(Exception, match=r"LinearQ8Group2: weight 1 \[16, 4, 16\] is blocked unlike weight 0"):
        session(model("LinearQ8", weights, K, grouped=True), kernels).run(None, {"x": np.ones((1, K), np.float32)})
    weights = _weights("LinearQ8", [16, 16], K, seed=3)
    with pytest.raises(Exception, match=r"LinearQ8Group2: x \[1, 32\], weight 0 \[16, 2, 32\] and scales 0"):
        session(model("LinearQ8", weights, K, grouped=True), kernels).run(None, {"x": np.ones((1, 32), np.float32)})


def test_bf16_group_kernel_names_the_bad_input(kernels):
    weights = _weights("LinearBF16", [16, 8], 64, seed=4)
    with pytest.raises(Exception, match=r"LinearBF16Group2: x \[2, 32\] and weight 0 \[16, 64\]"):
        session(model("LinearBF16", weights, 64, grouped=True), kernels).run(None, {"x": np.ones((2, 32), np.float32)})
