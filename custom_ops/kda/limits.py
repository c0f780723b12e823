"""What the k3::kda Triton kernels (and so the TensorRT plugin) support, stated once for op.py's config
check, the kernels' own argument check and the plugin's shape check (torch- and Triton-free)."""

from __future__ import annotations

# head dims the Triton kernels support; the reference takes any up to the max
KERNEL_HEAD_DIM = (16, 256)
