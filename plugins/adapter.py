"""The one adapter from a `PluginSpec` (core.py) to TensorRT's plugin interfaces.

- `creator(trt, spec, sm=, path=)`: an `IPluginCreatorV3One` making `IPluginV3` plugins (OneCore/OneBuild/
  OneRuntime). This is the interface TensorRT-RTX's ONNX parser accepts and TensorRT 11 supports alike;
  `trt` is the imported module (`tensorrt` or `tensorrt_rtx_bindings`).
- qdp.py holds the bodies of the `tensorrt.plugin` (QDP) decorator functions (TensorRT 11 only).

Paths (`path=`), fixed per engine build and recorded in the manifest — never chosen by timing:
- "aot": at build time (`configure_plugin`) the plan's Triton kernels are compiled to cubins for `sm` (the plan
  gets it as attrs["sm"]: target-dependent kernel choices, e.g. native FP4 MMAs from sm_100) and
  serialised into the engine as the plugin field `k3_kernels`; `enqueue` launches them through the CUDA
  driver (aot.CudaDriver) — several kernels per plugin are fine. Needs the Python plugin module at load,
  but no Triton compiler and no torch.
- "jit": `enqueue` calls the family's Triton launcher on torch tensors wrapping TensorRT's buffers.
"""

from __future__ import annotations

import functools
import json
import logging
from typing import Any

import numpy as np

from ..plan.launch import workspace_layout
from . import aot
from .core import PluginError, PluginSpec

log = logging.getLogger("k3x.plugins")
ERRORS: list[str] = []  # exceptions caught in plugin callbacks (an exception escaping into TensorRT aborts it)
FORMATS: dict[tuple[str, str], set[str] | None] = {}  # (node, port) -> dtypes refused; None once one was accepted


def format_failures() -> list[str]:
    """Ports of plugin nodes for which TensorRT offered only data types the plugin does not support."""
    return [f"node '{node}: tensor {port!r} offered {'|'.join(sorted(refused))}" for (node, port), refused
            in FORMATS.items() if refused]


def guard(default):
    """Run a plugin callback; on an exception record it in ERRORS (the builder raises them after the build)
    and return `default(self, *args)`, because a Python exception crossing into TensorRT kills the process."""
    def wrap(fn):
        @functools.wraps(fn)
        def inner(self, *args):
            try:
                return fn(self, *args)
            except Exception as e:  # noqa: BLE001 - reported by the builder, see ERRORS
                msg = f"k3::{self.plugin_name} {fn.__name__}: {type(e).__name__}: {e}"
                if msg not in ERRORS:
                    ERRORS.append(msg)
                log.error("%s", msg)
                return default(self, *args)
        return inner
    return wrap
PATHS = ("aot", "jit")
TRT_DTYPE_NAMES = {"FLOAT": "fp32", "HALF": "fp16", "BF16": "bf16", "INT32": "int32", "INT64": "int64",
                   "UINT8": "uint8", "INT8": "int8"}
_TYPESTR = {"fp32": "<f4", "fp16": "<f2", "bf16": "<i2", "int32": "<i4", "int64": "<i8", "uint8": "|u1", "int8": "|i1"}


def dtype_name(t) -> str:
    return TRT_DTYPE_NAMES.get(t.name, t.name.lower())


def to_trt_dtype(trt, name: str):
    return {v: getattr(trt.DataType, k) for k, v in TRT_DTYPE_NAMES.items()}[name]


def field_value(trt, f) -> Any:
    data = np.asarray(f.data)
    if f.type == trt.PluginFieldType.CHAR:
        return data.astype(np.uint8).tobytes().rstrip(b"\0").decode()
    if f.type in (trt.PluginFieldType.UNKNOWN, trt.PluginFieldType.INT8):
        return data.astype(np.int8).tobytes()
    return data.reshape(-1)[0].item()


