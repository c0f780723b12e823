"""exporter/onnx_rewrites.py: the converted model's rsqrt products become Div, so ONNX Runtime fuses the model's
RMSNorm (model/layers.py) into one SimplifiedLayerNormalization kernel; the norm's result is unchanged, a
Reciprocal with another use survives, and an exported model holds no Reciprocal in either flavor. KDA's
sibling projections become one Gemm; the traced SiTU-GLU becomes one k3x.fused::SiTUGLU call with the
same outputs, and a chain whose intermediate is used elsewhere (or a SiLU-GLU) is left alone. A depthwise
Conv (KDA's short conv) becomes one k3x.fused::DepthwiseConv1d call with the same outputs and back; a grouped
Conv of another form is left alone. MLA's attention over the latent cache (growing or static) becomes one
k3x.fused::LatentAttention call reading the cache in place, with bit-identical outputs."""

from __future__ import annotations

import functools

import onnx
import onnx_ir as ir
import pytest
import torch

from k3x.exporter.onnx_rewrites import (fuse_depthwise_conv, fuse_latent_attention, fuse_situ_glu,
                                       merge_sibling_gemms, rsqrt_as_div, unfuse_depthwise_conv)
from k3x.model.config import preset
from k3x.model.layers import GatedMLP, RMSNorm
from tolerances import assert_close

ort = pytest.importorskip("onnxruntime")


@functools.cache
def _export() -> tuple[bytes, RMSNorm]:
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(48, generator=torch.Generator().manual_seed(0)))
    x = torch.randn(1, 5, 48)
    ep = torch.export.export(norm, (x,), dynamic_shapes={"x": {1: torch.export.Dim("T")}})
    model = torch.onnx.export(ep, dynamo=True, opset_version=20, verbose=False).model
    return ir.serde.serialize_model(model).SerializeToString(), norm


def exported_norm() -> tuple[ir.Model, RMSNorm]:
    """A fresh copy of the exported RMSNorm (one export per session), and the module."""
    data, norm = _export()
    return ir.serde.deserialize_model(onnx.load_from_string(data)), norm


def test_rms_norm_runs_as_one_fused_kernel_with_the_same_result(tmp_path):
    model, norm = exported_norm()
    assert "Reciprocal" in [n.op_type for n in model.graph]  # torch.onnx writes rsqrt as Sqrt + Reciprocal
    assert rsqrt_as_div(model) == 1
    proto = ir.serde.serialize_model(model)
    assert "Reciprocal" not in [n.op_type for n in proto.graph.node]
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    sess = ort.InferenceSession(proto.SerializeToString(), so, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node] == ["SimplifiedLayerNormalization"]
    x = torch.randn(1, 9, 48, generator=torch.Generator().manual_seed(1)) * 4
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        assert_close(torch.from_numpy(y), norm(x), torch.float32, "rms_norm")


def test_a_reciprocal_with_another_use_is_kept():
    model, _ = exported_norm()
    (rec,) = [n for n in model.graph if n.op_type == "Reciprocal"]
    model.graph.outputs.append(rec.outputs[0])  # the 1/rms itself is wanted too
    assert rsqrt_as_div(model) == 1
    assert [n.op_type for n in model.graph].count("Reciprocal") == 1
    assert "Div" in [n.op_type for n in model.graph]


class _QKV(torch.nn.Module):
    """KDA's projections as the serving step writes them: three Linears of one x, concatenated."""

    def __init__(self, spare_use: bool = False) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(2)
        self.q, self.k, self.v = (torch.nn.Linear(24, n, bias=False) for n in (16, 16, 8))
        with torch.no_grad():
            for m in (self.q, self.k, self.v):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g))
        self.spare_use = spare_use

    def forward(self, x):
        q = self.q(x)
        y = torch.cat([q, self.k(x), self.v(x)], dim=-1) + 1  # the conv reads it (not a graph output)
        return (y, q.sum(-1)) if self.spare_use else y


def _exported(module: torch.nn.Module) -> ir.Model:
    x = torch.randn(5, 24)
    ep = torch.export.export(module, (x,), dynamic_shapes={"x": {0: torch.export.Dim("N")}})
    return torch.onnx.export(ep, dynamo=True, opset_version=20, verbose=False).model


def test_sibling_projections_become_one_gemm_with_the_same_result():
    module = _QKV()
    model = _exported(module)
    assert [n.op_type for n in model.graph].count("Gemm") == 3
    weights = dict(model.graph.initializers)
    assert merge_sibling_gemms(model) == 1
    ops = [n.op_type for n in model.graph]
    assert ops.count("Gemm") == 1 and ops.count("Concat") == 1  # the weights' Concat, folded at load
    assert dict(model.graph.initializers) == weights  # no weight copied at export
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(3))
    (y,) = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})
    with torch.no_grad():
        assert_close(torch.from_numpy(y), module(x), torch.float32, "merged q|k|v")


