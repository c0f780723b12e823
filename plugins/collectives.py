"""TensorRT plugins for a rank program's collectives: `AllReduce` and `AllGather` nodes of the trt-flavor ONNX
(exporter/onnx_collectives.py), namespace "k3", as IPluginV3 creators (TensorRT 11 and TensorRT-RTX alike).

    AllReduce(x; reduce_op="sum", group_name)   -> y, x's shape and type
    AllGather(x; group_size, group_name)        -> y, dim 0 multiplied by group_size (rank-major, like
                                                   `_c10d_functional.all_gather_into_tensor`)
fp32 | fp16 | bf16, LINEAR; no workspace; one tactic.

Runtime (`enqueue`): NCCL through torch.distributed on the process group this process registered under
`group_name` (runtime/dist_run.init registers the rank's TP / EP groups under the names the graph uses), on
TensorRT's stream (`torch.cuda.ExternalStream`: the NCCL work is ordered after the producers and before the
consumers of TensorRT's stream). So an engine with collectives runs inside a torchrun rank that has initialised
torch.distributed; the engine itself holds no communicator.

Not used: TensorRT 11's `INetworkDefinition.add_dist_collective`, which the ONNX parser does not emit for a
custom node (a build-time rewrite of the parsed network would be needed) and TensorRT-RTX does not have.
What the CPU machines prove: the parser resolves the nodes to these creators, fields reach `create_plugin`,
the shape and type functions and format negotiation run, and the engine builds (TensorRT-RTX, `--sm 89`).
What they cannot: `enqueue` (no GPU, no NCCL) and anything TensorRT 11-specific.
"""

from __future__ import annotations

from .core import PluginError

NAMESPACE, VERSION = "k3", "1"
FIELDS: dict[str, tuple[tuple[str, type], ...]] = {
    "AllReduce": (("reduce_op", str), ("group_name", str)),
    "AllGather": (("group_size", int), ("group_name", str)),
}
TYPES = ("fp32", "fp16", "bf16")


def output_shape(op: str, shape: list, attrs: dict) -> list:
    """The output shape rule (ints or symbolic dims with `*`)."""
    return list(shape) if op == "AllReduce" else [shape[0] * attrs["group_size"], *shape[1:]]


def check_attrs(op: str, attrs: dict) -> dict:
    """Field values of `op`, coerced; one PluginError naming the field otherwise."""
    out = {}
    for name, kind in FIELDS[op]:
        if name not in attrs:
            raise PluginError(f"k3::{op}: field {name!r} is missing")
        out[name] = kind(attrs[name])
    if op == "AllReduce" and out["reduce_op"] != "sum":
        raise PluginError(f"k3::AllReduce: field reduce_op={out['reduce_op']!r}: only 'sum'")
    if op == "AllGather" and out["group_size"] < 1:
        raise PluginError(f"k3::AllGather: field group_size={out['group_size']}: must be >= 1")
    return out


def run(op: str, attrs: dict, x, y) -> None:
    """The collective on torch tensors (TensorRT's buffers); y written in place."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(attrs["group_name"])
    if op == "AllReduce":
        y.copy_(x)
        dist.all_reduce(y, group=group)
    else:
        dist.all_gather_into_tensor(y, x.contiguous(), group=group)


def creator(trt, op: str):
    """An `IPluginCreatorV3One` for `op` (register with `register_creator(c, "k3")`)."""
    from .adapter import cuda_tensor, plugin_field, field_value, guard, dtype_name

    class Plugin(trt.IPluginV3, trt.IPluginV3OneCore, trt.IPluginV3OneBuild, trt.IPluginV3OneRuntime):
        def __init__(self, attrs: dict, node: str = ""):
            trt.IPluginV3.__init__(self)
            trt.IPluginV3OneCore.__init__(self)
            trt.IPluginV3OneBuild.__init__(self)
            trt.IPluginV3OneRuntime.__init__(self)
            self.num_outputs = 1
            self.plugin_namespace, self.plugin_name, self.plugin_version = NAMESPACE, op, VERSION
            self.timing_cache_id = ""
            self.attrs, self.node = attrs, node

        def get_capability_interface(self, type):
            return self

        def clone(self):
            return Plugin(dict(self.attrs), self.node)

        def destroy(self):
            pass

        @guard(lambda self, types: [types[0]])
        def get_output_data_types(self, input_types):
            return [input_types[0]]

        @guard(lambda self, inputs, *_: [inputs[0]])
        def get_output_shapes(self, inputs, shape_inputs, expr_builder):
            d = inputs[0]
            out = trt.DimsExprs(len(d))
            for i in range(len(d)):
                out[i] = d[i]
            if op == "AllGather":
                out[0] = expr_builder.operation(trt.DimensionOperation.PROD, d[0],
                                                expr_builder.constant(self.attrs["group_size"]))
            return [out]

        @guard(lambda self, *_: False)
        def supports_format_combination(self, pos, in_out, num_inputs):
            desc = in_out[pos].desc
            if desc.format != trt.TensorFormat.LINEAR or dtype_name(desc.type) not in TYPES:
                return False
            return pos == 0 or desc.type == in_out[0].desc.type

        def configure_plugin(self, inp, out):
            pass

        def get_workspace_size(self, inp, out):
            return 0

        def get_valid_tactics(self):
            return [1]

        def get_fields_to_serialize(self):
            self._serialized = [plugin_field(trt, k, v) for k, v in self.attrs.items()]  # kept alive for TensorRT
            return trt.PluginFieldCollection(self._serialized)

        def set_tactic(self, tactic):
            pass

        def on_shape_change(self, inp, out):
            pass

        def attach_to_context(self, context):
            return self.clone()

        @guard(lambda self, *_: None)
        def enqueue(self, input_desc, output_desc, inputs, outputs, workspace, stream):
            import torch

            t = dtype_name(input_desc[0].type)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                x = cuda_tensor(inputs[0], tuple(input_desc[0].dims), t)
                y = cuda_tensor(outputs[0], tuple(output_desc[0].dims), t)
                run(op, self.attrs, x, y)

    class Creator(trt.IPluginCreatorV3One):
        def __init__(self):
            trt.IPluginCreatorV3One.__init__(self)
            self.name, self.plugin_namespace, self.plugin_version = op, NAMESPACE, VERSION
            self.field_names = trt.PluginFieldCollection([plugin_field(trt, n, k()) for n, k in FIELDS[op]])

        def create_plugin(self, name, fc, phase):
            from .adapter import ERRORS

            try:
                return Plugin(check_attrs(op, {f.name: field_value(trt, f) for f in fc}), node=name)
            except PluginError as e:  # an exception escaping into TensorRT aborts it; the builder reports ERRORS
                ERRORS.append(f"node {name!r}: {e}")
                return None

    return Creator()