def plugin_field(trt, name: str, value: Any):
    if isinstance(value, bytes):
        return trt.PluginField(name, np.frombuffer(value, dtype=np.int8).copy(), trt.PluginFieldType.UNKNOWN)
    if isinstance(value, str):
        return trt.PluginField(name, np.frombuffer(value.encode(), dtype=np.int8).copy(), trt.PluginFieldType.CHAR)
    if isinstance(value, float):
        return trt.PluginField(name, np.array([value], dtype=np.float32), trt.PluginFieldType.FLOAT32)
    return trt.PluginField(name, np.array([int(value)], dtype=np.int32), trt.PluginFieldType.INT32)


class _Sym:
    """A TensorRT `IDimensionExpr` with the `+ - * //` the ops' shape rules use (`int - dim` is not one)."""

    def __init__(self, expr, builder):
        self.expr, self.b = expr, builder

    def _op(self, other, op):
        o = other.expr if isinstance(other, _Sym) else self.b.constant(int(other))
        return _Sym(self.b.operation(op, self.expr, o), self.b)

    def __add__(self, o): return self._op(o, self.b.trt.DimensionOperation.SUM)
    def __sub__(self, o): return self._op(o, self.b.trt.DimensionOperation.SUB)
    def __mul__(self, o): return self._op(o, self.b.trt.DimensionOperation.PROD)
    def __floordiv__(self, o): return self._op(o, self.b.trt.DimensionOperation.FLOOR_DIV)
    __radd__, __rmul__ = __add__, __mul__

    def const(self) -> int | None:
        return self.expr.get_constant_value() if self.expr.is_constant() else None


class _Builder:
    def __init__(self, trt, builder):
        self.trt, self.eb = trt, builder

    def constant(self, v):
        return self.eb.constant(v)

    def operation(self, op, a, b):
        return self.eb.operation(op, a, b)


def cuda_tensor(ptr: int, shape: tuple[int, ...], dtype: str):
    """Zero-copy torch view of a TensorRT device buffer (bf16 travels as int16, then is re-viewed)."""
    import torch

    class _Cai:
        __cuda_array_interface__ = {"shape": tuple(shape), "typestr": _TYPESTR[dtype], "data": (int(ptr), False),
                                    "version": 3}

    t = torch.as_tensor(_Cai(), device="cuda")
    return t.view(torch.bfloat16) if dtype == "bf16" else t


def _launches(spec: PluginSpec, plan, kernels: dict, dtypes: list[str], dims: dict, sm: int):
    """(launch, its compiled kernel, int32 scalars) of the variant of `plan` for `dims`, in order."""
    types = dict(zip([p.name for p in spec.ports], dtypes)) | {b.name: b.dtype for b in plan.workspace}
    for launch in plan.select(dims).launches:
        sc = launch.scalars(dims)
        yield launch, kernels[aot.launch_key(launch, aot.signature(launch, types | {k: "i32" for k in sc}), sm)], sc


def scratch_size(spec: PluginSpec, plan, kernels: dict, dtypes: list[str], dims: dict, sm: int) -> int:
    """Global scratch (device-side TMA descriptors) the launches at `dims` need: the largest one's, since they
    run one after another on the stream; it follows the plan's workspace in TensorRT's allocation."""
    return max((aot.scratch_bytes(k, x.grid(dims)) for x, k, _ in _launches(spec, plan, kernels, dtypes, dims, sm)),
               default=0)


def run_plan(spec: PluginSpec, plan, kernels: dict, driver, shapes: list, dtypes: list[str], ptrs: list[int],
             workspace: int, stream: int, sm: int) -> None:
    """Launch the variant of `plan` matching `shapes` with the compiled `kernels` (AOT path)."""
    dims = spec.dims(shapes[:len(spec.inputs)])
    offsets, total = workspace_layout(plan.workspace, dims)
    values = {p.name: ptr for p, ptr in zip(spec.ports, ptrs)}
    values |= {b.name: workspace + off for b, off in zip(plan.workspace, offsets)}
    for launch, k, sc in _launches(spec, plan, kernels, dtypes, dims, sm):
        driver.launch(k, launch.grid(dims), values | sc, stream, scratch=workspace + total if k.scratch else 0)


