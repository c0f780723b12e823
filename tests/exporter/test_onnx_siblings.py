"""exporter/onnx_siblings.py: projections of one input run as one node in the ort flavor, with the unmerged
outputs (bf16: bit for bit; 8-bit: to fp32 rounding, MatMulNBits sums a column that shares a 16-wide tile with
its neighbours in another order), a Concat of consecutive pieces rejoined, other nodes left alone."""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from tiny_onnx import export_k3

from k3x.exporter import onnx_flavors
from k3x.model.trunk import BF16Linear, Q8Linear

K, WIDTHS = 72, (40, 40, 24, 7, 13)  # awkward sizes: K not a multiple of the 32-wide block, odd widths


class Projections(torch.nn.Module):
    """What a KDA layer does with its normed input: five projections of x (the first three concatenated), one
    projection of another tensor, which must stay its own node."""

    def __init__(self, make) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.proj = torch.nn.ModuleList(make(torch.randn(n, K, generator=g) / K ** 0.5) for n in WIDTHS)
        self.other = make(torch.randn(16, WIDTHS[3], generator=g))

    def forward(self, x):
        q, k, v, f, gate = (p(x) for p in self.proj)
        return torch.cat([q, k, v], dim=-1).sigmoid(), self.other(f), gate * 2.0


def sessions(make, merged: bool, monkeypatch, kernels=None) -> tuple[ir.Model, ort.InferenceSession]:
    if not merged:
        monkeypatch.setattr(onnx_flavors, "merge_siblings", lambda model: 0)
    model = export_k3(Projections(make).eval(), torch.randn(2, 3, K))
    flavor = onnx_flavors.ort_pass(model)
    monkeypatch.undo()
    so = ort.SessionOptions()
    if kernels is not None:
        so.register_custom_ops_library(str(kernels))
    proto = ir.serde.serialize_model(flavor)
    return flavor, ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])


def k3_ops(model: ir.Model, op_type: str) -> int:
    return sum(1 for n in model.graph if n.op_type == op_type and n.domain == "k3")


@pytest.mark.parametrize("make, op_type", [(Q8Linear, "LinearQ8"), (BF16Linear, "LinearBF16")])
def test_siblings_run_as_one_node_with_the_same_outputs(make, op_type, monkeypatch):
    x = torch.randn(3, 5, K).numpy()  # other batch and sequence sizes than the traced example
    plain, plain_sess = sessions(make, False, monkeypatch)
    merged, merged_sess = sessions(make, True, monkeypatch)
    assert (k3_ops(plain, op_type), k3_ops(merged, op_type)) == (6, 2)
    assert sum(n.op_type == "Concat" and n.domain == "" and not n.name.endswith(("rows_1", "rows_2"))
               for n in merged.graph) < sum(n.op_type == "Concat" for n in plain.graph)  # q | k | v rejoined
    want = plain_sess.run(None, {"x": x})
    got = merged_sess.run(None, {"x": x})
    assert [o.name for o in merged_sess.get_outputs()] == [o.name for o in plain_sess.get_outputs()]
    for a, b in zip(want, got):
        assert a.shape == b.shape
        if op_type == "LinearBF16":
            assert np.array_equal(a, b)
        else:
            np.testing.assert_allclose(b, a, rtol=2e-5, atol=2e-5)
    ref = Projections(make).eval()(torch.from_numpy(x))
    for r, b in zip(ref, got):
        torch.testing.assert_close(torch.from_numpy(b), r, atol=2e-2 if op_type == "LinearQ8" else 1e-5, rtol=0)


def test_the_bf16_kernel_runs_the_merged_node(kernels, monkeypatch):
    """The kernel library's LinearBF16 reads the folded, row-concatenated weight as the body does."""
    x = torch.randn(2, 4, K).numpy()
    _, body = sessions(BF16Linear, True, monkeypatch)
    _, kernel = sessions(BF16Linear, True, monkeypatch, kernels)
    for a, b in zip(body.run(None, {"x": x}), kernel.run(None, {"x": x})):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5)


def test_a_weight_that_is_no_initializer_is_left_alone(monkeypatch):
    """A weightless export's weights are graph inputs: nothing to concatenate at load, so no merge."""
    model = export_k3(Projections(Q8Linear).eval(), torch.randn(2, 3, K))
    for v in list(model.graph.initializers.values()):
        if v.name.endswith(("qweight", "scales")):
            model.graph.initializers.pop(v.name)
            model.graph.inputs.append(v)
    assert onnx_flavors.merge_siblings(model) == 0
    assert k3_ops(model, "LinearQ8") == 6
