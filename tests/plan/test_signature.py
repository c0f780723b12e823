"""One signature per op family makes every interface of it: the registered torch schema, the ONNX node spec and
the TensorRT plugin ports/fields/rules agree with the family's `SIGNATURE`, and a change to a signature shows
up in all of them (they are made from it, not written beside it)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3x.custom_ops.registry import FAMILIES, Family
from k3x.plan.onnx_node import AttrType, NodeSpec
from k3x.plan.signature import REQUIRED, TYPE_VARS, Attr, Signature, TensorPort
from k3x.plugins.core import PluginSpec


def parts(sig: Signature) -> tuple[str, NodeSpec, PluginSpec]:
    """What the family files make from `sig`: torch schema, ONNX node, plugin spec."""
    spec = PluginSpec.of(sig, dims=lambda s: {}, check=lambda s, a: None, plan=lambda d, t, a: None)
    return sig.torch_schema(), NodeSpec.of(sig), spec


@pytest.mark.parametrize("name", FAMILIES)
def test_every_interface_is_the_signature(name):
    family = Family(name)
    sig = family.op.SIGNATURE
    assert sig.name == name and family.onnx.NODE.op_type == sig.node
    # torch: the registered op has exactly the generated schema
    assert str(family.overload._schema) == str(torch._C.parse_schema(f"{sig.qualname}{sig.torch_schema()}"))
    # ONNX: every tensor (optional ones too), type variables, the node attributes in order, the doc
    assert family.onnx.NODE == NodeSpec.of(sig)
    assert [n for n, _ in family.onnx.NODE.inputs] == [t.name for t in sig.inputs]
    if not family.gpu:  # registry.CPU_ONLY: no plugin
        return
    assert family.plugin.SPEC.name == sig.node
    # plugin: the same ports with their type variables' dtypes, the node attributes as fields, the rules
    spec = family.plugin.SPEC
    assert [(p.name, p.dtypes, p.same_as) for p in spec.ports] == \
        [(t.name, TYPE_VARS[t.var][0], t.same_as) for t in sig.inputs + sig.outputs]
    assert [(f.name, f.kind) for f in spec.fields] == [(a.name, a.field_kind) for a in sig.attrs if a.node]
    assert [f.name for f in spec.fields] == [n for n, _ in family.onnx.NODE.fields]
    assert spec.output_shapes == sig.output_shapes and spec.output_dtypes == sig.output_dtypes


def test_the_parameter_orders():
    """Torch: required tensors, op arguments, optional tensors; ONNX/plugin: all tensors, node attributes."""
    moe = Family("moe").op.SIGNATURE
    schema = moe.torch_schema()
    assert schema.startswith("(Tensor x, Tensor z,") and "SymInt top_k, float routed_scaling_factor, " \
        "bool renormalize, str activation" in schema and schema.endswith("str kernels, Tensor? expert_offset=None) -> Tensor")
    node = NodeSpec.of(moe)
    assert node.inputs[-1] == ("expert_offset", "O") and ("renormalize", AttrType.INT) in node.fields
    assert "kernels" not in [n for n, _ in node.fields] and "num_experts" not in schema
    kda = Family("kda").op.SIGNATURE
    assert kda.torch_schema().endswith("float gate_lower_bound=0.0) -> (Tensor, Tensor)")


@pytest.mark.parametrize("name", FAMILIES)
def test_changing_a_signature_changes_every_interface(name):
    sig = Family(name).op.SIGNATURE
    changed = replace(sig, inputs=sig.inputs + (TensorPort("probe", "F"),),
                      attrs=sig.attrs + (Attr("probe_n", int), Attr("probe_dim", int, op=False)))
    before, after = parts(sig), parts(changed)
    assert "Tensor probe, " in after[0] and "SymInt probe_n" in after[0] and "probe_dim" not in after[0]
    assert "probe" not in before[0]
    assert after[1].inputs[-1] == ("probe", "F") and after[1].fields[-2:] == (("probe_n", AttrType.INT),
                                                                            ("probe_dim", AttrType.INT))
    assert after[2].inputs[-1].name == "probe" and after[2].inputs[-1].dtypes == ("fp32",)
    assert [f.name for f in after[2].fields][-2:] == ["probe_n", "probe_dim"]
    assert len(after[2].fields) == len(before[2].fields) + 2


def test_moe_mxfp4_is_moe_with_packed_expert_ports():
    moe, mx = Family("moe").op.SIGNATURE, Family("moe_mxfp4").op.SIGNATURE
    assert mx.attrs == moe.attrs + (Attr("activations", str, "bf16"),)  # MXFP8 activations: a node field too
    assert mx.outputs == moe.outputs and mx.shapes is moe.shapes
    assert "str kernels, str activations='bf16', Tensor? expert_offset=None" in mx.torch_schema()
    assert mx.inputs[:4] == moe.inputs[:4] and mx.inputs[-1] == moe.inputs[-1]
    assert [(t.name, t.var) for t in mx.inputs[4:-1]] == [(n, "U") for n in
                                                          ("w1", "w3", "w2", "w1_scale", "w3_scale", "w2_scale")]


def test_output_rules():
    kda = Family("kda").op.SIGNATURE
    q, v = (2, 7, 3, 16), (2, 7, 3, 32)
    assert kda.output_shapes([q, q, v, q, (2, 7, 3), (2, 3, 16, 32)]) == [(2, 7, 3, 32), (2, 3, 16, 32)]
    assert kda.output_dtypes(["bf16", "bf16", "fp16", "fp32", "fp32", "fp32"]) == ["fp16", "fp32"]


@pytest.mark.parametrize("name", FAMILIES)
def test_fake_impl_is_the_shape_and_dtype_rule(name):
    """The generated fake impl: each output's shape from the shape rule, dtype from same_as / the fixed one."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from k3x.plan.dtypes import torch_dtype

    sig = Family(name).op.SIGNATURE
    shapes = {"kda": [(1, 5, 2, 16)] * 3 + [(1, 5, 2, 16), (1, 5, 2), (1, 2, 16, 16)],
              "kda_packed": [(5, 2, 16)] * 4 + [(5, 2), (4, 2, 16, 16), (3,), (2,)],
              "attn_res": [(1, 5, 32), (1, 5, 2, 32), (32,), (32,)],
              "moe": [(5, 32), (5, 16), (4, 32), (4,), (4, 8, 16), (4, 8, 16), (4, 16, 8), (1,)],
              "moe_mxfp4": [(5, 32), (5, 16), (4, 32), (4,), (4, 32, 8), (4, 32, 8), (4, 16, 16), (4, 32, 1),
                            (4, 32, 1), (4, 16, 1), (1,)],
              "mla_paged": [(5, 2, 16), (5, 2, 4), (5, 20), (3, 4, 20), (2, 2), (2,), (3,)],
              "kda_decode": [(3, 96), (3, 2, 16), (3, 2), (3, 2, 16), (96, 4), (2,), (32,), (16,), (5, 96, 3),
                             (5, 2, 16, 16), (3,)],
              "kda_prep": [(5, 96), (5, 2, 16), (5, 2), (96, 4), (2,), (32,), (6, 96, 3), (3,), (2,)],
              "linear_bf16": [(2, 5, 24), (40, 24)], "linear_q8": [(2, 5, 40), (6, 2, 32), (6, 2)]}[name]
    dtypes = ["fp16" if t.var in ("T", "W", "N", "G") else t.dtypes[0] for t in sig.inputs]
    values = {"kernels": "reference", "activation": "situ", "top_k": 2}
    with FakeTensorMode():
        tensors = {t.name: torch.empty(s, dtype=torch_dtype(d)) for t, s, d in zip(sig.inputs, shapes, dtypes)}
        args = [tensors[p.name] if isinstance(p, TensorPort) else values.get(p.name, p.kind(1))
                for p in sig.op_params()]
        out = getattr(torch.ops.k3, name)(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == sig.output_shapes(shapes)
    assert [o.dtype for o in outs] == [torch_dtype(d) for d in sig.output_dtypes(dtypes)]


def test_signature_refuses_inconsistent_declarations():
    t, o = TensorPort("x", "T"), TensorPort("y", "T", "x")
    ok = dict(name="p", node="P", inputs=(t,), outputs=(o,), attrs=(), shapes=lambda s: s, doc="")
    Signature(**ok)
    with pytest.raises(ValueError, match="used twice"):
        Signature(**ok | {"attrs": (Attr("x", int),)})
    with pytest.raises(ValueError, match="type variable 'Q'"):
        Signature(**ok | {"inputs": (TensorPort("x", "Q"),)})
    with pytest.raises(ValueError, match="same_as 'z'"):
        Signature(**ok | {"outputs": (TensorPort("y", "T", "z"),)})
    with pytest.raises(ValueError, match="output 'y' needs same_as"):
        Signature(**ok | {"outputs": (TensorPort("y", "T"),)})
    assert Attr("a", float).default is REQUIRED and Attr("b", bool).field_kind is int
