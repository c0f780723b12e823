"""exporter/onnx_rewrites_linear.py: in the ort flavor of a bf16 or int8 trunk export, the projections that read
one activation become one k3x.fused::LinearQ8Group / LinearBF16Group call (two a layer on k3-mini: the mixer's
and the FFN's); the grouped graph gives the outputs the ungrouped one gave, bit for bit on the function bodies
and on the kernel library (the group kernel's sums are the single kernel's); the trt pass and a second ort pass
(a rank program's) start from the nodes as converted; the dense trunk has nothing to group."""

from __future__ import annotations

import functools
from collections import Counter

import onnx
import onnx_ir as ir
import pytest

from ort_steps import prefill_and_decode

ort = pytest.importorskip("onnxruntime")

GROUP = {"int8": "LinearQ8Group", "bf16": "LinearBF16Group"}  # the op types' stem (the arity follows)
SINGLE = {"int8": "LinearQ8", "bf16": "LinearBF16"}


@functools.cache
def _converted_bytes(trunk: str) -> tuple[bytes, object]:
    """k3-mini with `trunk` converted by to_onnx_ir (serialised, once per session), and its config."""
    import k3x.exporter.onnx as exporter
    from k3x.exporter.trace import trace
    from k3x.model import build_model, preset
    from k3x.model.options import BuildOptions
    from k3x.model.trunk import convert_trunk

    cfg = preset("k3-mini")
    model = convert_trunk(build_model(cfg, BuildOptions(expert_format="mxfp4"), seed=0), trunk)
    converted = exporter.to_onnx_ir(trace(model), cfg)
    return ir.serde.serialize_model(converted).SerializeToString(), cfg


def _converted(trunk: str) -> tuple[ir.Model, object]:
    data, cfg = _converted_bytes(trunk)
    return ir.serde.deserialize_model(onnx.ModelProto.FromString(data)), cfg


def _projections(model: ir.Model, trunk: str) -> Counter:
    """(name, attributes) of every projection: a top-level k3 node, or one a group call stands for."""
    from k3x.exporter.onnx_rewrites_linear import GROUPED

    out = Counter()
    for n in model.graph:
        if n.domain == "k3" and n.op_type == SINGLE[trunk]:
            out[n.name, repr(sorted((k, a.value) for k, a in n.attributes.items()))] += 1
        elif n.op_type.startswith(GROUP[trunk]):
            out.update((name, repr(sorted(attrs.items()))) for name, _, attrs, _ in n.meta[GROUPED])
    return out


@pytest.mark.parametrize("trunk", ["int8", "bf16"])
def test_projections_of_one_activation_are_one_call(trunk):
    from k3x.exporter.onnx_flavors import ort_pass

    model, cfg = _converted(trunk)
    before = _projections(model, trunk)
    ort_pass(model)
    calls = [n for n in model.graph if n.op_type.startswith(GROUP[trunk])]
    assert len(calls) == 2 * cfg.num_layers  # the mixer's projections and the FFN's, every layer
    arity = Counter(len(c.outputs) for c in calls)
    kda, mla = cfg.layer_types.count("kda"), cfg.layer_types.count("mla")
    assert arity[6] == kda and arity[2] + arity[3] == cfg.num_layers + mla  # KDA 6; MLA, MoE 3; dense FFN 2
    singles = [n for n in model.graph if n.domain == "k3" and n.op_type == SINGLE[trunk]]
    assert len({id(n.inputs[0]) for n in singles}) == len(singles)  # no two left that read one x
    assert _projections(model, trunk) == before  # every projection kept, with its own attributes
    for c in calls:  # the call sits in its layer's scope (exporter/onnx_functions.py reads it) with its overload
        assert c.name.startswith("/model/layers.") and c.op_type == f"{GROUP[trunk]}{len(c.outputs)}"
        assert (c.domain, c.op_type, "") in model.functions


