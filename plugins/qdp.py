"""TensorRT 11 QDP (`tensorrt.plugin`) registration of any `PluginSpec`: the decorator functions are made from
the spec's ports and fields (the family's signature), not typed by hand.

TensorRT reads each decorated function's parameters with `inspect.signature` and checks them: `register` takes
the input TensorDescs, then the attributes annotated with their types (int | float | str, no defaults) and
returns TensorDesc or Tuple[TensorDesc, ...]; `autotune` takes (inputs..., outputs); `impl` (inputs...,
attrs..., outputs, stream); `aot_impl` (inputs..., attrs..., outputs, tactic) and must annotate its return
(name, PTX, KernelLaunchParams, SymIntExprs). TensorRT calls them positionally (attributes by keyword in
`register`). So each is one generic body with a `__signature__` built from the spec, its annotations real
classes (what `from __future__ import annotations` would turn into strings TensorRT cannot check).

The bodies: shapes/types, autotune combinations, JIT `impl` and single-kernel `aot_impl`, all from the same
`PluginSpec` as the IPluginV3 adapter. TensorRT-RTX has no `plugin` package, so none of this runs in CI; it
mirrors NVIDIA's quickly_deployable_plugins sample (kernel args: inputs, int32 scalars, outputs).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, List, Tuple, Union

from . import aot as aot_compiler
from .adapter import dtype_name, to_trt_dtype
from .core import PluginError, PluginSpec

POSITIONAL = inspect.Parameter.POSITIONAL_OR_KEYWORD


def signature(names_types: list[tuple[str, Any]], ret: Any = inspect.Signature.empty) -> inspect.Signature:
    return inspect.Signature([inspect.Parameter(n, POSITIONAL, annotation=t) for n, t in names_types],
                             return_annotation=ret)


def made(name: str, sig: inspect.Signature, body: Callable[[dict], Any]) -> Callable:
    """A function TensorRT introspects as `sig` that calls `body` with its arguments by name."""
    def fn(*args, **kwargs):
        return body(dict(sig.bind(*args, **kwargs).arguments))

    fn.__signature__, fn.__name__, fn.__qualname__ = sig, name, name
    fn.__annotations__ = {p.name: p.annotation for p in sig.parameters.values()} | {"return": sig.return_annotation}
    return fn


def functions(trtp, spec: PluginSpec, *, sm: int, opt_dims: dict) -> dict[str, Callable]:
    """decorator name -> function, for `spec` (aot_impl only where the spec has a single-kernel AOT plan)."""
    ins = [p.name for p in spec.inputs]
    attrs = [(f.name, f.kind) for f in spec.fields]
    descs = [(n, trtp.TensorDesc) for n in ins]
    n_out = len(spec.outputs)
    out_desc = trtp.TensorDesc if n_out == 1 else Tuple[(trtp.TensorDesc,) * n_out]
    pick = lambda a, names: [a[n] for n in names]  # noqa: E731
    fields = lambda a: {n: a[n] for n, _ in attrs}  # noqa: E731
    fns = {
        "register": made("desc", signature(descs + attrs, out_desc),
                         lambda a: output_descs(trtp, spec, pick(a, ins), fields(a))),
        "autotune": made("tune", signature(descs + [("outputs", Tuple[(trtp.TensorDesc,) * n_out])],
                                           List[trtp.AutoTuneCombination]), lambda a: autotune(trtp, spec)),
        "impl": made("impl", signature([(n, trtp.Tensor) for n in ins] + attrs + [
            ("outputs", Tuple[(trtp.Tensor,) * n_out]), ("stream", int)], None),
            lambda a: jit(spec, pick(a, ins), list(a["outputs"]), fields(a), a["stream"])),
    }
    if spec.qdp_aot_dims is not None:
        ret = Tuple[Union[str, bytes], Union[str, bytes], trtp.KernelLaunchParams, trtp.SymIntExprs]
        fns["aot_impl"] = made("aot", signature(descs + attrs + [
            ("outputs", Tuple[(trtp.TensorDesc,) * n_out]), ("tactic", int)], ret),
            lambda a: aot(trtp, spec, pick(a, ins), list(a["outputs"]), fields(a), sm, opt_dims | spec.qdp_aot_dims))
    return fns


def register(trtp, spec: PluginSpec, *, sm: int, opt_dims: dict) -> None:
    """Register `k3::<spec.name>` with TensorRT 11's QDP decorators (`trtp` = `tensorrt.plugin`)."""
    for decorator, fn in functions(trtp, spec, sm=sm, opt_dims=opt_dims).items():
        getattr(trtp, decorator)(f"{spec.namespace}::{spec.name}")(fn)


