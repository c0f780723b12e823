"""One declarative signature per op family, from which every interface of the family is made:

- the torch.library schema of `torch.ops.k3.<name>` and its fake impl (`define`, used by the family's op.py);
- the ONNX node spec `k3::<node>` (`onnx_node.NodeSpec.of`): formal inputs/outputs with type variables and
  the node attributes;
- the TensorRT plugin ports, fields, output-shape and output-type rules (`trt.core.PluginSpec.of`);
- the TensorRT 11 QDP decorator functions (`trt.qdp.register`), whose parameters TensorRT reads with
  `inspect.signature`.

Parameters are listed once, in one order. The torch schema takes the required tensors, then the attributes
that are op arguments (`Attr.op`), in order, then the optional tensors (`Tensor? name=None`). The ONNX node
and the plugin take every tensor (an optional one is always present there) and the attributes that are node
attributes (`Attr.node`), in order: the op's hyper-parameters and the static dims a plugin sizes its work
from (`Attr(..., op=False)`); `kernels` is an op argument only. Booleans are INT outside torch (ONNX has no
BOOL attribute).

Torch-free and ONNX-free (torch is imported inside `define` only), so plugins read it on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from .dtypes import FLOAT

REQUIRED = object()  # an attribute without a default

# type variable -> (k3x dtypes it admits, what it is): one letter per independently typed group of tensors
TYPE_VARS: dict[str, tuple[tuple[str, ...], str]] = {
    "T": (FLOAT, "activations in the model dtype"),
    "F": (("fp32",), "fp32 gates / routing bias"),
    "S": (("fp32",), "fp32 recurrent state"),
    "W": (FLOAT, "weights"),
    "N": (FLOAT, "norm weights (fp32 in K3's precision plan, independent of W)"),
    "G": (FLOAT, "router weights (independent of the expert weights)"),
    "O": (("int32",), "expert_offset [1]: global id of the first local expert (expert parallelism)"),
    "I": (("int32",), "int32 indices of a serving step: packed-sequence offsets, pool slots, block tables"),
    "X": (("fp32",), "fp32 activations of a CPU op on weights kept as stored (fp32 accumulation)"),
    "B": (("bf16",), "bf16 weights as the checkpoint stores them (the CPU trunk of a bf16 export)"),
    "U": (("uint8", "int8"), "packed weights (two 4-bit codes per byte) and their E8M0 scale bytes: uint8 (ort "
                             "flavor) or the same bytes as int8 (trt flavor)"),
    "C": (("uint8",), "8-bit weight codes in blocks along K (code 128 is zero; the int8 CPU trunk)"),
}
TORCH_TYPES = {float: "float", int: "SymInt", bool: "bool", str: "str"}
FIELD_KINDS = {float: float, int: int, bool: int, str: str}  # node attribute / plugin field / QDP type


@dataclass(frozen=True)
class TensorPort:
    """A tensor port: `var` its type variable (TYPE_VARS), `same_as` an earlier port whose dtype it has."""
    name: str
    var: str
    same_as: str | None = None
    optional: bool = False  # torch: a trailing `Tensor? name=None`; ONNX node and plugin: always present

    @property
    def dtypes(self) -> tuple[str, ...]:
        return TYPE_VARS[self.var][0]


@dataclass(frozen=True)
class Attr:
    """A non-tensor parameter: `kind` float | int | bool | str. `op`: an argument of the torch op; `node`: a
    node attribute and plugin field (a static dim the node carries is `op=False`; `kernels` is `node=False`)."""
    name: str
    kind: type
    default: Any = REQUIRED
    op: bool = True
    node: bool = True

    @property
    def field_kind(self) -> type:
        return FIELD_KINDS[self.kind]


KERNELS = Attr("kernels", str, node=False)  # every family's implementation choice (kernels.py)


@dataclass(frozen=True)
class Signature:
    name: str  # torch op k3::<name> = the family folder
    node: str  # ONNX op_type k3::<node> = the TensorRT plugin name
    inputs: tuple[TensorPort, ...]
    outputs: tuple[TensorPort, ...]
    attrs: tuple[Attr, ...]
    shapes: Callable[[list], Sequence]  # the shape rule: every input's shape, in port order -> output shapes
    doc: str  # the contract, as the ONNX schema states it

    def __post_init__(self) -> None:
        names = [t.name for t in self.inputs + self.outputs] + [a.name for a in self.attrs]
        if len(set(names)) != len(names):
            raise ValueError(f"k3::{self.name}: a parameter name is used twice in {names}")
        for i, t in enumerate(self.inputs + self.outputs):
            if t.var not in TYPE_VARS:
                raise ValueError(f"k3::{self.name}: tensor {t.name!r} has type variable {t.var!r}, not one of "
                                 f"{sorted(TYPE_VARS)}")
            if t.same_as is not None and t.same_as not in [s.name for s in self.inputs[:i]]:
                raise ValueError(f"k3::{self.name}: tensor {t.name!r} is same_as {t.same_as!r}, not an earlier input")
        for t in self.outputs:
            if t.same_as is None and len(t.dtypes) != 1:
                raise ValueError(f"k3::{self.name}: output {t.name!r} needs same_as or a one-dtype type variable")

    @property
    def qualname(self) -> str:
        return f"k3::{self.name}"

    def op_params(self) -> list[TensorPort | Attr]:
        """The torch op's parameters, in schema order."""
        return ([t for t in self.inputs if not t.optional] + [a for a in self.attrs if a.op]
                + [t for t in self.inputs if t.optional])

    def node_attrs(self) -> tuple[Attr, ...]:
        """The node attributes = plugin fields = QDP attributes, in order."""
        return tuple(a for a in self.attrs if a.node)

    def torch_schema(self) -> str:
        """`(Tensor q, ..., float scale, str kernels, float gate_lower_bound=0.0) -> (Tensor, Tensor)`."""
        args = []
        for p in self.op_params():
            if isinstance(p, TensorPort):
                args.append(f"Tensor? {p.name}=None" if p.optional else f"Tensor {p.name}")
            else:
                default = "" if p.default is REQUIRED else f"={p.default!r}"
                args.append(f"{TORCH_TYPES[p.kind]} {p.name}{default}")
        out = "Tensor" if len(self.outputs) == 1 else "(" + ", ".join("Tensor" for _ in self.outputs) + ")"
        return f"({', '.join(args)}) -> {out}"

    def output_shapes(self, shapes: Sequence) -> list:
        """Output shapes from every input's shape (ints or symbolic dims; only + * // in the rule)."""
        return [tuple(s) for s in self.shapes(list(shapes))]

    def output_dtypes(self, dtypes: Sequence) -> list:
        """Output dtypes from the input dtypes: the `same_as` port's, or the type variable's one dtype."""
        names = [t.name for t in self.inputs]
        return [dtypes[names.index(t.same_as)] if t.same_as else t.dtypes[0] for t in self.outputs]

    def define(self, impl: Callable):
        """Register `impl` as `torch.ops.k3.<name>` with this schema and a fake impl from the shape and dtype
        rules; returns torch's CustomOpDef (impl's own annotations are documentation only)."""
        import torch

        from .dtypes import torch_dtype

        op = torch.library.custom_op(self.qualname, impl, mutates_args=(), schema=self.torch_schema())
        params = self.op_params()

        def fake(*args, **kwargs):
            given = dict(zip([p.name for p in params], args)) | kwargs
            ins = [given.get(t.name) for t in self.inputs]
            shapes = [None if x is None else tuple(x.shape) for x in ins]
            dtypes = [None if x is None else x.dtype for x in ins]  # torch dtypes; the fixed ones come as names
            like = next(x for x in ins if x is not None)
            outs = [like.new_empty(s, dtype=torch_dtype(d) if isinstance(d, str) else d)
                    for s, d in zip(self.output_shapes(shapes), self.output_dtypes(dtypes))]
            return outs[0] if len(outs) == 1 else tuple(outs)

        op.register_fake(fake)
        return op