def test_a_projection_with_another_use_is_not_merged():
    model = _exported(_QKV(spare_use=True))
    assert merge_sibling_gemms(model) == 0
    assert [n.op_type for n in model.graph].count("Gemm") == 3


class _Mlp(torch.nn.Module):
    """The dense FFN / shared experts (model/layers.py GatedMLP) of a config with `activation`; `spare_use`
    also returns the gate's sigmoid (a chain value read elsewhere)."""

    def __init__(self, activation: str = "situ", spare_use: bool = False) -> None:
        super().__init__()
        from dataclasses import replace

        self.mlp = GatedMLP(replace(preset("k3-mini"), activation=activation), 24, 40)
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for p in self.mlp.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 2)
        self.spare_use = spare_use

    def forward(self, x):
        y = self.mlp(x)
        return (y, torch.sigmoid(self.mlp.gate_proj(x))) if self.spare_use else y


def _run(model: ir.Model, x: torch.Tensor) -> list:
    sess = ort.InferenceSession(ir.serde.serialize_model(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x.numpy()})


def test_the_situ_glu_becomes_one_fused_call_with_the_same_outputs():
    module = _Mlp()
    model, plain = _exported(module), _exported(module)
    ops = [n.op_type for n in model.graph]
    assert ops.count("Tanh") == 2 and ops.count("Sigmoid") == 1
    assert fuse_situ_glu(model) == 1
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ("k3x.fused", "SiTUGLU") in ops and ("", "Tanh") not in ops and ("", "Sigmoid") not in ops
    assert model.opset_imports["k3x.fused"] == 1 and ("k3x.fused", "SiTUGLU", "") in model.functions
    call = next(n for n in model.graph if n.op_type == "SiTUGLU")
    assert [float(v.producer().attributes["value"].value.numpy()) for v in call.inputs[2:]] == [4.0, 25.0]
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(5)) * 3
    (y,), (want,) = _run(model, x), _run(plain, x)
    assert (y == want).all()  # the body is the traced ops on the same constants: bit-identical
    with torch.no_grad():
        assert_close(torch.from_numpy(y), module(x), torch.float32, "fused situ glu")
    assert fuse_situ_glu(model) == 0  # nothing left to fuse


@pytest.mark.parametrize("activation,spare_use", [("situ", True), ("silu", False)])
def test_a_chain_read_elsewhere_or_a_silu_glu_is_left_alone(activation, spare_use):
    model = _exported(_Mlp(activation, spare_use))
    before = [n.op_type for n in model.graph]
    assert before.count("Sigmoid") == 1  # with spare_use the exporter's CSE shares the chain's Sigmoid
    assert fuse_situ_glu(model) == 0
    assert [n.op_type for n in model.graph] == before and not model.functions


