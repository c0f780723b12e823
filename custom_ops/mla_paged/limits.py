"""What the k3::mla_paged Triton kernels (and so the TensorRT plugin) support, stated once for op.py's config
check, the kernels' own argument check and the plugin's shape check (torch- and Triton-free)."""

from __future__ import annotations

KERNEL_MAX_LATENT = 1024  # C + R the Triton kernels (and so the TensorRT plugin) hold on chip per row
