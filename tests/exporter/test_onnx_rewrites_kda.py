"""exporter/onnx_rewrites_kda.py: every KDA layer's short conv, SiLU and q/k L2 norm in the batch interface becomes
one k3x.fused::KDAShortConv call, in every trunk's export (fp32, bf16, int8) and both flavors; the rewritten graph
gives the outputs it gave before, bit for bit on the function bodies and within fp32 rounding on the kernel
library, for K3's gate and Kimi Linear's, growing and static caches; a chain whose intermediate is wanted
elsewhere is left as traced."""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from ort_steps import prefill_and_decode
from trunk_models import TRUNKS

ort = pytest.importorskip("onnxruntime")


def _calls(model: onnx.ModelProto, op_type: str) -> int:
    """How many `op_type` nodes the graph holds with its layer functions inlined (never looking into a k3x.fused
    body: the call is the node)."""
    bodies = {(f.domain, f.name): f for f in model.functions if f.domain == "k3x.layers"}

    def count(nodes) -> int:
        return sum((n.op_type == op_type) + (count(bodies[n.domain, n.op_type].node)
                                             if (n.domain, n.op_type) in bodies else 0) for n in nodes)

    return count(model.graph.node)


@pytest.mark.parametrize("trunk", TRUNKS)
def test_every_kda_layer_of_each_trunk_is_one_call(trunk_exports, trunk):
    from k3x.model import preset

    kda_layers = preset("k3-mini").layer_types.count("kda")
    files = sorted((trunk_exports / trunk).glob("model*.onnx"))
    assert files, trunk
    for f in files:  # model.onnx, and model.trt.onnx where the trunk has one: TensorRT keeps the call too
        model = onnx.load(f, load_external_data=False)
        assert _calls(model, "KDAShortConv") == kda_layers, f.name
        assert _calls(model, "Conv") == _calls(model, "DepthwiseConv1d") == 0, f.name
        assert ("k3x.fused", "KDAShortConv") in {(fn.domain, fn.name) for fn in model.functions}


CASES = {"k3-mini int8, growing cache": ("k3", "int8", None),
         "Kimi Linear's gate, fp32, static cache": ("kimi", "dense", 16)}


@functools.cache
def _plain(config: str, trunk: str, max_context: int | None) -> tuple[bytes, object, object]:
    """The batch interface converted without the rewrite (serialised, once per session), its config and cache."""
    import k3x.exporter.onnx as exporter
    from k3x.exporter.trace import trace
    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions, CacheOptions
    from k3x.model.trunk import convert_trunk

    cfg = preset("k3-mini")
    if config == "kimi":
        cfg = replace(cfg, kda=replace(cfg.kda, gate_lower_bound=None, full_rank_output_gate=False))
    cache = CacheOptions(max_context=max_context)
    model = build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=0)
    model = model if trunk == "dense" else convert_trunk(model, trunk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(exporter, "fuse_kda_short_conv", lambda m: 0)
        converted = exporter.to_onnx_ir(trace(model, cache=cache), cfg, cache=cache)
    return ir.serde.serialize_model(converted).SerializeToString(), cfg, cache


def _converted(case: str) -> tuple[ir.Model, object, object]:
    data, cfg, cache = _plain(*CASES[case])
    return ir.serde.deserialize_model(onnx.ModelProto.FromString(data)), cfg, cache


def _ort_file(model: ir.Model) -> bytes:
    from k3x.exporter.onnx_flavors import ort_pass

    return ir.serde.serialize_model(ort_pass(model)).SerializeToString()


@pytest.mark.parametrize("case", CASES)
def test_the_rewritten_graph_gives_the_outputs_it_gave_before(kernels, case):
    from k3x.exporter.onnx_rewrites_kda import fuse_kda_short_conv

    plain, cfg, cache = _converted(case)
    fused, _, _ = _converted(case)
    assert fuse_kda_short_conv(fused) == cfg.layer_types.count("kda")
    ops = {(n.domain, n.op_type) for n in fused.graph}
    assert ("k3x.fused", "KDAShortConv") in ops and ("", "Conv") not in ops and ("", "Sigmoid") in ops  # β's
    assert fuse_kda_short_conv(fused) == 0  # nothing left to fuse
    plain_file, fused_file = _ort_file(plain), _ort_file(fused)
    want = prefill_and_decode(plain_file, cfg, cache)
    for got, tight in ((prefill_and_decode(fused_file, cfg, cache), True),
                       (prefill_and_decode(fused_file, cfg, cache, kernels), False)):
        assert len(got) == len(want)
        for g, w in zip(got, want):
            if tight:  # the body is the traced ops: bit-identical
                assert g.dtype == w.dtype and (g == w).all()
            else:  # the kernel: the body's values within fp32 rounding
                np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-4)


def test_a_chain_whose_intermediate_is_wanted_elsewhere_is_left_alone():
    from k3x.exporter.onnx_rewrites_kda import fuse_kda_short_conv

    model, cfg, _ = _converted("k3-mini int8, growing cache")
    silu = next(n for n in model.graph if n.op_type == "Sigmoid" and n.inputs[0].producer().op_type == "Transpose"
                and n.inputs[0].producer().inputs[0].producer().op_type == "Conv")
    model.graph.outputs.append(silu.outputs[0])  # the first layer's gate, read out as well
    assert fuse_kda_short_conv(model) == cfg.layer_types.count("kda") - 1
    assert [n.op_type for n in model.graph].count("Conv") == 1
