"""`k3::AttnRes` TensorRT plugin: the Block Attention Residuals mixer over the launch plan of `triton.py`.

    AttnRes(prefix [..., d], bank [..., N, d] (prefix's dtype, fp32|fp16|bf16), norm_weight [d], proj_weight [d]
            (fp32|fp16|bf16 each); eps, hidden_size) -> out [..., d] (prefix's dtype).  LINEAR only.
    Output shape: `attn_res_output_shape` (op.py).

One kernel, one program per token row (grid R = prod(prefix.shape[:-1])), N, d and eps specialised into the
code. Paths: IPluginV3 "aot" and QDP `aot_impl` embed the same cubin; "jit" runs the plan with Triton's JIT.
"""

from __future__ import annotations

from ...plugins.core import FLOAT, PluginSpec, Port, dims_match, fields_of
from . import triton as kt
from .onnx import NODE
from .op import KERNEL_MAX_BANK, attn_res_output_shape


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


SPEC = PluginSpec(
    name=NODE.op_type,
    inputs=(Port("prefix", FLOAT), Port("bank", FLOAT, "prefix"), Port("norm_weight", FLOAT),
            Port("proj_weight", FLOAT)),
    outputs=(Port("out", FLOAT, "prefix"),),
    fields=fields_of(NODE),
    output_shapes=lambda s: [attn_res_output_shape(s[0])],
    output_dtypes=lambda t: [t[0]],
    dims=kt.dims, check=check, plan=kt.plan, qdp_aot=True,
    notes="IPluginV3 aot and QDP aot_impl: one cubin (_attn_res_kernel)",
)


def register_qdp(trtp, *, sm: int, opt_dims: dict) -> None:
    """TensorRT 11 QDP registration of `k3::AttnRes` (needs `tensorrt.plugin`)."""
    from ...plugins import qdp

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
