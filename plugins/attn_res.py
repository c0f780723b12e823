"""`k3::AttnRes` plugin: the Block Attention Residuals mixer over `custom_ops/attn_res/triton.py`.

    AttnRes(prefix [..., d], bank [..., N, d] (prefix's dtype, fp32|fp16|bf16), norm_weight [d], proj_weight [d]
            (fp32|fp16|bf16 each); eps, hidden_size) -> out [..., d] (prefix's dtype).  LINEAR only.
    Output shape: `attn_res_output_shape` (custom_ops/attn_res/op.py).

One kernel, `_attn_res_kernel`, one program per token row (grid R = prod(prefix.shape[:-1])), with N, d and eps
specialised into the code, so its runtime arguments are (prefix, bank, norm_weight, proj_weight, out): already
QDP order. Paths: IPluginV3 "aot" and QDP `aot_impl` embed the same cubin; "jit" calls `triton.attn_res`.
"""

from __future__ import annotations

from ..custom_ops.attn_res import attn_res_output_shape
from ..custom_ops.attn_res import triton as kt
from .core import FLOAT, Launch, Plan, PluginSpec, Port, Variant, schema_fields


def dims(shapes) -> dict:
    prefix, bank = list(shapes[0]), list(shapes[1])
    R = 1
    for x in prefix[:-1]:
        R = x * R
    return {"R": R, "N": bank[-2], "d": prefix[-1]}


def _eq(a, b) -> bool:
    return a is None or b is None or a == b


def check(shapes, attrs: dict) -> str | None:
    prefix, bank, nw, pw = (list(x) for x in shapes)
    if len(bank) != len(prefix) + 1:
        return f"bank has rank {len(bank)}, expected prefix's rank + 1 = {len(prefix) + 1} ([..., N, d])"
    d, N = prefix[-1], bank[-2]
    want = prefix[:-1] + [N, d]
    if not all(_eq(a, b) for a, b in zip(bank, want)):
        return f"bank has shape {bank}, expected {want} (prefix {prefix})"
    for name, w in (("norm_weight", nw), ("proj_weight", pw)):
        if len(w) != 1 or not _eq(w[0], d):
            return f"{name} has shape {w}, expected [{d}]"
    if N is not None and not 1 <= N <= 15:
        return f"needs 1 <= N <= 15 bank entries (Triton kernel), got N={N}"
    if not _eq(attrs.get("hidden_size"), d):
        return f"field hidden_size={attrs.get('hidden_size')} does not match d={d}"
    return None


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    c = kt.attn_res_launch_config(max(int(d["R"]), 1), d["N"], d["d"])
    launch = Launch(kt._attn_res_kernel, ("prefix", "bank", "norm_weight", "proj_weight", "out"),
                    {"N": d["N"], "d": d["d"], "eps": float(attrs["eps"]), "NS": c["NS"], "BD": c["BD"]},
                    grid=lambda x: (x["R"], 1, 1), num_warps=c["num_warps"], num_stages=c["num_stages"])
    return Plan((Variant("rows", (launch,)),))


def jit(inputs, outputs, attrs: dict) -> None:
    outputs[0].copy_(kt.attn_res(*inputs, attrs["eps"]))


SPEC = PluginSpec(
    name="AttnRes",
    inputs=(Port("prefix", FLOAT), Port("bank", FLOAT, "prefix"), Port("norm_weight", FLOAT),
            Port("proj_weight", FLOAT)),
    outputs=(Port("out", FLOAT, "prefix"),),
    fields=schema_fields("AttnRes"),
    output_shapes=lambda s: [attn_res_output_shape(s[0])],
    output_dtypes=lambda t: [t[0]],
    dims=dims, check=check, plan=plan, jit=jit, qdp_aot=True,
    notes="IPluginV3 aot and QDP aot_impl: one cubin (_attn_res_kernel)",
)


def register_qdp(trtp, *, sm: int, opt_dims: dict) -> None:
    """TensorRT 11 QDP registration of `k3::AttnRes` (needs `tensorrt.plugin`)."""
    from . import qdp

    @trtp.register("k3::AttnRes")
    def _desc(prefix: trtp.TensorDesc, bank: trtp.TensorDesc, norm_weight: trtp.TensorDesc,
              proj_weight: trtp.TensorDesc, eps: float, hidden_size: int) -> trtp.TensorDesc:
        return qdp.output_descs(trtp, SPEC, [prefix, bank, norm_weight, proj_weight], {})

    @trtp.autotune("k3::AttnRes")
    def _tune(prefix, bank, norm_weight, proj_weight, outputs):
        return qdp.autotune(trtp, SPEC)

    @trtp.impl("k3::AttnRes")
    def _impl(prefix, bank, norm_weight, proj_weight, eps: float, hidden_size: int, outputs, stream: int) -> None:
        qdp.jit(SPEC, [prefix, bank, norm_weight, proj_weight], list(outputs), {"eps": eps}, stream)

    @trtp.aot_impl("k3::AttnRes")
    def _aot(prefix, bank, norm_weight, proj_weight, eps: float, hidden_size: int, outputs, tactic: int):
        return qdp.aot(trtp, SPEC, [prefix, bank, norm_weight, proj_weight], list(outputs),
                               {"eps": eps, "hidden_size": hidden_size}, sm, opt_dims)