class _Conv(torch.nn.Module):
    """A depthwise conv over x [B, C, L] with a bias (KDA's short conv as the exporter hands it over: a Conv with a
    zero bias), or with `padding`; doubled, so the Conv is not the graph output (whose name a rewrite keeps)."""

    def __init__(self, C: int = 24, W: int = 4, padding: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(C)
        self.w = torch.nn.Parameter(torch.randn(C, 1, W, generator=g))
        self.b = torch.nn.Parameter(torch.randn(C, generator=g))
        self.padding = padding

    def forward(self, x):
        return 2 * torch.nn.functional.conv1d(x, self.w, self.b, groups=self.w.shape[0], padding=self.padding)


def _exported_conv(module: torch.nn.Module) -> ir.Model:
    x = torch.randn(2, 24, 7)
    ep = torch.export.export(module, (x,), dynamic_shapes={"x": {2: torch.export.Dim("L", min=5)}})
    return torch.onnx.export(ep, dynamo=True, opset_version=20, verbose=False).model


def test_the_depthwise_conv_becomes_one_fused_call_with_the_same_outputs_and_back():
    module = _Conv()
    model, plain = _exported_conv(module), _exported_conv(module)
    assert fuse_depthwise_conv(model) == 1
    ops = [(n.domain, n.op_type) for n in model.graph]
    assert ("k3x.fused", "DepthwiseConv1d") in ops and ("", "Conv") not in ops
    assert ("k3x.fused", "DepthwiseConv1d", "") in model.functions
    for L in (4, 9):  # a decode step's window (the export sees L >= 5: torch guards L - 3 != 1), a prefill's
        x = torch.randn(2, 24, L, generator=torch.Generator().manual_seed(L))
        (y,), (want,) = _run(model, x), _run(plain, x)
        assert (y == want).all()  # the body is the Conv itself
    assert fuse_depthwise_conv(model) == 0  # nothing left to fuse
    assert unfuse_depthwise_conv(model) == 1
    assert [(n.domain, n.op_type) for n in model.graph] == [(n.domain, n.op_type) for n in plain.graph]
    assert not model.functions
    # node for node as found, names and attributes included: a rank program's model passes through ort and trt
    # once per rank, and every rank's file must be the same graph
    nodes = [ir.serde.serialize_node(n).SerializeToString() for n in model.graph]
    assert nodes == [ir.serde.serialize_node(n).SerializeToString() for n in plain.graph]


def test_a_padded_conv_is_left_alone():
    model = _exported_conv(_Conv(padding=1))
    before = [n.op_type for n in model.graph]
    assert fuse_depthwise_conv(model) == 0 and [n.op_type for n in model.graph] == before


class _Attention(torch.nn.Module):
    """k3-mini's MLA (model/mla.py) over a growing latent cache, or a static one (`static`: past_length 2)."""

    def __init__(self, static: bool = False) -> None:
        super().__init__()
        from k3x.model.mla import GatedMLA

        torch.manual_seed(6)
        self.mla, self.static = GatedMLA(preset("k3-mini")).eval(), static
        with torch.no_grad():
            for p in self.mla.parameters():
                p.normal_(0, 0.3) if p.dim() > 1 else p.uniform_(0.5, 1.5)

    def forward(self, x, past):
        return self.mla(x, past, torch.tensor(2)) if self.static else self.mla(x, past)


def _exported_attention(module: _Attention) -> ir.Model:
    x, past = torch.randn(1, 3, module.mla.o_proj.out_features), torch.randn(1, 4 + 8 * module.static,
                                                                              module.mla.m.latent_dim)
    dims = {"x": {1: torch.export.Dim("T", max=64)},
            "past": {} if module.static else {1: torch.export.Dim("P", max=64)}}
    ep = torch.export.export(module, (x, past), dynamic_shapes=dims)
    return torch.onnx.export(ep, dynamo=True, opset_version=20, verbose=False).model


@pytest.mark.parametrize("static", [False, True])
def test_the_latent_attention_becomes_one_fused_call_with_the_same_outputs(static):
    module = _Attention(static)
    plain = _exported_attention(module)
    model = ir.serde.deserialize_model(ir.serde.serialize_model(plain))
    assert [n.op_type for n in model.graph].count("Softmax") == 1
    concats = [n.op_type for n in model.graph].count("Concat")
    assert fuse_latent_attention(model) == 1
    ops = [(n.domain, n.op_type) for n in model.graph]
    op_type = "LatentAttention" if static else "LatentAttentionAppend"
    assert ("k3x.fused", op_type) in ops and ("", "Softmax") not in ops and ("", "Where") not in ops
    assert [k for k in model.functions] == [("k3x.fused", op_type, "")]  # only the function called
    call = next(n for n in model.graph if n.op_type == op_type)
    if static:  # the cache, read in place
        assert call.inputs[1].producer().op_type == "ScatterElements"
        assert not any(n.op_type == "Slice" and n.inputs[0] is call.inputs[1] for n in model.graph)  # never copied
    else:  # the growing cache's Concat(past, latent) joined the call, which writes present, the graph's output
        assert call.inputs[1] is model.graph.inputs[1] and [n.op_type for n in model.graph].count("Concat") == \
            concats - 1
        assert call.outputs[1] is model.graph.outputs[1] and call.outputs[1].name == plain.graph.outputs[1].name
    sessions = [ort.InferenceSession(ir.serde.serialize_model(m).SerializeToString(),
                                     providers=["CPUExecutionProvider"]) for m in (model, plain)]
    for T, P in [(1, 4), (3, 4)] + [(1, 9), (5, 0)] * (not static):  # decode rows and prefill chunks
        g = torch.Generator().manual_seed(T * 10 + P)
        feeds = {"x": torch.randn(1, T, module.mla.o_proj.out_features, generator=g).numpy(),
                 "past": torch.randn(1, 12 if static else P, module.mla.m.latent_dim, generator=g).numpy()}
        (y, present), (want_y, want_present) = (s.run(None, feeds) for s in sessions)
        assert (y == want_y).all() and (present == want_present).all()  # the body is the traced ops: bit-identical
    assert fuse_latent_attention(model) == 0  # nothing left to fuse
