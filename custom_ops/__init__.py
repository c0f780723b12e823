"""k3 custom ops: KDA, AttnRes and MoE as `torch.ops.k3.*` (registered on import)."""

from .backend import Backend
from . import attn_res, kda, moe  # noqa: F401  (registers torch.ops.k3.*)

__all__ = ["Backend", "attn_res", "kda", "moe"]
