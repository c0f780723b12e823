"""Collectives in a rank program's ONNX: `_c10d_functional.*` -> `AllReduce` / `AllGather` nodes, per flavor.

The translation (torch.onnx's custom table, exporter/onnx.py) turns
    _c10d_functional.all_reduce(x, "sum", group)                -> k3.dist::AllReduce(x; reduce_op, group_name)
    _c10d_functional.all_gather_into_tensor(x, size, group)     -> k3.dist::AllGather(x; group_size, group_name)
    _c10d_functional.wait_tensor(x)                             -> Identity (the nodes below are synchronous)
`group_name` is the name the traced graph uses (model/parallel.TP_GROUP / EP_GROUP); every rank registers its
own group under it (runtime/dist_run.init), so one ONNX graph serves every rank. AllGather concatenates on
axis 0, rank-major, like `all_gather_into_tensor`. Each node also carries `plugin_namespace="k3"`.

Flavors (the passes below; onnx_flavors.py calls them):
- `trt`: the nodes stay in `k3.dist`: TensorRT's parser resolves them by op_type + plugin_namespace as the
  plugins of plugins/collectives.py (NCCL through torch.distributed at run time).
- `ort`: the nodes move to `ai.onnx.contrib`, the domain of onnxruntime-extensions' Python custom ops;
  runtime/ort_collectives.py defines them (torch.distributed on the process's group) and the runner
  registers the extensions library. onnxruntime-gpu 1.31 from PyPI has no com.microsoft AllReduce/AllGather
  kernels (those exist only in ORT builds with NCCL/MPI), so they are not emitted.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # onnx_ir is imported where it is used: the ONNX Runtime side reads only the names here
    import onnx_ir as ir

DIST_DOMAIN = "k3.dist"  # as exported and in the trt flavor
PYOP_DOMAIN = "ai.onnx.contrib"  # onnxruntime-extensions' Python custom ops (ort flavor)
OPS = ("AllReduce", "AllGather")
NAMESPACE = {"plugin_namespace": "k3"}


def register_schemas() -> None:
    """OpSchemas of both nodes in both domains (idempotent): onnxscript and onnx.checker need them."""
    from onnx import defs
    from onnx.defs import OpSchema

    from ..plan.onnx_node import FLOAT_TYPES

    attrs = {"AllReduce": (("reduce_op", OpSchema.AttrType.STRING), ("group_name", OpSchema.AttrType.STRING)),
             "AllGather": (("group_size", OpSchema.AttrType.INT), ("group_name", OpSchema.AttrType.STRING))}
    for domain in (DIST_DOMAIN, PYOP_DOMAIN):
        for op, fields in attrs.items():
            try:
                defs.get_schema(op, 1, domain)
                continue
            except defs.SchemaError:
                pass
            a = [OpSchema.Attribute(n, k, "") for n, k in fields]
            a.append(OpSchema.Attribute("plugin_namespace", OpSchema.AttrType.STRING, "TensorRT plugin namespace",
                                        required=False))
            defs.register_schema(OpSchema(
                op, domain, 1, doc=f"{op} over the process group named group_name (exporter/onnx_collectives.py)",
                inputs=[OpSchema.FormalParameter("x", "T")], outputs=[OpSchema.FormalParameter("y", "T")],
                type_constraints=[("T", FLOAT_TYPES, "activations")], attributes=a))


def _opset():
    register_schemas()
    import onnxscript

    return onnxscript.values.Opset(DIST_DOMAIN, 1)


def _all_reduce(x, reduce_op: str, group_name: str):
    if reduce_op != "sum":
        raise ValueError(f"_c10d_functional.all_reduce: reduce_op={reduce_op!r}: only 'sum' is exported")
    return _opset().AllReduce(x, reduce_op="sum", group_name=str(group_name), **NAMESPACE)


def _all_gather(x, group_size: int, group_name: str):
    return _opset().AllGather(x, group_size=int(group_size), group_name=str(group_name), **NAMESPACE)


def _wait(x):
    import onnxscript

    return onnxscript.opset18.Identity(x)


def translation_table() -> dict:
    """OpOverload -> translation for the functional collectives a rank program contains."""
    import torch

    c = torch.ops._c10d_functional
    return {c.all_reduce.default: _all_reduce, c.all_gather_into_tensor.default: _all_gather,
            c.wait_tensor.default: _wait}


def collective_nodes(model: ir.Model) -> list[ir.Node]:
    import onnx_ir as ir

    return [n for n in ir.traversal.RecursiveGraphIterator(model.graph)
            if n.domain in (DIST_DOMAIN, PYOP_DOMAIN) and n.op_type in OPS]


def counts(model: ir.Model) -> dict[str, int]:
    """{"AllReduce": n, "AllGather": m} of the model (empty for a single-GPU graph)."""
    return dict(sorted(Counter(n.op_type for n in collective_nodes(model)).items()))


FIELDS = {"AllReduce": ("reduce_op", "group_name"), "AllGather": ("group_size", "group_name")}


def _set_attributes(nodes: list[ir.Node], namespace: bool) -> None:
    """Each node's fields in one order (+ `plugin_namespace` last when `namespace`): the files of every rank
    are alike whichever flavor a converted model was written in before."""
    import onnx_ir as ir

    for n in nodes:
        missing = [a for a in FIELDS[n.op_type] if a not in n.attributes]
        if missing:
            raise ValueError(f"node {n.name!r} ({n.domain}::{n.op_type}) lacks attribute(s) {missing}")
        attrs = [n.attributes[a] for a in FIELDS[n.op_type]]
        if namespace:
            attrs.append(ir.AttrString("plugin_namespace", NAMESPACE["plugin_namespace"]))
        n.attributes.clear()
        n.attributes.update({a.name: a for a in attrs})


def trt_pass(model: ir.Model) -> None:
    """Plugin nodes in `k3.dist` with every plugin field and the plugin namespace."""
    _flavor_pass(model, DIST_DOMAIN, namespace=True)


def ort_pass(model: ir.Model) -> None:
    """onnxruntime-extensions Python ops: domain `ai.onnx.contrib`, no plugin namespace."""
    _flavor_pass(model, PYOP_DOMAIN, namespace=False)


def _flavor_pass(model: ir.Model, domain: str, *, namespace: bool) -> None:
    nodes = collective_nodes(model)
    _set_attributes(nodes, namespace=namespace)
    for n in nodes:
        n.domain = domain
    _set_import(model, domain if nodes else None)


def _set_import(model: ir.Model, domain: str | None) -> None:
    for d in (DIST_DOMAIN, PYOP_DOMAIN):
        model.opset_imports.pop(d, None)
    if domain is not None:
        model.opset_imports[domain] = 1
