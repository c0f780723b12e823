"""ONNX Runtime's side of a rank program's collectives: the `ai.onnx.contrib::AllReduce` / `AllGather` nodes of
the ort flavor (exporter/onnx_collectives.py) as onnxruntime-extensions Python custom ops that call
torch.distributed on the group this process registered under the node's `group_name` (exporter/dist_run.init).

Notable choices:
- onnxruntime-extensions (pinned, installed without dependencies: it declares none and must not pull the
  CPU `onnxruntime`) loads into onnxruntime-gpu 1.31 as a custom-op library; its Python ops are defined
  once per process, here, on import (`register(session_options)` imports this module).
- Python ops exchange numpy arrays on the host: the collective runs on CPU tensors, which is right for gloo
  (the CPU parity path). With NCCL the tensors would have to go to the GPU and back; a GPU ONNX Runtime
  deployment wants an ORT build with NCCL collectives instead (not in the PyPI wheels).
- Types: fp32 only (one Python op per op_type; ORT's CPU provider runs no bf16 k3-mini graph anyway).
- AllGather uses `dist.all_gather` (gloo has no all_gather_into_tensor) and concatenates on axis 0,
  rank-major, as `_c10d_functional.all_gather_into_tensor` does.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from onnxruntime_extensions import PyCustomOpDef, get_library_path, onnx_op

def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        raise RuntimeError(f"collective on group {name!r}: torch.distributed is not initialised (run the ranks "
                           "under torchrun or `k3x run/verify` on the sharded export)")
    return _resolve_process_group(name)


def all_reduce(x: np.ndarray, reduce_op: str, group_name: str) -> np.ndarray:
    if reduce_op != "sum":
        raise ValueError(f"AllReduce reduce_op={reduce_op!r}: only 'sum'")
    t = torch.from_numpy(np.ascontiguousarray(x).copy())
    dist.all_reduce(t, group=_group(group_name))
    return t.numpy()


def all_gather(x: np.ndarray, group_size: int, group_name: str) -> np.ndarray:
    g = _group(group_name)
    if dist.get_world_size(g) != group_size:
        raise ValueError(f"AllGather group {group_name!r} has {dist.get_world_size(g)} ranks, the node says "
                         f"group_size={group_size}")
    t = torch.from_numpy(np.ascontiguousarray(x))
    parts = [torch.empty_like(t) for _ in range(group_size)]
    dist.all_gather(parts, t, group=g)
    return torch.cat(parts, 0).numpy()


_F = PyCustomOpDef.dt_float
onnx_op(op_type="AllReduce", inputs=[_F], outputs=[_F],
        attrs={"reduce_op": PyCustomOpDef.dt_string, "group_name": PyCustomOpDef.dt_string})(all_reduce)
onnx_op(op_type="AllGather", inputs=[_F], outputs=[_F],
        attrs={"group_size": PyCustomOpDef.dt_int64, "group_name": PyCustomOpDef.dt_string})(all_gather)


def register(session_options) -> None:
    """Let a session built with `session_options` run the collective nodes (the ops above + the library)."""
    session_options.register_custom_ops_library(get_library_path())
