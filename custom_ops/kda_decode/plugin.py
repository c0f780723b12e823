"""`k3::KDADecode` TensorRT plugin: the fused KDA decode step over the launch plan of `triton.py` (one kernel).

    KDADecode(qkv [B, C], f [B, H, K], b [B, H], gate [B, H, V] (one float dtype), conv_weight [C, W],
              A_log [>=H] fp32, dt_bias [H*K] fp32, norm_weight [V] fp32, conv_pool [S, C, W-1] fp32,
              state_pool [S, H, K, V] fp32, slots [B] int32; scale, eps, num_heads, head_dim, value_dim,
              conv_kernel, gate_lower_bound) -> (o [B, H, V], new_conv [B, C, W-1] fp32, new_state [B, H, K, V] fp32).
    LINEAR only; pure (the pools are inputs, never written). Ports, fields, output shapes and types:
    `SIGNATURE` (op.py). Block sizes from the profile's opt B; the grid follows the runtime B.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec
from ..kda.plugin import check_dims
from . import triton as kt
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    qkv, f, b, gate, w, a, dt, nw, conv, pool, slots = (list(x) for x in shapes)
    ranks = [len(x) for x in (qkv, f, b, gate, w, conv, pool, slots)]
    if ranks != [2, 3, 2, 3, 2, 3, 4, 1]:
        return (f"ranks qkv, f, b, gate, conv_weight, conv_pool, state_pool, slots {ranks}, "
                "expected [2, 3, 2, 3, 2, 3, 4, 1]")
    B, H, K = f
    V, W = gate[2], w[1]
    C = None if None in (H, K, V) else 2 * H * K + H * V
    checks = [("qkv", qkv, [B, C]), ("b", b, [B, H]), ("gate[:2]", gate[:2], [B, H]), ("conv_weight", w, [C, W]),
              ("dt_bias", dt, [None if None in (H, K) else H * K]), ("norm_weight", nw, [V]),
              ("conv_pool[1:]", conv[1:], [C, None if W is None else W - 1]), ("state_pool[1:]", pool[1:], [H, K, V]),
              ("slots", slots, [B])]
    reason = check_dims(checks, f"f {f}, gate {gate}", attrs, H, K, V)
    if reason is None and W is not None and attrs.get("conv_kernel") not in (None, W):
        reason = f"field conv_kernel={attrs.get('conv_kernel')} does not match the tensors' {W}"
    return reason


SPEC = PluginSpec.of(SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims={"B": 1},
                     notes="IPluginV3 aot and QDP aot_impl: the one fused kernel")
