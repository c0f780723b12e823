"""k3::kda_packed, Triton: k3::kda's kernels in their packed mode (VARLEN), their launch plan and the torch
launcher. No kernel of its own: `kda/triton.py` builds the launches (`recurrent_launch`,
`chunked_launches`). Never imports `reference.py`.

Packed mode: ports [N, H, *] hold B sequences end to end (cu_seqlens [B+1]); program b of a kernel reads
its sequence's first row and length from cu_seqlens, its initial state from state_pool row slots[b], and
writes final_state[b] (the pool is never written). Variants, chosen on the runtime dims:
  "recurrent": N <= B + RECURRENT_MAX_T - 1, so no sequence is longer than RECURRENT_MAX_T rows (decode
               steps, short appends): the recurrent kernel, every sequence.
  "mixed":     otherwise: the recurrent kernel on the sequences of <= RECURRENT_MAX_T rows (decode rows),
               then the chunked pair on the longer ones (prefill). The chunk grid is cdiv(N, 64) x B·H
               (sized for the longest possible sequence); programs past their sequence's chunks return.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ...plan.dtypes import dtype_name
from ...plan.launch import Plan, Variant, run
from ..kda.op import KERNEL_HEAD_DIM
from ..kda.triton import RECURRENT_MAX_T, chunked_launches, recurrent_launch, safe_gate


def dims(shapes) -> dict:
    """Named dims from the input shapes (q, k, v, g, beta, state_pool, cu_seqlens, slots)."""
    (N, H, K), v, slots = shapes[0], shapes[2], shapes[7]
    return {"N": N, "B": slots[0], "H": H, "K": K, "V": v[2]}


def all_short(x: dict) -> bool:
    """No sequence of the step can be longer than RECURRENT_MAX_T rows (each of the B has >= 1)."""
    return x["N"] <= x["B"] + RECURRENT_MAX_T - 1


def plan(d: dict, dtypes: list[str], attrs: dict) -> Plan:
    """The launches of k3::kda_packed at dims `d` (N, B, H, K, V). Ports: q, k, v, g, beta, state_pool,
    cu_seqlens, slots -> o, final_state."""
    everything = recurrent_launch(d, attrs, varlen=True, split=0)
    short = recurrent_launch(d, attrs, varlen=True, split=RECURRENT_MAX_T)
    intra, state, ws = chunked_launches(d, dtypes, attrs, varlen=True, split=RECURRENT_MAX_T)
    mixed = "mixed" if safe_gate(attrs.get("gate_lower_bound")) else "mixed-unbounded-gate"
    return Plan((Variant("recurrent", (everything,), when=all_short),
                 Variant(mixed, (short, intra, state), when=lambda x: not all_short(x))), workspace=ws)


def kda_packed(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, state_pool: Tensor, cu_seqlens: Tensor,
               slots: Tensor, *, scale: float | None = None,
               gate_lower_bound: float | None = None) -> tuple[Tensor, Tensor]:
    """Run `plan` with Triton's JIT: (o [N, H, V] in v's dtype, final_state [B, H, K, V] fp32)."""
    N, H, K = q.shape
    V, B = v.shape[-1], slots.shape[0]
    lo, hi = KERNEL_HEAD_DIM
    if not (lo <= K <= hi and lo <= V <= hi):
        raise ValueError(f"kda_packed (triton): needs {lo} <= K, V <= {hi}, got K={K}, V={V}")
    if state_pool.dtype != torch.float32:
        raise ValueError(f"kda_packed (triton): state_pool must be fp32, got {state_pool.dtype}")
    scale = K ** -0.5 if scale is None else float(scale)
    ports = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state_pool": state_pool,
             "cu_seqlens": cu_seqlens.to(torch.int32), "slots": slots.to(torch.int32)}
    ports = {n: x.contiguous() for n, x in ports.items()}
    ports["o"] = torch.empty(N, H, V, device=q.device, dtype=v.dtype)
    ports["final_state"] = torch.empty(B, H, K, V, device=q.device, dtype=torch.float32)
    d = dims([tuple(x.shape) for x in (q, k, v, g, beta, state_pool, cu_seqlens, slots)])
    p = plan(d, [dtype_name(q.dtype)], {"scale": scale, "gate_lower_bound": gate_lower_bound})
    run(p, ports, d)
    return ports["o"], ports["final_state"]
