"""The plugin core, written once per op family and shared by every TensorRT front end.

A `PluginSpec` states what TensorRT needs to know about a `k3::<Op>` node — its I/O ports with the data
types each accepts (LINEAR layout only), its fields (= the ONNX node attributes), the output-shape rule
(the op's own `*_output_shape(s)` function from `custom_ops/<family>/op.py`) and the output types — and
how to run it:

- `plan(dims, dtypes, attrs)` -> `Plan`: the Triton kernels of `custom_ops/<family>/triton.py` as
  `Launch`es (kernel, argument order, constexprs, warps) chosen for one concrete set of dims (the
  profile's opt shape), each launch's grid and int32 scalar arguments as functions of the runtime dims,
  and the workspace buffers. `aot.py` compiles the launches to cubins; `adapter.py` launches them.
- `jit(inputs, outputs, attrs)`: the debugging path, the family's Triton launcher on torch tensors.

Nothing here imports TensorRT, torch or Triton, so specs can be checked on any machine. Dims are dicts
of named sizes (`{"B": 2, "T": 7, ...}`); grid and scalar functions use only `+ * //` and `cdiv`, so the
same functions evaluate on ints and on TensorRT's symbolic shape expressions (QDP `ShapeExpr`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

DTYPES = ("fp32", "fp16", "bf16", "int32", "int64")
FLOAT = ("fp32", "fp16", "bf16")
ITEMSIZE = {"fp32": 4, "fp16": 2, "bf16": 2, "int32": 4, "int64": 8, "uint8": 1}
TRITON_TYPE = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "int32": "*i32", "int64": "*i64", "uint8": "*u8"}


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
class Buffer:
    """A workspace buffer: `numel(dims)` elements of `dtype`."""
    name: str
    dtype: str
    numel: Callable[[dict], Any]


@dataclass(frozen=True)
class Launch:
    """One kernel launch. `args` are, in the kernel's order, port names, workspace buffer names or int32
    scalar names (`scalars(dims)` gives their values); `constexprs` also pin specialised arguments.
    `divisible` names the int32 scalars the plan guarantees to be multiples of 16 (compiled with
    `tt.divisibility=16`, as Triton's JIT does for such values, and checked at every launch); every pointer
    gets that hint too (TensorRT buffers and workspace offsets are 256-byte aligned; also checked)."""
    kernel: Any  # triton.JITFunction
    args: tuple[str, ...]
    constexprs: dict
    grid: Callable[[dict], tuple]
    scalars: Callable[[dict], dict] = lambda d: {}
    num_warps: int = 4
    num_stages: int = 1
    divisible: tuple[str, ...] = ()

    @property
    def kernel_name(self) -> str:
        return self.kernel.fn.__name__ if hasattr(self.kernel, "fn") else self.kernel.__name__


@dataclass(frozen=True)
class Variant:
    """Launches run in order when `when(dims)` holds for the runtime dims (first match wins)."""
    name: str
    launches: tuple[Launch, ...]
    when: Callable[[dict], bool] = lambda d: True


@dataclass(frozen=True)
class Plan:
    variants: tuple[Variant, ...]
    workspace: tuple[Buffer, ...] = ()

    def select(self, dims: dict) -> Variant:
        for v in self.variants:
            if v.when(dims):
                return v
        raise PluginError(f"no kernel variant covers dims {dims}")


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
    plan: Callable[[dict, list[str], dict], Plan]  # opt dims, I/O dtypes, attrs
    jit: Callable[[list, list, dict], None]  # torch inputs, torch outputs (written in place), attrs
    notes: str = ""  # which path the plugin takes, for docs and build logs
    namespace: str = "k3"
    version: str = "1"
    qdp_aot: bool = False  # a single-kernel launch in QDP argument order exists (inputs, scalars, outputs)
    paths: tuple[str, ...] = ("aot", "jit")  # implementations this plugin has

    def resolve_path(self, requested: str) -> str:
        """The path this plugin takes when `requested` is asked for: it, or the one the plugin has (the
        builder prints and records the result per plugin, so this is never silent)."""
        return requested if requested in self.paths else self.paths[0]

    @property
    def ports(self) -> tuple[Port, ...]:
        return self.inputs + self.outputs

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


def cdiv(a, b):
    """Ceil division on ints and on symbolic shape expressions alike."""
    return (a + b - 1) // b


def workspace_layout(buffers: Sequence[Buffer], dims: dict, align: int = 256) -> tuple[list[int], int]:
    """Byte offsets of each buffer inside one workspace allocation, and its total size."""
    offsets, total = [], 0
    for b in buffers:
        offsets.append(total)
        total += cdiv(int(b.numel(dims)) * ITEMSIZE[b.dtype], align) * align
    return offsets, total


def schema_fields(op_type: str) -> tuple[Field, ...]:
    """The plugin fields of `k3::<op_type>`: exactly the node attributes declared in exporter/onnx_schemas.py
    (one source of truth for ONNX attributes and plugin fields); all required."""
    from ..exporter.onnx_schemas import PLUGIN_FIELDS, AttrType

    kinds = {AttrType.FLOAT: float, AttrType.INT: int, AttrType.STRING: str}
    return tuple(Field(name, kinds[t], None) for name, t in PLUGIN_FIELDS[op_type])
