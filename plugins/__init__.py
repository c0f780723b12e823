"""The TensorRT plumbing shared by every op family's plugin, knowing no family (each family states its own
plugin in `custom_ops/<family>/plugin.py`: a `PluginSpec` made from the family's signature;
custom_ops/trt_plugins.py registers them all).

`core.py` is the spec type (ports and formats, fields, shape/type rules, the family's launch plan); `aot.py`
compiles plans to cubins and launches them through the CUDA driver; `adapter.py` exposes a spec as an
IPluginV3 creator (TensorRT 11 and TensorRT-RTX); `qdp.py` registers a spec's QDP decorator functions,
made from its ports and fields (TensorRT 11 only); `collectives.py` the AllReduce / AllGather plugins of rank
programs (NCCL through torch.distributed), registered with the op families' creators. Each family's plugin
docstring says which paths (aot, jit, QDP aot_impl/impl) it has.
"""

from __future__ import annotations

from .core import PluginError, PluginSpec

__all__ = ["PluginError", "PluginSpec"]