def output_descs(trtp, spec: PluginSpec, descs: list, attrs: dict):
    """Body of a `@trtp.register` function: output TensorDescs from the spec's shape and type rules."""
    shapes = [list(d.shape_expr) for d in descs]
    dtypes = spec.output_dtypes([dtype_name(d.dtype) for d in descs])
    import tensorrt as trt

    outs = [trtp.from_shape_expr(tuple(s), dtype=to_trt_dtype(trt, t))
            for s, t in zip(spec.output_shapes(shapes), dtypes)]
    return outs[0] if len(outs) == 1 else tuple(outs)


def autotune(trtp, spec: PluginSpec) -> list:
    """Body of `@trtp.autotune`: one combination per port (its dtypes, LINEAR). Ties (k = q, o = v)
    are not expressible here; in a strongly typed network the ONNX dtypes already fix them."""
    names = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16", "int32": "INT32", "int64": "INT64", "uint8": "UINT8", "int8": "INT8"}
    c = trtp.AutoTuneCombination()
    for i, p in enumerate(spec.ports):
        c.pos(i, "|".join(names[t] for t in p.dtypes))
    return [c]


def jit(spec: PluginSpec, inputs: list, outputs: list, attrs: dict, stream: int) -> None:
    """Body of `@trtp.impl`: the family's Triton launcher on TensorRT's stream."""
    import torch

    with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
        spec.jit([torch.as_tensor(t, device="cuda") for t in inputs],
                 [torch.as_tensor(t, device="cuda") for t in outputs], attrs)


def aot(trtp, spec: PluginSpec, descs: list, out_descs: list, attrs: dict, sm: int, opt_dims: dict):
    """Body of `@trtp.aot_impl` for single-kernel plans in QDP argument order (inputs, i32 scalars, outputs):
    (kernel name, PTX, KernelLaunchParams, SymIntExprs). Grid and scalars are the spec's own functions,
    evaluated on the symbolic shapes; constexprs were chosen at `opt_dims`."""
    dtypes = [dtype_name(d.dtype) for d in list(descs) + list(out_descs)]
    plan = spec.plan(opt_dims, dtypes, attrs)
    launch = plan.variants[0].launches[0]
    if spec.qdp_aot_dims is None or plan.workspace or len(plan.variants[0].launches) != 1:
        raise PluginError(f"k3::{spec.name}: no single-kernel AOT plan for QDP; build with the IPluginV3 path")
    sym = spec.dims([list(d.shape_expr) for d in descs])
    sc = launch.scalars(sym)
    types = dict(zip([p.name for p in spec.ports], dtypes)) | {n: "i32" for n in sc}
    k = aot_compiler.compile_launch(launch, types, sm, keep_ptx=True)
    grid = tuple(launch.grid(sym)) + (1, 1)
    params = trtp.KernelLaunchParams()
    params.grid_x, params.grid_y, params.grid_z = grid[0], grid[1], grid[2]
    params.block_x = k.num_warps * 32
    params.shared_mem = k.shared
    extra = trtp.SymIntExprs.from_tuple([trtp.SymInt32(v) for v in sc.values()])
    return k.name.encode(), k.ptx.encode(), params, extra
