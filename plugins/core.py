"""The plugin core: what TensorRT needs to know about a `k3::<Op>` node, written once per op family (in
`custom_ops/<family>/plugin.py`) and shared by every TensorRT front end (adapter.py, qdp.py).

A `PluginSpec` states the node's I/O ports with the data types each accepts (LINEAR layout only), its fields
(= the ONNX node attributes), the output-shape and output-type rules — all made from the family's signature
(`PluginSpec.of`, plan/signature.py) — a shape check, and the family's launch plan
(`custom_ops/<family>/triton.plan`, plan/launch.py), which the AOT path runs from cubins and the JIT
path runs with Triton on torch tensors — the same plan the op's `triton` kernels execute.

Nothing here imports TensorRT or Triton. (torch comes in through `k3x.custom_ops`, whose package import
registers the ops, until the plan machinery it reads — dtypes, launch, signature — has a package of its own.)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..plan.dtypes import dtype_name
from ..plan.launch import Plan, run

__all__ = ["Field", "PluginError", "PluginSpec", "Port", "dims_match"]


class PluginError(ValueError):
    """A node TensorRT cannot take: names the plugin, the tensor/field and the reason."""


@dataclass(frozen=True)
class Port:
    name: str
    dtypes: tuple[str, ...]  # accepted data types, LINEAR format only
    same_as: str | None = None  # must have the data type of this earlier port


@dataclass(frozen=True)
class Field:
    name: str
    kind: type  # float | int | str  (ONNX FLOAT -> FLOAT32, INT -> INT32, STRING -> CHAR)
    default: Any


@dataclass(frozen=True)
class PluginSpec:
    name: str  # ONNX op_type, e.g. "KDA"; namespace "k3"
    inputs: tuple[Port, ...]
    outputs: tuple[Port, ...]
    fields: tuple[Field, ...]
    output_shapes: Callable[[list], list]  # input shapes (ints or symbolic) -> output shapes
    output_dtypes: Callable[[list[str]], list[str]]
    dims: Callable[[list], dict]  # input shapes -> named dims used by plan/grid/scalars
    check: Callable[[list, dict], str | None]  # concrete input shapes, attrs -> reason or None
    plan: Callable[[dict, list[str], dict], Plan]  # opt dims, I/O dtypes, attrs: the family's triton.plan
    notes: str = ""  # which path the plugin takes, for docs and build logs
    namespace: str = "k3"
    version: str = "1"
    # QDP aot_impl (one kernel in QDP argument order: inputs, scalars, outputs) exists: the dims it pins over
    # the opt dims ({} none); None: no aot_impl, QDP registers `impl` only
    qdp_aot_dims: dict | None = None
    paths: tuple[str, ...] = ("aot", "jit")  # implementations this plugin has

    @classmethod
    def of(cls, sig, **parts) -> PluginSpec:
        """The plugin of an op family's signature (plan/signature.py, read duck-typed): its ports with
        their dtypes, its fields (the node attributes, all required), its output-shape and output-type rules;
        `parts` are the rest (dims, check, plan, notes, ...)."""
        ports = lambda ts: tuple(Port(t.name, t.dtypes, t.same_as) for t in ts)  # noqa: E731
        return cls(name=sig.node, inputs=ports(sig.inputs), outputs=ports(sig.outputs),
                   fields=tuple(Field(a.name, a.field_kind, None) for a in sig.node_attrs()),
                   output_shapes=sig.output_shapes, output_dtypes=sig.output_dtypes, **parts)

    def resolve_path(self, requested: str) -> str:
        """The path this plugin takes when `requested` is asked for: it, or the one the plugin has (the
        builder prints and records the result per plugin, so this is never silent)."""
        return requested if requested in self.paths else self.paths[0]

    @property
    def ports(self) -> tuple[Port, ...]:
        return self.inputs + self.outputs

    def jit(self, inputs: list, outputs: list, attrs: dict) -> None:
        """The JIT path: the plan run by Triton's JIT on torch tensors (TensorRT's buffers); outputs in place."""
        tensors = list(inputs) + list(outputs)
        dims = self.dims([tuple(t.shape) for t in inputs])
        plan = self.plan(dims, [dtype_name(t.dtype) for t in tensors], attrs)
        run(plan, {p.name: t for p, t in zip(self.ports, tensors)}, dims)

    def attrs(self, given: dict) -> dict:
        """Field values from `given` (ONNX attributes / plugin fields), defaults filled, types coerced."""
        out = {}
        for f in self.fields:
            v = given.get(f.name, f.default)
            if v is None:
                raise PluginError(f"k3::{self.name}: field {f.name!r} is missing")
            out[f.name] = f.kind(v)
        return out

    def supports(self, pos: int, dtypes: Sequence[str]) -> bool:
        """Whether port `pos` may have `dtypes[pos]`, given the dtypes chosen for ports before it."""
        p = self.ports[pos]
        if dtypes[pos] not in p.dtypes:
            return False
        if p.same_as is not None:
            j = [q.name for q in self.ports].index(p.same_as)
            return j >= pos or dtypes[j] == dtypes[pos]
        return True

    def check_dtypes(self, dtypes: Sequence[str]) -> None:
        for i, (p, t) in enumerate(zip(self.ports, dtypes)):
            if not self.supports(i, dtypes):
                want = f"the dtype of {p.same_as}" if t in p.dtypes else "|".join(p.dtypes)
                raise PluginError(f"k3::{self.name}: tensor {p.name!r} has dtype {t}, supported: {want} (LINEAR)")

    def format_table(self) -> str:
        """One line per port: `name: fp16|bf16 LINEAR (= q)`."""
        return "; ".join(f"{p.name}: {'|'.join(p.dtypes)}" + (f" (= {p.same_as})" if p.same_as else "")
                         for p in self.ports) + " — LINEAR only"


def dims_match(got: Sequence, want: Sequence) -> bool:
    """Shapes agree where both dims are known (None = unknown at this point of the build)."""
    return len(got) == len(want) and all(a is None or b is None or a == b for a, b in zip(got, want))

