"""`k3::KDA` plugin: Kimi Delta Attention over the kernels of `custom_ops/kda/triton.py`.

    KDA(q, k, v [B, T, H, K|V] fp32|fp16|bf16 (one dtype), g [B, T, H, K] fp32, beta [B, T, H] fp32,
        initial_state [B, H, K, V] fp32; scale, num_heads, head_dim, value_dim) -> (o [B, T, H, V] (v's dtype),
        final_state [B, H, K, V] fp32).  LINEAR only.  Output shapes: `kda_output_shapes` (custom_ops/kda/op.py).

Kernels per runtime T, as the torch op does (`triton.kda`): T <= RECURRENT_MAX_T -> the recurrent kernel (one
launch, through `_kda_recurrent_qdp`, a wrapper that only reorders arguments into QDP order: inputs, int32
scalars, outputs); T > RECURRENT_MAX_T -> the chunked pair `_kda_intra_kernel` + `_kda_state_kernel` with
their intermediates (w, u, qg, kg, A, gl) in the TensorRT workspace. `scale` is specialised into the code.
Launch configs come from the kernel file's `kda_*_launch_config` at the profile's opt shape; grids are
recomputed from the runtime B and T.
Paths: IPluginV3 "aot" runs both variants from embedded cubins; QDP `aot_impl` (TensorRT 11) can carry one
kernel only, so it embeds the recurrent kernel for every T (exact, but slow for long prefills) — use the
IPluginV3 path for prefill engines. "jit" calls `triton.kda`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..custom_ops.kda import kda_output_shapes
from ..custom_ops.kda import triton as kt
from .core import FLOAT, Buffer, Launch, Plan, PluginSpec, Port, Variant, cdiv, schema_fields


@triton.jit
def _kda_recurrent_qdp(q, k, v, g, beta, h0, T, o, ht, scale, H: tl.constexpr, K: tl.constexpr,
                       V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, HAS_H0: tl.constexpr):
    kt._kda_recurrent_kernel(q, k, v, g, beta, h0, o, ht, T, scale, H, K, V, BK, BV, HAS_H0)


def dims(shapes) -> dict:
    (B, T, H, K), v = shapes[0], shapes[2]
    return {"B": B, "T": T, "H": H, "K": K, "V": v[3]}


def _eq(a, b) -> bool:
    return a is None or b is None or a == b


def check(shapes, attrs: dict) -> str | None:
    q, k, v, g, beta, s = (list(x) for x in shapes)
    if len(q) != 4 or len(v) != 4 or len(beta) != 3 or len(s) != 4:
        return f"ranks q {len(q)} v {len(v)} beta {len(beta)} initial_state {len(s)}, expected 4, 4, 3, 4"
    B, T, H, K = q
    V = v[3]
    checks = [("k", k, q), ("g", g, q), ("v[:3]", v[:3], q[:3]), ("beta", beta, [B, T, H]),
              ("initial_state", s, [B, H, K, V])]
    for name, got, want in checks:
        if len(got) != len(want) or not all(_eq(a, b) for a, b in zip(got, want)):
            return f"{name} has shape {got}, expected {want} (from q {q}, v {v})"
    for f, d in (("num_heads", H), ("head_dim", K), ("value_dim", V)):
        if not _eq(attrs.get(f), d):
            return f"field {f}={attrs.get(f)} does not match the tensors' {d}"
    if K is not None and V is not None and not (16 <= K <= 256 and 16 <= V <= 256):
        return f"needs 16 <= K, V <= 256 (Triton kernels), got K={K}, V={V}"
    return None


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    B, T, H, K, V = d["B"], d["T"], d["H"], d["K"], d["V"]
    scale = float(attrs["scale"])
    r = kt.kda_recurrent_launch_config(B, max(T, 1), H, K, V)
    recurrent = Launch(_kda_recurrent_qdp, ("q", "k", "v", "g", "beta", "initial_state", "T", "o", "final_state"),
                       {"scale": scale, "H": H, "K": K, "V": V, "BK": r["BK"], "BV": r["BV"], "HAS_H0": True},
                       grid=lambda x, BV=r["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=lambda x: {"T": x["T"]},
                       num_warps=r["num_warps"], num_stages=r["num_stages"])
    c = kt.kda_chunk_launch_config(B, max(T, kt.RECURRENT_MAX_T + 1), H, K, V)
    dot_bf16 = dtypes[0] == "bf16"
    idt = "bf16" if dot_bf16 else "fp32"  # dtype of the intermediates, as in triton.kda_chunked
    nt = lambda x: cdiv(x["T"], kt.BT)  # noqa: E731
    ws = (Buffer("w", idt, lambda x: x["B"] * x["T"] * H * K), Buffer("u", idt, lambda x: x["B"] * x["T"] * H * V),
          Buffer("qg", idt, lambda x: x["B"] * x["T"] * H * K), Buffer("kg", idt, lambda x: x["B"] * x["T"] * H * K),
          Buffer("A", idt, lambda x: x["B"] * x["T"] * H * kt.BT),
          Buffer("gl", "fp32", lambda x: x["B"] * nt(x) * H * K))
    ci, cs = c["intra"], c["state"]
    intra = Launch(kt._kda_intra_kernel, ("q", "k", "v", "g", "beta", "w", "u", "qg", "kg", "A", "gl", "T", "NT"),
                   {"scale": scale, "H": H, "K": K, "V": V, "BT": kt.BT, "BC": kt.BC, "BK": ci["BK"], "BV": ci["BV"],
                    "DOT_BF16": dot_bf16},
                   grid=lambda x: (nt(x), x["B"] * H, 1), scalars=lambda x: {"T": x["T"], "NT": nt(x)},
                   num_warps=ci["num_warps"], num_stages=ci["num_stages"])
    state = Launch(kt._kda_state_kernel, ("w", "u", "qg", "kg", "A", "gl", "initial_state", "o", "final_state", "T",
                                          "NT"),
                   {"H": H, "K": K, "V": V, "BT": kt.BT, "BK": cs["BK"], "BV": cs["BV"], "DOT_BF16": dot_bf16,
                    "HAS_H0": True},
                   grid=lambda x, BV=cs["BV"]: (cdiv(V, BV), x["B"] * H, 1), scalars=lambda x: {"T": x["T"], "NT": nt(x)},
                   num_warps=cs["num_warps"], num_stages=cs["num_stages"])
    return Plan((Variant("recurrent", (recurrent,), when=lambda x: x["T"] <= kt.RECURRENT_MAX_T),
                 Variant("chunked", (intra, state), when=lambda x: x["T"] > kt.RECURRENT_MAX_T)), workspace=ws)


def jit(inputs, outputs, attrs: dict) -> None:
    q, k, v, g, beta, s = inputs
    o, final = kt.kda(q, k, v, g, beta, scale=attrs["scale"], initial_state=s)
    outputs[0].copy_(o)
    outputs[1].copy_(final)


SPEC = PluginSpec(
    name="KDA",
    inputs=(Port("q", FLOAT), Port("k", FLOAT, "q"), Port("v", FLOAT, "q"), Port("g", ("fp32",)),
            Port("beta", ("fp32",)), Port("initial_state", ("fp32",))),
    outputs=(Port("o", FLOAT, "v"), Port("final_state", ("fp32",))),
    fields=schema_fields("KDA"),
    output_shapes=lambda s: list(kda_output_shapes(s[0], s[2])),
    output_dtypes=lambda t: [t[2], "fp32"],
    dims=dims, check=check, plan=plan, jit=jit, qdp_aot=True,
    notes="IPluginV3 aot: recurrent (T<=16) or chunked intra+state (T>16) cubins; QDP aot_impl: recurrent only",
)


def register_qdp(trtp, *, sm: int, opt_dims: dict) -> None:
    """TensorRT 11 QDP registration of `k3::KDA` (needs `tensorrt.plugin`)."""
    from typing import Tuple

    from . import qdp

    @trtp.register("k3::KDA")
    def _desc(q: trtp.TensorDesc, k: trtp.TensorDesc, v: trtp.TensorDesc, g: trtp.TensorDesc, beta: trtp.TensorDesc,
              initial_state: trtp.TensorDesc, scale: float, num_heads: int, head_dim: int,
              value_dim: int) -> Tuple[trtp.TensorDesc, trtp.TensorDesc]:
        return qdp.output_descs(trtp, SPEC, [q, k, v, g, beta, initial_state], {})

    @trtp.autotune("k3::KDA")
    def _tune(q, k, v, g, beta, initial_state, outputs):
        return qdp.autotune(trtp, SPEC)

    @trtp.impl("k3::KDA")
    def _impl(q, k, v, g, beta, initial_state, scale: float, num_heads: int, head_dim: int, value_dim: int,
              outputs, stream: int) -> None:
        qdp.jit(SPEC, [q, k, v, g, beta, initial_state], list(outputs), {"scale": scale}, stream)

    @trtp.aot_impl("k3::KDA")
    def _aot(q, k, v, g, beta, initial_state, scale: float, num_heads: int, head_dim: int, value_dim: int,
             outputs, tactic: int):
        return qdp.aot(trtp, SPEC, [q, k, v, g, beta, initial_state], list(outputs),
                               {"scale": scale}, sm, opt_dims | {"T": 1})
