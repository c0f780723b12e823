"""`k3::KDAPacked` TensorRT plugin: KDA over packed sequences with a slot-indexed state pool, over the launch
plan of `triton.py` (k3::KDA's kernels in packed mode).

    KDAPacked(q, k, v [N, H, K|V] fp32|fp16|bf16 (one dtype), g [N, H, K] fp32, beta [N, H] fp32,
              state_pool [S, H, K, V] fp32, cu_seqlens [B+1] int32, slots [B] int32; scale, num_heads,
              head_dim, value_dim, gate_lower_bound) -> (o [N, H, V] (v's dtype), final_state [B, H, K, V] fp32).
    LINEAR only. Ports, fields, output shapes and types: `SIGNATURE` (op.py).

Variants per runtime N and B (`triton.plan`): "recurrent" when no sequence can exceed RECURRENT_MAX_T rows,
else "mixed" (recurrent kernel on the short sequences, chunked pair on the long ones, intermediates in the
TensorRT workspace, sized for N rows). QDP `aot_impl` carries one kernel: the recurrent one over every
sequence (exact for any step, slow for long prefills) — use the IPluginV3 path for prefill engines.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec
from ..kda.plugin import check_dims
from . import triton as kt
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    q, k, v, g, beta, pool, cu, slots = (list(x) for x in shapes)
    ranks = [len(x) for x in (q, v, beta, pool, cu, slots)]
    if ranks != [3, 3, 2, 4, 1, 1]:
        return f"ranks q, v, beta, state_pool, cu_seqlens, slots {ranks}, expected [3, 3, 2, 4, 1, 1]"
    N, H, K = q
    V, B = v[2], slots[0]
    checks = [("k", k, q), ("g", g, q), ("v[:2]", v[:2], q[:2]), ("beta", beta, [N, H]),
              ("state_pool[1:]", pool[1:], [H, K, V]), ("cu_seqlens", cu, [None if B is None else B + 1])]
    return check_dims(checks, f"q {q}, v {v}, slots {slots}", attrs, H, K, V)


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims={"N": 1, "B": 1},
    notes="IPluginV3 aot: recurrent (every sequence <= 16 rows) or recurrent + chunked intra+state cubins; "
          "QDP aot_impl: recurrent only",
)