def compile_plan(spec: PluginSpec, plan, dtypes: list[str], sm: int, dims_list: list[dict]) -> list:
    """Compile every launch of every variant reachable at some of `dims_list` (min/opt/max) for `sm`."""
    types = dict(zip([p.name for p in spec.ports], dtypes)) | {b.name: b.dtype for b in plan.workspace}
    out = {}
    for v in plan.variants:
        if not any(v.when(d) for d in dims_list):  # predicates are monotone in the dynamic dims
            continue
        for launch in v.launches:
            sc = launch.scalars(dims_list[0])
            k = aot.compile_launch(launch, types | {n: "i32" for n in sc}, sm)
            out[k.key] = k
    return list(out.values())


def creator(trt, spec: PluginSpec, *, sm: int, path: str = "aot"):
    """An `IPluginCreatorV3One` instance for `spec` (register with `register_creator(c, spec.namespace)`)."""
    if path not in PATHS:
        raise PluginError(f"plugin path {path!r}: expected one of {PATHS}")

    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, attrs: dict, phase, extra: dict | None = None, node: str = ""):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.num_outputs = len(spec.outputs)
            self.plugin_namespace, self.plugin_name, self.plugin_version = spec.namespace, spec.name, spec.version
            self.timing_cache_id = ""
            self.attrs, self.phase, self.node = attrs, phase, node
            extra = extra or {}
            self.kernels_blob: bytes = extra.get("k3_kernels", b"")
            self.config: dict = json.loads(extra.get("k3_config") or "{}")  # opt dims, dtypes, sm, path
            self.shapes: list = []
            self._runtime = None  # (plan, kernels, driver), built on first enqueue

        # ---- core / lifecycle
        def get_capability_interface(self, type):
            return self

        def clone(self):
            c = Plugin(self.attrs, self.phase, node=self.node)
            c.kernels_blob, c.config, c.shapes = self.kernels_blob, dict(self.config), list(self.shapes)
            return c

        def destroy(self):
            pass

        # ---- build
        @guard(lambda self, types: [types[0]] * len(spec.outputs))
        def get_output_data_types(self, input_types):
            return [to_trt_dtype(trt, t) for t in spec.output_dtypes([dtype_name(t) for t in input_types])]

        @guard(lambda self, inputs, *_: [inputs[0]] * len(spec.outputs))
        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            b = _Builder(trt, expr_builder)
            shapes = [[_Sym(d[i], b) for i in range(len(d))] for d in inputs]
            static = [[s.const() for s in shp] for shp in shapes]
            reason = spec.check(static, self.attrs)
            if reason:
                raise PluginError(f"k3::{spec.name}: {reason}")
            outs = []
            for shp in spec.output_shapes(shapes):
                de = trt.DimsExprs(len(shp))
                for i, s in enumerate(shp):
                    de[i] = s.expr if isinstance(s, _Sym) else expr_builder.constant(int(s))
                outs.append(de)
            return outs

        @guard(lambda self, *_: False)
        def supports_format_combination(self, pos, in_out, num_inputs):
            if in_out[pos].desc.format != trt.TensorFormat.LINEAR:
                return False
            dtypes = [dtype_name(in_out[i].desc.type) for i in range(pos + 1)]
            key = (f"{self.node}' (k3::{spec.name})", spec.ports[pos].name)
            if dtypes[pos] in spec.ports[pos].dtypes:
                FORMATS[key] = None
            elif FORMATS.get(key, set()) is not None:
                FORMATS.setdefault(key, set()).add(dtypes[pos])
            return spec.supports(pos, dtypes)

        @guard(lambda self, *_: None)
        def configure_plugin(self, inp, out):
            dtypes = [dtype_name(d.desc.type) for d in list(inp) + list(out)]
            spec.check_dtypes(dtypes)
            lo, opt, hi = ([tuple(getattr(d, k)) for d in inp] for k in ("min", "opt", "max"))
            for shapes in (lo, opt, hi):
                reason = spec.check(shapes, self.attrs)
                if reason:
                    raise PluginError(f"k3::{spec.name}: {reason}")
            dims = [spec.dims(s) for s in (lo, opt, hi)]
            self.config = {"opt": dims[1], "min": dims[0], "max": dims[2], "dtypes": dtypes, "sm": sm, "path": path}
            if path == "aot":
                plan = spec.plan(dims[1], dtypes, self.attrs | {"sm": sm})
                kernels = compile_plan(spec, plan, dtypes, sm, dims)
                self.kernels_blob = aot.pack(kernels, {"plugin": f"{spec.namespace}::{spec.name}", "sm": sm})
                log.debug("k3::%s: %d AOT kernels for sm_%d: %s", spec.name, len(kernels), sm,
                          [k.name for k in kernels])

        @guard(lambda self, *_: 0)
        def get_workspace_size(self, inp, out):
            if path != "aot" or not self.config:
                return 0
            plan = spec.plan(self.config["opt"], self.config["dtypes"], self.attrs | {"sm": sm})
            hi = spec.dims([tuple(d.max) for d in inp])
            kernels = aot.unpack(self.kernels_blob)[1] if self.kernels_blob else {}
            scratch = scratch_size(spec, plan, kernels, self.config["dtypes"], hi, sm) if kernels else 0
            return workspace_layout(plan.workspace, hi)[1] + scratch

        def get_valid_tactics(self):
            return [1]

        def get_fields_to_serialize(self):
            fields = [plugin_field(trt, k, v) for k, v in self.attrs.items()]
            fields.append(plugin_field(trt, "k3_config", json.dumps(self.config, sort_keys=True)))
            if self.kernels_blob:
                fields.append(plugin_field(trt, "k3_kernels", self.kernels_blob))
            self._serialized = fields  # TensorRT reads the numpy buffers after we return: keep them alive
            return trt.PluginFieldCollection(fields)

        # ---- runtime
        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inp, out):
            self.shapes = [tuple(d.dims) for d in list(inp) + list(out)]

        def attach_to_context(self, context):
            return self.clone()

        @guard(lambda self, *_: None)
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            descs = list(input_desc) + list(output_desc)
            shapes = [tuple(d.dims) for d in descs]
            dtypes = [dtype_name(d.type) for d in descs]
            ptrs = list(inputs) + list(outputs)
            if path == "jit":
                import torch

                with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                    ts = [cuda_tensor(p, s, t) for p, s, t in zip(ptrs, shapes, dtypes)]
                    spec.jit(ts[:len(spec.inputs)], ts[len(spec.inputs):], self.attrs)
                return
            if self._runtime is None:
                meta, kernels = aot.unpack(self.kernels_blob)
                plan = spec.plan(self.config["opt"], self.config["dtypes"], self.attrs | {"sm": self.config["sm"]})
                self._runtime = (plan, kernels, aot.CudaDriver())
            plan, kernels, driver = self._runtime
            run_plan(spec, plan, kernels, driver, shapes, dtypes, ptrs, workspace, stream, self.config["sm"])

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = spec.name, spec.namespace, spec.version
            self.field_names = trt.PluginFieldCollection(
                [plugin_field(trt, f.name, f.kind(f.default) if f.default is not None else f.kind()) for f in spec.fields])
            self.path, self.sm = path, sm

        def create_plugin(self, name, fc, phase):
            given = {f.name: field_value(trt, f) for f in fc}
            extra = {k: given.pop(k) for k in ("k3_kernels", "k3_config") if k in given}
            if isinstance(extra.get("k3_config"), bytes):
                extra["k3_config"] = extra["k3_config"].decode()
            return Plugin(spec.attrs(given), phase, extra, node=name)

    return Creator()
