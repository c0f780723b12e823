"""Bodies of the TensorRT 11 QDP (`tensorrt.plugin`) decorator functions each family declares in
`register_qdp(trtp)`: shapes/types, autotune combinations, JIT `impl` and single-kernel `aot_impl`, all from
the same `PluginSpec` as the IPluginV3 adapter. TensorRT-RTX has no `plugin` package, so none of this runs in
CI; it mirrors NVIDIA's quickly_deployable_plugins sample (kernel args: inputs, int32 scalars, outputs).
"""

from __future__ import annotations

from . import aot as aot_compiler
from .adapter import dtype_name, to_trt_dtype
from .core import PluginError, PluginSpec


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
    if not spec.qdp_aot or plan.workspace or len(plan.variants[0].launches) != 1:
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
