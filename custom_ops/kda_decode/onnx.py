"""`k3::KDADecode` in ONNX: the node spec (= the TensorRT plugin's fields) and the torch.onnx translation of
`torch.ops.k3.kda_decode`.

No ONNX Runtime body: exported serving steps never contain this node. The step graph is traced once for
any packed step (dynamic N), so it keeps the general path (standard-op conv + k3::KDAPacked + norm); the
fused decode is chosen per step at run time by the eager step (model/serving.py), where N == B is a fact and
not a graph guard. A graph that does contain the node runs on the TensorRT plugin (plugin.py).
"""

from __future__ import annotations

import onnx

from ...plan.onnx_node import COMMON_ATTRIBUTES, NodeSpec, opset, static
from .op import SIGNATURE

NODE = NodeSpec.of(SIGNATURE)
NODE.register()  # onnx.checker and the exporter need the schema before any node is emitted


def translate(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool, slots, scale: float,
              eps: float, kernels: str, gate_lower_bound: float = 0.0):
    return opset().KDADecode(qkv, f, b, gate, conv_weight, A_log, dt_bias, norm_weight, conv_pool, state_pool, slots,
                             scale=float(scale), eps=float(eps), num_heads=static(f.shape[1], "kda heads"),
                             head_dim=static(f.shape[2], "kda head_dim"),
                             value_dim=static(gate.shape[2], "kda value_dim"),
                             conv_kernel=static(conv_weight.shape[1], "kda conv kernel"),
                             gate_lower_bound=float(gate_lower_bound), _outputs=3, **COMMON_ATTRIBUTES)


def function(opset_version: int, nodes: list) -> tuple[onnx.FunctionProto, dict[str, int]]:
    """No ONNX Runtime body (see the module docstring): a one-line error naming the node."""
    raise NotImplementedError("k3::KDADecode has no ONNX Runtime body: serving graphs use k3::KDAPacked; "
                              "run this node on the TensorRT plugin")
