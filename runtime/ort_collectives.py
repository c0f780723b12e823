"""ONNX Runtime's side of a rank program's collectives: the `ai.onnx.contrib::AllReduce` / `AllGather` nodes of
the ort flavor (exporter/onnx_collectives.py) as onnxruntime-extensions Python custom ops that call
torch.distributed on the group this process registered under the node's `group_name` (runtime/dist_run.init).

Notable choices:
- onnxruntime-extensions (pinned, installed without dependencies: it declares none and must not pull the
  CPU `onnxruntime`) loads into onnxruntime-gpu 1.31 as a custom-op library; its Python ops are defined
  once per process, here, on import (`register(session_options)` imports this module).
- Python ops exchange numpy arrays on the host: the collective runs on CPU tensors, which is right for gloo
  (the CPU parity path). With NCCL the tensors would have to go to the GPU and back; a GPU ONNX Runtime
  deployment wants an ORT build with NCCL collectives instead (not in the PyPI wheels).
- Types: fp32 only (one Python op per op_type; ORT's CPU provider runs no bf16 k3-mini graph anyway).
- Errors are found before the first run (`check_ready`): an exception inside a Python op aborts the
  process. A peer that dies mid-collective therefore ends this rank too (torchrun reports both).
- AllGather uses `dist.all_gather` (gloo has no all_gather_into_tensor) and concatenates on axis 0,
  rank-major, as `_c10d_functional.all_gather_into_tensor` does.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

from ..exporter.onnx_collectives import OPS, PYOP_DOMAIN


def _import_extensions():
    """onnxruntime_extensions, without what its package import drags in for its tokenizer converters: it
    imports `transformers` when installed (~10 s per rank process; nothing here uses it) and sets
    PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python for later processes. Both are undone around the import."""
    hide = "transformers" not in sys.modules
    env = os.environ.get("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION")
    if hide:
        sys.modules["transformers"] = None  # type: ignore[assignment]  # import fails: the converters are skipped
    try:
        import onnxruntime_extensions
    finally:
        if hide and sys.modules.get("transformers", 0) is None:
            del sys.modules["transformers"]
        if env is None:
            os.environ.pop("PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION", None)
        else:
            os.environ["PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"] = env
    return onnxruntime_extensions


_ext = _import_extensions()
PyCustomOpDef, get_library_path, onnx_op = _ext.PyCustomOpDef, _ext.get_library_path, _ext.onnx_op

def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def all_reduce(x: np.ndarray, reduce_op: str, group_name: str) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x).copy())
    dist.all_reduce(t, group=_group(group_name))  # reduce_op is "sum": checked by `check_ready`
    return t.numpy()


def all_gather(x: np.ndarray, group_size: int, group_name: str) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(x))
    parts = [torch.empty_like(t) for _ in range(group_size)]
    dist.all_gather(parts, t, group=_group(group_name))
    return torch.cat(parts, 0).numpy()


def check_ready(path) -> str | None:
    """Why the collective nodes of the ONNX file `path` cannot run in this process (None when they can):
    torch.distributed not initialised, a `group_name` not registered, a group of another size than the
    node's `group_size`, a reduction other than sum. Checked before the first run, because an exception
    raised inside a Python op aborts the process (onnxruntime-extensions rethrows it as a C++ exception)."""
    import onnx
    from onnx.helper import get_attribute_value

    from ..exporter.onnx_functions import model_nodes

    groups: dict[str, int | None] = {}
    for n in model_nodes(onnx.load(str(path), load_external_data=False)):
        if n.domain == PYOP_DOMAIN and n.op_type in OPS:
            a = {x.name: get_attribute_value(x) for x in n.attribute}
            name = a["group_name"].decode()
            if a.get("reduce_op", b"sum") != b"sum":
                return f"node {n.name!r}: reduce_op={a['reduce_op'].decode()!r}: only 'sum'"
            if groups.get(name) is None:
                groups[name] = a.get("group_size")
    if groups and not dist.is_initialized():
        return (f"its collective nodes (groups {sorted(groups)}) need torch.distributed: run the ranks under "
                "torchrun or `k3x run/verify` on the sharded export")
    for name, size in groups.items():
        try:
            g = _group(name)
        except Exception:  # noqa: BLE001 - c10d raises its own types
            return f"process group {name!r} is not registered in this process (runtime/dist_run.init)"
        if size is not None and dist.get_world_size(g) != size:
            return f"process group {name!r} has {dist.get_world_size(g)} ranks, the graph's AllGather {size}"
    return None


_F = PyCustomOpDef.dt_float
onnx_op(op_type="AllReduce", inputs=[_F], outputs=[_F],
        attrs={"reduce_op": PyCustomOpDef.dt_string, "group_name": PyCustomOpDef.dt_string})(all_reduce)
onnx_op(op_type="AllGather", inputs=[_F], outputs=[_F],
        attrs={"group_size": PyCustomOpDef.dt_int64, "group_name": PyCustomOpDef.dt_string})(all_gather)


def register(session_options) -> None:
    """Let a session built with `session_options` run the collective nodes (the ops above + the library)."""
    session_options.register_custom_ops_library(get_library_path())
