"""`k3::MLAPaged` TensorRT plugin: absorbed MLA attention over a paged latent pool, over the launch plan of
`triton.py`.

    MLAPaged(q_latent [N, H, C], q_rope [N, H, R], latent [N, C+R], latent_pool [NB, BS, C+R] (one dtype,
             fp32|fp16|bf16), block_table [B, MB], past_lens [B], cu_seqlens [B+1] (int32); scale, num_heads,
             kv_lora_rank, rope_dim, block_size) -> o [N, H, C] (q_latent's dtype).  LINEAR only.
    Ports, fields, output shape and type: `SIGNATURE` (op.py).

Two variants by the runtime dims (`triton.plan`): `decode` when every sequence brings one token (N == B):
split over keys, then a combine, the partials in the TensorRT workspace; else `rows`, one kernel. The pool is
an input the plugin only reads (TensorRT may alias it with the runtime's buffer). Paths: IPluginV3 "aot"
embeds the cubins (`rows` always, `decode`'s two when a profile point has N == B, as the min point (1, 1)
does); QDP has no `aot_impl` (one kernel, no workspace), so QDP runs the plan with Triton's JIT.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec, dims_match
from . import triton as kt
from .limits import KERNEL_MAX_LATENT
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    ql, qr, lat, pool, table, past, cu = (list(x) for x in shapes)
    ranks = [len(x) for x in (ql, qr, lat, pool, table, past, cu)]
    if ranks != [3, 3, 2, 3, 2, 1, 1]:
        return f"ranks {ranks}, expected [3, 3, 2, 3, 2, 1, 1] (q_latent .. cu_seqlens)"
    N, H, C = ql
    R = qr[2]
    L = None if C is None or R is None else C + R
    B = table[0]
    checks = [("q_rope", qr[:2], [N, H]), ("latent", lat, [N, L]), ("latent_pool", pool[2:], [L]),
              ("past_lens", past, [B]), ("cu_seqlens", cu, [None if B is None else B + 1])]
    for name, got, want in checks:
        if not dims_match(got, want):
            return f"{name} has shape {got}, expected {want} (from q_latent {ql}, q_rope {qr}, block_table {table})"
    for f, d in (("num_heads", H), ("kv_lora_rank", C), ("rope_dim", R), ("block_size", pool[1])):
        if not dims_match([attrs.get(f)], [d]):
            return f"field {f}={attrs.get(f)} does not match the tensors' {d}"
    if L is not None and L > KERNEL_MAX_LATENT:
        return f"needs kv_lora_rank + rope_dim <= {KERNEL_MAX_LATENT} (Triton kernel), got {L}"
    return None


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims=None,
    notes="IPluginV3 aot: rows kernel, decode split + combine kernels (workspace); QDP: jit only",
)
