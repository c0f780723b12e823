"""`k3::KDA` TensorRT plugin: Kimi Delta Attention over the launch plan of `triton.py`.

    KDA(q, k, v [B, T, H, K|V] fp32|fp16|bf16 (one dtype), g [B, T, H, K] fp32, beta [B, T, H] fp32,
        initial_state [B, H, K, V] fp32; scale, num_heads, head_dim, value_dim, gate_lower_bound) -> (o [B, T, H, V] (v's dtype),
        final_state [B, H, K, V] fp32).  LINEAR only.  Ports, fields, output shapes and types: `SIGNATURE` (op.py).

Kernels per runtime T, as the op runs them (`triton.plan`): T <= RECURRENT_MAX_T -> the recurrent kernel (one
launch, arguments already in QDP order: inputs, int32 scalars, outputs); above -> the chunked pair
`_kda_intra_kernel` + `_kda_state_kernel` with their intermediates in the TensorRT workspace. `scale` is
specialised into the code; block sizes come from the profile's opt shape, grids from the runtime B and T.
Paths: IPluginV3 "aot" runs both variants from embedded cubins; QDP `aot_impl` (TensorRT 11) can carry one
kernel only, so it embeds the recurrent kernel for every T (exact, but slow for long prefills) — use the
IPluginV3 path for prefill engines. "jit" runs the same plan with Triton's JIT.
"""

from __future__ import annotations

from ...plugins.core import PluginSpec, dims_match
from . import triton as kt
from .limits import KERNEL_HEAD_DIM
from .op import SIGNATURE


def check(shapes, attrs: dict) -> str | None:
    q, k, v, g, beta, s = (list(x) for x in shapes)
    if len(q) != 4 or len(v) != 4 or len(beta) != 3 or len(s) != 4:
        return f"ranks q {len(q)} v {len(v)} beta {len(beta)} initial_state {len(s)}, expected 4, 4, 3, 4"
    B, T, H, K = q
    V = v[3]
    checks = [("k", k, q), ("g", g, q), ("v[:3]", v[:3], q[:3]), ("beta", beta, [B, T, H]),
              ("initial_state", s, [B, H, K, V])]
    return check_dims(checks, f"q {q}, v {v}", attrs, H, K, V)


def check_dims(checks, context: str, attrs: dict, H, K, V) -> str | None:
    """Why the shapes fail (also k3::KDAPacked's check): the first (name, got, want) of `checks` that differs,
    a field num_heads / head_dim / value_dim other than H, K, V, or K, V outside the kernels' limits."""
    for name, got, want in checks:
        if not dims_match(got, want):
            return f"{name} has shape {got}, expected {want} (from {context})"
    for f, d in (("num_heads", H), ("head_dim", K), ("value_dim", V)):
        if not dims_match([attrs.get(f)], [d]):
            return f"field {f}={attrs.get(f)} does not match the tensors' {d}"
    lo, hi = KERNEL_HEAD_DIM
    if K is not None and V is not None and not (lo <= K <= hi and lo <= V <= hi):
        return f"needs {lo} <= K, V <= {hi} (Triton kernels), got K={K}, V={V}"
    return None


SPEC = PluginSpec.of(
    SIGNATURE, dims=kt.dims, check=check, plan=kt.plan, qdp_aot_dims={"T": 1},
    notes="IPluginV3 aot: recurrent (T<=16) or chunked intra+state (T>16) cubins; QDP aot_impl: recurrent only",
)