@pytest.mark.parametrize("trunk", ["int8", "bf16"])
def test_the_grouped_graph_gives_the_outputs_it_gave_before(kernels, trunk):
    import k3x.exporter.onnx_flavors as flavors

    grouped, cfg = _converted(trunk)
    plain, _ = _converted(trunk)
    flavors.ort_pass(grouped)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(flavors, "group_projections", lambda m: 0)
        flavors.ort_pass(plain)
    assert not any(n.op_type.startswith(GROUP[trunk]) for n in plain.graph)
    grouped_file = ir.serde.serialize_model(grouped).SerializeToString()
    plain_file = ir.serde.serialize_model(plain).SerializeToString()
    for library in (None, kernels):  # the bodies; the kernels (the group's sums are the single kernel's)
        got = prefill_and_decode(grouped_file, cfg, library=library)
        want = prefill_and_decode(plain_file, cfg, library=library)
        assert len(got) == len(want)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and (g == w).all()


def test_ungrouping_and_a_second_ort_pass_give_back_the_converted_nodes():
    from k3x.exporter.onnx_flavors import ort_pass
    from k3x.exporter.onnx_rewrites_linear import ungroup_projections

    model, _ = _converted("int8")
    nodes = Counter((n.domain, n.op_type, n.name) for n in model.graph)
    ort_pass(model)
    once = [(n.op_type, n.name) for n in model.graph]
    functions = set(model.functions)
    ort_pass(model)  # a rank program's next rank: ungrouped first, grouped again alike
    assert [(n.op_type, n.name) for n in model.graph] == once and set(model.functions) == functions
    assert ungroup_projections(model) == sum(op.startswith("LinearQ8Group") for op, _ in once)
    assert Counter((n.domain, n.op_type, n.name) for n in model.graph) == nodes
    assert not any(k[1].startswith("LinearQ8Group") for k in model.functions)


def test_a_call_read_back_from_a_file_is_ungrouped_from_its_body():
    """A group made in another process has no record of its nodes' names: its body's calls give the ops and
    attributes (the outputs unchanged)."""
    from k3x.exporter.onnx_flavors import ort_pass
    from k3x.exporter.onnx_rewrites_linear import ungroup_projections

    model, _ = _converted("bf16")
    ort_pass(model)
    read = ir.serde.deserialize_model(ir.serde.serialize_model(model))
    groups = [n for n in read.graph if n.op_type.startswith("LinearBF16Group")]
    singles = sum(n.op_type == "LinearBF16" for n in read.graph)
    assert ungroup_projections(read) == len(groups) > 0
    assert not any(n.op_type.startswith("LinearBF16Group") for n in read.graph)
    assert sum(n.op_type == "LinearBF16" for n in read.graph) == singles + sum(len(n.outputs) for n in groups)
    attributes = [sorted(a for _, a in _projections(m, "bf16").elements()) for m in (read, model)]
    assert attributes[0] == attributes[1]  # the same projections' attributes (named by the call now)


def test_the_dense_trunk_has_nothing_to_group():
    from k3x.exporter.onnx_rewrites_linear import group_projections

    model, _ = _converted("dense")
    assert group_projections(model) == 0


def test_an_int8_export_holds_the_groups_in_its_layer_functions(trunk_exports):
    """The file `k3x export --trunk int8` writes: each layer's function holds its two calls."""
    from k3x.model import preset

    model = onnx.load(trunk_exports / "int8" / "model.onnx", load_external_data=False)
    bodies = {(f.domain, f.name): f for f in model.functions if f.domain == "k3x.layers"}
    calls = sum(sum(n.op_type.startswith("LinearQ8Group") for n in bodies[n.domain, n.op_type].node)
                for n in model.graph.node if (n.domain, n.op_type) in bodies)
    assert calls == 2 * preset("k3-mini").num_layers
    assert {f.name for f in model.functions if f.domain == "k3x.fused"} >= {"LinearQ8Group6", "LinearQ8Group3"}
