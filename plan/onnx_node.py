"""What every `k3::<Op>` ONNX node shares: the node spec type, the custom domain, OpSchema registration, and
a small FunctionProto builder for the ONNX Runtime bodies. The families' `onnx.py` files hold the specifics.

Notable choices:
- A node's attributes are the op's static hyper-parameters plus the static dims a TensorRT plugin needs to
  size its workspace (`num_heads`, `head_dim`, ...); they ARE the plugin fields, in this order (the plugin
  specs read `NodeSpec.fields`, so the two cannot drift apart). Booleans are INT (0/1): ONNX has no BOOL
  attribute.
- Every node also carries `plugin_namespace="k3"` (TensorRT's parser looks plugins up by op_type +
  namespace); it is not a plugin field, so it is in `COMMON_ATTRIBUTES`.
- Tensors whose dtype may differ get their own type variable (norm weights are fp32 while projection
  weights are bf16; activations may differ from weights); the variables are signature.TYPE_VARS.
- A family's node is made from its signature (`NodeSpec.of(SIGNATURE)`, plan/signature.py).
- Function-body nodes are named `<Op>/<step>/<op_type>_<n>` (e.g. `MoE/route/TopK_7`); ONNX Runtime prefixes
  them with the calling node's name (`/model/layers.3/mlp/MoE`) when it inlines the function, so a profile
  or a Netron view maps back to the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import helper
from onnx.defs import OpSchema

from .dtypes import FLOAT, ONNX_TYPES
from .signature import TYPE_VARS as SIGNATURE_TYPE_VARS, Signature

DOMAIN = "k3"
VERSION = 1
PLUGIN_NAMESPACE = "k3"
COMMON_ATTRIBUTES: dict[str, str] = {"plugin_namespace": PLUGIN_NAMESPACE}
MS_DOMAIN = "com.microsoft"  # ONNX Runtime contrib ops (LinearAttention)
FUSED_DOMAIN = "k3x.fused"  # standard-op chains grouped as functions for one CPU kernel (custom_ops/fused.py)
AttrType = OpSchema.AttrType
TYPE_VARS = {v: ([ONNX_TYPES[d] for d in dtypes], what) for v, (dtypes, what) in SIGNATURE_TYPE_VARS.items()}
FLOAT_TYPES = [ONNX_TYPES[d] for d in FLOAT]
ATTR_TYPES = {float: AttrType.FLOAT, int: AttrType.INT, str: AttrType.STRING}  # by Attr.field_kind (bool -> INT)


@dataclass(frozen=True)
class NodeSpec:
    """What one `k3::<op_type>` node looks like: formal inputs/outputs (name, type var) and attributes."""

    op_type: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    fields: tuple[tuple[str, AttrType], ...]  # plugin fields = node attributes, in this order
    doc: str

    @classmethod
    def of(cls, sig: Signature) -> NodeSpec:
        """The node of an op family's signature: every tensor port, the node attributes in order."""
        return cls(sig.node, inputs=tuple((t.name, t.var) for t in sig.inputs),
                   outputs=tuple((t.name, t.var) for t in sig.outputs),
                   fields=tuple((a.name, ATTR_TYPES[a.field_kind]) for a in sig.node_attrs()), doc=sig.doc)

    def schema(self) -> OpSchema:
        used = [v for v in TYPE_VARS if any(t == v for _, t in self.inputs + self.outputs)]
        attrs = [OpSchema.Attribute(name, kind, "") for name, kind in self.fields]
        attrs.append(OpSchema.Attribute("plugin_namespace", AttrType.STRING, "TensorRT plugin namespace"))
        return OpSchema(
            self.op_type, DOMAIN, VERSION, doc=self.doc,
            inputs=[OpSchema.FormalParameter(n, t) for n, t in self.inputs],
            outputs=[OpSchema.FormalParameter(n, t) for n, t in self.outputs],
            type_constraints=[(v, TYPE_VARS[v][0], TYPE_VARS[v][1]) for v in used],
            attributes=attrs,
        )

    def register(self) -> None:
        """Register the OpSchema with onnx.defs (idempotent; onnx.checker needs it)."""
        try:
            onnx.defs.get_schema(self.op_type, VERSION, DOMAIN)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(self.schema())


class Body:
    """Tiny FunctionProto builder: `b.op("Mul", a, c)` returns a fresh value name; `b.step = "route"` names
    the nodes that follow `<Op>/route/<op_type>_<n>`."""

    def __init__(self, name: str, step: str = "") -> None:
        self.name, self.step, self.nodes, self._n = name, step, [], 0

    def _node_name(self, op_type: str) -> str:
        return "/".join(p for p in (self.name, self.step, f"{op_type}_{self._n}") if p)

    def op(self, op_type: str, *inputs: str, outputs: int = 1, domain: str = "", **attrs) -> str | list[str]:
        base = "_".join(p for p in (self.name, self.step, op_type, str(self._n)) if p)  # unique across bodies
        outs = [f"{base}_{i}" for i in range(outputs)]
        self.nodes.append(helper.make_node(op_type, list(inputs), outs, name=self._node_name(op_type), domain=domain,
                                           **attrs))
        self._n += 1
        return outs[0] if outputs == 1 else outs

    def out(self, op_type: str, inputs: list[str], outputs: list[str], **attrs) -> None:
        """A node writing the function's named outputs."""
        self.nodes.append(helper.make_node(op_type, inputs, outputs, name=self._node_name(op_type), **attrs))
        self._n += 1

    def ref(self, attr: str, kind: int, as_name: str) -> str:
        """A Constant holding the calling node's attribute `attr` (an ONNX attribute reference)."""
        out = f"{self.name}_ref_{attr}"
        if any(out in n.output for n in self.nodes):
            return out
        a = onnx.AttributeProto(name=as_name, ref_attr_name=attr, type=kind)
        self.nodes.append(helper.make_node("Constant", [], [out], name=f"{self.name}/attributes/{attr}"))
        self.nodes[-1].attribute.append(a)
        return out

    def ints(self, *values: int) -> str:
        return self.op("Constant", value_ints=list(values))

    def branch(self, outs: list[str], tag: str = "") -> onnx.GraphProto:
        """These nodes as a subgraph with no inputs (an If branch, reading the outer scope) returning `outs`
        under names of its own (`tag` tells sibling branches of one step apart), their types left to
        inference (any dtype)."""
        names = [f"{self.name}_{self.step}{tag}_out_{i}" for i in range(len(outs))]
        for src, dst in zip(outs, names):
            self.out("Identity", [src], [dst])
        return helper.make_graph(self.nodes, f"{self.name}_{self.step}{tag}", [],
                                 [onnx.ValueInfoProto(name=n) for n in names])

    def function(self, spec: NodeSpec, opsets: dict[str, int]) -> onnx.FunctionProto:
        return helper.make_function(DOMAIN, spec.op_type, [n for n, _ in spec.inputs], [n for n, _ in spec.outputs],
                                    self.nodes, [helper.make_opsetid(d, v) for d, v in sorted(opsets.items())],
                                    attributes=[f for f, _ in spec.fields], doc_string=spec.doc)


def static(dim: object, what: str) -> int:
    """A dim that must be static to become a node attribute (weights' dims, head counts)."""
    if not isinstance(dim, int):
        raise ValueError(f"{what} must be static for a k3 node attribute, got {dim!r}")
    return dim


def opset():
    """The onnxscript opset of the k3 domain: `opset().KDA(...)` emits a `k3::KDA` node in a translation."""
    import onnxscript

    return onnxscript.values.Opset(DOMAIN, VERSION)
