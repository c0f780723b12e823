"""`k3::AttnRes` TensorRT plugin: the Block Attention Residuals mixer over the launch plan of `triton.py`.

    AttnRes(prefix [..., d], bank [..., N, d] (prefix's dtype, fp32|fp16|bf16), norm_weight [d], proj_weight [d]
            (fp32|fp16|bf16 each); eps, hidden_size) -> out [..., d] (prefix's dtype).  LINEAR only.
    Ports, fields, output shape and type: `SIGNATURE` (op.py).

One kernel, one program per token row (grid R = prod(prefix.shape[:-1])), N, d and eps specialised into the
code. Paths: IPluginV3 "aot" and QDP `aot_impl` embed the same cubin; "jit" runs the plan with Triton's JIT.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec, dims_match
from . import triton as kt
from .limits import KERNEL_MAX_BANK
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    prefix, bank, nw, pw = (list(x) for x in shapes)
    if len(bank) != len(prefix) + 1:
        return f"bank has rank {len(bank)}, expected prefix's rank + 1 = {len(prefix) + 1} ([..., N, d])"
    d, N = prefix[-1], bank[-2]
    want = prefix[:-1] + [N, d]
    if not dims_match(bank, want):
        return f"bank has shape {bank}, expected {want} (prefix {prefix})"
    for name, w in (("norm_weight", nw), ("proj_weight", pw)):
        if not dims_match(w, [d]):
            return f"{name} has shape {w}, expected [{d}]"
    if N is not None and not 1 <= N <= KERNEL_MAX_BANK:
        return f"needs 1 <= N <= {KERNEL_MAX_BANK} bank entries (Triton kernel), got N={N}"
    if not dims_match([attrs.get("hidden_size")], [d]):
        return f"field hidden_size={attrs.get('hidden_size')} does not match d={d}"
    return None


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims={},
    notes="IPluginV3 aot and QDP aot_impl: one cubin (_attn_res_kernel)",
)
