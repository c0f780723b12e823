"""`k3::KDAPrep` TensorRT plugin: KDA's pre-recurrence over packed sequences, over the launch plan of
`triton.py` (one kernel).

    KDAPrep(qkv [N, C], f [N, H, K], b [N, H] (one float dtype; C = 2·H·K + H·V), conv_weight [C, W],
            A_log [>=H] fp32, dt_bias [H*K] fp32, conv_pool [S, C, W-1] fp32, cu_seqlens [B+1] int32,
            slots [B] int32; num_heads, head_dim, value_dim, conv_kernel, gate_lower_bound)
        -> (q, k [N, H, K], v [N, H, V] (qkv's dtype), g [N, H, K] fp32, beta [N, H] fp32, new_conv [B, C, W-1] fp32).
    LINEAR only; pure (the pool is an input, never written). Ports, fields, output shapes and types:
    `SIGNATURE` (op.py). No block size depends on N or B; the grid follows the runtime N and B.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec
from ..kda.plugin import check_dims
from . import triton as kt
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    qkv, f, b, w, a, dt, conv, cu, slots = (list(x) for x in shapes)
    ranks = [len(x) for x in (qkv, f, b, w, a, dt, conv, cu, slots)]
    if ranks != [2, 3, 2, 2, 1, 1, 3, 1, 1]:
        return (f"ranks qkv, f, b, conv_weight, A_log, dt_bias, conv_pool, cu_seqlens, slots {ranks}, "
                "expected [2, 3, 2, 2, 1, 1, 3, 1, 1]")
    N, H, K = f
    C, W, B = qkv[1], w[1], slots[0]
    V = None if None in (C, H, K) else (C - 2 * H * K) // H
    if V is not None and C != 2 * H * K + H * V:
        return f"qkv has shape {qkv}, expected [N, 2*H*K + H*V] (from f {f}: a whole V per head)"
    if None not in (a[0], H) and a[0] < H:
        return f"A_log has shape {a}, expected at least H={H} entries (from f {f})"
    checks = [("qkv[0]", qkv[:1], [N]), ("b", b, [N, H]), ("conv_weight", w, [C, W]),
              ("dt_bias", dt, [None if None in (H, K) else H * K]),
              ("conv_pool[1:]", conv[1:], [C, None if W is None else W - 1]),
              ("cu_seqlens", cu, [None if B is None else B + 1])]
    reason = check_dims(checks, f"f {f}, qkv {qkv}, slots {slots}", attrs, H, K, V)
    if reason is None and W is not None and attrs.get("conv_kernel") not in (None, W):
        reason = f"field conv_kernel={attrs.get('conv_kernel')} does not match the tensors' {W}"
    return reason


SPEC = PluginSpec.of(SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims={},
                     notes="IPluginV3 aot and QDP aot_impl: the one fused kernel, for any N and B")
