"""Flavor passes over an exported model with bare `k3::<Op>` nodes (each pass edits the onnx_ir model in place).

- `trt`: checks every k3 node carries all its plugin fields and `plugin_namespace`, that its family has a
  plugin (a CPU-only family's node is refused: registry.CPU_ONLY), and that no k3 function bodies are
  attached (TensorRT must resolve the nodes as plugins). Collective nodes of a rank program stay plugin
  nodes; in `ort` they become onnxruntime-extensions Python ops (onnx_collectives.py).
- `ort`: attaches one FunctionProto per k3 op type the model uses — the family's `onnx.function` body
  (custom_ops/<family>/onnx.py) — so ONNX Runtime inlines them and needs no extra library; and the body of
  every `k3x.fused` function those bodies call (custom_ops/fused.py; the k3::MoE body's SiTU-GLU, routing and
  combine); a depthwise conv left as a Conv at conversion (the batch interface's fp32 KDA conv is already
  inside a k3x.fused::KDAShortConv call, which both flavors keep: exporter/onnx_rewrites_kda.py) as a
  k3x.fused::DepthwiseConv1d call (onnx_rewrites.fuse_depthwise_conv), which the trt pass turns back into the
  Conv it was; and the CPU trunk's projections of one activation as one k3x.fused::LinearQ8Group /
  LinearBF16Group call (onnx_rewrites_linear.py; both passes first undo a previous ort pass's groups).
Neither pass names an op family: both go through the registry. Both must leave the model's own nodes as they
found them: a rank program's converted model goes through trt and ort once per rank (rewrites of those nodes
are made once, at conversion: exporter/onnx_rewrites.py).

Byte tensors (packed weights, scale bytes) feeding k3 nodes are UINT8 in the `ort` flavor and INT8 (the same
bytes) in the `trt` flavor: TensorRT plugins take no UINT8 formats and its ONNX parser widens UINT8
initializers to INT32 (4x the bytes). An external-data tensor is retyped in place (same file, offset, length).
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from ..custom_ops.fused import FUNCTIONS, FUSED_DOMAIN
from ..custom_ops.registry import by_onnx_op
from ..plan.onnx_node import COMMON_ATTRIBUTES, DOMAIN
from . import onnx_collectives
from .onnx_rewrites import fuse_depthwise_conv, unfuse_depthwise_conv
from .onnx_rewrites_linear import group_projections, ungroup_projections


def k3_nodes(model: ir.Model) -> list[ir.Node]:
    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph) if n.domain == DOMAIN]


def _check_attributes(nodes: list[ir.Node]) -> None:
    for n in nodes:
        try:
            spec = by_onnx_op(n.op_type).onnx.NODE
        except KeyError as e:
            raise ValueError(f"node {n.name!r}: {e.args[0]}") from None
        missing = [f for f, _ in spec.fields if f not in n.attributes] + \
                  [a for a in COMMON_ATTRIBUTES if a not in n.attributes]
        if missing:
            raise ValueError(f"node {n.name!r} (k3::{n.op_type}) lacks attribute(s) {missing}")


def retype_bytes(model: ir.Model, dtype: ir.DataType) -> None:
    """Every UINT8/INT8 initializer feeding a k3 node becomes `dtype`, bytes unchanged."""
    for v in {v for n in k3_nodes(model) for v in n.inputs if v is not None and v.const_value is not None}:
        t = v.const_value
        if t.dtype not in (ir.DataType.UINT8, ir.DataType.INT8) or t.dtype == dtype:
            continue
        if isinstance(t, ir.ExternalTensor):
            v.const_value = ir.ExternalTensor(t.location, t.offset, t.length, dtype, shape=t.shape, name=t.name,
                                              base_dir=t.base_dir)
        else:
            v.const_value = ir.Tensor(t.numpy().view(dtype.numpy()), dtype, name=t.name)
        v.dtype = dtype


def _check_plugins(nodes: list[ir.Node]) -> None:
    """Every k3 node has a TensorRT plugin: a CPU-only family's node (custom_ops/registry.CPU_ONLY) has none."""
    for n in nodes:
        family = by_onnx_op(n.op_type)
        if not family.gpu:
            raise ValueError(f"node {n.name!r} (k3::{n.op_type}): k3::{family.name} runs on ONNX Runtime's CPU "
                             "provider only and has no TensorRT plugin; export the ort flavor for it")


def trt_pass(model: ir.Model) -> ir.Model:
    """Bare plugin nodes: attributes complete, each with a plugin, no k3 function bodies, byte tensors INT8."""
    ungroup_projections(model)  # an ort pass's projection groups back to their k3 nodes (onnx_rewrites_linear.py)
    nodes = k3_nodes(model)
    _check_attributes(nodes)
    _check_plugins(nodes)
    retype_bytes(model, ir.DataType.INT8)
    unfuse_depthwise_conv(model)  # an ort pass's DepthwiseConv1d calls back to Conv (onnx_rewrites.py)
    onnx_collectives.trt_pass(model)
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    return model


def ort_pass(model: ir.Model) -> ir.Model:
    """Attach the ONNX Runtime function body of every k3 op type the model uses; byte tensors UINT8."""
    ungroup_projections(model)  # a previous ort pass's groups (a rank's model): the k3 nodes as converted
    nodes = k3_nodes(model)
    _check_attributes(nodes)
    retype_bytes(model, ir.DataType.UINT8)
    fuse_depthwise_conv(model)  # KDA's short conv as one k3x.fused call (exporter/onnx_rewrites.py)
    onnx_collectives.ort_pass(model)
    opset = model.opset_imports[""]
    if opset < 18:
        raise ValueError(f"ort flavor needs ai.onnx opset >= 18 (ReduceMean axes as input), model has {opset}")
    for op_type in sorted({n.op_type for n in nodes}):
        proto, opsets = by_onnx_op(op_type).onnx.function(opset, [n for n in nodes if n.op_type == op_type])
        fn = ir.serde.deserialize_function(proto)
        model.functions[fn.identifier()] = fn
        for domain, version in opsets.items():
            model.opset_imports[domain] = version
    called: dict[str, set[tuple[int, int]]] = {}  # op type -> the (input, output) counts of its calls
    for n in (n for f in model.functions.values() for n in f if n.domain == FUSED_DOMAIN):
        called.setdefault(n.op_type, set()).add((len(n.inputs), len(n.outputs)))
    for op_type, ports in sorted(called.items()):
        if len(ports) != 1:
            raise ValueError(f"{FUSED_DOMAIN}::{op_type} called with (inputs, outputs) {sorted(ports)}: one body "
                             "serves every call, so they must agree")
        fn = ir.serde.deserialize_function(FUNCTIONS[op_type](opset, ports.pop()))
        model.functions.setdefault(fn.identifier(), fn)
    group_projections(model)  # the CPU trunk's projections of one x as one call (onnx_rewrites_linear.py)
    return model


FLAVOR_PASSES: dict[str, Callable[[ir.Model], ir.Model]] = {"ort": ort_pass, "trt": trt_pass}
