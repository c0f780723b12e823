"""k3 custom ops: one folder per op family (custom_ops/registry.py lists them), each registered on import
as `torch.ops.k3.<family>`."""

from ..plan.kernels import Kernels
from . import registry

for _family in registry.families():
    _family.op  # noqa: B018  (imports op.py: registers torch.ops.k3.<family>)

__all__ = ["Kernels", "registry"]
