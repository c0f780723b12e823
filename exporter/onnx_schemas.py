"""ONNX OpSchemas for the `k3` custom domain: `k3::KDA`, `k3::AttnRes`, `k3::MoE` (version 1).

This file is the one place that states each node's inputs, outputs and attributes. The TensorRT
plugins import `PLUGIN_FIELDS` (plugin field name -> ONNX attribute type, in declaration order), so a
node's attributes and a plugin creator's field list cannot drift apart.

Notable choices:
- Attributes carry the op's static hyper-parameters plus the static dims a plugin needs to size its
  workspace (`num_heads`, `head_dim`, ...). Booleans are INT (0/1): ONNX has no BOOL attribute.
- Every node also carries `plugin_namespace="k3"` (TensorRT's parser looks plugins up by op_type +
  namespace); it is not a plugin field, so it is in `COMMON_ATTRIBUTES`, not in `PLUGIN_FIELDS`.
- Tensors whose dtype may differ get their own type variable (norm weights are fp32 while projection
  weights are bf16; activations may differ from weights).
- Registration is idempotent and happens on import (the exporter needs the schemas before it emits
  nodes; `onnx.checker` needs them to check the model).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx.defs import OpSchema

DOMAIN = "k3"
VERSION = 1
PLUGIN_NAMESPACE = "k3"

AttrType = OpSchema.AttrType
FLOAT_TYPES = ["tensor(float)", "tensor(float16)", "tensor(bfloat16)"]


@dataclass(frozen=True)
class NodeSpec:
    """What one `k3::<op_type>` node looks like: formal inputs/outputs (name, type var) and attributes."""

    op_type: str
    inputs: tuple[tuple[str, str], ...]
    outputs: tuple[tuple[str, str], ...]
    fields: tuple[tuple[str, AttrType], ...]  # plugin fields = node attributes, in this order
    doc: str


KDA = NodeSpec(
    "KDA",
    inputs=(("q", "T"), ("k", "T"), ("v", "T"), ("g", "F"), ("beta", "F"), ("initial_state", "S")),
    outputs=(("o", "T"), ("final_state", "S")),
    fields=(("scale", AttrType.FLOAT), ("num_heads", AttrType.INT), ("head_dim", AttrType.INT),
            ("value_dim", AttrType.INT)),
    doc="Kimi Delta Attention (gated delta rule, per-key decay). q, k [B, T, H, K] L2-normalised; "
        "v [B, T, H, V]; g [B, T, H, K] log-decay; beta [B, T, H] post-sigmoid; initial_state [B, H, K, V] "
        "fp32 -> o [B, T, H, V], final_state [B, H, K, V] fp32. Same contract as torch.ops.k3.kda.",
)
ATTN_RES = NodeSpec(
    "AttnRes",
    inputs=(("prefix", "T"), ("bank", "T"), ("norm_weight", "N"), ("proj_weight", "W")),
    outputs=(("out", "T"),),
    fields=(("eps", AttrType.FLOAT), ("hidden_size", AttrType.INT)),
    doc="Block Attention Residuals mixer: prefix [..., d], bank [..., N, d], norm_weight [d], proj_weight [d] "
        "-> [..., d]; softmax over N + 1 RMS-normalised sources, in fp32. Same contract as torch.ops.k3.attn_res.",
)
MOE = NodeSpec(
    "MoE",
    inputs=(("x", "T"), ("z", "T"), ("gate_weight", "G"), ("gate_bias", "F"), ("w1", "W"), ("w3", "W"),
            ("w2", "W")),
    outputs=(("u", "T"),),
    fields=(("top_k", AttrType.INT), ("routed_scaling_factor", AttrType.FLOAT), ("renormalize", AttrType.INT),
            ("activation", AttrType.STRING), ("situ_beta", AttrType.FLOAT), ("situ_linear_beta", AttrType.FLOAT),
            ("num_experts", AttrType.INT), ("hidden_size", AttrType.INT), ("expert_dim", AttrType.INT),
            ("intermediate_size", AttrType.INT)),
    doc="Routed MoE: sigmoid router on x [N, d] (gate_weight [E, d]), top_k on scores + gate_bias [E], weights "
        "from unbiased scores (renormalised, x routed_scaling_factor); experts w1, w3 [E, I, L], w2 [E, L, I] on "
        "z [N, L] with SiTU-GLU or SiLU-GLU -> u [N, L]. Same contract as torch.ops.k3.moe.",
)

NODE_SPECS: dict[str, NodeSpec] = {s.op_type: s for s in (KDA, ATTN_RES, MOE)}

# plugin field lists, importable by the TensorRT plugins: op_type -> ((field, ONNX AttrType), ...)
PLUGIN_FIELDS: dict[str, tuple[tuple[str, AttrType], ...]] = {s.op_type: s.fields for s in NODE_SPECS.values()}
# attributes every k3 node carries in addition to its plugin fields
COMMON_ATTRIBUTES: dict[str, str] = {"plugin_namespace": PLUGIN_NAMESPACE}

_TYPE_VARS = {
    "T": (FLOAT_TYPES, "activations in the model dtype"),
    "F": (["tensor(float)"], "fp32 gates / routing bias"),
    "S": (["tensor(float)"], "fp32 recurrent state"),
    "W": (FLOAT_TYPES, "weights"),
    "N": (FLOAT_TYPES, "norm weights (fp32 in K3's precision plan, independent of W)"),
    "G": (FLOAT_TYPES, "router weights (independent of the expert weights)"),
}


def _schema(spec: NodeSpec) -> OpSchema:
    used = [v for v in _TYPE_VARS if any(t == v for _, t in spec.inputs + spec.outputs)]
    attrs = [OpSchema.Attribute(name, kind, "") for name, kind in spec.fields]
    attrs.append(OpSchema.Attribute("plugin_namespace", AttrType.STRING, "TensorRT plugin namespace"))
    return OpSchema(
        spec.op_type, DOMAIN, VERSION, doc=spec.doc,
        inputs=[OpSchema.FormalParameter(n, t) for n, t in spec.inputs],
        outputs=[OpSchema.FormalParameter(n, t) for n, t in spec.outputs],
        type_constraints=[(v, _TYPE_VARS[v][0], _TYPE_VARS[v][1]) for v in used],
        attributes=attrs,
    )


def register_schemas() -> None:
    """Register the k3 OpSchemas with onnx.defs (idempotent)."""
    for spec in NODE_SPECS.values():
        try:
            onnx.defs.get_schema(spec.op_type, VERSION, DOMAIN)
        except onnx.defs.SchemaError:
            onnx.defs.register_schema(_schema(spec))


register_schemas()
