"""`k3::kda` — schema, fake impl, shape rule, limits and the kernel dispatch. Torch-only; Triton is imported lazily.

    k3::kda(q, k, v, g, beta, initial_state, scale, kernels, gate_lower_bound) -> (o, final_state)
    q, k [B, T, H, K] (L2-normalised); v [B, T, H, V]; g [B, T, H, K] log-decay; beta [B, T, H];
    initial_state [B, H, K, V] fp32.  o [B, T, H, V] (v's dtype), final_state [B, H, K, V] fp32.
Same contract as `reference.kda_recurrent`. Prefill and decode are the same op: T is dynamic.
`gate_lower_bound` is the caller's promise that g >= it everywhere (K3's safe gate: -5); 0.0 means no bound
(one encoding for the op, the ONNX attribute and the TensorRT plugin field, since a real bound is < 0). The
Triton kernels pick the chunked variant compiled without the unbounded-gate fallback from it, on the host.
On CUDA the op runs the candidate `candidates.py` picks for its shape class (own kernels, their launch entries,
fla-core's where a table measured on this GPU kind says so); the graph holds one node whichever runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ...plan.kernels import Kernels, require_kernels
from ...plan.signature import KERNELS, Attr, Signature, TensorPort
from . import reference
from .limits import KERNEL_HEAD_DIM


def check_config(cfg, *, kernels: bool) -> str | None:
    """Why k3::kda cannot run `cfg` (None if it can); `kernels`: also the Triton kernel limits."""
    lo, hi = KERNEL_HEAD_DIM
    d = cfg.kda.head_dim
    if not 0 < d <= hi:
        return f"kda.head_dim={d}: k3::kda supports head_dim <= {hi}"
    if kernels and d < lo:
        return f"kda.head_dim={d}: the Triton k3::kda kernels (and the TensorRT plugin) need head_dim >= {lo}"
    return None


def kda_output_shapes(q_shape, v_shape):
    """One shape rule for the fake impl and the TensorRT plugin: dims in, dims out (only + * //)."""
    B, T, H, K = q_shape
    V = v_shape[3]
    return (B, T, H, V), (B, H, K, V)


SIGNATURE = Signature(
    "kda", "KDA",
    inputs=(TensorPort("q", "T"), TensorPort("k", "T", "q"), TensorPort("v", "T", "q"), TensorPort("g", "F"), TensorPort("beta", "F"),
            TensorPort("initial_state", "S")),
    outputs=(TensorPort("o", "T", "v"), TensorPort("final_state", "S")),
    attrs=(Attr("scale", float), Attr("num_heads", int, op=False), Attr("head_dim", int, op=False),
           Attr("value_dim", int, op=False), KERNELS, Attr("gate_lower_bound", float, 0.0)),
    shapes=lambda s: kda_output_shapes(s[0], s[2]),
    doc="Kimi Delta Attention (gated delta rule, per-key decay). q, k [B, T, H, K] L2-normalised; "
        "v [B, T, H, V]; g [B, T, H, K] log-decay; beta [B, T, H] post-sigmoid; initial_state [B, H, K, V] "
        "fp32 -> o [B, T, H, V], final_state [B, H, K, V] fp32. Same contract as torch.ops.k3.kda. "
        "gate_lower_bound: g >= it everywhere (0 = no bound); selects the kernel, not the math.",
)


@SIGNATURE.define
def _kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, scale: float,
         kernels: str, gate_lower_bound: float = 0.0) -> tuple[Tensor, Tensor]:
    if require_kernels("k3::kda", kernels, q, k, v, g, beta, initial_state) is Kernels.TRITON:
        from . import candidates  # the candidate picked for this shape class (custom_ops/dispatch.py)

        return candidates.kda(q, k, v, g, beta, scale, initial_state, gate_lower_bound or None)
    if q.shape[1] == 1:
        return reference.kda_recurrent(q, k, v, g, beta, scale=scale, initial_state=initial_state)
    return reference.kda_chunked(q, k, v, g, beta, scale=scale, initial_state=initial_state)


@dataclass
class KDAOutput:
    output: Tensor  # [B, T, H, V]
    final_state: Tensor  # [B, H, K, V] fp32


def kda(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor, *,
        scale: float | None = None, kernels: Kernels = Kernels.REFERENCE,
        gate_lower_bound: float | None = None) -> KDAOutput:
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    lb = 0.0 if gate_lower_bound is None else float(gate_lower_bound)
    o, s = torch.ops.k3.kda(q, k, v, g, beta, initial_state, scale, Kernels(kernels).value, lb)
    return KDAOutput(o, s)
