"""What the k3::attn_res Triton kernel (and so the TensorRT plugin) supports, stated once for op.py's config
check, the kernel's own argument check and the plugin's shape check (torch- and Triton-free)."""

from __future__ import annotations

KERNEL_MAX_BANK = 15  # bank entries N the Triton kernel holds on chip
