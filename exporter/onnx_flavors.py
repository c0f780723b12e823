"""Flavor passes over an exported model with bare `k3::<Op>` nodes (each pass edits the onnx_ir model in place).

- `trt`: checks every k3 node carries all its plugin fields and `plugin_namespace`, and that no k3
  function bodies are attached (TensorRT must resolve the nodes as plugins).
- `ort`: attaches one FunctionProto per k3 op type the model uses — the family's `onnx.function` body
  (custom_ops/<family>/onnx.py) — so ONNX Runtime inlines them and needs no extra library.
Neither pass names an op family: both go through the registry.
"""

from __future__ import annotations

from typing import Callable

import onnx_ir as ir

from ..custom_ops.onnx_node import COMMON_ATTRIBUTES, DOMAIN
from ..custom_ops.registry import by_onnx_op


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


def trt_pass(model: ir.Model) -> ir.Model:
    """Bare plugin nodes: attributes complete, no k3 function bodies."""
    _check_attributes(k3_nodes(model))
    for key in [k for k in model.functions if k[0] == DOMAIN]:
        del model.functions[key]
    return model


def ort_pass(model: ir.Model) -> ir.Model:
    """Attach the ONNX Runtime function body of every k3 op type the model uses."""
    nodes = k3_nodes(model)
    _check_attributes(nodes)
    opset = model.opset_imports[""]
    if opset < 18:
        raise ValueError(f"ort flavor needs ai.onnx opset >= 18 (ReduceMean axes as input), model has {opset}")
    for op_type in sorted({n.op_type for n in nodes}):
        proto, opsets = by_onnx_op(op_type).onnx.function(opset, [n for n in nodes if n.op_type == op_type])
        fn = ir.serde.deserialize_function(proto)
        model.functions[fn.identifier()] = fn
        for domain, version in opsets.items():
            model.opset_imports[domain] = version
    return model


FLAVOR_PASSES: dict[str, Callable[[ir.Model], ir.Model]] = {"ort": ort_pass, "trt": trt_pass}
